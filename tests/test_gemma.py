"""A second real model, of another family: the base Gemma 3 270M (make setup-gemma) through the proxy.

Gemma 3's template renders no tools and wants roles to alternate, so the proxy writes the tools into the system
prompt in the Hermes convention and merges consecutive turns; its layers mix sliding-window and full attention.
A three-call tool conversation: every prompt the template's text, every logprob the trainer's."""

import copy
import os

import openai
import pytest

from lightning_lite.models import cache_dir

if not os.path.exists(os.path.join(cache_dir(), "gemma3-270m", "config.json")):
    pytest.skip(
        "Gemma 3 270M is not converted into the cache: run `make setup-gemma`",
        allow_module_level=True,
    )

from test_proxy import TOOLS, teacher_forced_call  # noqa: E402

from lightning_lite.records import read_calls  # noqa: E402


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Tokenizer, model and a proxy serving them through the embedded backend."""
    from lightning_lite.backends import HFBackend
    from lightning_lite.models import load_model, load_tokenizer
    from lightning_lite.proxy import Proxy, ProxyServer

    tok, model = load_tokenizer("gemma3-270m"), load_model("gemma3-270m").eval()
    backend = HFBackend(model, tok)
    out = str(tmp_path_factory.mktemp("gemma"))
    srv = ProxyServer(Proxy(backend, tok, model_name="gemma3-270m", out_dir=out)).start()
    srv.out, srv.model = out, model
    yield tok, srv
    srv.stop()
    backend.close()


def test_gemma_template_is_detected_as_hermes_with_merged_roles(gemma):
    tok, srv = gemma
    r = srv.proxy.renderer
    assert (r.info.native_tools, r.format, r.info.dialects) == (False, "hermes", ["merge_roles"])
    text = r.render_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [TOOLS[0]["function"]],
    )
    # the template writes <bos> itself and folds the system prompt (with the tools) into the first user turn
    assert (
        text.startswith("<bos><start_of_turn>user\nBe brief.")
        and '"name": "calculator"' in text
        and text.endswith("<start_of_turn>model\n")
    )
    assert text.count("<start_of_turn>user") == 1


def test_gemma_tool_conversation_is_token_exact(gemma):
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.samples import build_batch_samples

    tok, srv = gemma
    c = openai.OpenAI(base_url=srv.base_url("gemma-tools"), api_key="x", max_retries=0)
    msgs = [
        {"role": "system", "content": "You are a calculator agent."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    force = {"type": "function", "function": {"name": "calculator"}}
    sent = []
    for turn in range(3):
        sent.append(copy.deepcopy(msgs))
        r = c.chat.completions.create(
            model="gemma3-270m",
            messages=msgs,
            tools=TOOLS,
            tool_choice=force if turn == 0 else "auto",
            max_tokens=24 if turn == 0 else 8,
            temperature=0.7,
            seed=turn,
        )
        m = r.choices[0].message
        tool_calls = [
            tc.model_dump(include={"id", "type", "function"}) for tc in m.tool_calls or []
        ]
        if turn == 0 and not tool_calls:
            # A base model copies the schema into the arguments (greedy too) and does not close the call in a few
            # tokens: the client sends the call it would have made, as a harness echoing its own history does.
            assert r.choices[0].finish_reason == "length"
            tool_calls = [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ]
        echo = {"role": "assistant", "content": "" if tool_calls else m.content or ""} | (
            {"tool_calls": tool_calls} if tool_calls else {}
        )
        # a tool result and then a user message right after it: two user turns for Gemma, which the proxy merges
        msgs += [echo] + [
            {"role": "tool", "tool_call_id": tc["id"], "content": "5"} for tc in tool_calls
        ]
        msgs.append({"role": "user", "content": "Now add 1." if turn == 0 else "Thanks."})
    calls = [
        x
        for x in read_calls(os.path.join(srv.out, "calls.jsonl"), whole=True)
        if x.rollout_id == "gemma-tools"
    ]
    assert len(calls) == 3 and all(
        x.finish_reason in ("stop", "length", "tool_calls") for x in calls
    )
    second = tok.decode(
        calls[1].prompt_ids
    )  # the result and the next question: one user turn, after the model's
    assert second.count("<start_of_turn>user") == 2 and second.index(
        "<tool_response>"
    ) < second.index("Now add 1.")
    assert (
        "<end_of_turn>" not in second[second.index("<tool_response>") : second.index("Now add 1.")]
    )
    r = srv.proxy.renderer
    for x, m in zip(calls, sent):
        forced = r.forced_prefix("calculator") if x.index == 0 else ""
        want = (
            r.render_text(
                parse_chat_request({"messages": m, "tools": TOOLS}).messages, [TOOLS[0]["function"]]
            )
            + forced
        )
        parent = calls[x.parent] if x.parent is not None else None
        assert tok.decode(x.prompt_ids) == want or (
            parent
            and x.prompt_ids[: len(parent.prompt_ids) + len(parent.response_ids)]
            == parent.prompt_ids + parent.response_ids
        )
        assert (
            max(
                abs(a - b)
                for a, b in zip(teacher_forced_call(srv.model, x, tok), x.response_logprobs)
            )
            < 2e-3
        )
    samples, stats = build_batch_samples(calls)
    assert samples and stats["samples"] >= 1
    assert all(len(s.tokens) == len(s.loss_mask) == len(s.logprobs) for s in samples)


def test_gemma_sliding_window_layers_past_their_window_in_a_batch(gemma):
    """Prompts longer than the 512-token sliding window, decoded in one batch with a short one (left-padded caches):
    every logprob is still the one-pass forward's, so the backend masks Gemma's sliding layers right."""
    from concurrent.futures import ThreadPoolExecutor

    tok, srv = gemma
    long = " ".join(f"item {i} costs {i % 7} coins;" for i in range(120)) + " What is the total?"
    bodies = [("gemma-long", long), ("gemma-short", "Count to three.")]

    def ask(rid_text):
        c = openai.OpenAI(base_url=srv.base_url(rid_text[0]), api_key="x", max_retries=0)
        return c.chat.completions.create(
            model="gemma3-270m",
            messages=[{"role": "user", "content": rid_text[1]}],
            max_tokens=8,
            temperature=1.0,
        )

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, bodies))
    calls = [
        x
        for x in read_calls(os.path.join(srv.out, "calls.jsonl"), whole=True)
        if x.rollout_id in ("gemma-long", "gemma-short")
    ]
    assert len(calls) == 2 and max(len(x.prompt_ids) for x in calls) > 512 + 100
    for x in calls:
        assert (
            max(
                abs(a - b)
                for a, b in zip(teacher_forced_call(srv.model, x, tok), x.response_logprobs)
            )
            < 2e-3
        )
