"""FSDP2 trains exactly like DDP and like one process, packed as trees or row by row: one AdamW step of the
embedded model on the same global batch gives the same weights, with micro-batching on and a different number
of micro-batches per rank. Then train.py end to end under --parallel fsdp: sharded training, weight sync to the embedded
backend without a checkpoint, a transformers checkpoint, and --resume with the optimizer state.

The 2-rank half runs this file as a script: ``python tests/test_parallel.py RANK PORT OUT MODE``.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_lite import backends, parallel
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


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_fsdp_and_ddp_give_the_weights_of_one_process(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    for mode in ("ddp", "fsdp"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(r), str(port), str(tmp_path), mode],
                env=env,
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"{mode} rank failed:\n{out[-3000:]}"
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
    # a rank of its own loads the extras it uses: the embedded model's name, FSDP
    import lightning_lite.extras.embedded  # noqa: F401
    import lightning_lite.extras.fsdp  # noqa: F401

    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
