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
    """The optimizer state to checkpoint, each parameter's keyed by its name (not by its place in the
    optimizer, which a resume with other flags may change: --lora-per-harness's adapters follow the
    --harness order): whole, on rank 0 (a collective under FSDP, which gathers the shards)."""
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.optimizer_state(model, opt)
    name_of = {id(p): n for n, p in getattr(model, "module", model).named_parameters()}
    # the optimizer's state dict numbers its parameters in param_groups' order
    names = [name_of[id(p)] for group in opt.param_groups for p in group["params"]]
    state = opt.state_dict()
    return {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def load_optimizer_state(model, opt, state: dict, parallel: str):
    """Restore ``optimizer_state``'s output by parameter name (under FSDP each rank takes its shard). A
    parameter without saved state (one that never had a gradient) starts fresh."""
    if parallel == "fsdp":
        from .extras import fsdp

        return fsdp.load_optimizer_state(model, opt, state)
    # checkpoints written before the state was keyed by name: in the optimizer's order
    if all(isinstance(i, int) for g in state["param_groups"] for i in g["params"]):
        return opt.load_state_dict(state)
    name_of = {id(p): n for n, p in getattr(model, "module", model).named_parameters()}
    index = {
        name_of[id(p)]: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
    }
    # torch's loader pairs saved and current parameters by position: number the current ones in order
    groups, start = [], 0
    for group, saved in zip(opt.param_groups, state["param_groups"]):
        groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    by_index = {index[name]: s for name, s in state["state"].items()}
    opt.load_state_dict({"state": by_index, "param_groups": groups})


def scalar(t) -> float:
    """A float from a tensor that may be a DTensor (FSDP's gradient norm)."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)
