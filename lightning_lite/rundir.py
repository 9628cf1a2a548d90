"""A training run's directory (docs/training.md: the run folder), and the numbers of one step's row.

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
import secrets
import shutil
import time
from collections import Counter
from dataclasses import asdict

import torch
import torch.distributed as dist

from . import algo, hooks, records
from .records import SPLIT_REASONS, find_batches, read_jsonl


class RunDir:
    def __init__(self, out: str, rank: int, ddp: bool):
        self.out = out
        self.rank = rank
        # under DDP each rank writes files of its own
        self.ddp = ddp
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        self.checkpoints = os.path.join(out, "checkpoints")
        os.makedirs(os.path.join(out, "calls"), exist_ok=True)
        # where each metrics row goes besides metrics.jsonl (``start``)
        self.sinks = []
        if ddp:
            self.check_shared()

    def check_shared(self):
        """Every rank must see one run directory: rank 0 drops every rank's stale files at a resume,
        and every rank resumes from the checkpoint rank 0 wrote. A folder local to each node (several
        nodes, each its own --out) fails here, on every rank at once, before any training. Rank 0
        writes a file of a new name there; each rank looks for it (a collective)."""
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token)
        path = os.path.join(self.out, f".shared-{token[0]}")
        if self.rank == 0:
            open(path, "w").close()
        dist.barrier()
        missing = int(not os.path.exists(path))
        ranks_missing = int(algo.all_reduce([missing])[0])
        dist.barrier()
        if self.rank == 0:
            os.remove(path)
        if ranks_missing:
            raise SystemExit(
                f"--out {self.out}: {ranks_missing} rank(s) do not see the folder rank 0 writes "
                "(a folder local to each node?): give every node the same --out on a shared file "
                "system"
            )

    def start(self, args, config: dict):
        """Write config.json (the flags as they ran) and open the metrics sinks that
        hooks.METRIC_SINKS makes of the flags (extras/loggers.py: TensorBoard, W&B), on rank 0.
        Every rank tells hooks.PROGRESS where the run is (the report's heartbeat.json)."""
        hooks.progress("run", out=self.out, rank=self.rank, config=config)
        if self.rank:
            return
        with open(os.path.join(self.out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        for make_sink in hooks.METRIC_SINKS:
            sink = make_sink(args, config)
            if sink is not None:
                self.sinks.append(sink)

    def close(self):
        for sink in self.sinks:
            sink.close()

    def file(self, kind: str, name: str) -> str:
        """A step's (or an evaluation's) calls or rollouts: one file per rank under DDP."""
        if self.ddp:
            name += f".rank{self.rank}"
        return os.path.join(self.out, kind, name + ".jsonl")

    def save_rollouts(self, name: str, results: list, advantages: dict):
        """One line per rollout: the harness's RolloutResult and its advantage (a number, {call
        index: number} for a per-call estimator, or null: not trained)."""
        rows = []
        for result in results:
            rows.append({**asdict(result), "advantage": advantages.get(result.rollout_id)})
        records.write_jsonl(self.file("rollouts", name), rows)

    def append_metrics(self, row: dict):
        """One line of metrics.jsonl (None: not measured; NaN and inf, which JSON lacks, too), also
        to the other sinks. The file is written last: a row in it has been logged everywhere."""
        if self.rank:
            return
        # when it was written, seconds since the epoch: the live page's clock
        row = records.finite({**row, "time": round(time.time(), 3)})
        for sink in self.sinks:
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
        old = []
        if resumed and exists:
            # read_jsonl skips a torn last line
            old = read_jsonl(self.metrics_path)
        # (step, is an evaluation) -> its row: a row a Ctrl-C logged twice is kept once
        rows = {(r["step"], "eval_reward" in r): r for r in old if r["step"] <= start_step}
        evaluated = {step for step, is_eval in rows if is_eval}
        if self.rank == 0:
            for (kind, k), files in find_batches(self.out).items():
                rerun_step = kind == "step" and k >= start_step
                cut_short = kind == "eval" and k not in evaluated
                if rerun_step or cut_short:
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
        if keep:
            names = [n for n in os.listdir(self.checkpoints) if re.fullmatch(r"step_\d+", n)]
            newest_first = sorted(names, key=lambda name: -int(name[len("step_") :]))
            for name in newest_first[keep:]:
                shutil.rmtree(os.path.join(self.checkpoints, name))
        return final


# ---------------------------------------------------------------------- a step's numbers
# The metrics row's counts, summed over ranks.
COUNTED = [
    "rollouts",
    "failed",
    "flagged",
    "calls",
    "samples",
    "trainable_tokens",
    "truncated",
    "dropped",
]
# What Learner.update reports, copied into the row: the loss's own (algo.reduce_metrics), the
# grammar's token counts, and the mismatch metrics of extras/mismatch.py (null without it).
LOSS_METRICS = [
    "fwd_tokens",
    "constrained_tokens",
    "forced_tokens",
    "loss",
    "clip_frac",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "prob_corr",
    "dlogp_mean",
    "dlogp_max",
    "ratio_out_frac",
    "entropy_mean",
    # what the mismatch corrections did (algo.reduce_metrics)
    "is_weight_mean",
    "is_truncated_frac",
    "is_truncated_seq_frac",
    "masked_frac",
    "masked_seq_frac",
]
# The merge statistics the row counts (samples.build_samples's).
SPLITS = [f"split_{reason}" for reason in SPLIT_REASONS]
MERGED = ["tokens", "tokens_unmerged", "truncated", "dropped", *SPLITS]
# The row's rates: (its key, the sum it divides, the sum it divides by).
RATES = [
    ("reward", "reward", "rewarded"),
    ("success", "success", "rewarded"),
    ("calls_per_rollout", "calls", "rollouts"),
    ("merge_ratio", "tokens_unmerged", "tokens"),
    # the mean tokens a call generated
    ("response_tokens_mean", "gen", "calls"),
]


def per(a, b):
    """a / b, or None where b is 0: not measured (a 0 would claim a measurement)."""
    if not b:
        return None
    return a / b


def counts(results, calls, merge_stats: Counter) -> dict:
    """Sums over ``results`` (a rank's, or one harness's of them: extras/harnesses.py), their calls
    and samples.build_samples's merge statistics: summed over ranks, ``step_rates`` makes the row's
    numbers of them."""
    # None: an unrewarded trace (sft)
    rewarded = [r.reward for r in results if r.error is None and r.reward is not None]
    sums = {
        "rollouts": len(results),
        "failed": sum(r.error is not None for r in results),
        "flagged": sum(bool(r.flags) for r in results),
        "rewarded": len(rewarded),
        "reward": sum(rewarded),
        "success": sum(reward >= 1.0 for reward in rewarded),
        "calls": len(calls),
        "gen": sum(len(c.response_ids) for c in calls),
    }
    for key in MERGED:
        sums[key] = merge_stats[key]
    return sums


def step_counts(results, calls, samples, merge_stats: Counter, all_reduce) -> dict:
    """The step's sums over every rank: ``counts``, and those of the samples."""
    sums = counts(results, calls, merge_stats)
    sums["samples"] = len(samples)
    sums["signal"] = sum(any(s.advantages) for s in samples)
    sums["trainable_tokens"] = sum(sum(s.loss_mask) for s in samples)
    sums["kept_tokens"] = sum(len(s.tokens) for s in samples)
    return dict(zip(sums, all_reduce(list(sums.values()))))


def step_rates(sums: dict) -> dict:
    """The row's reward, success, calls per rollout, merge ratio and split counts from the sums."""
    row = {}
    for key, numerator, denominator in RATES:
        row[key] = per(sums[numerator], sums[denominator])
    splits = {reason: int(sums[f"split_{reason}"]) for reason in SPLIT_REASONS}
    row["splits"] = {reason: k for reason, k in splits.items() if k}
    return row


def token_rates(sums, t_rollout, t_train, world, generated: bool, trained: bool) -> dict:
    """gen_tok_s, the tokens a rank generated a second of its rollouts (None: the calls were
    recorded earlier, not generated here), and train_tok_s, the trainable tokens a rank trained a
    second of its update (None: no update ran)."""
    rates = {"gen_tok_s": None, "train_tok_s": None}
    if generated:
        rates["gen_tok_s"] = sums["gen"] / max(t_rollout, 1e-9) / world
    if trained and t_train:
        rates["train_tok_s"] = sums["kept_tokens"] / (t_train * world)
    return rates


def shown(row: dict, key: str, spec: str) -> str:
    """A metric as the step's line shows it; '-' where it was not measured."""
    if row.get(key) is None:
        return "-"
    return format(row[key], spec)


def step_line(row: dict) -> str:
    """The step's log line (README: reading a log line) of its metrics row."""
    return (
        f"step {row['step']:4d} | reward {shown(row, 'reward', '.3f')} "
        f"succ {shown(row, 'success', '.2f')} | fail {row['failed']} | samples {row['samples']} "
        f"tok {row['trainable_tokens']} fwd {shown(row, 'fwd_tokens', 'd')} "
        f"merge {shown(row, 'merge_ratio', '.2f')}x | loss {shown(row, 'loss', '+.4f')} "
        f"gnorm {shown(row, 'grad_norm', '.3f')} clip {shown(row, 'clip_frac', '.3f')} "
        f"|dlogp| {shown(row, 'dlogp_mean', '.4f')} | roll {row['t_rollout']:.1f}s "
        f"({shown(row, 'gen_tok_s', '.0f')} tok/s) train {row['t_train']:.1f}s "
        f"({shown(row, 'train_tok_s', '.0f')} tok/s) sync {row['t_sync']:.2f}s"
    )
