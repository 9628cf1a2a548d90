"""The rollout-vs-trainer mismatch metrics beyond the mean |dlogp| (docs/algorithms.md), over the
trainable tokens of a step's micro-batches and ranks:

    prob_corr        the Pearson correlation of the rollout's and the trainer's token probabilities
    ratio_min/max    the extremes of the ratio exp(trainer - rollout logprob)
    dlogp_max        the largest |trainer - rollout logprob|
    ratio_out_frac   the fraction of tokens whose ratio leaves [0.9, 1.1]

With the same weights on both sides prob_corr and the ratios are about 1; anything else is a bug to
find first. The core logs the mean ratio and |dlogp| (algo.reduce_metrics); without this file these
keys are null in metrics.jsonl.

Its seam: ``hooks.LOSS_METRICS`` holds ``Mismatch``, which trainer.Learner.backward makes once per
backward pass, gives each micro-batch (``add``) and asks for the metrics (``result``)."""

import math

import torch
import torch.distributed as dist

from .. import hooks
from ..algo import all_reduce


class Mismatch:
    """The sums and extremes of a step's trainable tokens (``add``), then their metrics
    (``result``)."""

    def __init__(self):
        # Sums over the trainable tokens: their count, those whose ratio leaves [0.9, 1.1], and the
        # Pearson correlation's sums of the rollout's (p) and the trainer's (q) probabilities:
        # p, q, p p, q q and p q.
        self.sums = torch.zeros(7, dtype=torch.float64)
        # Extremes of nothing until a token comes.
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.dlogp_max = -math.inf

    @torch.no_grad()
    def add(self, samples, batch, logprobs, entropy):
        """One micro-batch: its algo.collate ``batch`` (the rollout's logprobs and the loss mask,
        [B, T] each) and the trainer's [B, T] ``logprobs``."""
        old_logprobs = batch["old_logprobs"]
        on = batch["loss_mask"] > 0
        if not bool(on.any()):
            return
        dlogp = (logprobs - old_logprobs)[on].double()
        # the ratio as algo.policy_loss clamps it
        ratio = dlogp.clamp(-20, 20).exp()
        p = old_logprobs[on].double().exp()
        q = logprobs[on].double().exp()
        tokens = on.sum().double()
        out = ((ratio < 0.9) | (ratio > 1.1)).sum().double()
        sums = [tokens, out, p.sum(), q.sum(), (p * p).sum(), (q * q).sum(), (p * q).sum()]
        self.sums += torch.stack(sums).cpu()
        self.ratio_min = min(self.ratio_min, float(ratio.min()))
        self.ratio_max = max(self.ratio_max, float(ratio.max()))
        self.dlogp_max = max(self.dlogp_max, float(dlogp.abs().max()))

    def result(self) -> dict[str, float]:
        """The metrics over every rank's micro-batches (collective: a rank without samples calls it
        too). Without a token: the extremes of nothing (inf, -inf) and a nan correlation."""
        n, out, p, q, pp, qq, pq = all_reduce(self.sums.tolist())
        ratio_min = all_reduce([self.ratio_min], dist.ReduceOp.MIN)[0]
        ratio_max, dlogp_max = all_reduce([self.ratio_max, self.dlogp_max], dist.ReduceOp.MAX)
        var = (n * pp - p**2) * (n * qq - q**2)
        prob_corr = math.nan
        if var > 0:
            prob_corr = (n * pq - p * q) / math.sqrt(var)
        return {
            "prob_corr": prob_corr,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "dlogp_max": dlogp_max,
            "ratio_out_frac": out / max(n, 1.0),
        }


hooks.LOSS_METRICS.append(Mismatch)
