"""LoRA (extras/lora.py, train.py --lora) on the embedded model: only the adapters train, the embedded backend
serves the adapted module with the trainer's logprobs, the KL reference is the base, bad flags exit naming the fix;
end to end (make test-slow): two DDP ranks, a checkpoint of the adapters alone, --resume, the merge command."""

import argparse
import asyncio
import os
import sys

import pytest
import torch


from lightning_lite import algo
from lightning_lite.apis import Sampling
from lightning_lite.backends import HFBackend
from lightning_lite.extras import lora
from lightning_lite.models import load_model
from lightning_lite.records import Sample
from test_train import rows, run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def flags(**kw):
    base = dict(lora=8, lora_alpha=None, lora_targets=None, model="smollm2", backend="hf")
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


def test_the_embedded_backend_serves_the_adapters_with_the_trainers_logprobs(adapted, tok):
    """Two replies to one prompt, sampled by the backend serving the adapted module, scored as the trainer
    scores them (a packed tree): the same logprobs at fp32, to the 1e-5 level."""
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    )
    backend = HFBackend(adapted, tok)

    async def sample():
        replies = [Sampling(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
        return await asyncio.gather(*(backend.generate(prompt, s) for s in replies))

    try:
        replies = asyncio.run(sample())
    finally:
        backend.close()
    samples = []
    for g in replies:
        n, m = len(prompt), len(g.response_ids)
        s = Sample("r", prompt + g.response_ids, [0] * n + [1] * m, [0.0] * n + g.logprobs)
        s.temperature, s.top_k, s.top_p = [1.0] * (n + m), [0] * (n + m), [1.0] * (n + m)
        samples.append(s)
    b = algo.collate(samples, [1.0, 1.0], tree=True)
    with torch.no_grad():
        mine = algo.trainer_logprobs(adapted, b)
    on = b["loss_mask"] > 0
    assert (mine - b["old_logprobs"])[on].abs().max() < 1e-4


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(lora=0), "positive integer"),
        (dict(lora_targets="qproj"), "q_proj"),
        (dict(lora=None, lora_alpha=32.0), "add --lora RANK"),
        (dict(backend="vllm"), "--backend hf"),
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
