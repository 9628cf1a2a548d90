"""Several harnesses in one run (docs/training.md: several harnesses). ``--harness search:2
--harness calc`` draws a step's tasks in proportion to the weights, and each harness has its own
metrics (``reward/NAME``, ``eval_reward/NAME``); ``--group-across-harnesses`` puts every harness's
rollouts of one task id in one advantage group. One harness with no weight is the core's
(harness.Tasks).

The hook: ``hooks.tasks``, the factory of the object train.py asks for each step's groups
(``pick(step)``), each harness's columns of the step's row (``harness_columns``) and of an
evaluation's (``eval_row``), and the log line's tail of them (``by_harness``).
"""

import sys
from collections import Counter

from .. import hooks
from ..algo import all_reduce
from ..harness import WEIGHTED, Tasks, load_harness, parse_kwargs, several
from ..rundir import counts, step_rates
from ..samples import build_batch_samples


def add_args(parser):
    group = parser.add_argument_group("several harnesses")
    help = "one group a task id over every --harness (--group-size split by WEIGHT)"
    group.add_argument("--group-across-harnesses", action="store_true", help=help)


def check(args, ddp: bool, cuda: bool):
    # None: no --harness given (train.py's default comes after the checks)
    harness_specs = args.harness or []
    if args.group_across_harnesses and len(harness_specs) < 2:
        sys.exit(
            "--group-across-harnesses groups the rollouts of several --harness that run the "
            "same tasks: give two or more"
        )


def share(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights``, largest remainders first:
    ``share(4, [3, 1]) == [3, 1]``."""
    raw = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in raw]
    # the largest remainders get the rest, one each
    by_remainder = sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_weight(spec: str) -> tuple[str, float]:
    """``"search:2"`` -> ``("search", 2.0)``; ``"file.py:Class"`` -> ``("file.py:Class", 1.0)``."""
    match = WEIGHTED.fullmatch(spec)
    if match is None:
        return spec, 1.0
    return match[1], float(match[2])


def split_arg(item: str) -> tuple[str, str, str]:
    """A --harness-arg: ``"search:k=1"`` -> ``("search", "k", "1")``; ``"k=1"`` -> ``("", "k",
    "1")``, for every harness."""
    key, _, value = item.partition("=")
    target, _, name = key.rpartition(":")
    return target, name, value


def harness_kwargs(spec: str, items: list[str]) -> dict:
    """The keywords of the harness ``spec``: each ``--harness-arg K=V``, and each ``SPEC:K=V`` that
    names it."""
    kept = []
    for item in items:
        target, name, value = split_arg(item)
        if target in ("", spec):
            kept.append(f"{name}={value}")
    return parse_kwargs(kept)


class SeveralTasks(Tasks):
    """harness.Tasks for several harnesses, each drawn in proportion to its weight: a step's
    batch_size tasks split over them (largest remainders first), or with ``groups_across`` each
    task's group_size rollouts split over them, every harness running the same task id."""

    def __init__(self, args, log):
        # harness.Tasks's fields (its own __init__ loads one harness), then the weights
        self.batch_size = args.batch_size
        # each harness's merge statistics of the step (``merge``)
        self.merge_stats = {}
        self.group_size = args.group_size
        self.seed = args.seed
        self.groups_across = args.group_across_harnesses
        specs = []
        self.weights = []
        for item in args.harness:
            spec, weight = split_weight(item)
            specs.append(spec)
            self.weights.append(weight)
        if any(w <= 0 for w in self.weights):
            sys.exit("a --harness WEIGHT must be > 0")
        targets = {split_arg(item)[0] for item in args.harness_arg}
        unknown = targets - {"", *specs}
        if unknown:
            sys.exit(f"--harness-arg {sorted(unknown)[0]}:K=V names no --harness")
        self.harnesses = []
        for spec in specs:
            harness = load_harness(spec, **harness_kwargs(spec, args.harness_arg))
            # metrics are kept by name
            if harness.name in self.names():
                harness.name = f"{harness.name}{len(self.harnesses)}"
            self.harnesses.append(harness)
        self.train = {h.name: h.tasks("train") for h in self.harnesses}
        self.test = {h.name: h.tasks("test")[: args.eval_tasks] for h in self.harnesses}
        # harness name -> task id -> its task; the task ids every harness has, in the first's order
        self.by_id = {name: {t.id: t for t in tasks} for name, tasks in self.train.items()}
        first = self.train[self.harnesses[0].name]
        self.common = [t for t in first if all(t.id in ids for ids in self.by_id.values())]
        if self.groups_across and not self.common:
            names = ", ".join(self.by_id)
            sys.exit(f"--group-across-harnesses: harnesses {names} share no train task id")
        weights = ", ".join(f"{w:g}" for w in self.weights)
        each = f"each of the {len(self.harnesses)} harnesses (weights {weights})"
        if self.groups_across and 0 in share(self.group_size, self.weights):
            sys.exit(f"--group-size is too small to give {each} a rollout in every group")
        if not self.groups_across and 0 in share(self.batch_size, self.weights):
            sys.exit(f"--batch-size is too small to give {each} a task a step")
        for h, spec, weight in zip(self.harnesses, specs, self.weights):
            counts = f"{len(self.train[h.name])} train / {len(self.test[h.name])} test tasks"
            log(f"harness {h.name} ({spec}, weight {weight:g}): {counts}")

    def pick(self, step: int) -> list[list[tuple]]:
        """The step's batch_size groups (all ranks'), each group_size (harness, task, group id)."""
        if self.groups_across:
            # one task list; each task's group split over the harnesses by weight
            members = []
            for harness, n in zip(self.harnesses, share(self.group_size, self.weights)):
                members += [harness] * n
            groups = []
            for task in self.draw(self.common, step, self.batch_size):
                groups.append([(h, self.by_id[h.name][task.id], task.id) for h in members])
            return groups
        groups = []
        for harness, n in zip(self.harnesses, share(self.batch_size, self.weights)):
            for task in self.draw(self.train[harness.name], step, n):
                groups.append([(harness, task, f"{harness.name}/{task.id}")] * self.group_size)
        return groups

    def eval_row(self, results: list, seconds: float) -> dict:
        """harness.Tasks's row, and with two harnesses or more each one's eval_reward/NAME and
        eval_success/NAME."""
        row = super().eval_row(results, seconds)
        if len(self.harnesses) < 2:
            return row
        for name in self.names():
            rewards = [r.reward for r in results if r.harness == name and r.reward is not None]
            ran = sum(r.harness == name for r in results)
            successes = sum(reward >= 1.0 for reward in rewards)
            n, total, success = all_reduce([ran, sum(rewards), successes])
            row[f"eval_reward/{name}"] = total / max(1, n)
            row[f"eval_success/{name}"] = success / max(1, n)
        return row

    def merge(self, results: list, calls: list, max_seq_len) -> tuple[list, Counter]:
        """As Tasks.merge, each harness's rollouts apart: its merge statistics are kept for
        ``harness_columns``."""
        harness_of = {r.rollout_id: r.harness for r in results}
        samples = []
        self.merge_stats = {}
        for name in dict.fromkeys(harness_of.values()):
            its_calls = [c for c in calls if harness_of[c.rollout_id] == name]
            its_samples, self.merge_stats[name] = build_batch_samples(its_calls, max_seq_len)
            samples += its_samples
        return samples, sum(self.merge_stats.values(), Counter())

    def harness_columns(self, results: list, calls: list) -> dict:
        """With two harnesses or more, each one's rates of the step's row (rundir.step_rates: its
        reward/NAME, success/NAME, calls_per_rollout/NAME, merge_ratio/NAME, ...), of every rank's
        rollouts (a collective); its merge statistics are ``merge``'s."""
        if len(self.harnesses) < 2:
            return {}
        row = {}
        for name in self.names():
            mine = [r for r in results if r.harness == name]
            ids = {r.rollout_id for r in mine}
            its_calls = [c for c in calls if c.rollout_id in ids]
            sums = counts(mine, its_calls, self.merge_stats.get(name, Counter()))
            # every rank's
            sums = dict(zip(sums, all_reduce(list(sums.values()))))
            for key, value in step_rates(sums).items():
                row[f"{key}/{name}"] = value
        return row

    def by_harness(self, row: dict, *keys: str) -> str:
        """The log line's tail with two harnesses or more: for each of ``keys`` that ``row`` has
        per harness, its values, ``" | calc 0.500 | search 0.250"`` (``-``: not measured), those
        after the first named: ``" | loss | calc +0.012 | search -"``."""
        tail = ""
        if len(self.harnesses) < 2:
            return tail
        for i, key in enumerate(keys):
            if not any(f"{key}/{name}" in row for name in self.names()):
                continue
            if i > 0:
                tail += f" | {key}"
            for name in self.names():
                value = row.get(f"{key}/{name}")
                shown = "-" if value is None else f"{value:.3f}"
                tail += f" | {name} {shown}"
        return tail


def make_tasks(args, log) -> Tasks:
    """train.py's step tasks: the core's for one harness with no weight, SeveralTasks otherwise."""
    if several(args.harness, args.harness_arg) or args.group_across_harnesses:
        return SeveralTasks(args, log)
    return Tasks.from_flags(args, log)


hooks.tasks = make_tasks
