"""Training-phase tokens/s on the embedded model: forward + backward of the policy loss, micro-batched.

    python bench/train_step.py [--samples 16] [--group-size 4] [--min-len 64] [--max-len 512] [--micro-batch-tokens 4096]

Synthetic samples (records.Sample) of random token ids in GRPO groups of --group-size: the
samples of a group share their prompt (about 1 - --response-frac of --min-len..--max-len
tokens, drawn per group) and each has its own trainable response (loss_mask 1, about
--response-frac of it, drawn per sample). They go through train.py's own path: micro-batches
of at most --micro-batch-tokens padded tokens (train.py's micro_batches, read from its source, so
the bench follows it), algo.collate, algo.trainer_logprobs, algo.policy_loss, backward. Three
orders, one pass each, no optimizer step (the same whatever the batching):

  train.py        train.py's micro_batches: sorted by token ids (a group's samples side by
                  side, so a micro-batch that holds one group only runs its prompt once)
  by length       the same packing rule on the samples sorted by length
  arrival         the same packing rule in the order the samples were built (group by group)

tokens/s counts the samples' real tokens; padding is the fraction of the micro-batches'
[B, T] positions that are padding. Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import ast
import os
import random
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_lite import algo  # noqa: E402
from lightning_lite.models import load_model  # noqa: E402
from lightning_lite.records import Sample  # noqa: E402


def from_train_py(names, namespace):
    """train.py's top-level functions ``names``, compiled into ``namespace``. Importing train.py would
    parse its command line and start a run, so the functions are taken from its source instead."""
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        sys.exit(f"train.py no longer defines {sorted(missing)}: update bench/train_step.py")
    exec(compile(ast.Module(body=found, type_ignores=[]), "train.py", "exec"), namespace)
    return [namespace[n] for n in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4, help="samples sharing a prompt (train.py's default)")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--response-frac", type=float, default=0.25, help="trainable share of a sample (its response); the rest is its group's prompt")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="train.py's default")
    ap.add_argument("--repeat", type=int, default=2, help="passes per ordering; the fastest counts")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default, one per core)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    model = load_model(a.model, a.device).train()  # fp32, as train.py loads it
    vocab = model.config.vocab_size
    samples = []
    for i in range(a.samples):
        if i % a.group_size == 0:
            prompt = [rng.randrange(vocab) for _ in range(max(1, int(rng.randint(a.min_len, a.max_len) * (1 - a.response_frac))))]
        k = max(1, int(rng.randint(a.min_len, a.max_len) * a.response_frac))
        n = len(prompt) + k
        samples.append(Sample(rollout_id=f"r{i}", tokens=prompt + [rng.randrange(vocab) for _ in range(k)], loss_mask=[0] * (n - k) + [1] * k,
                              logprobs=[0.0] * (n - k) + [-rng.uniform(0.05, 3.0) for _ in range(k)], advantage=rng.choice([-1.0, 1.0]),
                              temperature=[1.0] * n, top_k=[0] * n, top_p=[1.0] * n))
    weights = algo.sample_weights(samples, "rollout-mean", algo.global_denominators(samples))
    ns = {"args": SimpleNamespace(micro_batch_tokens=a.micro_batch_tokens)}  # the train.py global it reads
    (micro_batches,) = from_train_py(["micro_batches"], ns)

    def step(mbs):
        """Forward + backward over the micro-batches; returns seconds."""
        model.zero_grad(set_to_none=True)
        sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for mb in mbs:
            b = algo.collate(*mb, device=a.device)
            lp = algo.trainer_logprobs(model, b)
            loss, _ = algo.policy_loss(lp, b["old_logprobs"], b["advantages"], b["loss_mask"], b["weights"])
            loss.backward()
        sync()
        return time.perf_counter() - t0

    step(micro_batches(samples[:2], weights[:2], [0, 1]))  # warm-up: first-call allocations
    real = sum(len(s.tokens) for s in samples)
    trainable = sum(sum(s.loss_mask) for s in samples)
    print(f"{a.samples} samples in groups of {a.group_size}, {real} tokens ({trainable} trainable), "
          f"lengths {min(len(s.tokens) for s in samples)}..{max(len(s.tokens) for s in samples)}, "
          f"micro-batches of <= {a.micro_batch_tokens} padded tokens, {a.device} fp32, {torch.get_num_threads()} threads\n")
    head = f"{'micro-batches':<14} {'count':>5} {'padded tok':>10} {'padding':>8} {'time s':>7} {'tokens/s':>9} {'padded tok/s':>12}"
    print(head)
    print("-" * len(head))
    for name, mbs in (("train.py", micro_batches(samples, weights)),
                      ("by length", micro_batches(samples, weights, sorted(range(len(samples)), key=lambda i: len(samples[i].tokens)))),
                      ("arrival", micro_batches(samples, weights, range(len(samples))))):
        padded = sum(max(len(s.tokens) for s in mb) * len(mb) for mb, _ in mbs)
        t = min(step(mbs) for _ in range(a.repeat))  # the best of --repeat: the first pass over new shapes allocates
        print(f"{name:<14} {len(mbs):>5} {padded:>10} {1 - real / padded:>8.1%} {t:>7.1f} {real / t:>9.0f} {padded / t:>12.0f}")
    print("\nModel-FLOPs utilization needs a GPU: scripts/gpu_check.sh prints it; on a CPU the table\n"
          "compares batchings only.")


if __name__ == "__main__":
    main()
