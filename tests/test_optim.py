"""The optimization knobs take effect with the values the README gives them, on trainer.Learner:
the learning rate's schedule (``lr_at``: linear warmup, then constant or cosine down to 10%) and
the rate AdamW gets, --grad-clip (AdamW is fed the clipped gradient), --weight-decay (AdamW's
decoupled decay: each weight shrinks by lr * wd), and the loss under user-given --clip-low,
--clip-high and --norm-const. train.py's side (its flags reach config.json and metrics.jsonl's
``lr`` column) is test_train.py's ``test_every_loss_norm_and_estimator_trains``.

The model is a 2-layer Llama whose LM head is zero: every logprob is -log(64) (its vocabulary),
so each ratio and loss below is computed by hand."""

import math
import types

import pytest
import torch

from lightning_lite.records import Sample
from lightning_lite.trainer import Learner, TrainConfig

VOCAB = 64
# every token's logprob under the zero LM head: -log(64)
LOGP = -math.log(VOCAB)
BETA1, BETA2 = 0.9, 0.99  # Learner's AdamW betas


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The directory of a 2-layer Llama (vocabulary 64) whose LM head is zero."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    path = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(path)
    return path


def learner(tiny, **flags) -> Learner:
    """A Learner of the tiny model on one CPU process in fp32: train.py's defaults but ``flags``."""
    values = dict(model=tiny, steps=10, lr=1e-3, warmup_steps=0, lr_schedule="constant")
    values |= dict(weight_decay=0.0, grad_clip=1.0, micro_batch_tokens=4096, no_tree=False)
    values |= dict(attn=None, parallel="ddp", activation_checkpointing=None, max_model_len=None)
    values |= dict(keep_checkpoints=2, loss="ppo", clip_low=0.2, clip_high=0.28)
    values |= dict(clip_ratio_c=3.0, tis_cap=2.0, kl_coef=0.0, norm="rollout-mean")
    values |= dict(norm_const=1024, backend="hf", async_steps=0)
    config = TrainConfig(**{**values, **flags})
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    cpu = torch.device("cpu")
    return Learner(config, tok, cpu, torch.float32, 1, True, None, lambda *a: None)


def sample(rid: str, advantage: float, ratios: list[float], version: int = 0) -> Sample:
    """A sample of 5 prompt tokens, then one trained token per ratio, sampled by weights
    ``version`` (the step it trains in: fresh): its rollout logprob is the trainer's (-log 64)
    minus log(ratio), so the trainer's ratio to it is ``ratio``."""
    prompt = 5
    # tokens of its own for each rollout id
    tokens = [(7 * i + sum(map(ord, rid))) % VOCAB for i in range(prompt + len(ratios))]
    mask = [0] * prompt + [1] * len(ratios)
    old = [0.0] * prompt + [LOGP - math.log(r) for r in ratios]
    s = Sample(rid, tokens, mask, old)
    s.advantages = [advantage * m for m in mask]
    s.version = [version] * len(tokens)
    return s


def named(name: str):
    """assert_close's message: the parameter's name, then what differs."""
    return lambda message: f"{name}: {message}"


def test_lr_warms_up_linearly_then_stays_constant(tiny):
    """--lr-schedule constant: lr from the first step without warmup; with --warmup-steps 4,
    lr (k + 1) / 4 at steps k = 0..3, then lr."""
    steps = [0, 1, 2, 3, 4, 5, 9]
    flat = learner(tiny, lr=1e-3, warmup_steps=0)
    assert [flat.lr_at(k) for k in steps] == pytest.approx([1e-3] * 7, rel=1e-12)
    warm = learner(tiny, lr=1e-3, warmup_steps=4)
    expected = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3]
    assert [warm.lr_at(k) for k in steps] == pytest.approx(expected, rel=1e-12)


def test_cosine_schedule_decays_to_a_tenth_after_the_warmup(tiny):
    """--lr-schedule cosine: lr (0.1 + 0.45 (1 + cos(pi d))), d the fraction of the steps after
    the warmup done, and lr / 10 from the last step on."""
    # --warmup-steps 0, 10 steps: d = k / 10. cos(0.9 pi) = -0.9510565: 0.1 + 0.45 * 0.0489435.
    cosine = learner(tiny, lr=1e-3, lr_schedule="cosine", warmup_steps=0, steps=10)
    got = [cosine.lr_at(k) for k in (0, 5, 9, 10, 15)]
    assert got == pytest.approx([1e-3, 5.5e-4, 1.2202457e-4, 1e-4, 1e-4], rel=1e-7)
    # --warmup-steps 4, 12 steps: linear to step 3, then d = (k - 4) / 8. cos(0.75 pi) =
    # -0.7071068: 0.1 + 0.45 * 0.2928932; cos(0.875 pi) = -0.9238795: 0.1 + 0.45 * 0.0761205.
    warm = learner(tiny, lr=1e-3, lr_schedule="cosine", warmup_steps=4, steps=12)
    got = [warm.lr_at(k) for k in (0, 1, 3, 4, 8, 10, 11)]
    expected = [2.5e-4, 5e-4, 1e-3, 1e-3, 5.5e-4, 2.3180195e-4, 1.3425421e-4]
    assert got == pytest.approx(expected, rel=1e-7)


def test_weight_decay_shrinks_every_weight_by_lr_times_wd_at_the_scheduled_lr(tiny):
    """--weight-decay is AdamW's decoupled decay: with no gradient (every advantage 0, so the loss
    is 0 whatever the weights) an update multiplies each weight by 1 - lr * wd, exactly, where lr
    is the schedule's at that step: warmup step 1 of 4, lr 1e-3 * 2 / 4, wd 0.1 -> 0.99995.
    Without decay the same update leaves every weight as it was."""
    zero = [sample("a", 0.0, [1.0, 1.0], version=1), sample("b", 0.0, [1.0, 1.0, 1.0], version=1)]
    for wd, factor in ((0.1, 0.99995), (0.0, 1.0)):
        net = learner(tiny, lr=1e-3, warmup_steps=4, weight_decay=wd)
        before = {n: p.detach().clone() for n, p in net.model.named_parameters()}
        metrics, grad_norm, skipped = net.update(zero, 1, True)
        assert skipped is None and grad_norm == 0.0 and metrics["loss"] == 0.0
        assert net.opt.param_groups[0]["lr"] == pytest.approx(5e-4, rel=1e-12)
        for n, p in net.model.named_parameters():
            expected = before[n] * factor
            torch.testing.assert_close(p.detach(), expected, rtol=1e-7, atol=0, msg=named(n))


def test_grad_clip_feeds_adamw_the_clipped_gradient(tiny):
    """--grad-clip c below the gradient's norm g: the update reports g (before clipping) and AdamW
    is fed the gradient times c / g: after its first step, its moments are (1 - beta1) grad and
    (1 - beta2) grad^2 of the clipped gradient. Adam's first step moves each weight by about lr
    whatever the gradient's scale, so the moments, not the weights, show the clip. The reference
    is the same update with a clip far above the norm, which leaves the gradient as it is."""
    batch = [sample("a", 1.0, [1.0, 1.0, 1.0]), sample("b", -1.0, [1.0, 1.0])]
    free = learner(tiny, grad_clip=1e9)
    _, norm, _ = free.update(batch, 0, True)
    assert norm > 0
    # the raw gradient, from AdamW's first moment: (1 - beta1) grad
    raw = {n: free.opt.state[p]["exp_avg"] / (1 - BETA1) for n, p in free.trained.items()}
    assert norm == pytest.approx(math.sqrt(sum(float((g**2).sum()) for g in raw.values())))
    clip = norm / 8
    clipped = learner(tiny, grad_clip=clip)
    _, reported, _ = clipped.update(batch, 0, True)
    assert reported == pytest.approx(norm, rel=1e-6)
    scale = clip / norm
    for n, p in clipped.trained.items():
        state = clipped.opt.state[p]
        # rtol 1e-4: clip_grad_norm_ divides by the norm + 1e-6
        moment = (1 - BETA1) * raw[n] * scale
        torch.testing.assert_close(state["exp_avg"], moment, rtol=1e-4, atol=1e-12, msg=named(n))
        moment = (1 - BETA2) * (raw[n] * scale) ** 2
        torch.testing.assert_close(state["exp_avg_sq"], moment, rtol=1e-4, atol=1e-15, msg=named(n))


def test_user_clip_range_and_norm_const_set_the_loss(tiny):
    """--loss ppo with --clip-low 0.1 --clip-high 0.05 and --norm seq-mean-token-sum-norm with
    --norm-const 4: tokens of ratio 1.3, 0.7 and 1.08 in a sample of advantage +1 and in one of
    -1. Token loss -min(r A, clip(r, 0.9, 1.05) A): +1 -> -1.05 (clipped), -0.7, -1.05 (clipped);
    -1 -> 1.3, 0.9 (clipped), 1.08. Each sample's weight 1 / (2 samples * 4): loss (-2.8 + 3.28)
    / 8 = 0.06, 3 of 6 tokens clipped. PPO's default clip (0.2, 0.28) gives -1.28 (clipped), -0.7,
    -1.08 and 1.3, 0.8 (clipped), 1.08: (-3.06 + 3.18) / 8 = 0.015, 2 of 6 clipped; and another
    --norm-const another divisor."""
    ratios = [1.3, 0.7, 1.08]
    batch = [sample("up", 1.0, ratios), sample("down", -1.0, ratios)]
    flags = dict(loss="ppo", norm="seq-mean-token-sum-norm", lr=0.0)
    user = learner(tiny, clip_low=0.1, clip_high=0.05, norm_const=4, **flags)
    metrics, _, _ = user.update(batch, 0, True)
    assert metrics["loss"] == pytest.approx(0.06, rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(3 / 6)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 3, rel=1e-5)
    default = learner(tiny, clip_low=0.2, clip_high=0.28, norm_const=4, **flags)
    metrics, _, _ = default.update(batch, 0, True)
    assert metrics["loss"] == pytest.approx(0.015, rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(2 / 6)
    # --norm-const 10: the same token losses over 2 * 10
    wider = learner(tiny, clip_low=0.1, clip_high=0.05, norm_const=10, **flags)
    metrics, _, _ = wider.update(batch, 0, True)
    assert metrics["loss"] == pytest.approx(0.48 / 20, rel=1e-5)


def test_token_counts_sum_the_trained_tokens_by_staleness_and_refuse_a_staler_one():
    """trainer.TokenCounts, the core's hooks.LOSS_METRICS-style object: fwd_tokens, and by staleness
    (update 5 trains tokens of versions 5 and 4) the trained tokens and their mean |dlogp|; a token
    older than the run allows is a bug."""
    from lightning_lite.trainer import TokenCounts

    counts = TokenCounts(version=5, max_age=1, async_steps=1)
    batch = {
        "fwd_tokens": 6,
        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]),
        "version": torch.tensor([[0, 5, 4], [0, 4, 0]]),
        "old_logprobs": torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]]),
    }
    logprobs = torch.tensor([[0.0, -1.5, -1.25], [0.0, -1.0, 0.0]])
    counts.add([], batch, logprobs, None)
    counts.add([], {**batch, "loss_mask": torch.zeros(2, 3)}, logprobs, None)
    assert counts.result() == {
        "fwd_tokens": 12,
        "staleness": {0: 1, 1: 2},
        "dlogp_by_staleness": {0: 0.5, 1: pytest.approx((0.25 + 1.0) / 2)},
    }
    with pytest.raises(RuntimeError, match="sampled 2 updates ago, more than the 1 .*--async 1"):
        TokenCounts(version=6, max_age=1, async_steps=1).add([], batch, logprobs, None)
