"""The trainer-vs-sampler mismatch corrections (algo.correction_weights, algo.rejection_mask,
policy_loss's --ppo-ratio and --rollout-correction): by hand, against TRL 1.16's and verl 0.9's
definitions on the same inputs, and in one train.py step."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

from lightning_lite.algo import (
    correction_problem,
    correction_weights,
    policy_loss,
    reduce_metrics,
    rejection_mask,
)

approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-9)  # noqa: E731


def one_sample(log_ratios, pad=9.0):
    """[1, T + 1]: trainer and sampler logprobs whose log ratios are ``log_ratios``, then a padding
    position (loss mask 0) with a wild one, which nothing may read."""
    sampler = torch.full((1, len(log_ratios) + 1), -1.0, dtype=torch.float64)
    trainer = sampler + torch.tensor([[*log_ratios, pad]], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(log_ratios) + [0.0]], dtype=torch.float64)
    return trainer, sampler, mask


def test_importance_weights_by_hand():
    # log ratios 0.1, 0.5, -0.2: ratios 1.10517, 1.64872, 0.81873; their sum 0.4: exp 1.49182
    lp, old, mask = one_sample([0.1, 0.5, -0.2])
    r = [math.exp(0.1), math.exp(0.5), math.exp(-0.2)]
    seq = math.exp(0.4)
    cases = [
        # (mode, c_min, c_max, weights, outside)
        ("none", 0.0, 1.5, [1, 1, 1], [0, 0, 0]),
        ("token-truncate", 0.0, 1.5, [r[0], 1.5, r[2]], [0, 1, 0]),
        ("token-mask", 0.0, 1.5, [r[0], 0.0, r[2]], [0, 1, 0]),
        ("token-truncate", 0.9, 1.5, [r[0], 1.5, 0.9], [0, 1, 1]),  # TRL clamps below at C_min
        ("token-mask", 0.9, 1.5, [r[0], 0.0, 0.0], [0, 1, 1]),
        ("sequence-truncate", 0.0, 1.5, [seq] * 3, [0] * 3),  # 1.49182 inside
        ("sequence-mask", 0.0, 1.5, [seq] * 3, [0] * 3),
        ("sequence-truncate", 0.0, 1.4, [1.4] * 3, [1] * 3),
        ("sequence-mask", 0.0, 1.4, [0.0] * 3, [1] * 3),
    ]
    for mode, c_min, c_max, weights, outside in cases:
        lp.requires_grad_()
        w, out = correction_weights(lp, old, mask, mode, c_min, c_max)
        assert not w.requires_grad, mode  # detached: it changes the measure, not the objective
        assert w[0].tolist() == approx([*weights, 0.0]), mode  # 0 on the padding
        assert out[0].tolist() == [*map(bool, outside), False], mode


def test_rejection_bands_by_hand():
    lp, old, mask = one_sample([0.1, 0.5, -0.2])
    assert rejection_mask(lp, old, mask)[0].tolist() == [True, True, True, False]  # no band
    # token band (0.5, 1.5): 1.64872 is out
    assert rejection_mask(lp, old, mask, (0.5, 1.5))[0].tolist() == [True, False, True, False]
    # the geometric mean exp(0.4 / 3) = 1.14263: out of (0.99, 1.01), in (0.5, 2); padding never in
    tight = rejection_mask(lp, old, mask, seq_mean_band=(0.99, 1.01))
    assert tight[0].tolist() == [False] * 4
    assert rejection_mask(lp, old, mask, seq_mean_band=(0.5, 2))[0].tolist() == [1, 1, 1, 0]
    # both: a token out of its band leaves the others of a sample inside its mean band
    both = rejection_mask(lp, old, mask, (0.5, 1.5), (0.5, 2))
    assert both[0].tolist() == [True, False, True, False]


# The same inputs for ours and the peers': two samples, the first with a padded position whose
# logprobs are wild. Log ratios (trainer - sampler): [0.1, 0.5, -0.2, pad], [-0.05, 0.02, 1.2, -0.9].
TRAINER = torch.tensor([[-1.0, -0.7, -2.2, 5.0], [-0.35, -1.48, -0.3, -2.1]], dtype=torch.float64)
SAMPLER = torch.tensor([[-1.1, -1.2, -2.0, -4.0], [-0.3, -1.5, -1.5, -1.2]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)


def trl_importance_ratio(trainer, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions (the
    block under "Compute the importance sampling ratio when using vLLM", lines 2660-2706 of the
    wheel), as read: per-token diff (trainer's old_per_token_logps - sampling_per_token_logps) *
    mask; sequence_* modes sum it over the sequence ([B, 1]); exp; *_truncate clamps to
    [clip_min, clip_max], *_mask sets ratios outside [clip_min, clip_max] to 0 (None: unbounded)."""
    diff = (trainer - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max).expand_as(mask)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0).expand_as(mask)


def verl_is_weights(trainer, sampler, mask, level, threshold):
    """verl 0.9.0, verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights as
    compute_rollout_correction_and_rejection_mask calls it (log_ratio = old_log_prob -
    rollout_log_prob), as read: "token" exp(clamp(log_ratio, -20, 20)); "sequence"
    exp(clamp(masked sum, -20, 20)) broadcast; times the mask; a float threshold clamps above
    (TIS), "lower_upper" zeroes weights outside [lower, upper] (IcePop)."""
    log_ratio = trainer - sampler
    if level == "token":
        raw = log_ratio.clamp(-20, 20).exp()
    else:
        raw = (log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20).exp().expand_as(mask)
    raw = raw * mask
    if not isinstance(threshold, str):
        return raw.clamp(max=threshold)
    lower, upper = (float(x) for x in threshold.split("_"))
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def verl_rejection(trainer, sampler, mask, option, threshold):
    """verl 0.9.0, rollout_corr_helper.py, compute_rollout_rejection_mask, as read: token_k1 =
    -clamp(log_ratio, -20, 20); token_k1 keeps a token with log(lower) <= k1 <= log(upper);
    seq_mean_k1 keeps a sequence whose masked mean of k1 (sum / (count + 1e-8)) is in that range;
    the returned mask is response_mask * keep."""
    k1 = -(trainer - sampler).clamp(-20, 20)
    lower, upper = (math.log(float(x)) for x in threshold.split("_"))
    stat = k1
    if option == "seq_mean_k1":
        stat = ((k1 * mask).sum(-1) / (mask.sum(-1) + 1e-8))[:, None]
    return mask * ((stat >= lower) & (stat <= upper))


def skyrl_geometric_mask(trainer, sampler, mask, low, high):
    """SkyRL (NovaSky-AI/SkyRL), skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py,
    compute_sequence_mask with sequence_mask_metric "geometric", as read: exp of the sequence's
    masked sum of log ratios over its token count (at least 1); kept when within [low, high]."""
    count = mask.sum(-1, keepdim=True).clamp(min=1.0)
    geo = torch.exp(((trainer - sampler) * mask).sum(-1, keepdim=True) / count)
    return (~(geo > high) & ~(geo < low)).expand_as(mask)


@pytest.mark.parametrize(
    "mode, c_min, c_max",
    [
        ("token-truncate", None, 1.5),
        ("token-truncate", 0.9, 1.5),
        ("token-mask", None, 1.5),
        ("token-mask", 0.9, 1.5),
        ("sequence-truncate", None, 1.4),  # sample 0: exp(0.4) = 1.49 truncated
        ("sequence-mask", None, 1.4),  # sample 0 masked, sample 1: exp(0.27) = 1.31 kept
        ("sequence-mask", 1.35, 3.0),  # TRL's default C_max 3; a C_min that drops sample 1
    ],
)
def test_weights_equal_trls_and_verls_on_the_same_inputs(mode, c_min, c_max):
    ours, _ = correction_weights(TRAINER, SAMPLER, MASK, mode, c_min or 0.0, c_max)
    on = MASK > 0
    trl = trl_importance_ratio(TRAINER, SAMPLER, MASK, mode.replace("-", "_"), c_min, c_max)
    assert ours[on].tolist() == approx(trl[on].tolist())
    # verl's rollout_is: a float threshold is our *-truncate from 0; "lower_upper" our *-mask
    level = mode.split("-")[0]
    if mode.endswith("truncate") and c_min is None:
        verl = verl_is_weights(TRAINER, SAMPLER, MASK, level, c_max)
        torch.testing.assert_close(ours, verl)
    if mode.endswith("mask") and c_min is not None:
        verl = verl_is_weights(TRAINER, SAMPLER, MASK, level, f"{c_min}_{c_max}")
        torch.testing.assert_close(ours, verl)


@pytest.mark.parametrize("low, high", [(0.5, 2.0), (0.8, 1.2), (0.99, 1.01), (0.95, 1.3)])
def test_bands_equal_verls_and_skyrls_on_the_same_inputs(low, high):
    # verl bounds k1 = -log r: our band (LOW, HIGH) on r is its "1/HIGH_1/LOW"
    spec = f"{1 / high!r}_{1 / low!r}"
    token = rejection_mask(TRAINER, SAMPLER, MASK, (low, high))
    assert (
        token.double().tolist() == verl_rejection(TRAINER, SAMPLER, MASK, "token_k1", spec).tolist()
    )
    seq = rejection_mask(TRAINER, SAMPLER, MASK, seq_mean_band=(low, high))
    verl = verl_rejection(TRAINER, SAMPLER, MASK, "seq_mean_k1", spec)
    assert seq.double().tolist() == verl.tolist()
    skyrl = skyrl_geometric_mask(TRAINER, SAMPLER, MASK, low, high) & (MASK > 0)
    assert seq.tolist() == skyrl.tolist()
    # the inputs test something: (0.8, 1.2) drops tokens 0.5 and 1.2 and -0.9, keeps the rest
    if (low, high) == (0.8, 1.2):
        assert token.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def two_rows(ratios, advs):
    """Two samples of 3 trainable tokens, sampler logprob log(0.5), trainer log(0.5 * ratio)."""
    old = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    new = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()
    return new, old, torch.tensor(advs, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)


def test_decoupled_ppo_with_token_truncate_is_tis():
    """--loss ppo --ppo-ratio trainer --rollout-correction token-truncate --correction-max 2: r = 1
    in value, so each token's loss is -w A with w = min(r_sampler, 2), and its gradient -w A is
    --loss tis --tis-cap 2's. Sampler ratios 0.5 1 3 (A = 2), 1 1 1 (A = 0): w = 0.5 1 2."""
    new, old, adv, mask = two_rows([[0.5, 1.0, 3.0], [1.0, 1.0, 1.0]], [2.0, 0.0])
    one = torch.ones(2, dtype=torch.float64)
    options = dict(ppo_ratio="trainer", rollout_correction="token-truncate", correction_max=2.0)
    loss, m = policy_loss(new, old, adv, mask, one, "ppo", **options)
    assert loss.item() == approx(-2 * (0.5 + 1 + 2))
    loss.backward()
    decoupled = new.grad.clone()
    new.grad = None
    tis, _ = policy_loss(new, old, adv, mask, one, "tis", tis_cap=2.0)
    tis.backward()
    torch.testing.assert_close(decoupled, new.grad)
    assert decoupled[0].tolist() == approx([-1.0, -2.0, -4.0])
    r = reduce_metrics([m])
    # nothing clipped (the trainer's ratio is 1); the ratio reported is still the sampler's
    assert r["clip_frac"] == 0.0 and r["ratio_mean"] == approx((0.5 + 1 + 3 + 3) / 6)
    assert r["is_weight_mean"] == approx((0.5 + 1 + 2 + 3) / 6)
    assert (r["is_truncated_frac"], r["is_truncated_seq_frac"]) == (approx(1 / 6), approx(1 / 2))
    assert (r["masked_frac"], r["masked_seq_frac"]) == (0.0, 0.0)


def test_masked_weights_and_bands_take_tokens_out_of_the_loss():
    # sampler ratios 0.5 1 3 and 1 1 1, A = 1 each; weights 1 per sample
    new, old, adv, mask = two_rows([[0.5, 1.0, 3.0], [1.0, 1.0, 1.0]], [1.0, 1.0])
    one = torch.ones(2, dtype=torch.float64)
    # PPO against the sampler, token band (0.6, 2.5): 0.5 and 3 out; left -min(1, 1) x 4 tokens
    loss, m = policy_loss(new, old, adv, mask, one, "ppo", reject_token=(0.6, 2.5))
    assert loss.item() == approx(-4.0)
    loss.backward()
    assert new.grad.tolist() == [approx([0.0, -1.0, 0.0]), approx([-1.0] * 3)]
    r = reduce_metrics([m])
    assert (r["masked_frac"], r["masked_seq_frac"]) == (approx(2 / 6), approx(1 / 2))
    # geometric band (0.99, 1.01): sample 0's (0.5 * 1 * 3) ** (1/3) = 1.1447 is out, all of it
    _, m = policy_loss(new, old, adv, mask, one, "ppo", reject_seq_mean=(0.99, 1.01))
    r = reduce_metrics([m])
    assert (r["masked_frac"], r["masked_seq_frac"]) == (approx(3 / 6), approx(1 / 2))
    # decoupled, sequence-mask at C_max 1.4: sample 0's product 1.5 is out; sample 1's 1 weighs 1
    new.grad = None
    options = dict(ppo_ratio="trainer", rollout_correction="sequence-mask", correction_max=1.4)
    loss, m = policy_loss(new, old, adv, mask, one, "ppo", **options)
    assert loss.item() == approx(-3.0)
    loss.backward()
    assert new.grad.tolist() == [[0.0] * 3, approx([-1.0] * 3)]
    r = reduce_metrics([m])
    assert (r["masked_frac"], r["masked_seq_frac"], r["is_weight_mean"]) == (0.5, 0.5, 0.5)


def test_off_is_the_plain_loss_to_the_bit():
    # every correction off, spelled out or left to its default: the same loss and gradient bits
    new, old, adv, mask = two_rows([[0.5, 1.0, 3.0], [0.9, 1.1, 1.3]], [1.0, -0.5])
    w = torch.tensor([0.25, 0.125], dtype=torch.float64)
    for loss in ("ppo", "gspo", "tis", "sft"):
        new.grad = None
        default, m = policy_loss(new, old, adv, mask, w, loss)
        default.backward()
        grad = new.grad.clone()
        new.grad = None
        off = dict(rollout_correction="none", reject_token=None, ppo_ratio="sampler")
        spelled, _ = policy_loss(new, old, adv, mask, w, loss, **off)
        spelled.backward()
        assert (spelled.item(), new.grad.tolist()) == (default.item(), grad.tolist()), loss
        r = reduce_metrics([m])
        assert (r["is_weight_mean"], r["masked_frac"], r["is_truncated_frac"]) == (1.0, 0, 0)


def test_bad_corrections_are_refused_saying_what_to_change():
    assert correction_problem("ppo") is None
    assert correction_problem("ppo", "sequence-mask", ppo_ratio="trainer") is None
    assert correction_problem("gspo", reject_token=(0.5, 5.0), reject_seq_mean=(0.99, 1.01)) is None
    refused = [
        (("ppo", "token-mask", 2.0, 1.0, None, None, "trainer"), "--correction-min 2.0"),
        (("ppo", "token-mask", 0.0, 0.0, None, None, "trainer"), "C_max > 0"),
        (("ppo", "none", 0.0, 3.0, (2.0, 1.0)), "--reject-token 2.0 1.0"),
        (("ppo", "none", 0.0, 3.0, None, (0.0, 1.01)), "--reject-seq-mean 0.0 1.01"),
        (("ppo", "token-truncate"), "add --ppo-ratio trainer"),
        (("gspo", "sequence-mask"), "count the mismatch twice"),
        (("tis", "token-mask", 0.0, 3.0, None, None, "trainer"), "--loss ppo --ppo-ratio trainer"),
        (("sft", "none", 0.0, 3.0, (0.5, 2.0)), "--loss sft takes no ratio"),
        (("ppo", "token-clip"), "--rollout-correction must be one of"),
    ]
    for args, message in refused:
        problem = correction_problem(*args)
        assert problem is not None and message in problem, (args, problem)
    new, old, adv, mask = two_rows([[1.0] * 3] * 2, [1.0, 1.0])
    with pytest.raises(ValueError, match="add --ppo-ratio trainer"):
        policy_loss(new, old, adv, mask, adv, "ppo", rollout_correction="token-mask")


def train(args, timeout=300):
    p = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout + p.stderr


def test_train_py_refuses_bad_corrections_at_start(tmp_path):
    # before any model loads: C_min > C_max, and a ratio correction on --from-calls sft (recorded
    # calls without sampler logprobs are read only under sft, their logprobs then 0)
    code, log = train(
        ["--rollout-correction", "token-mask", "--ppo-ratio", "trainer", "--correction-min", "4"]
        + ["--out", str(tmp_path / "a")]
    )
    assert code != 0 and "--correction-min 4.0 and --correction-max 3.0" in log, log[-2000:]
    code, log = train(
        ["--from-calls", str(tmp_path), "--loss", "sft", "--reject-token", "0.5", "2"]
        + ["--out", str(tmp_path / "b")]
    )
    assert code != 0 and "--loss sft takes no ratio to the sampler" in log, log[-2000:]
    assert not os.path.exists(tmp_path / "b" / "metrics.jsonl")


@pytest.mark.slow  # one train.py step on the embedded model: ~40 s here
def test_one_step_with_corrections_logs_what_they_did(tmp_path):
    out = tmp_path / "run"
    harness = os.path.join(ROOT, "tests", "harnesses.py") + ":LengthHarness"
    corrections = ["--ppo-ratio", "trainer", "--rollout-correction", "sequence-mask"]
    corrections += ["--reject-token", "0.5", "2", "--reject-seq-mean", "0.99", "1.01"]
    code, log = train(
        ["--harness", harness, "--steps", "1", "--batch-size", "2", "--group-size", "3"]
        + ["--eval-tasks", "0", "--out", str(out)]
        + corrections
    )
    assert code == 0, log[-3000:]
    (row,) = [json.loads(line) for line in open(out / "metrics.jsonl") if '"reward"' in line]
    keys = ("is_truncated_frac", "is_truncated_seq_frac", "masked_frac", "masked_seq_frac")
    assert all(0.0 <= row[k] <= 1.0 for k in keys), row
    # the same weights on both sides (fp32): the weights are 1 to the sampler's noise, and the
    # trainer's own ratio clips nothing
    assert row["is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and row["clip_frac"] == 0.0
    config = json.load(open(out / "config.json"))
    assert (config["rollout_correction"], config["reject_seq_mean"]) == (
        "sequence-mask",
        [0.99, 1.01],
    )


def test_the_live_pages_token_records_hold_each_tokens_correction(tmp_path, monkeypatch):
    """extras/recorder.py writes what the corrections multiplied each trained token's policy term
    by (the live page's token tooltip shows it): log ratios 0.1 0.5 -0.2, token-mask at C_max 1.5
    gives 1.10517 0 0.81873, and the band (0.85, 2) then drops 0.81873."""
    from lightning_lite import algo
    from lightning_lite.extras import recorder
    from lightning_lite.records import Sample

    monkeypatch.setattr(recorder.RUN, "out", str(tmp_path))
    monkeypatch.setattr(recorder.RUN, "begun", set())
    s = Sample("r0", [1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], calls=[0])
    s.temperature, s.top_k, s.top_p = [1.0] * 4, [0] * 4, [1.0] * 4
    s.version, s.call, s.advantages = [0] * 4, [-1, 0, 0, 0], [0.0, 1.0, 1.0, 1.0]
    batch = algo.collate([s], [1.0])
    logprobs = batch["old_logprobs"] + torch.tensor([[0.0, 0.1, 0.5, -0.2]])
    options = dict(loss="ppo", clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, tis_cap=2.0)
    options |= dict(ppo_ratio="trainer", rollout_correction="token-mask", correction_max=1.5)
    for band, expected in ((None, [1.105171, 0.0, 0.818731]), ((0.85, 2.0), [1.105171, 0, 0])):
        rec = recorder.TokenRecorder(0, {**options, "reject_token": band})
        rec.add([s], batch, logprobs, torch.zeros_like(logprobs))
        rec.close()
        (line,) = [json.loads(x) for x in open(tmp_path / "tokens" / "step_0.jsonl")][-1:]
        assert line["correction"] == pytest.approx(expected, abs=2e-6)
