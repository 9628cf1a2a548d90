"""LoRA (extras/lora.py, train.py --lora) on the embedded model: only the adapters train, the embedded backend
serves the adapted module with the trainer's logprobs, the KL reference is the base, bad flags exit naming the fix;
end to end (make test-slow): two DDP ranks, a checkpoint of the adapters alone, --resume, the merge command."""

import argparse
import asyncio
import os
import subprocess
import sys

import pytest
import torch


from lightning_lite import algo
from lightning_lite.apis import Sampling
from lightning_lite.backends import HFBackend
from lightning_lite.extras import lora
from lightning_lite.models import load_model
from lightning_lite.records import Sample
from conftest import ROOT
from test_train import rows, run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def flags(**kw):
    base = dict(lora=8, lora_alpha=None, lora_targets=None, model="smollm2", backend="hf")
    base |= dict(lora_per_harness=None, harness=["calc"], vllm_sleep=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def adapted():
    """SmolLM2 with rank-8 adapters that change its outputs (peft starts lora_B at 0: no change)."""
    net = lora.wrap(load_model("smollm2"), flags()).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return net


def test_only_the_adapters_train_and_the_reference_is_the_base(adapted, model, tok):
    trainable = {n: p.numel() for n, p in adapted.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # rank 8 on the 7 linear layers of 30 decoder layers (hidden 576, MLP 1536, 3 KV heads of 64):
    # 8 x (in + out) = q, o: 8 x 1152; k, v: 8 x 768; gate, up, down: 8 x 2112 -> 81,408 a layer
    assert sum(trainable.values()) == 30 * 81_408 == 2_442_240
    assert all(p.dtype == torch.float32 for n, p in adapted.named_parameters() if n in trainable)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        plain, tuned = model(input_ids=ids).logits, adapted(input_ids=ids).logits
        with lora.base_only(adapted, True):
            base = adapted(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 0.1
    assert torch.allclose(base, plain, atol=1e-5)


def test_targets_and_alpha_choose_the_layers_and_the_scale():
    net = lora.wrap(
        load_model("smollm2"), flags(lora=4, lora_alpha=16.0, lora_targets="q_proj,v_proj")
    )
    trainable = {n: p.numel() for n, p in net.named_parameters() if p.requires_grad}
    # rank 4 on q (576 -> 576) and v (576 -> 192) of 30 layers: 4 x (1152 + 768) a layer
    assert sum(trainable.values()) == 30 * 4 * (1152 + 768)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert net.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 16.0 / 4


def sample_and_score(backend, prompt, rollouts, score):
    """A reply to ``prompt`` for each rollout id, sampled at once (one batch) by ``backend``; each reply's
    max |trainer - sampled logprob|, the trainer's being ``score(rollout id)(batch)`` (a packed tree)."""

    async def sample():
        jobs = [
            (rid, Sampling(max_tokens=12, temperature=1.0, seed=i))
            for i, rid in enumerate(rollouts)
        ]
        return await asyncio.gather(
            *(backend.generate(prompt, s, rollout_id=rid) for rid, s in jobs)
        )

    try:
        replies = asyncio.run(sample())
    finally:
        backend.close()
    gaps = {}
    for rid, g in zip(rollouts, replies):
        n, m = len(prompt), len(g.response_ids)
        s = Sample(rid, prompt + g.response_ids, [0] * n + [1] * m, [0.0] * n + g.logprobs)
        s.temperature, s.top_k, s.top_p = [1.0] * (n + m), [0] * (n + m), [1.0] * (n + m)
        b = algo.collate([s], [1.0], tree=True)
        with torch.no_grad():
            gaps[rid] = float((score(rid)(b) - b["old_logprobs"])[b["loss_mask"] > 0].abs().max())
    return gaps


def test_the_embedded_backend_serves_the_adapters_with_the_trainers_logprobs(adapted, tok):
    """Two replies sampled by the backend serving the adapted module, scored as the trainer scores them:
    the same logprobs at fp32, to the 1e-5 level."""
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    )
    score = lambda rid: lambda b: algo.trainer_logprobs(adapted, b)  # noqa: E731
    assert (
        max(sample_and_score(HFBackend(adapted, tok), prompt, ["r1", "r2"], score).values()) < 1e-4
    )


def test_one_batch_serves_each_harness_its_adapter_with_the_trainers_logprobs(tok):
    """--lora-per-harness: the embedded backend decodes a batch that mixes two adapters (peft's adapter_names),
    each rollout through its harness's; the trainer, training one adapter at a time (lora.activate), scores
    each reply as it was sampled, to the 1e-5 level, and under the other adapter it does not."""
    net = lora.wrap(load_model("smollm2"), flags(lora_per_harness=["planner", "coder"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    adapter_of = {"p0": "planner", "c0": "coder", "p1": "planner", "c1": "coder"}
    backend = HFBackend(net, tok)
    backend.adapter_of = adapter_of.get
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    )

    def under(adapter):
        return lambda b: algo.trainer_logprobs(lora.activate(net, adapter), b)

    other = {"planner": "coder", "coder": "planner"}
    own = sample_and_score(backend, prompt, adapter_of, lambda rid: under(adapter_of[rid]))
    assert max(own.values()) < 1e-4, own
    backend = HFBackend(net, tok)
    backend.adapter_of = adapter_of.get
    swapped = sample_and_score(
        backend, prompt, adapter_of, lambda rid: under(other[adapter_of[rid]])
    )
    assert min(swapped.values()) > 0.01, swapped


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(lora=0), "positive integer"),
        (dict(lora_targets="qproj"), "q_proj"),
        (dict(lora=None, lora_alpha=32.0), "add --lora RANK"),
        (dict(backend="vllm", lora=600), "rank 512 at most"),
        (dict(vllm_sleep=True), "--vllm-sleep drops the base model"),
        (dict(lora=None, lora_per_harness=True, harness=["calc", "search"]), "add --lora RANK"),
        (dict(lora_per_harness=True), "name two or more --harness"),
    ],
)
def test_bad_lora_flags_exit_before_anything_starts_naming_the_fix(kw, says):
    with pytest.raises(SystemExit) as e:
        lora.check(flags(**kw), ddp=False, cuda=False)
    assert says in str(e.value)


@pytest.mark.slow  # minutes: two torchrun runs and a merge
def test_lora_trains_under_ddp_checkpoints_the_adapters_resumes_and_merges(tmp_path, tok):
    out = str(tmp_path / "run")
    calc = ["train.py", "--harness", "calc", "--harness-arg", "max_tokens=32"]
    calc += ["--harness-arg", "tool_first=False", "--batch-size", "4", "--group-size", "4"]
    calc += ["--eval-tasks", "0", "--lr", "1e-3", "--lora", "8", "--kl-coef", "0.05", "--out", out]
    run(TORCHRUN + calc + ["--steps", "2", "--save-every", "1"], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and any(r["grad_norm"] for r in steps)
    # served from the adapted module: what was sampled is what is trained
    assert all(r["dlogp_mean"] is None or r["dlogp_mean"] < 1e-4 for r in steps)
    # the adapters in peft's format and their AdamW state, not the base model
    ckpt = os.path.join(out, "checkpoints", "step_2")
    files = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert len(state["optimizer"]["state"]) == 2 * 7 * 30  # lora_A and lora_B of 210 layers
    run(TORCHRUN + calc + ["--steps", "3", "--resume"], timeout=900)
    assert [r["step"] for r in rows(out) if "reward" in r] == [1, 2, 3]
    # merged: a plain transformers model computing what base + adapters compute
    merged = str(tmp_path / "merged")
    ckpt = os.path.join(out, "checkpoints", "step_3")
    run([sys.executable, "-m", "lightning_lite.extras.lora", "merge", ckpt, merged])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        want = PeftModel.from_pretrained(load_model("smollm2"), ckpt)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        plain = load_model("smollm2")(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4) and (got - plain).abs().max() > 1e-3
    # the run's calls trained on again, imitated (--from-calls, --loss sft)
    again = str(tmp_path / "again")
    run(
        [sys.executable, "train.py", "--from-calls", out, "--lora", "8", "--loss", "sft"]
        + ["--steps", "1", "--batch-size", "2", "--out", again]
    )
    assert [r["grad_norm"] > 0 for r in rows(again)] == [True]


@pytest.mark.slow  # a minute: one torchrun run
def test_lora_under_fsdp_bf16_async_and_forced_calls(tmp_path):
    """FSDP2 shards the adapted layers, the base in bf16; rollouts run during training (the served copy gets
    the adapters alone); calc's first call is forced under a grammar."""
    out = str(tmp_path / "run")
    args = TORCHRUN + ["train.py", "--harness", "calc", "--batch-size", "2", "--group-size", "4"]
    args += [
        "--eval-tasks",
        "0",
        "--lora",
        "8",
        "--parallel",
        "fsdp",
        "--dtype",
        "bf16",
        "--async",
        "--steps",
        "2",
    ]
    # (a KL term: every step updates, whatever the rewards; its reference is the base under FSDP too)
    args += ["--kl-coef", "0.05"]
    run(args + ["--out", out], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert len(steps) == 2 and all(r["forced_tokens"] > 0 for r in steps)
    assert steps[1]["staleness"] and all(r["grad_norm"] for r in steps)
    assert "adapter_model.safetensors" in os.listdir(os.path.join(out, "checkpoints", "step_2"))


@pytest.mark.slow  # minutes: two torchrun runs and a merge
def test_an_adapter_per_harness_trains_on_its_harness_alone_under_ddp(tmp_path, tok):
    """--lora-per-harness with two harnesses on two DDP ranks: "length" has a signal every step, "constant"
    (a reward of 0.5 whatever the reply) never does. Each rollout is served by its harness's adapter, each
    adapter trains on its harness's samples alone: length's moves, has AdamW state and its metrics;
    constant's stays at its start (lora_B 0) with none. The checkpoint holds an adapter folder per harness;
    --resume continues; the merge command takes one by name."""
    out = str(tmp_path / "run")
    two = ["train.py", "--harness", "tests/harnesses.py:LengthHarness"]
    two += ["--harness", "tests/harnesses.py:ConstantHarness", "--harness-arg", "max_tokens=12"]
    two += ["--batch-size", "4", "--group-size", "4", "--eval-tasks", "0", "--lr", "1e-3"]
    two += ["--lora", "8", "--lora-per-harness", "--out", out]
    run(TORCHRUN + two + ["--steps", "2", "--save-every", "2"], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["grad_norm/length"] > 0 and r["dlogp_mean/length"] < 1e-4, r
        assert r["skipped/constant"] == "no_signal" and "loss/constant" not in r, r
    from safetensors.torch import load_file

    ckpt = os.path.join(out, "checkpoints", "step_2")
    weights = {
        h: load_file(os.path.join(ckpt, h, "adapter_model.safetensors"))
        for h in ("length", "constant")
    }
    moved = lambda h: max(float(w.abs().max()) for k, w in weights[h].items() if "lora_B" in k)  # noqa: E731
    assert moved("length") > 0 and moved("constant") == 0
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert len(state["optimizer"]["state"]) == 2 * 7 * 30  # length's lora_A and lora_B alone
    run(TORCHRUN + two + ["--steps", "3", "--resume"], timeout=900)
    assert [r["step"] for r in rows(out) if "reward" in r] == [1, 2, 3]
    merged = str(tmp_path / "merged")
    ckpt = os.path.join(out, "checkpoints", "step_3")
    merge = [sys.executable, "-m", "lightning_lite.extras.lora", "merge", ckpt, merged]
    p = subprocess.run(merge, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "--adapter one of" in p.stderr and "'length'" in p.stderr, p.stderr
    run(merge + ["--adapter", "length"])
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        plain = load_model("smollm2")(input_ids=ids).logits
    assert (got - plain).abs().max() > 1e-3
