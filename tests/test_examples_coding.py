"""The coding examples (examples/swe: mini-swe-agent, examples/openhands: OpenHands SDK).

Fast: the scorer on known-good and known-bad solutions, and the rollout lifecycle with
a fake agent (no model). Then one train.py step through each real harness on the
embedded model; without its harness venv each skips with one line, and fails under CI
(conftest.require: .ci/run installs the harnesses before make test).
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, require
from lightning_lite.extras.sandbox import Sandbox
from examples.swe.tasks import (
    FAMILIES,
    CodingHarness,
    make_tasks,
    score,
    write_solution,
    write_workspace,
)


@pytest.fixture(scope="module")
def tasks():
    return make_tasks()


def one_per_family(tasks):
    return list({t.meta["family"]: t for t in tasks["train"]}.values())


def test_task_set_is_deterministic_split_and_varied(tasks):
    assert len(tasks["train"]) >= 60 and len(tasks["test"]) >= 10
    again = make_tasks()
    assert [t.answer for t in again["train"]] == [t.answer for t in tasks["train"]]
    train = {json.dumps(t.answer["files"]) + t.answer["hidden"] for t in tasks["train"]}
    assert not train & {json.dumps(t.answer["files"]) + t.answer["hidden"] for t in tasks["test"]}
    assert {t.meta["family"] for t in tasks["train"]} == {f.__name__ for f in FAMILIES}
    assert {t.meta["difficulty"] for t in tasks["train"]} == {1, 2, 3}
    for t in tasks["train"]:  # the workspace never holds the hidden tests
        assert "hidden" not in "".join(t.answer["tests"]) and t.answer["f2p"] >= 1


def test_fix_scores_1_empty_change_0_edited_tests_0(tasks, tmp_path):
    for i, t in enumerate(one_per_family(tasks)):
        repo = tmp_path / str(i)
        repo.mkdir()
        write_workspace(t, repo)
        assert not (repo / ".git").exists() and not (repo / "hidden_tests.py").exists()
        assert score(t, repo) == 0.0, t.id  # empty change
        for name in t.answer["tests"]:  # "fix" the tests instead of the code: restored for scoring
            (repo / name).write_text("import unittest\n")
        (repo / "hidden_tests.py").write_text("")  # a planted file is ignored too
        assert score(t, repo) == 0.0, t.id
        write_solution(t, repo)
        assert score(t, repo) == 1.0, t.id


def test_partial_credit_and_broken_code(tasks, tmp_path):
    t = next(t for t in tasks["train"] if t.meta["family"] == "two_files")
    write_workspace(t, tmp_path)
    (tmp_path / "pricing.py").write_text(
        t.answer["solution"]["pricing.py"]
    )  # one of the two bugs fixed
    assert 0.0 < score(t, tmp_path) < 1.0
    (tmp_path / "cart.py").write_text(
        "import time\ntime.sleep(60)\n"
    )  # a hang scores 0, within the timeout
    assert score(t, tmp_path, timeout=2) == 0.0
    t = next(t for t in tasks["train"] if t.answer["p2p"])
    write_workspace(t, tmp_path)
    for name in t.answer["files"]:  # breaks what worked (PASS_TO_PASS): 0
        (tmp_path / name).write_text("")
    assert score(t, tmp_path) == 0.0


class FakeAgent(CodingHarness):
    """Writes the reference fix (or nothing) and leaves a process behind in its own session."""

    name = "fake"
    sandbox = Sandbox()  # the host: the lifecycle, not the sandbox, is tested here

    def __init__(self, fix=True):
        super().__init__(n_train=4, n_test=0)
        self.fix = fix

    def agent(self, task, endpoint, repo, home):
        code = (
            "import json, os, subprocess, sys\n"
            "subprocess.Popen(['sleep', '300.4217'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"  # escapes the group
            f"files = json.loads({json.dumps(json.dumps(task.answer['solution'] if self.fix else {}))})\n"
            f"for name, text in files.items(): open(os.path.join({str(repo)!r}, name), 'w').write(text)\n"
        )  # cwd: repo/ and home/
        return [sys.executable, "-c", code], {}


@pytest.mark.parametrize("fix", [True, False])
def test_rollout_lifecycle_with_a_fake_agent(fix):
    from lightning_lite.harness import Endpoint, run_rollouts

    h = FakeAgent(fix)
    jobs = [(f"fake-{i}", t, h) for i, t in enumerate(h.tasks("train"))]
    endpoint_for = lambda rid: Endpoint(
        "http://127.0.0.1:9/v1", "k", "m", rid, "http://127.0.0.1:9"
    )  # noqa: E731
    results = asyncio.run(run_rollouts(jobs, endpoint_for, timeout=60, progress=False))
    assert [r.reward for r in results] == [float(fix)] * 4, results
    assert not h._roots and not list(
        Path("/tmp").glob("ll-coding-fake-*")
    )  # every rollout directory is gone
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert (
        "sleep 300.4217" not in ps
    )  # the escaped process was killed too (an odd duration: no other process's)


# ---------------------------------------------------------------------------- the real harnesses


def train_one_step(tmp_path, tasks, harness, venv, install, extra):
    require(
        os.path.exists(os.path.join(ROOT, ".harnesses", venv, "bin", "python")),
        f"{harness}: .harnesses/{venv} is not installed (run {install})",
    )
    out = str(tmp_path / "run")
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--harness",
            harness,
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--max-new-tokens",
            "64",
            "--out",
            out,
        ]
        + extra,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_0.jsonl"))]
    assert row["rollouts"] == 2 and row["failed"] == 0, p.stderr[-5000:]
    assert len({c["rollout_id"] for c in calls}) == 2 and row["calls"] == len(calls)
    # --max-seq-len must hold the first prompt, or the rollout's samples are dropped (not counted in metrics)
    assert row["samples"] >= 2 and row["trainable_tokens"] > 0
    # Each rollout's reward is the scorer's: the share of its task's f2p hidden tests that pass, so a
    # whole number of f2p-ths (a reward from elsewhere, e.g. the agent's own POST, would not be); the
    # step's reward is their mean.
    rollouts = [json.loads(line) for line in open(os.path.join(out, "rollouts", "step_0.jsonl"))]
    f2p = {t.id: t.answer["f2p"] for t in tasks["train"]}
    assert len(rollouts) == 2 and all(r["task_id"] in f2p for r in rollouts), rollouts
    for r in rollouts:
        k = r["reward"] * f2p[r["task_id"]]
        assert abs(k - round(k)) < 1e-9 and 0 <= round(k) <= f2p[r["task_id"]], r
    assert row["reward"] == pytest.approx(sum(r["reward"] for r in rollouts) / 2)
    return row


def test_train_step_through_mini_swe_agent(tmp_path, tasks):
    """One train.py step of examples/swe through mini-swe-agent on the embedded model: both rollouts
    run, their calls are recorded and trained on, and their rewards are the scorer's."""
    train_one_step(
        tmp_path,
        tasks,
        "swe",
        "mini-swe-agent-venv",
        "tests/real_harnesses/install.sh mini-swe-agent",
        ["--harness-arg", "step_limit=2", "--max-seq-len", "8192", "--rollout-timeout", "600"],
    )


def test_train_step_through_openhands(tmp_path, tasks):
    """The same through the OpenHands SDK (examples/openhands)."""
    train_one_step(
        tmp_path,
        tasks,
        "openhands",
        "openhands-venv",
        "tests/real_harnesses/install.sh openhands",
        [
            "--harness-arg",
            "max_steps=2",
            "--max-model-len",
            "16384",
            "--max-seq-len",
            "16384",
            "--rollout-timeout",
            "600",
        ],
    )
