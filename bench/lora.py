"""LoRA on the embedded model, two tables.

1. Against full training: the same train.py steps (calc, same seed) once full and once with --lora RANK,
   each in its own process. Per mode: trainable parameters, mean seconds of the training phase (t_train)
   over the steps after the first, the process's peak resident memory, the mean reward, and the seconds a
   weight sync copies into a served copy (backends.copy_weights of what AdamW trains, what --async and FSDP
   do each step; without them the embedded backend serves the trained module itself and copies nothing).
2. An adapter per harness (--lora-per-harness), 2 and 4 harnesses: one update of every adapter as
   ``lora.LoRA.update`` trains them (one backward pass, one AdamW step) against the loop of one full update
   per harness it replaced, on the same synthetic samples (per harness: --groups groups of 8 rollouts, a
   shared --prompt-tokens prompt and --reply-tokens sampled tokens each). Median seconds over --repeat
   updates after a warm-up, and the largest difference of the adapters' new weights between the two.

    python bench/lora.py                        # --steps 4 --lora 16; 2 and 4 harnesses
    python bench/lora.py --smoke                # a few seconds' run of every code path: numbers mean nothing

Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# --model smollm2 by name needs the embedded-model extra (train.py and proxy.py load it too).
import lightning_lite.extras.embedded  # noqa: E402, F401

# the trainer's CPU attention, as train.py's (extras/fast_decode.py: block_sdpa)
import lightning_lite.extras.fast_decode  # noqa: E402, F401

# The defaults --smoke sets (tests/test_bench.py runs it): a minute or two on a CPU.
SMOKE = dict(steps=1, batch_size=1, max_tokens=8, lora=4, harnesses="2", groups=1, copies=1)
SMOKE |= dict(prompt_tokens=8, reply_tokens=4, repeat=1)

# train.py in a child that reports its peak resident memory (KB on Linux) on its last line
RUN = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)"
)


def lora_flags(rank, names=None, **kw) -> argparse.Namespace:
    """train.py's flags that extras/lora.py and trainer.Learner read, at train.py's defaults."""
    flags = dict(lora=rank, lora_alpha=None, lora_rslora=False, lora_targets=None)
    flags |= dict(lora_per_harness=bool(names), model="smollm2", backend="hf", parallel="ddp")
    flags |= dict(async_steps=0, attn=None, no_tree=False, keep_checkpoints=2)
    flags |= dict(activation_checkpointing=None, max_model_len=None, steps=20, warmup_steps=0)
    flags |= dict(lr=1e-4, weight_decay=0.0, lr_schedule="constant", grad_clip=1.0)
    flags |= dict(micro_batch_tokens=4096, norm="rollout-mean", norm_const=1024, loss="ppo")
    flags |= dict(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, tis_cap=2.0, kl_coef=0.0)
    return argparse.Namespace(**{**flags, **kw})


def params_and_copy(rank, copies):
    """(trainable, all) parameters of the embedded model, whole or with rank-``rank`` adapters, and the
    fastest of ``copies`` weight syncs into a served copy of it."""
    from lightning_lite.backends import copy_weights
    from lightning_lite.extras import lora
    from lightning_lite.models import load_model

    trained, served = (load_model("smollm2") for _ in range(2))
    if rank:
        trained = lora.LoRA(lora_flags(rank)).wrap(trained)
        served = lora.LoRA(lora_flags(rank)).wrap(served)
    # what trainer.Learner's sync copies (Learner.trained): the parameters AdamW updates
    updated = {n: p for n, p in trained.named_parameters() if p.requires_grad}
    seconds = []
    for _ in range(copies):
        t0 = time.perf_counter()
        copy_weights(updated, served)
        seconds.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in updated.values())
    return n, sum(p.numel() for p in trained.parameters()), min(seconds)


def run(out, steps, extra, batch, max_tokens):
    args = [
        sys.executable,
        "train.py",
        "--harness",
        "calc",
        "--harness-arg",
        f"max_tokens={max_tokens}",
    ]
    args += ["--harness-arg", "tool_first=False", "--batch-size", str(batch), "--group-size", "4"]
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


def against_full(a):
    print("| mode | trainable / all params | t_train s | sync copy s | peak RSS GB | reward |")
    print("|---|---|---|---|---|---|")
    for name, flags, rank in [
        ("full", ["--lr", str(a.lr)], 0),
        (f"--lora {a.lora}", ["--lr", str(10 * a.lr), "--lora", str(a.lora)], a.lora),
    ]:
        n, total, copy = params_and_copy(rank, a.copies)
        with tempfile.TemporaryDirectory() as out:
            t_train, peak, reward = run(out, a.steps, flags, a.batch_size, a.max_tokens)
        print(
            f"| {name} | {n:,} / {total:,} ({n / total:.2%}) | {t_train:.2f} | {copy:.3f} | "
            f"{peak:.2f} | {reward:.3f} |"
        )


def synthetic_step(learner, names, groups, prompt_tokens, reply_tokens):
    """Per harness ``groups`` groups of 8 rollouts: a shared random prompt, random sampled replies with
    the rollout logprobs of the harness's adapter and advantages of either sign. (samples, results)"""
    import torch

    from lightning_lite import algo
    from lightning_lite.extras import lora
    from lightning_lite.records import Sample

    g = torch.Generator().manual_seed(0)
    random_ids = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    samples, results = [], []
    for name in names:
        lora.activate(learner.model, name)
        for k in range(groups):
            prompt = random_ids(prompt_tokens)
            for i in range(8):
                rid = f"{name}-{k}-{i}"
                tokens = prompt + random_ids(reply_tokens)
                mask = [0] * prompt_tokens + [1] * reply_tokens
                s = Sample(rid, tokens, mask, [0.0] * len(tokens))
                with torch.no_grad():
                    own = algo.trainer_logprobs(learner.model, algo.collate([s], [1.0]))[0]
                s.logprobs = [x * m for x, m in zip(own.tolist(), mask)]
                s.advantages = [(i - 3.5) / 2.3 * m for m in mask]
                samples.append(s)
                results.append(argparse.Namespace(rollout_id=rid, harness=name))
    return samples, results


def per_harness_loop(learner, samples, results, step, names):
    """What --lora-per-harness ran before ``lora.LoRA.update``: a full update per harness, one after
    another (its own backward, gradient reduction, clipping and AdamW step)."""
    from lightning_lite.extras import lora

    harness_of = {r.rollout_id: r.harness for r in results}
    for name in names:
        lora.activate(learner.model, name)
        learner.update([s for s in samples if harness_of[s.rollout_id] == name], step, True)


def adapter_weights(learner):
    from lightning_lite.extras import lora

    return {
        n: p.detach().clone()
        for n, p in learner.model.named_parameters()
        if lora.adapter_of_param(n)
    }


def one_pass_against_loop(a, tok):
    import torch

    from lightning_lite.extras import lora
    from lightning_lite.trainer import Learner, TrainConfig

    print()
    print(
        "| harnesses | samples | tokens | per-harness loop s | one pass s | speed-up | max weight diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in a.harnesses:
        names = [f"h{i}" for i in range(n)]
        seconds, weights = {}, {}
        for mode in ("loop", "one pass"):
            torch.manual_seed(0)
            flags = lora_flags(a.lora, names, micro_batch_tokens=a.micro_batch_tokens)
            adapter = lora.LoRA(flags)
            adapter.names = names
            config = TrainConfig.from_flags(flags)
            cpu = torch.device("cpu")
            learner = Learner(config, tok, cpu, torch.float32, 1, True, None, print, adapter)
            samples, results = synthetic_step(
                learner, names, a.groups, a.prompt_tokens, a.reply_tokens
            )
            times = []
            for k in range(a.repeat + 1):
                t0 = time.perf_counter()
                # (step 0 each time: the samples were sampled by version 0, as at the first step)
                if mode == "loop":
                    per_harness_loop(learner, samples, results, 0, names)
                else:
                    adapter.update(learner, samples, results, 0)
                times.append(time.perf_counter() - t0)
                if k == 0:
                    # the first update's weights, compared across the two modes
                    weights[mode] = adapter_weights(learner)
            # the first update warms up (allocations, thread pools): not timed
            seconds[mode] = statistics.median(times[1:])
        diff = max(
            (weights["loop"][k] - weights["one pass"][k]).abs().max().item()
            for k in weights["loop"]
        )
        tokens = sum(len(s.tokens) for s in samples)
        loop, one = seconds["loop"], seconds["one pass"]
        print(
            f"| {n} | {len(samples)} | {tokens:,} | {loop:.2f} | {one:.2f} | {loop / one:.2f}x | "
            f"{diff:.1e} |"
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4, help="train.py's, for table 1")
    ap.add_argument("--max-tokens", type=int, default=32, help="calc's, for table 1")
    ap.add_argument("--lora", type=int, default=16, help="the adapters' rank")
    ap.add_argument("--lr", type=float, default=1e-5, help="full training's; LoRA's is 10x")
    ap.add_argument("--copies", type=int, default=5, help="table 1: timed syncs, the fastest shown")
    ap.add_argument("--harnesses", default="2,4", help="table 2: adapters, comma-separated counts")
    ap.add_argument("--groups", type=int, default=2, help="table 2: groups of 8 per harness")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="table 2: timed updates per mode")
    help = "a few seconds' run of every code path, for the tests: the numbers mean nothing"
    ap.add_argument("--smoke", action="store_true", help=help)
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    a.harnesses = [int(n) for n in a.harnesses.split(",")]
    against_full(a)
    from lightning_lite.models import load_tokenizer

    one_pass_against_loop(a, load_tokenizer("smollm2"))


if __name__ == "__main__":
    main()
