"""Device placement without a GPU. ``FakeCuda`` is a TorchFunctionMode that plays a CUDA device on the CPU: a tensor
made on "cuda" (``device="cuda"``, ``.to("cuda")``, ``.cuda()``) is computed on the CPU but tagged, whatever is
computed from a tagged tensor is tagged, its ``.device`` reads cuda:0 (so code that places by ``x.device`` follows
it), and an op that meets a tagged and an untagged tensor raises as CUDA would ("Expected all tensors to be on the
same device"). As on CUDA, a 0-dim CPU tensor mixes with anything, and CPU index tensors may index a CUDA tensor.

What it catches is what crashes on the first GPU run: a tensor made without ``device=`` next to the logits, a CPU
generator for a CUDA ``multinomial``, a collective's tensor on the CPU under NCCL.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from lightning_lite import algo, parallel
from lightning_lite.backends import sample_token
from lightning_lite.chat import Sampling
from lightning_lite.records import Sample

CUDA = torch.device("cuda", 0)
INDEXING = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put,
    torch.Tensor.index_put_,
}


def tagged(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_fake_cuda", False)


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)


def on_cuda(d) -> bool:
    return isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"


class FakeCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (
            func == torch.Tensor.device.__get__
        ):  # == : each attribute access makes a new bound getter
            return CUDA if tagged(args[0]) else func(*args)
        if func == torch.Tensor.is_cuda.__get__:
            return tagged(args[0])
        to_cuda = to_cpu = False
        if on_cuda(kwargs.get("device")):
            kwargs["device"], to_cuda = "cpu", True
        elif kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            to_cpu = True
        if func is torch.Tensor.cuda:
            func, args, to_cuda = torch.Tensor.clone, args[:1], True
        elif func is torch.Tensor.cpu:
            func, to_cpu = torch.Tensor.clone, True
        elif func is torch.Tensor.to:
            rest = []
            for a in args[1:]:
                if on_cuda(a):
                    to_cuda = True
                    a = "cpu"
                elif isinstance(a, (str, torch.device)):
                    to_cpu = True
                elif isinstance(a, torch.Tensor):
                    to_cuda, to_cpu = tagged(a), not tagged(a)
                    a = a.dtype
                rest.append(a)
            args = (args[0], *rest)
            if (
                to_cuda or to_cpu
            ):  # a real copy: .to() of a CPU tensor to the CPU returns it, tag and all
                args, func = (args[0].clone(), *args[1:]), torch.Tensor.to
        if func is torch.Tensor.numpy and tagged(args[0]):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
            )
        if (
            func is torch.multinomial
            and tagged(args[0])
            and kwargs.get("generator") is not None
            and kwargs["generator"].device.type != "cuda"
        ):
            raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu'")
        checked = (
            [args[0], *args[2:3]] if func in INDEXING else [*args, *kwargs.values()]
        )  # indices may stay on the CPU
        ts = [t for t in tensors(checked) if tagged(t) or t.dim() > 0]
        if len({tagged(t) for t in ts}) > 1 and func not in (torch.Tensor.copy_,):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"({getattr(func, '__name__', func)})"
            )
        out = func(*args, **kwargs)
        tag = to_cuda or (not to_cpu and any(tagged(t) for t in tensors([*args, *kwargs.values()])))
        if tag:
            for t in tensors(out):
                t._fake_cuda = True
        return out


def cuda_model(model):
    """The embedded model's parameters and buffers as FakeCuda tensors (in place: they stay tagged after)."""
    for t in [*model.parameters(), *model.buffers()]:
        t._fake_cuda = True
    return model


@pytest.fixture
def fake_cuda_model(model):
    yield cuda_model(model)
    for t in [*model.parameters(), *model.buffers()]:
        t._fake_cuda = False


def test_the_fake_device_catches_what_cuda_refuses():
    """The mode itself: each of these raises on a real GPU, so it must raise here (else the tests below prove nothing)."""
    with FakeCuda():
        x = torch.randn(5, device="cuda")
        assert x.device == CUDA and x.is_cuda and not torch.ones(5).is_cuda
        assert (x + 1).device == CUDA and (
            x * torch.tensor(2.0)
        ).device == CUDA  # a 0-dim CPU tensor mixes
        assert x[torch.tensor([0, 2])].device == CUDA  # CPU indices index a CUDA tensor
        assert (
            x.cpu().device.type == "cpu" and x.device == CUDA and x.to(torch.float64).device == CUDA
        )
        for bad in (
            lambda: x + torch.ones(5),
            lambda: torch.cat([x, torch.ones(5)]),
            lambda: x.numpy(),
            lambda: torch.multinomial(x.softmax(-1), 1, generator=torch.Generator()),
        ):
            with pytest.raises((RuntimeError, TypeError)):
                bad()


def test_sampling_on_the_gpu_keeps_every_tensor_on_the_logits_device():
    """backends.sample_token with top-k, top-p and a temperature (the support's tensors must follow the logits)."""
    logits = torch.randn(49152)
    with FakeCuda():
        x = logits.to("cuda")
        for s in (
            Sampling(temperature=0.7, top_k=20, top_p=0.9),
            Sampling(temperature=1.0, top_p=0.5),
            Sampling(temperature=0),
        ):
            tok, lp = sample_token(x, s)
            assert 0 <= tok < 49152 and lp <= 0.0
        keep = algo.sampling_support(
            x[None], torch.tensor([5], device=x.device), x.new_tensor([0.9])
        )
        assert keep.device == CUDA and int(keep.sum()) <= 5


def test_a_training_micro_batch_runs_on_the_gpu_from_collate_to_backward(fake_cuda_model, tok):
    """collate -> trainer_logprobs (two rows with one prompt, packed as a tree) -> policy_loss -> backward, with the
    model's parameters on the (fake) GPU; rows sampled under top-k / top-p too. Nothing made on the CPU meets them."""
    prompt = tok.encode("The capital of France is")
    rows = []
    for i, (reply, k, p) in enumerate([(" Paris, a city", 0, 1.0), (" Lyon, I think", 20, 0.9)]):
        r = tok.encode(reply)
        n = len(prompt) + len(r)
        rows.append(
            Sample(
                rollout_id=f"r{i}",
                tokens=prompt * 4 + r,
                loss_mask=[0] * len(prompt) * 4 + [1] * len(r),
                logprobs=[0.0] * len(prompt) * 4 + [-1.0] * len(r),
                temperature=[1.0] * (n + 3 * len(prompt)),
                top_k=[k] * (n + 3 * len(prompt)),
                top_p=[p] * (n + 3 * len(prompt)),
                advantages=[1.0 - 2 * i] * (n + 3 * len(prompt)),
            )
        )
    with FakeCuda():
        b = algo.collate(rows, [0.5, 0.5], device=CUDA)
        assert all(v.device == CUDA for v in b.values() if isinstance(v, torch.Tensor))
        lp = algo.trainer_logprobs(fake_cuda_model, b)
        loss, m = algo.policy_loss(
            lp,
            b["old_logprobs"],
            b["advantages"],
            b["loss_mask"],
            b["weights"],
            kl_coef=0.1,
            ref_logprobs=lp.detach(),
        )
        loss.backward()
        metrics = algo.reduce_metrics([m])
    assert lp.requires_grad and tagged(lp) and metrics["dlogp_mean"] > 0
    fake_cuda_model.zero_grad(set_to_none=True)


@pytest.fixture
def gloo_as_nccl(monkeypatch, tmp_path):
    """A one-rank gloo group that says it is NCCL, whose collectives refuse a tensor off the (fake) GPU, as NCCL does."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    seen = []
    real = dist.all_reduce

    def all_reduce(t, *a, **kw):
        if not tagged(t):
            raise RuntimeError("No backend type associated with device type cpu")
        seen.append(t)
        return real(t, *a, **kw)

    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    yield seen
    monkeypatch.undo()
    dist.destroy_process_group()


def test_every_collective_tensor_is_on_the_training_device_under_nccl(gloo_as_nccl):
    """algo.all_reduce (the denominators, the step's counts) and parallel.pad_micro_batches (FSDP's MAX)."""
    s = Sample(
        rollout_id="r",
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -1.0, -1.0],
        temperature=[1.0] * 3,
        top_k=[0] * 3,
        top_p=[1.0] * 3,
        advantages=[0.0, 1.0, 1.0],
    )
    with FakeCuda():
        assert algo.global_denominators([s]) == {"tokens": 2, "samples": 1, "rollouts": 1}
        assert parallel.pad_micro_batches([["mb"]], "fsdp") == [["mb"]]
        assert algo.all_reduce([1.0, 2.0], op=dist.ReduceOp.MAX) == [1.0, 2.0]
    assert len(gloo_as_nccl) == 3 and os.environ.get("WORLD_SIZE") in (None, "1")
