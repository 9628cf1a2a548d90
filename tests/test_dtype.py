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

from conftest import ROOT

from lightning_lite.algo import collate, trainer_logprobs
from lightning_lite.backends import HFBackend
from lightning_lite.chat import Sampling
from lightning_lite.records import Sample, read_jsonl


def test_bf16_backend_serves_the_logprobs_the_bf16_trainer_computes(model, tok):
    chat = [{"role": "user", "content": "Say something about the sea."}]
    prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))[
        "input_ids"
    ]
    backend = HFBackend(
        model, tok, max_model_len=256, dtype=torch.bfloat16
    )  # the module itself, as under DDP
    try:
        gen = asyncio.run(backend.generate(prompt, Sampling(max_tokens=16, seed=0)))
    finally:
        backend.close()
    n, pad = len(gen.response_ids), [0] * len(prompt)
    b = collate([Sample("r", prompt + gen.response_ids, pad + [1] * n, pad + gen.logprobs)], [1.0])
    served = torch.tensor(gen.logprobs)
    with torch.no_grad():
        fp32 = trainer_logprobs(model, b)[0, -n:]
        with torch.autocast("cpu", torch.bfloat16):
            bf16 = trainer_logprobs(model, b)[0, -n:]
    d_bf16, d_fp32 = (bf16 - served).abs().mean().item(), (fp32 - served).abs().mean().item()
    print(f"|served - trainer|: bf16 autocast {d_bf16:.4f}, fp32 {d_fp32:.4f} over {n} tokens")
    # served under bf16 autocast: not the fp32 logprobs (an fp32 backend gives them to ~1e-5), the bf16 trainer's to
    # bf16 noise. That noise is as large as the bf16 - fp32 gap (measured: 0.017-0.038 both): two bf16 computations of
    # other shapes (prefill, decode with a KV cache vs one pass) round differently, so the ratio is 1 only to ~3%.
    assert d_fp32 > 1e-3 and d_bf16 < 0.1


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_train_py_bf16_trains_serves_and_checkpoints_fp32_masters_with_the_served_dtype(tmp_path):
    from safetensors import safe_open

    from lightning_lite.models import load_model

    out = str(tmp_path / "run")
    harness = os.path.join(ROOT, "tests", "harnesses.py") + ":LengthHarness"
    args = [
        "--harness",
        harness,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--eval-tasks",
        "0",
    ]
    cmd = [sys.executable, "train.py", *args, "--dtype", "bf16", "--out", out]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert row["grad_norm"] > 0 and 1e-3 < row["dlogp_mean"] < 0.1, (
        row
    )  # bf16 noise (fp32 on both sides: ~1e-5)
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
