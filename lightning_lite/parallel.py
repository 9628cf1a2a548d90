"""Data parallelism: DDP, a full copy of the policy per rank (torchrun). The loss is the same as in one
process: DDP averages gradients over ranks, and train.py's weights already make the global sum.
``--parallel fsdp`` shards the weights instead: each function here hands that mode to extras/fsdp.py.
"""

import contextlib

import torch
import torch.distributed as dist

from .algo import all_reduce


def wrap(
    model, parallel, world, offload=False, checkpointing=False, dtype=torch.float32, unused=False
):
    """The module to train: ``model`` itself (one process), DDP(model), or ``model`` sharded in place
    (fsdp; ``offload``: the shards in CPU memory; ``dtype``: of its compute). ``unused``: parameters
    that a backward leaves without gradients (--lora-per-harness: the other harnesses' adapters)."""
    # recompute each layer's activations in backward: memory for compute
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.wrap(model, offload, dtype)
    ddp = torch.nn.parallel.DistributedDataParallel
    return ddp(model, find_unused_parameters=unused) if world > 1 else model


def accumulating(model, parallel: str, last: bool):
    """Context for one micro-batch's backward: gradients are reduced over ranks only on the last one."""
    if parallel == "fsdp":
        model.set_requires_gradient_sync(last)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def pad_micro_batches(mbs: list, parallel: str) -> list:
    """Pad with None (train.py runs a zero-loss step for None): a rank without samples runs one, and under
    FSDP, where each forward and backward is a collective, every rank runs as many as the most has."""
    n = int(all_reduce([len(mbs)], op=dist.ReduceOp.MAX)[0]) if parallel == "fsdp" else len(mbs)
    return mbs + [None] * (max(n, 1) - len(mbs))


def full_state_dict(model, parallel: str) -> dict:
    """The whole model's weights for a checkpoint or a vLLM sync: the module's own tensors (no copy), or
    under FSDP gathered into rank 0's host memory (a collective; the other ranks get {})."""
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.full_state_dict(model)
    return getattr(model, "module", model).state_dict()


def optimizer_state(model, opt, parallel: str) -> dict:
    """The optimizer state to checkpoint: whole, on rank 0 (a collective under FSDP)."""
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.optimizer_state(model, opt)
    return opt.state_dict()


def load_optimizer_state(model, opt, state: dict, parallel: str):
    """Restore ``optimizer_state``'s output (under FSDP each rank takes its shard of the whole)."""
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.load_optimizer_state(model, opt, state)
    opt.load_state_dict(state)


def scalar(t) -> float:
    """A float from a tensor that may be a DTensor (FSDP's gradient norm)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
