"""Recorded calls -> training samples: one prefix tree per rollout, one sample per leaf, ``loss_mask`` 1 exactly
on sampled tokens (DESIGN.md "Retokenization and merging"; example: ``build_samples``).

A call hangs under its recorded ``parent`` (no id compared), else under the earlier call whose prompt + response
is the longest prefix of its prompt; a call that extends nothing starts a new root (a "split"), counted by reason:

    rewrote_history    its prompt starts with an earlier call's prompt, not with that call's response (history edited)
    template_mismatch  the proxy matched the messages, but the template renders the sampled turn otherwise
    new_thread         an unrelated conversation (title generation, sub-agents)
    retry              the same prompt ids again: the earlier attempt is dropped unless a later call continued it
                       (the ``n`` choices of one request are siblings instead)

    python -m lightning_lite.samples CALLS.jsonl --out SAMPLES.jsonl [--max-seq-len N]
"""

from __future__ import annotations

import argparse
import os
from collections import Counter, defaultdict
from typing import Iterable, Optional

from .records import SPLIT_REASONS, UNANSWERED, Call, Sample, full_prompt, read_calls, write_jsonl


def build_samples(
    calls: list[Call], max_seq_len: Optional[int] = None
) -> tuple[list[Sample], Counter]:
    """Turn ONE rollout's calls into samples; return (samples, stats).

    Example: an append-only chat of 2 turns and a separate title call:

        0: prompt [1 2]        response [3 4]
        1: prompt [1 2 3 4 5]  response [6]     extends 0 (as recorded: parent 0, prompt_tail [5])
        2: prompt [9]          response [8]     extends nothing -> split_new_thread
        -> samples [1 2 3 4 5 6] mask [0 0 1 1 0 1]  and  [9 8] mask [0 1]

    ``max_seq_len``: a longer sample is cut after the last call response that fits (never inside a response),
    or dropped when even its first call does not fit (counted: ``truncated``, ``dropped``); the tokens cut off
    are trained nowhere (unless another leaf holds them).
    """
    # a failed or cancelled call: nothing to train
    stats = Counter(
        rollouts=1, calls=len(calls), unanswered=sum(c.finish_reason in UNANSWERED for c in calls)
    )
    calls = sorted((c for c in calls if c.finish_reason not in UNANSWERED), key=lambda c: c.index)
    by_index = {c.index: c for c in calls}
    if len(by_index) < len(calls):
        i = next(a.index for a, b in zip(calls, calls[1:]) if a.index == b.index)
        raise ValueError(
            f"rollout {calls[0].rollout_id!r}: call index {i} twice; pass each rollout's calls once, from one "
            "calls file (a proxy restarted on a file before calls were numbered after those on disk reuses indices)"
        )
    # The tree: each call as the ids after the call it extends (a root: its whole prompt). A call's
    # prompt + response ids are the segments up its path, built as one list for the samples only.
    kept: dict[int, Call] = {}  # index -> call still in the tree (retried attempts leave it)
    up: dict[int, Optional[int]] = {}  # index -> the call it extends (None: a root)
    tail: dict[int, list[int]] = {}  # index -> its prompt ids after up's prompt + response ids
    size: dict[Optional[int], int] = {
        None: 0
    }  # index -> len(prompt + response); None: above the roots
    split: dict[
        int, str
    ] = {}  # index -> why this call began a new tree instead of extending one (SPLIT_REASONS)

    def lineage(i):  # call i, the call it extends, ..., its root
        while i is not None:
            yield by_index[i]
            i = up[i]

    def starts(ids, i, prompt_only=False):  # does ids start with call i's prompt (+ response) ids?
        segs = (
            seg for c in lineage(i) for seg in (c.response_ids, tail[c.index])
        )  # the last segment first
        end = size[i]
        if prompt_only:
            end -= len(next(segs))
        if len(ids) < end:
            return False
        for seg in segs:
            if ids[end - len(seg) : end] != seg:
                return False
            end -= len(seg)
        return True

    for c in calls:
        if not (c.prompt_ids or c.parent is not None and c.prompt_tail is not None):
            raise ValueError(
                f"rollout {c.rollout_id!r} call {c.index}: no prompt ids (empty prompt_ids, no parent + "
                "prompt_tail); the first sampled token would have no context to be trained from. "
                "Is the proxy recording prompt ids?"
            )
        if len(c.response_logprobs) != len(c.response_ids):
            raise ValueError(
                f"rollout {c.rollout_id!r} call {c.index}: {len(c.response_ids)} response ids but "
                f"{len(c.response_logprobs)} logprobs; every sampled token needs its rollout logprob."
            )
        stats["sampled_tokens"] += len(c.response_ids)
        claimed = c.parent in kept  # the proxy built this prompt on that call's: nothing to compare
        if claimed:
            up[c.index] = c.parent
            tail[c.index] = (
                c.prompt_tail if c.prompt_ids is None else c.prompt_ids[size[c.parent] :]
            )
            same = lambda e: up[e.index] == c.parent and tail[e.index] == tail[c.index]  # noqa: E731
        else:  # placed by its ids (its claimed parent, if any, left the tree as a retried attempt)
            ids = c.prompt_ids if c.prompt_ids is not None else full_prompt(c, by_index)
            same = lambda e: (
                size[e.index] - len(e.response_ids) == len(ids) and starts(ids, e.index, True)
            )  # noqa: E731
        # A retry: the same prompt ids again, from an earlier request (the n choices of one
        # request, indices index-choice .. index, are siblings, not retries). The earlier attempt
        # is dropped unless something already continued from it (then the harness used it: both
        # stay, as branches). Checked before extension, as that prompt also extends its parent.
        retried = [e for e in kept.values() if e.index < c.index - c.choice and same(e)]
        stats["split_retry"] += bool(retried)
        for e in retried:
            if e.index not in (up[i] for i in kept):
                del kept[e.index]
        if not claimed:
            # Longest candidate first: in an append-only chat the previous call matches at once.
            ext = next((i for i in sorted(kept, key=lambda i: -size[i]) if starts(ids, i)), None)
            up[c.index], tail[c.index] = ext, ids[size[ext] :]
            # The first root of a rollout is not a split, nor is choice 1.. of a request (a sibling).
            if ext is None and (retried or kept and c.choice == 0):
                split[c.index] = (
                    "retry"
                    if retried
                    else c.split
                    if c.split in SPLIT_REASONS
                    else "rewrote_history"
                    if any(starts(ids, i, True) for i in kept)
                    else "new_thread"
                )
                stats["split_" + split[c.index]] += not retried  # a retry is counted above
        kept[c.index] = c
        size[c.index] = size[up[c.index]] + len(tail[c.index]) + len(c.response_ids)

    stats["tokens_unmerged"] = sum(size[i] for i in kept)
    children = {up[i] for i in kept}
    paths = []  # (tokens, root -> leaf calls) of each leaf, cut to max_seq_len
    for leaf in (i for i in kept if i not in children):
        path = list(lineage(leaf))[::-1]
        if max_seq_len is not None and size[leaf] > max_seq_len:
            # Cut at the end of a call's response: a turn boundary, never mid-response.
            path = [c for c in path if size[c.index] <= max_seq_len]
            stats["truncated" if path else "dropped"] += 1
            if not path:
                continue
        paths.append(
            ([t for c in path for seg in (tail[c.index], c.response_ids) for t in seg], path)
        )
    # A sampled token on several leaves' paths is trained once, in the longest leaf (ties: the
    # smaller token ids): a rule that does not depend on which branch the harness sent first,
    # so per-sample normalizations (seq-mean-token-mean) weigh it the same in every run.
    paths.sort(key=lambda p: (-len(p[0]), p[0]))
    trained: set[int] = set()  # calls whose response is already trained in a longer leaf
    samples = []
    for tokens, path in paths:
        n = len(tokens)
        mask, logprobs, temperature, top_k, top_p, version, call = (
            [0] * n,
            [0.0] * n,
            [1.0] * n,
            [0] * n,
            [1.0] * n,
            [0] * n,
            [-1] * n,
        )
        grammars = {}
        for c in path:
            if c.index in trained:
                continue
            trained.add(c.index)
            if c.grammar:
                grammars[c.index] = c.grammar
            k = len(c.response_ids)
            a = size[c.index] - k
            mask[a : a + k], logprobs[a : a + k] = [1] * k, c.response_logprobs
            temperature[a : a + k], top_k[a : a + k], top_p[a : a + k] = (
                [c.temperature] * k,
                [c.top_k] * k,
                [c.top_p] * k,
            )
            version[a : a + k], call[a : a + k] = [c.model_version] * k, [c.index] * k
        if not any(mask):  # everything it sampled is trained in another leaf
            stats["empty"] += 1
            continue
        samples.append(
            Sample(
                rollout_id=path[-1].rollout_id,
                tokens=tokens,
                loss_mask=mask,
                logprobs=logprobs,
                calls=[c.index for c in path],
                split=split.get(path[0].index),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                version=version,
                call=call,
                grammars=grammars,
            )
        )
        stats["samples"] += 1
        stats["trainable_tokens"] += sum(mask)
        stats["tokens"] += n
    samples.sort(key=lambda s: s.calls[-1])  # in call order
    return samples, stats


def build_batch_samples(
    calls: Iterable[Call], max_seq_len: Optional[int] = None
) -> tuple[list[Sample], Counter]:
    """``build_samples`` of each rollout (in order of first appearance): all samples and the summed stats."""
    by_rollout: dict[str, list[Call]] = defaultdict(list)
    for c in calls:
        by_rollout[c.rollout_id].append(c)
    samples, stats = [], Counter()
    for s, st in (
        build_samples(rollout_calls, max_seq_len) for rollout_calls in by_rollout.values()
    ):
        samples += s
        stats.update(st)
    return samples, stats


def format_stats(stats: Counter) -> str:
    merged, unanswered = stats["tokens"], stats["unanswered"]
    rows = [
        ("rollouts", "rollouts", ""),
        (
            "calls",
            "calls",
            f"{unanswered} unanswered (backend error, client gone)" if unanswered else "",
        ),
        ("samples", "samples", ""),
        ("trainable tokens", "trainable_tokens", f"of {stats['sampled_tokens']} sampled"),
        ("tokens (merged)", "tokens", ""),
        (
            "tokens (one per call)",
            "tokens_unmerged",
            f"{stats['tokens_unmerged'] / merged:.2f}x the merged count" if merged else "",
        ),
        *((f"split: {r}", "split_" + r, "") for r in SPLIT_REASONS),
        ("truncated (max-seq-len)", "truncated", "cut at a turn boundary"),
        ("dropped (max-seq-len)", "dropped", "first turn too long"),
        ("empty", "empty", "no token left to train"),
    ]
    return "\n".join(f"{name:<24}{stats[key]:>9}  {note}".rstrip() for name, key, note in rows)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        description="Turn recorded calls (calls.jsonl) into training samples."
    )
    ap.add_argument("calls", help="calls.jsonl written by the proxy")
    ap.add_argument("--out", required=True, help="samples.jsonl to write")
    ap.add_argument(
        "--max-seq-len", type=int, default=None, help="truncate/drop longer samples (counted)"
    )
    args = ap.parse_args(argv)
    if not os.path.isfile(args.calls):
        ap.error(f"{args.calls}: no such file; pass the calls.jsonl the proxy wrote")
    samples, stats = build_batch_samples(read_calls(args.calls), args.max_seq_len)
    write_jsonl(args.out, samples)
    print(format_stats(stats))
    print(f"wrote {len(samples)} samples to {args.out}")


if __name__ == "__main__":
    main()
