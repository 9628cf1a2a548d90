"""The report against a real train.py run: each step's trainable tokens and samples, as the page
and the live page's server give them, compared with what train.py itself wrote (metrics.jsonl, and
the trainer's per-sample records in tokens/step_K.jsonl). tests/test_report.py checks the page on
runs written by hand; this one catches a drift between train.py's count and the report's."""

import base64
import gzip
import json
import os
import subprocess
import sys
import threading
import urllib.request

import pytest

from conftest import ROOT
from lightning_lite.records import read_jsonl

HARNESSES = os.path.join(ROOT, "tests", "harnesses.py")


def page_data(path) -> dict:
    """The DATA object report.py wrote into a report.html."""
    html = open(path).read()
    start = html.index("const DATA = ") + len("const DATA = ")
    return json.loads(html[start : html.index(";</script>", start)])


def unpack(blob: str) -> dict:
    """A batch as report.html stores it: gzip, then base64."""
    return json.loads(gzip.decompress(base64.b64decode(blob)))


def served_batch(run_dir: str, k: int) -> dict:
    """GET /api/batch of step_K from the live page's server of ``run_dir``."""
    from lightning_lite.extras.report import make_server

    server = make_server([run_dir], "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api/batch?run=0&kind=step&k={k}"
    try:
        with urllib.request.urlopen(url) as response:
            return json.loads(response.read())
    finally:
        server.shutdown()
        server.server_close()


def sample_counts(batch: dict) -> dict:
    """{(rollout id, its calls): trainable tokens} of the batch's samples in rollouts it says
    trained, as the page draws them (a sample's loss mask)."""
    counts = {}
    for rollout in batch["rollouts"]:
        if rollout["trained"]:
            for s in rollout["samples"]:
                counts[(rollout["rollout_id"], tuple(s["calls"]))] = sum(s["mask"])
    return counts


@pytest.mark.slow  # one train.py step: ~1.7 min of CPU; 4-7 min on 2 cores under a load of 7-8
def test_each_steps_trained_tokens_are_what_train_py_counted(tmp_path):
    """One train.py step of BranchingHarness (each rollout: two samples, one of two merged calls)
    under --max-seq-len 76, which cuts every second sample after its first call. The step's
    trainable tokens and samples in the report.html that train.py wrote, and in the live server's
    /api/batch, equal metrics.jsonl's `trainable_tokens` and `samples`; the tokens drawn trained sum
    to them (to 0 had the update been skipped); and each sample's trainable tokens equal the
    trainer's own record of that sample (tokens/step_0.jsonl: with 8 samples a step, the recorder
    keeps every one)."""
    out = str(tmp_path / "run")
    args = [sys.executable, "train.py", "--harness", HARNESSES + ":BranchingHarness"]
    args += ["--steps", "1", "--batch-size", "2", "--group-size", "2", "--eval-tasks", "0"]
    # A rollout's 3 calls took over the default 300 s on 2 cores under a load of 8.
    args += ["--max-concurrency", "4", "--rollout-timeout", "900", "--max-seq-len", "76"]
    p = subprocess.run(
        args + ["--out", out], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
    assert row["failed"] == 0
    # The limit cut samples: a report that ignored the run's --max-seq-len would count more.
    assert row["truncated"] + row["dropped"] > 0
    # The trainer's records of the step (none where its update was skipped: its seeded replies
    # gave no group a reward spread): every sample it trained, with its trained positions.
    trainer = {}
    if not row["skipped"]:
        records = read_jsonl(os.path.join(out, "tokens", "step_0.jsonl"))
        trainer = {(r["rollout_id"], tuple(r["calls"])): r["trained"] for r in records}
        assert len(trainer) == row["samples"] and sum(trainer.values()) == row["trainable_tokens"]

    (meta,) = page_data(os.path.join(out, "report.html"))["batches"]
    assert (meta["kind"], meta["metrics_step"]) == ("step", 1)
    trained = 0 if row["skipped"] else row["trainable_tokens"]
    for batch in (unpack(meta["blob"]), served_batch(out, 0)):
        counts = batch["counts"]
        assert counts["trainable_tokens"] == row["trainable_tokens"], (counts, row)
        assert counts["samples"] == row["samples"], (counts, row)
        assert counts["trained_tokens"] == trained
        assert sum(r["trainable"] for r in batch["rollouts"] if r["trained"]) == trained
        if trainer:
            assert sample_counts(batch) == trainer
