"""Training signals beyond one reward per rollout (README "Training signals"), end to end on the embedded model:
per-call rewards, several harnesses in one run and groups across them, training from calls proxy.py recorded, sft."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import requests

from conftest import ROOT

from lightning_lite import algo
from lightning_lite.extras.from_calls import read_recorded
from lightning_lite.records import read_calls, read_jsonl
from lightning_lite.samples import build_samples

HARNESSES = os.path.join(ROOT, "tests", "harnesses.py")


def train(args, ok=True, timeout=600):
    p = subprocess.run(
        [sys.executable, "train.py"] + args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert (p.returncode == 0) == ok, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout + p.stderr


def step_rows(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]


def recomputed(out, estimator, **kw):
    """The advantages of step 0 recomputed from what the run wrote (rewards, groups, call rewards, calls)."""
    rolls = list(read_jsonl(os.path.join(out, "rollouts", "step_0.jsonl")))
    calls = read_calls(os.path.join(out, "calls", "step_0.jsonl"))
    groups = kw.pop("groups", lambda r: f"{r['harness']}/{r['task_id']}")
    adv, _ = algo.compute_advantages(
        {r["rollout_id"]: r["reward"] for r in rolls},
        {r["rollout_id"]: groups(r) for r in rolls},
        estimator,
        call_rewards={
            r["rollout_id"]: {int(k): v for k, v in r["call_rewards"].items()} for r in rolls
        },
        calls={
            r["rollout_id"]: [c.index for c in calls if c.rollout_id == r["rollout_id"]]
            for r in rolls
        },
        **kw,
    )
    return rolls, adv


def as_written(adv):  # JSON keys are strings
    return {str(k): v for k, v in adv.items()} if isinstance(adv, dict) else adv


@pytest.mark.slow  # ~25-35 s: make test-slow
def test_per_call_rewards_through_two_harnesses_in_proportion(tmp_path):
    """--harness percall --harness length:2: the step draws 1 and 2 tasks; per-call rewards (one POSTed by index, one
    returned by reply id) are recorded by call index, --adv returns gives each call its discounted return, and the
    metrics and the evaluation report each harness on its own."""
    out = str(tmp_path / "run")
    log = train(
        [
            "--harness",
            HARNESSES + ":PerCallHarness",
            "--harness",
            HARNESSES + ":LengthHarness:2",
            "--adv",
            "returns",
            "--gamma",
            "0.5",
            "--steps",
            "1",
            "--batch-size",
            "3",
            "--group-size",
            "2",
            "--eval-tasks",
            "1",
            "--lr",
            "1e-4",
            "--out",
            out,
        ]
    )
    (row,) = step_rows(out)
    rolls, adv = recomputed(out, "returns", gamma=0.5)
    by = {h: [r for r in rolls if r["harness"] == h] for h in ("percall", "length")}
    assert (
        len(by["percall"]) == 2
        and len(by["length"]) == 4
        and row["failed"] == 0
        and row["grad_norm"] > 0
    )
    for r in by[
        "percall"
    ]:  # call 0's reward POSTed, call 1's returned under its reply id: both by index now
        assert (
            sorted(r["call_rewards"]) == ["0", "1"]
            and r["call_rewards"]["1"] <= 0 <= r["call_rewards"]["0"]
        )
    assert all(r["call_rewards"] == {} for r in by["length"])
    assert all(as_written(adv[r["rollout_id"]]) == pytest.approx(r["advantage"]) for r in rolls)
    assert all(
        isinstance(r["advantage"], dict)
        and len(r["advantage"]) == (2 if r["harness"] == "percall" else 1)
        for r in rolls
    )
    assert (row["calls_per_rollout/percall"], row["calls_per_rollout/length"]) == (2.0, 1.0)
    for h in ("percall", "length"):
        rewards = [r["reward"] for r in by[h]]
        assert (
            row[f"reward/{h}"] == pytest.approx(sum(rewards) / len(rewards))
            and row[f"merge_ratio/{h}"] >= 1.0
            and f"splits/{h}" in row
        )
    evals = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "eval_reward" in r]
    assert len(evals) == 2 and all(
        "eval_reward/percall" in e and "eval_reward/length" in e and e["eval_tasks"] == 2
        for e in evals
    )
    assert "harness percall" in log and "harness length" in log and " | percall " in log
    # the run as --from-calls reads it: its step's calls and rewards (not its evaluations'), its groups kept
    model, calls, rewards = read_recorded(out)
    assert (
        model == "smollm2"
        and len(calls) == row["calls"]
        and len({c.rollout_id for c in calls}) == len(rewards) == 6
    )
    assert all(
        rewards[r["rollout_id"]]
        == {
            "reward": r["reward"],
            "calls": {int(k): v for k, v in r["call_rewards"].items()},
            "group": f"0/{r['harness']}/{r['task_id']}",
        }
        for r in rolls
    )


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_groups_across_harnesses(tmp_path):
    """--group-across-harnesses: the two harnesses run the same tasks, each task's group of 4 holds 2 rollouts of each,
    and grpo-step's advantages are computed over those mixed groups."""
    out = str(tmp_path / "run")
    train(
        [
            "--harness",
            HARNESSES + ":PerCallHarness",
            "--harness",
            HARNESSES + ":LengthHarness",
            "--group-across-harnesses",
            "--adv",
            "grpo-step",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--group-size",
            "4",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    rolls, adv = recomputed(out, "grpo-step", groups=lambda r: r["task_id"])
    tasks = {r["task_id"] for r in rolls}
    assert len(tasks) == 2 and len(rolls) == 8
    for t in tasks:
        assert sorted(r["harness"] for r in rolls if r["task_id"] == t) == [
            "length",
            "length",
            "percall",
            "percall",
        ]
    assert all(as_written(adv[r["rollout_id"]]) == pytest.approx(r["advantage"]) for r in rolls)
    # not what groups within one harness would give
    _, apart = recomputed(out, "grpo-step")
    assert any(as_written(apart[r["rollout_id"]]) != pytest.approx(r["advantage"]) for r in rolls)
    # a group too small to hold a rollout of each harness is refused, saying why
    log = train(
        [
            "--harness",
            HARNESSES + ":PerCallHarness",
            "--harness",
            HARNESSES + ":LengthHarness:4",
            "--group-across-harnesses",
            "--group-size",
            "2",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "small"),
        ],
        ok=False,
    )
    assert (
        "--group-size is too small to give each of the 2 harnesses (weights 1, 4) a rollout in every group"
        in log
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """proxy.py served two tasks, three rollouts each, and took rewards while serving: per rollout (with a task), per
    call (by index and by reply id), a rollout rewarded per call only, and one never rewarded."""
    out = tmp_path_factory.mktemp("served") / "proxy"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "proxy.py"),
            "--port",
            str(port),
            "--out",
            str(out),
            "--max-new-tokens",
            "12",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/rollout/{{}}"
    try:
        for _ in range(240):
            try:
                requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.5)
        for t, topic in enumerate(("rivers", "bread")):
            for g in range(3):
                rid = f"user{t}-{g}"
                c = openai.OpenAI(base_url=url.format(rid) + "/v1", api_key="x", max_retries=0)
                msgs = [{"role": "user", "content": f"Tell me about {topic}."}]
                first = c.chat.completions.create(
                    model="smollm2", messages=msgs, temperature=1.0, top_p=0.9
                )
                msgs += [
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Shorter."},
                ]
                c.chat.completions.create(model="smollm2", messages=msgs, temperature=0.7)
                if g < 2:  # the thumbs a deployment sends later
                    assert (
                        requests.post(
                            url.format(rid) + "/reward", json={"reward": float(g), "task": f"t{t}"}
                        ).status_code
                        == 200
                    )
                assert (
                    requests.post(
                        url.format(rid) + "/reward",
                        json={"reward": 0.5 - g, "call": first.id, "task": f"t{t}"},
                    ).status_code
                    == 200
                )
        c = openai.OpenAI(base_url=url.format("lurker") + "/v1", api_key="x", max_retries=0)
        c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hello?"}])
    finally:
        p.send_signal(signal.SIGINT)
        log, _ = p.communicate(timeout=60)
    assert p.returncode == 0, log
    return str(out)


# make test-slow, beside the other two tests that take `recorded`: the fixture (proxy.py started, served and
# stopped) is then built in one session of CI, not in make test's and again in test-slow's.
@pytest.mark.slow  # ~60 s, and `recorded`'s ~60-150 s when it runs first
def test_from_calls_trains_on_what_proxy_py_recorded_with_the_rewards_it_took(recorded, tmp_path):
    out = str(tmp_path / "run")
    log = train(
        [
            "--from-calls",
            recorded,
            "--adv",
            "grpo-step",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--lr",
            "1e-4",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    (row,) = step_rows(out)
    # 6 rewarded rollouts (user*-2 per call only: reward 0) of 2 calls; the lurker, never rewarded, is not trained
    assert (
        row["rollouts"] == 6
        and row["calls"] == 12
        and row["trainable_tokens"] > 0
        and row["grad_norm"] > 0
    )
    # The recorded calls are of these weights: |dlogp| at fp32 noise (here mean 5e-6, max 5e-5). The
    # max may reach ~2e-3 where a token sits at the top-p nucleus's edge (docs/serving.md; seen once
    # in CI), so the mean is what tells these weights from others.
    assert row["dlogp_mean"] < 1e-4 and row["dlogp_max"] < 1e-2
    assert row["staleness"] == {"0": row["trainable_tokens"]}
    assert (
        "--from-calls: 6 rollouts (12 calls) in 2 groups" in log
        and "12 recorded calls, 0 updates stale" in log
    )
    assert (
        len(read_calls(os.path.join(out, "calls", "step_0.jsonl"))) == 12
    )  # as a harness step's: the report shows them
    rolls = {r["rollout_id"]: r for r in read_jsonl(os.path.join(out, "rollouts", "step_0.jsonl"))}
    assert rolls["user1-2"]["reward"] == 0.0 and rolls["user1-2"]["call_rewards"] == {"0": -1.5}
    # task t0: rewards 0, 1, 0 -> grpo -0.577, 1.155, -0.577; first calls rewarded 0.5, -0.5, -1.5 -> (r + 0.5) / 1
    assert rolls["user0-0"]["advantage"] == {
        "0": pytest.approx(-0.57735 + 1.0, abs=1e-5),
        "1": pytest.approx(-0.57735, abs=1e-5),
    }
    assert rolls["user0-2"]["advantage"] == {
        "0": pytest.approx(-0.57735 - 1.0, abs=1e-5),
        "1": pytest.approx(-0.57735, abs=1e-5),
    }


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_sft_on_recorded_traces_lowers_their_loss(recorded, tmp_path):
    """--loss sft with no --sft-min-reward imitates every recorded rollout, the unrewarded one too: two steps on the
    same three groups, and the second step's loss (their mean negative logprob) is lower. (A small lr: Adam's first
    step moves every weight by about lr, and at 3e-4 that overshot once, the loss going up.)"""
    out = str(tmp_path / "run")
    train(
        [
            "--from-calls",
            recorded,
            "--loss",
            "sft",
            "--steps",
            "2",
            "--batch-size",
            "3",
            "--lr",
            "3e-5",
            "--warmup-steps",
            "0",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    first, second = step_rows(out)
    assert (
        first["rollouts"] == second["rollouts"] == 7
        and first["trainable_tokens"] == second["trainable_tokens"]
    )
    assert second["loss"] < first["loss"] - 0.05, (first["loss"], second["loss"])
    # --sft-min-reward 1: rejection sampling keeps the rollouts rewarded 1 (user0-1, user1-1) alone
    out = str(tmp_path / "rft")
    train(
        [
            "--from-calls",
            recorded,
            "--loss",
            "sft",
            "--sft-min-reward",
            "1",
            "--steps",
            "1",
            "--batch-size",
            "3",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    (row,) = step_rows(out)
    rolls = list(read_jsonl(os.path.join(out, "rollouts", "step_0.jsonl")))
    kept = {"user0-1", "user1-1"}
    assert {r["rollout_id"] for r in rolls if r["advantage"] is not None} == kept
    # their samples alone: one a rollout, or two where the reply did not render back as sampled
    # (the proxy's sampled text decides: a template_mismatch split)
    calls = [c for c in read_calls(os.path.join(recorded, "calls.jsonl")) if c.rollout_id in kept]
    samples_of = [build_samples([c for c in calls if c.rollout_id == rid])[0] for rid in kept]
    assert row["samples"] == sum(len(samples) for samples in samples_of) >= 2


@pytest.mark.slow  # ~25-35 s: make test-slow
def test_from_calls_refuses_what_it_cannot_train_exactly(recorded, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(recorded, other)
    json.dump({"model": "/models/another"}, open(os.path.join(other, "proxy.json"), "w"))
    log = train(["--from-calls", other, "--steps", "1", "--out", str(tmp_path / "a")], ok=False)
    assert "sampled by /models/another, not --model smollm2" in log and "--loss sft" in log
    untasked = str(
        tmp_path / "untasked"
    )  # rewards POSTed without a task: every rollout a group of one
    shutil.copytree(recorded, untasked)
    lines = [
        {k: v for k, v in r.items() if k != "task"}
        for r in read_jsonl(os.path.join(recorded, "rewards.jsonl"))
    ]
    open(os.path.join(untasked, "rewards.jsonl"), "w").writelines(
        json.dumps(r) + "\n" for r in lines
    )
    log = train(
        ["--from-calls", untasked, "--adv", "grpo", "--steps", "1", "--out", str(tmp_path / "b")],
        ok=False,
    )
    assert "every rollout is a group of its own" in log and "--adv reinforce" in log
    os.remove(os.path.join(other, "rewards.jsonl"))
    log = train(
        [
            "--from-calls",
            other,
            "--loss",
            "sft",
            "--sft-min-reward",
            "0",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "c"),
        ],
        ok=False,
    )
    assert "no rewarded rollout" in log
