"""The three API shapes through their official clients (openai: chat and responses; anthropic: messages),
stream and not, on the embedded model: one conversation, token reuse, live streaming, errors in each format."""

import json
import time

import anthropic
import openai
import pytest
import requests
import torch

from test_proxy import calls_of, client, teacher_forced_call

from lightning_lite.samples import build_samples

SYSTEM, QUESTION = "Use the calculator tool for arithmetic.", "What is 17*23, then plus 5?"
CALC = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
SEEDS = [1, 1, 0]  # sampling seeds for which the model completes both forced calls as valid JSON
FORCE = [True, True, False]  # the first two turns name the tool (tool_choice), the third is free


class Chat:
    """A harness on chat completions: keeps the messages, sends tool results back."""

    def __init__(self, server, rid):
        self.c, self.msgs = client(server, rid), [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def turn(self, force, seed, stream):
        choice = {"type": "function", "function": {"name": "calculator"}} if force else "auto"
        kw = dict(model="smollm2", messages=self.msgs, tools=[{"type": "function", "function": CALC}], tool_choice=choice, max_tokens=32, temperature=1.0, seed=seed)
        if stream:
            content, calls = "", {}
            for ch in self.c.chat.completions.create(stream=True, **kw):
                d = ch.choices[0].delta if ch.choices else None
                content += (d.content or "") if d else ""
                for tc in (d.tool_calls or []) if d else []:
                    calls.setdefault(tc.index, {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": ""}})
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
            msg = {"role": "assistant", "content": content or None, **({"tool_calls": list(calls.values())} if calls else {})}
        else:
            msg = self.c.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
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
        kw = dict(model="smollm2", instructions=SYSTEM, input=self.input, tools=[{"type": "function", **CALC}], max_output_tokens=32, temperature=1.0,
                  tool_choice={"type": "function", "name": "calculator"} if force else "auto", extra_body={"seed": seed}, store=False)
        if stream:
            events = list(self.c.responses.create(stream=True, **kw))
            seqs = [e.sequence_number for e in events]
            assert seqs == list(range(len(seqs))) and events[0].type == "response.created"
            assert events[-1].type in ("response.completed", "response.incomplete")
            r = events[-1].response
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "".join(c.text for o in r.output if o.type == "message" for c in o.content)
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert args == "".join(o.arguments for o in r.output if o.type == "function_call")
        else:
            r = self.c.responses.create(**kw)
        names = []
        for o in r.output:
            if o.type == "function_call":
                names.append(o.name)
                self.input += [{"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments},
                               {"type": "function_call_output", "call_id": o.call_id, "output": "391"}]
            else:
                self.input.append({"role": "assistant", "content": o.content[0].text})
        if not names:
            self.input.append({"role": "user", "content": "Go on."})
        return names


class Messages:
    """A harness on Anthropic Messages (as Claude Code sends it)."""

    def __init__(self, server, rid):
        self.c = anthropic.Anthropic(base_url=f"{server.url}/rollout/{rid}", api_key="sk-test", max_retries=0)
        self.msgs = [{"role": "user", "content": QUESTION}]

    def turn(self, force, seed, stream):
        kw = dict(model="smollm2", system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}], messages=self.msgs,
                  tools=[{"name": CALC["name"], "description": CALC["description"], "input_schema": CALC["parameters"]}], max_tokens=32,
                  tool_choice={"type": "tool", "name": "calculator"} if force else {"type": "auto"}, extra_body={"seed": seed, "temperature": 1.0})
        if stream:
            with self.c.messages.stream(**kw) as s:
                kinds = [e.type for e in s]
                m = s.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        else:
            m = self.c.messages.create(**kw)
        self.msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        self.msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "391"} for b in uses] or "Go on."})
        assert m.stop_reason == ("tool_use" if uses else m.stop_reason) and m.usage.output_tokens > 0
        return [b.name for b in uses]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", [Chat, Responses, Messages], ids=["chat", "responses", "anthropic"])
def test_three_turn_tool_conversation_in_each_api_is_one_sample(server, model, api, stream):
    """The same conversation (same seeds, so the same sampled tokens) through each API shape: the proxy
    records prompt ids that extend the previous call's prompt + response ids, and the calls merge into one
    sample whose logprobs the trainer reproduces."""
    rid = f"three-turn-{api.__name__}-{'sse' if stream else 'json'}"
    h = api(server, rid)
    names = [h.turn(force, seed, stream) for force, seed in zip(FORCE, SEEDS)]
    assert names[0] == names[1] == ["calculator"]  # tool_choice names the function: the proxy starts the call, the model fills it in
    calls = calls_of(server, rid)
    assert [c.index for c in calls] == [0, 1, 2] and {c.api for c in calls} == {api.__name__.lower().replace("messages", "anthropic")}
    for prev, cur in zip(calls, calls[1:]):
        assert cur.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)] == prev.prompt_ids + prev.response_ids
        assert cur.parent == prev.index and cur.split_hint is None
    for call in calls:  # invariant 1, per call ...
        assert max(abs(a - b) for a, b in zip(teacher_forced_call(model, call), call.response_logprobs)) < 2e-3
    samples, stats = build_samples(calls)  # ... and on the merged sample
    assert len(samples) == 1 and stats["samples"] == 1
    s = samples[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0].float(), -1)
    assert all(abs(lp[i - 1, s.tokens[i]].item() - old) < 2e-3 for i, (m, old) in enumerate(zip(s.loss_mask, s.logprobs)) if m)
    assert sum(s.loss_mask) == sum(len(c.response_ids) for c in calls)


def test_the_same_conversation_is_one_internal_conversation_in_every_api(tok):
    """A tool-using exchange written in each API shape maps to the same messages, hence the same prompt ids."""
    from lightning_lite.apis import parse_anthropic_request, parse_chat_request, parse_responses_request
    from lightning_lite.chat import Renderer

    args = {"expression": "17*23"}
    chat = parse_chat_request({"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "391"}], "tools": [{"type": "function", "function": CALC}]})
    resp = parse_responses_request({"instructions": SYSTEM, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}, {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": json.dumps(args)},
        {"type": "function_call_output", "call_id": "c1", "output": "391"}], "tools": [{"type": "function", **CALC}, {"type": "web_search"}]}, lambda _: [])
    anth = parse_anthropic_request({"system": [{"type": "text", "text": SYSTEM}], "max_tokens": 5, "messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "calculator", "input": args}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "391"}]}]}],
        "tools": [{"name": "calculator", "description": CALC["description"], "input_schema": CALC["parameters"]}]})
    assert chat.messages == resp.messages == anth.messages and chat.tools == resp.tools == anth.tools
    r = Renderer(tok)
    assert r.build_prompt(chat.messages, chat.tools, []) == r.build_prompt(anth.messages, anth.tools, [])


def test_streaming_sends_tokens_as_they_are_sampled(server):
    """Time to the first content delta is a fraction of the whole generation (not sent after it)."""
    c = client(server, "live")
    t0 = time.time()
    stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
                                       max_tokens=48, temperature=0, stream=True)
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

    s = ContentStream(tok, stops=["STOP"], parse_tools=True, forced=False)
    pieces = [s.feed(tok.encode(t)) for t in ["  Hello", "  Hello wor", "  Hello world <tool", "  Hello world <tool_call>\n{", "  Hello world ST"]]
    assert pieces == ["Hello", " wor", "ld", "", ""] and s.sent == "Hello world"  # "<tool" may start a call: held back
    s = ContentStream(tok, stops=[], parse_tools=False, forced=False)
    ids = tok.encode("café ☕")
    assert "".join(s.feed(ids[:k]) for k in range(1, len(ids) + 1)) == "café ☕"  # no split UTF-8 character, ever
    assert ContentStream(tok, [], True, forced=True).feed(ids) == ""


def test_anthropic_count_tokens_errors_and_probe(server):
    base = f"{server.url}/rollout/anth-misc"
    a = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    n = a.messages.count_tokens(model="m", system="Be brief.", messages=[{"role": "user", "content": "hi"}]).input_tokens
    assert n == len(server.proxy.renderer.build_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [], [])[0])
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="m", max_tokens=4, messages=[])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert requests.head(base).status_code == 200  # Claude Code probes its base URL first
    r = requests.post(base + "/v1/messages?beta=true", json={"model": "m", "max_tokens": 3, "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"},
                      "context_management": {"edits": []}, "output_config": {"effort": "high"}, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}, {"role": "system", "content": "Be brief."},
                                   {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"}, {"type": "text", "text": "Hello"}]},
                                   {"role": "user", "content": "Bye"}]}, headers={"anthropic-beta": "context-management-2025-06-27"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_responses_previous_response_id(server):
    c = client(server, "prev-id")
    r1 = c.responses.create(model="m", input="Name a color.", max_output_tokens=4, temperature=0)
    r2 = c.responses.create(model="m", previous_response_id=r1.id, input=[{"role": "user", "content": "Another one."}], max_output_tokens=4, temperature=0)
    calls = calls_of(server, "prev-id")
    assert r2.previous_response_id == r1.id and calls[1].parent == 0  # the stored conversation was extended
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="m", previous_response_id="resp_nope", input="hi", max_output_tokens=2)
    assert "previous_response_id" in e.value.message
    # tool types the model cannot use are ignored, reasoning items too; an image is refused
    ok = c.responses.create(model="m", input=[{"type": "reasoning", "id": "rs_1", "summary": []}, {"role": "developer", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                            tools=[{"type": "web_search"}, {"type": "namespace", "name": "x", "tools": []}], include=["reasoning.encrypted_content"],
                            reasoning={"effort": "high"}, store=False, parallel_tool_calls=True, max_output_tokens=3,
                            temperature=0, extra_body={"client_metadata": {"a": "b"}, "prompt_cache_key": "k"})
    assert ok.status == "incomplete" and ok.usage.output_tokens == 3
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_a_request_that_appends_converts_only_its_new_messages():
    """With a memo kept per conversation, the messages a request shares with the previous one are reused (the
    same objects: no Python work per earlier message), the new ones converted; the result is what parsing
    without a memo gives; an edited message is converted again; a bad request leaves the memo as it was."""
    from lightning_lite.apis import parse_anthropic_request, parse_chat_request, parse_responses_request
    from lightning_lite.chat import BadRequest

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    shapes = {  # a user turn, an assistant turn with a tool call, its result; the memo sees the first two, then all three
        "chat": (lambda items, memo: parse_chat_request({"messages": items}, memo),
                 [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]),
        "anthropic": (lambda items, memo: parse_anthropic_request({"messages": items, "max_tokens": 4}, memo),
                      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "1"}]}]),
        "responses": (lambda items, memo: parse_responses_request({"input": items}, None, memo),
                      [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": "ok"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}, {"type": "function_call_output", "call_id": "c1", "output": "1"}]),
    }
    for name, (parse, items) in shapes.items():
        memo = {}
        first = parse(items[:-1], memo).messages
        second = parse(items, memo).messages
        assert second == parse(items, None).messages and len(second) == 3 and second[2]["role"] == "tool", name
        assert second[0] is first[0] and (name == "responses" or second[1] is first[1]), name  # reused, not converted again
        edited = [{"role": "user", "content": "hello"}] + items[1:]
        assert parse(edited, memo).messages == parse(edited, None).messages and memo["items"] is edited, name
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
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": text}]}]})
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "name": "bash", "arguments": {"command": "echo hello"}}]}
    for other in ("Calling tools:\n[1, 2]", "Calling tools: not a list", "I was calling tools: [{'function': {'name': 'x'}}] yesterday"):
        assert "tool_calls" not in parse_chat_request({"messages": [{"role": "assistant", "content": other}]}).messages[0]


def captured(shape_paths):
    """Captured harness requests to the given routes (skipped with one line when the folder is absent)."""
    import os

    from conftest import HARNESS_REQUESTS, NO_CAPTURES

    if not os.path.isdir(HARNESS_REQUESTS):
        return [pytest.param(None, None, id="captured", marks=pytest.mark.skip(reason=NO_CAPTURES))]
    out = []
    for name in sorted(os.listdir(HARNESS_REQUESTS)):
        for i, line in enumerate(open(os.path.join(HARNESS_REQUESTS, name)) if name.endswith(".jsonl") else []):
            r = json.loads(line)
            if r.get("method") == "POST" and r["path"].split("?")[0] in shape_paths:
                out.append(pytest.param(r["path"], r["body"], id=f"{name[:-6]}-{i}"))
    return out


def sse_events(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path,body", captured({"/v1/messages", "/v1/responses"}))
def test_replay_captured_anthropic_and_responses_requests(server, path, body):
    """Each request Claude Code, Codex, the Agents SDK and OpenHands sent, as sent (fewer tokens): a well-formed
    answer in its API's format, or, past the embedded model's 8192 tokens, the context error in that format."""
    anth = path.startswith("/v1/messages")
    body = dict(body, **({"max_tokens": 6} if anth else {"max_output_tokens": 6}))
    r = requests.post(f"{server.url}/rollout/replay-{abs(hash(path + json.dumps(body)[:200])) % 10**8}{path}", json=body)
    if r.status_code == 400:
        err = r.json()
        assert (err["error"]["type"] if anth else err["error"]["code"]) in ("invalid_request_error", "context_length_exceeded") and "context length" in r.text
        return
    assert r.status_code == 200, r.text[:500]
    if not body.get("stream"):
        out = r.json()
        assert out["type" if anth else "object"] == ("message" if anth else "response") and out["usage"]
        return
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    if anth:
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    else:
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_client_that_goes_away_stops_its_generation(server):
    """The harness gave up (timeout, closed connection): its call stops generating within a few tokens and
    is recorded as cancelled."""
    stats = server.proxy.backend.stats
    before = dict(stats)
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a very long essay about the sea."}], "max_tokens": 2000, "temperature": 1.0}
    with pytest.raises(requests.exceptions.ReadTimeout):  # not streamed: the client gives up waiting
        requests.post(f"{server.url}/rollout/gone-False/v1/chat/completions", json=body, timeout=1.5)
    with requests.post(f"{server.url}/rollout/gone-True/v1/chat/completions", json=dict(body, stream=True), stream=True) as r:
        next(r.iter_lines())  # streamed: the client reads the first event, then closes the connection
    deadline = time.time() + 30
    while stats["cancelled"] - before["cancelled"] < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert stats["cancelled"] - before["cancelled"] == 2
    assert stats["generated_tokens"] - before["generated_tokens"] < 400  # not the 4,000 asked for
    # nothing answered: each recorded as cancelled, with no response (never trained on)
    assert [(c.finish_reason, c.response_ids) for c in calls_of(server, "gone-False") + calls_of(server, "gone-True")] == [("cancelled", [])] * 2


def test_a_reply_cut_by_the_proxys_cap_is_answered_as_finished(tok, tmp_path):
    """The trainer's cap is not the client's limit: the client is told stop / end_turn / completed, the record says length."""
    from test_proxy import CannedBackend

    from lightning_lite.proxy import Proxy, ProxyServer
    from lightning_lite.records import read_calls

    srv = ProxyServer(Proxy(CannedBackend(tok, "Once upon a time"), tok, out_dir=str(tmp_path), max_new_tokens=4)).start()
    try:
        msgs = [{"role": "user", "content": "Tell me a story."}]
        assert client(srv, "cap").chat.completions.create(model="m", messages=msgs).choices[0].finish_reason == "stop"
        assert client(srv, "cap").chat.completions.create(model="m", messages=msgs, max_tokens=4).choices[0].finish_reason == "length"  # its own limit
        a = anthropic.Anthropic(base_url=f"{srv.url}/rollout/cap", api_key="x", max_retries=0)
        assert a.messages.create(model="m", max_tokens=8000, messages=msgs).stop_reason == "end_turn"
        assert client(srv, "cap").responses.create(model="m", input="Tell me a story.").status == "completed"
        assert client(srv, "cap").completions.create(model="m", prompt="Once").choices[0].finish_reason == "stop"
    finally:
        srv.stop()
    calls = read_calls(str(tmp_path / "calls.jsonl"))
    assert [(c.finish_reason, c.capped) for c in calls] == [("length", True), ("length", False), ("length", True), ("length", True), ("length", True)]
