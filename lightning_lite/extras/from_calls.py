"""train.py --from-calls: train on calls recorded before (by proxy.py --out, or by a train.py run)
instead of running a harness. Its seam is ``hooks.step_source``, set when --from-calls is given:
``load`` reads and checks the recorded runs once, and ``Recorded.step`` stands in for the harness
step, returning the same (groups, results, calls) as running the rollouts would."""

import functools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

from .. import hooks
from ..harness import RolloutResult, fail_rollouts_the_backend_failed
from ..records import Call, find_batches, read_calls, read_jsonl


def check(args, ddp: bool, cuda: bool):
    if args.from_calls and args.async_steps:
        sys.exit(
            "--from-calls trains on calls recorded before: --async (rollouts while training) has "
            "none to run"
        )
    if args.from_calls:
        # Recorded calls may be of other weights: no guard on the sampler's logprobs unless asked.
        if args.max_mismatch is None:
            args.max_mismatch = math.inf
        # They train without a harness: --harness names what evaluates, none by default.
        if args.harness is None:
            args.harness = []
        # Sampled before this run began, by its version 0: the last step trains them a run's steps
        # after.
        args.max_staleness = args.steps
        hooks.step_source = functools.partial(
            _load_for,
            dirs=args.from_calls,
            model=args.model,
            loss=args.loss,
            adv=args.adv,
            sft_min_reward=args.sft_min_reward,
        )


def _load_for(tokenizer, log, *, dirs, model, loss, adv, sft_min_reward) -> "Recorded":
    """``load`` with the tokenizer's vocabulary (hooks.step_source)."""
    return load(dirs, model, len(tokenizer), loss, adv, sft_min_reward, log)


HELP = (
    "train on the calls that proxy.py --out DIR (rewards POSTed while it served) or a train.py run "
    "recorded, instead of running a harness (docs/signals.md: training from recorded calls); "
    "--harness evaluates"
)


def add_args(parser) -> None:
    group = parser.add_argument_group("training from recorded calls (extras/from_calls.py)")
    group.add_argument("--from-calls", nargs="+", metavar="DIR", help=HELP)


def read_recorded(run_dir: str) -> tuple[Optional[str], list[Call], dict[str, dict]]:
    """What ``run_dir`` recorded: proxy.py's (calls.jsonl, rewards.jsonl, proxy.json) or a train.py
    run's (calls/ and rollouts/ of its steps, not its evaluations; config.json). Returns (the model
    that served them, the calls, {rollout id: {"reward": R or None, "calls": {call index: r},
    "group": a task id or None}}), a rollout only when it was rewarded; of two rewards for one
    rollout or call the last counts. A train.py run's rollouts keep their GRPO groups (the task, in
    its step); failed ones are left out."""
    rewards: dict[str, dict] = {}
    # the model that served them: proxy.py's proxy.json or train.py's config.json names it
    model = None
    for name in ("proxy.json", "config.json"):
        meta = os.path.join(run_dir, name)
        if os.path.exists(meta):
            with open(meta) as f:
                model = json.load(f).get("model")
            break
    # proxy.py's folder: the calls, and the rewards POSTed while it served
    if os.path.exists(os.path.join(run_dir, "calls.jsonl")):
        calls = read_calls(os.path.join(run_dir, "calls.jsonl"))
        path = os.path.join(run_dir, "rewards.jsonl")
        lines = []
        if os.path.exists(path):
            lines = read_jsonl(path)
        for line in lines:
            entry = rewards.setdefault(
                line["rollout_id"], {"reward": None, "calls": {}, "group": None}
            )
            if line.get("call") is None:
                entry["reward"] = line["reward"]
            else:
                entry["calls"][line["call"]] = line["reward"]
            entry["group"] = line.get("task") or entry["group"]
        return model, calls, rewards
    # train.py's folder: each step's calls and rollouts
    steps = {k: files for (kind, k), files in find_batches(run_dir).items() if kind == "step"}
    calls = [c for files in steps.values() for path in files["calls"] for c in read_calls(path)]
    for step, files in steps.items():
        for line in (line for path in files["rollouts"] for line in read_jsonl(path)):
            if line.get("error") is None and line.get("reward") is not None:
                rewards[line["rollout_id"]] = {
                    "reward": line["reward"],
                    "calls": {int(i): r for i, r in (line.get("call_rewards") or {}).items()},
                    "group": f"{step}/{line.get('harness') or ''}/{line['task_id']}",
                }
    if not calls:
        raise ValueError(
            f"{run_dir}: no calls.jsonl (proxy.py --out) and no calls/step_K.jsonl (train.py "
            "--out): not a recorded run"
        )
    return model, calls, rewards


@dataclass
class Recorded:
    """The recorded rollouts to train on: rollout id -> {"reward", "calls": call rewards}, rollout
    id -> its calls, advantage group -> its rollout ids."""

    rewards: dict[str, dict] = field(default_factory=dict)
    calls: dict[str, list[Call]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)

    def step(
        self, step: int, rank: int, world: int, batch_size: int, draw: Callable
    ) -> tuple[dict, list[RolloutResult], list[Call]]:
        """This rank's share of the step's ``batch_size`` groups (``draw(items, step, n)`` picks
        them, as it picks a harness's tasks): ({rollout id: its group}, results, calls), as a
        harness step returns them."""
        picked = {
            rid: group
            for group in draw(list(self.groups), step, batch_size)[rank::world]
            for rid in self.groups[group]
        }
        results = [
            RolloutResult(
                rollout_id=rid,
                task_id=group,
                reward=self.rewards[rid]["reward"],
                error=None,
                seconds=0.0,
                harness="recorded",
                call_rewards=self.rewards[rid]["calls"],
            )
            for rid, group in picked.items()
        ]
        calls = [c for rid in picked for c in self.calls[rid]]
        fail_rollouts_the_backend_failed(results, calls)
        return picked, results, calls


def load(
    dirs: list[str],
    model: str,
    vocab_size: int,
    loss: str,
    adv: str,
    sft_min_reward: Optional[float],
    log: Callable = print,
) -> Recorded:
    """Read every recorded run in ``dirs`` and check it can be trained exactly (else exit, saying
    why): sampled by ``model`` (their logprobs are the old policy's) unless ``loss`` is sft, token
    ids within ``vocab_size``. A rollout is kept when rewarded (or, under sft without
    ``sft_min_reward``, always: a trace to imitate)."""
    from ..models import resolve

    recorded = Recorded()
    for j, d in enumerate(dirs):
        try:
            served, calls, rewards = read_recorded(d)
        except (OSError, ValueError) as e:
            sys.exit(f"--from-calls {d}: {e}")
        same_model = False
        if served:
            same_model = os.path.abspath(resolve(served)) == os.path.abspath(resolve(model))
        if not same_model and loss != "sft":
            who = served
            hint = ""
            if not served:
                who = "a model it does not name (no proxy.json, no config.json)"
                hint = f', or, if you know they are {model}\'s, write {{"model": "{model}"}} to '
                hint += f"{d}/proxy.json"
            sys.exit(
                f"--from-calls {d}: its calls were sampled by {who}, not --model {model}: their "
                f"logprobs are another policy's. Learn from them with --loss sft (same "
                f"tokenizer){hint}"
            )
        no_logprobs = [c for c in calls if len(c.response_logprobs) != len(c.response_ids)]
        if no_logprobs and loss != "sft":
            sys.exit(
                f"--from-calls {d}: {len(no_logprobs)} calls have no logprobs to take the ratio "
                "to; --loss sft trains on them"
            )
        for c in no_logprobs:
            c.response_logprobs = [0.0] * len(c.response_ids)
        if any(t >= vocab_size for c in calls for t in c.response_ids):
            sys.exit(
                f"--from-calls {d}: token ids beyond this tokenizer's {vocab_size}: recorded with "
                "another tokenizer"
            )
        calls_of: dict[str, list[Call]] = {}
        for c in calls:
            calls_of.setdefault(c.rollout_id, []).append(c)
        for rid, rollout_calls in calls_of.items():
            # unrewarded: nothing to learn from, but as a trace to imitate
            if rid not in rewards and not (loss == "sft" and sft_min_reward is None):
                continue
            info = rewards.get(rid) or {"reward": None, "calls": {}, "group": None}
            key = rid
            if len(dirs) > 1:
                # several folders: their rollout ids may collide
                key = f"d{j}.{rid}"
            for c in rollout_calls:
                c.rollout_id = key
                # sampled before this run began: by this run's version 0, a step's number of
                # updates ago when it trains
                c.model_version = 0
            reward = info["reward"]
            if reward is None and rid in rewards:
                # rewarded per call only: the rollout's reward is 0 (unrewarded, under sft: None,
                # trained and not counted in the reward)
                reward = 0.0
            recorded.rewards[key] = {"reward": reward, "calls": info["calls"]}
            recorded.calls[key] = rollout_calls
            group = key
            if info["group"]:
                group = f"d{j}/{info['group']}"
            recorded.groups.setdefault(group, []).append(key)
    if not recorded.rewards:
        sys.exit(
            f"--from-calls: no rewarded rollout in {' '.join(dirs)}: POST rewards to "
            "/rollout/<id>/reward while proxy.py serves (docs/signals.md: training from recorded "
            "calls), or imitate the traces with --loss sft"
        )
    singletons = all(len(g) == 1 for g in recorded.groups.values())
    if loss != "sft" and adv in ("grpo", "dr_grpo", "rloo") and singletons:
        sys.exit(
            f'--from-calls: every rollout is a group of its own (no "task" in the rewards POSTed), '
            f"so --adv {adv} gives each advantage 0: use --adv reinforce (the batch mean as "
            "baseline), or POST rewards with a task"
        )
    n_calls = sum(len(calls) for calls in recorded.calls.values())
    n_rollouts = len(recorded.rewards)
    log(f"--from-calls: {n_rollouts} rollouts ({n_calls} calls) in {len(recorded.groups)} groups")
    return recorded
