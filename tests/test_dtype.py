"""--dtype bf16: the trainer computes under bf16 autocast on fp32 master weights, the embedded backend serves under
the same autocast (so its recorded logprobs are the trainer's, to bf16 noise), FSDP gathers the weights in bf16,
and checkpoints hold the fp32 masters with the served dtype in config.json."""

import asyncio
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers.cache_utils import DynamicCache

from conftest import ROOT

from lightning_lite.backends import HFBackend
from lightning_lite.chat import Sampling
from lightning_lite.records import read_jsonl


def decode_logprobs(model, prompt: list[int], ids: list[int], dtype) -> torch.Tensor:
    """[len(ids)] the logprob of each of ``ids`` after ``prompt`` and the ids before it, under a
    plain transformers decode in the embedded backend's shapes (the prompt in one forward, then one
    token a forward on its KV cache), under autocast to ``dtype`` (fp32: none), at temperature 1."""
    bf16 = dtype == torch.bfloat16
    out = []
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        cache = DynamicCache()
        inputs = dict(past_key_values=cache, use_cache=True)
        logits = model(input_ids=torch.tensor([prompt]), logits_to_keep=1, **inputs).logits
        for i, token in enumerate(ids):
            out.append(float(torch.log_softmax(logits[0, -1].float(), -1)[token]))
            if i + 1 < len(ids):
                logits = model(input_ids=torch.tensor([[token]]), **inputs).logits
    return torch.tensor(out)


def test_bf16_backend_serves_the_logprobs_of_a_bf16_forward(model, tok):
    """HFBackend(dtype=bf16), as train.py --dtype bf16 (or --serve-dtype bf16) makes it, computes
    under bf16 autocast, the trainer's dtype: its logprobs are those of a plain bf16-autocast
    decode of the same weights in the same shapes, to the bit (measured: max |difference| 0 over 8
    tokens), and not fp32's (mean |difference| 1e-2 to 4e-2). An fp32 backend fails the first
    bound by as much. Only the same shapes tell the two dtypes apart: the trainer's one-pass
    forward (other shapes) rounds bf16 differently, and measured |served - bf16 trainer| 0.021-0.048
    against |served - fp32 trainer| 0.020-0.034, so no bound on those separates bf16 from fp32."""
    chat = [{"role": "user", "content": "Say something about the sea."}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tok(text)["input_ids"]
    # the module itself, as under DDP
    backend = HFBackend(model, tok, max_model_len=256, dtype=torch.bfloat16)
    try:
        gen = asyncio.run(backend.generate(prompt, Sampling(max_tokens=8, seed=0)))
    finally:
        backend.close()
    served = torch.tensor(gen.logprobs)
    bf16 = decode_logprobs(model, prompt, gen.response_ids, torch.bfloat16)
    fp32 = decode_logprobs(model, prompt, gen.response_ids, torch.float32)
    d_bf16, d_fp32 = (bf16 - served).abs(), (fp32 - served).abs()
    print(f"|served - bf16 decode| max {d_bf16.max():.2e}, |served - fp32 decode| mean ", end="")
    print(f"{d_fp32.mean():.2e} over {len(served)} tokens")
    assert len(served) == 8
    assert d_bf16.max() < 1e-4 and d_fp32.mean() > 1e-3, (served, bf16, fp32)


def fp32_logprobs(model, tokens: list[int], positions: list[int]) -> list[float]:
    """The fp32 logprob of ``tokens[p]`` after ``tokens[:p]`` for each p of ``positions``, at
    temperature 1, from one forward without autocast."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[p - 1, tokens[p]]) for p in positions]


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_train_py_bf16_trains_serves_and_checkpoints_fp32_masters_with_the_served_dtype(tmp_path):
    """train.py --dtype bf16: the sampler and the trainer both compute in bf16, each told apart
    from fp32 by the step's own records. The trained tokens' rollout logprobs (calls/, and
    tokens/step_0.jsonl's "old") and the trainer's ("logprob"), against an fp32 forward of the same
    weights (step 1's rollouts and backward run on the initial ones): each side's mean |difference|
    is bf16 rounding (measured in two runs: sampler 2.7e-2 to 3.8e-2, trainer 3.0e-2 to 3.6e-2),
    where an fp32 side gives ~1e-5 (measured with the backend made fp32: sampler 5e-6; with the
    trainer's autocast off: trainer 2e-6), so each must be past 1e-3. A bound on the mean
    |trainer - sampler| (dlogp_mean) alone cannot tell: bf16 on either side alone gives ~2e-2 too.
    Then the checkpoint holds the fp32 masters and names the served dtype."""
    from safetensors import safe_open

    from lightning_lite.models import load_model

    out = str(tmp_path / "run")
    harness = os.path.join(ROOT, "tests", "harnesses.py") + ":LengthHarness"
    # ranked: the group has a signal whatever was sampled, so the step runs its backward
    args = ["--harness", harness, "--harness-arg", "ranked=True", "--steps", "1"]
    args += ["--batch-size", "2", "--group-size", "2", "--eval-tasks", "0"]
    cmd = [sys.executable, "train.py", *args, "--dtype", "bf16", "--out", out]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    # bf16 noise (fp32 on both sides: ~1e-5)
    assert row["grad_norm"] > 0 and 1e-3 < row["dlogp_mean"] < 0.1, row
    calls = {c["rollout_id"]: c for c in read_jsonl(os.path.join(out, "calls", "step_0.jsonl"))}
    lines = list(read_jsonl(os.path.join(out, "tokens", "step_0.jsonl")))
    # every trained token of the 4 rollouts (one call each), each recorded once
    assert sorted(line["rollout_id"] for line in lines) == sorted(calls)
    # the weights step 1 sampled and trained with, as loaded (not the session's shared model)
    initial = load_model("smollm2").eval()
    served, trainer, fp32 = [], [], []
    for line in lines:
        call = calls[line["rollout_id"]]
        tokens = call["prompt_ids"] + call["response_ids"]
        assert line["token"] == [tokens[p] for p in line["pos"]]
        assert line["old"] == pytest.approx(call["response_logprobs"], abs=1e-6)
        served += line["old"]
        trainer += line["logprob"]
        fp32 += fp32_logprobs(initial, tokens, line["pos"])
    fp32 = torch.tensor(fp32)
    d_served = (torch.tensor(served) - fp32).abs().mean().item()
    d_trainer = (torch.tensor(trainer) - fp32).abs().mean().item()
    print(f"mean |logprob - fp32|: sampler {d_served:.2e}, trainer {d_trainer:.2e}")
    assert 1e-3 < d_served < 0.1 and 1e-3 < d_trainer < 0.1, (d_served, d_trainer)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bf16"
    ckpt = os.path.join(out, "checkpoints", "step_1")
    assert (
        json.load(open(os.path.join(ckpt, "config.json")))["dtype"] == "bfloat16"
    )  # what --dtype auto loaders pick
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {
            "F32"
        }  # the masters: --resume continues exactly
    assert next(load_model(ckpt).parameters()).dtype == torch.float32  # what --resume loads


def _fsdp_worker(port):
    """One gloo rank: parallel.wrap(dtype=bf16) gathers the weights in bf16 for compute; the shards stay fp32."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_lite import parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda m, a: seen.append(m.weight.dtype)
    )
    parallel.wrap(model, "fsdp", 1, dtype=torch.bfloat16)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
    assert seen == [torch.bfloat16], seen
    assert (
        {p.dtype for p in model.parameters()}
        == {p.grad.dtype for p in model.parameters()}
        == {torch.float32}
    )
    dist.destroy_process_group()


def test_fsdp_under_bf16_computes_with_bf16_weights_and_keeps_fp32_shards():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"import sys; sys.path.insert(0, 'tests'); from test_dtype import _fsdp_worker; _fsdp_worker({port})"
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
