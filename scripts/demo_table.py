"""A demo's before/after table from its train.py run folder, for any harness (make demo-instruct, make
demo-search): each held-out evaluation's reward, success and calls per rollout, then the run's totals:
minutes, the rollouts' splits and the tokens the packed tree forwarded against one row per sample.

    python scripts/demo_table.py runs/demo-search
"""

import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_lite.records import find_batches, read_calls, read_jsonl  # noqa: E402
from lightning_lite.samples import build_batch_samples  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", help="a train.py --out folder (metrics.jsonl, calls/)")
    args = parser.parse_args()
    rows = list(read_jsonl(os.path.join(args.run, "metrics.jsonl")))
    evals = {r["step"]: r for r in rows if "eval_reward" in r}
    steps = [r for r in rows if "reward" in r]
    if not evals:
        sys.exit(
            f"{args.run}/metrics.jsonl has no held-out evaluation: run train.py with --eval-tasks N"
        )
    batches = find_batches(args.run)
    print("| | held-out reward | held-out success | calls per rollout |")
    print("|---|---|---|---|")
    for k, r in sorted(evals.items()):
        calls = sum(len(read_calls(f)) for f in batches.get(("eval", k), {}).get("calls", []))
        what = "before training (step 0)" if k == 0 else f"after {k} steps"
        n = max(1, r["eval_tasks"])
        print(f"| {what} | {r['eval_reward']:.3f} | {r['eval_success']:.2f} | {calls / n:.2f} |")
    # the steps that trained: what the packed tree forwarded, and one row per sample (--no-tree) would
    fwd = unpacked = 0
    for r in [r for r in steps if r["fwd_tokens"]]:
        calls = [c for f in batches[("step", r["step"] - 1)]["calls"] for c in read_calls(f)]
        samples, _ = build_batch_samples(calls)
        fwd, unpacked = fwd + r["fwd_tokens"], unpacked + sum(len(s.tokens) for s in samples)
    splits = sum((Counter(r["splits"]) for r in steps), Counter())
    minutes = (sum(r["t_step"] for r in steps) + sum(r["eval_s"] for r in evals.values())) / 60
    print(
        f"\n{len(steps)} steps in {minutes:.1f} min; training rollouts split {dict(splits) or 'never'} "
        f"(calls per rollout {sum(r['calls'] for r in steps) / max(1, sum(r['rollouts'] for r in steps)):.2f}); "
        f"the packed tree forwarded {fwd:,} tokens where one row per sample takes {unpacked:,}"
        + (f" ({1 - fwd / unpacked:.0%} fewer)" if unpacked else "")
    )


if __name__ == "__main__":
    main()
