"""The GPU checks that need only torch, transformers, peft and this repo: no `make venv`, no
embedded model, no vLLM, no hub. Every model is random, built from a config below; one process,
one GPU. Five checks, each one key of the JSON it writes (--out, or $OUT/gpu_check.json):

- ``fsdp``: FSDP2 at world size 1 (NCCL; gloo under --smoke) through parallel.wrap and
  parallel.accumulating, as trainer.Learner runs them: the peak memory of a few micro-batches of
  backward and the gradient bytes held after a micro-batch that is not the last.
- ``mismatch``: the embedded backend (backends.HFBackend) samples under bf16 autocast; the trainer's
  one-pass forward (algo.trainer_logprobs, a packed tree) scores the same tokens in bf16 and fp32:
  |dlogp| (mean, p50, p99, max) and the share of tokens PPO's default clip would clip.
- ``head_memory``: the peak memory of the LM head's chunked logprobs (forward and backward) at
  Qwen3.5's vocabulary of 248,320.
- ``tree_memory``: the peak memory of a packed tree's forward and backward (algo.collate's tree,
  algo.tree_mask, the attention the trainer runs) at 4k and 16k tokens.
- ``weight_sync``: extras/vllm.py's ``_write`` (each tensor to host memory in bf16 as it is written) on a
  state dict of Qwen3-8B's tensors (8.2B parameters, fp32 on the GPU as the trainer's masters):
  seconds per GB written, and peak host memory against the largest tensor.

A check that fails is recorded with its error (and what it measured before it failed); the others
still run, and the exit status is 1. Every measurement's name ends in its unit (UNITS).

    python scripts/gpu_check.py --smoke          # any CPU: tiny shapes, gloo (make gpu-check-smoke)
    python scripts/gpu_check.py --only mismatch  # one check

On a bare GPU machine (the device tool: the repo's working tree, $OUT comes back), the command:

    python scripts/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tail -n 100
"""

import argparse
import asyncio
import gc
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

# Run as a script (python scripts/gpu_check.py): the repo root is not on the path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lightning_lite.extras.fast_decode  # noqa: E402,F401  the backend's decoding, as in train.py
import lightning_lite.extras.fsdp  # noqa: E402,F401  registers --parallel fsdp
from lightning_lite import algo, parallel  # noqa: E402
from lightning_lite.backends import HFBackend  # noqa: E402
from lightning_lite.chat import Sampling  # noqa: E402
from lightning_lite.extras.vllm import VLLMBackend  # noqa: E402
from lightning_lite.extras.fast_decode import install_trainer  # noqa: E402
from lightning_lite.records import Sample  # noqa: E402
from lightning_lite.trainer import return_freed_memory  # noqa: E402

# The unit each measurement's name ends in.
UNITS = ("_bytes", "_s", "_nats", "_fraction", "_count", "_GB", "_s_per_GB", "_bytes_per_GB")
UNITS += ("_bytes_per_param",)

# Qwen3-shaped models, as transformers.Qwen3Config keywords. Every model is random (torch.manual_seed).
FULL = {
    # ~168M parameters: 670 MB of fp32 masters
    "fsdp_model": dict(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=False,
    ),
    # micro-batches, each a GRPO group: a prompt and its replies, packed as one tree
    "fsdp_batches": dict(micro_batches=4, prompt=256, replies=8, reply=224),
    # prompts x replies each, prompt and reply tokens (4,096 sampled tokens)
    "mismatch_batch": dict(prompts=4, replies=4, prompt=128, reply=256),
    # one layer: the memory is the head's; tied embeddings (one [V, H] matrix)
    "head_model": dict(
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=2048,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "head_tokens": 4096,
    "tree_model": dict(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "tree_tokens": [4096, 16384],
    # Qwen3-8B's shapes (8.19B parameters)
    "sync_model": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
# The logits' standard deviation over the vocabulary that the mismatch check scales its model's LM
# head to: a trained model's order (its sampled tokens then carry ~1-3 nats), where a random one's
# is below 1 and its distribution near uniform. bf16's rounding of the logits grows with them.
LOGIT_STD = 5.0
# The same code on tiny shapes (--smoke): seconds on a CPU.
SMOKE = {
    "fsdp_model": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "fsdp_batches": dict(micro_batches=3, prompt=32, replies=4, reply=24),
    "mismatch_batch": dict(prompts=2, replies=2, prompt=16, reply=16),
    "head_model": dict(FULL["head_model"], vocab_size=4096, hidden_size=64, intermediate_size=128),
    "head_tokens": 256,
    "tree_model": dict(
        FULL["tree_model"], vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=16
    ),
    "tree_tokens": [256, 512],
    # 59M parameters: a 118 MB file, enough for a per-GB number
    "sync_model": dict(
        FULL["sync_model"],
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


# ----------------------------------------------------------------------------- measuring


def sync(device):
    """Wait for the GPU's queued work, so that a clock or a memory counter sees it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_bytes(field: str) -> int:
    """This process's host memory from /proc/self/status: "VmRSS" now, "VmHWM" its peak since
    ``reset_host_peak``, in bytes."""
    with open("/proc/self/status") as f:
        kb = re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)
    return int(kb) * 1024


def reset_host_peak():
    """Start VmHWM again from VmRSS (Linux: clear_refs 5), once the heap has given back what it
    freed (else a peak that reuses freed heap memory reads as nothing new)."""
    return_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Peak:
    """The peak memory of a block, and what was held at its start, in bytes: on a GPU the caching
    allocator's (torch.cuda.max_memory_allocated), on a CPU the process's resident memory (VmHWM;
    coarser: it counts every page touched, the heap's included).

        with Peak(device) as peak:
            ...
        peak.above_start  # bytes at the peak beyond those held when the block began
    """

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            reset_host_peak()
            self.start = host_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        sync(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = host_bytes("VmHWM")
        self.above_start = self.peak - self.start


def held_bytes(device) -> int:
    """The memory held now: the GPU allocator's, or this process's resident memory on a CPU."""
    sync(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return host_bytes("VmRSS")


def free_memory(device):
    """Drop what the last check left (its models, caches) before the next one measures."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return_freed_memory()


def random_model(shape: dict, device, seed: int = 0):
    """A random Qwen3 causal LM of ``shape`` (Qwen3Config keywords), fp32, built on ``device``.
    No token ends a reply (no EOS): the backend samples exactly max_tokens."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )
    return model


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` tokens named t0, t1, ..., no EOS: what HFBackend
    needs of one (EOS ids, decode) without a tokenizer file from the hub."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def group_samples(prompt: list[int], replies: list[list[int]], rid: str, vocab_size: int) -> list:
    """A GRPO group: each reply after the shared prompt, trained on its reply tokens (advantages
    +1 and -1 in turn; rollout logprobs -log V, a random model's near-uniform ones, so that the
    ratios are near 1 and PPO's clip leaves them their gradient)."""
    samples = []
    for k, reply in enumerate(replies):
        n = len(reply)
        advantage = 1.0 - 2.0 * (k % 2)
        samples.append(
            Sample(
                f"{rid}-{k}",
                prompt + reply,
                [0] * len(prompt) + [1] * n,
                [0.0] * len(prompt) + [-math.log(vocab_size)] * n,
                advantages=[0.0] * len(prompt) + [advantage] * n,
            )
        )
    return samples


def random_ids(n: int, vocab_size: int, generator) -> list[int]:
    """``n`` token ids drawn uniformly from the vocabulary."""
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def forward_backward(model, samples: list[Sample], device, dtype):
    """One micro-batch as trainer.Learner.backward runs it (packed as a tree, autocast in
    ``dtype`` over fp32 weights, algo.policy_loss with its defaults): the loss's backward."""
    weights = [1.0 / len(samples)] * len(samples)
    batch = algo.collate(samples, weights, device, pad_id=0, tree=True)
    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        logprobs, entropy = algo.trainer_logprobs_and_entropy(model, batch)
    loss, _ = algo.policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        batch["weights"],
        entropy=entropy,
    )
    loss.backward()
    return batch


# ----------------------------------------------------------------------------- the checks


def gradient_bytes(model) -> tuple[int, int]:
    """(bytes in the parameters' .grad (each rank's shard), bytes FSDP2 accumulates apart while
    gradients are not reduced: its unsharded gradients, fp32, of set_requires_gradient_sync(False)).
    """
    from torch.distributed.fsdp import FSDPModule

    in_grad = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        # a DTensor's shard on this rank
        local = p.grad
        if hasattr(local, "to_local"):
            local = local.to_local()
        in_grad += local.numel() * local.element_size()
    accumulated = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        # a module that holds no parameters of its own (its layers are shard units of their own)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            held = [fsdp_param.unsharded_accumulated_grad]
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            held.append(getattr(unsharded, "grad", None))
            accumulated += sum(t.numel() * t.element_size() for t in held if t is not None)
    return in_grad, accumulated


def check_fsdp(sizes, device, dtype, out: dict):
    """FSDP2 at world size 1 through parallel.wrap / parallel.accumulating (what --parallel fsdp
    runs): peak memory over the micro-batches, gradient bytes after the first (not the last) and
    after the last."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        shape = sizes["fsdp_model"]
        model = random_model(shape, device)
        install_trainer(model)
        n_params = sum(p.numel() for p in model.parameters())
        model = parallel.wrap(model, "fsdp", 1, dtype=dtype)
        model.train()
        plan = sizes["fsdp_batches"]
        g = torch.Generator().manual_seed(1)
        out["config"] = {"model": shape, "batches": plan, "backend": backend, "dtype": str(dtype)}
        out["params_count"] = n_params
        start = held_bytes(device)
        out["held_before_bytes"] = start
        n = plan["micro_batches"]
        t0 = time.perf_counter()
        with Peak(device) as peak:
            for i in range(n):
                prompt = random_ids(plan["prompt"], shape["vocab_size"], g)
                replies = [
                    random_ids(plan["reply"], shape["vocab_size"], g)
                    for _ in range(plan["replies"])
                ]
                samples = group_samples(prompt, replies, f"mb{i}", shape["vocab_size"])
                last = i == n - 1
                with parallel.accumulating(model, "fsdp", last=last):
                    forward_backward(model, samples, device, dtype)
                in_grad, accumulated = gradient_bytes(model)
                if i == 0 and not last:
                    out["after_first_grad_bytes"] = in_grad
                    out["after_first_unsharded_accumulated_bytes"] = accumulated
                    out["after_first_held_above_start_bytes"] = held_bytes(device) - start
                    total = in_grad + accumulated
                    out["after_first_grad_bytes_per_param"] = total / n_params
        sync(device)
        out["micro_batches_s"] = time.perf_counter() - t0
        out["peak_bytes"] = peak.peak
        out["peak_above_start_bytes"] = peak.above_start
        out["after_last_grad_bytes"] = in_grad
        out["after_last_unsharded_accumulated_bytes"] = accumulated
        out["after_last_held_above_start_bytes"] = held_bytes(device) - start
    finally:
        dist.destroy_process_group()


def dlogp_stats(trainer: torch.Tensor, served: torch.Tensor, prefix: str, out: dict):
    """|trainer - served| over the sampled tokens ([N] each): mean, p50, p99, max, and the share
    of tokens whose ratio exp(trainer - served) PPO's default clip clips (algo.clip_range("ppo"):
    outside [0.8, 1.28])."""
    d = (trainer.double() - served.double()).abs()
    out[f"{prefix}_dlogp_mean_nats"] = d.mean().item()
    out[f"{prefix}_dlogp_p50_nats"] = d.quantile(0.5).item()
    out[f"{prefix}_dlogp_p99_nats"] = d.quantile(0.99).item()
    out[f"{prefix}_dlogp_max_nats"] = d.max().item()
    low, high = algo.clip_range("ppo")
    ratio = (trainer.double() - served.double()).exp()
    clipped = (ratio < 1 - low) | (ratio > 1 + high)
    out[f"{prefix}_ppo_clipped_fraction"] = clipped.double().mean().item()


def check_mismatch(sizes, device, dtype, out: dict):
    """The embedded backend samples under bf16 autocast (train.py --dtype bf16, the GPU default:
    it serves the trainer's fp32 module, as under DDP); the trainer scores the same tokens in one
    packed forward under bf16 autocast and in fp32."""
    shape = sizes["fsdp_model"]
    plan = sizes["mismatch_batch"]
    model = random_model(shape, device).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [random_ids(plan["prompt"], shape["vocab_size"], g) for _ in range(plan["prompts"])]
    # the LM head scaled so that the logits' std over the vocabulary is LOGIT_STD
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        probe = model(input_ids=torch.tensor(prompts[:1], device=device)).logits
        head.mul_(LOGIT_STD / probe.float().std(-1).mean())
        probe = model(input_ids=torch.tensor(prompts[:1], device=device)).logits
    out["logit_std_nats"] = probe.float().std(-1).mean().item()
    # as trainer.Learner prepares its model before train.py starts the backend on it
    install_trainer(model)
    tok = tiny_tokenizer(shape["vocab_size"])
    total = plan["prompt"] + plan["reply"]
    backend = HFBackend(model, tok, max_model_len=total, dtype=torch.bfloat16)

    async def sample_all():
        calls = []
        for i, prompt in enumerate(prompts):
            for k in range(plan["replies"]):
                sampling = Sampling(max_tokens=plan["reply"], temperature=1.0, seed=100 * i + k)
                calls.append(backend.generate(prompt, sampling))
        return await asyncio.gather(*calls)

    out["config"] = {"model": shape, "batch": plan, "sampler": "HFBackend, bf16 autocast"}
    t0 = time.perf_counter()
    try:
        generations = asyncio.run(sample_all())
    finally:
        backend.close()
    out["sampling_s"] = time.perf_counter() - t0
    samples = []
    for i, prompt in enumerate(prompts):
        for k in range(plan["replies"]):
            gen = generations[i * plan["replies"] + k]
            pad = [0] * len(prompt)
            n = len(gen.response_ids)
            samples.append(
                Sample(f"r{i}-{k}", prompt + gen.response_ids, pad + [1] * n, pad + gen.logprobs)
            )
    batch = algo.collate(samples, [1.0] * len(samples), device, pad_id=0, tree=True)
    on = batch["loss_mask"] > 0
    served = batch["old_logprobs"][on]
    out["sampled_tokens_count"] = int(on.sum())
    # how peaked the sampled distributions were (a uniform one: log V nats)
    out["sampled_nll_mean_nats"] = -served.double().mean().item()
    with torch.no_grad():
        with torch.autocast(device.type, torch.bfloat16):
            bf16 = algo.trainer_logprobs(model, batch)[on]
        fp32 = algo.trainer_logprobs(model, batch)[on]
    dlogp_stats(bf16, served, "trainer_bf16", out)
    dlogp_stats(fp32, served, "trainer_fp32", out)


def check_head_memory(sizes, device, dtype, out: dict):
    """The forward and backward of algo.trainer_logprobs_and_entropy over ``head_tokens`` trained
    tokens of one sample, at a large vocabulary: the head runs 1,024 tokens at a time (its
    default chunk), so the logits held are [1024, V], not [T, V]."""
    shape = sizes["head_model"]
    T = sizes["head_tokens"]
    model = random_model(shape, device).train()
    install_trainer(model)
    V = shape["vocab_size"]
    g = torch.Generator().manual_seed(3)
    prompt = random_ids(1, V, g)
    samples = group_samples(prompt, [random_ids(T, V, g)], "head", V)
    out["config"] = {"model": shape, "trained_tokens": T, "chunk": 1024, "dtype": str(dtype)}
    # for reading the peak: fp32 logits of one chunk, of all T tokens at once, the head's gradient
    out["one_chunk_fp32_logits_bytes"] = min(T, 1024) * V * 4
    out["unchunked_fp32_logits_bytes"] = T * V * 4
    out["head_weight_grad_bytes"] = V * shape["hidden_size"] * 4
    t0 = time.perf_counter()
    with Peak(device) as peak:
        forward_backward(model, samples, device, dtype)
    out["forward_backward_s"] = time.perf_counter() - t0
    out["peak_above_start_bytes"] = peak.above_start


def check_tree_memory(sizes, device, dtype, out: dict):
    """The forward and backward of a GRPO group packed as one tree (a prompt of L/8 tokens, 7
    replies of L/8) of L tokens, for each L of ``tree_tokens``: the mask (algo.tree_mask, [L, L]
    bool) and the attention the trainer runs it with (sdpa on a GPU, block_sdpa on a CPU)."""
    shape = sizes["tree_model"]
    model = random_model(shape, device).train()
    install_trainer(model)
    g = torch.Generator().manual_seed(4)
    out["config"] = {"model": shape, "tokens": sizes["tree_tokens"], "dtype": str(dtype)}
    out["config"]["attention"] = model.config._attn_implementation
    for L in sizes["tree_tokens"]:
        part = L // 8
        prompt = random_ids(part, shape["vocab_size"], g)
        replies = [random_ids(part, shape["vocab_size"], g) for _ in range(7)]
        samples = group_samples(prompt, replies, f"tree{L}", shape["vocab_size"])
        out[f"tree_{L}_mask_bytes"] = L * L
        t0 = time.perf_counter()
        with Peak(device) as peak:
            batch = forward_backward(model, samples, device, dtype)
        out[f"tree_{L}_forward_backward_s"] = time.perf_counter() - t0
        out[f"tree_{L}_packed_count"] = batch["fwd_tokens"]
        out[f"tree_{L}_peak_above_start_bytes"] = peak.above_start
        model.zero_grad(set_to_none=True)
        free_memory(device)


def check_weight_sync(sizes, device, dtype, out: dict):
    """extras/vllm.py's VLLMBackend._write (each tensor converted to bf16, copied to host memory and
    written in turn: write_safetensors) on a state dict of ``sync_model``'s tensors, fp32 on ``device`` (the trainer's
    masters under DDP). Measured: the copy to host alone, then the whole _write (copy and file);
    per GB of the file; and the arithmetic for Qwen3-8B's 8.19B parameters."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    def names_and_shapes(shape):
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(Qwen3Config(**shape))
        return {name: t.shape for name, t in meta.state_dict().items()}

    shapes = names_and_shapes(sizes["sync_model"])
    shapes_8b = names_and_shapes(FULL["sync_model"])
    params_8b = sum(s.numel() for s in shapes_8b.values())
    state = {}
    for name, shape in shapes.items():
        state[name] = torch.empty(shape, device=device).normal_(std=0.02)
    n_params = sum(t.numel() for t in state.values())
    written = n_params * 2
    # where the file goes: in memory (/dev/shm) when it fits twice, as extras/vllm.py _sync_dir
    # picks, else the temporary folder's disk
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * written
    folder = tempfile.mkdtemp(prefix="gpu-check-sync-", dir="/dev/shm" if shm else None)
    out["config"] = {"model": sizes["sync_model"], "folder": folder, "from": str(device)}
    out["params_count"] = n_params
    try:
        # the first copy's one-time costs (kernels, the host allocator) kept out of the per-GB numbers
        smallest = min(state.values(), key=lambda t: t.numel())
        smallest.to("cpu", torch.bfloat16)
        reset_host_peak()
        start = host_bytes("VmRSS")
        sync(device)
        t0 = time.perf_counter()
        copied = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state.items()}
        out["copy_to_host_s"] = time.perf_counter() - t0
        out["copy_host_peak_above_start_bytes"] = host_bytes("VmHWM") - start
        del copied
        reset_host_peak()
        start = host_bytes("VmRSS")
        writer = SimpleNamespace(sync_dir=folder)
        dtypes = {name: torch.bfloat16 for name in state}
        t0 = time.perf_counter()
        VLLMBackend._write(writer, state, dtypes)
        out["write_s"] = time.perf_counter() - t0
        out["write_host_peak_above_start_bytes"] = host_bytes("VmHWM") - start
        path = os.path.join(folder, "model.safetensors")
        out["file_GB"] = os.path.getsize(path) / 1e9
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gb = out["file_GB"]
    out["copy_to_host_s_per_GB"] = out["copy_to_host_s"] / gb
    out["write_s_per_GB"] = out["write_s"] / gb
    # _write holds one tensor at a time in host memory: its peak follows the largest tensor (the
    # embeddings), not the file's size
    largest = max(s.numel() for s in shapes.values()) * 2
    largest_8b = max(s.numel() for s in shapes_8b.values()) * 2
    out["largest_tensor_bf16_bytes"] = largest
    out["write_host_peak_per_largest_tensor_fraction"] = (
        out["write_host_peak_above_start_bytes"] / largest
    )
    # the same at Qwen3-8B's bf16 size: seconds per GB, host memory per largest tensor
    gb_8b = params_8b * 2 / 1e9
    out["qwen3_8b_bf16_GB"] = gb_8b
    out["qwen3_8b_write_s"] = out["write_s_per_GB"] * gb_8b
    fraction = out["write_host_peak_per_largest_tensor_fraction"]
    out["qwen3_8b_write_host_peak_bytes"] = fraction * largest_8b


CHECKS = {
    "fsdp": check_fsdp,
    "mismatch": check_mismatch,
    "head_memory": check_head_memory,
    "tree_memory": check_tree_memory,
    "weight_sync": check_weight_sync,
}


# ----------------------------------------------------------------------------- running and reporting


def unitless(result: dict) -> list[str]:
    """The measurements of a check's result whose names end in no unit of UNITS, or that are not
    finite numbers (``config``, ``ok``, ``error`` and ``traceback`` are not measurements)."""
    bad = []
    for key, value in result.items():
        if key in ("config", "ok", "error", "traceback"):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not key.endswith(UNITS) or not number or not math.isfinite(value):
            bad.append(key)
    return bad


def run_checks(checks: dict, sizes: dict, device, dtype) -> dict:
    """Each check in turn, into its own key: its measurements, ``ok``, ``wall_s``; a check that
    raises keeps what it measured and gets ``error`` and ``traceback``, and the next one runs."""
    results = {}
    for name, check in checks.items():
        result = {}
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            check(sizes, device, dtype, result)
            bad = unitless(result)
            if bad:
                raise ValueError(f"measurements without a unit or not finite: {bad}")
            result["ok"] = True
        except Exception as e:
            result["ok"] = False
            result["error"] = f"{type(e).__name__}: {e}"
            result["traceback"] = traceback.format_exc()
            print(result["traceback"], file=sys.stderr, flush=True)
        result["wall_s"] = time.perf_counter() - t0
        results[name] = result
        free_memory(device)
    return results


def readable(key: str, value) -> str:
    """A measurement as the table shows it: bytes in GiB (MiB below 1 GiB), the rest as written."""
    if key.endswith("_bytes") or key.endswith("_bytes_per_GB"):
        if abs(value) >= 2**30:
            return f"{value / 2**30:.3f} GiB"
        return f"{value / 2**20:.2f} MiB"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def print_table(report: dict):
    meta = report["meta"]
    print(f"\n{meta['device']}; torch {meta['torch']}; smoke {meta['smoke']}")
    print(f"{'check':12} {'measurement':48} {'value':>14}")
    for name in CHECKS:
        result = report.get(name)
        if result is None:
            continue
        status = "ok" if result["ok"] else f"FAILED: {result['error']}"
        print(f"{name:12} {'status':48} {status:>14}")
        for key, value in result.items():
            if key in ("config", "ok", "error", "traceback"):
                continue
            print(f"{'':12} {key:48} {readable(key, value):>14}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, gloo")
    parser.add_argument("--out", help="the JSON's path (default: $OUT/gpu_check.json)")
    parser.add_argument("--only", action="append", choices=list(CHECKS), help="repeatable")
    args = parser.parse_args(argv)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "gpu_check.json")
    if out is None:
        parser.error("say where the JSON goes: --out PATH, or set $OUT")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit(
            "gpu_check.py: no CUDA device here (torch.cuda.is_available() is False): run it on a "
            "GPU machine, or pass --smoke to run the same code on tiny shapes on this CPU"
        )
    device = torch.device("cpu")
    sizes = SMOKE
    if not args.smoke:
        device = torch.device("cuda:0")
        torch.cuda.set_device(device)
        sizes = FULL
    dtype = torch.bfloat16
    checks = {name: CHECKS[name] for name in args.only or CHECKS}
    name = "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    report = {
        "meta": {
            "device": name,
            "torch": torch.__version__,
            "smoke": args.smoke,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    }
    t0 = time.perf_counter()
    report.update(run_checks(checks, sizes, device, dtype))
    report["meta"]["wall_s"] = time.perf_counter() - t0
    report["failed"] = [name for name in checks if not report[name]["ok"]]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    print(f"\n[gpu_check] {out}; {report['meta']['wall_s']:.1f} s; failed: {report['failed']}")
    if report["failed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
