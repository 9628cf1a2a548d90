"""train.py end to end on the embedded model: DDP on two CPU processes, resume, failures, harness kinds."""

import asyncio
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

from lightning_lite.records import read_calls, read_jsonl

HARNESSES = os.path.join(ROOT, "tests", "harnesses.py")
TINY = ["--batch-size", "2", "--group-size", "3", "--eval-tasks", "2", "--max-concurrency", "8"]


def run(args, timeout=600):
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout + p.stderr


def rows(out):
    return list(read_jsonl(os.path.join(out, "metrics.jsonl")))


@pytest.mark.slow  # minutes: two torchrun runs of the calc agent
def test_torchrun_two_ranks_on_calc_then_resume(tmp_path, model):
    """Two DDP ranks (gloo) train on calc's single-call agent (reward: the answer's score; the untrained model
    answers ~13% right and often in the right format, so most groups of 6 have a reward spread to learn
    from; the multi-turn agent's untrained rewards are nearly all 0)."""
    out = str(tmp_path / "run")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train.py",
    ]
    calc = [
        "--harness",
        "calc",
        "--harness-arg",
        "max_tokens=32",
        "--harness-arg",
        "tool_first=False",
        "--batch-size",
        "4",
        "--group-size",
        "6",
        "--eval-tasks",
        "2",
        "--lr",
        "5e-5",
    ]
    run(torchrun + calc + ["--steps", "2", "--save-every", "1", "--out", out])
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollouts"] == 24 and r["failed"] == 0 and r["samples"] >= 24 for r in steps)
    assert any(r["grad_norm"] for r in steps)  # null: a skipped update
    assert len([r for r in rows(out) if "eval_reward" in r]) == 2  # before and after
    for step in (0, 1):
        for rank in (0, 1):
            calls = [
                json.loads(line)
                for line in open(os.path.join(out, "calls", f"step_{step}.rank{rank}.jsonl"))
            ]
            assert len({c["rollout_id"] for c in calls}) == 12 and {
                c["model_version"] for c in calls
            } == {step}
            rolls = [
                json.loads(line)
                for line in open(os.path.join(out, "rollouts", f"step_{step}.rank{rank}.jsonl"))
            ]
            assert {r["rollout_id"] for r in rolls} == {c["rollout_id"] for c in calls} and all(
                r["error"] is None and r["advantage"] is not None for r in rolls
            )
    assert (
        len(open(os.path.join(out, "rollouts", "eval_0.rank0.jsonl")).readlines()) == 1
    )  # 2 eval tasks over 2 ranks
    assert json.load(open(os.path.join(out, "config.json")))["world_size"] == 2
    assert os.path.exists(os.path.join(out, "report.html"))
    # the checkpoint is a transformers model, and training changed it
    from transformers import AutoModelForCausalLM

    ckpt = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoints", "step_2"))
    changed = [
        n for (n, a), b in zip(ckpt.named_parameters(), model.parameters()) if not torch.equal(a, b)
    ]
    assert len(changed) > 10
    # --resume continues at step 2 with the optimizer state and the same data order
    run(
        torchrun
        + calc
        + ["--steps", "3", "--resume", "--eval-tasks", "0", "--keep-checkpoints", "1", "--out", out]
    )
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert json.load(open(os.path.join(out, "config.json")))["start_step"] == 2
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step_3"
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [
        "latest",
        "step_3",
    ]  # --keep-checkpoints 1


@pytest.mark.slow  # minutes: a killed run, then --resume
def test_a_run_killed_between_checkpoints_resumes_without_losing_or_repeating_a_step(tmp_path):
    """SIGKILL after step 3 of 4 (checkpoint at step 2), and a torn line in metrics.jsonl: --resume redoes
    step 3 on the same tasks, and the run's files hold each step once."""
    import signal
    import time

    out = tmp_path / "run"
    args = [
        sys.executable,
        "train.py",
        "--harness",
        HARNESSES + ":LengthHarness",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--eval-tasks",
        "0",
        "--out",
        str(out),
    ]
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while (
            not [
                r for r in (rows(out) if (out / "metrics.jsonl").exists() else []) if r["step"] == 3
            ]
            and time.time() < deadline
            and p.poll() is None
        ):
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    finally:
        p.kill()
    assert (out / "checkpoints" / "latest").read_text() == "step_2"
    tasks = sorted(r["task_id"] for r in map(json.loads, open(out / "rollouts" / "step_2.jsonl")))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # as if killed mid-write
    run(args + ["--resume"])
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
    calls = read_calls(str(out / "calls" / "step_2.jsonl"))
    assert (
        len(calls) == 4
        and len({c.rollout_id for c in calls}) == 4
        and {c.model_version for c in calls} == {2}
    )
    assert (
        sorted(r["task_id"] for r in map(json.loads, open(out / "rollouts" / "step_2.jsonl")))
        == tasks
    )  # the same data


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_failing_rollouts_are_reported_and_training_goes_on(tmp_path):
    out = str(tmp_path / "run")
    log = run(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":FlakyHarness",
            "--steps",
            "1",
            "--batch-size",
            "6",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--rollout-timeout",
            "20",
            "--out",
            out,
        ]
    )
    (step,) = rows(out)
    assert (
        step["rollouts"] == 12
        and step["failed"] == 6
        and step["samples"] == 6
        and step["grad_norm"] > 0
    )
    assert (
        "the harness crashed on purpose" in log and "timeout after 20" in log and "no reward" in log
    )


@pytest.mark.slow  # ~20 s, one train.py run: make test-slow (make test was at its 10 minutes)
def test_each_evaluation_draws_the_same_replies_for_a_task(tmp_path):
    """An evaluation's calls ask for no seed, so the proxy gives each one its task's (from --seed
    and the task; Proxy.seeds): under unchanged weights (--lr 0) the evaluations before and after a
    step sample the same replies, though their 4 rollouts run at once and the step's rollouts drew
    from the backend's generator in between (without the seeds, the replies differed)."""
    out = str(tmp_path / "run")
    flags = ["--harness", HARNESSES + ":LengthHarness", "--steps", "1", "--batch-size", "2"]
    flags += ["--group-size", "2", "--eval-tasks", "4", "--max-concurrency", "4", "--lr", "0"]
    run([sys.executable, "train.py", *flags, "--out", out])

    def replies(step):
        calls = read_calls(os.path.join(out, "calls", f"eval_{step}.jsonl"))
        # "eval{step}-r0-{i}": the task's position, the same at every evaluation
        return {c.rollout_id.split("-")[-1]: c.response_ids for c in calls}

    assert len(replies(0)) == 4 and replies(0) == replies(1)


def test_batch_must_divide_over_ranks(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "train.py",
            "--harness",
            "calc",
            "--batch-size",
            "3",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "--batch-size 3 does not divide over 2 ranks" in p.stderr


def test_subprocess_harness_calls_land_in_its_rollout(server):
    from lightning_lite.harness import Endpoint, load_harness, run_rollouts

    h = load_harness(HARNESSES + ":ScriptHarness")
    jobs = [(f"sub-{i}", t, h) for i, t in enumerate(h.tasks("train")[:2])]
    endpoint_for = lambda rid: Endpoint(server.base_url(rid), "sk-sub", "smollm2", rid, server.url)  # noqa: E731
    results = asyncio.run(run_rollouts(jobs, endpoint_for, timeout=120, progress=False))
    assert all(r.error is None and r.reward is not None for r in results), results
    assert sorted(
        c.rollout_id
        for c in read_calls(os.path.join(server.out, "calls.jsonl"))
        if c.rollout_id.startswith("sub-")
    ) == ["sub-0", "sub-1"]


def test_calc_agent_on_the_embedded_model(server):
    from lightning_lite.harness import Endpoint, load_harness, run_rollouts

    h = load_harness("calc", max_tokens=16)
    jobs = [(f"calc-{i}", t, h) for i, t in enumerate(h.tasks("test")[:3])]
    endpoint_for = lambda rid: Endpoint(server.base_url(rid), "k", "smollm2", rid, server.url)  # noqa: E731
    results = asyncio.run(run_rollouts(jobs, endpoint_for, timeout=120, progress=False))
    assert all(r.error is None and 0.0 <= r.reward <= 1.0 for r in results), results
    calls = [
        c
        for c in read_calls(os.path.join(server.out, "calls.jsonl"))
        if c.rollout_id.startswith("calc-")
    ]
    assert {c.rollout_id for c in calls} == {"calc-0", "calc-1", "calc-2"}
    assert all(c.temperature == 0.7 and len(c.response_ids) <= 16 for c in calls)
    # multi-turn: a forced calculator call, then an answer; each rollout's calls merge into one sample, except where
    # the template renders the echoed call otherwise than the model wrote it (a stock server's prompt: a new sample)
    from lightning_lite.samples import build_batch_samples

    samples, stats = build_batch_samples(calls)
    splits = sum(c.split == "template_mismatch" for c in calls)
    assert (
        len(calls) >= 6
        and len(samples) == stats["samples"] == 3 + splits
        and stats["split_template_mismatch"] == splits
    )
    assert all(c.split in (None, "template_mismatch") for c in calls)


@pytest.mark.parametrize(
    "opts",
    [
        [
            "--loss",
            "gspo",
            "--norm",
            "token-mean",
            "--adv",
            "rloo",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "0",
            "--tensorboard",
            "--wandb",
            "ll-test",
        ],
        [
            "--loss",
            "tis",
            "--tis-cap",
            "1.5",
            "--norm",
            "seq-mean-token-sum-norm",
            "--norm-const",
            "3",
            "--adv",
            "reinforce",
            "--kl-coef",
            "0.05",
            "--weight-decay",
            "0.01",
            "--attn",
            "eager",
        ],  # the packed tree's mask as an additive one, for the policy and the reference model
        [
            "--norm",
            "seq-mean-token-sum",
            "--adv",
            "dr_grpo",
            "--micro-batch-tokens",
            "64",
            "--max-seq-len",
            "48",
            "--drop-zero-variance",
            "--clip-low",
            "0.1",
            "--clip-high",
            "0.05",
        ],
        [
            "--norm",
            "seq-mean-token-mean",
            "--eval-every",
            "1",
            "--grad-clip",
            "0.5",
            "--max-batch-size",
            "2",
            "--seed",
            "3",
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--max-new-tokens",
            "5",
            "--max-model-len",
            "16384",
        ],
    ],
    ids=[
        "gspo-token-mean-rloo-cosine",
        "tis-sum-norm-reinforce-kl",
        "seq-sum-dr_grpo-microbatch-maxlen",
        "seq-mean-eval-every",
    ],
)
@pytest.mark.slow  # ~40-160 s: make test-slow
def test_every_loss_norm_and_estimator_trains(tmp_path, opts, monkeypatch):
    """Two steps under each loss, normalization and estimator, and the optimization flags as train.py
    passes them on: the `lr` column is the schedule's, by hand (the constant one's default warmup of 2
    steps, or cosine without warmup); user-given --clip-low/--clip-high, --norm-const, --weight-decay
    and --grad-clip reach config.json (the flags TrainConfig.from_flags reads), and --norm-const sets
    the loss's value. What those values do to a loss and an update is test_optim.py's, on a Learner:
    the clip range and C in a loss by hand, AdamW fed the clipped gradient, decay of lr * wd."""
    monkeypatch.setenv(
        "WANDB_MODE", "offline"
    )  # no network here: wandb writes its run under OUT/wandb
    out = str(tmp_path / "run")
    run(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":LengthHarness",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--group-size",
            "3",
            "--eval-tasks",
            "1",
            "--lr",
            "1e-4",
            "--out",
            out,
        ]
        + opts
    )
    steps = [r for r in rows(out) if "reward" in r]
    assert len(steps) == 2 and all(
        r["failed"] == 0 and r["samples"] > 0 and r["grad_norm"] > 0 for r in steps
    )
    assert (
        abs(steps[0]["dlogp_mean"]) < 1e-3
    )  # same weights on both sides: the trainer reproduces the rollout logprobs
    # --lr 1e-4 over 2 steps: cosine without warmup 1e-4, then 1e-4 (0.1 + 0.45 (1 + cos(pi / 2)))
    # = 5.5e-5; constant, its default 2 warmup steps: 1e-4 / 2, then 1e-4
    lrs = [1e-4, 5.5e-5] if "cosine" in opts else [5e-5, 1e-4]
    assert [r["lr"] for r in steps] == pytest.approx(lrs, rel=1e-9)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["norm"] == opts[opts.index("--norm") + 1]
    assert config["weight_decay"] == (0.01 if "--weight-decay" in opts else 0.0)
    assert config["grad_clip"] == (0.5 if "--grad-clip" in opts else 1.0)
    if "gspo" in opts:  # GSPO's own clip range, not PPO's 0.2 / 0.28
        assert (config["clip_low"], config["clip_high"]) == (3e-4, 4e-4)
    if "--clip-low" in opts:  # the user's, not PPO's default 0.2 / 0.28
        assert (config["clip_low"], config["clip_high"]) == (0.1, 0.05)
    if "--norm-const" in opts:
        # the user's C, in the loss's value: at step 1 every ratio is 1 (to ~1e-6: the weights that
        # sampled) and the KL term 0 (the policy is the reference), so tis's token loss is -A times
        # the token's logprob (the rollout's, to ~1e-5), and each sample weighs 1 / (N samples * C):
        # the loss is -sum(A sum(logprobs)) / (N * 3), one sample per rollout (one call each)
        assert config["norm_const"] == 3
        rolls = list(read_jsonl(os.path.join(out, "rollouts", "step_0.jsonl")))
        calls = read_jsonl(os.path.join(out, "calls", "step_0.jsonl"))
        logprobs = {c["rollout_id"]: sum(c["response_logprobs"]) for c in calls}
        terms = [x["advantage"] * logprobs[x["rollout_id"]] / (len(rolls) * 3) for x in rolls]
        loss = steps[0]["loss"]
        assert loss == pytest.approx(-sum(terms), abs=1e-4 * sum(map(abs, terms))), terms
    else:
        # Dr. GRPO's C by default: the generation budget, --max-new-tokens (default 1024)
        assert config["norm_const"] == (5 if "--max-new-tokens" in opts else 1024)
    if "--eval-every" in opts:
        assert [r["step"] for r in rows(out) if "eval_reward" in r] == [0, 1, 2]
    if (
        "--max-new-tokens" in opts
    ):  # the harness asks for 8 tokens, the trainer allows 5; beyond 8192, RoPE is YaRN-scaled
        calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_0.jsonl"))]
        assert all(
            len(c["response_ids"]) <= 5 and c["capped"] == (c["finish_reason"] == "length")
            for c in calls
        )
        assert (
            json.load(open(os.path.join(out, "checkpoints", "step_2", "config.json")))[
                "rope_parameters"
            ]["rope_type"]
            == "yarn"
        )
    if (
        "--tensorboard" in opts
    ):  # the same numbers as metrics.jsonl, in TensorBoard and in an offline wandb run
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = EventAccumulator(os.path.join(out, "tensorboard"))
        tb.Reload()
        assert [(e.step, round(e.value, 5)) for e in tb.Scalars("reward")] == [
            (r["step"], round(r["reward"], 5)) for r in steps
        ]
        assert [e.step for e in tb.Scalars("eval_success")] == [0, 2]
        (log,) = glob.glob(
            os.path.join(out, "wandb", "offline-run-*", "run-*.wandb")
        )  # the offline run's record log
        logged = open(log, "rb").read()
        assert (
            all(json.dumps(r["reward"]).encode() in logged for r in steps)
            and b"eval_success" in logged
        )


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_tree_packing_trains_exactly_as_separate_rows(tmp_path):
    """One step on rollouts that split (BranchingHarness: two leaves each, seeded and run one at a time, so both
    runs get the same calls), in groups that share their prompt, packed as trees (the default) and --no-tree, in
    several micro-batches: the same loss, grad norm and updated weights, with fewer tokens through the model."""
    from safetensors.torch import load_file

    from lightning_lite.models import load_model

    res = {}
    for name, extra in (("tree", []), ("rows", ["--no-tree"])):
        out = str(tmp_path / name)
        run(
            [
                sys.executable,
                "train.py",
                "--harness",
                HARNESSES + ":BranchingHarness",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--group-size",
                "3",
                "--eval-tasks",
                "0",
                "--max-concurrency",
                "1",
                "--micro-batch-tokens",
                "160",
                "--lr",
                "1e-4",
                "--save-every",
                "1",
                "--out",
                out,
            ]
            + extra
        )
        calls = [
            (c["prompt_ids"], c["response_ids"])
            for c in read_jsonl(os.path.join(out, "calls", "step_0.jsonl"))
        ]
        res[name] = (
            rows(out)[-1],
            calls,
            load_file(os.path.join(out, "checkpoints", "step_1", "model.safetensors")),
        )
    (tree, calls, w), (flat, calls_flat, w_flat) = res["tree"], res["rows"]
    assert (
        calls == calls_flat and tree["splits"] == {"rewrote_history": 6} and tree["samples"] == 12
    )
    # A first step's loss is ~0 (each group's advantages sum to 0, every ratio is 1): what is left is summation noise,
    # which another order (or another CPU: -2.2e-7 against 9.3e-8 on one) moves by 1e-7s, and the backend's logprobs,
    # which are not the same in every process: once (make test-slow, 6 Dec 2026) the tree run's first call had
    # logprobs 3.6e-4 from the rows run's on the same tokens, and the losses were 4.2e-6 and 1.2e-7 (its grad norm
    # within 4e-6 of the other's). The gradient carries the test.
    assert tree["loss"] == pytest.approx(flat["loss"], rel=1e-5, abs=2e-5) and tree[
        "grad_norm"
    ] == pytest.approx(flat["grad_norm"], rel=1e-4)
    assert tree["fwd_tokens"] < 0.7 * flat["fwd_tokens"], (tree["fwd_tokens"], flat["fwd_tokens"])
    # Adam's first step moves a weight by about lr whatever its gradient's size, so on the few weights with a gradient
    # at fp32 noise (another summation order) the two runs differ by up to lr: compare the whole update (measured 2e-4
    # of it until 6 Dec 2026; 1.1e-3 on 7 Dec 2026 with transformers 5.19.0 and peft 0.22.0, on an untouched checkout
    # of the day before too). A tree that trained other tokens would move it by about the whole update.
    w0 = load_model("smollm2").state_dict()
    update = torch.cat([(w[k] - w0[k]).double().flatten() for k in w])
    diff = torch.cat([(w[k] - w_flat[k]).double().flatten() for k in w])
    assert update.norm() > 0 and diff.norm() <= 3e-3 * update.norm(), (diff.norm(), update.norm())


def test_grammar_constrained_calls_are_scored_under_the_mask_that_drew_them(tmp_path):
    """A forced calculator call (its schema's grammar, temperature 0.7, top_p 0.8), its result and a JSON reply
    (response_format), merged into one sample and trained for one step: the trainer replays each grammar over the
    recorded ids and reproduces every logprob to fp32 noise; the tokens the grammar forced are counted (logprob 0
    on both sides, no gradient). Scored without the masks, the same calls gave |dlogp| mean ~2, max ~16."""
    out = str(tmp_path / "run")
    run(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":SamplingHarness",
            "--harness-arg",
            "setting='constrained'",
            "--harness-arg",
            "max_tokens=24",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--group-size",
            "3",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    (step,) = rows(out)
    assert (
        step["failed"] == 0
        and step["calls"] == 12
        and step["samples"] == 6
        and step["grad_norm"] > 0
    ), step
    assert (
        step["dlogp_mean"] < 1e-4 and step["dlogp_max"] < 1e-3 and step["ratio_out_frac"] == 0.0
    ), step
    assert 0 < step["forced_tokens"] < step["constrained_tokens"] <= step["trainable_tokens"], step
    # what the recorder extra records for the live page (docs/training.md, "Seeing a run"): every
    # trained sample's tokens (6, under the cap of 12) with the trainer's numbers, and the heartbeat
    lines = [json.loads(line) for line in open(os.path.join(out, "tokens", "step_0.jsonl"))]
    assert len(lines) == 6 and sum(line["trained"] for line in lines) == step["trainable_tokens"]
    dlogp = [abs(a - o) for line in lines for a, o in zip(line["logprob"], line["old"])]
    assert max(dlogp) < 1e-3 and all(line["step"] == 0 for line in lines)
    # the row's entropy_mean is the mean of every trained token's entropy (all of them recorded
    # here), 0 for a token the grammar forced
    entropy = [h for line in lines for h in line["entropy"]]
    assert step["entropy_mean"] == pytest.approx(sum(entropy) / len(entropy), abs=1e-5)
    assert min(entropy) == 0.0 and step["entropy_mean"] > 0
    beat = json.load(open(os.path.join(out, "heartbeat.json")))
    assert beat["phase"] == "done" and beat["in_flight"] == [] and len(beat["finished"]) == 6
    assert step["time"] > 0 and step["response_tokens_mean"] > 0
    calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_0.jsonl"))]
    assert all(c["grammar"] for c in calls) and {
        c["finish_reason"] for c in calls if c["index"] == 0
    } <= {"tool_calls", "length"}
    for c in calls:  # the JSON replies that were not cut short follow their schema
        if c["index"] == 1 and c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["response"]["content"])["answer"], int), c["response"]


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_each_token_is_scored_under_the_sampling_that_drew_it(tmp_path):
    """Rollouts sampled with top_p 0.6, with top_k 5, and two-turn conversations at temperature 0.5 then 1.0
    (merged into one sample), trained for one step: the trainer reproduces every recorded logprob to fp32
    noise (plain temperature-1 runs: |dlogp| mean ~1e-5, max ~3e-5). Scoring by temperature alone gave
    mean 0.27-0.39 and max 0.5-2.9 on these settings."""
    out = str(tmp_path / "run")
    run(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":SamplingHarness",
            "--harness-arg",
            "setting='all'",
            "--harness-arg",
            "max_tokens=8",
            "--steps",
            "1",
            "--batch-size",
            "3",
            "--group-size",
            "3",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ]
    )
    (step,) = rows(out)
    assert (
        step["failed"] == 0 and step["calls"] == 12 and step["samples"] == 9
    )  # the two-turn rollouts merged
    assert step["grad_norm"] > 0 and step["trainable_tokens"] > 50
    # (the max, not the mean, may reach ~2e-3 where a token sits at the nucleus's edge: docs/serving.md)
    assert (
        step["dlogp_mean"] < 1e-4 and step["dlogp_max"] < 1e-2 and step["ratio_out_frac"] == 0.0
    ), step
    assert 1 - 1e-2 < step["ratio_min"] <= step["ratio_mean"] <= step["ratio_max"] < 1 + 1e-2, step
    calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_0.jsonl"))]
    assert {(c["temperature"], c["top_p"], c["top_k"]) for c in calls} == {
        (1.0, 0.6, 0),
        (1.0, 1.0, 5),
        (0.5, 1.0, 0),
        (1.0, 1.0, 0),
    }


@pytest.mark.slow  # minutes: a 100-step run stopped by SIGINT (the any-phase test below interrupts every phase)
def test_ctrl_c_saves_a_checkpoint_and_exits(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":LengthHarness",
            "--steps",
            "100",
            "--batch-size",
            "2",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        log, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, log[-3000:]
    assert "saving a checkpoint" in log
    latest = (out / "checkpoints" / "latest").read_text()
    assert (out / "checkpoints" / latest / "model.safetensors").exists() and int(
        latest.split("_")[1]
    ) >= 1


@pytest.mark.parametrize("bound", [1, 2])
@pytest.mark.slow  # ~40-160 s: make test-slow
def test_async_rollouts_stay_within_the_staleness_bound_and_are_scored_against_what_served_them(
    tmp_path, bound
):
    """--async N: step s's rollouts start while earlier steps train, so calls are served by older weights,
    never more than N updates old. The trainer (fp32, on the pre-update weights of step s) reproduces the
    recorded logprobs of calls served by the current version exactly and differs from calls served by older
    versions: the recorded logprobs are those of the version that served each call, which the loss's ratio corrects."""
    out = str(tmp_path / "run")
    steps = bound + 2
    run(
        [
            sys.executable,
            "train.py",
            "--harness",
            HARNESSES + ":LengthHarness",
            "--steps",
            str(steps),
            "--batch-size",
            "2",
            "--group-size",
            "3",
            "--eval-tasks",
            "0",
            "--lr",
            "1e-4",
            "--warmup-steps",
            "0",
            "--async",
            str(bound),
            "--out",
            out,
        ]
    )
    trained = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1)) and all(
        r["failed"] == 0 for r in trained
    )
    for s in range(steps):
        versions = {
            c.model_version for c in read_calls(os.path.join(out, "calls", f"step_{s}.jsonl"))
        }
        assert versions and all(max(0, s - bound) <= v <= s for v in versions), (s, versions)
    ages = {int(a) for r in trained for a in r["staleness"]}
    assert ages <= set(range(bound + 1)) and max(ages) >= 1, ages  # rollouts did overlap training
    by_age = {
        int(a): d for r in trained for a, d in r["dlogp_by_staleness"].items() if r["grad_norm"]
    }
    assert by_age.get(0, 0.0) < 1e-4 and all(d > 1e-2 for a, d in by_age.items() if a >= 1), by_age


# Runs train.py in one process (runpy: the imports are paid once), run after run; a run's "phase" raises a
# KeyboardInterrupt (Ctrl-C) from a monkeypatched function in that phase of step k (train.py has no test hooks).
DRIVER = r'''
import builtins, json, os, runpy, shutil, sys
sys.path.insert(0, os.getcwd())
import torch
from lightning_lite import algo, backends, harness, records


def interrupt(orig, *a, **kw):
    raise KeyboardInterrupt


def patch(obj, name, when, then=interrupt):
    """obj.name does then(orig, ...) instead on the first call for which when(...) holds; returns the undo."""
    orig, fired = getattr(obj, name), []

    def hooked(*a, **kw):
        if fired or not when(*a, **kw):
            return orig(*a, **kw)
        fired.append(1)
        return then(orig, *a, **kw)
    setattr(obj, name, hooked)
    return lambda: setattr(obj, name, orig)


def nth_call(n):
    count = [0]

    def when(*a, **kw):
        count[0] += 1
        return count[0] == n
    return when


def nan_loss(orig, *a, **kw):
    loss, m = orig(*a, **kw)
    return loss * float("nan"), m


def torn_write(orig, path, items, *a, **kw):  # killed after the first line
    orig(path, list(items)[:1])
    raise KeyboardInterrupt


def trained_and_served(out, k):
    def when(backend, model=None, version=None):  # HFBackend.sync_weights gets what training changes, by name (Learner.trained); it serves backend.model
        if version == k + 1:
            trained = {name: p.detach().clone() for name, p in model.items()}
            torch.save({"trained": trained, "served": backend.model.state_dict()}, os.path.join(out, "at_interrupt.pt"))
        return version == k + 1
    return when


def phase_patch(phase, k, out):
    return {
        "rollouts": lambda: patch(harness, "run_rollouts", lambda *a, desc="", **kw: desc == f"step {k}"),
        "training": lambda: patch(torch.nn.utils, "clip_grad_norm_", nth_call(k + 1)),  # after backward, before opt.step()
        "sync": lambda: patch(backends.HFBackend, "sync_weights", lambda self, model=None, version=None: version == k + 1),
        "async-sync": lambda: patch(backends.HFBackend, "sync_weights", trained_and_served(out, k)),
        "logging": lambda: patch(builtins, "print", lambda *a, **kw: bool(a) and str(a[0]).startswith(f"step {k + 1:4d} |")),
        "eval": lambda: patch(harness, "run_rollouts", lambda *a, desc="", **kw: desc == f"eval {k + 1}"),
        "save-every": lambda: patch(torch, "save", lambda obj, f, *a, **kw: f"step_{k + 1}.tmp" in str(f)),
        "forget": lambda: patch(records, "write_jsonl", lambda path, *a, **kw: path.startswith(os.path.join(out, "metrics.jsonl")), torn_write),
        "nan-loss": lambda: patch(algo, "policy_loss", nth_call(1), nan_loss),
        None: lambda: (lambda: None),
    }[phase]()


root, common, runs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
results = []
for r in runs:
    out = os.path.join(root, r["out"])
    for name in r.get("plant", []):  # files of an attempt with another world size
        records.write_jsonl(os.path.join(out, name), [{"rollout_id": "x"}])
    metrics = os.path.join(out, "metrics.jsonl")
    res = {"rows_before": len(list(records.read_jsonl(metrics))) if os.path.exists(metrics) else 0}
    unpatch = phase_patch(r.get("phase"), r.get("k", 0), out)
    sys.argv = ["train.py", *common, *r.get("args", []), "--out", out]
    try:
        runpy.run_path("train.py", run_name="__main__")
        res["code"] = 0
    except SystemExit as e:
        res["code"] = e.code
    except KeyboardInterrupt:
        res["code"] = "KeyboardInterrupt"
    finally:
        unpatch()
    latest = os.path.join(out, "checkpoints", "latest")
    res["latest"] = open(latest).read() if os.path.exists(latest) else None
    res["rows"] = len(list(records.read_jsonl(metrics))) if os.path.exists(metrics) else 0
    if r.get("copy_weights"):  # the newest checkpoint's weights, kept past --keep-checkpoints
        aside = os.path.join(out, f"weights_{res['latest']}")
        os.makedirs(aside)
        shutil.copy(os.path.join(out, "checkpoints", res["latest"], "model.safetensors"), aside)
    res["planted_left"] = [name for name in r.get("plant", []) if os.path.exists(os.path.join(out, name))]
    for name in res["planted_left"]:
        os.remove(os.path.join(out, name))  # not real calls: the report would choke on them
    results.append(res)
json.dump(results, open(os.path.join(root, "results.json"), "w"))
'''


def run_in_process(tmp_path, common, runs, timeout=900):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    log = run(
        [sys.executable, str(driver), str(tmp_path), json.dumps(common), json.dumps(runs)],
        timeout=timeout,
    )
    return json.load(open(tmp_path / "results.json")), log


def safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_ctrl_c_in_any_phase_then_resume_applies_each_update_once(tmp_path):
    """Ctrl-C in each phase of a step, each followed by --resume: the checkpoint counts the step as done
    once its update is applied (the interrupt in weight sync, logging, --save-every or evaluation comes
    after it), and the final weights are those of the run that was never interrupted (seeded calls one at
    a time: the same rollouts), so no update was lost or applied twice. metrics.jsonl ends as the
    uninterrupted run's: a row of every step (written at the Ctrl-C if it came between the update and the
    log line), in order, none twice, and every due evaluation once (one cut short, the final one here, runs
    again on resume; one not begun runs first thing). On the way: a resume killed while it rewrites
    metrics.jsonl loses no row, and a resume drops every rank's files of the dropped steps and evaluations."""
    common = [
        "--harness",
        HARNESSES + ":LengthHarness",
        "--harness-arg",
        "max_tokens=4",
        "--harness-arg",
        "seeded=True",
        "--harness-arg",
        "ranked=True",
        "--steps",
        "4",
        "--batch-size",
        "1",
        "--group-size",
        "2",
        "--eval-tasks",
        "1",
        "--eval-every",
        "3",
        "--save-every",
        "2",
        "--max-concurrency",
        "1",
        "--max-new-tokens",
        "4",
        "--lr",
        "1e-4",
        "--warmup-steps",
        "0",
        "--keep-checkpoints",
        "1",
    ]
    # resuming at step 3, with the rows of steps 1-3 and of evaluation 0 (evaluation 3 not begun)
    dropped = [
        "calls/step_3.rank1.jsonl",
        "rollouts/step_3.rank0.jsonl",
        "calls/eval_4.rank1.jsonl",
        "rollouts/eval_3.rank1.jsonl",
    ]
    kept = ["calls/step_2.rank1.jsonl", "rollouts/eval_0.rank1.jsonl"]
    chain = [
        ("rollouts", 0, "step_0"),
        ("training", 0, "step_0"),
        ("sync", 0, "step_1"),
        ("save-every", 1, "step_2"),
        ("logging", 2, "step_3"),
        ("forget", 0, None),
        ("eval", 3, "step_4"),
        (None, 0, "step_4"),
    ]
    runs = [{"out": "baseline"}] + [
        {
            "out": "chain",
            "phase": phase,
            "k": k,
            "args": ["--resume"] * (i > 0),
            "copy_weights": i == 0,
            **({"plant": dropped + kept} if phase == "forget" else {}),
        }
        for i, (phase, k, _) in enumerate(chain)
    ]
    results, log = run_in_process(tmp_path, common, runs)
    assert results[0]["code"] == 0, log[-3000:]
    for (phase, k, latest), r in zip(chain, results[1:]):
        if phase == "forget":  # killed while it rewrote metrics.jsonl: every row is still there
            assert r["code"] == "KeyboardInterrupt" and r["rows"] == r["rows_before"] > 0, r
            assert sorted(r["planted_left"]) == sorted(kept), r
        else:
            assert r["code"] == (130 if phase else 0) and r["latest"] == latest, (
                phase,
                k,
                r,
                log[-3000:],
            )
    # A checkpoint holds ~1.6 GB (the weights and AdamW's two moments), so the runs keep only the
    # newest (--keep-checkpoints 1), and the first interrupted run's weights are copied aside.
    base = safetensors(tmp_path / "baseline" / "checkpoints" / "step_4")
    start = safetensors(tmp_path / "chain" / "weights_step_0")
    final = safetensors(tmp_path / "chain" / "checkpoints" / "step_4")
    update = sum((base[k] - start[k]).abs().sum().item() for k in base)
    diff = sum((final[k] - base[k]).abs().sum().item() for k in base)
    assert update > 0 and diff <= 1e-3 * update, (
        f"the resumed run's weights differ from the uninterrupted run's by {diff / update:.3f} of the training's change"
    )
    kinds = lambda d: [(r["step"], "eval_reward" in r) for r in rows(tmp_path / d)]  # noqa: E731
    assert (
        kinds("chain")
        == kinds("baseline")
        == [(0, True), (1, False), (2, False), (3, False), (3, True), (4, False), (4, True)]
    )
    for a, b in zip(
        rows(tmp_path / "chain"), rows(tmp_path / "baseline")
    ):  # the rows written at a Ctrl-C hold their step's numbers
        assert (a.get("reward"), a.get("eval_reward"), a.get("skipped")) == (
            b.get("reward"),
            b.get("eval_reward"),
            b.get("skipped"),
        ), (a, b)
        assert (
            a.get("grad_norm") == b.get("grad_norm")
            or abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * b["grad_norm"]
        ), (a, b)
    steps = [r for r in rows(tmp_path / "chain") if "reward" in r]
    assert [r["t_sync"] is None for r in steps] == [True, False, False, False], (
        steps
    )  # step 1's written at the Ctrl-C in its sync


@pytest.mark.slow
def test_skipped_updates_log_nulls_and_async_ctrl_c_saves_the_trained_weights(tmp_path, model):
    """A step without signal (groups of 1) logs its update's metrics as null (metrics.jsonl, the log line, no
    TensorBoard scalar), never as a measured 0; a NaN loss skips the update with a warning instead of making
    the weights NaN; Ctrl-C under --async checkpoints the trained weights, not the server's copy (a step behind)."""
    common = [
        "--harness",
        HARNESSES + ":LengthHarness",
        "--harness-arg",
        "max_tokens=4",
        "--harness-arg",
        "seeded=True",
        "--harness-arg",
        "ranked=True",
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--group-size",
        "2",
        "--eval-tasks",
        "0",
        "--max-concurrency",
        "1",
        "--max-new-tokens",
        "4",
        "--lr",
        "1e-4",
    ]
    runs = [
        {"out": "nosignal", "args": ["--group-size", "1", "--tensorboard"]},
        {"out": "nan", "phase": "nan-loss"},
        {"out": "async", "phase": "async-sync", "args": ["--async", "1", "--steps", "2"]},
    ]  # last: its rollouts thread may outlive it
    results, log = run_in_process(tmp_path, common, runs)
    assert [r["code"] for r in results] == [0, 0, 130], log[-3000:]
    (row,) = rows(tmp_path / "nosignal")
    unmeasured = (
        "loss",
        "grad_norm",
        "clip_frac",
        "prob_corr",
        "dlogp_mean",
        "dlogp_max",
        "ratio_out_frac",
        "entropy_mean",
        "train_tok_s",
    )
    assert (
        row["skipped"] == "no_signal"
        and all(row[k] is None for k in unmeasured)
        and row["reward"] is not None
    ), row
    assert "loss - gnorm - clip - |dlogp| -" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "nosignal" / "tensorboard"))
    tb.Reload()
    assert "reward" in tb.Tags()["scalars"] and not set(unmeasured) & set(tb.Tags()["scalars"])
    (row,) = rows(tmp_path / "nan")
    assert (
        row["skipped"] == "nonfinite_grad"
        and row["grad_norm"] is None
        and "WARNING: the gradient norm is nan" in log
    ), row
    start, after = model.state_dict(), safetensors(tmp_path / "nan" / "checkpoints" / "step_1")
    assert all(torch.equal(after[k], start[k]) for k in after)  # no update, no NaN
    at = torch.load(tmp_path / "async" / "at_interrupt.pt")
    assert results[2]["latest"] == "step_1"
    saved = safetensors(tmp_path / "async" / "checkpoints" / "step_1")
    assert all(torch.equal(saved[k], at["trained"][k]) for k in saved) and not all(
        torch.equal(saved[k], at["served"][k]) for k in saved
    )


FREED = """
import torch
from lightning_lite.trainer import return_freed_memory

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))

# A 20 MB block freed raises glibc's mmap threshold to 20 MB, as a backward's first tensors do: the
# 4 MB tensors after it come from the heap, each followed by a 64 KB one that stays (as the weights
# and AdamW state do), so the heap keeps them when they are freed.
block = torch.ones(5 * 2**20)
del block
before = rss_mb()
freed = []
kept = []
for _ in range(100):
    freed.append(torch.ones(2**20))
    kept.append(torch.ones(16384))
del freed
held = rss_mb()
return_freed_memory()
print(before, held, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_memory_an_update_freed_goes_back_to_the_system():
    """Learner.finish_update returns the heap's freed memory (trainer.return_freed_memory): 400 MB of
    4 MB tensors, freed, stay resident until it runs."""
    p = subprocess.run([sys.executable, "-c", FREED], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    before, held, returned = (int(x) for x in p.stdout.split())
    assert held - before > 300 and returned - before < 100, (before, held, returned)
