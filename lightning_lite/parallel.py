"""Data-parallel wrapping of the policy: DDP (a full copy per rank) or FSDP2 (everything sharded;
README: models bigger than one GPU). The loss is the same either way: both average gradients over
ranks, and train.py's weights already make the global sum. Under FSDP every forward and backward
gathers weights from all ranks (hence ``pad_micro_batches``), and the parameters are shards:
``full_state_dict`` gathers them for the embedded backend's own copy and for checkpoints.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from .algo import all_reduce


def wrap(model, parallel: str, device: torch.device, world: int, offload: bool = False, checkpointing: bool = False):
    """The module to train: ``model`` itself (one process), DDP(model), or model sharded in place (FSDP2;
    ``offload`` keeps parameters, gradients and optimizer state in CPU memory)."""
    if checkpointing:  # recompute each layer's activations in backward: memory for compute
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # on a GPU: bf16 compute, fp32 master weights and gradient reductions
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    kw = {"mp_policy": mp, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    for layer in model.model.layers:  # transformers decoder models: one shard unit per layer
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def accumulating(model, parallel: str, last: bool):
    """Context for one micro-batch's backward: gradients are reduced over ranks only on the last one."""
    if parallel == "fsdp":
        model.set_requires_gradient_sync(last)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def pad_micro_batches(mbs: list, parallel: str) -> list:
    """Under FSDP each forward and backward is a collective, so every rank must run as many as the others:
    pad with None (train.py runs a zero-loss step for None). A rank without samples always runs one."""
    n = int(all_reduce([len(mbs)], op=dist.ReduceOp.MAX)[0]) if parallel == "fsdp" else len(mbs)
    return mbs + [None] * (max(n, 1) - len(mbs))


def full_state_dict(model, parallel: str) -> dict:
    """The whole model's weights on every rank (a collective under FSDP), on its device."""
    if parallel != "fsdp":
        return getattr(model, "module", model).state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model, opt, parallel: str) -> dict:
    """The optimizer state to checkpoint: whole, on rank 0 (a collective under FSDP)."""
    if parallel != "fsdp":
        return opt.state_dict()
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, state: dict, parallel: str):
    """Restore ``optimizer_state``'s output (under FSDP each rank takes its shard of the whole)."""
    if parallel != "fsdp":
        return opt.load_state_dict(state)
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def scalar(t) -> float:
    """A float from a tensor that may be a DTensor (FSDP's gradient norm)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
