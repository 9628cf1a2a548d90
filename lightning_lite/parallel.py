"""Data parallelism: DDP, a full copy of the policy on each rank (torchrun). The loss is the same as
in one process: DDP averages gradients over ranks, and the trainer's sample weights already make the
global sum. The padding of a rank's micro-batches is here too: under sharding every rank runs as
many as the others (``pad_micro_batches``, ``padding``), and under flex_attention each has one shape
(``row_length``).

Another mode (``--parallel fsdp``: the weights, gradients and AdamW state sharded) is an extra
registered in ``hooks.PARALLEL``: each function here hands such a mode to the extra's function of
the same name.
"""

import contextlib
import os
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import hooks
from .algo import all_reduce
from .records import Sample


# How long a collective waits for the slowest rank before the job fails (train.py --dist-timeout):
# NCCL's own default, 10 minutes, is shorter than a slow rank's agent rollouts or vLLM's first start.
DIST_TIMEOUT_MINUTES = 120.0


def process_group_options(device_name: str, minutes: float) -> tuple[str, timedelta]:
    """(backend, timeout) of the process group torchrun's ranks share. On GPUs NCCL reduces CUDA
    tensors and gloo CPU ones (--fsdp-offload's gradient norm is over CPU shards); on CPUs gloo
    alone. E.g. ("cuda", 120) -> ("cpu:gloo,cuda:nccl", timedelta(hours=2)); ("cpu", 5) ->
    ("gloo", timedelta(minutes=5))."""
    backend = "gloo"
    if device_name == "cuda":
        backend = "cpu:gloo,cuda:nccl"
    return backend, timedelta(minutes=minutes)


def init(
    device_name: str, timeout_minutes: float = DIST_TIMEOUT_MINUTES
) -> tuple[bool, int, int, torch.device]:
    """(ddp, rank, world size, this rank's device). Under torchrun (WORLD_SIZE > 1) the process
    group starts here (process_group_options: NCCL and gloo on GPUs, gloo on CPUs; a collective
    fails after ``timeout_minutes`` waiting); each rank takes the GPU of its LOCAL_RANK."""
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    world = 1
    if ddp:
        backend, timeout = process_group_options(device_name, timeout_minutes)
        dist.init_process_group(backend, timeout=timeout)
        rank = dist.get_rank()
        world = dist.get_world_size()
    device = torch.device(device_name)
    if device_name == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    return ddp, rank, world, device


def load(load_whole, device: torch.device, parallel: str):
    """The policy to train: ``load_whole(device)``, the whole model on ``device``, or what the
    sharding extra of mode ``parallel`` builds instead (FSDP: the whole only in rank 0's host
    memory, the other ranks' without memory; its ``wrap`` fills the shards)."""
    extra = sharding(parallel)
    if extra is None:
        return load_whole(device)
    return extra.load(load_whole, device)


def barrier():
    """Every rank waits here for the others (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


def sharding(parallel: str):
    """The extra that implements ``parallel`` (hooks.PARALLEL), or None for DDP."""
    if parallel == "ddp":
        return None
    if parallel not in hooks.PARALLEL:
        raise ValueError(hooks.missing(f"--parallel {parallel}", parallel))
    return hooks.PARALLEL[parallel]


# The ops whose outputs --activation-checkpointing selective keeps: the matmuls and attention,
# whose recompute would be most of a layer's forward. The rest of a layer (norms, rotary, SiLU,
# products, residual adds) is recomputed from them in backward: elementwise work, where it held
# ~60% of the activations. An attention kernel not listed (flash-attn's own) is recomputed.
aten = torch.ops.aten
KEPT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
KEPT_OPS |= {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


# checkpoint's policy, asked for each op of a layer's forward
def _keep_matmuls(ctx, op, *args, **kwargs):
    if op in KEPT_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def wrap(model, parallel, world, checkpointing=None, dtype=torch.float32, unused=False):
    """The module to train: ``model`` itself (one process), DDP(model), or ``model`` sharded in
    place by the extra of mode ``parallel`` (``dtype``: of its compute). ``unused``: some parameters
    may get no gradient in a backward (--lora-per-harness: the other harnesses' adapters).
    ``checkpointing``: None, or what each layer's backward recomputes (--activation-checkpointing):
    "full" all of its forward from its input, "selective" all but its matmuls and attention."""
    # memory for compute: each layer keeps its input (and under "selective" the outputs of
    # KEPT_OPS), the rest of its activations recomputed in its backward
    if checkpointing:
        options = {"use_reentrant": False}
        if checkpointing == "selective":
            options["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    extra = sharding(parallel)
    if extra is not None:
        return extra.wrap(model, dtype)
    if world == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)


def accumulating(model, parallel: str, last: bool):
    """Context for one micro-batch's backward: gradients are reduced over ranks only on the last
    one."""
    extra = sharding(parallel)
    if extra is not None:
        return extra.accumulating(model, last)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def pad_micro_batches(micro_batches: list, parallel: str, pad=None) -> list:
    """``micro_batches`` and after them copies of ``pad`` (``padding``'s micro-batch), each a
    micro-batch that trains nothing: a rank without samples runs one, and under sharding, where
    each forward and backward is a collective, every rank runs as many as the rank with the most.
    E.g. FSDP, 3 on this rank and 5 on another: [mb0, mb1, mb2, pad, pad]."""
    n = len(micro_batches)
    if sharding(parallel) is not None:
        n = int(all_reduce([n], op=dist.ReduceOp.MAX)[0])
    return micro_batches + [pad] * (max(n, 1) - len(micro_batches))


def padding(token: int) -> tuple[list[Sample], list[float]]:
    """The (samples, weights) micro-batch that ``pad_micro_batches`` pads with: one sample of
    ``token`` twice, its second token trainable (the LM head runs, as on the other ranks) at weight
    0 (its loss and gradients are 0)."""
    return [Sample("pad", [token, token], [0, 1], [0.0, 0.0])], [0.0]


def row_length(model, micro_batch_tokens: int) -> int:
    """What algo.collate pads a micro-batch's rows to (its ``pad_to``): under flex_attention, which
    compiles for each new shape, --micro-batch-tokens, so that every micro-batch has one shape;
    otherwise 1 (no padding)."""
    if model.config._attn_implementation == "flex_attention":
        return micro_batch_tokens
    return 1


def full_state_dict(model, parallel: str) -> dict:
    """The whole model's weights for a checkpoint or a vLLM sync: the module's own tensors (no
    copy), or, sharded, gathered into rank 0's host memory (a collective; the other ranks get {}).
    """
    extra = sharding(parallel)
    if extra is not None:
        return extra.full_state_dict(model)
    return getattr(model, "module", model).state_dict()


def _names_in_order(model, opt) -> list[str]:
    """The names of the optimizer's parameters, in its order (param_groups'; its state dict numbers
    them so)."""
    name_of = {id(p): n for n, p in getattr(model, "module", model).named_parameters()}
    return [name_of[id(p)] for group in opt.param_groups for p in group["params"]]


def optimizer_state(model, opt, parallel: str) -> dict:
    """The optimizer state to checkpoint, each parameter's keyed by its name (not by its place in
    the optimizer, which a resume with other flags may change: --lora-per-harness's adapters follow
    the --harness order): whole, on rank 0 (a collective under FSDP, which gathers the shards)."""
    extra = sharding(parallel)
    if extra is not None:
        return extra.optimizer_state(model, opt)
    names = _names_in_order(model, opt)
    state = opt.state_dict()
    return {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def load_optimizer_state(model, opt, state: dict, parallel: str):
    """Restore ``optimizer_state``'s output by parameter name (under FSDP each rank takes its
    shard). A parameter without saved state (one that never had a gradient) starts fresh."""
    extra = sharding(parallel)
    if extra is not None:
        return extra.load_optimizer_state(model, opt, state)
    # checkpoints written before the state was keyed by name: in the optimizer's order
    if all(isinstance(i, int) for g in state["param_groups"] for i in g["params"]):
        return opt.load_state_dict(state)
    index = {name: i for i, name in enumerate(_names_in_order(model, opt))}
    # torch's loader pairs saved and current parameters by position: number the current ones in
    # order
    groups, start = [], 0
    for group, saved in zip(opt.param_groups, state["param_groups"]):
        groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    by_index = {index[name]: s for name, s in state["state"].items()}
    opt.load_state_dict({"state": by_index, "param_groups": groups})


def scalar(t) -> float:
    """A float from a tensor that may be a DTensor (FSDP's gradient norm)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
