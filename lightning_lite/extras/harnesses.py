"""The harnesses a run trains through, and which of their tasks each step runs (docs/training.md:
several harnesses). One harness is the plain case; several (``--harness search:2 --harness calc``)
draw a step's tasks in proportion to their weights, each with its own metrics (``reward/NAME``),
and ``--group-across-harnesses`` puts every harness's rollouts of one task id in one advantage group.

The hook: train.py asks ``Tasks.pick(step)`` for the step's groups of (harness, task, group id).
"""

import random
import re
import sys

from .. import algo
from ..harness import load_harness, parse_kwargs


def add_args(parser):
    group = parser.add_argument_group("several harnesses")
    help = "one group a task id over every --harness (--group-size split by WEIGHT)"
    group.add_argument("--group-across-harnesses", action="store_true", help=help)


def check(args, ddp: bool, cuda: bool):
    if args.group_across_harnesses and (len(args.harness) < 2 or args.from_calls):
        sys.exit(
            "--group-across-harnesses groups the rollouts of several --harness that run the "
            "same tasks: give two or more"
        )


def share(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights``, largest remainders first: share(4, [3, 1]) == [3, 1]."""
    raw = [total * w / sum(weights) for w in weights]
    n = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: n[i] - raw[i])[: total - sum(n)]:
        n[i] += 1
    return n


class Tasks:
    def __init__(self, args, log):
        self.args = args
        # "search:2" -> ("search", 2.0); "file.py:Class" keeps its class
        specs = [
            (m[1], float(m[2])) if (m := re.fullmatch(r"(.+):(\d+(?:\.\d+)?)", h)) else (h, 1.0)
            for h in args.harness
        ]
        self.weights = [w for _, w in specs]
        # "K=V" goes to every harness, "SPEC:K=V" to that one
        items = [(k.rpartition(":"), v) for k, _, v in (i.partition("=") for i in args.harness_arg)]
        if unknown := {key[0] for key, _ in items} - {"", *(spec for spec, _ in specs)}:
            sys.exit(f"--harness-arg {sorted(unknown)[0]}:K=V names no --harness")
        if any(w <= 0 for w in self.weights):
            sys.exit("a --harness WEIGHT must be > 0")
        self.harnesses = []
        for spec, _ in specs:
            kwargs = parse_kwargs([f"{key[2]}={v}" for key, v in items if key[0] in ("", spec)])
            h = load_harness(spec, **kwargs)
            # metrics are kept by name
            if h.name in self.names():
                h.name = f"{h.name}{len(self.harnesses)}"
            self.harnesses.append(h)
        self.train = {h.name: h.tasks("train") for h in self.harnesses}
        self.test = {h.name: h.tasks("test")[: args.eval_tasks] for h in self.harnesses}
        self.by_id = {name: {t.id: t for t in tasks} for name, tasks in self.train.items()}
        first = self.train[self.harnesses[0].name] if self.harnesses else []
        self.common = [t for t in first if all(t.id in ids for ids in self.by_id.values())]
        across = args.group_across_harnesses
        if across and not self.common:
            sys.exit(
                f"--group-across-harnesses: harnesses {', '.join(self.by_id)} share no train task id"
            )
        total = args.group_size if across else args.batch_size
        if self.harnesses and 0 in share(total, self.weights):
            what = "a rollout in every group" if across else "a task a step"
            weights = ", ".join(f"{w:g}" for w in self.weights)
            sys.exit(
                f"{'--group-size' if across else '--batch-size'} is too small to give each of the "
                f"{len(self.harnesses)} harnesses (weights {weights}) {what}"
            )
        for h, (spec, w) in zip(self.harnesses, specs):
            log(
                f"harness {h.name} ({spec}, weight {w:g}): {len(self.train[h.name])} train / "
                f"{len(self.test[h.name])} test tasks"
            )

    def names(self) -> list[str]:
        return [h.name for h in self.harnesses]

    def pick(self, step: int) -> list[list[tuple]]:
        """The step's --batch-size groups (all ranks'), each --group-size of (harness, task, group id)."""
        a = self.args
        if a.group_across_harnesses:
            # one task list; each task's group split over the harnesses by weight
            split = share(a.group_size, self.weights)
            members = [h for h, n in zip(self.harnesses, split) for _ in range(n)]
            tasks = self.draw(self.common, step, a.batch_size)
            return [[(h, self.by_id[h.name][t.id], t.id) for h in members] for t in tasks]
        split = share(a.batch_size, self.weights)
        return [
            [(h, t, f"{h.name}/{t.id}")] * a.group_size
            for h, n in zip(self.harnesses, split)
            for t in self.draw(self.train[h.name], step, n)
        ]

    def draw(self, items: list, step: int, n: int) -> list:
        """The step's n items of a fixed shuffle per epoch, so --resume sees the same order."""
        epoch, k = divmod(step, max(1, len(items) // max(1, n)))
        items = list(items)
        random.Random(self.args.seed * 1000 + epoch).shuffle(items)
        return items[k * n : (k + 1) * n]

    def test_jobs(self) -> list[tuple]:
        return [(h, t) for h in self.harnesses for t in self.test[h.name]]

    def eval_row(self, results: list, seconds: float) -> dict:
        """eval_reward and eval_success over every rank's results, and each harness's (/NAME)."""
        row = {}
        for name in [""] + (self.names() if len(self.harnesses) > 1 else []):
            mine = [r for r in results if r.harness == name or not name]
            ok = [r.reward for r in mine if r.reward is not None]
            sums = [len(mine), sum(ok), sum(r >= 1.0 for r in ok), len(mine) - len(ok)]
            n, total, success, failed = algo.all_reduce(sums)
            suffix = f"/{name}" if name else ""
            row["eval_reward" + suffix] = total / max(1, n)
            row["eval_success" + suffix] = success / max(1, n)
            if not name:
                row.update(eval_tasks=int(n), eval_failed=int(failed), eval_s=round(seconds, 1))
        return row

    def by_harness(self, row: dict, key: str) -> str:
        """The log line's tail with several harnesses: ' | calc 0.500 | search 0.250'."""
        if len(self.harnesses) < 2:
            return ""
        show = lambda v: "-" if v is None else f"{v:.3f}"
        return "".join(f" | {name} {show(row.get(f'{key}/{name}'))}" for name in self.names())
