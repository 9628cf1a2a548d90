"""Peak memory of a train.py run, by phase, against its floor.

    python bench/memory.py                    # the instruct demo's settings, 2 steps: full and --lora 16
    python bench/memory.py -- --harness calc  # train.py flags after "--" replace the run's
    python bench/memory.py --smoke            # a tiny calc run, for the tests: numbers mean little

Each run is train.py itself, in a child process of this script, with a thread that reads the process's
resident memory (VmRSS, every 10 ms) and the phase train.py is in: which is known by wrapping the functions
train.py calls for it (harness.run_rollouts: rollouts, or evaluation when its progress bar says "eval";
trainer.Learner.update: the update, backward and AdamW step; the backend's sync_weights; Learner.save).
The table: per phase, its peak resident memory over the run and (+) the most it grew within one of its
occurrences (what the phase itself allocates, over what the run held when it began); and the floor, what a
full fine-tune must hold (fp32 weights, gradients and AdamW's two moments: 16 bytes per trained parameter,
4 per frozen one).
Memory is measured, not time, so a busy machine changes little but the run's length.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The instruct demo's settings (Makefile: demo-instruct), two steps and a small evaluation.
INSTRUCT = ["--harness", "instruct", "--batch-size", "4", "--group-size", "8", "--lr", "2e-5"]
INSTRUCT += ["--max-concurrency", "32", "--steps", "2", "--eval-tasks", "8", "--eval-every", "2"]
# --smoke: one step, no LoRA row and no evaluation (the rollouts' wrapper times it too), in seconds.
SMOKE = ["--harness", "calc", "--harness-arg", "max_tokens=8", "--batch-size", "1"]
SMOKE += ["--group-size", "2", "--steps", "1", "--eval-tasks", "0"]

# Run in the child: train.py under the phase-tagging wrappers and the sampler thread. It writes
# {"phases": {name: [peak GB, largest growth within one occurrence GB]}, "trained": n, "frozen": n}
# as JSON to argv[1].
CHILD = r"""
import json, os, runpy, sys, threading, time
sys.path.insert(0, os.getcwd())
import lightning_lite.extras.embedded
from lightning_lite import backends, harness, trainer

out_path = sys.argv[1]
# The phases entered and not yet left, innermost last: [name, rss at its start, its peak so far].
# "between" is outside every wrapped one (samples, advantages, logging).
phases = {}

def rss_gb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20

stack = [["between", rss_gb(), rss_gb()]]

def note():
    now = rss_gb()
    entry = stack[-1]
    entry[2] = max(entry[2], now)
    peak, growth = phases.get(entry[0], (0.0, 0.0))
    phases[entry[0]] = [max(peak, now), max(growth, entry[2] - entry[1])]

def sample():
    while True:
        note()
        time.sleep(0.01)

def enter(name):
    now = rss_gb()
    stack.append([name, now, now])
    note()

def leave():
    note()
    stack.pop()

def tagged(name, fn):
    def wrapper(*args, **kwargs):
        enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            leave()
    return wrapper

async def rollouts(*args, **kwargs):
    enter("evaluation" if "eval" in kwargs.get("desc", "") else "rollouts")
    try:
        return await run_rollouts(*args, **kwargs)
    finally:
        leave()

run_rollouts = harness.run_rollouts
harness.run_rollouts = rollouts
trainer.Learner.update = tagged("update", trainer.Learner.update)
trainer.Learner.save = tagged("checkpoint", trainer.Learner.save)
backends.HFBackend.sync_weights = tagged("sync", backends.HFBackend.sync_weights)
learner_init = trainer.Learner.__init__
counts = {}

def init(self, *args, **kwargs):
    learner_init(self, *args, **kwargs)
    params = list(self.model.parameters())
    counts["trained"] = sum(p.numel() for p in params if p.requires_grad)
    counts["frozen"] = sum(p.numel() for p in params if not p.requires_grad)

trainer.Learner.__init__ = tagged("model load", init)
threading.Thread(target=sample, daemon=True).start()
sys.argv = ["train.py"] + sys.argv[2:]
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    note()
    with open(out_path, "w") as f:
        f.write(json.dumps({"phases": phases, **counts}))
"""


def measure(flags: list[str]) -> dict:
    """train.py with ``flags`` (and its own --out) in a child process: the phases' memory."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "memory.json")
        cmd = [sys.executable, "-c", CHILD, result] + flags + ["--out", os.path.join(tmp, "run")]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(result):
            raise SystemExit(f"train.py {' '.join(flags)} failed:\n{p.stderr[-3000:]}")
        with open(result) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny calc run: for the tests")
    ap.add_argument("--lora", type=int, default=16, help="the rank of the LoRA row; 0: none")
    ap.add_argument("flags", nargs="*", help="train.py's flags, after --: replace the run's")
    a = ap.parse_args()
    flags = a.flags or INSTRUCT
    if a.smoke:
        flags = SMOKE
    runs = [("full", flags)]
    if a.lora and not a.smoke:
        runs.append((f"--lora {a.lora}", flags + ["--lora", str(a.lora)]))
    order = ["model load", "rollouts", "update", "sync", "evaluation", "checkpoint", "between"]
    print(f"train.py {' '.join(flags)}\n")
    print("| run | floor GB | " + " | ".join(order) + " | peak GB | peak / floor |")
    print("|---" * (len(order) + 4) + "|")
    for name, run_flags in runs:
        got = measure(run_flags)
        # fp32 weights, gradients and AdamW's two moments per trained parameter; weights per frozen one
        floor = (16 * got["trained"] + 4 * got["frozen"]) / 2**30
        cells = []
        for phase in order:
            if phase in got["phases"]:
                peak, growth = got["phases"][phase]
                cells.append(f"{peak:.2f} (+{growth:.2f})")
            else:
                cells.append("")
        peak = max(p for p, _ in got["phases"].values())
        print(
            f"| {name} | {floor:.2f} | "
            + " | ".join(cells)
            + f" | {peak:.2f} | {peak / floor:.1f}x |"
        )


if __name__ == "__main__":
    main()
