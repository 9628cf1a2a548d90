"""A training run's directory (README: the run directory), and the numbers of one step's row.

    OUT/config.json              the flags as they ran
    OUT/metrics.jsonl            one row a step, one an evaluation
    OUT/calls/step_K.jsonl       the step's calls (.rankR.jsonl under DDP): records.Call
    OUT/rollouts/step_K.jsonl    one line a rollout: task, reward, why it failed, its advantage
    OUT/checkpoints/step_K/      transformers weights + trainer_state.pt; `latest` names the newest

A run that resumes at step k drops what an earlier attempt wrote after checkpoint k: those steps run
again on the same tasks, so a run killed between checkpoints loses no data and trains none twice.
"""

import json
import os
import re
import shutil
from collections import Counter
from dataclasses import asdict

import torch
import torch.distributed as dist

from . import records
from .records import SPLIT_REASONS, find_batches, read_jsonl


class RunDir:
    def __init__(self, out: str, rank: int, ddp: bool):
        self.out, self.rank, self.ddp = out, rank, ddp
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        self.checkpoints = os.path.join(out, "checkpoints")
        os.makedirs(os.path.join(out, "calls"), exist_ok=True)

    def file(self, kind: str, name: str) -> str:
        """A step's (or an evaluation's) calls or rollouts: one file per rank under DDP."""
        name += f".rank{self.rank}" if self.ddp else ""
        return os.path.join(self.out, kind, name + ".jsonl")

    def save_rollouts(self, name: str, results: list, advantages: dict):
        """One line per rollout: the harness's RolloutResult and its advantage (a number, {call
        index: number} for a per-call estimator, or null: not trained)."""
        rows = [asdict(r) | {"advantage": advantages.get(r.rollout_id)} for r in results]
        records.write_jsonl(self.file("rollouts", name), rows)

    def append_metrics(self, row: dict, sinks=()):
        """One line of metrics.jsonl (None: not measured; NaN and inf, which JSON lacks, too), also
        to the other sinks (hooks.METRIC_SINKS). The file is written last: a row in it has been
        logged everywhere."""
        if self.rank:
            return
        row = records.finite(row)
        for sink in sinks:
            sink.log(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self):
        latest = os.path.join(self.checkpoints, "latest")
        if os.path.exists(latest):
            return os.path.join(self.checkpoints, open(latest).read().strip())
        return None

    def drop_after(self, start_step: int, resumed: bool) -> set:
        """Drop the steps an earlier attempt ran after ``start_step`` (their calls, rollouts and
        metrics rows) and the evaluations cut short (no metrics row): they run again. Rank 0 drops
        every rank's files (that attempt may have had another world size), the others wait.
        Returns the steps whose evaluation is done."""
        exists = os.path.exists(self.metrics_path)
        # read_jsonl skips a torn last line; a Ctrl-C may have logged a row twice: once each
        old = read_jsonl(self.metrics_path) if resumed and exists else []
        rows = {(r["step"], "eval_reward" in r): r for r in old if r["step"] <= start_step}
        evaluated = {step for step, is_eval in rows if is_eval}
        for (kind, k), files in find_batches(self.out).items() if self.rank == 0 else ():
            if kind == "step" and k >= start_step or kind == "eval" and k not in evaluated:
                for path in files["calls"] + files["rollouts"]:
                    os.remove(path)
        if self.rank == 0 and exists:
            # a new file, then a rename: a kill here loses no row
            records.write_jsonl(self.metrics_path + ".tmp", rows.values())
            os.replace(self.metrics_path + ".tmp", self.metrics_path)
        if self.ddp:
            dist.barrier()
        return evaluated

    def save_checkpoint(self, step, model, tok, weights, optim, dtype, config, keep: int) -> str:
        """Weights in transformers format (written by ``model``'s plain class, so it loads
        anywhere), the optimizer state and the step, written whole to a temporary folder, then
        renamed."""
        final = os.path.join(self.checkpoints, f"step_{step}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=weights)
        # it wrote the module's dtype: a loader's (a vLLM server's) "auto" takes the served one
        model.config.dtype = dtype
        model.config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        state = {"optimizer": optim, "step": step, "args": config}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(self.checkpoints, "latest"), "w") as f:
            f.write(f"step_{step}")
        names = [n for n in os.listdir(self.checkpoints) if re.fullmatch(r"step_\d+", n)]
        for name in sorted(names, key=lambda n: -int(n[5:]))[keep:] if keep else ():
            shutil.rmtree(os.path.join(self.checkpoints, name))
        return final


# ---------------------------------------------------------------------- a step's numbers
# the metrics row's counts (summed over ranks) and what the loss reports (algo.policy_loss)
COUNTED = "rollouts failed flagged calls samples trainable_tokens truncated dropped".split()
LOSS_METRICS = "fwd_tokens constrained_tokens forced_tokens loss clip_frac ratio_mean".split()
LOSS_METRICS += "ratio_min ratio_max prob_corr dlogp_mean dlogp_max ratio_out_frac".split()


# merge statistics the row counts (samples.build_samples's)
SPLITS = [f"split_{r}" for r in SPLIT_REASONS]
RATES = [("reward", "reward", "rewarded"), ("success", "success", "rewarded")]
RATES += [("calls_per_rollout", "calls", "rollouts"), ("merge_ratio", "tokens_unmerged", "tokens")]


def per(a, b):
    """a / b, or None where b is 0: not measured (a 0 would claim a measurement)."""
    return a / b if b else None


def counts(results, calls, merge_stats: Counter) -> dict:
    """Sums over ``results`` (a rank's, or one harness's of them), their calls and
    samples.build_samples's merge statistics: summed over ranks, ``step_rates`` makes the row's
    numbers of them."""
    # None: an unrewarded trace (sft)
    rewarded = [r.reward for r in results if r.error is None and r.reward is not None]
    n = dict(rollouts=len(results), failed=sum(r.error is not None for r in results))
    n |= dict(flagged=sum(bool(r.flags) for r in results), rewarded=len(rewarded))
    n |= dict(reward=sum(rewarded), success=sum(x >= 1.0 for x in rewarded), calls=len(calls))
    n["gen"] = sum(len(c.response_ids) for c in calls)
    merged = ["tokens", "tokens_unmerged", "truncated", "dropped", *SPLITS]
    return n | {k: merge_stats[k] for k in merged}


def step_counts(results, calls, samples, merge_stats: dict, names: list, all_reduce) -> dict:
    """The step's sums over every rank: all of it, and each harness's (keys ending in /NAME) when
    there are several."""
    n = counts(results, calls, sum(merge_stats.values(), Counter()))
    n |= dict(samples=len(samples), signal=sum(any(s.advantages) for s in samples))
    n |= dict(trainable_tokens=sum(sum(s.loss_mask) for s in samples))
    n["kept_tokens"] = sum(len(s.tokens) for s in samples)
    for name in names if len(names) > 1 else ():
        mine = [r for r in results if r.harness == name]
        ids, stats = {r.rollout_id for r in mine}, merge_stats.get(name, Counter())
        sums = counts(mine, [c for c in calls if c.rollout_id in ids], stats)
        n.update({f"{k}/{name}": v for k, v in sums.items()})
    return dict(zip(n, all_reduce(list(n.values()))))


def step_rates(n: dict, names: list) -> dict:
    """The row's reward, success, calls per rollout, merge ratio and split counts from the sums."""
    row = {}
    for suffix in [""] + [f"/{name}" for name in names if len(names) > 1]:
        # the row's key, and the sums it divides
        for key, a, b in RATES:
            row[key + suffix] = per(n[a + suffix], n[b + suffix])
        splits = {r: int(n[f"split_{r}{suffix}"]) for r in SPLIT_REASONS}
        row["splits" + suffix] = {r: k for r, k in splits.items() if k}
    return row
