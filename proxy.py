"""Serve the policy model behind an OpenAI-compatible endpoint and record every call, no training.

    python proxy.py --model smollm2 --port 8000 --out runs/proxy

Point any harness at http://127.0.0.1:8000/rollout/<rollout_id>/v1 (or plain /v1: rollout
"default"). Every answered call is appended to OUT/calls.jsonl, and every reward POSTed to
/rollout/<id>/reward (a rollout's, or one call's with "call") to OUT/rewards.jsonl. To train on
them:

    python train.py --from-calls OUT

or to turn them into training samples:

    python -m lightning_lite.samples OUT/calls.jsonl --out OUT/samples.jsonl

Ctrl-C stops it cleanly.
"""

import argparse
import json
import logging
import os

import torch
from aiohttp import web

from lightning_lite import hooks
from lightning_lite.backends import HFBackend
from lightning_lite.models import load_model, load_tokenizer
from lightning_lite.proxy import Proxy
from lightning_lite.toolcalls import format_names

# The extras this script serves with, each lightning_lite/extras/NAME.py: it fills its hooks when
# loaded (hooks.py), before the flags are parsed, and one whose file is missing is left out. Without
# any: chat completions of Hermes-format models, forced calls unconstrained, and no --vllm-url.
PROXY_EXTRAS = [
    "responses",
    "anthropic",
    "completions",
    "tool_formats",
    "grammar",
    "fast_decode",
    "embedded",
    "vllm",
]


def parse_args(extras: dict) -> argparse.Namespace:
    """The flags; ``extras``: the extras loaded, by name (--tool-format's choices are theirs
    too)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    add = parser.add_argument
    add("--model", default="smollm2", help="'smollm2' (embedded) or a transformers model directory")
    add("--host", default="127.0.0.1", help="bind address; any but loopback needs --api-key")
    add("--api-key", default=os.environ.get("LL_API_KEY"), help="clients must send it; $LL_API_KEY")
    add("--port", type=int, default=8000)
    add("--out", default="runs/proxy", help="calls are appended to OUT/calls.jsonl")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--max-batch-size", type=int, default=32, help="requests decoded together")
    add("--max-model-len", type=int, help="context limit (default: the model's; beyond: YaRN)")
    add("--max-new-tokens", type=int, help="the most tokens a call generates (default: no cap)")
    add("--call-timeout", type=float, help="seconds per call before the client gets a 504")
    add("--max-requests", type=int, default=1024, help="requests handled at once; more get 429")
    add("--vllm-url", nargs="+", metavar="URL", help="serve from these vLLM servers (same model)")
    add("--no-reuse-tokens", action="store_true", help="render every prompt fresh (a bench only)")
    add("--tool-format", choices=format_names(), help="tool-call format (default: the template's)")
    add("--keep-history-tokens", action="store_true", help="reuse turns the template re-renders")
    args = parser.parse_args()
    if args.vllm_url and "vllm" not in extras:
        parser.error(hooks.missing("--vllm-url", "vllm"))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        message = f"--host {args.host} exposes the model beyond this machine: "
        parser.error(message + "set --api-key (or LL_API_KEY) too")
    # which model the calls in OUT are of: train.py --from-calls trains only on its own model's
    meta = os.path.join(args.out, "proxy.json")
    if os.path.exists(meta):
        recorded = json.load(open(meta)).get("model")
        if recorded != args.model:
            message = f"{args.out} holds calls of model {recorded!r}, not {args.model!r}: "
            parser.error(message + "record into another --out")
    return args


def main():
    loaded = hooks.load_extras(PROXY_EXTRAS)
    extras = {module.__name__.rsplit(".", 1)[-1]: module for module in loaded}
    args = parse_args(extras)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"model": args.model}, open(os.path.join(args.out, "proxy.json"), "w"))
    tok = load_tokenizer(args.model)
    if args.vllm_url:
        backend = extras["vllm"].VLLMBackend(
            args.vllm_url, sync_dir=os.path.join(args.out, "weights")
        )
    else:
        model = load_model(args.model, args.device, max_model_len=args.max_model_len).eval()
        backend = HFBackend(model, tok, args.max_batch_size, max_model_len=args.max_model_len)
    proxy = Proxy(
        backend,
        tok,
        model_name=args.model,
        out_dir=args.out,
        reuse_tokens=not args.no_reuse_tokens,
        max_new_tokens=args.max_new_tokens,
        call_timeout=args.call_timeout,
        api_key=args.api_key,
        max_requests=args.max_requests,
        tool_format=args.tool_format,
        keep_history_tokens=args.keep_history_tokens,
    )
    print(proxy.renderer.describe(), flush=True)
    url = f"http://{args.host}:{args.port}"
    where = f"{url}/v1 (per rollout: /rollout/<id>/v1); recording to {args.out}/calls.jsonl"
    print(f"serving {args.model} on {where}", flush=True)
    try:
        # handler_cancellation: a client that leaves cancels its call; shutdown_timeout: on
        # SIGTERM/SIGINT, calls still generating get 2 s to finish, then are cancelled (every
        # answered call is on disk already)
        options = dict(print=None, access_log=None, handler_cancellation=True, shutdown_timeout=2)
        web.run_app(proxy.app(), host=args.host, port=args.port, **options)
    finally:
        backend.close()
        print(f"stopped; calls are in {args.out}/calls.jsonl", flush=True)


if __name__ == "__main__":
    main()
