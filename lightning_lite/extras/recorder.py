"""What a train.py run records for its live page while it trains (docs/training.md, "Seeing a
run"): each step's per-token training data, and a heartbeat.

    RUN_DIR/tokens/step_K.jsonl   a selection of the samples update K + 1 trained on, each token's
                                  trainer logprob, rollout logprob, ratio, clipped, advantage,
                                  entropy, correction
    RUN_DIR/heartbeat.json        the phase and the rollouts in flight, rewritten every second

Its invariants: a token line holds exactly the numbers the trainer computed for that sample's
trained tokens (positions where its loss mask is 1, in the sample's own positions, whatever the
prefix-tree packing of its micro-batch); the selection is bounded (``WORST`` samples with the
largest |trainer - rollout logprob| and ``RANDOM`` drawn at random, per backward pass and rank), so a
long run's files grow with its steps, not with its batch; the heartbeat file is replaced whole
(written to a temporary file, then renamed), so a reader never sees half of one.

Its seams: ``hooks.TOKEN_RECORDERS`` holds ``TokenRecorder`` (trainer.Learner.backward makes one
per pass and gives it each micro-batch); ``hooks.PROGRESS`` holds ``on_progress`` (train.py, the
rollout runner and the proxy tell it what happens). ``hooks.AFTER_RUN`` holds ``run_done``: the
heartbeat says "done" after the last step.
"""

import atexit
import heapq
import json
import os
import random
import re
import threading
import time
from collections import deque

import torch

from .. import algo, hooks

# The samples a backward pass records, per rank: the worst by max |dlogp|, and a few at random.
WORST = 8
RANDOM = 4
# Floats are written to this many decimals (1e-6: far below any |dlogp| worth reading).
DECIMALS = 6
# How often the heartbeat file is rewritten, and how many finished rollouts it lists.
HEARTBEAT_S = 1.0
FINISHED_KEPT = 256


class Run:
    """The run this process trains, as the "run" event told it (``out`` None: no train.py run, so
    nothing is written: a test's own Learner)."""

    def __init__(self):
        self.out = None
        self.rank = 0
        self.world = 1
        # the steps whose tokens file this process has begun (a second pass of a step appends)
        self.begun = set()

    def suffix(self) -> str:
        """A file's rank suffix, as rundir.RunDir.file names it: under DDP each rank writes its
        own."""
        if self.world > 1:
            return f".rank{self.rank}"
        return ""

    def tokens_path(self, step: int) -> str:
        return os.path.join(self.out, "tokens", f"step_{step}{self.suffix()}.jsonl")

    def heartbeat_path(self) -> str:
        if self.rank:
            return os.path.join(self.out, f"heartbeat.rank{self.rank}.json")
        return os.path.join(self.out, "heartbeat.json")


RUN = Run()


def rounded(values: torch.Tensor) -> list[float]:
    return [round(v, DECIMALS) for v in values.double().tolist()]


def corrections(options: dict, logprobs, old, loss_mask) -> torch.Tensor:
    """[B, T] each token's importance weight times whether a band kept it, as policy_loss applies
    them under ``options`` (a missing option: off)."""
    mode = options.get("rollout_correction", "none")
    c_min = options.get("correction_min", 0.0)
    c_max = options.get("correction_max", 3.0)
    weight, _ = algo.correction_weights(logprobs, old, loss_mask, mode, c_min, c_max)
    bands = (options.get("reject_token"), options.get("reject_seq_mean"))
    return weight * algo.rejection_mask(logprobs, old, loss_mask, *bands)


class TokenRecorder:
    """One backward pass's selection of samples (``add`` each micro-batch), written to
    tokens/step_K.jsonl by ``close``."""

    def __init__(self, version: int, loss_options: dict):
        self.step = version
        self.options = loss_options
        # a min-heap of (max |dlogp|, order, line): the WORST largest seen
        self.worst = []
        # a reservoir of (order, line): RANDOM samples drawn uniformly from all seen
        self.random = []
        self.seen = 0
        self.rng = random.Random(version)

    @torch.no_grad()
    def add(self, samples: list, batch: dict, logprobs: torch.Tensor, entropy: torch.Tensor):
        """One micro-batch: ``samples`` are its [B, T] rows in order (algo.collate), ``logprobs``
        and ``entropy`` the trainer's [B, T], at each sample's own positions (the packing's
        ``where`` already mapped back by algo.trainer_logprobs_and_entropy)."""
        if RUN.out is None:
            return
        mask = batch["loss_mask"] > 0
        old = batch["old_logprobs"]
        dlogp = (logprobs - old).abs() * mask
        largest = dlogp.max(1).values.tolist()
        trained = mask.sum(1).tolist()
        ratio = None
        clipped = None
        for i, sample in enumerate(samples):
            if not trained[i]:
                continue
            order = self.seen
            self.seen += 1
            take_worst = len(self.worst) < WORST or largest[i] > self.worst[0][0]
            take_random = len(self.random) < RANDOM
            slot = None
            if not take_random:
                slot = self.rng.randrange(self.seen)
                take_random = slot < RANDOM
            if not (take_worst or take_random):
                continue
            if ratio is None:
                # [B, T] each: the ratio and clip of algo.policy_loss's own first step
                options = self.options
                _, ratio, clipped = algo.token_loss(
                    logprobs,
                    old,
                    batch["advantages"],
                    batch["loss_mask"],
                    options["loss"],
                    options["clip_low"],
                    options["clip_high"],
                    options["tis_cap"],
                    options["clip_ratio_c"],
                )
                # [B, T]: what the mismatch corrections multiply each token's policy term by
                # (algo.policy_loss; 1 when off)
                correction = corrections(options, logprobs, old, batch["loss_mask"])
            line = self.line(sample, i, batch, logprobs, entropy, ratio, clipped, largest[i])
            line["correction"] = rounded(correction[i, batch["loss_mask"][i] > 0])
            if take_worst:
                heapq.heappush(self.worst, (largest[i], order, line))
                if len(self.worst) > WORST:
                    heapq.heappop(self.worst)
            if take_random:
                if slot is None:
                    self.random.append((order, line))
                else:
                    self.random[slot] = (order, line)

    def line(self, sample, i, batch, logprobs, entropy, ratio, clipped, dlogp_max) -> dict:
        """One sample's line: who it is, and its trained tokens' numbers, position by position."""
        pos = batch["loss_mask"][i].nonzero().flatten()
        positions = pos.tolist()
        return {
            "step": self.step,
            "rank": RUN.rank,
            "rollout_id": sample.rollout_id,
            "calls": sample.calls,
            "split": sample.split,
            "len": len(sample.tokens),
            "weight": round(float(batch["weights"][i]), 9),
            "dlogp_max": round(dlogp_max, DECIMALS),
            "trained": len(positions),
            "pos": positions,
            "token": [sample.tokens[p] for p in positions],
            "logprob": rounded(logprobs[i, pos]),
            "old": rounded(batch["old_logprobs"][i, pos]),
            "ratio": rounded(ratio[i, pos]),
            "clipped": clipped[i, pos].int().tolist(),
            "adv": rounded(batch["advantages"][i, pos]),
            "entropy": rounded(entropy[i, pos]),
            "call": [sample.call[p] for p in positions],
            "version": [sample.version[p] for p in positions],
        }

    def close(self):
        """Write the selection: the worst first (largest |dlogp| first), then the random ones not
        among them. A step's first pass in this process starts its file, a second appends
        (--lora-per-harness: one pass per adapter)."""
        if RUN.out is None:
            return
        worst = sorted(self.worst, key=lambda item: -item[0])
        chosen = {order for _, order, _ in worst}
        lines = []
        for _, _, line in worst:
            lines.append({**line, "why": "worst"})
        for order, line in sorted(self.random, key=lambda item: item[0]):
            if order not in chosen:
                lines.append({**line, "why": "random"})
        path = RUN.tokens_path(self.step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mode = "a"
        if self.step not in RUN.begun:
            mode = "w"
            RUN.begun.add(self.step)
        with open(path, mode) as f:
            for line in lines:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")


# ----------------------------------------------------------------------------- the heartbeat
class Heartbeat:
    """What the run is doing now, from the progress events (any thread: the proxy's, the rollout
    runner's, the trainer's), written to heartbeat.json every ``HEARTBEAT_S`` by a thread of its
    own."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phase = None
        self.step = None
        self.phase_since = None
        # rollout id -> what is known of it while it runs
        self.in_flight = {}
        self.finished = deque(maxlen=FINISHED_KEPT)
        self.thread = None

    def event(self, event: str, info: dict):
        now = time.time()
        with self.lock:
            if event == "phase":
                self.phase = info["phase"]
                self.step = info["step"]
                self.phase_since = now
            elif event == "rollout_start":
                self.in_flight[info["rollout_id"]] = {
                    "rollout_id": info["rollout_id"],
                    "task_id": info["task"].id,
                    "harness": info["harness"].name,
                    "start": now,
                    "calls": 0,
                    "last_call": None,
                }
            elif event == "rollout_end":
                result = info["result"]
                self.in_flight.pop(result.rollout_id, None)
                finished = {
                    "rollout_id": result.rollout_id,
                    "task_id": result.task_id,
                    "harness": result.harness,
                    "reward": result.reward,
                    "error": result.error,
                    "seconds": round(result.seconds, 3),
                    "end": now,
                }
                self.finished.append(finished)
            elif event == "call_start":
                rollout = self.in_flight.get(info["rollout_id"])
                if rollout is not None:
                    rollout["last_call"] = {"state": "generating", "since": now}
            elif event == "call_end":
                call = info["call"]
                rollout = self.in_flight.get(call.rollout_id)
                if rollout is not None:
                    rollout["calls"] += 1
                    rollout["last_call"] = {
                        "state": call.finish_reason,
                        "index": call.index,
                        "tokens": len(call.response_ids),
                        "since": now,
                    }
        if event == "phase" and info["phase"] in ("done", "exited"):
            self.write()

    def snapshot(self) -> dict:
        """The heartbeat's JSON: times are seconds since the epoch, and each rollout's ``seconds``
        its time in flight so far."""
        now = time.time()
        with self.lock:
            in_flight = []
            for rollout in self.in_flight.values():
                row = {**rollout, "seconds": round(now - rollout["start"], 3)}
                in_flight.append(row)
            finished = list(self.finished)
            return {
                "time": now,
                "pid": os.getpid(),
                "rank": RUN.rank,
                "phase": self.phase,
                "step": self.step,
                "phase_since": self.phase_since,
                "in_flight": in_flight,
                "finished": finished,
            }

    def write(self):
        """heartbeat.json replaced whole: a temporary file, then a rename."""
        path = RUN.heartbeat_path()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f, separators=(",", ":"))
        os.replace(tmp, path)

    def beat(self):
        """The writer thread: every HEARTBEAT_S until the process ends (a daemon thread). A write
        that fails (a full disk, the folder removed) is tried again at the next beat."""
        while True:
            try:
                self.write()
            except OSError:
                pass
            time.sleep(HEARTBEAT_S)

    def start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self.beat, name="heartbeat", daemon=True)
            self.thread.start()
            atexit.register(self.exited)

    def exited(self):
        """At the process's end: a run that did not say "done" (a crash, a Ctrl-C, a rank other
        than 0) says "exited", so the page does not wait on it."""
        if self.phase != "done":
            self.event("phase", {"phase": "exited", "step": self.step})


HEARTBEAT = Heartbeat()
STEP_FILE = re.compile(r"step_(\d+)(?:\.rank\d+)?\.jsonl")


def drop_tokens_after(out: str, start_step: int):
    """A resumed run trains the steps from ``start_step`` again: their old token files go, as
    rundir.RunDir.drop_after drops their calls and rollouts."""
    folder = os.path.join(out, "tokens")
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        match = STEP_FILE.fullmatch(name)
        if match and int(match[1]) >= start_step:
            os.remove(os.path.join(folder, name))


def run_done(run_dir: str):
    """hooks.AFTER_RUN: the run finished (train.py's rank 0): the heartbeat says "done"."""
    if HEARTBEAT.thread is not None:
        HEARTBEAT.event("phase", {"phase": "done", "step": HEARTBEAT.step})


def on_progress(event: str, info: dict):
    """hooks.PROGRESS: the "run" event says where to write (and starts the heartbeat); the others
    feed the heartbeat."""
    if event == "run":
        RUN.out = info["out"]
        RUN.rank = info["rank"]
        RUN.world = info["config"]["world_size"]
        if RUN.rank == 0:
            drop_tokens_after(RUN.out, info["config"]["start_step"])
        HEARTBEAT.start()
        return
    HEARTBEAT.event(event, info)


hooks.TOKEN_RECORDERS.append(TokenRecorder)
hooks.PROGRESS.append(on_progress)
hooks.AFTER_RUN.append(run_done)
