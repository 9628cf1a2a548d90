"""FSDP2 trains exactly like DDP and like one process, packed as trees or row by row: one AdamW step of the
embedded model on the same global batch gives the same weights, with micro-batching on and a different number
of micro-batches per rank. Then train.py end to end under --parallel fsdp: sharded training, weight sync to the embedded
backend without a checkpoint, a transformers checkpoint, and --resume with the optimizer state.

The quick tests (one 2-rank run, ~15 s): the process group gets --dist-timeout, FSDP's gradients
stay sharded between micro-batches, and under FSDP only rank 0 loads the whole model.

The 2-rank half runs this file as a script: ``python tests/test_parallel.py RANK PORT OUT MODE``.
"""

import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_lite import parallel
from lightning_lite.algo import (
    collate,
    global_denominators,
    policy_loss,
    sample_weights,
    trainer_logprobs,
)
from lightning_lite.records import Sample

RANK_OF = [
    0,
    0,
    0,
    1,
]  # rank 0 holds three samples, rank 1 one: FSDP must pad rank 1's micro-batches
SHARED = [
    0,
    10,
    0,
    6,
]  # sample i starts with sample i-1's first SHARED[i] tokens: a packed tree shares them


def make_samples(model):
    """Four samples of random tokens, the second half trainable, rollout logprobs the model's own minus noise."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, T in enumerate((14, 20, 9, 17)):
        tokens = samples[-1].tokens[: SHARED[i]] if SHARED[i] else []
        tokens += torch.randint(
            0, model.config.vocab_size, (T - len(tokens),), generator=g
        ).tolist()
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        with torch.no_grad():
            lp = trainer_logprobs(
                model, collate([Sample(f"r{i}", tokens, mask, [0.0] * T)], [1.0])
            )[0]
        old = (lp - 0.1 * torch.rand(T, generator=g)).tolist()
        samples.append(
            Sample(
                rollout_id=f"r{i}",
                tokens=tokens,
                loss_mask=mask,
                logprobs=[x if m else 0.0 for x, m in zip(old, mask)],
                advantages=[(1.0, -0.5, 0.8, -1.2)[i] * m for m in mask],
            )
        )
    return samples


def one_step(mode, rank=0, world=1, tree=False):
    """train.py's update on this rank's samples, two samples per micro-batch (packed as one tree with ``tree``);
    returns (full weights on rank 0, grad norm, the wrapped module)."""
    from lightning_lite.models import load_model

    torch.manual_seed(0)
    model = load_model("smollm2", torch.device("cpu"))
    samples = [s for s, r in zip(make_samples(model), RANK_OF) if world == 1 or r == rank]
    net = parallel.wrap(model, mode, world)
    # eps 1e-6, not 1e-8: Adam divides by |g|, so with 1e-8 a weight whose gradient is ~1e-8 moves by up to
    # ~lr/10 on summation-order noise alone (measured: 5e-6 of a 1.1e-4 step, DDP vs one process)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), eps=1e-6)
    weights = sample_weights(samples, "token-mean", global_denominators(samples))
    mbs = parallel.pad_micro_batches([samples[i : i + 2] for i in range(0, len(samples), 2)], mode)
    for k, mb in enumerate(mbs):
        with parallel.accumulating(net, mode, last=k == len(mbs) - 1):
            if mb is None:  # train.py's zero-loss step for a rank with fewer micro-batches
                (net(input_ids=torch.tensor([[1]])).logits.sum() * 0.0).backward()
                continue
            b = collate(mb, [weights[samples.index(s)] for s in mb], tree=tree)
            lp = trainer_logprobs(net, b)
            loss, _ = policy_loss(
                lp, b["old_logprobs"], b["advantages"], b["loss_mask"], b["weights"]
            )
            (loss * world).backward()
    gnorm = parallel.scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    return (
        {k: v.detach().clone() for k, v in parallel.full_state_dict(model, mode).items()},
        gnorm,
        net,
    )


def gathers_one_tensor_at_a_time(net, rank, weights):
    """Under FSDP the weight syncs and checkpoints hold no second copy of the model: the full state dict is in
    rank 0's host memory only, and filling the embedded backend's copy gathers one tensor at a time."""
    import weakref

    from torch.distributed.tensor import DTensor

    from lightning_lite import backends
    from lightning_lite.models import load_model

    full = parallel.full_state_dict(net, "fsdp")
    assert (len(full) > 0) == (rank == 0) and all(v.device.type == "cpu" for v in full.values())
    alive, most, gather = [], [0], DTensor.full_tensor

    def tracked(self, *a, **kw):
        t = gather(self, *a, **kw)
        alive.append(weakref.ref(t))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return t

    dst = load_model("smollm2", torch.device("cpu"))
    DTensor.full_tensor = tracked
    try:
        backends.copy_weights(net, dst)
    finally:
        DTensor.full_tensor = gather
    print(f"rank {rank}: {len(alive)} tensors gathered, at most {most[0]} alive at once")
    assert len(alive) == len(dst.state_dict()) and most[0] <= 2, (len(alive), most[0])
    got = dst.state_dict()
    assert all(
        torch.equal(got[k], v) for k, v in weights.items()
    )  # rank 0's gathered weights (rank 1 has none)


def worker(rank, port, out, mode):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for tree in (False, True):
        weights, gnorm, net = one_step(mode, rank, 2, tree)
        if rank == 0:
            torch.save((weights, gnorm), os.path.join(out, f"{mode}{'-tree' * tree}.pt"))
    if mode == "fsdp":
        gathers_one_tensor_at_a_time(net, rank, weights)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(out, mode):
    """This file as a script on 2 gloo ranks (loopback), one process each; fails with their output."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(r), str(port), str(out), mode],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{mode} rank failed:\n{log[-3000:]}"


class Toy(torch.nn.Module):
    """A decoder's shape as fsdp.wrap shards it (``.model.layers``, then a head), 3 x 64 x 64."""

    def __init__(self, width=64, depth=3):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return self.head(x).sum()


def held_gradient_bytes(model) -> int:
    """The bytes of every gradient FSDP holds on this rank: each parameter's sharded ``.grad`` and
    any whole (unsharded) gradient it keeps to reduce later (FSDPParam's, torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            # the shard is a DTensor; the whole gradients are plain tensors
            held = [fsdp_param.sharded_param.grad, fsdp_param.unsharded_accumulated_grad]
            if hasattr(fsdp_param, "_unsharded_param"):
                held.append(fsdp_param._unsharded_param.grad)
            for grad in held:
                if isinstance(grad, DTensor):
                    grad = grad.to_local()
                if grad is not None:
                    total += grad.numel() * grad.element_size()
    return total


def quick_worker(rank, port, out):
    """Starts the group through parallel.init as under torchrun, accumulates 3 micro-batches of the
    toy model under FSDP as the trainer does, then loads a tiny Llama as the Learner does under
    FSDP; writes what the tests check."""
    from lightning_lite.extras import fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE="2")
    parallel.init("cpu", 7.5)
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    torch.manual_seed(0)
    model = Toy()
    # each rank's 3 micro-batches, and the one-process gradient of both ranks' 6
    inputs = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(1))
    whole = Toy()
    whole.load_state_dict(model.state_dict())
    sum(whole(x) for x in inputs.flatten(0, 1)).backward()
    fsdp.wrap(model)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    held = []
    for k, x in enumerate(inputs[rank]):
        with parallel.accumulating(model, "fsdp", last=k == 2):
            (model(x) * 2).backward()  # x world: FSDP averages over ranks
        held.append(held_gradient_bytes(model))
    diff = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), whole.parameters())
    )
    result = {"timeout_s": timeout.total_seconds(), "shard_bytes": shard_bytes, "held": held}
    result["max_grad_diff"] = diff
    result.update(loaded_on_rank_0_only(os.path.join(out, "tiny")))
    with open(os.path.join(out, f"quick-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def loaded_on_rank_0_only(tiny) -> dict:
    """The policy as the Learner loads it under FSDP (parallel.load, then parallel.wrap) from the
    tiny model saved in ``tiny``: which ranks loaded it whole, whether it was built on the meta
    device, and how far its weights, buffers and logits are from the whole model's."""
    from lightning_lite.models import load_model

    loads = []

    def whole(device):
        loads.append(str(device))
        return load_model(tiny, device)

    model = parallel.load(whole, torch.device("cpu"), "fsdp")
    meta = all(p.is_meta for p in model.parameters())
    parallel.wrap(model, "fsdp", 2)
    ref = load_model(tiny)
    weights = parallel.full_state_dict(model, "fsdp")
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        logits_diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max()
    buffers_equal = all(torch.equal(b, ref.get_buffer(n)) for n, b in model.named_buffers())
    weights_equal = all(torch.equal(v, ref.state_dict()[k]) for k, v in weights.items())
    return {
        "loads": loads,
        "meta": meta,
        "weights": len(weights),
        "weights_equal": weights_equal,
        "buffers_equal": buffers_equal,
        "logits_diff": logits_diff.item(),
    }


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """quick_worker's results on 2 ranks (~15 s), one dict a rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("quick")
    # a tiny Llama with tied embeddings, as SmolLM2's
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
    shape.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(out / "tiny")
    run_two_ranks(out, "quick")
    return [json.load(open(out / f"quick-{r}.json")) for r in range(2)]


def test_process_group_options():
    minutes = parallel.DIST_TIMEOUT_MINUTES
    assert parallel.process_group_options("cuda", 120) == (
        "cpu:gloo,cuda:nccl",
        datetime.timedelta(hours=2),
    )
    assert parallel.process_group_options("cpu", 5) == ("gloo", datetime.timedelta(minutes=5))
    assert minutes >= 60  # longer than NCCL's 10 minutes: a slow rank's rollouts, vLLM's start


def test_init_gives_the_group_its_timeout(quick_run):
    # gloo's own default is 30 minutes
    assert [r["timeout_s"] for r in quick_run] == [450.0, 450.0]


def test_fsdp_accumulates_gradients_sharded(quick_run):
    """After each micro-batch's backward, the first of 3 included, a rank holds no more gradient
    bytes than its shard of the parameters (with the reduction put off to the last micro-batch it
    held each parameter's whole gradient: twice its shard on 2 ranks); and the sum over the
    micro-batches and ranks is the one-process gradient."""
    for r in quick_run:
        print(r)
        assert r["held"] == [r["shard_bytes"]] * 3, r
        assert r["max_grad_diff"] < 1e-5, r


def test_fsdp_loads_the_whole_model_on_rank_0_only(quick_run):
    """Under FSDP only rank 0 loads the whole model, into host memory; every rank builds it on the
    meta device, and after sharding holds exactly rank 0's weights and buffers."""
    assert [r["loads"] for r in quick_run] == [["cpu"], []], quick_run
    assert all(r["meta"] and r["buffers_equal"] for r in quick_run), quick_run
    assert quick_run[0]["weights"] > 0 and quick_run[0]["weights_equal"], quick_run
    assert all(r["logits_diff"] < 1e-5 for r in quick_run), quick_run


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_fsdp_and_ddp_give_the_weights_of_one_process(tmp_path):
    for mode in ("ddp", "fsdp"):
        run_two_ranks(tmp_path, mode)
    from lightning_lite.models import load_model

    before = load_model("smollm2", torch.device("cpu")).state_dict()
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as the ranks run (OMP_NUM_THREADS=1): some CPU kernels sum in another order on 2 threads,
    try:  # and Adam turns that fp32 noise into up to ~10% of a step on weights with near-zero gradients (measured)
        ref, ref_gnorm, _ = one_step("ddp")  # one process, the whole batch, row by row
        torch.save(one_step("ddp", tree=True)[:2], tmp_path / "one-tree.pt")
    finally:
        torch.set_num_threads(threads)
    step = max((ref[k] - before[k]).abs().max().item() for k in ref)
    assert step > 5e-5  # the update moved the weights (Adam: ~lr per weight)
    for mode in ("one-tree", "ddp", "ddp-tree", "fsdp", "fsdp-tree"):
        weights, gnorm = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
        assert abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm, (
            mode,
            gnorm,
            ref_gnorm,
        )  # a wrong gradient scale shows here (measured: 9e-6)
        diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
        print(
            f"{mode}: grad norm {gnorm:.6f} vs {ref_gnorm:.6f}, max |weight - one process| {diff:.2e} (update {step:.2e})"
        )
        assert diff <= 1e-2 * step, (mode, diff, step)


@pytest.mark.slow  # minutes: two torchrun runs of train.py under FSDP
def test_train_py_under_fsdp_syncs_checkpoints_and_resumes(tmp_path):
    from conftest import ROOT

    out = str(tmp_path / "run")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train.py",
        "--parallel",
        "fsdp",
        "--harness",
        os.path.join(ROOT, "tests", "harnesses.py") + ":LengthHarness",
        "--batch-size",
        "2",
        "--group-size",
        "3",
        "--eval-tasks",
        "0",
        "--lr",
        "1e-4",
        # under FSDP each layer's recompute gathers its shards again; "selective" keeps its matmuls
        "--activation-checkpointing",
        "selective",
        "--out",
        out,
    ]

    def run(args):
        p = subprocess.run(torchrun + args, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]

    run(["--steps", "2", "--save-every", "1"])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(
        r["grad_norm"] > 0 and r["failed"] == 0 for r in rows
    )
    assert (
        abs(rows[0]["dlogp_mean"]) < 1e-3
    )  # the backend's full copy serves exactly the trainer's weights
    calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_1.rank1.jsonl"))]
    assert {c["model_version"] for c in calls} == {1}  # synced from the shards, no checkpoint read
    from transformers import AutoModelForCausalLM

    ckpt = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoints", "step_2"))
    assert type(ckpt).__name__ == "LlamaForCausalLM"  # the plain class, not FSDP's wrapper
    run(["--steps", "3", "--resume"])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["grad_norm"] > 0


@pytest.mark.slow  # ~15-35 s: make test-slow
def test_options_that_cannot_work_say_why():
    from conftest import ROOT

    cases = [
        (["--parallel", "fsdp"], "start it with torchrun"),
        (
            ["--parallel", "fsdp", "--fsdp-offload", "--device", "cpu"],
            "needs --parallel fsdp on GPUs",
        ),
        (["--attn", "flex_attention", "--device", "cpu"], "no CPU backward for FlexAttention"),
    ]
    # The three runs start together: each spends its seconds importing on one core before it exits.
    runs = [
        subprocess.Popen(
            [sys.executable, "train.py", "--harness", "calc"] + args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _ in cases
    ]
    for p, (_, msg) in zip(runs, cases):
        _, stderr = p.communicate(timeout=120)
        assert p.returncode != 0 and msg in stderr, stderr[-2000:]


if __name__ == "__main__":
    rank = int(sys.argv[1])
    port = int(sys.argv[2])
    out = sys.argv[3]
    mode = sys.argv[4]
    if mode == "quick":
        quick_worker(rank, port, out)
        sys.exit()
    # a rank of its own loads the extras it uses: the embedded model's name, FSDP
    import lightning_lite.extras.embedded  # noqa: F401
    import lightning_lite.extras.fsdp  # noqa: F401

    worker(rank, port, out, mode)


def test_a_rank_pads_with_a_micro_batch_that_trains_nothing():
    """parallel.padding: one two-token sample whose second token is trainable (the LM head runs) at
    weight 0; a rank without samples runs one; parallel.row_length pads rows only under
    flex_attention."""
    from types import SimpleNamespace

    pad = parallel.padding(7)
    (sample,), weights = pad
    assert (sample.tokens, sample.loss_mask, weights) == ([7, 7], [0, 1], [0.0])
    assert parallel.pad_micro_batches([], "ddp", pad) == [pad]
    assert parallel.pad_micro_batches(["mb"], "ddp", pad) == ["mb"]
    flex = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flex_attention"))
    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    assert parallel.row_length(flex, 4096) == 4096 and parallel.row_length(sdpa, 4096) == 1
