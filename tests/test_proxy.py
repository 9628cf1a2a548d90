"""The proxy on the embedded model: real harness requests, multi-turn token reuse, bad input."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import openai
import pytest
import requests
import torch

from conftest import HARNESS_REQUESTS, NO_CAPTURES, ROOT, capture_marks

from lightning_lite.records import read_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def client(server, rid=None):
    return openai.OpenAI(
        base_url=server.base_url(rid) if rid else server.url + "/v1",
        api_key="sk-test",
        max_retries=0,
    )


def calls_of(server, rid):
    return [
        c
        for c in read_calls(os.path.join(server.out, "calls.jsonl"), whole=True)
        if c.rollout_id == rid
    ]


def teacher_forced(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    n = len(prompt_ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(response_ids)]


def teacher_forced_call(model, call, tok=None):
    """The trainer's logprobs of a call's response under the call's own sampling (temperature, top-k, top-p and, for a
    forced call or a JSON reply, its grammar's masks, replayed with ``tok``)."""
    from lightning_lite.extras import grammar
    from lightning_lite.algo import sampled_logprobs
    from lightning_lite.extras.grammar import unpack_bits

    ids = torch.tensor([call.prompt_ids + call.response_ids])
    n, k = len(call.prompt_ids), len(call.response_ids)
    with torch.no_grad():
        logits = model(ids).logits[0, n - 1 : n - 1 + k]
    V = logits.shape[-1]
    allowed = (
        unpack_bits(grammar.replay(call.grammar, call.response_ids, tok, V), V)
        if call.grammar
        else None
    )
    s = lambda v, dt=torch.float32: torch.full((k,), v, dtype=dt)  # noqa: E731
    return sampled_logprobs(
        logits,
        torch.tensor(call.response_ids),
        s(call.temperature),
        s(call.top_k, torch.long),
        s(call.top_p),
        allowed,
    ).tolist()


# ---------------------------------------------------------------------------- real harness requests


def harness_chat_requests():
    """The project's own fixtures, and the captured requests of real harnesses when that folder is there."""
    out = [
        pytest.param(body, id=f"fixture-{name}")
        for file in ("chat_requests.json", "chat_tool_requests.json")
        for name, body in json.load(open(os.path.join(ROOT, "tests", "fixtures", file))).items()
        if not name.startswith("_")
    ]
    if not os.path.isdir(HARNESS_REQUESTS):
        return out + [pytest.param(None, id="captured", marks=pytest.mark.skip(reason=NO_CAPTURES))]
    for name in sorted(os.listdir(HARNESS_REQUESTS)):
        if not name.endswith(".jsonl"):
            continue
        for i, line in enumerate(open(os.path.join(HARNESS_REQUESTS, name))):
            r = json.loads(line)
            if r.get("method") == "POST" and r["path"].split("?")[0] == "/v1/chat/completions":
                marks = capture_marks(r["body"])
                out.append(pytest.param(r["body"], id=f"{name[:-6]}-{i}", marks=marks))
    return out


def prompt_length(tok, path, body) -> int:
    """The tokens of the prompt the proxy builds for a request to ``path`` (chat completions,
    Anthropic Messages or Responses), rendered fresh: the conversation, then a forced call's opening."""
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.chat import Renderer
    from lightning_lite.extras.anthropic import parse_anthropic_request
    from lightning_lite.extras.responses import parse_responses_request

    parse = {
        "/v1/chat/completions": parse_chat_request,
        "/v1/messages": parse_anthropic_request,
        "/v1/responses": lambda b: parse_responses_request(b, None),
    }[path.split("?")[0]]
    req, r = parse(body), Renderer(tok)
    forced = r.encode(r.forced_prefix(req.force_tool))
    return len(r.build_prompt(req.messages, req.tools, [])[0]) + len(forced)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("body", harness_chat_requests())
def test_replay_harness_request(server, tok, body, stream):
    """Each captured chat request, as its harness sent it (fewer tokens), parses with the openai client:
    one finish reason, the recorded call's (or "tool_calls" when calls came back), and the recorded
    call's prompt and reply lengths in the usage; past the context, OpenAI's context error."""
    body = dict(body, max_tokens=6, stream=stream)
    body.pop("max_completion_tokens", None)
    known = {
        k: body.pop(k)
        for k in (
            "model",
            "messages",
            "tools",
            "tool_choice",
            "stop",
            "max_tokens",
            "temperature",
            "top_p",
            "stream",
            "stream_options",
        )
        if k in body
    }
    rid = "replay-" + uuid.uuid4().hex[:8]
    c = client(server, rid)
    # The embedded model's context is 8192 tokens; some harnesses send more (Qwen Code's system prompt and tools
    # alone are ~19k). Those must get OpenAI's own context error, which the client raises as BadRequestError.
    n_prompt = prompt_length(tok, "/v1/chat/completions", dict(body, **known))
    if n_prompt >= server.proxy.backend.max_model_len:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**known, extra_body=body)
        assert e.value.code == "context_length_exceeded" and calls_of(server, rid) == []
        return
    if stream:
        chunks = list(c.chat.completions.create(**known, extra_body=body))
        (call,) = calls_of(server, rid)
        # The finish reason comes once, wherever it is: a chunk of usage alone may follow it.
        at = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].finish_reason]
        called = any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks)
        finishes = [chunks[i].choices[0].finish_reason for i in at]
        assert finishes == ["tool_calls" if called else call.finish_reason]
        assert all(not ch.choices for ch in chunks[at[0] + 1 :])
        if known.get("stream_options", {}).get("include_usage"):
            usage = chunks[-1].usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (
                n_prompt,
                len(call.response_ids),
            )
    else:
        r = c.chat.completions.create(**known, extra_body=body)
        (call,) = calls_of(server, rid)
        called = bool(r.choices[0].message.tool_calls)
        assert r.choices[0].finish_reason == ("tool_calls" if called else call.finish_reason)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
            n_prompt,
            len(call.response_ids),
        )
        assert r.choices[0].message.content is not None or called
    assert len(call.prompt_ids) == n_prompt and 1 <= len(call.response_ids) <= 6
    assert call.finish_reason in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------------- multi-turn reuse + faithfulness


def test_rewritten_history_renders_fresh_and_says_why(server):
    rid = "rewrite"
    c = client(server, rid)
    msgs = [{"role": "user", "content": "Say hi."}]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    msgs += [
        {"role": "assistant", "content": "something the model never said"},
        {"role": "user", "content": "Again."},
    ]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Unrelated title request"}],
        max_tokens=4,
        temperature=0,
    )
    c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Unrelated title request"}],
        max_tokens=4,
        temperature=0,
    )
    hints = [(x.parent, x.split) for x in calls_of(server, rid)]
    assert hints == [(None, None), (None, "rewrote_history"), (None, "new_thread"), (None, "retry")]


def test_a_turn_the_template_renders_otherwise_is_rendered_fresh_unless_kept(
    backend, tok, tmp_path
):
    """SmolLM2 renders a tool call as pretty JSON; the model wrote it compact. By default the next prompt is the
    template's rendering (what a stock server sends), split as template_mismatch; keep_history_tokens keeps the
    sampled tokens; --no-reuse-tokens renders fresh as well."""
    from lightning_lite.chat import Renderer, Turn, turn_texts

    msgs, tools = [{"role": "user", "content": "2+3?"}], [{"name": "calculator"}]
    r = Renderer(tok)
    ids, _, _ = r.build_prompt(msgs, tools, [])
    resp = r.encode(
        '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
    ) + [tok.eos_token_id]
    reply = r.parse_reply(r.sampled_text(resp, []), True)
    turn = Turn(0, msgs, tools, reply, ids, resp)
    nxt = msgs + [reply, {"role": "tool", "tool_call_id": "x", "content": "5"}]
    fresh, parent, split = r.build_prompt(nxt, tools, [turn])
    assert (parent, split) == (None, "template_mismatch") and tok.decode(fresh) == r.render_text(
        nxt, tools
    )
    assert r.build_prompt(nxt, tools, [turn], reuse=False)[1:] == (None, "template_mismatch")
    kept, parent, split = Renderer(tok, keep_history_tokens=True).build_prompt(nxt, tools, [turn])
    assert (parent, split) == (0, None) and kept[: len(ids) + len(resp)] == ids + resp
    # written as the template writes it, the turn is reused as sampled
    turn_text = turn_texts(r.render_text, msgs + [reply], 2, tools, {}, r.info.per_message).turn
    resp = r.encode(turn_text.removesuffix("\n")[: -len("<|im_end|>")]) + [tok.eos_token_id]
    turn = Turn(0, msgs, tools, r.parse_reply(r.sampled_text(resp, []), True), ids, resp)
    assert r.build_prompt(nxt, tools, [turn])[1:] == (0, None)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_a_thinking_template_on_the_embedded_model_prompts_as_a_stock_server_or_keeps_one_sample(
    backend, tok, tmp_path, keep
):
    """A Qwen3-shaped template (reasoning in <think>, Hermes calls) swapped into the embedded model; a 3-call tool
    conversation whose client echoes what it got (content, tool calls, reasoning_content). By default every prompt
    is exactly the template's rendering of the conversation; with keep_history_tokens the calls are one sample."""
    import copy

    from lightning_lite.chat import Renderer
    from lightning_lite.proxy import Proxy, ProxyServer
    from lightning_lite.samples import build_batch_samples

    t = copy.deepcopy(tok)
    t.chat_template = open(
        os.path.join(ROOT, "tests", "fixtures", "templates", "qwen3.jinja")
    ).read()
    srv = ProxyServer(Proxy(backend, t, out_dir=str(tmp_path), keep_history_tokens=keep)).start()
    try:
        c = openai.OpenAI(base_url=srv.base_url("think"), api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "What is 2+3? Think, then use the calculator."}]
        force, sent = {"type": "function", "function": {"name": "calculator"}}, []
        for turn in range(3):
            sent.append(copy.deepcopy(msgs))
            r = c.chat.completions.create(
                model="m",
                messages=msgs,
                tools=TOOLS,
                tool_choice=force if turn < 2 else "auto",
                max_tokens=16,
                temperature=0.8,
                seed=turn,
            )
            m = r.choices[0].message
            echo = {"role": "assistant", "content": m.content or ""}
            if getattr(m, "reasoning_content", None):
                echo["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                echo["tool_calls"] = [
                    tc.model_dump(include={"id", "type", "function"}) for tc in m.tool_calls
                ]
            msgs += [echo] + [
                {"role": "tool", "tool_call_id": tc.id, "content": "5"} for tc in m.tool_calls or []
            ]
            if not m.tool_calls:
                msgs.append({"role": "user", "content": "Thanks."})
    finally:
        srv.stop()
    calls = read_calls(str(tmp_path / "calls.jsonl"), whole=True)
    assert len(calls) == 3
    samples, stats = build_batch_samples(calls)
    if keep:
        assert [x.parent for x in calls] == [None, 0, 1] and len(samples) == 1
    else:  # the prompt a stock server would build: the template's text of the conversation, plus a forced call's opening
        from lightning_lite.apis import parse_chat_request

        r = Renderer(t)
        for call, m in zip(calls, sent):
            forced = r.forced_prefix("calculator") if call.index < 2 else ""
            assert (
                t.decode(call.prompt_ids)
                == r.render_text(
                    parse_chat_request({"messages": m, "tools": TOOLS}).messages,
                    [TOOLS[0]["function"]],
                )
                + forced
            )
        assert stats["samples"] == 1 + stats["split_template_mismatch"]


def test_completions_api_text_and_token_ids(server, tok, model):
    c = client(server, "completions")
    r = c.completions.create(
        model="m", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
    ids = tok.encode("1, 2, 3,")
    r = c.completions.create(model="m", prompt=ids, max_tokens=3, temperature=1.0, logprobs=1)
    call = calls_of(server, "completions")[-1]
    assert call.prompt_ids == ids and call.api == "completions"
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(call.response_logprobs)
    tf = teacher_forced(model, call.prompt_ids, call.response_ids)
    assert max(abs(a - b) for a, b in zip(tf, call.response_logprobs)) < 2e-3
    # Greedy, streamed and not: the same text (several words, streamed in several pieces), the
    # recorded call's tokens decoded, and the same finish reason, sent once.
    kw = dict(model="m", prompt="Once upon a time", max_tokens=6, temperature=0)
    whole = c.completions.create(**kw).choices[0]
    chunks = list(c.completions.create(stream=True, **kw))
    call = calls_of(server, "completions")[-1]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.text == tok.decode(call.response_ids, skip_special_tokens=True)
    assert len(text.split()) > 1
    finishes = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == [whole.finish_reason] == [call.finish_reason]


def test_stop_strings_and_max_tokens(server):
    c = client(server, "stops")
    r = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count from 1 to 20, one number per line."}],
        max_tokens=40,
        temperature=0,
        stop=["\n"],
    )
    assert "\n" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_choices_are_recorded_as_sibling_calls(server, tok, model):
    """n=2: two choices, each its own call (choice 0, 1) and its own sample; the harness continues one of them."""
    rid = "n-choices"
    c = client(server, rid)
    msgs = [{"role": "user", "content": "Name an animal."}]
    r = c.chat.completions.create(
        model="m", messages=msgs, max_tokens=6, temperature=1.0, top_p=0.8, n=2, seed=3
    )
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == sum(
        len(x.response_ids) for x in calls_of(server, rid)
    )
    msgs += [
        r.choices[1].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Another."},
    ]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=1.0)
    calls = calls_of(server, rid)
    assert [(x.index, x.choice) for x in calls] == [(0, 0), (1, 1), (2, 0)]
    assert (
        calls[0].prompt_ids == calls[1].prompt_ids
        and calls[0].response_ids != calls[1].response_ids
    )
    assert calls[2].parent == 1  # it continues the choice the harness kept
    for x in calls:
        assert (
            max(abs(a - b) for a, b in zip(teacher_forced_call(model, x), x.response_logprobs))
            < 2e-3
        )
    from lightning_lite.samples import build_samples

    samples, st = build_samples(calls)
    assert [s.calls for s in samples] == [[0], [1, 2]] and not any(
        v for k, v in st.items() if k.startswith("split_")
    )
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(x.response_ids) for x in calls)
    chunks = list(
        client(server, rid + "-sse").chat.completions.create(
            model="m", messages=msgs[:1], max_tokens=6, n=2, seed=3, stream=True
        )
    )
    assert sorted({ch.choices[0].index for ch in chunks if ch.choices}) == [0, 1]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].finish_reason) == 2
    r = c.completions.create(model="m", prompt="1, 2, 3,", max_tokens=3, n=3, seed=1)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and [
        x.choice for x in calls_of(server, rid)[-3:]
    ] == [0, 1, 2]


class CannedBackend:
    """Answers every request with the same text, cut by the token cap ("length")."""

    eos_ids, max_model_len, version, stats = set(), 8192, 0, {}

    def __init__(self, tok, text):
        self.ids = tok.encode(text, add_special_tokens=False)
        self.text = text

    async def generate(self, prompt_ids, sampling, on_token=None, rollout_id=""):
        from lightning_lite.backends import Generation

        return Generation(self.ids, [0.0] * len(self.ids), "length", self.text, self.version)


def test_a_cut_reply_that_parses_as_a_tool_call_is_recorded_as_length(tok, tmp_path):
    from lightning_lite.proxy import Proxy, ProxyServer

    srv = ProxyServer(
        Proxy(
            CannedBackend(
                tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}'
            ),
            tok,
            out_dir=str(tmp_path),
        )
    ).start()
    try:
        r = client(srv, "cut").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS, max_tokens=20
        )
    finally:
        srv.stop()
    # the client gets the call it can run; the record keeps the truth: the cap cut the reply
    assert (
        r.choices[0].finish_reason == "tool_calls"
        and r.choices[0].message.tool_calls[0].function.name == "calculator"
    )
    assert [c.finish_reason for c in read_calls(str(tmp_path / "calls.jsonl"))] == ["length"]


def test_models_health_and_root(server):
    assert client(server).models.list().data[0].id == "smollm2"
    assert requests.get(server.url + "/health").json()["status"] == "ok"
    assert requests.head(server.url + "/").status_code == 200
    assert requests.get(server.base_url("x") + "/models").status_code == 200


# ---------------------------------------------------------------------------- errors (the bad-input table is in test_faults.py)


def test_openai_client_sees_errors_as_its_own(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )
    assert e.value.code == "invalid_value" and "max_tokens" in e.value.message


def test_error_types_follow_each_apis_status():
    """Every error answer takes its type from its status, as OpenAI and Anthropic document them."""
    from lightning_lite.proxy import _error

    # a path of each API
    paths = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}

    def kind(api, status):
        return json.loads(_error(paths[api], status, "m").text)["error"]["type"]

    statuses = (400, 401, 404, 405, 413, 429, 502, 504)
    assert [kind("anthropic", s) for s in statuses] == [
        "invalid_request_error",
        "authentication_error",
        "not_found_error",
        "invalid_request_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "timeout_error",
    ]
    assert [kind("openai", s) for s in statuses] == ["invalid_request_error"] * 5 + [
        "rate_limit_error"
    ] + ["server_error"] * 2
    assert _error(paths["openai"], 429, "m", retry_after=2.5).headers["Retry-After"] == "2.5"
    assert "Retry-After" not in _error(paths["anthropic"], 502, "m").headers


def test_reward_endpoint(server):
    r = requests.post(server.url + "/rollout/rewarded/reward", json={"reward": 0.5})
    assert r.status_code == 200 and server.proxy.reward("rewarded") == 0.5


def test_rewards_for_calls_by_index_or_reply_id_land_next_to_the_calls(server):
    """A call is rewarded by its index in the rollout or by the id its reply had (chat, Anthropic, Responses,
    completions ids alike); each accepted reward is a line of rewards.jsonl beside calls.jsonl, the last one counting."""
    rid, url = f"pc-{uuid.uuid4().hex[:8]}", server.url + "/rollout/{}/reward"
    c = client(server, rid)
    first = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    second = c.completions.create(model="m", prompt="Hello", max_tokens=2)
    post = lambda body: requests.post(url.format(rid), json=body)  # noqa: E731
    assert post({"reward": 0.25, "call": 0}).json() == {
        "rollout_id": rid,
        "reward": 0.25,
        "call": 0,
    }
    assert post({"reward": -1, "call": second.id}).json() == {
        "rollout_id": rid,
        "reward": -1.0,
        "call": 1,
    }
    assert (
        post({"reward": 2, "call": first.id, "task": "t1"}).json()["call"] == 0
    )  # again: the last one counts
    assert post({"reward": 1}).status_code == 200
    assert server.proxy.call_rewards(rid) == {0: 2.0, 1: -1.0} and server.proxy.reward(rid) == 1.0
    assert [c.reply_id for c in calls_of(server, rid)] == [first.id, second.id]
    import anthropic  # the Responses and Anthropic ids name their calls too

    third = c.responses.create(model="m", input="Hi", max_output_tokens=2)
    fourth = anthropic.Anthropic(
        base_url=server.url + f"/rollout/{rid}", api_key="x", max_retries=0
    ).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert [post({"reward": 3, "call": x.id}).json()["call"] for x in (third, fourth)] == [2, 3]
    lines = [json.loads(x) for x in open(server.out / "rewards.jsonl") if rid in x]
    assert [(x["reward"], x.get("call"), x.get("task")) for x in lines] == [
        (0.25, 0, None),
        (-1.0, 1, None),
        (2.0, 0, "t1"),
        (1.0, None, None),
        (3.0, 2, None),
        (3.0, 3, None),
    ]
    # a call it does not have, a bool, an unknown key: a 4xx that says what to send, nothing recorded
    for body, status, says in [
        ({"reward": 1, "call": 4}, 404, "has no call 4"),
        ({"reward": 1, "call": "chatcmpl-x"}, 404, "has no call"),
        ({"reward": 1, "call": True}, 404, "has no call"),
        ({"reward": True}, 400, "reward"),
        ({"reward": 1, "turn": 0}, 400, "keys reward, call"),
        ({"reward": 1, "task": 3}, 400, "task"),
    ]:
        r = post(body)
        assert r.status_code == status and says in r.json()["error"]["message"], (body, r.text)
    assert sum(rid in x for x in open(server.out / "rewards.jsonl")) == 6


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_proxy_cli_serves_and_stops_cleanly(tmp_path, sig):
    """python proxy.py serves; Ctrl-C or `kill` (what process managers send) stops it within seconds, even while
    a call is generating, with exit code 0 and every answered call on disk."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    p = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "proxy.py"),
            "--port",
            str(port),
            "--out",
            str(out),
            "--max-batch-size",
            "4",
            "--max-model-len",
            "2048",
            "--max-new-tokens",
            "40",
            "--no-reuse-tokens",
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
            "--model",
            "smollm2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/rollout/cli/v1", api_key="x", max_retries=0
        )
        for _ in range(120):
            try:
                models = c.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        assert models.data[0].max_model_len == 2048
        n = 0
        for i in range(2):
            r = c.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": f"What is {i}+3?"}],
                max_tokens=50,
                temperature=0,
            )
            n += r.usage.completion_tokens
        # a call still generating when the signal comes (it asks for no limit: the cap applies)
        busy = subprocess.Popen(
            [
                "curl",
                "-s",
                "-m",
                "60",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps(
                    {"messages": [{"role": "user", "content": "Write a long essay about rivers."}]}
                ),
            ],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(1.0)
    finally:
        t0 = time.time()
        p.send_signal(sig)
        log, _ = p.communicate(timeout=60)
        busy.kill()
    assert p.returncode == 0 and time.time() - t0 < 20, log
    assert "Traceback" not in log and "terminate called" not in log, log
    calls = read_calls(str(out / "calls.jsonl"))
    assert [c.rollout_id for c in calls[:2]] == ["cli", "cli"] and sum(
        len(c.response_ids) for c in calls[:2]
    ) == n
    # max_tokens 50 asked, 40 allowed: where the cap cut the reply, the record says so
    assert all(
        len(c.response_ids) <= 40 and c.capped == (c.finish_reason == "length") for c in calls
    )


def test_samples_cli_on_calls_recorded_by_the_proxy(server, tmp_path):
    c = client(server, "for-samples")
    msgs = [{"role": "user", "content": "Name a fruit."}]
    for turn in range(2):
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=1.0)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Another one."},
        ]
    c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A side request"}], max_tokens=3
    )
    out = tmp_path / "samples.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_lite.samples",
            os.path.join(server.out, "calls.jsonl"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "samples" in p.stdout and "new_thread" in p.stdout
    mine = [
        json.loads(line) for line in open(out) if json.loads(line)["rollout_id"] == "for-samples"
    ]
    calls = calls_of(server, "for-samples")
    assert len(calls) == 3 and len(mine) == 2  # the two turns merged, the side request on its own
    for s in mine:
        assert len(s["tokens"]) == len(s["loss_mask"]) == len(s["logprobs"])
        assert all(lp == 0.0 for m, lp in zip(s["loss_mask"], s["logprobs"]) if not m)
    assert sum(sum(s["loss_mask"]) for s in mine) == sum(len(c.response_ids) for c in calls)


def test_the_core_takes_its_plain_path_where_an_extra_is_missing(tok, monkeypatch):
    """hooks.grammar NoGrammar: a forced call is opened by the prompt alone, its arguments unconstrained;
    hooks.isolation NoIsolation: rollout_tokens is refused naming extras/isolation.py; a rollout's own
    socket needs rollout_tokens; an unknown tool-call format lists the registered ones."""
    from types import SimpleNamespace

    from lightning_lite import hooks, toolcalls
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.proxy import Exchange, Proxy, ProxyServer, Session

    backend = SimpleNamespace(max_model_len=8192, paused=False, eos_ids=None)
    proxy = Proxy(backend, tok)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "2+3?"}], "tools": tools}
    body["tool_choice"] = {"type": "function", "function": {"name": "calc"}}
    monkeypatch.setattr(hooks, "grammar", hooks.NoGrammar())
    req = parse_chat_request(body, {})
    exchange = Exchange("r", Session(), "chat", req)
    proxy.build_prompt(exchange)
    assert exchange.forced == '<tool_call>\n{"name": "calc", "arguments":'
    assert req.sampling.grammar is None
    assert tok.decode(exchange.prompt_ids).endswith(exchange.forced)
    with pytest.raises(
        ValueError, match="needs Proxy.rollout_tokens=True. and .*extras/isolation.py"
    ):
        ProxyServer(proxy).endpoint("r", "m", socket=True)
    monkeypatch.setattr(hooks, "isolation", hooks.NoIsolation)
    with pytest.raises(ValueError, match="rollout_tokens needs lightning_lite/extras/isolation.py"):
        Proxy(backend, tok, rollout_tokens=True)
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'; use one of hermes, "):
        toolcalls.format_of("nope")
    monkeypatch.setattr(hooks, "TOOL_FORMATS", {"hermes": toolcalls.HERMES})
    with pytest.raises(ValueError, match="needs lightning_lite/extras/tool_formats.py"):
        toolcalls.format_of("mistral")
