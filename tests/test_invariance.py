"""Invariant 3: the same global batch gives the same gradient on 1 or 2 ranks (gloo, two
CPU processes) and for any micro-batch split, for every normalization mode and loss.

The 2-rank half runs this file as a script: ``python tests/test_invariance.py RANK PORT OUT``.
"""

import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from lightning_lite.algo import (
    NORMS,
    assign_advantages,
    collate,
    compute_advantages,
    gather_rewards,
    global_denominators,
    policy_loss,
    reduce_metrics,
    sample_weights,
    trainer_logprobs,
)
from lightning_lite.records import Sample

V, D = 13, 4
CONFIGS = [(norm, loss) for loss in ("ppo", "gspo", "tis") for norm in NORMS] + [
    ("rollout-mean", "ppo+kl")
]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]  # 8 rollouts, tasks of 2: t0..t3
RANK_OF = lambda rid: int(rid[1:]) // 4  # noqa: E731  ranks hold whole groups: r0-r3 on 0, r4-r7 on 1


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(V, D, generator=g, dtype=torch.float64),
        torch.randn(D, V, generator=g, dtype=torch.float64),
    ]


def tiny(p):
    """A tiny causal model with train.py's calling convention: the running mean of the embeddings so far,
    projected to the vocab, at the positions ``logits_to_keep``."""

    def net(input_ids, logits_to_keep, **_):
        h = (
            p[0][input_ids].cumsum(1)
            / torch.arange(1, input_ids.shape[1] + 1, dtype=torch.float64)[:, None]
        )
        return SimpleNamespace(logits=(h @ p[1])[:, logits_to_keep])

    return net


def make_batch():
    """The global batch: 1 or 2 samples per rollout, ragged lengths, a few prompt/observation
    tokens, rollout logprobs = the model's own, perturbed (so ratios differ from 1 and clip)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for r in range(8):
        for _ in range(1 + (r % 3 == 0)):
            T = int(torch.randint(4, 10, (1,), generator=g))
            tokens = torch.randint(0, V, (T,), generator=g).tolist()
            mask = [0, 0] + (torch.rand(T - 2, generator=g) < 0.7).long().tolist()
            mask[-1] = 1
            samples.append(
                Sample(rollout_id=f"r{r}", tokens=tokens, loss_mask=mask, logprobs=[0.0] * T)
            )
    net = tiny(params(1))
    for s in samples:
        lp = trainer_logprobs(net, collate([s], [1.0], dtype=torch.float64, tree=False))[
            0
        ] + 0.3 * torch.randn(len(s.tokens), generator=g, dtype=torch.float64)
        s.logprobs = [x if m else 0.0 for x, m in zip(lp.tolist(), s.loss_mask)]
    rewards = {f"r{r}": x for r, x in enumerate(REWARDS)}
    groups = {f"r{r}": f"t{r // 2}" for r in range(8)}
    return samples, rewards, groups


def grads(samples, norm, loss, n_micro, world=1, denoms=None):
    """Exactly train.py's step: denominators, weights, micro-batches, backward, DDP's average."""
    p, ref = [t.requires_grad_() for t in params(1)], params(2)
    denoms = denoms or global_denominators(samples)
    w = sample_weights(
        samples, norm, denoms, norm_const=8.0
    )  # the C of seq-mean-token-sum-norm: a fixed budget
    metrics = []
    for k in range(n_micro):
        idx = list(range(k, len(samples), n_micro))
        # row by row: the stand-in reads each row in order, it takes no tree mask (test_algo packs real models)
        b = collate([samples[i] for i in idx], [w[i] for i in idx], dtype=torch.float64, tree=False)
        lp = trainer_logprobs(tiny(p), b)  # the function train.py trains with
        kl = {}
        if loss == "ppo+kl":
            kl = dict(kl_coef=0.05, ref_logprobs=trainer_logprobs(tiny(ref), b))
        l, m = policy_loss(
            lp,
            b["old_logprobs"],
            b["advantages"],
            b["loss_mask"],
            b["weights"],
            loss=loss.split("+")[0],
            tis_cap=1.3,
            **kl,
        )  # a low cap: some tokens truncated
        (l * world).backward()
        metrics.append(m)
    g = torch.cat([t.grad.flatten() for t in p])
    if world > 1:  # what DDP does with the gradients: the mean over ranks
        dist.all_reduce(g)
        g /= world
    return g, reduce_metrics(metrics)


def advantages_for(samples, rewards, groups, estimator="grpo"):
    adv, _ = compute_advantages(*gather_rewards(rewards, groups), estimator=estimator)
    return adv, assign_advantages(samples, adv)


def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    samples, rewards, groups = make_batch()
    mine = lambda d: {k: v for k, v in d.items() if RANK_OF(k) == rank}  # noqa: E731
    samples = [s for s in samples if RANK_OF(s.rollout_id) == rank]
    res = {
        "adv": {
            e: advantages_for([], mine(rewards), mine(groups), e)[0]
            for e in ("grpo", "reinforce", "rloo")
        }
    }
    _, samples = advantages_for(samples, mine(rewards), mine(groups))
    for norm, loss in CONFIGS:
        for n_micro in (1, 2):
            res[norm, loss, n_micro] = grads(samples, norm, loss, n_micro, world=2)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def close(a, b, rel=1e-6):
    return (a - b).abs().max().item() <= rel * a.abs().max().item()


def test_same_gradient_for_any_split_and_rank_count(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(r), str(port), str(tmp_path)],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    # While the two ranks run, the single-process references.
    samples, rewards, groups = make_batch()
    adv_ref = {e: advantages_for([], rewards, groups, e)[0] for e in ("grpo", "reinforce", "rloo")}
    _, samples = advantages_for(samples, rewards, groups)
    ref = {c: grads(samples, *c, n_micro=1) for c in CONFIGS}
    for c in CONFIGS:
        g4, m4 = grads(samples, *c, n_micro=4)
        assert ref[c][0].abs().max() > 1e-3, f"{c}: a vanishing gradient proves nothing"
        assert close(ref[c][0], g4), f"{c}: 4 micro-batches differ from 1"
        assert abs(m4["loss"] - ref[c][1]["loss"]) <= 1e-9 * abs(ref[c][1]["loss"]) + 1e-12
    # The test has teeth: per-micro-batch denominators (the naive way) do change the gradient.
    halves = [samples[:6], samples[6:]]
    naive = sum(grads(h, "token-mean", "ppo", 1)[0] for h in halves) / 2
    assert not close(ref["token-mean", "ppo"][0], naive)

    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank process failed:\n{out}"
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for e, a in adv_ref.items():  # gathered rewards: every rank computes the global advantages
            assert res["adv"][e].keys() == a.keys() and all(
                abs(res["adv"][e][k] - a[k]) < 1e-12 for k in a
            )
        for c in CONFIGS:
            for n_micro in (1, 2):
                g, m = res[c + (n_micro,)]
                assert close(ref[c][0], g), (
                    f"{c}, 2 ranks x {n_micro} micro-batches: gradient differs from 1 rank"
                )
                assert abs(m["loss"] - ref[c][1]["loss"]) <= 1e-9 * abs(ref[c][1]["loss"]) + 1e-12
                assert (
                    m["tokens"] == ref[c][1]["tokens"]
                    and abs(m["clip_frac"] - ref[c][1]["clip_frac"]) < 1e-12
                )


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
