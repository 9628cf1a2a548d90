"""The three API shapes through their official clients (openai: chat and responses; anthropic: messages),
stream and not, on the embedded model: one conversation, token reuse, live streaming, errors in each format."""

import json
import os
import time
import uuid

import anthropic
import openai
import pytest
import requests
import torch

from conftest import HARNESS_REQUESTS, NO_CAPTURES, ROOT, capture_marks
from test_proxy import calls_of, client, prompt_length, teacher_forced_call

from lightning_lite.extras import grammar
from lightning_lite.algo import collate, trainer_logprobs
from lightning_lite.samples import build_samples

SYSTEM, QUESTION = "Use the calculator tool for arithmetic.", "What is 17*23, then plus 5?"
CALC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
SEEDS = [1, 1, 0]  # sampling seeds for which the model completes both forced calls as valid JSON
FORCE = [True, True, False]  # the first two turns name the tool (tool_choice), the third is free


class Chat:
    """A harness on chat completions: keeps the messages, sends tool results back."""

    def __init__(self, server, rid):
        self.c, self.msgs = (
            client(server, rid),
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        )

    def turn(self, force, seed, stream):
        choice = {"type": "function", "function": {"name": "calculator"}} if force else "auto"
        kw = dict(
            model="smollm2",
            messages=self.msgs,
            tools=[{"type": "function", "function": CALC}],
            tool_choice=choice,
            max_tokens=32,
            temperature=1.0,
            seed=seed,
        )
        if stream:
            content, calls = "", {}
            for ch in self.c.chat.completions.create(stream=True, **kw):
                d = ch.choices[0].delta if ch.choices else None
                content += (d.content or "") if d else ""
                for tc in (d.tool_calls or []) if d else []:
                    calls.setdefault(
                        tc.index,
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {"name": tc.function.name, "arguments": ""},
                        },
                    )
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
            msg = {
                "role": "assistant",
                "content": content or None,
                **({"tool_calls": list(calls.values())} if calls else {}),
            }
        else:
            msg = (
                self.c.chat.completions.create(**kw)
                .choices[0]
                .message.model_dump(exclude_none=True)
            )
        self.msgs.append(msg)
        for tc in msg.get("tool_calls", []):
            self.msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": "391"})
        if not msg.get("tool_calls"):
            self.msgs.append({"role": "user", "content": "Go on."})
        return [tc["function"]["name"] for tc in msg.get("tool_calls", [])]


class Responses:
    """A harness on the Responses API (as Codex and the Agents SDK send it: the whole input every turn)."""

    def __init__(self, server, rid):
        self.c, self.input = client(server, rid), [{"role": "user", "content": QUESTION}]

    def turn(self, force, seed, stream):
        kw = dict(
            model="smollm2",
            instructions=SYSTEM,
            input=self.input,
            tools=[{"type": "function", **CALC}],
            max_output_tokens=32,
            temperature=1.0,
            tool_choice={"type": "function", "name": "calculator"} if force else "auto",
            extra_body={"seed": seed},
            store=False,
        )
        if stream:
            events = list(self.c.responses.create(stream=True, **kw))
            seqs = [e.sequence_number for e in events]
            assert seqs == list(range(len(seqs))) and events[0].type == "response.created"
            assert events[-1].type in ("response.completed", "response.incomplete")
            r = events[-1].response
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "".join(
                c.text for o in r.output if o.type == "message" for c in o.content
            )
            args = "".join(
                e.delta for e in events if e.type == "response.function_call_arguments.delta"
            )
            assert args == "".join(o.arguments for o in r.output if o.type == "function_call")
        else:
            r = self.c.responses.create(**kw)
        names = []
        for o in r.output:
            if o.type == "function_call":
                names.append(o.name)
                self.input += [
                    {
                        "type": "function_call",
                        "call_id": o.call_id,
                        "name": o.name,
                        "arguments": o.arguments,
                    },
                    {"type": "function_call_output", "call_id": o.call_id, "output": "391"},
                ]
            else:
                self.input.append({"role": "assistant", "content": o.content[0].text})
        if not names:
            self.input.append({"role": "user", "content": "Go on."})
        return names


class Messages:
    """A harness on Anthropic Messages (as Claude Code sends it)."""

    def __init__(self, server, rid):
        self.c = anthropic.Anthropic(
            base_url=f"{server.url}/rollout/{rid}", api_key="sk-test", max_retries=0
        )
        self.msgs = [{"role": "user", "content": QUESTION}]

    def turn(self, force, seed, stream):
        kw = dict(
            model="smollm2",
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            messages=self.msgs,
            tools=[
                {
                    "name": CALC["name"],
                    "description": CALC["description"],
                    "input_schema": CALC["parameters"],
                }
            ],
            max_tokens=32,
            tool_choice={"type": "tool", "name": "calculator"} if force else {"type": "auto"},
            extra_body={"seed": seed, "temperature": 1.0},
        )
        if stream:
            with self.c.messages.stream(**kw) as s:
                kinds = [e.type for e in s]
                m = s.get_final_message()
            assert (
                kinds[0] == "message_start"
                and kinds[-1] == "message_stop"
                and "message_delta" in kinds
            )
        else:
            m = self.c.messages.create(**kw)
        self.msgs.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        self.msgs.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": "391"} for b in uses
                ]
                or "Go on.",
            }
        )
        assert (
            m.stop_reason == ("tool_use" if uses else m.stop_reason) and m.usage.output_tokens > 0
        )
        return [b.name for b in uses]


@pytest.fixture(scope="module")
def kept(backend, tok, tmp_path_factory):
    """A proxy that keeps the sampled tokens of every echoed turn (keep_history_tokens): the 135M model writes
    replies its template renders otherwise (text after a call), which by default split (tests/test_families.py)."""
    from lightning_lite.proxy import Proxy, ProxyServer

    out = tmp_path_factory.mktemp("kept")
    srv = ProxyServer(Proxy(backend, tok, out_dir=str(out), keep_history_tokens=True)).start()
    srv.out = out
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", [Chat, Responses, Messages], ids=["chat", "responses", "anthropic"])
def test_three_turn_tool_conversation_in_each_api_is_one_sample(kept, model, tok, api, stream):
    """The same conversation (same seeds, so the same sampled tokens) through each API shape: the proxy
    records prompt ids that extend the previous call's prompt + response ids, and the calls merge into one
    sample whose logprobs the trainer reproduces."""
    server = kept
    rid = f"three-turn-{api.__name__}-{'sse' if stream else 'json'}"
    h = api(server, rid)
    names = [h.turn(force, seed, stream) for force, seed in zip(FORCE, SEEDS)]
    assert (
        names[0] == names[1] == ["calculator"]
    )  # tool_choice names the function: the proxy starts the call, the model fills it in
    calls = calls_of(server, rid)
    assert [c.index for c in calls] == [0, 1, 2] and {c.api for c in calls} == {
        api.__name__.lower().replace("messages", "anthropic")
    }
    for prev, cur in zip(calls, calls[1:]):
        assert (
            cur.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)]
            == prev.prompt_ids + prev.response_ids
        )
        assert cur.parent == prev.index and cur.split is None
    for call in calls:  # invariant 1, per call ...
        assert (
            max(
                abs(a - b)
                for a, b in zip(teacher_forced_call(model, call, tok), call.response_logprobs)
            )
            < 2e-3
        )
    samples, stats = build_samples(calls)  # ... and on the merged sample
    assert len(samples) == 1 and stats["samples"] == 1
    s = samples[
        0
    ]  # the forced calls' tokens under their grammars' replayed masks, as train.py scores them
    b = collate(samples, [1.0])
    replay = grammar.Replay(samples, tok, model.config.vocab_size)
    with torch.no_grad():
        assert (trainer_logprobs(model, b, allowed=replay) - b["old_logprobs"])[
            b["loss_mask"] > 0
        ].abs().max() < 2e-3
    assert sum(s.loss_mask) == sum(len(c.response_ids) for c in calls) and set(s.grammars) == {0, 1}


def test_the_same_conversation_is_one_internal_conversation_in_every_api(tok):
    """A tool-using exchange written in each API shape maps to the same messages, hence the same prompt ids."""
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.extras.anthropic import parse_anthropic_request
    from lightning_lite.extras.responses import parse_responses_request
    from lightning_lite.chat import Renderer

    args = {"expression": "17*23"}
    chat = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": json.dumps(args)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "391"},
            ],
            "tools": [{"type": "function", "function": CALC}],
        }
    )
    resp = parse_responses_request(
        {
            "instructions": SYSTEM,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                {"type": "reasoning", "id": "rs", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "calculator",
                    "arguments": json.dumps(args),
                },
                {"type": "function_call_output", "call_id": "c1", "output": "391"},
            ],
            "tools": [{"type": "function", **CALC}, {"type": "web_search"}],
        },
        lambda _: [],
    )
    anth = parse_anthropic_request(
        {
            "system": [{"type": "text", "text": SYSTEM}],
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "c1", "name": "calculator", "input": args}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "c1",
                            "content": [{"type": "text", "text": "391"}],
                        }
                    ],
                },
            ],
            "tools": [
                {
                    "name": "calculator",
                    "description": CALC["description"],
                    "input_schema": CALC["parameters"],
                }
            ],
        }
    )
    assert (
        chat.messages == resp.messages == anth.messages and chat.tools == resp.tools == anth.tools
    )
    r = Renderer(tok)
    assert r.build_prompt(chat.messages, chat.tools, []) == r.build_prompt(
        anth.messages, anth.tools, []
    )


def test_streaming_sends_tokens_as_they_are_sampled(server):
    """Time to the first content delta is a fraction of the whole generation (not sent after it)."""
    c = client(server, "live")
    t0 = time.time()
    stream = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    first, text = None, ""
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.time() - t0
            text += ch.choices[0].delta.content
    total = time.time() - t0
    (call,) = calls_of(server, "live")
    assert len(call.response_ids) == 48 and text == call.response["content"]
    assert first < total / 3, (first, total)


def test_streamed_content_never_shows_a_tool_call_or_a_stop_string(server, tok):
    from lightning_lite.chat import ContentStream

    r = server.proxy.renderer
    s = ContentStream(r, stops=["STOP"], parse_tools=True)
    pieces = [
        s.feed(tok.encode(t))[1]
        for t in [
            "  Hello",
            "  Hello wor",
            "  Hello world <tool",
            "  Hello world <tool_call>\n{",
            "  Hello world ST",
        ]
    ]
    assert (
        pieces == ["Hello", " wor", "ld", "", ""] and s.sent == "Hello world"
    )  # "<tool" may start a call: held back
    s = ContentStream(r, stops=[], parse_tools=False)
    ids = tok.encode("café ☕")
    assert (
        "".join(s.feed(ids[:k])[1] for k in range(1, len(ids) + 1)) == "café ☕"
    )  # no split UTF-8 character, ever
    assert ContentStream(r, [], True, forced=r.forced_prefix("")).feed(ids) == ("", "")


def test_anthropic_count_tokens_errors_and_probe(server):
    base = f"{server.url}/rollout/anth-misc"
    a = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    n = a.messages.count_tokens(
        model="m", system="Be brief.", messages=[{"role": "user", "content": "hi"}]
    ).input_tokens
    assert n == len(
        server.proxy.renderer.build_prompt(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [], []
        )[0]
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="m", max_tokens=4, messages=[])
    assert (
        e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    )
    assert requests.head(base).status_code == 200  # Claude Code probes its base URL first
    r = requests.post(
        base + "/v1/messages?beta=true",
        json={
            "model": "m",
            "max_tokens": 3,
            "thinking": {"type": "adaptive"},
            "metadata": {"user_id": "u"},
            "context_management": {"edits": []},
            "output_config": {"effort": "high"},
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
                    ],
                },
                {"role": "system", "content": "Be brief."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "...", "signature": "s"},
                        {"type": "text", "text": "Hello"},
                    ],
                },
                {"role": "user", "content": "Bye"},
            ],
        },
        headers={"anthropic-beta": "context-management-2025-06-27"},
    )
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_responses_previous_response_id(server):
    c = client(server, "prev-id")
    r1 = c.responses.create(model="m", input="Name a color.", max_output_tokens=4, temperature=0)
    r2 = c.responses.create(
        model="m",
        previous_response_id=r1.id,
        input=[{"role": "user", "content": "Another one."}],
        max_output_tokens=4,
        temperature=0,
    )
    calls = calls_of(server, "prev-id")
    assert (
        r2.previous_response_id == r1.id and calls[1].parent == 0
    )  # the stored conversation was extended
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(
            model="m", previous_response_id="resp_nope", input="hi", max_output_tokens=2
        )
    assert "previous_response_id" in e.value.message
    # tool types the model cannot use are ignored, reasoning items too; an image is refused
    ok = c.responses.create(
        model="m",
        input=[
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        tools=[{"type": "web_search"}, {"type": "namespace", "name": "x", "tools": []}],
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "high"},
        store=False,
        parallel_tool_calls=True,
        max_output_tokens=3,
        temperature=0,
        extra_body={"client_metadata": {"a": "b"}, "prompt_cache_key": "k"},
    )
    assert ok.status == "incomplete" and ok.usage.output_tokens == 3
    with pytest.raises(openai.BadRequestError):
        c.responses.create(
            model="m",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        )


def test_a_request_that_appends_converts_only_its_new_messages():
    """With a memo kept per conversation, the messages a request shares with the previous one are reused (the
    same objects: no Python work per earlier message), the new ones converted; the result is what parsing
    without a memo gives; an edited message is converted again; a bad request leaves the memo as it was."""
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.extras.anthropic import parse_anthropic_request
    from lightning_lite.extras.responses import parse_responses_request
    from lightning_lite.chat import BadRequest

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    shapes = {  # a user turn, an assistant turn with a tool call, its result; the memo sees the first two, then all three
        "chat": (
            lambda items, memo: parse_chat_request({"messages": items}, memo),
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ],
        ),
        "anthropic": (
            lambda items, memo: parse_anthropic_request({"messages": items, "max_tokens": 4}, memo),
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "1"}],
                },
            ],
        ),
        "responses": (
            lambda items, memo: parse_responses_request({"input": items}, None, memo),
            [
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "content": "ok"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
            ],
        ),
    }
    for name, (parse, items) in shapes.items():
        memo = {}
        first = parse(items[:-1], memo).messages
        second = parse(items, memo).messages
        assert (
            second == parse(items, None).messages
            and len(second) == 3
            and second[2]["role"] == "tool"
        ), name
        assert second[0] is first[0] and (name == "responses" or second[1] is first[1]), (
            name
        )  # reused, not converted again
        edited = [{"role": "user", "content": "hello"}] + items[1:]
        assert (
            parse(edited, memo).messages == parse(edited, None).messages and memo["items"] is edited
        ), name
        with pytest.raises(BadRequest):
            parse(edited + [{"role": "nobody"}], memo)
        assert memo["items"] is edited, name
    # Responses joins a call to the assistant message before it in a new dict: the memo's own stays as it was
    memo = {}
    parse_responses_request({"input": shapes["responses"][1]}, None, memo)
    assert memo["out"][1] == [{"role": "assistant", "content": "ok"}]


def test_tool_calls_sent_back_as_text_are_read_as_tool_calls():
    """smolagents' form: the calls it received, as a Python repr in the assistant's text."""
    from lightning_lite.apis import parse_chat_request

    text = "Calling tools:\n[{'id': 'call_0', 'type': 'function', 'function': {'name': 'bash', 'arguments': {'command': 'echo hello'}}}]"
    req = parse_chat_request(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": text}]},
            ]
        }
    )
    assert req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "name": "bash", "arguments": {"command": "echo hello"}}],
    }
    for other in (
        "Calling tools:\n[1, 2]",
        "Calling tools: not a list",
        "I was calling tools: [{'function': {'name': 'x'}}] yesterday",
    ):
        assert (
            "tool_calls"
            not in parse_chat_request(
                {"messages": [{"role": "assistant", "content": other}]}
            ).messages[0]
        )


def captured(shape_paths):
    """Captured harness requests to the given routes (skipped with one line when the folder is absent)."""
    if not os.path.isdir(HARNESS_REQUESTS):
        return [pytest.param(None, None, id="captured", marks=pytest.mark.skip(reason=NO_CAPTURES))]
    out = []
    for name in sorted(os.listdir(HARNESS_REQUESTS)):
        for i, line in enumerate(
            open(os.path.join(HARNESS_REQUESTS, name)) if name.endswith(".jsonl") else []
        ):
            r = json.loads(line)
            if r.get("method") == "POST" and r["path"].split("?")[0] in shape_paths:
                marks = capture_marks(r["body"])
                out.append(pytest.param(r["path"], r["body"], id=f"{name[:-6]}-{i}", marks=marks))
    return out


def fixture_requests(*names):
    """The project's own requests in the captures' shapes (tests/fixtures/NAME; its "_path" is the
    route they go to): a clean clone has no captures, and these always run."""
    out = []
    for name in names:
        requests_of = json.load(open(os.path.join(ROOT, "tests", "fixtures", name)))
        path = requests_of.pop("_path")
        out += [
            pytest.param(path, body, id=f"fixture-{key}")
            for key, body in requests_of.items()
            if not key.startswith("_")
        ]
    return out


def sse_events(text):
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


# What each API tells the client when the recorded call ends with stop or length, and when the
# reply returns calls to run (even a cut one).
FINISHES = {
    "/v1/chat/completions": ({"stop": "stop", "length": "length"}, "tool_calls"),
    "/v1/messages": ({"stop": "end_turn", "length": "max_tokens"}, "tool_use"),
    "/v1/responses": ({"stop": "completed", "length": "incomplete"}, "completed"),
}


def read_answer(route, body, r, max_tokens):
    """The answer ``r`` to ``body`` as its API's official client reads it (handed ``r``'s bytes by a
    fake transport; a stream through the client's stream helper, after its events' order is
    checked): (its finish, whether it returns calls to run, its usage as (prompt tokens, reply
    tokens), None for a chat stream that did not ask for it)."""
    stream = bool(body.get("stream"))
    api = "anthropic" if route == "/v1/messages" else "openai"
    sdk = sdk_client(api, r.content, r.headers["content-type"])
    events = sse_events(r.text) if stream else []
    kinds, hi = [e.get("type") for e in events], [{"role": "user", "content": "hi"}]
    if route == "/v1/chat/completions" and stream:
        assert r.text.rstrip().endswith("data: [DONE]")
        chunks = list(sdk.chat.completions.create(model="m", messages=hi, stream=True))
        ends = [c.choices[0].finish_reason for c in chunks if c.choices]
        # once, on the last chunk with a choice (a chunk of usage alone may follow it)
        assert [f for f in ends if f] == ends[-1:]
        usage = chunks[-1].usage
        called = any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        return ends[-1], called, usage and (usage.prompt_tokens, usage.completion_tokens)
    if route == "/v1/chat/completions":
        out = sdk.chat.completions.create(model="m", messages=hi)
        usage, choice = (out.usage.prompt_tokens, out.usage.completion_tokens), out.choices[0]
        return choice.finish_reason, bool(choice.message.tool_calls), usage
    if route == "/v1/messages":
        if stream:
            assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
            with sdk.messages.stream(model="m", max_tokens=max_tokens, messages=hi) as s:
                out = s.get_final_message()
        else:
            out = sdk.messages.create(model="m", max_tokens=max_tokens, messages=hi)
        called = any(b.type == "tool_use" for b in out.content)
        return out.stop_reason, called, (out.usage.input_tokens, out.usage.output_tokens)
    if stream:
        ends = ("response.completed", "response.incomplete")
        assert kinds[0] == "response.created" and kinds[-1] in ends
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        # The stream helper's final response is a completed one's: the last event carries either.
        with sdk.responses.stream(model="m", input="hi") as s:
            out = list(s)[-1].response
    else:
        out = sdk.responses.create(model="m", input="hi")
    # validated as a typed client does (the SDK's own reading fills a missing required field)
    from openai.types.responses import Response

    Response.model_validate(events[-1]["response"] if stream else r.json())
    called = any(o.type == "function_call" for o in out.output)
    return out.status, called, (out.usage.input_tokens, out.usage.output_tokens)


def check_answer(srv, rid, path, body, r, n_prompt, max_tokens):
    """``r`` answered ``body`` (sent to ``path``) with a 200 in its API's own format (read_answer).
    The call is recorded with the prompt's ``n_prompt`` token ids and 1 to ``max_tokens`` sampled
    ones, and the answer's usage and finish agree with that record."""
    assert r.status_code == 200, r.text[:500]
    route = path.split("?")[0]
    finish, called, usage = read_answer(route, body, r, max_tokens)
    (call,) = calls_of(srv, rid)
    n = len(call.response_ids)
    assert len(call.prompt_ids) == n_prompt and 1 <= n <= max_tokens
    assert len(call.response_logprobs) == n
    # A chat stream carries its usage only when stream_options.include_usage asks for it.
    silent = route == "/v1/chat/completions" and body.get("stream")
    silent = silent and not (body.get("stream_options") or {}).get("include_usage")
    assert usage == (None if silent else (n_prompt, n))
    by_record, of_calls = FINISHES[route]
    assert finish == (of_calls if called else by_record[call.finish_reason])


@pytest.mark.parametrize(
    "path,body",
    fixture_requests("messages_requests.json", "responses_requests.json")
    + captured({"/v1/messages", "/v1/responses"}),
)
def test_replay_captured_anthropic_and_responses_requests(server, tok, path, body):
    """Each request Claude Code, Codex, the Agents SDK and OpenHands sent, as sent (fewer tokens), and
    the fixtures in their shapes: a well-formed answer in its API's format (check_answer), or, past the
    embedded model's 8192 tokens, the context error in that format and no call recorded."""
    anth = path.startswith("/v1/messages")
    body = dict(body, **({"max_tokens": 6} if anth else {"max_output_tokens": 6}))
    rid = "replay-" + uuid.uuid4().hex[:8]
    n_prompt = prompt_length(tok, path, body)
    r = requests.post(f"{server.url}/rollout/{rid}{path}", json=body)
    if n_prompt >= server.proxy.backend.max_model_len:
        err = r.json()
        assert r.status_code == 400 and calls_of(server, rid) == []
        assert (err["error"]["type"] if anth else err["error"]["code"]) in (
            "invalid_request_error",
            "context_length_exceeded",
        ) and "context length" in r.text
        return
    check_answer(server, rid, path, body, r, n_prompt, 6)


# The context of the proxy that serves the captures past the embedded model's 8192 tokens.
LONG_CONTEXT = 32768
# The harnesses whose long captures are served to completion: one of each API they use (Claude
# Code's Messages, OpenHands CLI's chat), ~7 minutes on 2 cores, since a harness's first request
# prefills for 1-5 minutes. The others' (OpenHands CLI's other capture, Qwen Code: ~7 minutes more)
# replay above up to the context error.
LONG_SERVED = ("claude-code-", "openhands-cli-2-")
ROUTES = {"/v1/chat/completions", "/v1/messages", "/v1/responses"}


def past_the_context(limit=8192):
    """The captured requests, of every API, whose prompt passes the embedded model's ``limit``
    tokens (its context): the replays above can only check the context error on them. Rendering
    the captures to count their tokens adds about a second to collecting this file."""
    params = captured(ROUTES)
    if params[0].values[0] is None:
        return params
    from lightning_lite.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    return [
        pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
        for p in params
        if p.id.startswith(LONG_SERVED) and prompt_length(tok, *p.values) >= limit
    ]


@pytest.fixture(scope="module")
def long_server(tok, tmp_path_factory):
    """A second proxy, over the embedded model served at LONG_CONTEXT tokens (YaRN RoPE past its
    8192): every capture fits."""
    from lightning_lite.backends import HFBackend
    from lightning_lite.models import load_model
    from lightning_lite.proxy import Proxy, ProxyServer

    model = load_model("smollm2", max_model_len=LONG_CONTEXT).eval()
    backend = HFBackend(model, tok, max_model_len=LONG_CONTEXT)
    out = tmp_path_factory.mktemp("long-proxy")
    srv = ProxyServer(Proxy(backend, tok, out_dir=str(out))).start()
    srv.out = out
    yield srv
    srv.stop()
    backend.close()


@pytest.mark.parametrize("path,body", past_the_context())
def test_captured_requests_past_the_context_are_served_at_a_longer_one(
    long_server, tok, path, body
):
    """The captures the replays can only answer with the context error (LONG_SERVED's: OpenHands
    CLI's and Claude Code's, 8.5k-20k tokens), served to completion at 32,768 tokens: a 200 in
    their API's format with the call recorded (check_answer). A harness's first request prefills
    for a minute or more on 2 cores; its next one reuses the cached prefix."""
    route = path.split("?")[0]
    body = dict(
        body, **({"max_output_tokens": 4} if route == "/v1/responses" else {"max_tokens": 4})
    )
    body.pop("max_completion_tokens", None)
    rid = "long-" + uuid.uuid4().hex[:8]
    n_prompt = prompt_length(tok, path, body)
    assert long_server.proxy.backend.max_model_len - 4 > n_prompt >= 8192
    r = requests.post(f"{long_server.url}/rollout/{rid}{path}", json=body, timeout=1800)
    check_answer(long_server, rid, path, body, r, n_prompt, 4)


def test_a_client_that_goes_away_stops_its_generation(server):
    """The harness gave up (timeout, closed connection): its call stops generating within a few tokens and
    is recorded as cancelled."""
    stats = server.proxy.backend.stats
    before = dict(stats)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a very long essay about the sea."}],
        "max_tokens": 2000,
        "temperature": 1.0,
    }
    with pytest.raises(
        requests.exceptions.ReadTimeout
    ):  # not streamed: the client gives up waiting
        requests.post(
            f"{server.url}/rollout/gone-False/v1/chat/completions", json=body, timeout=1.5
        )
    with requests.post(
        f"{server.url}/rollout/gone-True/v1/chat/completions",
        json=dict(body, stream=True),
        stream=True,
    ) as r:
        next(
            r.iter_lines()
        )  # streamed: the client reads the first event, then closes the connection
    deadline = time.time() + 30
    while stats["cancelled"] - before["cancelled"] < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert stats["cancelled"] - before["cancelled"] == 2
    assert stats["generated_tokens"] - before["generated_tokens"] < 400  # not the 4,000 asked for
    # nothing answered: each recorded as cancelled, with no response (never trained on)
    assert [
        (c.finish_reason, c.response_ids)
        for c in calls_of(server, "gone-False") + calls_of(server, "gone-True")
    ] == [("cancelled", [])] * 2


def test_a_reply_cut_by_the_proxys_cap_is_answered_as_finished(tok, tmp_path):
    """The trainer's cap is not the client's limit: the client is told stop / end_turn / completed, the record says length."""
    from test_proxy import CannedBackend

    from lightning_lite.proxy import Proxy, ProxyServer
    from lightning_lite.records import read_calls

    srv = ProxyServer(
        Proxy(CannedBackend(tok, "Once upon a time"), tok, out_dir=str(tmp_path), max_new_tokens=4)
    ).start()
    try:
        msgs = [{"role": "user", "content": "Tell me a story."}]
        assert (
            client(srv, "cap")
            .chat.completions.create(model="m", messages=msgs)
            .choices[0]
            .finish_reason
            == "stop"
        )
        assert (
            client(srv, "cap")
            .chat.completions.create(model="m", messages=msgs, max_tokens=4)
            .choices[0]
            .finish_reason
            == "length"
        )  # its own limit
        a = anthropic.Anthropic(base_url=f"{srv.url}/rollout/cap", api_key="x", max_retries=0)
        assert (
            a.messages.create(model="m", max_tokens=8000, messages=msgs).stop_reason == "end_turn"
        )
        assert (
            client(srv, "cap").responses.create(model="m", input="Tell me a story.").status
            == "completed"
        )
        assert (
            client(srv, "cap").completions.create(model="m", prompt="Once").choices[0].finish_reason
            == "stop"
        )
    finally:
        srv.stop()
    calls = read_calls(str(tmp_path / "calls.jsonl"))
    assert [(c.finish_reason, c.capped) for c in calls] == [
        ("length", True),
        ("length", False),
        ("length", True),
        ("length", True),
        ("length", True),
    ]


# ----------------------------------------------------------------------------- writers and parsers, no model

THOUGHT, ANSWER = "The user wants 17*23. 17*20 = 340, 17*3 = 51: 391.", "It is 391."
CALL = {"id": "call_7", "name": "calculator", "arguments": {"expression": "17*23"}}


def answered(reply, choices=1, finish="stop"):
    """Fake answers for a writer: (call, reply) pairs with what the writers read of a recorded call."""
    from types import SimpleNamespace

    return [
        (
            SimpleNamespace(
                choice=i,
                response_ids=[5] * 9,
                response_logprobs=[-0.5] * 9,
                capped=False,
                finish_reason=finish,
            ),
            reply,
        )
        for i in range(choices)
    ]


def writer(api, req=None):
    from lightning_lite.apis import ChatReply
    from lightning_lite.extras.anthropic import AnthropicReply
    from lightning_lite.extras.responses import ResponsesReply
    from lightning_lite.chat import Request

    req = req or Request(tools=[CALC], stream=True, include_usage=True)
    return {
        "chat": lambda: ChatReply(req, "m", 11),
        "anthropic": lambda: AnthropicReply(req, "m", 11),
        "responses": lambda: ResponsesReply(req, "m", 11),
    }[api]()


def streamed(w, answers, live_reasoning=(), live_text=()):
    """The bytes of a stream: start, the live reasoning then text deltas, then end() with what they sent."""
    return (
        w.start()
        + b"".join(map(w.reasoning, live_reasoning))
        + b"".join(map(w.text, live_text))
        + w.end(answers, "".join(live_text), "".join(live_reasoning))
    )


def sdk_client(api, body: bytes, content_type: str = "text/event-stream"):
    """The API's official client, answered ``body`` (server-sent events, unless ``content_type`` says
    otherwise) by a fake transport: its stream helpers check the events."""
    import importlib.util

    httpx = importlib.import_module(
        "httpx2" if importlib.util.find_spec("httpx2") else "httpx"
    )  # what these clients are built on

    http = httpx.Client(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(200, content=body, headers={"content-type": content_type})
        )
    )
    if api == "anthropic":
        return anthropic.Anthropic(
            base_url="http://fake", api_key="x", http_client=http, max_retries=0
        )
    return openai.OpenAI(base_url="http://fake/v1", api_key="x", http_client=http, max_retries=0)


LIVE = [
    ((), ()),
    (("The user wants ", "17*23."), ()),
    ((THOUGHT[:20], THOUGHT[20:]), ("It is ",)),
]  # nothing live, part of the reasoning, all of it and part of the text


@pytest.mark.parametrize(
    "live", LIVE, ids=["nothing-live", "reasoning-partly-live", "text-partly-live"]
)
@pytest.mark.parametrize("calls", [False, True], ids=["text", "text+call"])
def test_reasoning_goes_out_in_each_apis_own_field_and_the_stream_carries_the_same(live, calls):
    """reasoning_content / a thinking block / a reasoning item, before the text and the calls; the streamed events,
    whatever was sent live, reassemble (by hand, and by the official clients' stream helpers) into the JSON body's."""
    reply = {
        "role": "assistant",
        "content": ANSWER,
        "reasoning": THOUGHT,
        **({"tool_calls": [CALL]} if calls else {}),
    }
    answers = answered(reply, finish="tool_calls" if calls else "stop")
    live_reasoning, live_text = live

    msg = writer("chat").body(answers)["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"], len(msg.get("tool_calls", []))) == (
        ANSWER,
        THOUGHT,
        int(calls),
    )
    deltas = [
        e["choices"][0]["delta"]
        for e in sse_events(streamed(writer("chat"), answers, live_reasoning, live_text).decode())
        if e["choices"]
    ]
    assert (
        "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
        and "".join(d.get("content", "") for d in deltas) == ANSWER
    )
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(
        "reasoning_content" not in d for d in deltas[first_content:]
    )  # reasoning before content
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])] == [
        "calculator"
    ] * calls

    body = writer("anthropic").body(answers)
    assert body["content"][0] == {
        "type": "thinking",
        "thinking": THOUGHT,
        "signature": "",
    } and body["content"][1] == {"type": "text", "text": ANSWER}
    assert [b["type"] for b in body["content"]] == ["thinking", "text"] + ["tool_use"] * calls
    events = sse_events(streamed(writer("anthropic"), answers, live_reasoning, live_text).decode())
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert (
        [e["index"] for e in starts]
        == list(range(len(body["content"])))
        == [e["index"] for e in events if e["type"] == "content_block_stop"]
    )
    assert (
        "".join(
            e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta"
        )
        == THOUGHT
    )
    assert (
        "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        == ANSWER
    )
    with sdk_client(
        "anthropic", streamed(writer("anthropic"), answers, live_reasoning, live_text)
    ).messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == body[
        "content"
    ] and final.stop_reason == body["stop_reason"]

    body = writer("responses").body(answers)
    reasoning, message = body["output"][:2]
    assert (
        reasoning["type"] == "reasoning"
        and reasoning["id"].startswith("rs_")
        and reasoning["summary"] == []
    )
    assert (
        reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
        and message["content"][0]["text"] == ANSWER
    )
    assert [o["type"] for o in body["output"]] == ["reasoning", "message"] + [
        "function_call"
    ] * calls
    raw = streamed(writer("responses"), answers, live_reasoning, live_text)
    events = sse_events(raw.decode())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == list(
        range(len(body["output"]))
    )
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        == THOUGHT
    )
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == [THOUGHT]
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    )
    with sdk_client("responses", raw).responses.stream(model="m", input="hi") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [o.model_dump(exclude_none=True)["type"] for o in final.output] == [
        o["type"] for o in body["output"]
    ]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER


def test_a_reply_without_reasoning_has_no_reasoning_field_or_event():
    answers = answered({"role": "assistant", "content": ANSWER})
    assert "reasoning_content" not in writer("chat").body(answers)["choices"][0]["message"]
    assert [b["type"] for b in writer("anthropic").body(answers)["content"]] == ["text"]
    assert [o["type"] for o in writer("responses").body(answers)["output"]] == ["message"]
    for api in ("chat", "anthropic", "responses"):
        for raw in (streamed(writer(api), answers, (), ("It ",)), streamed(writer(api), answers)):
            assert not any(
                k in raw
                for k in (b"reasoning_content", b'"reasoning"', b"reasoning_text", b"thinking")
            ), api


def test_chat_reasoning_of_every_choice_is_sent_and_only_choice_0_streamed_live():
    from lightning_lite.chat import Request

    answers = answered({"role": "assistant", "content": ANSWER, "reasoning": THOUGHT}, choices=2)
    events = sse_events(
        streamed(
            writer("chat", Request(n=2, stream=True)), answers, (THOUGHT[:9],), ("It",)
        ).decode()
    )
    for i in (0, 1):
        deltas = [
            e["choices"][0]["delta"]
            for e in events
            if e["choices"] and e["choices"][0]["index"] == i
        ]
        assert (
            "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
            and "".join(d.get("content") or "" for d in deltas) == ANSWER
        )


def test_reasoning_sent_back_is_read_back_in_each_apis_shape():
    """What a client echoes of the reasoning (chat reasoning_content or reasoning, Anthropic thinking blocks, Responses
    reasoning items) becomes the assistant message's "reasoning"; what the proxy wrote comes back as the reply it was."""
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.extras.anthropic import parse_anthropic_request
    from lightning_lite.extras.responses import parse_responses_request

    user = {"role": "user", "content": QUESTION}
    reply = {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT, "tool_calls": [CALL]}
    tool = {"role": "tool", "tool_call_id": CALL["id"], "content": "391"}
    expected = [user, reply, tool]

    msg = writer("chat").body(answered(reply))["choices"][0]["message"]
    assert parse_chat_request({"messages": [user, msg, tool]}).messages == expected
    renamed = {
        k if k != "reasoning_content" else "reasoning": v for k, v in msg.items()
    }  # OpenRouter's name
    assert parse_chat_request({"messages": [user, renamed, tool]}).messages == expected
    bare = parse_chat_request(
        {
            "messages": [
                user,
                {"role": "assistant", "content": "x", "reasoning_content": ""},
                {**user, "reasoning": "no"},
            ]
        }
    ).messages
    assert all(
        "reasoning" not in m for m in bare
    )  # empty: no key; a user's: not an assistant's reasoning

    blocks = writer("anthropic").body(answered(reply))["content"]
    anth = parse_anthropic_request(
        {
            "max_tokens": 5,
            "messages": [
                user,
                {
                    "role": "assistant",
                    "content": [{"type": "redacted_thinking", "data": "xyz"}] + blocks,
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_7", "content": "391"}
                    ],
                },
            ],
        }
    )
    assert anth.messages == [
        user,
        {**reply, "tool_calls": [{**CALL, "id": "toolu_7"}]},
        {**tool, "tool_call_id": "toolu_7"},
    ]
    redacted = parse_anthropic_request(
        {
            "max_tokens": 5,
            "messages": [
                user,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "x"},
                        {"type": "text", "text": "ok"},
                    ],
                },
            ],
        }
    )
    assert redacted.messages[1] == {"role": "assistant", "content": "ok"}

    output = writer("responses").body(answered(reply))["output"]
    output_tool = {"type": "function_call_output", "call_id": CALL["id"], "output": "391"}
    assert (
        parse_responses_request({"input": [user] + output + [output_tool]}, lambda _: []).messages
        == expected
    )
    summary = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": THOUGHT}],
        "encrypted_content": "gAAA",
    }
    call = {
        "type": "function_call",
        "call_id": CALL["id"],
        "name": "calculator",
        "arguments": json.dumps(CALL["arguments"]),
    }
    later = [
        {"role": "user", "content": "Thanks."},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"role": "assistant", "content": "Bye."},
    ]
    msgs = parse_responses_request(
        {"input": [user, summary, call, output_tool] + later}, lambda _: []
    ).messages
    assert msgs == [
        user,
        {"role": "assistant", "content": "", "reasoning": THOUGHT, "tool_calls": [CALL]},
        tool,
        later[0],
        later[2],
    ]


def test_chat_template_kwargs_reach_the_request_and_a_non_object_is_a_400():
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.chat import BadRequest

    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(
        {**base, "chat_template_kwargs": {"enable_thinking": False}}
    ).template_kwargs == {"enable_thinking": False}
    assert (
        parse_chat_request(base).template_kwargs
        == {}
        == parse_chat_request({**base, "chat_template_kwargs": None}).template_kwargs
    )
    for bad in ("enable_thinking=false", ["enable_thinking"], 0):
        with pytest.raises(BadRequest) as e:
            parse_chat_request({**base, "chat_template_kwargs": bad})
        assert (e.value.status, e.value.param, e.value.code) == (
            400,
            "chat_template_kwargs",
            "invalid_type",
        )


def test_tools_and_tool_choice_read_alike_in_every_apis_shape():
    """One normalizer: the same function tool, and tool_choice none / auto / required / named, in each API's own shape;
    tools the model cannot call (server tools) are left out; a named tool that is not offered is a 400."""
    from lightning_lite.apis import parse_chat_request
    from lightning_lite.extras.anthropic import parse_anthropic_request
    from lightning_lite.extras.responses import parse_responses_request
    from lightning_lite.chat import BadRequest

    user = {"role": "user", "content": "hi"}
    shapes = {
        "chat": (
            lambda tools, choice: parse_chat_request(
                {"messages": [user], "tools": tools, **choice}
            ),
            [{"type": "function", "function": CALC}],
            {
                "none": "none",
                "auto": "auto",
                "required": "required",
                "named": {"type": "function", "function": {"name": "calculator"}},
            },
        ),
        "anthropic": (
            lambda tools, choice: parse_anthropic_request(
                {"max_tokens": 5, "messages": [user], "tools": tools, **choice}
            ),
            [
                {
                    "name": "calculator",
                    "description": CALC["description"],
                    "input_schema": CALC["parameters"],
                },
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            {
                "none": {"type": "none"},
                "auto": {"type": "auto"},
                "required": {"type": "any"},
                "named": {"type": "tool", "name": "calculator"},
            },
        ),
        "responses": (
            lambda tools, choice: parse_responses_request(
                {"input": "hi", "tools": tools, **choice}, lambda _: []
            ),
            [
                {"type": "function", **CALC},
                {"type": "web_search"},
                {"type": "namespace", "name": "x", "tools": []},
            ],
            {
                "none": "none",
                "auto": "auto",
                "required": "required",
                "named": {"type": "function", "name": "calculator"},
            },
        ),
    }
    for name, (parse, tools, choices) in shapes.items():
        got = {
            k: (r.tools, r.parse_tools, r.force_tool)
            for k, c in choices.items()
            for r in [parse(tools, {"tool_choice": c})]
        }
        assert got == {
            "none": ([CALC], False, None),
            "auto": ([CALC], True, None),
            "required": ([CALC], True, ""),
            "named": ([CALC], True, "calculator"),
        }, name
        assert (
            parse(tools, {}).force_tool is None
            and parse([], {"tool_choice": choices["required"]}).force_tool is None
        ), name  # no tools: nothing to force
        named = choices["named"]
        wrong = (
            {**named, "function": {"name": "nope"}}
            if "function" in named
            else {**named, "name": "nope"}
        )
        for bad_tools, choice, param in (
            [tools, {"tool_choice": wrong}, "tool_choice"],
            [tools, {"tool_choice": 5}, "tool_choice"],
            [tools, {"tool_choice": "function"}, "tool_choice"],
            [tools, {"tool_choice": "any"}, "tool_choice"],
            [{"calculator": CALC}, {}, "tools"],
            [[5], {}, "tools[0]"],
            [[{"type": "function", "description": "no name"}], {}, "tools[0]"],
        ):
            with pytest.raises(BadRequest) as e:
                parse(bad_tools, choice)
            assert e.value.param == param and e.value.status == 400, (name, bad_tools, choice)


def test_completions_reply_body_and_stream_agree():
    from lightning_lite.extras.completions import CompletionsReply
    from lightning_lite.chat import Request

    answers = [
        (call, text)
        for (call, _), text in zip(
            answered({}, choices=2, finish="length"), ["Paris, and then", " Lyon"]
        )
    ]
    w = CompletionsReply(Request(n=2, stream=True, include_usage=True), "m", 4)
    body = w.body(answers)
    assert [c["text"] for c in body["choices"]] == ["Paris, and then", " Lyon"] and body[
        "usage"
    ] == {"prompt_tokens": 4, "completion_tokens": 18, "total_tokens": 22}
    events = sse_events(w.end(answers).decode())
    assert [
        "".join(
            e["choices"][0]["text"]
            for e in events
            if e["choices"] and e["choices"][0]["index"] == i
        )
        for i in (0, 1)
    ] == ["Paris, and then", " Lyon"]
    assert [
        e["choices"][0]["finish_reason"]
        for e in events
        if e["choices"] and e["choices"][0]["finish_reason"]
    ] == ["length", "length"]
    assert (
        events[-1]["usage"] == body["usage"] and len(events) > 4
    )  # word-sized pieces, then the usage chunk


LIVE_ORDER = [(((THOUGHT[:9],), ()), 2, 1), (((THOUGHT,), (ANSWER[:3],)), 1, 2)]


@pytest.mark.parametrize(
    "live,n_thought,n_text", LIVE_ORDER, ids=["reasoning-partly-live", "text-partly-live"]
)
def test_stream_events_come_in_each_apis_order(live, n_thought, n_text):
    """Reasoning, text and a call streamed partly live: the exact sequence of events (and their indexes) each API's
    clients expect, pinned (the reassembly checks above would not notice two events swapped)."""
    reply = {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT, "tool_calls": [CALL]}
    answers = answered(reply, finish="tool_calls")

    def block(i, kind, deltas):
        deltas = [("content_block_delta", i, d) for d in deltas]
        return [("content_block_start", i, kind)] + deltas + [("content_block_stop", i, None)]

    events = sse_events(streamed(writer("anthropic"), answers, *live).decode())
    kinds = [(e.get("delta") or e.get("content_block") or {}).get("type") for e in events]
    assert [(e["type"], e.get("index"), kind) for e, kind in zip(events, kinds)] == (
        [("message_start", None, None)]
        + block(0, "thinking", ["thinking_delta"] * n_thought + ["signature_delta"])
        + block(1, "text", ["text_delta"] * n_text)
        + block(2, "tool_use", ["input_json_delta"])
        + [("message_delta", None, None), ("message_stop", None, None)]
    )

    def item(i, text, n):
        done = [(f"{text}.done", i), ("content_part.done", i), ("output_item.done", i)]
        return (
            [("output_item.added", i), ("content_part.added", i)]
            + [(f"{text}.delta", i)] * n
            + done
        )

    call = [
        ("output_item.added", 2),
        ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2),
        ("output_item.done", 2),
    ]
    events = sse_events(streamed(writer("responses"), answers, *live).decode())
    assert [(e["type"].removeprefix("response."), e.get("output_index")) for e in events] == (
        [("created", None), ("in_progress", None)]
        + item(0, "reasoning_text", n_thought)
        + item(1, "output_text", n_text)
        + call
        + [("completed", None)]
    )


def test_completions_request_and_its_bad_fields():
    from lightning_lite.extras.completions import parse_completions_request
    from lightning_lite.chat import BadRequest

    body = {
        "prompt": ["Paris"],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
    }
    req = parse_completions_request(body)
    assert (req.prompt_text, req.prompt_ids, req.n, req.include_usage, req.logprobs) == (
        "Paris",
        None,
        2,
        True,
        True,
    )
    assert parse_completions_request({"prompt": [[1, 2]], "max_tokens": 3}).prompt_ids == [1, 2]
    for body, param in [
        ({"prompt": "x", "stream_options": 3}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "n": 17}, "n"),
    ]:
        with pytest.raises(
            BadRequest
        ) as e:  # a 400, not a 500 (a non-object stream_options once was)
            parse_completions_request(body)
        assert e.value.param == param and e.value.status == 400, body
