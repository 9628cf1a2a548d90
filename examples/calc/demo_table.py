"""The demo's table (README "What the demo shows"), read from a train.py run of the calc agent: for each held-out
evaluation, the reward and what the calls did.

    python examples/calc/demo_table.py runs/demo

reward: the harness's; correct answer: the last reply scores 1.0; computing calculator call: the first call computes
the problem's own arithmetic (``computes``); success: both; calls per rollout; merge ratio: tokens of the calls one by
one over tokens of the merged samples (samples.build_samples).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.calc.harness import CalcHarness, computes, score  # noqa: E402
from lightning_lite.harness import parse_kwargs  # noqa: E402
from lightning_lite.records import find_batches, read_calls, read_jsonl  # noqa: E402
from lightning_lite.samples import build_batch_samples  # noqa: E402


def evaluation(files: dict, tasks: dict, format_reward: float) -> dict:
    results = [r for f in files["rollouts"] for r in read_jsonl(f)]
    calls = [c for f in files["calls"] for c in read_calls(f)]
    by_rollout = {}
    for c in sorted(calls, key=lambda c: c.index):
        by_rollout.setdefault(c.rollout_id, []).append(c)
    correct = computing = success = 0
    for r in results:
        task, mine = tasks[r["task_id"]], by_rollout.get(r["rollout_id"], [])
        first = mine[0].response if mine and mine[0].response else {}
        calc = any(
            t["name"] == "calculator" and computes(t["arguments"], task.prompt, task.answer)
            for t in first.get("tool_calls", [])
        )
        right = (
            bool(mine)
            and score((mine[-1].response or {}).get("content") or "", task.answer, format_reward)
            == 1.0
        )
        correct, computing, success = correct + right, computing + calc, success + (right and calc)
    _, st = build_batch_samples(calls)
    n = max(1, len(results))
    return {
        "reward": sum(r["reward"] or 0.0 for r in results) / n,
        "correct": correct / n,
        "computing": computing / n,
        "success": success / n,
        "calls_per_rollout": len(calls) / n,
        "merge_ratio": st["tokens_unmerged"] / max(1, st["tokens"]),
        "rollouts": len(results),
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run", help="a train.py --out folder of a calc run")
    args = ap.parse_args()
    config = json.load(open(os.path.join(args.run, "config.json")))
    kw = parse_kwargs(
        [
            k.rpartition(":")[2] + "=" + v
            for k, _, v in (i.partition("=") for i in config["harness_arg"])
        ]
    )
    harness = CalcHarness(
        **{k: v for k, v in kw.items() if k in CalcHarness.__init__.__code__.co_varnames}
    )
    tasks = {t.id: t for t in harness.tasks("test")}
    print(
        "| | held-out reward | correct answer | computing calculator call (first turn) | success (both) | calls per rollout | merge ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for (kind, k), files in find_batches(args.run).items():
        if kind == "eval":
            e = evaluation(files, tasks, harness.format_reward)
            print(
                f"| after {k} steps ({e['rollouts']} tasks) | {e['reward']:.3f} | {e['correct']:.2f} | {e['computing']:.2f} | "
                f"{e['success']:.2f} | {e['calls_per_rollout']:.2f} | {e['merge_ratio']:.2f}x |"
            )


if __name__ == "__main__":
    main()
