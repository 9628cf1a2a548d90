"""The embedded backend's decode tokens/s at batch 8, 32 and 64 against this machine's roofline.

    python bench/decode_roofline.py                  # --batches 8,32,64 --prompt 64 --new 64
    python bench/decode_roofline.py --threads 2
    python bench/decode_roofline.py --dtype bf16     # served in bf16 (train.py --serve-dtype bf16)
    python bench/decode_roofline.py --smoke          # --batches 2,4 --new 4, small probes: for the tests

The roofline of one decode step (every sequence of the batch adds one token) is the larger of two times:
its FLOPs over the machine's matmul throughput, and the bytes it must read over the machine's memory
bandwidth. Both ceilings are measured here, first: a large fp32 matmul (2 n^3 FLOPs, best of several),
and a large tensor copy (it reads and writes each byte: 2 x its size, best of several). What one step
needs is computed from the model's shapes (SmolLM2-135M in fp32): FLOPs, 2 per weight of every linear
layer (the tied LM head included) per sequence, plus attention's 4 x heads x head_dim per layer per
cached position; bytes, every linear layer's weights once (whatever the batch) plus each sequence's KV
cache (2 x KV heads x head_dim x 4 bytes per layer per position), at the batch's mean context. The
roofline's tokens/s is the batch over that time; "of roofline" is the measured tokens/s over it.
Under --dtype bf16 the model is served as train.py --serve-dtype bf16 serves it: fp32 weights, every
forward under bf16 autocast (each weight read in fp32 and cast), the KV cache in bf16 (2 bytes a
value); the matmul probe runs in bf16, so a CPU without native bf16 matmuls (AVX512-BF16 or AMX)
shows it there.

The decode itself is decode_speed.py's measurement (the backend's on_token stamps, prefill left out)
with ``batch`` requests at once through HFBackend and extras/fast_decode.py, as train.py serves a
step's rollouts: each request a different raw-prose prompt of --prompt tokens (no chat template, so an
early EOS is unlikely; the tokens counted are the ones generated), --new tokens each. Decode tokens/s
counts the tokens stamped after the last request's first token, over the time from there to the last
token. Run it on a quiet machine: a second process on the cores halves any number here.
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
from bench.decode_speed import TEXT  # noqa: E402
from lightning_lite.backends import HFBackend  # noqa: E402
from lightning_lite.chat import Sampling  # noqa: E402
from lightning_lite.models import load_model, load_tokenizer  # noqa: E402

# The defaults --smoke sets (tests/test_bench.py runs it): seconds on a CPU.
SMOKE = {"batches": "2,4", "prompt": 16, "new": 4, "matmul": 512, "copy_mb": 64}


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n by n x n matmul in ``dtype`` (2 n^3 FLOPs), the best of 5."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=out), 5)


def copy_bandwidth(mb: int) -> float:
    """Bytes/s of copying an ``mb`` MB fp32 tensor into another: it reads and writes each byte."""
    src = torch.randn(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), 5)


def step_cost(model, batch: int, context: float, kv_value_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of ``batch`` sequences at a mean ``context`` of cached
    positions: every linear layer's weights (the tied LM head once, read in fp32) and each
    sequence's KV cache (``kv_value_bytes`` a value: 4 in fp32, 2 under bf16 autocast)."""
    config = model.config
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = config.num_key_value_heads
    # QK^T and the weighted sum of V: 2 FLOPs each per query head, head_dim and cached position
    attention = 4 * layers * heads * head_dim * context
    flops = batch * (2 * weights + attention)
    kv_bytes = batch * layers * 2 * kv_heads * head_dim * kv_value_bytes * context
    return flops, weights * 4 + kv_bytes


async def decode(backend, prompts: list[list[int]], new: int) -> tuple[float, int]:
    """All ``prompts`` at once: (decode tokens/s after the last first token, tokens generated)."""
    stamps = [[] for _ in prompts]

    def one(i):
        return backend.generate(
            prompts[i],
            Sampling(max_tokens=new, temperature=1.0, seed=i),
            on_token=lambda t: stamps[i].append(time.perf_counter()),
        )

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    start = max(s[0] for s in stamps)
    end = max(s[-1] for s in stamps)
    after = sum(1 for s in stamps for t in s if t > start)
    return after / (end - start), sum(len(s) for s in stamps)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="8,32,64", help="requests decoded together")
    ap.add_argument("--prompt", type=int, default=64, help="tokens in each prompt")
    ap.add_argument("--new", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--matmul", type=int, default=2048, help="n of the n x n matmul probe")
    ap.add_argument("--copy-mb", type=int, default=512, help="MB of the copy probe")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the served dtype")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds, for the tests: numbers mean nothing"
    )
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    peak_flops = matmul_flops(a.matmul, dtype)
    bandwidth = copy_bandwidth(a.copy_mb)
    print(
        f"{torch.get_num_threads()} torch threads; measured: {a.dtype} matmul ({a.matmul}^2) "
        f"{peak_flops / 1e9:.1f} GFLOP/s, copy ({a.copy_mb} MB) {bandwidth / 1e9:.1f} GB/s"
    )
    tok = load_tokenizer("smollm2")
    model = load_model("smollm2").eval()
    backend = HFBackend(model, tok, max_batch_size=max(batches), dtype=dtype)
    words = tok.encode(TEXT * (a.prompt // 30 + 2), add_special_tokens=False)
    # A warm-up: the first forward pays for allocations and kernels' choices.
    asyncio.run(decode(backend, [words[: a.prompt]], 4))
    print(
        "| batch | decode tok/s | roofline tok/s | of roofline | bound by | GFLOP/step | MB/step "
        "| tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        # A different first token each: no prefix-cache hit, as distinct tasks' prompts.
        prompts = [[(i * 37) % 997 + 3] + words[1 : a.prompt] for i in range(batch)]
        got, n = asyncio.run(decode(backend, prompts, a.new))
        flops, nbytes = step_cost(model, batch, a.prompt + a.new / 2, dtype.itemsize)
        compute_s, memory_s = flops / peak_flops, nbytes / bandwidth
        roof = batch / max(compute_s, memory_s)
        bound = "compute" if compute_s >= memory_s else "memory"
        print(
            f"| {batch} | {got:.1f} | {roof:.1f} | {got / roof:.2f} | {bound} | {flops / 1e9:.2f} "
            f"| {nbytes / 2**20:.0f} | {n} |",
            flush=True,
        )
    backend.close()


if __name__ == "__main__":
    main()
