"""FSDP2 (``--parallel fsdp``; docs/gpus.md: models bigger than one GPU): weights, gradients and
AdamW state sharded over the ranks, one shard unit per decoder layer. Its seam:
``hooks.PARALLEL["fsdp"]`` is this module, and each of parallel.py's functions hands the fsdp mode
to the one of the same name here. The loss is the same as under DDP; every forward and backward
gathers weights from all ranks (hence parallel.pad_micro_batches), and the parameters are shards
(DTensors): ``full_state_dict`` and ``optimizer_state`` gather them for checkpoints; a vLLM sync
(extras/vllm.py) and the embedded backend's own copy (backends.copy_weights) gather them one at a
time."""

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp2
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from .. import hooks

# whole on rank 0, in host memory: no GPU holds a second copy of the model
_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
# --fsdp-offload: the shards, their gradients and AdamW state in CPU memory (set by check)
offload = False
# The models ``load`` built without weights, by id: (rank 0's whole model, None on the other ranks;
# the device of the shards). ``wrap`` fills their shards and forgets them.
_unfilled = {}


def check(args, ddp: bool, cuda: bool):
    if args.fsdp_offload and (args.parallel != "fsdp" or not cuda):
        sys.exit(
            "--fsdp-offload moves FSDP's shards from GPU memory to CPU memory: it needs "
            "--parallel fsdp on GPUs"
        )
    if args.parallel == "fsdp" and not ddp:
        sys.exit(
            "--parallel fsdp shards over ranks: start it with torchrun --nproc_per_node N "
            "(N >= 2); one process trains whole"
        )
    global offload
    offload = args.fsdp_offload


def add_args(parser):
    """The flags of ``--parallel fsdp``, as an argparse group."""
    group = parser.add_argument_group("FSDP2 (--parallel fsdp)")
    help = "keep parameters, gradients and optimizer state in CPU memory"
    group.add_argument("--fsdp-offload", action="store_true", help=help)


def load(load_whole, device: torch.device):
    """The policy to shard, built on the meta device (no memory) on every rank: only rank 0 loads
    the whole (``load_whole("cpu")``, into host memory, never onto a GPU), the others build the
    same model from its config, and ``wrap`` fills every rank's shards from rank 0's weights. Not
    under --fsdp-offload (its shards live in host memory, its buffers on the GPU: no GPU has tried
    that yet): there every rank loads the whole onto ``device``, then shards it."""
    if offload:
        return load_whole(device)
    whole = None
    # what the other ranks build the same model from: its config (RoPE scaling included), dtype
    # and generation config (a checkpoint writes it)
    spec = [None, None, None]
    if dist.get_rank() == 0:
        whole = load_whole("cpu")
        spec = [whole.config, whole.dtype, whole.generation_config]
    dist.broadcast_object_list(spec, src=0)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec[0], dtype=spec[1])
    model.generation_config = spec[2]
    _unfilled[id(model)] = (whole, device)
    return model


def _fill(model, whole, device: torch.device):
    """Allocate the sharded ``model``'s shards and buffers on ``device`` and copy rank 0's ``whole``
    model into them (a collective): each tensor broadcast from rank 0, each rank keeping its shard.
    """
    model.to_empty(device=device)
    weights = {}
    if whole is not None:
        weights = whole.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    # The buffers outside the state dict (RoPE's inv_freq) are rank 0's too.
    for name, buffer in model.named_buffers():
        if whole is not None:
            buffer.copy_(whole.get_buffer(name))
        dist.broadcast(buffer, src=0)
    # The trainer's attention (hooks.fast_decode.install_trainer: on a CPU, extras/fast_decode.py's
    # block_sdpa) is chosen by where the parameters are, which were on the meta device when the
    # core asked.
    hooks.fast_decode.install_trainer(model)


def wrap(model, dtype: torch.dtype = torch.float32):
    """Shard ``model`` in place and return it; --fsdp-offload keeps parameters, gradients and
    optimizer state in CPU memory. ``dtype`` bf16: the weights are gathered and computed with in
    bf16; the shards (master weights) and the gradient reductions stay fp32. A model ``load`` built
    gets its weights here, after sharding."""
    precision = fsdp2.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload_policy = fsdp2.CPUOffloadPolicy() if offload else fsdp2.OffloadPolicy()
    policy = {"mp_policy": precision, "offload_policy": offload_policy}
    # transformers decoder models: one shard unit per layer (under LoRA's wrapper: the base model's)
    for layer in getattr(model, "get_base_model", lambda: model)().model.layers:
        fsdp2.fully_shard(layer, **policy)
    fsdp2.fully_shard(model, **policy)
    if id(model) in _unfilled:
        _fill(model, *_unfilled.pop(id(model)))
    # FSDP settles each shard unit's gradient dtypes at the root's first forward, from the
    # parameters trainable then. The first forward of a step is the KL reference's, where peft's
    # disable_adapter has frozen the adapters: settled then, no unit would cast its bf16 gradients
    # to the fp32 shards' dtype. Settled here, the trainable parameters are the trained ones.
    model._get_fsdp_state()._lazy_init()
    return model


def accumulating(model, last: bool):
    """Context for one micro-batch's backward: its gradients are reduce-scattered over the ranks on
    every micro-batch, ``last`` or not, and each rank adds its shard into the sharded gradient it
    holds. Skipping the reduction until the last one (set_requires_gradient_sync(False)) would keep
    each parameter's whole unsharded fp32 gradient on every rank meanwhile: 36 GB a rank for a 9B
    model instead of 36 / 8 = 4.5 on 8 ranks. The sum is the same: the mean over ranks of the sums
    over micro-batches is the sum over micro-batches of the means (a reduce-scatter a micro-batch
    costs a layer's gradient traffic each time, not once a step)."""
    model.set_requires_gradient_sync(True)
    return contextlib.nullcontext()


def full_state_dict(model) -> dict:
    """The whole model's weights (a collective), gathered one tensor at a time into rank 0's host
    memory; the other ranks get {}."""
    return get_model_state_dict(model, options=_GATHERED)


def optimizer_state(model, opt) -> dict:
    """The whole optimizer state on rank 0 (a collective)."""
    return get_optimizer_state_dict(model, opt, options=_GATHERED)


def load_optimizer_state(model, opt, state: dict):
    """Restore ``optimizer_state``'s output (keyed by parameter name): each rank takes its shard of
    the whole. strict=False: a parameter that never had a gradient (an adapter without a signal so
    far) has no saved state (torch's loader gives it a zero state at step 1)."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, opt, state, options=options)


hooks.PARALLEL["fsdp"] = sys.modules[__name__]
