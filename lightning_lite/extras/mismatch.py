"""The rollout-vs-trainer mismatch metrics beyond the mean |dlogp| (docs/algorithms.md), over the
trainable tokens of a step's micro-batches and ranks:

    prob_corr        the Pearson correlation of the rollout's and the trainer's token probabilities
    ratio_min/max    the extremes of the ratio exp(trainer - rollout logprob)
    dlogp_max        the largest |trainer - rollout logprob|
    ratio_out_frac   the fraction of tokens whose ratio leaves [0.9, 1.1]

With the same weights on both sides prob_corr is about 1 and the ratios about 1; anything else is a
bug to find before tuning anything. The core logs the loss's own metrics (algo.reduce_metrics: the
mean ratio and |dlogp|); without this file these keys are null in metrics.jsonl.

Its seam: ``hooks.LOSS_METRICS`` holds ``Mismatch``, which trainer.Learner.backward makes once per
backward pass, gives each micro-batch (``add``) and asks for the metrics (``result``)."""

import math

import torch
import torch.distributed as dist

from .. import hooks
from ..algo import all_reduce


class Mismatch:
    """The sums and extremes of a step's trainable tokens, then (``result``) their metrics."""

    def __init__(self):
        # Sums over the trainable tokens: their count, those whose ratio leaves [0.9, 1.1], and the
        # Pearson correlation's sums of the rollout's (p) and the trainer's (q) probabilities.
        self.sums = dict.fromkeys(("tokens", "ratio_out", "p", "q", "pp", "qq", "pq"), 0.0)
        # Extremes of nothing until a token comes.
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.dlogp_max = -math.inf

    @torch.no_grad()
    def add(self, logprobs, old_logprobs, loss_mask):
        """One micro-batch's [B, T] trainer and rollout logprobs, and its loss mask."""
        on = loss_mask > 0
        dlogp = (logprobs - old_logprobs)[on].double()
        if not len(dlogp):
            return
        # the ratio as algo.policy_loss clamps it
        ratio = dlogp.clamp(-20, 20).exp()
        p = old_logprobs[on].double().exp()
        q = logprobs[on].double().exp()
        values = {
            "tokens": on.sum().double(),
            "ratio_out": ((ratio < 0.9) | (ratio > 1.1)).sum().double(),
            "p": p.sum(),
            "q": q.sum(),
            "pp": (p * p).sum(),
            "qq": (q * q).sum(),
            "pq": (p * q).sum(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "dlogp_max": dlogp.abs().max(),
        }
        # one device->host copy
        values = dict(zip(values, torch.stack(list(values.values())).tolist()))
        for key in self.sums:
            self.sums[key] += values[key]
        self.ratio_min = min(self.ratio_min, values["ratio_min"])
        self.ratio_max = max(self.ratio_max, values["ratio_max"])
        self.dlogp_max = max(self.dlogp_max, values["dlogp_max"])

    def result(self) -> dict[str, float]:
        """The metrics over every rank's micro-batches (collective: a rank without samples calls it
        too). Without a token: the extremes of nothing (inf, -inf) and a nan correlation."""
        total = dict(zip(self.sums, all_reduce(list(self.sums.values()))))
        ratio_min = all_reduce([self.ratio_min], dist.ReduceOp.MIN)[0]
        ratio_max, dlogp_max = all_reduce([self.ratio_max, self.dlogp_max], dist.ReduceOp.MAX)
        n = max(total["tokens"], 1.0)
        cov = n * total["pq"] - total["p"] * total["q"]
        var_p = n * total["pp"] - total["p"] ** 2
        var_q = n * total["qq"] - total["q"] ** 2
        prob_corr = math.nan
        if var_p * var_q > 0:
            prob_corr = cov / math.sqrt(var_p * var_q)
        return {
            "prob_corr": prob_corr,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "dlogp_max": dlogp_max,
            "ratio_out_frac": total["ratio_out"] / n,
        }


hooks.LOSS_METRICS.append(Mismatch)
