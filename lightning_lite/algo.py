"""Advantages and the policy-gradient loss, exact under DDP and gradient accumulation. The loss is a
sum of ``weight * token_loss``, with weights from counts over the whole global batch
(``global_denominators``): no micro-batch and no rank divides by a count of its own. A rank without
samples must still call the collectives and backward a zero loss, or the others wait. train.py's
step follows the order of this file. Besides torch it imports only records.py (and transformers'
registry of attention masks, to tell which attentions take a mask).

What the algorithm is (the default path: --adv grpo, --norm rollout-mean, --loss ppo; each other
choice is a line or a branch):

    compute_advantages, gather_rewards    rewards -> one advantage per rollout, or per call
    assign_advantages                     -> one advantage per trainable token
    global_denominators, sample_weights   each sample's weight: the loss normalization
    policy_loss, clip_range               the loss of a micro-batch, and its metrics as sums
    token_loss                            its first step: each token's loss, ratio and clip
    reduce_metrics                        the metrics of the step, over micro-batches and ranks

How the model is run, exactly as it sampled (the trainer's logprobs are the sampler's):

    pack, collate                         samples -> one row, a prefix tree (shared prefixes once)
    tree_unsupported, tree_mask           the attention mask of that tree
    sampling_support, sampled_logprobs    logprobs under the top-k / top-p distribution sampled
    sampled_entropy                       the entropy of that distribution
    trainer_logprobs(_and_entropy)        the forward: the LM head only where a token is trained
"""

import math
from collections import Counter, defaultdict
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .records import Sample, common_prefix

# grpo-step and returns give each call its own advantage (from call_rewards), the others one per
# rollout.
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce", "grpo-step", "returns")
LOSSES = ("ppo", "gspo", "tis", "sft")
# The one place for the default (clip_low, clip_high) of each clipped loss (clip_range); GSPO's is
# its paper's (a sequence ratio moves far less than a token's).
CLIP = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
# --rollout-correction: the importance weight of the trainer's probability over the sampler's, per
# token or per sample, truncated or masked (TRL's vllm_importance_sampling_mode, verl's rollout_is).
CORRECTIONS = ("none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")
# --ppo-ratio: what PPO's ratio, and so its clip (the trust region), is taken against.
PPO_RATIOS = ("sampler", "trainer")
NORMS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "rollout-mean",
)
# A rollout's advantage: one number (grpo, dr_grpo, rloo, reinforce), or {call index: number} for a
# per-call estimator (grpo-step, returns); assign_advantages turns either into one advantage per
# token.
Advantage = Union[float, dict[int, float]]


# ----------------------------------------------------------------------------- advantages


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


# With n-1, as GRPO; 0 for fewer than 2.
def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def imitation_advantages(rewards: dict, min_reward: Optional[float] = None) -> dict:
    """--loss sft: an advantage of 1 for each rollout to imitate, every finished one, or with
    ``min_reward`` those rewarded at least that.

    >>> imitation_advantages({"a": 1.0, "b": 0.2, "c": None}, min_reward=0.5)
    {'a': 1.0}
    """
    kept = {}
    for rollout_id, reward in rewards.items():
        if min_reward is None or (reward is not None and reward >= min_reward):
            kept[rollout_id] = 1.0
    return kept


def compute_advantages(
    rewards: dict[str, Optional[float]],
    groups: dict[str, str],
    estimator: str = "grpo",
    eps: float = 1e-6,
    drop_zero_variance: bool = False,
    call_rewards: Optional[dict] = None,
    calls: Optional[dict] = None,
    gamma: float = 1.0,
) -> tuple[dict[str, Advantage], dict]:
    """One advantage per rollout, or per call; returns ({rollout_id: advantage, or {call index:
    advantage}}, stats).

    ``rewards[rid] is None`` marks a failed rollout: left out before any statistic and missing from
    the result (not trained). A group is the rollouts of one task (``groups[rid]``). For rewards
    [1, 0, 0]:

        grpo       (r - mean) / (std + eps), std with n-1: mean 1/3, std 0.577
                                                          -> [1.155, -0.577, -0.577]
        dr_grpo    r - mean                               -> [0.667, -0.333, -0.333]
        rloo       r - mean of the others = n/(n-1) (r - mean)  -> [1, -0.5, -0.5]
        reinforce  r - mean over the whole batch (all groups)

    Per call (``call_rewards[rid]``: {call index: reward}; ``calls[rid]``: the rollout's answered
    call indices), each call's advantage reaches exactly the tokens it sampled
    (``assign_advantages``):

        grpo-step  grpo of the rollout rewards + (r_k - m) / (s + eps), m and s (n-1) over every
                   call reward of the group (0 for a call without one, or fewer than two, all
                   equal). Rewards [1, 0], calls rewarded {0: 1} and {0: 0, 1: 0}: m 1/3, s 0.577
                   -> {0: 0.707 + 1.155} and {0: -0.707 - 0.577, 1: -1.284}
        returns    G_k = r_k + gamma G_k+1 over the rollout's calls in index order, its reward
                   added to the last call's; A_k = G_k - the group's mean G_0 (a rollout's whole
                   return). gamma 0.5, rewards [1, 0], {0: 0.2} and {}, two calls each:
                   G {0: 0.7, 1: 1} and {0: 0, 1: 0} -> {0: 0.35, 1: 0.65} and {0: -0.35, 1: -0.35}.
                   With gamma 1 and no call rewards it is dr_grpo.

    A group whose rewards (and call rewards) are all equal (one rollout too) gets 0 from a group
    baseline, and reinforce r - batch mean; it is counted, and ``drop_zero_variance`` drops it
    unless it has one rollout (docs/algorithms.md: the table). Under DDP pass all ranks' rewards
    (``gather_rewards``): the batch mean is global.
    """
    # 1. the rollouts that did not fail, each in its group
    ok = _checked_rewards(rewards, groups, estimator, calls)
    call_rewards = call_rewards or {}
    per_call = estimator in ("grpo-step", "returns")
    by_group: dict[str, list[str]] = defaultdict(list)
    for rid in ok:
        by_group[groups[rid]].append(rid)
    batch_mean = _mean(list(ok.values())) if ok else 0.0
    stats = Counter(rollouts=len(ok), failed=len(rewards) - len(ok), groups=len(by_group))
    stats.update(zero_variance_groups=0, singleton_groups=0, dropped_rollouts=0)
    # 2. each group on its own: count it, maybe drop it, then its rollouts' advantages
    advantages = {}
    for rids in by_group.values():
        r = [ok[rid] for rid in rids]
        group_calls = {rid: call_rewards.get(rid, {}) for rid in rids}
        step_rewards = [x for rid in rids for x in group_calls[rid].values()] if per_call else []
        flat = max(r) == min(r) and max(step_rewards, default=0) == min(step_rewards, default=0)
        stats["zero_variance_groups"] += flat
        stats["singleton_groups"] += len(r) == 1
        if flat and drop_zero_variance and len(r) > 1:
            stats["dropped_rollouts"] += len(r)
            continue
        if estimator == "returns":
            group_adv = _returns(r, rids, calls, group_calls, gamma)
        else:
            group_adv = _group_advantages(r, estimator, batch_mean, eps)
        if estimator == "grpo-step":
            group_adv = _plus_call_rewards(group_adv, rids, calls, group_calls, step_rewards, eps)
        advantages.update(zip(rids, group_adv))
    stats["reward_mean"] = batch_mean
    return advantages, dict(stats)


# The rewards of the rollouts that did not fail, after checking the arguments.
def _checked_rewards(rewards, groups, estimator, calls) -> dict[str, float]:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; pick one of {ESTIMATORS}")
    if estimator in ("grpo-step", "returns") and calls is None:
        raise ValueError(
            f"{estimator} gives each call an advantage: pass calls, each rollout's answered call "
            "indices"
        )
    ok = {rid: float(r) for rid, r in rewards.items() if r is not None}
    if bad := [rid for rid, r in ok.items() if not math.isfinite(r)]:
        raise ValueError(
            f"non-finite reward for rollouts {bad[:5]}; report a failed rollout as None instead"
        )
    if missing := [rid for rid in ok if rid not in groups]:
        raise ValueError(f"rollouts {missing[:5]} have no group (task id) in `groups`")
    return ok


# One advantage per rollout of a group with rewards ``r`` (the table of ``compute_advantages``).
def _group_advantages(r: list[float], estimator: str, batch_mean: float, eps: float) -> list[float]:
    n, mean = len(r), _mean(r)
    if estimator == "reinforce":
        return [x - batch_mean for x in r]
    if max(r) == min(r):
        return [0.0] * n
    if estimator == "dr_grpo":
        return [x - mean for x in r]
    if estimator == "rloo":
        return [x - (sum(r) - x) / (n - 1) for x in r]
    # grpo, grpo-step
    return [(x - mean) / (_std(r) + eps) for x in r]


# grpo-step: each call's advantage is its rollout's + its own reward normalized over every call
# reward of the group (``step_rewards``); 0 for a call without one.
def _plus_call_rewards(adv, rids, calls, call_rewards, step_rewards, eps) -> list[dict[int, float]]:
    m, s = _mean(step_rewards), _std(step_rewards)

    def own(rid, k):
        return (call_rewards[rid][k] - m) / (s + eps) if s > 0 and k in call_rewards[rid] else 0.0

    return [{k: a + own(rid, k) for k in calls.get(rid, ())} for rid, a in zip(rids, adv)]


# returns: each call's return G_k minus the group's mean whole return (G_0); a rollout's reward is
# added to its last call's.
def _returns(r, rids, calls, call_rewards, gamma) -> list[dict[int, float]]:
    returns = []
    for reward, rid in zip(r, rids):
        ks = sorted(calls.get(rid, ()))
        g = 0.0
        ret = {}
        for k in reversed(ks):
            g = call_rewards[rid].get(k, 0.0) + (reward if k == ks[-1] else 0.0) + gamma * g
            ret[k] = g
        returns.append(ret)
    baseline = sum(ret[min(ret)] if ret else 0.0 for ret in returns) / len(r)
    return [{k: g - baseline for k, g in ret.items()} for ret in returns]


def gather_rewards(*dicts: dict) -> tuple[dict, ...]:
    """The union of every rank's ``dicts`` (rewards, groups, ...), each on its own (unchanged
    without torch.distributed). Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return dicts
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, dicts)
    return tuple({k: v for rank in out for k, v in rank[i].items()} for i in range(len(dicts)))


def assign_advantages(samples: list[Sample], advantages: dict[str, Advantage]) -> list[Sample]:
    """Set each sample's per-token ``advantages``: its rollout's advantage, or (``advantages[rid]``
    a dict, a per-call estimator) that of the call that sampled the token, whichever sample holds
    it; drop samples without one (failed, zero-variance dropped). A sample [p p a a p b] (mask 0 0 1
    1 0 1, calls a: 0, b: 1) under {0: 0.5, 1: -1} gets [0 0 0.5 0.5 0 -1]."""
    kept = [s for s in samples if s.rollout_id in advantages]
    for s in kept:
        adv = advantages[s.rollout_id]
        if not isinstance(adv, dict):
            s.advantages = [adv if m else 0.0 for m in s.loss_mask]
            continue
        if len(s.call) != len(s.tokens):
            raise ValueError(
                f"sample of rollout {s.rollout_id!r} has no per-token call (Sample.call, which "
                "samples.build_samples sets): a per-call advantage cannot find its tokens"
            )
        s.advantages = [adv[c] if m else 0.0 for c, m in zip(s.call, s.loss_mask)]
    return kept


# ----------------------------------------------------------------------------- normalization


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few floats over ranks (unchanged without torch.distributed). Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    # NCCL only reduces CUDA tensors; gloo takes CPU ones.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def global_denominators(samples: list[Sample]) -> dict:
    """Over the global batch (every rank calls it, with its own samples: a collective): ``tokens``,
    the trainable tokens; ``samples`` and ``rollouts``, those with one or more. A rollout's samples
    must all be on one rank."""
    n = [sum(s.loss_mask) for s in samples]
    rollouts = {s.rollout_id for s, k in zip(samples, n) if k > 0}
    tokens, nseq, nroll = all_reduce([sum(n), sum(k > 0 for k in n), len(rollouts)])
    return {"tokens": int(tokens), "samples": int(nseq), "rollouts": int(nroll)}


def sample_weights(samples: list[Sample], norm: str, denoms: dict, norm_const=None) -> list[float]:
    """Each sample's weight per trainable token: the loss is the sum of ``weight * token_loss``
    (docs/algorithms.md: the normalization table). N_* from ``global_denominators``; n_s and n_r
    are a sample's and its rollout's trainable tokens:

        token-mean 1/N_tokens   seq-mean-token-mean 1/(N_samples n_s)
        seq-mean-token-sum 1/N_samples   seq-mean-token-sum-norm 1/(N_samples C)
        rollout-mean 1/(N_rollouts n_r)

    C is ``norm_const``, a fixed token budget (Dr. GRPO's generation budget; a batch-dependent one
    brings a length bias).
    """
    if norm not in NORMS:
        raise ValueError(f"unknown loss normalization {norm!r}; pick one of {NORMS}")
    if norm == "seq-mean-token-sum-norm" and not (norm_const and norm_const > 0):
        raise ValueError(
            "seq-mean-token-sum-norm needs norm_const > 0: a fixed token budget such as the most "
            "tokens a rollout may generate"
        )
    n = [sum(s.loss_mask) for s in samples]
    per_rollout: Counter = Counter()
    for s, k in zip(samples, n):
        per_rollout[s.rollout_id] += k
    # the table above, one line per mode
    divisor = {
        "token-mean": lambda s, k: denoms["tokens"],
        "seq-mean-token-mean": lambda s, k: denoms["samples"] * k,
        "seq-mean-token-sum": lambda s, k: denoms["samples"],
        "seq-mean-token-sum-norm": lambda s, k: denoms["samples"] * norm_const,
        "rollout-mean": lambda s, k: denoms["rollouts"] * per_rollout[s.rollout_id],
    }[norm]
    return [1.0 / divisor(s, k) if k else 0.0 for s, k in zip(samples, n)]


# ----------------------------------------------------------------------------- the exact forward


def pack(seqs: list[list[int]]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Lay token sequences out as one prefix tree, each distinct prefix once, depth first: returns
    (tokens, depth, end, where). ``where[i][t]`` is the packed index of ``seqs[i][t]``; ``depth``
    its position in its own sequence (the position id); ``end[j]`` one past the last index below j,
    so j is an ancestor of q, or q, exactly when ``j <= q < end[j]`` (the attention mask). Sorted
    sequences are laid out depth first by appending each one's tokens after its longest common
    prefix with the one before.

    >>> pack([[1, 2, 3], [5], [1, 2, 4]])
    ([1, 2, 3, 4, 5], [0, 1, 2, 2, 0], [4, 4, 3, 4, 5], [[0, 1, 2], [4], [0, 1, 3]])
    """
    # The packed row: each token, its depth, and one past the last index below it.
    tokens, depth, end = [], [], []
    # where[i]: the packed index of each token of seqs[i].
    where = [[]] * len(seqs)
    # The sequence laid out before this one (in sorted order).
    prev = None
    for i in sorted(range(len(seqs)), key=lambda i: seqs[i]):
        path = []
        if prev is not None:
            path = where[prev][: common_prefix(seqs[prev], seqs[i])]
        for t in seqs[i][len(path) :]:
            path.append(len(tokens))
            tokens.append(t)
            depth.append(len(path) - 1)
            end.append(0)
        # The sequences after this one that share j come later: the last one sets end[j].
        for j in path:
            end[j] = path[-1] + 1
        where[i] = path
        prev = i
    return tokens, depth, end, where


def collate(
    samples: list[Sample],
    weights: list[float],
    device=None,
    dtype=torch.float32,
    pad_id: int = 0,
    tree: bool = True,
    pad_to: int = 1,
) -> dict:
    """One micro-batch as tensors: the samples right-padded to [B, T] (``weights``: [B]), and what
    the model runs, ``input_ids`` [R, L]: with ``tree`` the samples ``pack``ed into one row
    (``depth`` [1, L], ``end`` [L]; padded to a multiple of ``pad_to`` with tokens that see only
    themselves), else the [B, T] rows themselves. ``where`` [B, T] is the flat index into
    ``input_ids`` of each sample position; ``fwd_tokens`` the real tokens run."""
    B, T = len(samples), max(len(s.tokens) for s in samples)

    def padded(values, fill, type_=dtype):  # [B, T]
        lists = [list(x) + [fill] * (T - len(x)) for x in values]
        return torch.tensor(lists, dtype=type_, device=device)

    b = {
        "tokens": padded([s.tokens for s in samples], pad_id, torch.long),
        "loss_mask": padded([s.loss_mask for s in samples], 0),
        "old_logprobs": padded([s.logprobs for s in samples], 0.0),
        "temperature": padded([s.temperature for s in samples], 1.0),
        "top_k": padded([s.top_k for s in samples], 0, torch.long),
        "top_p": padded([s.top_p for s in samples], 1.0),
        "version": padded([s.version or [0] * len(s.tokens) for s in samples], 0, torch.long),
        "advantages": padded([s.advantages for s in samples], 0.0),
        # [B]
        "weights": torch.tensor(weights, dtype=dtype, device=device),
    }
    # Without tree the model runs the padded rows themselves: input_ids [B, T], (i, t) at flat index
    # i T + t.
    b["input_ids"] = b["tokens"]
    b["depth"] = None
    b["end"] = None
    b["where"] = torch.arange(B * T, device=device).view(B, T)
    b["fwd_tokens"] = sum(len(s.tokens) for s in samples)
    if not tree:
        return b
    # One packed row [1, L], L = n + extra: `extra` pad tokens, each its own root (its end is
    # itself + 1).
    tokens, depth, end, where = pack([s.tokens for s in samples])
    n = len(tokens)
    extra = -n % pad_to
    return {
        **b,
        "input_ids": torch.tensor([tokens + [pad_id] * extra], device=device),
        "depth": torch.tensor([depth + [0] * extra], device=device),
        "end": torch.tensor(end + list(range(n + 1, n + extra + 1)), device=device),
        "where": padded(where, 0, None),
        "fwd_tokens": n,
    }


def tree_unsupported(config) -> Optional[str]:
    """Why a model cannot run a packed tree (``tree_mask``), or None: its attention must take a mask
    (sdpa, eager, flex_attention) and every layer must be attention (full or sliding window; a
    recurrent layer, as Qwen3.5's linear attention, reads the row in order, not as a tree)."""
    impl = getattr(config, "_attn_implementation", None)
    attention = {"full_attention", "sliding_attention"}
    if kinds := set(getattr(config, "layer_types", None) or ()) - attention:
        return f"its {sorted(kinds)} layers are not attention over a mask"
    # An attention that transformers gives sdpa's mask is sdpa under another name, as the faster
    # ones of extras/fast_decode.py are: it takes tree_mask's [1, 1, L, L] bool.
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    sdpa_like = ALL_MASK_ATTENTION_FUNCTIONS.get(impl) is sdpa_mask
    if impl not in ("eager", "flex_attention") and not sdpa_like:
        return f"its attention ({impl}) takes no arbitrary mask; sdpa, eager and flex_attention do"
    return None


def tree_mask(config, depth: torch.Tensor, end: torch.Tensor):
    """The attention mask of a packed row (``collate``): q sees kv exactly when kv is q or an
    ancestor of q, and in a sliding-window layer also ``depth[q] - depth[kv] < sliding_window`` (the
    window counts positions in q's own sequence, not packed indices). In the form the model's
    attention takes: [1, 1, L, L] bool (sdpa), additive float (eager) or a FlexAttention BlockMask
    (O(L^2 / 128^2) memory: the one for long rows on GPUs); a dict by layer type when the model
    mixes full and sliding layers, as Gemma and gpt-oss do.

    For ``pack([[1, 2, 3], [1, 2, 4]])`` (end [4, 4, 3, 4]) token 4 (index 3) sees indices 0, 1, 3.
    """
    if why := tree_unsupported(config):
        raise ValueError(f"this model cannot train a packed tree: {why}; pass --no-tree")
    impl = config._attn_implementation
    L = len(end)
    window = getattr(config, "sliding_window", None)
    default = "sliding_attention" if window else "full_attention"
    types = getattr(config, "layer_types", None) or [default]

    # q sees kv: kv is q or an ancestor of q (pack's end), within the window in a sliding layer.
    def sees(q, kv, sliding):
        m = (kv <= q) & (q < end[kv])
        if not sliding:
            return m
        return m & (depth[0, q] - depth[0, kv] < window)

    def build(sliding):
        # FlexAttention: compiled, it never builds the [L, L] mask; new closures of the same code
        # and shapes do not recompile (flex's either).
        if impl == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            return torch.compile(create_block_mask)(
                lambda b, h, q, kv: sees(q, kv, sliding), None, None, L, L, device=end.device
            )
        # [1, 1, L, L] bool (sdpa), or additive float (eager)
        i = torch.arange(L, device=end.device)
        m = sees(i[:, None], i[None, :], sliding)[None, None]
        if impl != "eager":
            return m
        return torch.zeros(m.shape, device=m.device).masked_fill(~m, -math.inf)

    masks = {k: build(k == "sliding_attention") for k in set(types)}
    if len(masks) == 1:
        return masks[types[0]]
    return masks


def sampling_support(x, top_k, top_p, m: int = 1024) -> torch.Tensor:
    """The tokens that top-k, then top-p sampling may draw: [N, V] logits already divided by the
    temperature, [N] ``top_k`` (<= 0: off) and ``top_p`` (1.0: off) -> [N, V] bool.

    top-k keeps the k largest logits (ties with the k-th too); top-p then keeps the most probable
    of those until their renormalized mass reaches top_p (at least one): either way ``x >= (the
    n-th largest)`` for some n. The sampler (backends.sample_token) calls it too: both agree on the
    rule by construction. It looks at the ``m`` largest logits first, and again at more for the
    rows they do not settle.

    >>> sampling_support(torch.tensor([[3., 2., 1., 0.]]), torch.tensor([3]), torch.tensor([0.7]))
    tensor([[ True,  True, False, False]])   # top-3 probs .67 .24 .09: mass before the 3rd is .91
    """
    V = x.shape[-1]
    m = min(V, m)
    cut_k = (top_k > 0) & (top_k < V)
    # [N, m] the m largest logits, sorted, largest first. The support nearly always lies in them: a
    # top-m costs ~1/40 of sorting a 50k vocabulary.
    largest = x.topk(m, -1).values
    # [N, m] the top-k among the m largest, ties included; their logsumexp (all V without a top-k)
    kth = largest.gather(-1, (top_k.clamp(1, m) - 1)[:, None])
    inside = ~cut_k[:, None] | (largest >= kth)
    lse = torch.where(cut_k, largest.masked_fill(~inside, -math.inf).logsumexp(-1), x.logsumexp(-1))
    # [N, m] probabilities renormalized over the top-k; top-p keeps those whose mass before them is
    # below top_p.
    p = (largest - lse[:, None]).exp() * inside
    n_top_p = ((p.cumsum(-1) - p) < top_p[:, None]).sum(-1).clamp(min=1)
    # [N] how many of the largest are kept; keep [N, V]: x at least the n-th largest
    n = torch.where(top_p < 1.0, torch.minimum(inside.sum(-1), n_top_p), inside.sum(-1))
    keep = (x >= largest.gather(-1, (n - 1)[:, None])) | (n == V)[:, None]
    # The m largest settle a row when they hold its top-k (else lse falls short) and its cut: the
    # top-p cut before the m-th, or with top-k alone, the k-th. A row with neither keeps all V.
    holds_top_k = ~cut_k | (top_k <= m)
    holds_cut = torch.where(top_p < 1.0, n < m, cut_k)
    redo = ~(holds_top_k & holds_cut) & (m < V)
    # Only those rows again: with top-k alone over the k largest, else over all V (a sort).
    if redo.any():
        rows = redo.nonzero()[:, 0]
        width = V
        if bool((cut_k[rows] & (top_p[rows] >= 1.0)).all()):
            width = int(top_k[rows].max())
        keep[rows] = sampling_support(x[rows], top_k[rows], top_p[rows], width)
    return keep


def sampled_logprobs(logits, tokens, temperature, top_k, top_p, allowed=None) -> torch.Tensor:
    """[N, V] logits, [N] tokens and the settings that sampled each -> [N] logprob of each token
    under the distribution it was drawn from: softmax(logits / T) on the top-k / top-p support
    (``sampling_support``), renormalized; greedy (T = 0) under softmax(logits), as the sampler
    reports it. ``allowed`` [N, V] bool holds a grammar's masks, applied first, as the sampler
    applied them; a token the grammar forces (the only one allowed) gets logprob 0, and no gradient.

    For logits [2, 1, 0], token 0, T 1: no truncation -0.408; top_k 2 -> -0.313; top_p 0.5 -> 0.0;
    allowed [T, F, T] -> -0.127 (softmax over [2, 0]).
    """
    x, lse, _, _ = _sampled_distribution(logits, tokens, temperature, top_k, top_p, allowed)
    return x.gather(-1, tokens[:, None])[:, 0] - lse


@torch.no_grad()
def sampled_entropy(logits, tokens, temperature, top_k, top_p, allowed=None) -> torch.Tensor:
    """[N] entropy (in nats, no gradient) of the distribution each token was drawn from: the one
    ``sampled_logprobs`` scores the token under, on the same support (the token kept inside it).

    For logits [2, 1, 0], T 1: no truncation 0.832 (probabilities .665 .245 .090); top_k 2 -> 0.582
    (.731 .269); top_p 0.5 -> 0.0 (token 0 alone); allowed [T, F, T] -> 0.365 (.881 .119).
    """
    return _entropy(*_sampled_distribution(logits, tokens, temperature, top_k, top_p, allowed))


# What sampled_logprobs and sampled_entropy share: x [N, V], log_softmax(logits / T) (greedy: T 1)
# with -inf where ``allowed`` is False; lse [N], the log of each row's support's mass under x (0.0
# for a row sampled from all of it); cut [n], the rows sampled under top-k / top-p, and keep [n, V],
# their support. x - lse is the sampled distribution's log-probabilities. log_softmax, not x -
# logsumexp(x): one [N, V] tensor fewer each way, and its backward is one fused kernel (the LM
# head's chunk of a step trained ~15% faster on a CPU).
def _sampled_distribution(logits, tokens, temperature, top_k, top_p, allowed):
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    greedy = temperature <= 0
    x = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], -1)
    lse = x.new_zeros(x.shape[0])
    # The rows sampled under top-k / top-p: normalized over their support alone, recomputed on these
    # logits (no gradient through its choice) and always holding the token (DESIGN.md: why
    # recompute).
    cut = (~greedy & ((top_k > 0) | (top_p < 1.0))).nonzero()[:, 0]
    keep = None
    if len(cut):
        with torch.no_grad():
            keep = sampling_support(x[cut], top_k[cut], top_p[cut])
            keep[torch.arange(len(cut)), tokens[cut]] = True
        lse = lse.index_put((cut,), x[cut].masked_fill(~keep, -math.inf).logsumexp(-1))
    return x, lse, cut, keep


# [N] -sum p log p over each row's support, of _sampled_distribution's x, lse, cut and keep; no
# gradient. It holds one [N, V] tensor, p (a [chunk, V] of Qwen's vocabulary is 620 MB): 0 outside
# the support (and where a grammar masked x to -inf), p log p in place, 0 log 0 taken as 0.
@torch.no_grad()
def _entropy(x, lse, cut, keep) -> torch.Tensor:
    p = x.exp()
    if len(cut):
        p[cut] = (x[cut] - lse[cut, None]).exp_().masked_fill_(~keep, 0.0)
    entropy = -p.xlogy_(p).sum(-1)
    # + 0.0: a certain token's -0.0 is 0.0
    return entropy + 0.0


# Stands in for the LM head during the model's forward, which then returns the hidden states it
# gave it.
class _Hidden(torch.nn.Module):
    h = None

    def forward(self, h):
        self.h = h
        return h


# [n, H] hidden states (or [n, V] logits when ``head`` is None) -> ([n] logprobs of ``tokens``,
# [n] entropies or None), at ``index`` in the batch (trainer_logprobs' ``allowed``). The entropy is
# computed last, without gradient: the backward's recomputation (checkpoint) stops once it has the
# tensors the gradient needs, before it.
def _head_logprobs(h, head, tokens, temperature, top_k, top_p, index, allowed, entropy):
    logits = h if head is None else head(h)
    mask = None
    if allowed is not None:
        mask = allowed(index, logits.shape[-1])
    x, lse, cut, keep = _sampled_distribution(logits, tokens, temperature, top_k, top_p, mask)
    logprobs = x.gather(-1, tokens[:, None])[:, 0] - lse
    if not entropy:
        return logprobs, None
    return logprobs, _entropy(x, lse, cut, keep)


# ``net``'s forward, ``raw``'s LM head ``head`` swapped for ``_Hidden``: the hidden states the model
# gave it, or None when the model changes the head's output (Gemma2's softcapping, Cohere's
# logit_scale).
def _forward_without_head(net, raw, head, **inputs) -> Optional[torch.Tensor]:
    hidden = _Hidden()
    raw.set_output_embeddings(hidden)
    try:
        out = net(**inputs).logits
    finally:
        raw.set_output_embeddings(head)
    return out if out is hidden.h else None


def trainer_logprobs(net, b: dict, chunk: int = 1024, allowed=None) -> torch.Tensor:
    """[B, T] logprobs of a ``collate``d micro-batch's trainable tokens under ``net``, 0.0
    elsewhere: ``trainer_logprobs_and_entropy``'s, without the entropy."""
    logprobs, _ = trainer_logprobs_and_entropy(net, b, chunk, allowed, entropy=False)
    return logprobs


def trainer_logprobs_and_entropy(
    net, b: dict, chunk: int = 1024, allowed=None, entropy: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[B, T] logprobs of a ``collate``d micro-batch's trainable tokens under ``net`` (a
    transformers causal LM, maybe in DDP or FSDP), each under the sampling settings of the call that
    drew it (``sampled_logprobs``); 0.0 elsewhere. The model runs a packed tree (every shared
    prefix, a GRPO group's prompt or a rollout's history, computed once) or the padded rows; memory
    is one chunk's [chunk, V] logits whatever the sample length.

    ``allowed``: the tokens a grammar allowed, replayed (hooks.grammar.Replay): fn(index [n],
    n_vocab) -> [n, V] bool, or None where it constrained none of them; ``index`` is each token's
    flat position i T + t in the batch's [B, T].

    And [B, T] each trainable token's entropy (``sampled_entropy``; 0.0 elsewhere; None when
    ``entropy`` is False), of the distribution its logprob is under, computed in the same chunk from
    the same logits, without gradient.
    """
    tokens, loss_mask, ids = b["tokens"], b["loss_mask"], b["input_ids"]
    L = ids.shape[1]
    # The LM head runs only at the positions that predict a trainable token, `chunk` of them at a
    # time and recomputed in backward: the numbers unchanged.
    # 1. Which positions to run the head at. Token t is predicted at position t - 1 (token 0 never
    #    is): on [B, T-1]. src [N]: the flat index into ids [R, L] of the position predicting each
    #    of the N trainable tokens. keep [K]: the distinct columns among them, sorted; col [N]: each
    #    one's index into keep.
    on = loss_mask[:, 1:] > 0
    src = b["where"][:, :-1][on]
    keep, col = torch.unique(src % L, return_inverse=True)
    raw = getattr(net, "module", net)
    inputs = dict(input_ids=ids, logits_to_keep=keep, use_cache=False)
    # A packed tree: each token at its depth, seeing only its ancestors.
    if b["end"] is not None:
        mask = tree_mask(raw.config, b["depth"], b["end"])
        inputs.update(position_ids=b["depth"], attention_mask=mask)
    # 2. The forward, through DDP's or FSDP's wrapper, its head swapped out: out [R, K, H] hidden
    #    states, the head run per chunk below (FSDP leaves the root's weights gathered after its
    #    forward). A model found to change its head's output is marked (ll_full_logits) and from
    #    then on runs whole: out [R, K, V] logits.
    head = None
    if not getattr(raw, "ll_full_logits", False) and hasattr(raw, "get_output_embeddings"):
        head = raw.get_output_embeddings()
    out = _forward_without_head(net, raw, head, **inputs) if head is not None else None
    if out is None:
        if head is not None:
            # Remembered on the model: later calls skip the trial forward.
            raw.ll_full_logits = True
        head = None
        out = net(**inputs).logits
    # 3. Per trainable token ([N] each): its hidden state (or logits), token, settings and flat
    #    index; the head and the logprobs in chunks of `chunk` tokens, recomputed in backward
    #    (checkpoint).
    index = torch.arange(tokens.numel(), device=tokens.device).view(tokens.shape)
    per_token = [out[src // L, col], tokens[:, 1:][on]]
    per_token += [b[k][:, 1:][on] for k in ("temperature", "top_k", "top_p")]
    per_token.append(index[:, 1:][on])
    chunks = [
        checkpoint(_head_logprobs, h, head, *rest, allowed, entropy, use_reentrant=False)
        for h, *rest in zip(*(x.split(chunk) for x in per_token))
    ]
    # 4. Back to [B, T]: the N logprobs (and entropies) at the trainable positions, 0.0 elsewhere.
    on_mask = loss_mask > 0
    lp = torch.cat([c[0] for c in chunks]).to(loss_mask.dtype)
    logprobs = loss_mask.new_zeros(loss_mask.shape).masked_scatter(on_mask, lp)
    if not entropy:
        return logprobs, None
    h = torch.cat([c[1] for c in chunks]).to(loss_mask.dtype)
    return logprobs, loss_mask.new_zeros(loss_mask.shape).masked_scatter(on_mask, h)


# ----------------------------------------------------------------------------- the loss


def clip_range(loss: str, clip_low=None, clip_high=None) -> tuple[Optional[float], Optional[float]]:
    """The clip range a loss runs with: each bound given, or the loss's default (``CLIP``; None for
    a loss that does not clip). The one place the default is resolved: ``policy_loss`` and train.py
    (its config.json) both call it: ``clip_range("gspo", clip_high=1e-3) == (3e-4, 1e-3)``."""
    low, high = CLIP.get(loss, (None, None))
    if clip_low is not None:
        low = clip_low
    if clip_high is not None:
        high = clip_high
    return low, high


def correction_problem(
    loss: str,
    rollout_correction: str = "none",
    correction_min: float = 0.0,
    correction_max: float = 3.0,
    reject_token: Optional[tuple] = None,
    reject_seq_mean: Optional[tuple] = None,
    ppo_ratio: str = "sampler",
) -> Optional[str]:
    """What is wrong with these mismatch corrections (train.py's flags of the same names), or None.
    ``correction_problem("ppo", "token-mask")`` names --ppo-ratio trainer: PPO's ratio to the
    sampler already is that weight, and a second one would count it twice (verl's bypass mode
    applies none to PPO for the same reason)."""
    if rollout_correction not in CORRECTIONS or ppo_ratio not in PPO_RATIOS:
        return f"--rollout-correction must be one of {CORRECTIONS}, --ppo-ratio one of {PPO_RATIOS}"
    if not 0 <= correction_min <= correction_max or correction_max <= 0:
        return (
            f"--correction-min {correction_min} and --correction-max {correction_max}: the weight's "
            "range needs 0 <= C_min <= C_max and C_max > 0"
        )
    for flag, band in (("--reject-token", reject_token), ("--reject-seq-mean", reject_seq_mean)):
        if band is not None and not 0 < band[0] <= band[1]:
            return f"{flag} {band[0]} {band[1]}: a ratio band needs 0 < LOW <= HIGH"
    weighted = rollout_correction != "none"
    corrected = weighted or reject_token or reject_seq_mean or ppo_ratio != "sampler"
    if loss == "sft" and corrected:
        return (
            "--loss sft takes no ratio to the sampler (recorded calls may hold no sampler "
            "logprobs): drop --rollout-correction, --reject-token, --reject-seq-mean, --ppo-ratio"
        )
    if loss == "tis" and (weighted or ppo_ratio != "sampler"):
        return (
            "--loss tis weights by min(r, --tis-cap), a token-truncate of its ratio to the sampler: "
            "for another weight use --loss ppo --ppo-ratio trainer --rollout-correction MODE"
        )
    if weighted and ppo_ratio == "sampler":
        return (
            f"--rollout-correction {rollout_correction} with PPO's ratio taken to the sampler would "
            "count the mismatch twice: add --ppo-ratio trainer"
        )
    return None


def correction_weights(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "none",
    c_min: float = 0.0,
    c_max: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight of the trainer's probability over the sampler's, without gradient, and
    where it left [c_min, c_max] (truncated or masked): [B, T] each, 0.0 and False off the mask.
    With log ratios d_t = logprobs_t - sampler_logprobs_t (+-20 at most, as verl's safety bound):

        token-*     w_t = exp(d_t), each token its own weight
        sequence-*  w = exp(sum_t d_t) on every token of a sample: the product of its ratios, as
                    TRL 1.16 (grpo_trainer.py) and verl 0.9 (rollout_corr_helper.py) take it (a
                    sum, not the geometric mean --reject-seq-mean takes)
        *-truncate  min(max(w, c_min), c_max)
        *-mask      w inside [c_min, c_max], else 0
        none        1

    One sample, d = 0.1, 0.5, -0.2 (ratios 1.105, 1.649, 0.819), c_max 1.5: token-truncate
    1.105 1.5 0.819, token-mask 1.105 0 0.819 (the 2nd out either way); sequence: exp(0.4) =
    1.492 on all three, inside; with c_max 1.4 sequence-truncate 1.4 and sequence-mask 0 (all out).
    """
    mask = loss_mask.to(logprobs.dtype)
    on = loss_mask > 0
    if mode == "none":
        return mask, torch.zeros_like(on)
    log_ratio = (logprobs.detach() - sampler_logprobs) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(1, keepdim=True)
    raw = log_ratio.clamp(-20, 20).exp().expand_as(mask)
    outside = ((raw < c_min) | (raw > c_max)) & on
    if mode.endswith("truncate"):
        weight = raw.clamp(c_min, c_max)
    else:
        weight = raw.masked_fill(outside, 0.0)
    return weight * mask, outside


def rejection_mask(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    token_band: Optional[tuple] = None,
    seq_mean_band: Optional[tuple] = None,
) -> torch.Tensor:
    """[B, T] bool: the trainable tokens two-sided bands on the ratio r_t = exp(logprobs_t -
    sampler_logprobs_t) keep in the loss (False off the mask); a band (LOW, HIGH) keeps what lies
    in [LOW, HIGH], None keeps all:

        token_band     each token by its own r_t (IcePop's mask)
        seq_mean_band  every token of a sample by exp(mean_t log r_t) over its trainable tokens,
                       the geometric mean of its ratios (SkyRL's geometric sequence mask)

    verl 0.9 bounds k1 = -log r (rollout_corr_helper.compute_rollout_rejection_mask): its token_k1
    and seq_mean_k1 with "L_H" are these bands with (1/H, 1/L). One sample, log ratios 0.1, 0.5,
    -0.2: token_band (0.5, 1.5) drops the 2nd (1.649); the mean 0.4/3 = 0.133 gives 1.143, so
    seq_mean_band (0.99, 1.01) drops all three and (0.5, 2) none.
    """
    on = loss_mask > 0
    kept = on.clone()
    log_ratio = ((logprobs.detach() - sampler_logprobs) * on).clamp(-20, 20)
    if token_band is not None:
        ratio = log_ratio.exp()
        kept &= (ratio >= token_band[0]) & (ratio <= token_band[1])
    if seq_mean_band is not None:
        mean = log_ratio.sum(1, keepdim=True) / on.sum(1, keepdim=True).clamp(min=1)
        ratio = mean.exp()
        kept &= (ratio >= seq_mean_band[0]) & (ratio <= seq_mean_band[1])
    return kept


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    loss: str = "ppo",
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
    tis_cap: float = 2.0,
    kl_coef: float = 0.0,
    ref_logprobs: Optional[torch.Tensor] = None,
    clip_ratio_c: float = 3.0,
    entropy: Optional[torch.Tensor] = None,
    rollout_correction: str = "none",
    correction_min: float = 0.0,
    correction_max: float = 3.0,
    reject_token: Optional[tuple] = None,
    reject_seq_mean: Optional[tuple] = None,
    ppo_ratio: str = "sampler",
) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the loss, and its metrics as sums (see ``reduce_metrics``).
    [B, T]: ``logprobs`` (trainer, with grad), ``old_logprobs`` (recorded at rollout),
    ``loss_mask``, ``ref_logprobs``, ``advantages`` (or [B], one per sample); [B]: ``weights``
    (``sample_weights``). With r = exp(logprobs - old_logprobs), advantage A:

        ppo   -min(r A, clip(r, 1-clip_low, 1+clip_high) A) per token; for A < 0 at most
              -clip_ratio_c A
        gspo  the same with r the sample's exp(mean log-ratio over its trainable tokens), one per
              sample
        tis   -min(r, tis_cap) A logprobs: REINFORCE, truncated importance weight (no grad)
        sft   -logprobs: supervised, the advantage unused (train.py keeps the rollouts it should
              imitate)

    plus ``kl_coef`` * k3(ref || trainer) = exp(ref - lp) - (ref - lp) - 1 when kl_coef > 0. A clip
    bound left None is the loss's default (``clip_range``). ``entropy`` [B, T] (detached,
    ``trainer_logprobs_and_entropy``'s) is only summed into the metrics (entropy_mean; 0 without
    it, as kl_mean without the KL term).

    The mismatch corrections (docs/algorithms.md; all off by default, the loss then as above):
    ``ppo_ratio`` "trainer" takes ppo's and gspo's r against the trainer's own logprobs, detached
    (decoupled PPO: r is 1 in value, its gradient that of logprobs); ``rollout_correction`` then
    multiplies each token's policy term by ``correction_weights`` (mode ``rollout_correction``,
    range [``correction_min``, ``correction_max``]), and the bands ``reject_token`` and
    ``reject_seq_mean`` (``rejection_mask``) take the tokens they reject out of it. A removed token
    still counts in ``weights``' denominators, as TRL's masked weights do. A = 1, r_sampler = 1.649
    (d = 0.5), token-truncate at 1.5 with --ppo-ratio trainer: loss -1.5, gradient -1.5.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; pick one of {LOSSES}")
    problem = correction_problem(
        loss,
        rollout_correction,
        correction_min,
        correction_max,
        reject_token,
        reject_seq_mean,
        ppo_ratio,
    )
    if problem:
        raise ValueError(problem)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            "kl_coef > 0 needs ref_logprobs: the reference model's logprobs of its tokens"
        )
    mask = loss_mask.to(logprobs.dtype)
    # 1. each token's loss [B, T], its ratio, and whether it was clipped (no gradient). PPO's ratio
    #    is to the sampler's logprobs, or to the trainer's own (the proximal policy of a step's one
    #    update: the clip then bounds nothing).
    proximal = old_logprobs
    if ppo_ratio == "trainer":
        proximal = logprobs.detach()
    tok_loss, ratio, was_clipped = token_loss(
        logprobs,
        proximal,
        advantages,
        loss_mask,
        loss,
        clip_low,
        clip_high,
        tis_cap,
        clip_ratio_c,
    )
    # The metrics' ratio is always the sampler's: the mismatch.
    if ppo_ratio == "trainer":
        ratio = ((logprobs.detach() - old_logprobs) * mask).clamp(-20, 20).exp()
    # 2. the mismatch corrections [B, T], without gradient: the importance weight of the trainer
    #    over the sampler, and the tokens a band keeps. Skipped when off: the numbers unchanged.
    is_weight, outside = correction_weights(
        logprobs, old_logprobs, loss_mask, rollout_correction, correction_min, correction_max
    )
    kept = rejection_mask(logprobs, old_logprobs, loss_mask, reject_token, reject_seq_mean)
    if rollout_correction != "none":
        tok_loss = tok_loss * is_weight
    if reject_token or reject_seq_mean:
        tok_loss = tok_loss * kept
    truncated = outside & rollout_correction.endswith("truncate")
    masked = (outside & rollout_correction.endswith("mask")) | ((loss_mask > 0) & ~kept)
    corrected = (is_weight, truncated, masked)
    # 3. the KL penalty, k3 estimator [B, T]
    kl = None
    if kl_coef > 0:
        d = (ref_logprobs - logprobs) * mask
        kl = d.exp() - d - 1
        tok_loss = tok_loss + kl_coef * kl
    # 4. agg_loss: the sum of weight * token loss over the trainable tokens, each sample's weight
    #    [B] being 1 / its denominator over the global batch (sample_weights): no division here,
    #    none per micro-batch.
    total = (tok_loss * weights.to(logprobs.dtype)[:, None] * mask).sum()
    metrics = _loss_metrics(
        total, ratio, logprobs, old_logprobs, mask, was_clipped, kl, entropy, corrected
    )
    return total, metrics


def token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss: str = "ppo",
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
    tis_cap: float = 2.0,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``policy_loss``'s first step, [B, T] each: every token's loss (before the KL term and the
    weights), its ratio r = exp(logprobs - old_logprobs), and whether the loss clipped it (bool, no
    gradient): ppo and gspo by their clip and dual clip (gspo by its sample's ratio), tis above
    ``tis_cap``, sft never. The arguments are policy_loss's; extras/recorder.py takes each recorded
    token's ratio and clip from here.
    """
    # [B, T] mask and advantages (a [B] advantage: one per sample, [B, 1])
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    # [B, T] log-ratio: 0 off the mask, so exp() stays finite on padding; +-20 keeps a wild token (a
    # bug) from overflowing.
    log_ratio = ((logprobs - old_logprobs) * mask).clamp(-20, 20)
    ratio = log_ratio.exp()
    if loss in ("ppo", "gspo"):
        clip = clip_range(loss, clip_low, clip_high)
        tok_loss, was_clipped = _clipped_loss(ratio, log_ratio, mask, adv, loss, clip, clip_ratio_c)
    elif loss == "tis":
        tok_loss = -ratio.detach().clamp(max=tis_cap) * adv * logprobs
        was_clipped = ratio > tis_cap
    else:
        tok_loss = -logprobs
        # sft clips nothing.
        was_clipped = mask < 0
    return tok_loss, ratio, was_clipped


# ppo and gspo: [B, T] token losses and whether each was clipped; ``clip``: (clip_low, clip_high).
def _clipped_loss(ratio, log_ratio, mask, adv, loss, clip, clip_ratio_c):
    # ppo: the token's ratio [B, T]; gspo: the sample's [B, 1], exp(mean log-ratio over its
    # trainable tokens)
    r = ratio
    if loss == "gspo":
        r = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).exp()
    clipped = r.clamp(1 - clip[0], 1 + clip[1])
    tok_loss = -torch.min(r * adv, clipped * adv)
    # Dual clip: for A < 0 the clip leaves r |A| unbounded above, and one stale or mismatched token
    # could set the update; a ratio above clip_ratio_c counts as clip_ratio_c (no gradient). A = -1,
    # r = 5: 5 -> 3.
    tok_loss = torch.where(adv < 0, torch.minimum(tok_loss, -clip_ratio_c * adv), tok_loss)
    was_clipped = (clipped * adv < r * adv) | ((adv < 0) & (r > clip_ratio_c))
    return tok_loss.expand_as(mask), was_clipped.expand_as(mask)


# The sums over the trainable tokens that ``reduce_metrics`` combines; ``corrected``: [B, T] each,
# the importance weights and the tokens they truncated and the tokens taken out of the loss.
@torch.no_grad()
def _loss_metrics(
    total, ratio, logprobs, old_logprobs, mask, was_clipped, kl, entropy, corrected
) -> dict:
    on = mask > 0
    r = ratio[on].double()
    is_weight, truncated, masked = corrected
    return {
        "loss": total.detach().double(),
        "tokens": on.sum().double(),
        "clipped": was_clipped[on].sum().double(),
        "ratio_sum": r.sum(),
        "dlogp_sum": (logprobs - old_logprobs)[on].double().abs().sum(),
        "kl_sum": kl[on].double().sum() if kl is not None else r.sum() * 0,
        "entropy_sum": entropy[on].double().sum() if entropy is not None else r.sum() * 0,
        "is_weight_sum": is_weight[on].double().sum(),
        "truncated": truncated[on].double().sum(),
        "masked": masked[on].double().sum(),
        # per sample: those with a trainable token, and those with one truncated or masked
        "samples": on.any(1).double().sum(),
        "truncated_samples": (truncated & on).any(1).double().sum(),
        "masked_samples": (masked & on).any(1).double().sum(),
    }


def reduce_metrics(metrics: list[dict]) -> dict[str, float]:
    """Combine ``policy_loss`` metrics of all micro-batches (and all ranks: collective; a rank
    without samples passes []) into the global loss, tokens and means per trainable token
    (clip_frac, ratio_mean, dlogp_mean, kl_mean, entropy_mean, is_weight_mean), and what the
    mismatch corrections did, by token and by sample: is_truncated_frac and is_truncated_seq_frac
    (an importance weight truncated), masked_frac and masked_seq_frac (taken out of the loss by a
    masked weight or a band). The rollout-vs-trainer mismatch's other metrics (prob_corr, the
    extremes) are an extra's (hooks.LOSS_METRICS: extras/mismatch.py)."""
    # A rank without samples joins the all-reduce with an empty micro-batch's metrics: zero sums.
    if not metrics:
        empty = torch.zeros(0, 0)
        none = torch.zeros(0, 0, dtype=torch.bool)
        nothing = (empty, none, none)
        metrics = [
            _loss_metrics(torch.zeros(()), empty, empty, empty, empty, none, None, None, nothing)
        ]
    keys = list(metrics[0])
    # One device->host copy, and one all-reduce.
    sums = torch.stack([torch.stack([m[k] for k in keys]) for m in metrics]).sum(0)
    agg = dict(zip(keys, all_reduce(sums.tolist())))
    n = max(agg["tokens"], 1.0)
    return {
        "loss": agg["loss"],
        "tokens": agg["tokens"],
        "clip_frac": agg["clipped"] / n,
        "ratio_mean": agg["ratio_sum"] / n,
        "dlogp_mean": agg["dlogp_sum"] / n,
        "kl_mean": agg["kl_sum"] / n,
        "entropy_mean": agg["entropy_sum"] / n,
        "is_weight_mean": agg["is_weight_sum"] / n,
        "is_truncated_frac": agg["truncated"] / n,
        "is_truncated_seq_frac": agg["truncated_samples"] / max(agg["samples"], 1.0),
        "masked_frac": agg["masked"] / n,
        "masked_seq_frac": agg["masked_samples"] / max(agg["samples"], 1.0),
    }


# ----------------------------------------------------------------------------- the flags
def add_args(parser):
    """train.py's algorithm flags, as an argparse group: each help says what its choice reduces to
    (docs/algorithms.md has the tables)."""
    group = parser.add_argument_group("algorithm (docs/algorithms.md)")
    group.add_argument("--adv", default="grpo", choices=ESTIMATORS, help="advantage estimator")
    group.add_argument("--gamma", type=float, default=1.0, help="--adv returns: discount per call")
    group.add_argument(
        "--drop-zero-variance", action="store_true", help="drop groups of equal rewards"
    )
    group.add_argument(
        "--loss",
        default="ppo",
        choices=LOSSES,
        help="ppo: clipped token ratio; gspo: sequence ratio; tis: truncated IS; sft: imitate",
    )
    group.add_argument(
        "--sft-min-reward", type=float, help="sft: imitate rollouts rewarded >= this"
    )
    group.add_argument("--norm", default="rollout-mean", choices=NORMS, help="normalization")
    group.add_argument("--norm-const", type=float, help="Dr. GRPO's C (default: --max-new-tokens)")
    group.add_argument("--clip-low", type=float, help="ratio clip below 1 (ppo 0.2, gspo 3e-4)")
    group.add_argument("--clip-high", type=float, help="ratio clip above 1 (ppo 0.28, gspo 4e-4)")
    group.add_argument("--clip-ratio-c", type=float, default=3.0, help="dual clip (inf: off)")
    group.add_argument("--tis-cap", type=float, default=2.0, help="--loss tis: the IS weight's cap")
    # The mismatch corrections (docs/algorithms.md), each off by default.
    group.add_argument(
        "--rollout-correction",
        default="none",
        choices=CORRECTIONS,
        help="weight each token's loss by trainer/sampler prob, per token or sample (product), "
        "clamped to or zeroed outside [C_min, C_max] (TRL's vllm_importance_sampling_mode, "
        "verl's rollout_is; needs --ppo-ratio trainer; none: the plain loss)",
    )
    group.add_argument(
        "--correction-min", type=float, default=0.0, help="C_min (0: no lower bound)"
    )
    group.add_argument(
        "--correction-max", type=float, default=3.0, help="C_max (TRL's 3, verl's 2)"
    )
    group.add_argument(
        "--reject-token",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="drop tokens whose trainer/sampler ratio is outside [LOW, HIGH] (IcePop: 0.5 5)",
    )
    group.add_argument(
        "--reject-seq-mean",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="drop samples whose exp(mean log ratio) is outside [LOW, HIGH] (SkyRL: 0.99 1.01)",
    )
    group.add_argument(
        "--ppo-ratio",
        default="sampler",
        choices=PPO_RATIOS,
        help="sampler: one clip bounds the update and the mismatch (the default until bf16 "
        "learning is measured); trainer: decoupled PPO, the mismatch left to the above",
    )
    group.add_argument(
        "--kl-coef", type=float, default=0.0, help="KL to the initial model (0: off)"
    )
    group.add_argument(
        "--max-mismatch",
        type=float,
        metavar="LOGPROB",
        help="stop before an update when the mean |trainer - sampler logprob| of the tokens of its "
        "weights is past this (default: 0.01 fp32/fp32, 0.2 with bf16; inf: off)",
    )


def resolve_args(args):
    """The algorithm flags' derived defaults, resolved in place (config.json records what ran):
    the clip range of the loss, Dr. GRPO's C; a combination of corrections that cannot apply stops
    the run, saying why."""
    args.clip_low, args.clip_high = clip_range(args.loss, args.clip_low, args.clip_high)
    if args.norm_const is None:
        args.norm_const = args.max_new_tokens
    weight = (args.rollout_correction, args.correction_min, args.correction_max)
    bands = (args.reject_token, args.reject_seq_mean)
    problem = correction_problem(args.loss, *weight, *bands, args.ppo_ratio)
    if problem:
        raise SystemExit(problem)
