"""HFBackend: the sampled distribution's logprobs, batching, stop conditions, pause and weight sync."""

import asyncio
import math
import os
import threading
import time

import pytest
import torch

from lightning_lite.backends import draw, release_cpu_threads, sample_token
from lightning_lite.chat import Sampling


def test_sample_token_logprob_is_that_of_the_truncated_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # top_k=2 keeps {0.5, 0.3} -> renormalized 0.625 / 0.375
    seen = {
        sample_token(logits, Sampling(top_k=2), torch.Generator().manual_seed(s)) for s in range(40)
    }
    assert {t for t, _ in seen} == {0, 1}
    for t, lp in seen:
        assert math.isclose(lp, math.log([0.625, 0.375][t]), rel_tol=1e-5)
    # top_p=0.7: 0.5 alone < 0.7, so {0.5, 0.3} is the smallest set reaching it
    for s in range(20):
        t, lp = sample_token(logits, Sampling(top_p=0.7), torch.Generator().manual_seed(s))
        assert t in (0, 1) and math.isclose(lp, math.log([0.625, 0.375][t]), rel_tol=1e-5)
    # temperature 2: softmax(log p / 2) = sqrt(p) / sum(sqrt(p))
    q = torch.sqrt(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    t, lp = sample_token(logits, Sampling(temperature=2.0), torch.Generator().manual_seed(0))
    assert math.isclose(lp, math.log(q[t] / q.sum()), rel_tol=1e-5)
    # greedy reports the plain model logprob of the argmax
    t, lp = sample_token(logits, Sampling(temperature=0))
    assert t == 0 and math.isclose(lp, math.log(0.5), rel_tol=1e-6)


def test_draw_follows_the_probabilities_and_never_draws_a_token_of_probability_zero(monkeypatch):
    # unnormalized, as a renormalized support's exp may be: 1 : 3 : 0 : 4
    probs = torch.tensor([0.1, 0.3, 0.0, 0.4])
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(
        torch.tensor([draw(probs, generator) for _ in range(8000)]), minlength=4
    )
    assert counts[2] == 0
    # 1/8, 3/8, 4/8 within 4 standard errors (sd of a share over 8000 draws <= 0.0056)
    assert torch.allclose(
        counts.double() / 8000, torch.tensor([0.125, 0.375, 0, 0.5]).double(), atol=0.023
    )
    # the same seed, the same token
    again = [draw(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    assert again == [draw(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    # every uniform 0 (each clock raised to the same finite time): the likeliest token wins, never
    # one of probability 0
    monkeypatch.setattr(torch, "rand", lambda shape, **k: torch.zeros(shape))
    assert draw(torch.tensor([0.0, 0.2, 0.0, 0.1])) == 1


def test_logits_that_differ_by_float_noise_draw_the_same_token():
    """What a seed draws survives float noise in the logits (a resumed run's weights, another
    batch shape, a cached prefix): a resumed run's evaluation samples what the uninterrupted run
    did. An inverse-CDF draw, which reads a cumulative sum at one uniform number, moved ~4.5% of
    these draws."""
    generator = torch.Generator().manual_seed(0)
    moved = 0
    for seed in range(1000):
        # [V]: a few likely tokens and a long tail, as an LM's at temperature 1
        logits = torch.randn(49152, generator=generator) * 2.5
        logits[torch.randint(49152, (5,), generator=generator)] += 12
        noisy = logits + 1e-4 * torch.randn(49152, generator=generator)
        token = draw(torch.softmax(logits, -1), torch.Generator().manual_seed(seed))
        moved += token != draw(torch.softmax(noisy, -1), torch.Generator().manual_seed(seed))
    assert moved <= 2, f"{moved} of 1000 draws moved under a logit noise of 1e-4"


def _prompt(tok, text):
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def test_concurrent_requests_are_batched_and_match_teacher_forcing(backend, tok, model):
    prompts = [
        tok.encode(_prompt(tok, q))
        for q in ["Name a fruit.", "What is 4+4?", "Say a long sentence about cats and dogs."]
    ]
    before = dict(backend.stats)

    async def go():
        return await asyncio.gather(
            *[
                backend.generate(p, Sampling(max_tokens=6, seed=i, top_k=40))
                for i, p in enumerate(prompts)
            ]
        )

    gens = asyncio.run(go())
    assert backend.stats["requests"] - before["requests"] == 3
    assert backend.stats["batches"] - before["batches"] < 3  # at least two of them shared a batch
    for p, g in zip(prompts, gens):
        assert 1 <= len(g.response_ids) <= 6 and len(g.logprobs) == len(g.response_ids)
        with torch.no_grad():
            logits = model(torch.tensor([p + g.response_ids])).logits[0]
        for i, (t, lp) in enumerate(zip(g.response_ids, g.logprobs)):
            row = logits[len(p) - 1 + i]
            kth = torch.topk(row, 40).values[-1]
            ref = torch.log_softmax(row.masked_fill(row < kth, float("-inf")), -1)[t].item()
            assert abs(ref - lp) < 2e-3


def test_prefix_cache_hit_gives_the_same_tokens(backend, tok):
    p = tok.encode(_prompt(tok, "Tell me about the moon in one sentence, please, with details."))

    async def go():
        return [await backend.generate(p, Sampling(max_tokens=5, seed=7)) for _ in range(2)]

    cached = backend.stats["cached_tokens"]
    a, b = asyncio.run(go())
    assert (
        backend.stats["cached_tokens"] - cached >= len(p) - 1
    )  # the second prefill reused the first's KV
    assert a.response_ids == b.response_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_prefix_cache_keeps_longest_prefixes_and_evicts_the_least_recently_used():
    from lightning_lite.extras.fast_decode import PrefixCache

    def kv(n):
        return [(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))]

    c = PrefixCache(max_tokens=40)
    a, b = list(range(20)), list(range(100, 115))
    c.store(a[:10], kv(10))
    c.store(a, kv(20))  # extends the first entry: it replaces it
    c.store(b, kv(15))
    assert [entry[1] for entry in c.entries] == [a, b]
    n, hit, logits = c.lookup(a + [7])
    assert n == 20 and hit[0][0].shape[2] == 20 and logits is None
    assert c.lookup(a)[0] == 19  # one token is left to prefill
    assert c.lookup(a[:7] + [0, 1])[0] == 0  # a shared prefix under 8 tokens is not worth it
    c.store(list(range(200, 210)), kv(10))  # 45 tokens > 40: b, the least recently used, leaves
    assert [entry[1][0] for entry in c.entries] == [0, 200]
    c.store(list(range(41)), kv(41))  # longer than the whole cache: not kept
    assert [entry[1][0] for entry in c.entries] == [0, 200]
    # --lora-per-harness: another adapter's KV is another model's: never a hit, never redundant
    c.max_tokens = 60
    c.store(a[:12], kv(12), "coder")
    assert c.lookup(a[:12] + [7], "planner")[0] == 0
    assert c.lookup(a + [7])[0] == 20 and c.lookup(a + [7], "coder")[0] == 12
    assert [(entry[0], entry[1][0]) for entry in c.entries] == [
        (None, 200),
        (None, 0),
        ("coder", 0),
    ]
    # A prompt stored with the logits after it (a GRPO group's): all of it is a hit, nothing to
    # prefill; a longer prompt or another one still prefills its rest.
    c = PrefixCache()
    c.store(b, kv(15), logits=torch.arange(3.0))
    n, hit, logits = c.lookup(b)
    assert n == 15 and hit[0][0].shape[2] == 15 and logits.tolist() == [0.0, 1.0, 2.0]
    n, hit, logits = c.lookup(b + [7])
    assert n == 15 and logits is None
    n, hit, logits = c.lookup(b[:-1] + [0])
    assert n == 14 and logits is None
    assert c.lookup(b, "coder") == (0, None, None)


def test_eos_and_context_limit(backend, tok, model):
    p = tok.encode(_prompt(tok, "What is 2+3?"))  # greedy: "2 + 3 = 5" and EOS
    g = asyncio.run(backend.generate(p, Sampling(max_tokens=30, temperature=0)))
    assert (
        g.finish_reason == "stop"
        and g.response_ids[-1] == tok.eos_token_id
        and "<|im_end|>" not in g.text
    )
    # a prompt that fills the context leaves room for the rest only
    from lightning_lite.backends import HFBackend

    small = HFBackend(model, tok, max_model_len=128)  # a short context keeps this test fast
    try:
        long = (p * 128)[:126]
        g = asyncio.run(small.generate(long, Sampling(max_tokens=100, temperature=0)))
        assert len(g.response_ids) == 2 and g.finish_reason == "length"
    finally:
        small.close()


def test_pause_holds_requests_and_sync_weights_bumps_version(backend, tok):
    p = tok.encode(_prompt(tok, "Hi"))
    asyncio.run(backend.generate(p, Sampling(max_tokens=2)))
    assert backend.prefix_cache.entries
    backend.pause()
    assert (
        not backend.prefix_cache.entries
    )  # the KV cache is gone before training: the weights change, training gets the memory
    done = threading.Event()
    result = {}

    def run():
        result["g"] = asyncio.run(backend.generate(p, Sampling(max_tokens=2)))
        done.set()

    threading.Thread(target=run).start()
    time.sleep(1.0)
    assert not done.is_set()  # paused: nothing generates while the trainer owns the weights
    v = backend.version
    backend.sync_weights()
    assert backend.version == v + 1
    backend.resume()
    assert done.wait(60) and result["g"].version == v + 1


def test_each_side_lets_its_openmp_threads_go_when_it_hands_over_the_cpus(backend, tok):
    """Two OpenMP teams on few CPUs make each small parallel region pay a wake-up (decoding 30%
    slower on 2 cores: release_cpu_threads): the backend's worker lets its team go once it is idle,
    and resume() lets the caller's (the trainer's) go."""
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP team to let go")

    def threads():
        return set(os.listdir("/proc/self/task"))

    p = tok.encode(_prompt(tok, "Hi"))
    release_cpu_threads()
    asyncio.run(backend.generate(p, Sampling(max_tokens=2)))
    # returns once the worker is idle
    backend.pause()
    # the trainer's work: a parallel region on this thread starts this thread's team
    before = threads()
    torch.randn(1000, 1000) @ torch.randn(1000, 1000)
    team = threads() - before
    assert len(team) == torch.get_num_threads() - 1
    backend.resume()
    assert not team & threads()
    # the worker's team started for this generation, and went when it was done
    before = threads()
    asyncio.run(backend.generate(p, Sampling(max_tokens=2)))
    backend.pause()
    assert not threads() - before
    backend.resume()


def test_a_call_in_flight_during_a_weight_sync_finishes_on_the_old_version(backend, tok):
    """pause() lets the running batch finish under the weights it started with (recorded as that version);
    calls that come after the sync are served by the new version."""
    p = tok.encode(_prompt(tok, "Tell me a story about a cat."))
    started, result = threading.Event(), {}
    gen = backend.generate(p, Sampling(max_tokens=24), on_token=lambda t: started.set())
    th = threading.Thread(target=lambda: result.update(g=asyncio.run(gen)))
    th.start()
    assert started.wait(60)
    v = backend.version
    backend.pause()  # returns once the call in flight is done
    th.join(60)
    assert result["g"].version == v and result["g"].finish_reason in ("stop", "length")
    backend.sync_weights()
    backend.resume()
    assert asyncio.run(backend.generate(p, Sampling(max_tokens=2))).version == v + 1


def test_decoding_reads_kv_heads_in_place_with_the_same_numbers():
    """The two copies a decode step no longer makes: grouped query heads give transformers' attention with
    repeated KV heads, and a cache layer that appends in place holds what DynamicCache's torch.cat holds,
    through row selection and trimming as the batching loop does them."""
    import types

    from transformers.cache_utils import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lightning_lite.extras.fast_decode import RoomyLayer, _grouped_sdpa

    g = torch.Generator().manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = (
        torch.randn(2, 9, 1, 16, generator=g),
        torch.randn(2, 3, 50, 16, generator=g),
        torch.randn(2, 3, 50, 16, generator=g),
    )
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    mask[1, ..., :7] = False  # a left-padded row
    ours, theirs = (
        _grouped_sdpa(module, q, k, v, mask, scaling=0.25)[0],
        sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0],
    )
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-6)
    roomy, plain = (
        DynamicCache(ddp_cache_data=[(k.clone(), v.clone())]),
        DynamicCache(ddp_cache_data=[(k.clone(), v.clone())]),
    )
    roomy.layers[0].__class__ = RoomyLayer
    for i in range(300):
        new = torch.randn(roomy.layers[0].keys.shape[0], 3, 1, 16, generator=g)
        a, b = roomy.layers[0].update(new, -new), plain.layers[0].update(new, -new)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        if i == 100:  # a row finished
            roomy.batch_select_indices(torch.tensor([1]))
            plain.batch_select_indices(torch.tensor([1]))
        if i == 200:  # padding columns trimmed
            for layer in (roomy.layers[0], plain.layers[0]):
                layer.keys, layer.values = layer.keys[:, :, 5:], layer.values[:, :, 5:]
    assert roomy.layers[0]._buf[0].shape[2] - roomy.get_seq_length() <= 256  # room, not a doubling


def test_a_few_rows_without_gradient_multiply_weight_first_with_the_same_numbers():
    """_skinny_linear is nn.Linear's product: (W @ x^T)^T to float noise at up to SKINNY_ROWS rows
    without gradient; F.linear itself with more rows or with gradient (the trainer's forward)."""
    from lightning_lite.extras.fast_decode import SKINNY_ROWS, _skinny_linear

    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 200)
    # [2, 4, 96]: 8 rows, as a decode step of batch 8 gives them
    x = torch.randn(2, 4, 96, generator=g)
    with torch.no_grad():
        ours, theirs = _skinny_linear(layer, x), layer(x)
        assert ours.shape == (2, 4, 200) and torch.allclose(ours, theirs, atol=1e-5)
        # no rows at all: an empty product of the right shape
        assert _skinny_linear(layer, torch.zeros(0, 1, 96)).shape == (0, 1, 200)
        # more rows: F.linear's own numbers, bit for bit
        wide = torch.randn(SKINNY_ROWS + 1, 96, generator=g)
        assert torch.equal(_skinny_linear(layer, wide), layer(wide))
    # with gradient: F.linear, and the gradient reaches the weights
    ours = _skinny_linear(layer, x)
    assert torch.equal(ours, layer(x))
    ours.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_without_the_fast_decode_extra_the_backend_decodes_the_same_tokens(
    backend, tok, model, monkeypatch
):
    """extras/fast_decode.py is optional: without it (hooks.fast_decode the core's do-nothing
    NoFastDecode) the batch keeps transformers' own attention and cache layers, and a batch of two
    greedy replies is the same."""
    from lightning_lite import hooks
    from lightning_lite.backends import HFBackend

    prompts = [tok.encode(_prompt(tok, q)) for q in ["What is 4+4?", "Name three fruits."]]

    def replies(b):
        async def go():
            greedy = Sampling(max_tokens=8, temperature=0)
            return await asyncio.gather(*[b.generate(p, greedy) for p in prompts])

        return asyncio.run(go())

    fast = replies(backend)
    fast_decode = hooks.fast_decode
    monkeypatch.setattr(hooks, "fast_decode", hooks.NoFastDecode())
    model.set_attn_implementation("sdpa")
    # the linear layers' own forward again, not install()'s _skinny_linear
    for module in model.modules():
        module.__dict__.pop("forward", None)
    plain = HFBackend(model, tok)
    try:
        slow = replies(plain)
    finally:
        plain.close()
        fast_decode.install(model)
    assert model.config._attn_implementation == "grouped_sdpa"
    assert model.lm_head.forward.__func__ is fast_decode._skinny_linear
    for a, b in zip(fast, slow):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_grammar_without_the_grammar_extra_fails_its_request(backend, tok, monkeypatch):
    """Only extras/grammar.py sets a request's grammar; without it such a request fails, naming
    the file, and the backend serves the next one."""
    from lightning_lite import hooks

    monkeypatch.setattr(hooks, "grammar", hooks.NoGrammar())
    p = tok.encode(_prompt(tok, "Say yes."))
    with pytest.raises(RuntimeError, match="extras/grammar.py"):
        asyncio.run(backend.generate(p, Sampling(max_tokens=2, grammar='start: "yes"')))
    assert len(asyncio.run(backend.generate(p, Sampling(max_tokens=2))).response_ids) >= 1


def test_a_model_with_recurrent_layers_is_refused_at_start_naming_them_and_vllm(tok):
    """Qwen3.5's linear-attention layers keep a recurrent state, not keys and values: decoding them
    with the batch's KV cache failed every call (an IndexError inside the model). The backend now
    refuses such a model when it is built, and says which backend serves it."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from lightning_lite.backends import HFBackend

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2)
    shape |= dict(linear_num_key_heads=2, linear_num_value_heads=2)
    shape |= dict(linear_key_head_dim=16, linear_value_head_dim=16)
    config = Qwen3_5TextConfig(vocab_size=len(tok), **shape)
    assert "linear_attention" in config.layer_types
    net = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"\['linear_attention'\].*--backend vllm"):
        HFBackend(net, tok)
