"""--serve-dtype: the sampler computes in its own dtype while the trainer keeps --dtype (bf16
sampling with an fp32 trainer is a GPU's mismatch, on a CPU); and the guard on the served
weights: a step whose sampler serves other weights stops before its update, with nothing trained
or saved."""

import asyncio
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from test_lora import a_learner, adapter_weights, learner_flags
from test_vllm_placement import fake_env, started, tiny_learner, vllm_flags  # noqa: F401

from lightning_lite import backends
from lightning_lite.backends import HFBackend
from lightning_lite.chat import Sampling
from lightning_lite.extras import vllm
from lightning_lite.models import load_model
from lightning_lite.records import Sample, read_jsonl
from lightning_lite.trainer import MAX_MISMATCH, Learner, TrainConfig

LENGTH = os.path.join(ROOT, "tests", "harnesses.py") + ":LengthHarness"
# ranked: every group has a signal, so the step runs its backward (and the guard)
SHORT = ["--harness", LENGTH, "--harness-arg", "max_tokens=12", "--harness-arg", "ranked=True"]
SHORT += ["--steps", "1"]
SHORT += ["--batch-size", "1", "--group-size", "2", "--eval-tasks", "0", "--lr", "1e-5"]


def train(out, *flags):
    """One step of train.py on the embedded backend: (its exit status, its log)."""
    cmd = [sys.executable, "train.py", *SHORT, *flags, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.slow  # ~30 s, minutes on a loaded machine: two train.py runs, bf16 in software
def test_bf16_sampling_with_an_fp32_trainer_runs_and_differs_by_the_bf16_amount(tmp_path):
    """The embedded backend samples under bf16 autocast while the trainer computes in fp32: the
    recorded logprobs differ from the trainer's by bf16 rounding (measured on the calc task: mean
    |dlogp| ~2e-2), not fp32's ~1e-5, and far inside the guard's bf16 bound."""
    status, log = train(tmp_path / "bf16", "--serve-dtype", "bf16")
    assert status == 0, log[-3000:]
    config = json.load(open(tmp_path / "bf16" / "config.json"))
    assert config["dtype"] == "fp32" and config["serve_dtype"] == "bf16"
    assert config["max_mismatch"] == MAX_MISMATCH["bf16"]
    (bf16,) = read_jsonl(tmp_path / "bf16" / "metrics.jsonl")
    status, log = train(tmp_path / "fp32")
    assert status == 0, log[-3000:]
    assert json.load(open(tmp_path / "fp32" / "config.json"))["serve_dtype"] == "fp32"
    (fp32,) = read_jsonl(tmp_path / "fp32" / "metrics.jsonl")
    print(f"mean |dlogp|: bf16 sampling {bf16['dlogp_mean']:.2e}, fp32 {fp32['dlogp_mean']:.2e}")
    assert 1e-3 < bf16["dlogp_mean"] < 0.1 and bf16["grad_norm"] is not None, bf16
    assert fp32["dlogp_mean"] < 1e-4 and fp32["grad_norm"] is not None, fp32


@pytest.mark.parametrize(
    "trainer, served, flag", [("bf16", "fp32", "float32"), ("fp32", "bf16", "bfloat16")]
)
# fake_env: test_vllm_placement's fixture, imported
def test_vllm_servers_and_their_syncs_take_the_serve_dtype(fake_env, trainer, served, flag):  # noqa
    """The started servers' --dtype and the weight syncs' dtype are --serve-dtype's, not the
    trainer's."""
    learner = tiny_learner()
    learner.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[trainer]
    backend = vllm.start(
        vllm_flags(fake_env, serve_dtype=served), learner, None, torch.device("cpu")
    )
    try:
        argv = started(fake_env, backend.urls[0])[0]["argv"]
        assert argv[argv.index("--dtype") + 1] == flag
        assert backend.dtype == getattr(torch, flag)
    finally:
        backend.close()


def test_a_gpu_without_bf16_is_refused_and_a_cpu_computes_it(monkeypatch):
    """A GPU before Ampere has no bf16 (train.py --serve-dtype bf16 stops at start, naming fp32); a
    CPU without AVX512-BF16 computes it in software."""
    # a GPU that only emulates bf16 (torch's default answer counts emulation)
    fake = lambda including_emulation=True: including_emulation  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake)
    assert not backends.bf16_supported(torch.device("cuda"))
    assert backends.bf16_supported(torch.device("cpu"))


def replies(model, tok, n=2) -> list[Sample]:
    """``n`` replies of the embedded backend serving ``model``, as samples with advantages +1 and -1
    (a signal to update on)."""
    chat = [{"role": "user", "content": "Name a colour."}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tok(text)["input_ids"]
    backend = HFBackend(model, tok, max_model_len=256)

    async def sample():
        calls = [backend.generate(prompt, Sampling(max_tokens=10, seed=i)) for i in range(n)]
        return await asyncio.gather(*calls)

    try:
        gens = asyncio.run(sample())
    finally:
        backend.close()
    samples = []
    for i, gen in enumerate(gens):
        k, pad = len(gen.response_ids), [0] * len(prompt)
        s = Sample(f"r{i}", prompt + gen.response_ids, pad + [1] * k, pad + gen.logprobs)
        s.advantages = pad + [1.0 - 2 * (i % 2)] * k
        samples.append(s)
    return samples


def perturbed(model):
    """``model`` with noise on its MLPs: the weights of another checkpoint, or of a missed sync."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "mlp" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return other


def a_plain_learner(tok, **kw):
    config = TrainConfig.from_flags(learner_flags(**kw))
    return Learner(config, tok, torch.device("cpu"), torch.float32, 1, True, None, print)


def test_the_guard_stops_the_update_when_the_sampler_serves_other_weights(tok):
    """Served wrong (weights off by a little noise on the MLPs): the update stops at step 1 before
    AdamW, naming the causes, the numbers and the flag, and no weight or optimizer state changed.
    Served right, the same update goes through (fp32 on both sides: ~1e-5)."""
    learner = a_plain_learner(tok, max_mismatch=MAX_MISMATCH["fp32"])
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    samples = replies(perturbed(learner.model), tok)
    with pytest.raises(SystemExit) as stop:
        learner.update(samples, 0, True)
    message = str(stop.value)
    print(message)
    for words in ("step 1:", "not synced", "adapters were not loaded", "another model"):
        assert words in message
    assert "--max-mismatch 0.01" in message and "Nothing was updated" in message
    assert not learner.opt.state
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    metrics, grad_norm, skipped = learner.update(replies(learner.model, tok), 0, True)
    assert metrics["dlogp_mean"] < 1e-3 and grad_norm and skipped is None
    assert learner.opt.state


def test_the_guard_stops_a_lora_run_whose_sampler_serves_the_base(tok):
    """--lora-per-harness (its own update path, adapter.update): trained adapters (random lora_B)
    while the sampler serves the base model without them. The first adapter's backward stops the
    step; no adapter moved."""
    learner = a_learner(tok, ["calc"], max_mismatch=MAX_MISMATCH["bf16"])
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    before = adapter_weights(learner.model, "calc")
    samples = replies(load_model("smollm2"), tok)
    results = [type("Result", (), dict(rollout_id=s.rollout_id, harness="calc")) for s in samples]
    with pytest.raises(SystemExit, match="adapters were not loaded"):
        learner.adapter.update(learner, samples, results, 0)
    after = adapter_weights(learner.model, "calc")
    assert all(torch.equal(after[n], before[n]) for n in before) and not learner.opt.state


def test_train_py_stops_at_step_1_when_the_bound_is_crossed_and_writes_no_checkpoint(tmp_path):
    """train.py end to end: a bound below fp32's own noise stands in for a wrong sampler (train.py
    has no way to serve other weights on purpose): the run exits non-zero at step 1 with the
    guard's message, before any metrics row or checkpoint."""
    status, log = train(tmp_path / "run", "--max-mismatch", "1e-9", "--save-every", "1")
    assert status != 0 and "past --max-mismatch 1e-09" in log, log[-3000:]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl") or not list(
        read_jsonl(tmp_path / "run" / "metrics.jsonl")
    )
    assert not os.path.isdir(tmp_path / "run" / "checkpoints") or not os.listdir(
        tmp_path / "run" / "checkpoints"
    )
