"""Time and peak memory of merging one rollout's calls into samples (samples.build_samples).

    python bench/merging.py [--sizes 1,10,50,100,200] [--split-calls 200] [--split-every 20] [--repeat 5]
    python bench/merging.py --smoke     # a second's run of every rollout kind, for the tests

Synthetic rollouts, no model: an append-only agent chat where each call's prompt is the
previous call's prompt + response + a new tool/user message, with --min-new..--max-new new
tokens per turn (about a third of them sampled) after a --system-tokens long first prompt
(system prompt + tools). One more rollout rewrites its history every --split-every calls
(a summary replaces the turns so far), which starts a new sample each time
(split_rewrote_history).

The calls are given as records.read_calls reads them: a call the proxy built on the previous
one holds only its new ids (parent + prompt_tail), a rewrite its whole prompt.

Columns: total tokens (the longest sequence), ids the calls stand for (the sum of prompt +
response lengths: one sample per call would train that many), median time over --repeat runs, time per call,
time per held id and per merged token (flat down a column: linear in that size), extra peak
memory while it runs (tracemalloc, a separate run: tracing slows it), and the training
tokens with merging vs one sample per call (stats["tokens"] vs stats["tokens_unmerged"]).
"""

import argparse
import os
import random
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_lite.records import Call  # noqa: E402
from lightning_lite.samples import build_samples  # noqa: E402

VOCAB = 49152  # SmolLM2's; the ids are never decoded
# The defaults --smoke sets (tests/test_bench.py runs it): short rollouts of both kinds, run once.
SMOKE = {
    "sizes": "1,5",
    "split_calls": 10,
    "split_every": 3,
    "system_tokens": 50,
    "min_new": 10,
    "max_new": 30,
    "repeat": 1,
}


def rollout(n_calls, rng, a, split_every=0):
    """n_calls calls of one append-only chat; with split_every, every split_every-th call rewrites the history."""
    ids = lambda k: [rng.randrange(VOCAB) for _ in range(k)]  # noqa: E731
    system = ids(a.system_tokens)
    prompt, tail, calls = system + ids(rng.randint(a.min_new, a.max_new) // 2), None, []
    for i in range(n_calls):
        if split_every and i and i % split_every == 0:
            # A rewritten history: the same system prompt, then a summary the model never sampled.
            prompt, tail = system + ids(rng.randint(a.min_new, a.max_new)), None
        new = rng.randint(a.min_new, a.max_new)
        k = max(
            1, new // 3
        )  # sampled; the rest of the turn's new tokens arrive as the next tool result
        response = ids(k)
        # As records.read_calls gives them: a call built on the previous one is its parent + the new ids.
        calls.append(
            Call(
                rollout_id="r",
                index=i,
                api="chat",
                model_version=0,
                prompt_ids=None if tail else prompt,
                response_ids=response,
                response_logprobs=[-rng.random() for _ in range(k)],
                finish_reason="tool_calls",
                parent=i - 1 if tail else None,
                prompt_tail=tail,
            )
        )
        tail = ids(new - k)
        prompt = prompt + response + tail
    return calls


def measure(calls, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        samples, stats = build_samples(calls)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    build_samples(calls)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak, samples, stats


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1,10,50,100,200", help="calls per append-only rollout")
    ap.add_argument(
        "--split-calls",
        type=int,
        default=200,
        help="calls of the rollout that rewrites its history (0: none)",
    )
    ap.add_argument("--split-every", type=int, default=20)
    ap.add_argument(
        "--system-tokens", type=int, default=2000, help="the first prompt's system prompt + tools"
    )
    ap.add_argument(
        "--min-new",
        type=int,
        default=100,
        help="fewest new tokens per turn (response + next message)",
    )
    ap.add_argument("--max-new", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds' run of every code path, for the tests: the numbers mean nothing",
    )
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()

    cases = [(f"append {n}", int(n), 0) for n in a.sizes.split(",")]
    if a.split_calls:
        cases.append((f"split/{a.split_every} {a.split_calls}", a.split_calls, a.split_every))
    print(
        "| rollout | calls | samples | total tok | ids held | time ms | us/call | ns/id held "
        "| ns/merged | peak MiB | train tok merged | one per call | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, every in cases:
        calls = rollout(n, random.Random(a.seed), a, every)
        t, peak, samples, st = measure(calls, a.repeat)
        longest = max(len(s.tokens) for s in samples)
        held, merged = st["tokens_unmerged"], st["tokens"]
        print(
            f"| {name} | {n} | {st['samples']} | {longest} | {held} | {t * 1e3:.2f} "
            f"| {t / n * 1e6:.1f} | {t / held * 1e9:.2f} | {t / merged * 1e9:.1f} "
            f"| {peak / 2**20:.1f} | {merged} | {held} | {held / merged:.1f}x |"
        )
    print(
        "\nids held = sum of prompt + response lengths the calls stand for (grows as calls^2 in an append-only chat), what\n"
        "build_samples read when every call held its whole prompt; they hold each id once now (parent + prompt_tail)."
    )


if __name__ == "__main__":
    main()
