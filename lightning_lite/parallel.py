"""Data-parallel wrapping of the policy: DDP (a full copy per rank) or FSDP2 (everything sharded;
README: models bigger than one GPU). The loss is the same either way: both average gradients over
ranks, and train.py's weights already make the global sum. Under FSDP every forward and backward
gathers weights from all ranks (hence ``pad_micro_batches``), and the parameters are shards:
``copy_weights`` and ``full_state_dict`` gather them for the embedded backend's own copy, vLLM and checkpoints.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from .algo import all_reduce


def wrap(
    model,
    parallel: str,
    device: torch.device,
    world: int,
    offload: bool = False,
    checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """The module to train: ``model`` itself (one process), DDP(model), or model sharded in place (FSDP2;
    ``offload`` keeps parameters, gradients and optimizer state in CPU memory; ``dtype``: of its compute)."""
    if checkpointing:  # recompute each layer's activations in backward: memory for compute
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # bf16: the weights are gathered and computed with in bf16; the shards (master weights) and reductions stay fp32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
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
    """The whole model's weights for a checkpoint or a vLLM sync: the module's own tensors (no copy), or under FSDP
    (a collective) gathered one tensor at a time into rank 0's host memory (the other ranks get {}): no GPU holds a
    second copy of the model."""
    if parallel != "fsdp":
        return getattr(model, "module", model).state_dict()
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


@torch.no_grad()
def copy_weights(model, dst):
    """Load ``model``'s weights into ``dst``, a plain copy of it (the embedded backend's own). Under FSDP (a
    collective) each tensor is gathered, copied and freed in turn: no rank holds the whole model twice."""
    src = getattr(model, "module", model).state_dict()
    for k, v in dst.state_dict().items():
        v.copy_(src[k].full_tensor() if hasattr(src[k], "full_tensor") else src[k])


def optimizer_state(model, opt, parallel: str) -> dict:
    """The optimizer state to checkpoint: whole, on rank 0 (a collective under FSDP)."""
    if parallel != "fsdp":
        return opt.state_dict()
    return get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(model, opt, state: dict, parallel: str):
    """Restore ``optimizer_state``'s output (under FSDP each rank takes its shard of the whole)."""
    if parallel != "fsdp":
        return opt.load_state_dict(state)
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def scalar(t) -> float:
    """A float from a tensor that may be a DTensor (FSDP's gradient norm)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
