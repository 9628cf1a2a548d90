"""Serve the policy model behind an OpenAI-compatible endpoint and record every call, without training.

    python proxy.py --model smollm2 --port 8000 --out runs/proxy

Point any harness at http://127.0.0.1:8000/rollout/<rollout_id>/v1 (or plain /v1: rollout "default").
Every answered call is appended to OUT/calls.jsonl, and every reward POSTed to /rollout/<id>/reward (a
rollout's, or one call's with "call") to OUT/rewards.jsonl; `python train.py --from-calls OUT` trains on them,
`python -m lightning_lite.samples OUT/calls.jsonl --out OUT/samples.jsonl` turns them into training samples.
Ctrl-C stops it cleanly.
"""

import argparse
import json
import logging
import os

import torch
from aiohttp import web

from lightning_lite.backends import HFBackend
from lightning_lite.extras.vllm import VLLMBackend
from lightning_lite.models import load_model, load_tokenizer
from lightning_lite.proxy import Proxy
from lightning_lite.toolcalls import FORMATS


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded, no download) or a transformers model directory",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default loopback only; any other needs --api-key)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("LL_API_KEY"),
        help="key every request must carry (Bearer or x-api-key; default: $LL_API_KEY)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="runs/proxy", help="calls are appended to OUT/calls.jsonl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context limit (default: the model's); beyond what it was trained for, RoPE is scaled (YaRN)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="the most tokens one call may generate, whatever the request asks (default: no cap)",
    )
    p.add_argument(
        "--call-timeout",
        type=float,
        default=None,
        help="seconds the model gets per call before the client gets a 504 (default: none)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=1024,
        help="requests handled at once; more get 429 with Retry-After",
    )
    p.add_argument(
        "--vllm-url",
        nargs="+",
        default=None,
        metavar="URL",
        help="serve from these vLLM servers (same model as --model, for its tokenizer) instead of the embedded backend",
    )
    p.add_argument(
        "--no-reuse-tokens",
        action="store_true",
        help="render every prompt fresh instead of reusing sampled tokens (for comparison)",
    )
    p.add_argument(
        "--tool-format",
        default=None,
        choices=FORMATS,
        help="the model family's tool-call format (default: detected from the chat template)",
    )
    p.add_argument(
        "--keep-history-tokens",
        action="store_true",
        help="where the chat template renders an earlier turn otherwise than it was sampled "
        "(reasoning stripped, calls re-serialized), keep the sampled tokens (one sample per rollout) instead of the template's rendering",
    )
    a = p.parse_args()
    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.api_key:
        p.error(
            f"--host {a.host} exposes the model beyond this machine: set --api-key (or LL_API_KEY) too"
        )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # which model the calls in OUT are of: train.py --from-calls trains only on its own model's (README)
    meta = os.path.join(a.out, "proxy.json")
    if os.path.exists(meta) and (was := json.load(open(meta)).get("model")) != a.model:
        p.error(f"{a.out} holds calls of model {was!r}, not {a.model!r}: record into another --out")
    os.makedirs(a.out, exist_ok=True)
    json.dump({"model": a.model}, open(meta, "w"))
    tok = load_tokenizer(a.model)
    if a.vllm_url:
        backend = VLLMBackend(a.vllm_url, sync_dir=os.path.join(a.out, "weights"))
    else:
        backend = HFBackend(
            load_model(a.model, a.device, max_model_len=a.max_model_len).eval(),
            tok,
            max_batch_size=a.max_batch_size,
            max_model_len=a.max_model_len,
        )
    proxy = Proxy(
        backend,
        tok,
        model_name=a.model,
        out_dir=a.out,
        reuse_tokens=not a.no_reuse_tokens,
        max_new_tokens=a.max_new_tokens,
        call_timeout=a.call_timeout,
        api_key=a.api_key,
        max_requests=a.max_requests,
        tool_format=a.tool_format,
        keep_history_tokens=a.keep_history_tokens,
    )
    print(proxy.renderer.describe(), flush=True)
    print(
        f"serving {a.model} on http://{a.host}:{a.port}/v1 (per rollout: /rollout/<id>/v1); recording to {a.out}/calls.jsonl",
        flush=True,
    )
    try:
        # handler_cancellation: a client that leaves cancels its call; shutdown_timeout: on SIGTERM/SIGINT, calls
        # still generating get 2 s to finish, then are cancelled (every answered call is already on disk)
        web.run_app(
            proxy.app(),
            host=a.host,
            port=a.port,
            print=None,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=2,
        )
    finally:
        backend.close()
        print(f"stopped; calls are in {a.out}/calls.jsonl", flush=True)


if __name__ == "__main__":
    main()
