"""LoRA against full training on the embedded model, in one run: the same train.py steps (calc, same seed) once
full and once with --lora RANK, each in its own process. Per mode: trainable parameters, mean seconds of the
training phase (t_train) over the steps after the first, the process's peak resident memory, the mean reward, and
the seconds a weight sync copies into a served copy (backends.copy_weights, what --async and FSDP do each step;
without them the embedded backend serves the trained module itself and a sync copies nothing).

    python bench/lora.py                        # --steps 4 --lora 16

Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# train.py in a child that reports its peak resident memory (KB on Linux) on its last line
RUN = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)"
)


def params_and_copy(rank):
    """(trainable, all) parameters of the embedded model, whole or with rank-``rank`` adapters, and the
    fastest of 5 weight syncs into a served copy of it."""
    from lightning_lite.backends import copy_weights
    from lightning_lite.extras import lora
    from lightning_lite.models import load_model

    flags = argparse.Namespace(lora=rank, lora_alpha=None, lora_targets=None)
    trained, served = (load_model("smollm2") for _ in range(2))
    if rank:
        trained, served = lora.wrap(trained, flags), lora.wrap(served, flags)
    seconds = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy_weights(trained, served)
        seconds.append(time.perf_counter() - t0)
    params = list(trained.parameters())
    n = sum(p.numel() for p in params if p.requires_grad)
    return n, sum(p.numel() for p in params), min(seconds)


def run(out, steps, extra):
    args = [sys.executable, "train.py", "--harness", "calc", "--harness-arg", "max_tokens=32"]
    args += ["--harness-arg", "tool_first=False", "--batch-size", "4", "--group-size", "4"]
    args += ["--eval-tasks", "0", "--steps", str(steps), "--out", out, *extra]
    p = subprocess.run([sys.executable, "-c", RUN, *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "t_train" in r]
    later = rows[1:] or rows
    mean = lambda k: sum(r[k] for r in later) / len(later)  # noqa: E731
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    peak_gb = int(p.stdout.strip().splitlines()[-1]) / 2**20
    return mean("t_train"), peak_gb, sum(rewards) / max(len(rewards), 1)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lora", type=int, default=16, help="the adapters' rank")
    ap.add_argument("--lr", type=float, default=1e-5, help="full training's; LoRA's is 10x")
    a = ap.parse_args()
    print("| mode | trainable / all params | t_train s | sync copy s | peak RSS GB | reward |")
    print("|---|---|---|---|---|---|")
    for name, flags, rank in [
        ("full", ["--lr", str(a.lr)], 0),
        (f"--lora {a.lora}", ["--lr", str(10 * a.lr), "--lora", str(a.lora)], a.lora),
    ]:
        n, total, copy = params_and_copy(rank)
        with tempfile.TemporaryDirectory() as out:
            t_train, peak, reward = run(out, a.steps, flags)
        print(
            f"| {name} | {n:,} / {total:,} ({n / total:.2%}) | {t_train:.2f} | {copy:.3f} | "
            f"{peak:.2f} | {reward:.3f} |"
        )


if __name__ == "__main__":
    main()
