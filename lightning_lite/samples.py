"""Recorded calls -> training samples. The invariant: every sampled token is trained exactly once,
in the longest leaf that holds it, so the per-sample normalizations do not depend on the order of
a tree's branches; ``loss_mask`` is 1 exactly on sampled tokens (DESIGN.md "Retokenization and
merging"; a worked example: ``build_samples``).

A rollout's calls form a prefix tree, and each leaf is one sample. A call hangs under its recorded
``parent`` (the proxy's word is trusted: no ids are compared), else under the earlier call whose
prompt + response is the longest prefix of its prompt. A call that extends nothing starts a new
root (a "split"), counted by reason:

    rewrote_history    its prompt starts with an earlier call's prompt, not with that call's
                       response (the harness edited its history)
    template_mismatch  the proxy matched the messages, but the template renders the sampled turn
                       otherwise
    new_thread         an unrelated conversation (title generation, sub-agents)
    retry              the same prompt ids again: the earlier attempt is dropped unless a later
                       call continued it (the ``n`` choices of one request are siblings instead)

    python -m lightning_lite.samples CALLS.jsonl --out SAMPLES.jsonl [--max-seq-len N]
"""

import argparse
import os
from collections import Counter, defaultdict
from typing import Iterable, Optional

from .records import SPLIT_REASONS, UNANSWERED, Call, Sample, full_prompt, read_calls, write_jsonl


def build_samples(calls: list[Call], max_seq_len=None) -> tuple[list[Sample], Counter]:
    """Turn ONE rollout's calls into samples; return (samples, stats).

    Example: an append-only chat of 2 turns and a separate title call:

        0: prompt [1 2]        response [3 4]
        1: prompt [1 2 3 4 5]  response [6]     extends 0 (as recorded: parent 0, prompt_tail [5])
        2: prompt [9]          response [8]     extends nothing -> split_new_thread
        -> samples [1 2 3 4 5 6] mask [0 0 1 1 0 1]  and  [9 8] mask [0 1]

    ``max_seq_len``: a longer sample is cut after the last call response that fits (never inside a
    response), or dropped when even its first call does not fit (counted: ``truncated``,
    ``dropped``); the tokens cut off are trained nowhere (unless another leaf holds them)."""
    # 1. the answered calls in index order (a failed or cancelled call: nothing to train)
    unanswered = sum(c.finish_reason in UNANSWERED for c in calls)
    stats = Counter(rollouts=1, calls=len(calls), unanswered=unanswered)
    calls = sorted((c for c in calls if c.finish_reason not in UNANSWERED), key=lambda c: c.index)
    tree = _Tree({c.index: c for c in calls})
    if len(tree.by_index) < len(calls):
        i = next(a.index for a, b in zip(calls, calls[1:]) if a.index == b.index)
        raise ValueError(
            f"rollout {calls[0].rollout_id!r}: call index {i} twice; pass each rollout's calls "
            "once, from one calls file (a proxy restarted on a file before calls were numbered "
            "after those on disk reuses indices)"
        )
    # 2. each call hung in the prefix tree
    for c in calls:
        _check(c)
        stats["sampled_tokens"] += len(c.response_ids)
        tree.add(c, stats)
    stats["tokens_unmerged"] = sum(tree.size[i] for i in tree.kept)
    # 3. one sample per leaf, each sampled token trained in one of them
    samples = []
    trained = set()
    for tokens, path in tree.leaf_paths(max_seq_len, stats):
        sample = _sample(tokens, path, tree, trained)
        if sample is None:
            stats["empty"] += 1
            continue
        samples.append(sample)
        stats.update(samples=1, trainable_tokens=sum(sample.loss_mask), tokens=len(tokens))
    samples.sort(key=lambda s: s.calls[-1])  # in call order
    return samples, stats


def _check(c: Call) -> None:
    if not (c.prompt_ids or c.parent is not None and c.prompt_tail is not None):
        raise ValueError(
            f"rollout {c.rollout_id!r} call {c.index}: no prompt ids (empty prompt_ids, no "
            "parent + prompt_tail); the first sampled token would have no context to be trained "
            "from. Is the proxy recording prompt ids?"
        )
    if len(c.response_logprobs) != len(c.response_ids):
        raise ValueError(
            f"rollout {c.rollout_id!r} call {c.index}: {len(c.response_ids)} response ids but "
            f"{len(c.response_logprobs)} logprobs; every sampled token needs its rollout logprob."
        )


# One rollout's calls as a prefix tree. Each call holds only its ids after the call it extends
# (``tail``; a root: its whole prompt), so a call's prompt + response ids are the segments up its
# path, never copied: root tail, root response, ..., its tail, its response.
class _Tree:
    def __init__(self, by_index: dict[int, Call]):
        self.by_index = by_index
        # index -> the call, while in the tree (a retried attempt leaves it)
        self.kept: dict[int, Call] = {}
        # index -> the call it extends (None: a root)
        self.up: dict[int, Optional[int]] = {}
        # index -> its prompt ids after up's prompt + response ids
        self.tail: dict[int, list[int]] = {}
        # index -> len(prompt + response); None: above the roots
        self.size: dict[Optional[int], int] = {None: 0}
        # index -> why this call began a new tree instead of extending one (SPLIT_REASONS)
        self.split: dict[int, str] = {}

    # call i, the call it extends, ..., its root
    def lineage(self, i: Optional[int]):
        while i is not None:
            yield self.by_index[i]
            i = self.up[i]

    # Whether ``ids`` start with call i's prompt + response ids (``prompt_only``: its prompt ids).
    # Compared segment by segment from the end of call i's ids back to its root's first, slices of
    # ``ids`` only.
    def starts_with(self, ids: list[int], i: int, prompt_only: bool = False) -> bool:
        segments = (seg for c in self.lineage(i) for seg in (c.response_ids, self.tail[c.index]))
        end = self.size[i]
        if prompt_only:
            end -= len(next(segments))
        if len(ids) < end:
            return False
        for seg in segments:
            if ids[end - len(seg) : end] != seg:
                return False
            end -= len(seg)
        return True

    # Whether the earlier call ``e`` had the same prompt as ``c``: with ``ids`` (c's prompt),
    # compared to e's; without (c hangs under the parent the proxy recorded), the same parent and
    # the same tail.
    def same_prompt(self, e: Call, c: Call, ids: Optional[list[int]]) -> bool:
        if ids is None:
            return self.up[e.index] == c.parent and self.tail[e.index] == self.tail[c.index]
        prompt_len = self.size[e.index] - len(e.response_ids)
        return prompt_len == len(ids) and self.starts_with(ids, e.index, prompt_only=True)

    # Hang call ``c``: under its recorded parent, else under the longest call its prompt extends,
    # else as a new root (a split, counted by reason); an earlier attempt at the same prompt leaves
    # the tree.
    def add(self, c: Call, stats: Counter) -> None:
        ids = None
        if c.parent in self.kept:
            # the proxy built this prompt on that call's: nothing to compare
            self.up[c.index] = c.parent
            new_ids = c.prompt_tail if c.prompt_ids is None else c.prompt_ids[self.size[c.parent] :]
            self.tail[c.index] = new_ids
        else:
            # placed by its ids (its claimed parent, if any, left the tree as a retried attempt)
            ids = c.prompt_ids if c.prompt_ids is not None else full_prompt(c, self.by_index)
        # A retry: the same prompt ids again, from an earlier request (the n choices of one request,
        # indices index - choice .. index, are siblings, not retries). The earlier attempt is
        # dropped unless something already continued from it (then the harness used it: both stay,
        # as branches). Checked before extension, as that prompt also extends its parent.
        first_of_request = c.index - c.choice
        earlier = [e for e in self.kept.values() if e.index < first_of_request]
        retried = [e for e in earlier if self.same_prompt(e, c, ids)]
        if retried:
            stats["split_retry"] += 1
        for e in retried:
            if not any(self.up[i] == e.index for i in self.kept):
                del self.kept[e.index]
        if ids is not None:
            # Longest candidate first: in an append-only chat the previous call matches at once.
            longest_first = sorted(self.kept, key=lambda i: -self.size[i])
            extends = next((i for i in longest_first if self.starts_with(ids, i)), None)
            self.up[c.index] = extends
            self.tail[c.index] = ids[self.size[extends] :]
            # The first root of a rollout is not a split, nor is choice 1.. of a request (a
            # sibling).
            if extends is None and (retried or (self.kept and c.choice == 0)):
                self.split[c.index] = self.split_reason(c, ids, retried)
                # a retry is counted above
                if not retried:
                    stats["split_" + self.split[c.index]] += 1
        self.kept[c.index] = c
        # its prompt + response: up's, then its tail and its response
        size = self.size[self.up[c.index]] + len(self.tail[c.index])
        self.size[c.index] = size + len(c.response_ids)

    def split_reason(self, c: Call, ids: list[int], retried: list[Call]) -> str:
        if retried:
            return "retry"
        if c.split in SPLIT_REASONS:
            return c.split
        if any(self.starts_with(ids, i, prompt_only=True) for i in self.kept):
            return "rewrote_history"
        return "new_thread"

    # (tokens, its calls root first) of each leaf, cut to ``max_seq_len``; the longest first (ties:
    # the smaller token ids).
    def leaf_paths(self, max_seq_len: Optional[int], stats: Counter) -> list[tuple]:
        children = {self.up[i] for i in self.kept}
        paths = []
        for leaf in (i for i in self.kept if i not in children):
            path = list(self.lineage(leaf))[::-1]
            if max_seq_len is not None and self.size[leaf] > max_seq_len:
                # Cut at the end of a call's response: a turn boundary, never mid-response.
                path = [c for c in path if self.size[c.index] <= max_seq_len]
                stats["truncated" if path else "dropped"] += 1
                if not path:
                    continue
            tokens = [t for c in path for seg in (self.tail[c.index], c.response_ids) for t in seg]
            paths.append((tokens, path))
        # A sampled token on several leaves' paths is trained once, in the longest leaf (ties: the
        # smaller token ids): a rule that does not depend on which branch the harness sent first, so
        # per-sample normalizations (seq-mean-token-mean) weigh it the same in every run.
        paths.sort(key=lambda p: (-len(p[0]), p[0]))
        return paths


# The sample of one leaf: its calls' responses trainable, but those ``trained`` in a longer leaf
# already (added to it); None when nothing is left to train.
def _sample(tokens: list[int], path: list[Call], tree: _Tree, trained: set) -> Optional[Sample]:
    n = len(tokens)
    # every per-token list as where the mask is 0
    fill = dict(loss_mask=0, logprobs=0.0, temperature=1.0, top_k=0, top_p=1.0, version=0, call=-1)
    sample = Sample(path[-1].rollout_id, tokens, **{k: [x] * n for k, x in fill.items()})
    sample.calls = [c.index for c in path]
    sample.split = tree.split.get(path[0].index)
    for c in (c for c in path if c.index not in trained):
        trained.add(c.index)
        # the call's response: the last k of its prompt + response ids
        k = len(c.response_ids)
        at = slice(tree.size[c.index] - k, tree.size[c.index])
        sample.loss_mask[at] = [1] * k
        sample.logprobs[at] = c.response_logprobs
        sample.temperature[at] = [c.temperature] * k
        sample.top_k[at] = [c.top_k] * k
        sample.top_p[at] = [c.top_p] * k
        sample.version[at] = [c.model_version] * k
        sample.call[at] = [c.index] * k
        if c.grammar:
            sample.grammars[c.index] = c.grammar
    return sample if any(sample.loss_mask) else None


def build_batch_samples(calls: Iterable[Call], max_seq_len=None) -> tuple[list[Sample], Counter]:
    """``build_samples`` of each rollout (in order of first appearance): all samples and the summed
    stats."""
    by_rollout: dict[str, list[Call]] = defaultdict(list)
    for c in calls:
        by_rollout[c.rollout_id].append(c)
    samples = []
    stats = Counter()
    for rollout_calls in by_rollout.values():
        rollout_samples, rollout_stats = build_samples(rollout_calls, max_seq_len)
        samples += rollout_samples
        stats.update(rollout_stats)
    return samples, stats


def for_imitation(samples: list[Sample]) -> list[Sample]:
    """The samples as --loss sft trains them: each token scored under the model's own softmax and
    without a grammar's mask, so the model learns to write what the sampler's settings or a grammar
    made it write."""
    for s in samples:
        n = len(s.tokens)
        s.temperature = [1.0] * n
        s.top_k = [0] * n
        s.top_p = [1.0] * n
        s.grammars = {}
    return samples


def format_stats(stats: Counter) -> str:
    n = stats["unanswered"]
    merged = stats["tokens"]
    unanswered = f"{n} unanswered (backend error, client gone)" if n else ""
    ratio = f"{stats['tokens_unmerged'] / merged:.2f}x the merged count" if merged else ""
    # (name, stats key, note)
    rows = [
        ("rollouts", "rollouts", ""),
        ("calls", "calls", unanswered),
        ("samples", "samples", ""),
        ("trainable tokens", "trainable_tokens", f"of {stats['sampled_tokens']} sampled"),
        ("tokens (merged)", "tokens", ""),
        ("tokens (one per call)", "tokens_unmerged", ratio),
    ]
    rows += [(f"split: {r}", "split_" + r, "") for r in SPLIT_REASONS]
    rows.append(("truncated (max-seq-len)", "truncated", "cut at a turn boundary"))
    rows.append(("dropped (max-seq-len)", "dropped", "first turn too long"))
    rows.append(("empty", "empty", "no token left to train"))
    return "\n".join(f"{name:<24}{stats[key]:>9}  {note}".rstrip() for name, key, note in rows)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        description="Turn recorded calls (calls.jsonl) into training samples."
    )
    ap.add_argument("calls", help="calls.jsonl written by the proxy")
    ap.add_argument("--out", required=True, help="samples.jsonl to write")
    ap.add_argument("--max-seq-len", type=int, help="truncate/drop longer samples (counted)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.calls):
        ap.error(f"{args.calls}: no such file; pass the calls.jsonl the proxy wrote")
    samples, stats = build_batch_samples(read_calls(args.calls), args.max_seq_len)
    write_jsonl(args.out, samples)
    print(format_stats(stats))
    print(f"wrote {len(samples)} samples to {args.out}")


if __name__ == "__main__":
    main()
