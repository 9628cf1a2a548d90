"""algo.py against numbers computed by hand (the arithmetic is in the comments)."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from lightning_lite import algo
from lightning_lite.algo import (
    collate,
    compute_advantages,
    global_denominators,
    pack,
    policy_loss,
    reduce_metrics,
    sample_weights,
    sampled_entropy,
    sampled_logprobs,
    sampling_support,
    trainer_logprobs,
    trainer_logprobs_and_entropy,
    tree_mask,
    tree_unsupported,
)
from lightning_lite.extras.mismatch import Mismatch
from lightning_lite.records import Sample

approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-9)  # noqa: E731


def mismatch(*micro_batches) -> dict:
    """extras/mismatch.py's metrics (hooks.LOSS_METRICS) of micro-batches (logprobs, old_logprobs,
    loss_mask), as trainer.Learner.backward adds them to reduce_metrics'."""
    metric = Mismatch()
    for logprobs, old_logprobs, loss_mask in micro_batches:
        batch = {"old_logprobs": old_logprobs, "loss_mask": loss_mask}
        metric.add([], batch, logprobs.detach(), None)
    return metric.result()


# group g1: a=1 b=0 c=0 (f failed); g2: d=1 e=1 (all equal); g3: h=0.5 alone
REWARDS = {"a": 1.0, "b": 0.0, "c": 0.0, "f": None, "d": 1.0, "e": 1.0, "h": 0.5}
GROUPS = {"a": "g1", "b": "g1", "c": "g1", "f": "g1", "d": "g2", "e": "g2", "h": "g3"}


def test_grpo():
    adv, st = compute_advantages(REWARDS, GROUPS, "grpo")
    # g1: mean 1/3, deviations 2/3 -1/3 -1/3, std = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.57735
    assert adv["a"] == approx((2 / 3) / math.sqrt(1 / 3)) and adv["a"] == approx(1.154700)
    assert adv["b"] == adv["c"] == approx(-0.577350)
    assert adv["d"] == adv["e"] == adv["h"] == 0.0  # zero variance; singleton
    assert "f" not in adv  # failed: not trained, not in the statistics (else g1's mean would move)
    assert (st["rollouts"], st["failed"], st["groups"]) == (6, 1, 3)
    assert (st["zero_variance_groups"], st["singleton_groups"]) == (2, 1)


def test_dr_grpo_rloo_reinforce():
    adv, _ = compute_advantages(REWARDS, GROUPS, "dr_grpo")
    assert (adv["a"], adv["b"], adv["d"]) == (approx(2 / 3), approx(-1 / 3), 0.0)
    adv, st = compute_advantages(REWARDS, GROUPS, "rloo")
    # a: 1 - mean(b, c) = 1 - 0 = 1;  b: 0 - mean(a, c) = -0.5;  h alone: 0 (counted)
    assert (adv["a"], adv["b"], adv["c"], adv["d"], adv["h"]) == (1.0, -0.5, -0.5, 0.0, 0.0)
    assert st["singleton_groups"] == 1
    adv, _ = compute_advantages(REWARDS, GROUPS, "reinforce")
    # batch mean = (1 + 0 + 0 + 1 + 1 + 0.5) / 6 = 3.5 / 6 = 0.583333
    assert adv["a"] == adv["d"] == approx(1 - 3.5 / 6) and adv["b"] == approx(-3.5 / 6)
    assert adv["h"] == approx(0.5 - 3.5 / 6)


def test_drop_zero_variance_and_errors():
    adv, st = compute_advantages(REWARDS, GROUPS, "grpo", drop_zero_variance=True)
    # g2 (d, e: both 1.0) is dropped; h is a group of 1: all the data there is, never "flat"
    assert sorted(adv) == ["a", "b", "c", "h"] and st["dropped_rollouts"] == 2
    # reinforce with groups of 1 (its use case) keeps every rollout
    adv, st = compute_advantages(
        {"x": 1.0, "y": 0.0}, {"x": "gx", "y": "gy"}, "reinforce", drop_zero_variance=True
    )
    assert adv == {"x": 0.5, "y": -0.5} and st["dropped_rollouts"] == 0
    with pytest.raises(ValueError, match="pick one of"):
        compute_advantages(REWARDS, GROUPS, "ppo")
    with pytest.raises(ValueError, match="no group"):
        compute_advantages({"x": 1.0}, {}, "grpo")
    with pytest.raises(ValueError, match="None"):
        compute_advantages({"x": float("nan")}, {"x": "g"}, "grpo")


def test_per_call_estimators_by_hand():
    # the docstring's examples. grpo-step, rewards a=1 b=0 (one group): grpo 0.7071 / -0.7071 (mean .5, std sqrt(.5));
    # call rewards a {0: 1}, b {0: 0, 1: 0}: m 1/3, s sqrt(1/3) -> (1 - 1/3) / s = 1.1547, (0 - 1/3) / s = -0.5774
    adv, st = compute_advantages(
        {"a": 1.0, "b": 0.0},
        {"a": "g", "b": "g"},
        "grpo-step",
        call_rewards={"a": {0: 1.0}, "b": {0: 0.0, 1: 0.0}},
        calls={"a": [0], "b": [0, 1]},
    )
    assert adv["a"] == {0: approx(math.sqrt(0.5) + 2 / 3 / math.sqrt(1 / 3))} and adv["a"][
        0
    ] == approx(1.861807)
    assert adv["b"] == {0: approx(-math.sqrt(0.5) - 1 / 3 / math.sqrt(1 / 3)), 1: approx(-1.284457)}
    # a call without a reward gets the rollout's part alone; no call rewards at all: grpo per call
    adv, _ = compute_advantages(
        {"a": 1.0, "b": 0.0},
        {"a": "g", "b": "g"},
        "grpo-step",
        call_rewards={"a": {1: 5.0}},
        calls={"a": [0, 1], "b": [0]},
    )
    assert adv == {
        "a": {0: approx(math.sqrt(0.5)), 1: approx(math.sqrt(0.5))},
        "b": {0: approx(-math.sqrt(0.5))},
    }  # one call reward: no spread
    # returns, gamma 0.5: a: G1 = 1 (its reward, on its last call), G0 = 0.2 + 0.5 * 1 = 0.7; b: 0, 0; baseline (0.7 + 0) / 2
    adv, _ = compute_advantages(
        {"a": 1.0, "b": 0.0},
        {"a": "g", "b": "g"},
        "returns",
        call_rewards={"a": {0: 0.2}},
        calls={"a": [0, 1], "b": [0, 1]},
        gamma=0.5,
    )
    assert adv == {
        "a": {0: approx(0.35), 1: approx(0.65)},
        "b": {0: approx(-0.35), 1: approx(-0.35)},
    }
    # gamma 1 and no call rewards: dr_grpo, on every call
    dr, _ = compute_advantages(REWARDS, GROUPS, "dr_grpo")
    calls = {rid: [0, 3] for rid in REWARDS}
    adv, _ = compute_advantages(REWARDS, GROUPS, "returns", calls=calls)
    assert adv == {rid: {0: approx(a), 3: approx(a)} for rid, a in dr.items()}
    # a group flat in rollout rewards but not in call rewards is not zero-variance: not dropped
    adv, st = compute_advantages(
        {"d": 1.0, "e": 1.0},
        {"d": "g", "e": "g"},
        "grpo-step",
        drop_zero_variance=True,
        call_rewards={"d": {0: 1.0}, "e": {0: 0.0}},
        calls={"d": [0], "e": [0]},
    )
    assert adv["d"][0] == approx(1 / math.sqrt(0.5) / 2) and st["zero_variance_groups"] == 0
    # README's worked example
    ex = dict(
        rewards={"a": 1.0, "b": 0.0},
        groups={"a": "g", "b": "g"},
        call_rewards={"a": {0: 0.2}, "b": {0: 0.0}},
        calls={"a": [0, 1], "b": [0, 1]},
    )
    h = math.sqrt(0.5)
    assert compute_advantages(estimator="grpo-step", **ex)[0] == {
        "a": {0: approx(2 * h), 1: approx(h)},
        "b": {0: approx(-2 * h), 1: approx(-h)},
    }
    assert compute_advantages(estimator="returns", gamma=0.5, **ex)[0] == {
        "a": {0: approx(0.35), 1: approx(0.65)},
        "b": {0: approx(-0.35), 1: approx(-0.35)},
    }
    with pytest.raises(ValueError, match="answered call indices"):
        compute_advantages(REWARDS, GROUPS, "returns")


def test_sft_imitates_every_finished_rollout_or_those_rewarded_at_least_the_threshold():
    from lightning_lite.algo import imitation_advantages

    rewards = {"a": 1.0, "b": 0.2, "c": 0.5}
    assert imitation_advantages(rewards) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert imitation_advantages(rewards, min_reward=0.5) == {"a": 1.0, "c": 1.0}
    assert imitation_advantages(rewards, min_reward=2.0) == {}


def test_per_call_advantages_reach_exactly_the_tokens_of_their_calls():
    """Calls 1 and 2 both continue call 0 (two leaves); call 3 starts over (a split). Call 0's tokens are trained once,
    in the longest leaf, with call 0's advantage; every trainable token has its own call's, prompts 0."""
    from lightning_lite.algo import assign_advantages
    from lightning_lite.records import Call
    from lightning_lite.samples import build_samples

    def call(i, prompt, response):
        return Call("r", i, "chat", 0, prompt, response, [-0.1] * len(response), "stop")

    calls = [
        call(0, [1], [10, 11]),
        call(1, [1, 10, 11, 5], [12]),
        call(2, [1, 10, 11, 6], [13, 14]),
        call(3, [2], [15]),
    ]
    samples = build_samples(calls)[0]
    assert [s.tokens for s in samples] == [[1, 10, 11, 5, 12], [1, 10, 11, 6, 13, 14], [2, 15]]
    assert [s.call for s in samples] == [[-1, -1, -1, -1, 1], [-1, 0, 0, -1, 2, 2], [-1, 3]]
    assign_advantages(samples, {"r": {0: 0.5, 1: -1.0, 2: 2.0, 3: 0.25}})
    assert [s.advantages for s in samples] == [
        [0, 0, 0, 0, -1.0],
        [0, 0.5, 0.5, 0, 2.0, 2.0],
        [0, 0.25],
    ]
    assign_advantages(samples, {"r": 0.7})  # one advantage per rollout: every trainable token
    assert [s.advantages for s in samples] == [
        [0, 0, 0, 0, 0.7],
        [0, 0.7, 0.7, 0, 0.7, 0.7],
        [0, 0.7],
    ]
    # the loss sees each token's own: [B, T] advantages, per token (ppo, ratio 1: -A per token)
    assign_advantages(samples, {"r": {0: 0.5, 1: -1.0, 2: 2.0, 3: 0.25}})
    b = collate(samples, [1.0, 1.0, 1.0])
    loss, _ = policy_loss(
        b["old_logprobs"], b["old_logprobs"], b["advantages"], b["loss_mask"], b["weights"]
    )
    assert loss.item() == approx(-(-1.0 + 0.5 * 2 + 2.0 * 2 + 0.25))


def test_sft_loss_is_the_weighted_negative_logprob():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    loss, m = policy_loss(
        lp, lp.detach() - 1, torch.tensor([0.0, -3.0]), mask, torch.tensor([0.5, 1.0]), loss="sft"
    )
    assert (
        loss.item() == approx(0.5 * (1 + 2) + 1.0 * 0.5) and m["clipped"] == 0
    )  # the advantage and the ratio play no part
    loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.5, -0.5], [0.0, -1.0, 0.0]]


# Rollout A: samples of 1 and 2 trainable tokens; rollout B: one sample of 4. With
# advantage -1 and new == old logprobs (ratio 1), tis's token loss -1 * A * logprob is
# the logprob itself; we pick them as  a: -1 | -2 -3   b: -4 -5 -6 -7.
def norm_batch():
    def s(rid, lps):  # one prompt token (mask 0), then the sampled tokens
        return Sample(
            rollout_id=rid,
            tokens=list(range(len(lps) + 1)),
            loss_mask=[0] + [1] * len(lps),
            logprobs=[0.0] + lps,
            advantages=[0.0] + [-1.0] * len(lps),
        )

    return [s("A", [-1.0]), s("A", [-2.0, -3.0]), s("B", [-4.0, -5.0, -6.0, -7.0])]


@pytest.mark.parametrize(
    "norm,const,expected",
    [
        ("token-mean", None, -28 / 7),  # all 7 tokens: -28 / 7 = -4
        ("seq-mean-token-mean", None, (-1 - 5 / 2 - 22 / 4) / 3),  # (-1 + -2.5 + -5.5) / 3 = -3
        ("seq-mean-token-sum", None, (-1 - 5 - 22) / 3),  # -28 / 3
        ("seq-mean-token-sum-norm", 10, -28 / (3 * 10)),  # sums / (3 samples x C=10)
        ("rollout-mean", None, (-6 / 3 - 22 / 4) / 2),  # A: -6/3 = -2, B: -22/4 = -5.5 -> -3.75
    ],
)
def test_normalization_modes(norm, const, expected):
    samples = norm_batch()
    denoms = global_denominators(samples)  # no torch.distributed: the local counts
    assert denoms == {"tokens": 7, "samples": 3, "rollouts": 2}
    w = sample_weights(samples, norm, denoms, norm_const=const)
    total, parts = 0.0, []
    for micro in ([0, 1, 2], [0], [1, 2]):  # the whole batch, then split in two micro-batches
        b = collate([samples[i] for i in micro], [w[i] for i in micro], dtype=torch.float64)
        loss, m = policy_loss(
            b["old_logprobs"],
            b["old_logprobs"],
            b["advantages"],
            b["loss_mask"],
            b["weights"],
            loss="tis",
        )
        if len(micro) == 3:
            assert loss.item() == approx(expected)
        else:
            total += loss.item()
            parts.append(m)
    assert total == approx(expected) and reduce_metrics(parts)["loss"] == approx(expected)


def test_weights_by_hand():
    samples = norm_batch()
    d = global_denominators(samples)
    assert sample_weights(samples, "seq-mean-token-mean", d) == approx([1 / 3, 1 / 6, 1 / 12])
    assert sample_weights(samples, "rollout-mean", d) == approx([1 / 6, 1 / 6, 1 / 8])
    with pytest.raises(ValueError, match="pick one of"):
        sample_weights(samples, "mean", d)
    with pytest.raises(
        ValueError, match="fixed token budget"
    ):  # no batch-dependent default: that is a length bias
        sample_weights(samples, "seq-mean-token-sum-norm", d)


def two_rows(ratios, advs):
    """Two samples of 3 trainable tokens, old logprob log(0.5), trainer logprob log(0.5 * ratio)."""
    old = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    new = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()
    return new, old, torch.tensor(advs, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)


def test_ppo_by_hand():
    new, old, adv, mask = two_rows([[0.5, 1.0, 2.0]] * 2, [1.0, -1.0])
    w = torch.full((2,), 1 / 6, dtype=torch.float64)  # token-mean over 6 tokens
    loss, m = policy_loss(new, old, adv, mask, w, "ppo", clip_low=0.2, clip_high=0.28)
    # clip(r) = 0.8, 1.0, 1.28.  A=+1: -min(r, c) = -0.5, -1, -1.28 (3rd clipped)
    #                            A=-1: -min(-r, -c) = 0.8, 1, 2   (1st clipped)
    assert loss.item() == approx((-0.5 - 1 - 1.28 + 0.8 + 1 + 2) / 6)
    loss.backward()
    # d/dlogprob of -A r w where not clipped: -A r / 6; clipped tokens get no gradient
    assert new.grad.tolist() == [approx([-0.5 / 6, -1 / 6, 0.0]), approx([0.0, 1 / 6, 2 / 6])]
    r = {**reduce_metrics([m]), **mismatch((new, old, mask))}
    assert r["clip_frac"] == approx(2 / 6) and r["tokens"] == 6
    assert (r["ratio_min"], r["ratio_mean"], r["ratio_max"]) == (
        approx(0.5),
        approx(7 / 6),
        approx(2.0),
    )
    assert r["dlogp_mean"] == approx(4 * math.log(2) / 6) and r["dlogp_max"] == approx(math.log(2))


def test_dual_clip_bounds_a_negative_advantage_tokens_ratio_by_hand():
    """--clip-ratio-c: for A < 0 the PPO term is min(max(-r A, -clip(r) A), -C A). Ratios 0.5, 2, 5, C = 3:
    A = -1: max(r, clip(r)) = 0.8 (clipped), 2, 5 -> min with 3: 0.8, 2, 3 (the 3rd dual-clipped: no gradient);
    A = +1 is untouched: -min(r, clip(r)) = -0.5, -1.28 (clipped), -1.28 (clipped)."""
    new, old, adv, mask = two_rows([[0.5, 2.0, 5.0]] * 2, [-1.0, 1.0])
    w = torch.ones(2, dtype=torch.float64)
    loss, m = policy_loss(
        new, old, adv, mask, w, "ppo", clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    assert loss.item() == approx(0.8 + 2 + 3 - 0.5 - 1.28 - 1.28)
    loss.backward()
    assert new.grad.tolist() == [
        approx([0.0, 2.0, 0.0]),
        approx([-0.5, 0.0, 0.0]),
    ]  # -A r where the r branch is taken
    assert reduce_metrics([m])["clip_frac"] == approx(4 / 6)  # 0.8, 5 (dual), 1.28, 1.28
    unbounded, _ = policy_loss(
        new, old, adv, mask, w, "ppo", clip_low=0.2, clip_high=0.28, clip_ratio_c=math.inf
    )
    assert unbounded.item() == approx(0.8 + 2 + 5 - 0.5 - 1.28 - 1.28)  # inf: off, the old PPO loss
    # gspo: the sample's ratio exp(mean log-ratio) = (0.5 * 2 * 5) ** (1/3) = 1.71 for A = -1: under C, kept; C = 1.5 caps it
    seq = 5.0 ** (1 / 3)
    g, _ = policy_loss(new, old, adv, mask, w, "gspo", clip_low=0.2, clip_high=0.28)
    g_c, _ = policy_loss(
        new, old, adv, mask, w, "gspo", clip_low=0.2, clip_high=0.28, clip_ratio_c=1.5
    )
    assert (g.item(), g_c.item()) == (approx(3 * seq - 3 * 1.28), approx(3 * 1.5 - 3 * 1.28))


def test_gspo_by_hand():
    # row 0: log-ratios 0, 0, 0.3 -> sequence ratio exp(0.1) = 1.10517, inside [0.8, 1.28]
    # row 1: log-ratios 0.9 x3 -> exp(0.9) = 2.4596; A = -1: -min(-2.4596, -1.28) = 2.4596 (not clipped)
    new, old, adv, mask = two_rows([[1.0, 1.0, math.exp(0.3)], [math.exp(0.9)] * 3], [2.0, -1.0])
    w = torch.full(
        (2,), 1 / 6, dtype=torch.float64
    )  # seq-mean-token-mean: 1 / (2 samples x 3 tokens)
    ppo_clip = dict(clip_low=0.2, clip_high=0.28)
    loss, m = policy_loss(new, old, adv, mask, w, "gspo", **ppo_clip)
    assert loss.item() == approx((-2 * math.exp(0.1) + math.exp(0.9)) / 2)
    loss.backward()
    # d(seq ratio)/d(logprob_t) = seq ratio / 3; sample weight 1/2: grad = -A s / 3 / 2
    assert new.grad[0].tolist() == approx([-2 * math.exp(0.1) / 6] * 3)
    assert new.grad[1].tolist() == approx([math.exp(0.9) / 6] * 3)
    assert reduce_metrics([m])["clip_frac"] == 0.0
    # A = +1 on row 1 instead: 2.4596 > 1.28 is clipped, the whole sample gets no gradient
    new.grad = None
    loss, m = policy_loss(
        new, old, torch.tensor([2.0, 1.0], dtype=torch.float64), mask, w, "gspo", **ppo_clip
    )
    loss.backward()
    assert new.grad[1].tolist() == [0.0] * 3 and reduce_metrics([m])["clip_frac"] == approx(0.5)
    # GSPO's own default range (3e-4, 4e-4): row 0's ratio 1.105 is clipped too, for A > 0
    _, m = policy_loss(new, old, torch.tensor([2.0, 1.0], dtype=torch.float64), mask, w, "gspo")
    assert reduce_metrics([m])["clip_frac"] == 1.0
    _, m = policy_loss(
        new, old, torch.tensor([2.0, 1.0], dtype=torch.float64), mask, w, "ppo"
    )  # PPO's (0.2, 0.28): 0.9 inside
    assert reduce_metrics([m])["clip_frac"] == approx(4 / 6)


def test_tis_by_hand():
    new, old, adv, mask = two_rows([[0.5, 1.0, 3.0], [1.0, 1.0, 1.0]], [2.0, 0.0])
    w = torch.ones(2, dtype=torch.float64)
    loss, m = policy_loss(new, old, adv, mask, w, "tis", tis_cap=2.0)
    # -min(r, 2) * A * logprob, logprobs log(0.25), log(0.5), log(1.5): weights 0.5, 1, 2 (3 capped)
    assert loss.item() == approx(-2 * (0.5 * math.log(0.25) + math.log(0.5) + 2 * math.log(1.5)))
    loss.backward()
    assert new.grad[0].tolist() == approx(
        [-1.0, -2.0, -4.0]
    )  # -A min(r, cap), the weight has no grad
    assert reduce_metrics([m])["clip_frac"] == approx(1 / 6)


def test_kl_penalty_and_mismatch_metrics():
    # one token, A = 0: only the KL term. k3 with d = ref - lp = 0.5: e^0.5 - 0.5 - 1 = 0.148721
    lp = torch.tensor([[-1.0]], dtype=torch.float64)
    one, ref = torch.ones(1, dtype=torch.float64), torch.tensor([[-0.5]], dtype=torch.float64)
    loss, m = policy_loss(lp, lp, one * 0, torch.ones(1, 1), one, kl_coef=0.1, ref_logprobs=ref)
    assert loss.item() == approx(0.1 * (math.exp(0.5) - 1.5)) and reduce_metrics([m])[
        "kl_mean"
    ] == approx(0.148721)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, one, torch.ones(1, 1), one, kl_coef=0.1)
    # probabilities 0.2 0.4 0.6 (rollout) vs 0.3 0.5 0.7 (trainer): a shift, Pearson 1
    p, q = torch.tensor([[0.2, 0.4, 0.6]]).double(), torch.tensor([[0.3, 0.5, 0.7]]).double()
    # over two micro-batches (extras/mismatch.py)
    r = mismatch(
        (q.log()[:, :2], p.log()[:, :2], torch.ones(1, 2)),
        (q.log()[:, 2:], p.log()[:, 2:], torch.ones(1, 1)),
    )
    assert r["prob_corr"] == approx(1.0) and r["dlogp_max"] == approx(math.log(0.3 / 0.2))
    assert mismatch((q.flip(1).log(), p.log(), torch.ones(1, 3)))["prob_corr"] == approx(-1.0)


def fixed_logits(logits):
    """A stand-in for the model: returns the rows of ``logits`` that train.py asks for (logits_to_keep)."""
    return lambda input_ids, logits_to_keep, **_: SimpleNamespace(logits=logits[:, logits_to_keep])


def test_trainer_logprobs_alignment():
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    tokens = [[1, 2, 3, 4], [0, 0, 1, 1]]
    b = collate(
        [
            Sample("a", tokens[0], [0, 0, 1, 1], [0.0] * 4),
            Sample("b", tokens[1], [0, 1, 1, 0], [0.0] * 4),
        ],
        [1.0, 1.0],
        dtype=torch.float64,
        tree=False,
    )  # the stand-in's logits are per row
    lp = trainer_logprobs(fixed_logits(logits), b)
    ref = torch.log_softmax(logits, -1)  # token t is predicted at position t - 1
    assert lp[1, 2] == approx(ref[1, 1, 1].item()) and lp[0, 3] == approx(ref[0, 2, 4].item())
    assert lp[0, :2].tolist() == [0.0, 0.0] and lp[1, 3] == 0.0  # off the loss mask


def test_pack_by_hand():
    tokens, depth, end, where = pack([[1, 2, 3], [5], [1, 2, 4], [1, 2]])
    assert (tokens, depth, end) == ([1, 2, 3, 4, 5], [0, 1, 2, 2, 0], [4, 4, 3, 4, 5])
    assert where == [
        [0, 1, 2],
        [4],
        [0, 1, 3],
        [0, 1],
    ]  # a sample that is a prefix of another adds nothing
    b = collate(
        [
            Sample("a", [1, 2, 3], [0, 0, 1], [0.0] * 3),
            Sample("b", [1, 2, 4], [0, 1, 1], [0.0] * 3),
        ],
        [1.0, 1.0],
        pad_to=8,
    )
    assert (
        b["input_ids"].tolist() == [[1, 2, 3, 4, 0, 0, 0, 0]] and b["fwd_tokens"] == 4
    )  # padded: each pad sees itself
    cfg = SimpleNamespace(_attn_implementation="sdpa")
    m = tree_mask(cfg, b["depth"], b["end"])[0, 0].int()
    assert (
        m[3].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
        and m[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
        and m[6].tolist() == [0] * 6 + [1, 0]
    )
    assert b["where"].tolist() == [[0, 1, 2], [0, 1, 3]]
    flat = collate(
        [Sample("a", [1, 2, 3], [0, 0, 1], [0.0] * 3), Sample("b", [1, 2], [0, 1], [0.0] * 2)],
        [1.0, 1.0],
        tree=False,
    )
    assert (
        flat["input_ids"].tolist() == [[1, 2, 3], [1, 2, 0]]
        and flat["fwd_tokens"] == 5
        and flat["end"] is None
    )


def tiny(kind, seed=0):
    """A tiny random model in fp64: Llama (full attention), Mistral (every layer a sliding window of 5), Gemma2
    (sliding and full layers, a dict of masks)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    size = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    cls, cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig(**size)),
        "mistral": (MistralForCausalLM, MistralConfig(**size, sliding_window=5, head_dim=8)),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(**size, sliding_window=5, head_dim=8)),
    }[kind]
    torch.manual_seed(seed)
    return cls(cfg).double()


def branching_samples(vocab=50):
    """A rollout that split (a leaf that extends a shared history, one that rewrote it), a second rollout of the
    same task prompt, a sample that is a prefix-free stranger: 4 samples, 31 to 12 tokens, 101 tokens, 56 distinct
    prefixes' worth when packed."""
    g = torch.Generator().manual_seed(0)
    r = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt = r(20)
    turn1 = prompt + r(5)
    return [
        Sample("a", turn1 + r(6), [0] * 20 + [1] * 11, [0.0] * 31),
        Sample("b", prompt + r(9), [0] * 20 + [1] * 9, [0.0] * 29),
        Sample("c", r(12), [0] * 3 + [1] * 9, [0.0] * 12),
        Sample("a", turn1 + r(4), [0] * 25 + [1] * 4, [0.0] * 29),
    ]


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_tree_gives_each_token_its_own_sequences_logprob(kind, attn):
    """Packed as one tree (each shared prefix once, 56 of 101 tokens), the logprobs and gradients are those of
    training every sample as its own row: to fp64 for the logprobs; the gradients, summed in another order through
    RMSNorm's fp32, to 1e-6 of their size (measured 4e-8 to 9e-8). Sliding-window layers count the window in each
    token's own sequence: with the sequences 2-6x the window, a packed-index window would be far off."""
    net = tiny(kind)
    net.set_attn_implementation(attn)
    out = {}
    for tree in (False, True):
        b = collate(branching_samples(), [1.0] * 4, dtype=torch.float64, tree=tree)
        out[tree] = logprobs_and_grads(net, lambda: trainer_logprobs(net, b)), b["fwd_tokens"]
    ((lp_rows, g_rows), n_rows), ((lp, g), n) = out[False], out[True]
    assert (n_rows, n) == (101, 56)
    assert (
        torch.allclose(lp, lp_rows, atol=1e-7)
        and (g - g_rows).abs().max() <= 1e-6 * g_rows.abs().max()
    )
    if kind != "llama":  # the window matters here: the same weights without it give other numbers
        net.config.sliding_window = None
        if kind == "gemma2":
            net.config.layer_types = ["full_attention"] * 2
        b = collate(branching_samples(), [1.0] * 4, dtype=torch.float64)
        assert (
            logprobs_and_grads(net, lambda: trainer_logprobs(net, b))[0] - lp_rows
        ).abs().max() > 1e-3


def test_a_packed_tree_under_activation_checkpointing_and_flex_attention():
    """--activation-checkpointing recomputes the packed forward to the same gradients; FlexAttention's block mask
    (forward only on a CPU: torch has no CPU backward for it) gives the logprobs of the sdpa rows."""
    net = tiny("llama")
    b = collate(branching_samples(), [1.0] * 4, dtype=torch.float64)
    lp, g = logprobs_and_grads(net, lambda: trainer_logprobs(net, b))
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()  # no dropout in this config
    lp_ckpt, g_ckpt = logprobs_and_grads(net, lambda: trainer_logprobs(net, b))
    assert (
        torch.allclose(lp_ckpt, lp, atol=1e-12) and (g - g_ckpt).abs().max() <= 1e-9 * g.abs().max()
    )
    net = tiny("llama").float().eval()
    samples = [Sample(s.rollout_id, s.tokens, s.loss_mask, s.logprobs) for s in branching_samples()]
    with torch.no_grad():
        rows = trainer_logprobs(net, collate(samples, [1.0] * 4, tree=False))
        net.set_attn_implementation("flex_attention")
        flex = trainer_logprobs(net, collate(samples, [1.0] * 4, pad_to=128))
    assert (flex - rows).abs().max() <= 1e-5


def test_selective_activation_checkpointing_recomputes_no_matmul():
    """--activation-checkpointing selective (parallel.wrap) keeps each layer's matmul and attention
    outputs: a packed tree's gradients are the plain backward's, and the backward runs exactly the
    plain backward's matmul FLOPs, where "full" also recomputes the forward's."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_lite.parallel import wrap

    b = collate(branching_samples(), [1.0] * 4, dtype=torch.float64)
    grads, flops = {}, {}
    for mode in (None, "selective", "full"):
        net = wrap(tiny("llama"), "ddp", 1, checkpointing=mode).train()
        lp = trainer_logprobs(net, b)
        with FlopCounterMode(display=False) as counter:
            lp.sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in net.parameters()])
        flops[mode] = counter.get_total_flops()
    for mode in ("selective", "full"):
        assert (grads[mode] - grads[None]).abs().max() <= 1e-9 * grads[None].abs().max()
    assert flops["selective"] == flops[None] < flops["full"]


def test_block_sdpa_is_attention_under_the_mask_over_only_the_keys_each_block_sees():
    """extras/fast_decode.py's block_sdpa on a packed tree's mask (pack([[1, 2, 3], [1, 2, 4]]) and
    the 56-token tree of branching_samples), 4 query heads, each pair sharing one of 2 KV heads
    (head h reads KV head h // 2): the numbers of dense SDPA with the KV heads repeated, at any block
    size; and a block runs only over the keys its rows see."""
    from lightning_lite.extras.fast_decode import block_sdpa

    for seqs in ([[1, 2, 3], [1, 2, 4]], [s.tokens for s in branching_samples()]):
        _, depth, end, _ = pack(seqs)
        config = SimpleNamespace(_attn_implementation="sdpa")
        mask = tree_mask(config, torch.tensor([depth]), torch.tensor(end))
        L = len(end)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, L, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(2))
        repeated = [t.repeat_interleave(2, dim=1) for t in (k, v)]
        dense = F.scaled_dot_product_attention(q, *repeated, mask)
        for block in (1, 2, 3, 7, 128):
            assert (block_sdpa(q, k, v, mask, block=block) - dense).abs().max() < 1e-12
        # as transformers passes them: [B, L, H, D] memory, transposed to [B, H, L, D]
        strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        for block in (1, 3):
            assert (block_sdpa(*strided, mask, block=block) - dense).abs().max() < 1e-12
    # Row 3 of the first tree (token 4) sees keys 0, 1 and 3: a block of that row alone, given keys
    # that differ only at key 2 (its sibling), gives the same output.
    _, depth, end, _ = pack([[1, 2, 3], [1, 2, 4]])
    mask = tree_mask(
        SimpleNamespace(_attn_implementation="sdpa"), torch.tensor([depth]), torch.tensor(end)
    )
    q = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 2], v2[:, :, 2] = 1e6, float("nan")
    row3 = block_sdpa(q, k, v, mask, block=1)[:, :, 3]
    assert torch.equal(block_sdpa(q, k2, v2, mask, block=1)[:, :, 3], row3)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_a_packed_tree_longer_than_a_block_trains_under_block_sdpa_as_separate_rows(kind):
    """The trainer's attention on a CPU (extras/fast_decode.py's install_trainer): a packed tree of
    209 tokens (two blocks of query rows) gives the logprobs and gradients of each sample as its own
    row under transformers' sdpa."""
    from lightning_lite.extras.fast_decode import install_trainer

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50, (59,), generator=g).tolist()
    samples = []
    for n in (50, 60, 40):
        reply = torch.randint(0, 50, (n,), generator=g).tolist()
        samples.append(Sample("r", prompt + reply, [0] * 59 + [1] * n, [0.0] * (59 + n)))
    net = tiny(kind)
    net.set_attn_implementation("sdpa")
    rows = collate(samples, [1.0] * 3, dtype=torch.float64, tree=False)
    lp_rows, g_rows = logprobs_and_grads(net, lambda: trainer_logprobs(net, rows))
    install_trainer(net)
    assert net.config._attn_implementation == "block_sdpa"
    tree = collate(samples, [1.0] * 3, dtype=torch.float64)
    assert tree["fwd_tokens"] == 209
    lp, g = logprobs_and_grads(net, lambda: trainer_logprobs(net, tree))
    assert torch.allclose(lp, lp_rows, atol=1e-7)
    assert (g - g_rows).abs().max() <= 1e-6 * g_rows.abs().max()


def test_models_that_cannot_run_a_packed_tree_say_why():
    assert (
        tree_unsupported(
            SimpleNamespace(
                _attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]
            )
        )
        is None
    )
    assert "linear_attention" in tree_unsupported(
        SimpleNamespace(
            _attn_implementation="sdpa", layer_types=["linear_attention", "full_attention"]
        )
    )
    assert "flash_attention_2" in tree_unsupported(
        SimpleNamespace(_attn_implementation="flash_attention_2")
    )
    with pytest.raises(ValueError, match="--no-tree"):
        tree_mask(
            SimpleNamespace(_attn_implementation="flash_attention_2"),
            torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([1, 2]),
        )


def test_reduce_metrics_of_a_rank_without_samples():
    # such a rank still joins the all-reduces, with neutral values
    r = {**reduce_metrics([]), **Mismatch().result()}
    assert (
        r["tokens"] == 0
        and r["loss"] == 0
        and r["ratio_min"] == math.inf
        and math.isnan(r["prob_corr"])
    )


def test_sampling_support_by_hand():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 5)
    keep = sampling_support(
        x, torch.tensor([0, 2, 3, 0, 1]), torch.tensor([1.0, 1.0, 0.7, 0.9, 0.1])
    )
    # softmax [.644 .237 .087 .032]; top-3 renormalized [.665 .245 .090]
    assert keep.tolist() == [
        [True] * 4,  # nothing truncated
        [True, True, False, False],  # top-2
        [True, True, False, False],  # top-3, then top-p .7: the mass before the 3rd is .91
        [True, True, True, False],  # top-p .9: the mass before the 4th is .968 >= .9
        [True, False, False, False],
    ]
    # top-p 0 still keeps one token; ties with the k-th logit stay in (as in the sampler)
    assert sampling_support(
        torch.tensor([[1.0, 2.0]]), torch.tensor([0]), torch.tensor([0.0])
    ).tolist() == [[False, True]]
    assert sampling_support(
        torch.tensor([[2.0, 1.0, 1.0, 0.0]]), torch.tensor([2]), torch.tensor([1.0])
    ).tolist() == [[True, True, True, False]]


def test_sampled_logprobs_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 6)
    tokens = torch.tensor([0, 0, 0, 0, 1, 2])
    T = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 1.0])
    k = torch.tensor([0, 2, 0, 0, 5, 1])
    p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.5, 1.0])
    lp = sampled_logprobs(logits, tokens, T, k, p)
    z = math.log(math.e**2 + math.e + 1)
    assert lp[0].item() == approx(2 - z)  # plain softmax: -0.408
    assert lp[1].item() == approx(2 - math.log(math.e**2 + math.e))  # top-2: -0.313
    assert lp[2].item() == approx(0.0)  # top-p .5 keeps token 0 alone
    assert lp[3].item() == approx(4 - math.log(math.e**4 + math.e**2 + 1))  # T = 0.5
    assert lp[4].item() == approx(1 - z)  # greedy: softmax(logits), no truncation
    # top-1 keeps token 0, but token 2 WAS sampled (float noise at the boundary): it stays in the support
    assert lp[5].item() == approx(0 - math.log(math.e**2 + 1))


def test_sampled_entropy_by_hand():
    """The entropy of the distribution each token's logprob is under: softmax(logits / T) on the
    top-k / top-p support and the grammar's mask, renormalized; greedy under softmax(logits)."""
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 6)
    tokens = torch.tensor([0, 0, 0, 0, 1, 0])
    T = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    k = torch.tensor([0, 2, 0, 0, 5, 0])
    p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.5, 1.0])
    allowed = torch.ones(6, 3, dtype=torch.bool)
    allowed[3, 1] = False

    def h(probs):
        return -sum(q * math.log(q) for q in probs)

    z = math.e**2 + math.e + 1
    got = sampled_entropy(logits, tokens, T, k, p, allowed).tolist()
    # plain softmax: .665 .245 .090 -> 0.832
    assert got[0] == approx(h([math.e**2 / z, math.e / z, 1 / z]))
    # top-2: .731 .269 -> 0.582
    assert got[1] == approx(h([math.e**2 / (math.e**2 + math.e), math.e / (math.e**2 + math.e)]))
    # top-p .5 keeps token 0 alone: certain (0.0, not -0.0)
    assert got[2] == 0.0 and math.copysign(1, got[2]) == 1
    # the grammar allows tokens 0 and 2: .881 .119 -> 0.365
    assert got[3] == approx(h([math.e**2 / (math.e**2 + 1), 1 / (math.e**2 + 1)]))
    # greedy: softmax(logits), its top-k and top-p unused
    assert got[4] == approx(got[0])
    # T 0.5: softmax([4, 2, 0])
    z2 = math.e**4 + math.e**2 + 1
    assert got[5] == approx(h([math.e**4 / z2, math.e**2 / z2, 1 / z2]))


def test_trainer_logprobs_uses_each_tokens_own_sampling():
    """A merged sample whose turns used different settings: each token is scored under its own."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (1, 5), generator=g)
    sample = Sample(
        "a",
        tokens[0].tolist(),
        [0, 1, 1, 1, 1],
        [0.0] * 5,
        temperature=[1.0, 0.5, 0.5, 1.0, 1.0],
        top_k=[0, 0, 0, 3, 0],
        top_p=[1.0, 1.0, 1.0, 1.0, 0.6],
    )
    s = collate([sample], [1.0], dtype=torch.float64, tree=False)
    lp = trainer_logprobs(fixed_logits(logits), s)
    for t in range(1, 5):  # token t is predicted at position t-1 under the settings of token t
        one = sampled_logprobs(
            logits[0, t - 1 : t],
            tokens[0, t : t + 1],
            s["temperature"][0, t : t + 1],
            s["top_k"][0, t : t + 1],
            s["top_p"][0, t : t + 1],
        )
        assert lp[0, t].item() == approx(one.item())
    assert lp[0, 1].item() == approx(torch.log_softmax(logits[0, 0] / 0.5, -1)[tokens[0, 1]].item())
    assert lp.dtype == torch.float64 and lp[0, 0] == 0.0


def mixed_batch(V, dtype=torch.float32):
    """Three rows sharing an 18-token prompt (packed once), 21 trainable tokens under mixed
    temperature / top-k / top-p settings: greedy, top-k, top-p, both, and a top-k past the 1,024 largest."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (18,), generator=g).tolist()
    samples = []
    for i, n in enumerate((7, 5, 9)):
        T = 18 + n
        tokens = prompt + torch.randint(0, V, (n,), generator=g).tolist()
        samples.append(
            Sample(
                f"r{i}",
                tokens,
                [0] * 18 + [1] * n,
                [0.0] * T,
                temperature=([1.0, 0.7, 1.3, 0.0] * T)[i : i + T],
                top_k=([0, 5, 0, min(V - 1, 2000), 3] * T)[i : i + T],
                top_p=([1.0, 1.0, 0.9, 0.95, 0.5] * T)[i : i + T],
            )
        )
    return collate(samples, [1.0] * 3, dtype=dtype)


def logprobs_and_grads(net, f):
    net.zero_grad(set_to_none=True)
    lp = f()
    lp.sum().backward()
    g = torch.cat([p.grad.flatten() for p in net.parameters()])
    net.zero_grad(set_to_none=True)
    return lp.detach(), g


def whole_logprobs(net, b):
    """The computation without chunks: the model's own full logits, every trainable position at once."""
    on = b["loss_mask"][:, 1:] > 0
    logits = net(input_ids=b["tokens"]).logits[:, :-1]
    settings = (b[k][:, 1:][on] for k in ("temperature", "top_k", "top_p"))
    lp = sampled_logprobs(logits[on], b["tokens"][:, 1:][on], *settings)
    return torch.zeros_like(b["loss_mask"]).masked_scatter(b["loss_mask"] > 0, lp)


def test_trainer_logprobs_in_chunks_is_the_whole_computation(model, monkeypatch):
    """The embedded model (its LM head tied to the embeddings), 3 rows a chunk (7 chunks, the last partial): the
    logprobs and gradients of the whole computation. fp32: the head's matmul rounds differently for another number
    of rows (measured: 1e-5 in the logprobs, 7e-5 of the gradient's norm; in fp64 1e-14 and 1e-15)."""
    b = mixed_batch(model.config.vocab_size)
    lp, g = logprobs_and_grads(model, lambda: trainer_logprobs(model, b, chunk=3))
    lp_whole, g_whole = logprobs_and_grads(model, lambda: whole_logprobs(model, b))
    assert (lp - lp_whole).abs().max() <= 1e-4 and (g - g_whole).norm() <= 1e-3 * g_whole.norm()
    # The entropy of each token's distribution, from the same chunks: the whole logits'
    # sampled_entropy, computed once a chunk (the backward's recomputation stops before it), without
    # gradient.
    calls = []
    entropy_of_chunk = algo._entropy
    monkeypatch.setattr(algo, "_entropy", lambda *a: calls.append(1) or entropy_of_chunk(*a))
    lp_h, h = trainer_logprobs_and_entropy(model, b, chunk=3)
    lp_h.sum().backward()
    model.zero_grad(set_to_none=True)
    assert len(calls) == 7 and not h.requires_grad and (lp_h.detach() - lp).abs().max() == 0
    on = b["loss_mask"][:, 1:] > 0
    with torch.no_grad():
        logits = model(input_ids=b["tokens"]).logits[:, :-1]
    settings = (b[k][:, 1:][on] for k in ("temperature", "top_k", "top_p"))
    h_whole = sampled_entropy(logits[on], b["tokens"][:, 1:][on], *settings)
    assert (h[b["loss_mask"] > 0] - h_whole).abs().max() <= 1e-4
    assert (h[b["loss_mask"] == 0] == 0).all() and h_whole.min() >= 0
    assert not hasattr(
        model, "ll_full_logits"
    )  # the chunked head ran: the model returned the hidden states as given


class LargestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most rows of V logits (or their gradients) that one tensor made by any op holds, forward and
    backward; the head's weight, its gradient and their transposes ([V, H] or [H, V]) left out."""

    def __init__(self, net):
        super().__init__()
        self.V, self.H, self.rows = net.config.vocab_size, net.config.hidden_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.V
                and t.numel() != self.V * self.H
            ):
                self.rows = max(self.rows, t.numel() // self.V)
        return out


def test_trainer_logprobs_memory_is_one_chunk_of_logits(model):
    """21 trainable positions, 3 a chunk: no tensor of logits holds more than 3 rows, in forward or in backward
    (the model itself would make [3, 9, V] logits, the head running from the first trainable position)."""
    b = mixed_batch(model.config.vocab_size)
    with LargestLogits(model) as seen:
        logprobs_and_grads(model, lambda: trainer_logprobs(model, b, chunk=3))
    assert seen.rows == 3


def test_trainer_logprobs_of_a_model_that_post_processes_its_logits():
    """A model whose forward changes the head's output (as Gemma2's softcapping or Cohere's logit_scale do) is
    noticed and runs with its own head, to the same numbers; a plain one (tied head) runs the chunked head.
    A tiny random Llama in fp64 (fp32 RMSNorm: the packed prefix sums gradients in another order, as above)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Softcapped(
        LlamaForCausalLM
    ):  # Gemma2's final_logit_softcapping (a scale would pass: W 2h = 2 W h)
        def forward(self, **kw):
            out = super().forward(**kw)
            out.logits = torch.tanh(out.logits / 0.5) * 0.5
            return out

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    b = mixed_batch(50, torch.float64)
    for cls in (LlamaForCausalLM, Softcapped):
        torch.manual_seed(0)
        net = cls(cfg).double()
        lp_whole, g_whole = logprobs_and_grads(net, lambda: whole_logprobs(net, b))
        for _ in range(2):  # the first call notices the post-processing, the second remembers it
            lp, g = logprobs_and_grads(net, lambda: trainer_logprobs(net, b, chunk=3))
            assert (
                torch.allclose(lp, lp_whole, atol=1e-12)
                and (g - g_whole).abs().max() <= 1e-6 * g_whole.abs().max()
            )
        assert getattr(net, "ll_full_logits", False) == (cls is Softcapped)


def test_sampling_support_past_the_1024_largest_logits_is_that_of_a_whole_sort():
    """Rows whose cut lies past the 1,024 largest are redone, alone: on all V (top-p) or on the k largest (top-k
    alone). Near-flat logits, top-k 2,000 then top-p 0.6 keep 1,199 (the top-1,024's mass alone gave 614)."""
    flat = torch.linspace(0, 0.01, 3000)[None]
    assert sampling_support(flat, torch.tensor([2000]), torch.tensor([0.6])).sum().item() == 1199
    x = torch.cat([flat, torch.randn(5, 3000, generator=torch.Generator().manual_seed(0)) * 2])
    k, p = torch.tensor([2000, 2000, 0, 1500, 5, 0]), torch.tensor([0.6, 1.0, 0.999, 0.9, 0.5, 0.3])
    keep = sampling_support(x, k, p)
    assert torch.equal(keep, sampling_support(x, k, p, m=3000))  # m = V: one whole sort
    assert keep.sum(-1).tolist() == [1199, 2000, 2584, 606, 2, 28]
