"""samples.py: calls -> prefix tree -> samples, with every split counted."""

import json
import os
import random
import subprocess
import sys

import pytest

from lightning_lite.records import Call, Sample, read_jsonl, write_jsonl
from lightning_lite.samples import build_batch_samples, build_samples


def call(index, prompt, response, rid="r0", split=None):
    # logprob of a sampled token = -(token id)/100: easy to check where it lands
    return Call(
        rollout_id=rid,
        index=index,
        api="chat",
        model_version=index,
        prompt_ids=list(prompt),
        response_ids=list(response),
        response_logprobs=[-t / 100 for t in response],
        finish_reason="stop",
        split=split,
    )


def child(index, parent, tail, response, rid="r0"):
    """A call as the proxy records it when it built the prompt on call ``parent``'s (records.read_calls keeps it so)."""
    c = call(index, [], response, rid)
    c.prompt_ids, c.prompt_tail, c.parent = None, list(tail), parent
    return c


def check_logprobs(s):
    for t, m, lp in zip(s.tokens, s.loss_mask, s.logprobs):
        assert lp == (-t / 100 if m else 0.0)


def test_append_only_conversation_is_one_sample():
    # 3 turns: sampled [10 11], tool result [5], sampled [12], user [6 7], sampled [13 14 15]
    calls = [
        call(0, [1, 2], [10, 11]),
        call(1, [1, 2, 10, 11, 5], [12]),
        call(2, [1, 2, 10, 11, 5, 12, 6, 7], [13, 14, 15]),
    ]
    samples, st = build_samples(calls)
    assert len(samples) == 1
    s = samples[0]
    assert s.tokens == [1, 2, 10, 11, 5, 12, 6, 7, 13, 14, 15]
    assert s.loss_mask == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert s.calls == [0, 1, 2] and s.rollout_id == "r0"
    check_logprobs(s)
    assert st["samples"] == 1 and st["trainable_tokens"] == 6 and st["tokens"] == 11
    assert st["tokens_unmerged"] == 4 + 6 + 11
    assert not any(
        st["split_" + r] for r in ("rewrote_history", "template_mismatch", "new_thread", "retry")
    )


def test_rewritten_history_splits_with_reason():
    # the harness sends back [10 99] instead of the sampled [10 11]
    calls = [call(0, [1, 2], [10, 11]), call(1, [1, 2, 10, 99, 5], [12])]
    samples, st = build_samples(calls)
    assert [s.tokens for s in samples] == [[1, 2, 10, 11], [1, 2, 10, 99, 5, 12]]
    assert [s.loss_mask for s in samples] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert st["split_rewrote_history"] == 1 and st["samples"] == 2
    assert [s.split for s in samples] == [None, "rewrote_history"]  # why each sample began
    # the proxy's split names the reason when it knows better (same tokens, fresh render)
    calls[1].split = "template_mismatch"
    _, st = build_samples(calls)
    assert st["split_template_mismatch"] == 1 and st["split_rewrote_history"] == 0


def test_interleaved_threads_give_two_samples():
    calls = [
        call(0, [1, 2], [10]),
        call(1, [3], [20]),
        call(2, [1, 2, 10, 5], [11]),
        call(3, [3, 20, 6], [21]),
    ]
    samples, st = build_samples(calls)
    assert [s.tokens for s in samples] == [[1, 2, 10, 5, 11], [3, 20, 6, 21]]
    assert [s.loss_mask for s in samples] == [[0, 0, 1, 0, 1], [0, 1, 0, 1]]
    assert [s.calls for s in samples] == [[0, 2], [1, 3]]
    assert st["split_new_thread"] == 1 and [s.split for s in samples] == [None, "new_thread"]


def test_shared_sampled_prefix_is_trained_once():
    # calls 1 and 2 both continue call 0 (e.g. two sub-agents forked from one context)
    calls = [
        call(0, [1], [10, 11]),
        call(1, [1, 10, 11, 5], [12]),
        call(2, [1, 10, 11, 6], [13, 14]),
    ]
    samples, st = build_samples(calls)
    assert [s.tokens for s in samples] == [[1, 10, 11, 5, 12], [1, 10, 11, 6, 13, 14]]
    # the shared [10 11] is trained once, in the longest leaf, whichever branch came first
    assert [s.loss_mask for s in samples] == [[0, 0, 0, 0, 1], [0, 1, 1, 0, 1, 1]]
    for s in samples:
        check_logprobs(s)
    assert st["trainable_tokens"] == 5 == sum(len(c.response_ids) for c in calls)
    assert not any(k.startswith("split_") and v for k, v in st.items())  # branching is not a split
    swapped = [
        call(0, [1], [10, 11]),
        call(1, [1, 10, 11, 6], [13, 14]),
        call(2, [1, 10, 11, 5], [12]),
    ]
    masks = {tuple(s.tokens): s.loss_mask for s in build_samples(swapped)[0]}
    assert masks == {tuple(s.tokens): s.loss_mask for s in samples}
    # equal lengths: the smaller token ids train it (a rule, not arrival order)
    tie = [call(0, [1], [10]), call(1, [1, 10, 6], [13]), call(2, [1, 10, 5], [12])]
    assert [s.loss_mask for s in build_samples(tie)[0]] == [[0, 0, 0, 1], [0, 1, 0, 1]]


def test_n_choices_are_siblings_not_retries():
    # one request for n=2 (calls 0, 1: choice 0, 1), the harness continues choice 1, then retries that call
    calls = [
        call(0, [1, 2], [10]),
        call(1, [1, 2], [20]),
        call(2, [1, 2, 20, 5], [21]),
        call(3, [1, 2, 20, 5], [22]),
    ]
    calls[1].choice = 1
    samples, st = build_samples(calls)
    assert [s.tokens for s in samples] == [[1, 2, 10], [1, 2, 20, 5, 22]]
    assert [s.loss_mask for s in samples] == [[0, 0, 1], [0, 0, 1, 0, 1]]
    assert st["split_retry"] == 1 and st["split_new_thread"] == st["split_rewrote_history"] == 0
    # the same prompt again in a LATER request retries both choices of the earlier one
    later = [call(0, [1, 2], [10]), call(1, [1, 2], [20]), call(2, [1, 2], [30])]
    later[1].choice = 1
    samples, st = build_samples(later)
    assert (
        [s.tokens for s in samples] == [[1, 2, 30]]
        and st["split_retry"] == 1
        and samples[0].split == "retry"
    )


def test_each_token_carries_the_sampling_of_its_call():
    calls = [call(0, [1, 2], [10, 11]), call(1, [1, 2, 10, 11, 5], [12])]
    calls[0].temperature, calls[0].top_p = 0.5, 0.9
    calls[1].temperature, calls[1].top_k = 1.0, 5
    (s,), _ = build_samples(calls)
    assert s.temperature == [1.0, 1.0, 0.5, 0.5, 1.0, 1.0]
    assert s.top_p == [1.0, 1.0, 0.9, 0.9, 1.0, 1.0] and s.top_k == [0, 0, 0, 0, 0, 5]


def test_retry_keeps_the_last_attempt():
    calls = [
        call(0, [1], [10]),
        call(1, [1, 10, 5], [11, 12]),
        call(2, [1, 10, 5], [13]),
        call(3, [1, 10, 5, 13, 6], [14]),
    ]
    samples, st = build_samples(calls)
    assert len(samples) == 1
    assert samples[0].tokens == [1, 10, 5, 13, 6, 14] and samples[0].loss_mask == [0, 1, 0, 1, 0, 1]
    assert samples[0].calls == [0, 2, 3]
    assert st["split_retry"] == 1 and st["trainable_tokens"] == 3
    # a retried first call: still one sample, no new_thread
    samples, st = build_samples([call(0, [1], [10]), call(1, [1], [11])])
    assert (
        [s.tokens for s in samples] == [[1, 11]]
        and st["split_retry"] == 1
        and st["split_new_thread"] == 0
    )


def test_mask_sum_equals_sampled_tokens_kept_random_trees():
    rng = random.Random(0)
    for _ in range(50):
        calls, nxt = [], 100
        for i in range(rng.randint(1, 8)):
            r = rng.random()
            if calls and r < 0.6:  # extend a random earlier call with an observation
                e = rng.choice(calls)
                prompt = e.prompt_ids + e.response_ids + [rng.randint(1, 9)]
            elif calls and r < 0.7:  # retry
                prompt = rng.choice(calls).prompt_ids
            else:
                prompt = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
            resp = list(
                range(nxt, nxt + rng.randint(1, 4))
            )  # unique ids: each sampled token is traceable
            nxt += len(resp)
            calls.append(call(i, prompt, resp))
        samples, st = build_samples(calls)
        trained = [t for s in samples for t, m in zip(s.tokens, s.loss_mask) if m]
        assert len(trained) == len(set(trained)), "a sampled token trained twice"
        kept = {c.index for s in samples for c in calls if c.index in s.calls}
        assert (
            len(trained)
            == sum(len(c.response_ids) for c in calls if c.index in kept)
            == st["trainable_tokens"]
        )
        assert st["sampled_tokens"] - st["trainable_tokens"] == sum(
            len(c.response_ids) for c in calls if c.index not in kept
        )  # only retried attempts are lost
        for s in samples:
            check_logprobs(s)


def test_max_seq_len_truncates_at_turn_boundary_or_drops():
    calls = [call(0, [1, 2], [10, 11]), call(1, [1, 2, 10, 11, 5], [12, 13, 14])]  # 4 | 8 tokens
    samples, st = build_samples(calls, max_seq_len=6)
    assert [s.tokens for s in samples] == [[1, 2, 10, 11]] and samples[0].loss_mask == [0, 0, 1, 1]
    assert st["truncated"] == 1 and st["trainable_tokens"] == 2 and samples[0].calls == [0]
    samples, st = build_samples(calls, max_seq_len=3)
    assert samples == [] and st["dropped"] == 1 and st["trainable_tokens"] == 0
    samples, st = build_samples(calls, max_seq_len=8)
    assert len(samples[0].tokens) == 8 and st["truncated"] == 0
    # a branch cut back to its shared prefix trains nothing new: counted, not duplicated
    calls.append(call(2, [1, 2, 10, 11, 6], [15, 16, 17]))
    samples, st = build_samples(calls, max_seq_len=6)
    assert (
        len(samples) == 1
        and st["truncated"] == 2
        and st["empty"] == 1
        and st["trainable_tokens"] == 2
    )


def test_bad_call_says_what_is_wrong():
    c = call(0, [1], [10, 11])
    c.response_logprobs = [-0.1]
    with pytest.raises(ValueError, match="2 response ids but 1 logprobs"):
        build_samples([c])


def test_batch_groups_by_rollout():
    calls = [call(0, [1], [10], "a"), call(0, [2], [20], "b"), call(1, [1, 10, 3], [11], "a")]
    samples, st = build_batch_samples(calls)
    assert [(s.rollout_id, s.tokens) for s in samples] == [("a", [1, 10, 3, 11]), ("b", [2, 20])]
    assert st["rollouts"] == 2 and st["calls"] == 3 and st["split_new_thread"] == 0


def test_cli_on_synthetic_calls(tmp_path):
    calls = [
        call(0, [1, 2], [10, 11], "a"),
        call(1, [1, 2, 10, 11, 5], [12], "a"),
        call(2, [7], [30], "a"),
        call(0, [3], [20, 21], "b"),
    ]
    path = tmp_path / "calls.jsonl"
    write_jsonl(str(path), calls)
    out = tmp_path / "out" / "samples.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-m", "lightning_lite.samples", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    lines = {line.split("  ")[0].strip(): line for line in p.stdout.splitlines()}
    assert lines["rollouts"].split()[-1] == "2" and lines["samples"].split()[-1] == "3"
    assert "split: new_thread" in p.stdout and "tokens (one per call)" in p.stdout
    rows = [json.loads(line) for line in open(out)]
    assert all({"rollout_id", "tokens", "loss_mask", "logprobs"} <= set(r) for r in rows)
    assert [s.tokens for s in read_jsonl(str(out), Sample)] == [
        [1, 2, 10, 11, 5, 12],
        [7, 30],
        [3, 20, 21],
    ]


def test_retry_of_a_continued_call_keeps_both():
    # call 1 continued from call 0, then the harness sends call 0's prompt again (a restart)
    calls = [call(0, [1], [10]), call(1, [1, 10, 5], [11]), call(2, [1], [12])]
    samples, st = build_samples(calls)
    assert [s.tokens for s in samples] == [[1, 10, 5, 11], [1, 12]]
    assert (
        st["split_retry"] == 1 and st["split_rewrote_history"] == 0 and st["trainable_tokens"] == 3
    )


def random_rollout(rng):
    """Random calls: extensions of earlier calls (an observation appended), retries, new threads; each also as the
    proxy records it (an extension: ``parent`` + ``prompt_tail``, a retry: the retried call's parent and tail)."""
    whole, tails, nxt = [], [], 100
    for i in range(rng.randint(1, 10)):
        r, resp = (
            rng.random(),
            list(range(nxt, nxt + rng.randint(1, 4))),
        )  # unique ids: each sampled token is traceable
        nxt += len(resp)
        if whole and r < 0.6:  # extend a random earlier call with an observation
            e = rng.choice(whole)
            obs = [rng.randint(1, 9)]
            whole.append(call(i, e.prompt_ids + e.response_ids + obs, resp))
            tails.append(child(i, e.index, obs, resp))
        elif whole and r < 0.75:  # retry
            k = rng.randrange(len(whole))
            whole.append(call(i, whole[k].prompt_ids, resp))
            tails.append(
                child(i, tails[k].parent, tails[k].prompt_tail, resp)
                if tails[k].parent is not None
                else call(i, whole[k].prompt_ids, resp)
            )
        else:
            prompt = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
            whole.append(call(i, prompt, resp))
            tails.append(call(i, prompt, resp))
    return whole, tails


def test_calls_as_recorded_merge_exactly_as_their_whole_prompts_would():
    """samples.py follows the proxy's parent claims without comparing (or building) prompts: the same samples
    and stats as from every call's whole prompt ids, on random trees with retries and branches."""
    rng = random.Random(1)
    for _ in range(300):
        whole, tails = random_rollout(rng)
        (a, sa), (b, sb) = build_samples(whole), build_samples(tails)
        assert [(s.tokens, s.loss_mask, s.logprobs, s.calls, s.split, s.version) for s in a] == [
            (s.tokens, s.loss_mask, s.logprobs, s.calls, s.split, s.version) for s in b
        ]
        assert sa == sb
        assert (
            build_samples(whole, max_seq_len=7)[1] == build_samples(tails, max_seq_len=7)[1]
        )  # truncation too


def test_a_call_whose_claimed_parent_was_dropped_as_a_retried_attempt_is_placed_by_its_ids():
    # 2 retries 1 (which is dropped: nothing continued from it yet), then 3 continues from 1's answer after all
    calls = [
        call(0, [1], [10]),
        child(1, 0, [5], [11]),
        child(2, 0, [5], [12]),
        child(3, 1, [6], [13]),
    ]
    samples, st = build_samples(calls)
    assert [(s.tokens, s.loss_mask, s.calls) for s in samples] == [
        ([1, 10, 5, 12], [0, 0, 0, 1], [0, 2]),
        ([1, 10, 5, 11, 6, 13], [0, 1, 0, 0, 0, 1], [0, 3]),
    ]
    assert st["split_retry"] == 1 and st["trainable_tokens"] == 3


def test_a_long_rollout_merges_holding_each_id_about_once():
    """200 turns as read_calls gives them: build_samples builds the one leaf's tokens, never each call's whole
    prompt (that was 200 prompts of up to 11k ids: ~9 MB of list here, 2 GB per step at 37k-token rollouts)."""
    import tracemalloc

    calls, nxt = [call(0, range(1000, 2000), [1])], 2
    for i in range(1, 200):
        calls.append(child(i, i - 1, range(nxt, nxt + 40), [nxt + 40] * 10))
        nxt += 50
    tracemalloc.start()
    (s,), st = build_samples(calls)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (
        len(s.tokens) == st["tokens"] == 1000 + 1 + 199 * 50
        and st["trainable_tokens"] == 1 + 199 * 10
    )
    assert st["tokens_unmerged"] > 100 * len(s.tokens)  # what one sample per call would train
    assert peak < 12 * 8 * len(s.tokens), peak  # the sample's few per-token lists, not 200 prompts


def test_duplicate_call_indices_are_an_error_that_says_why():
    with pytest.raises(ValueError, match="call index 0 twice"):
        build_samples([call(0, [1], [10]), call(0, [2], [20])])
