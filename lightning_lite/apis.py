"""Chat completions: its request -> the internal :class:`~chat.Request` (one conversation of
normalized messages, docs/serving.md), and the internal reply -> its answer; the
helpers every API shape shares (the others, Anthropic Messages, Responses and /v1/completions, are
in ``extras/``).

A reply writer (``ChatReply``; the extras' ``AnthropicReply``, ``ResponsesReply``) turns the
answered calls into the JSON body (``body(answers)``) or server-sent events: ``start()`` before the
first token, ``reasoning(delta)`` and ``text(delta)`` as they are sampled (all reasoning before any
text), ``end(answers, sent, sent_reasoning)`` for what was not sent yet (tool calls are sent whole,
once parsed), ``error(message)`` when the backend fails mid-stream. ``answers`` are (call, reply)
pairs: the recorded Call and the parsed assistant message (``{"role", "content", "reasoning"?,
"tool_calls"?}``); ``sent``, ``sent_reasoning``: what was streamed already."""

import ast
import json
import math
import re
import time
import uuid
from typing import Any, Callable, Optional

from .chat import ROLES, BadRequest, Request, Sampling, parse_arguments
from .records import common_prefix

# ----------------------------------------------------------------------------- parsing, shared


def convert(items: list, convert_item: Callable[[Any, int], list[dict]], memo: Optional[dict]):
    """``convert_item(items[i], i)`` for every item, concatenated. ``memo`` (None, or a dict the
    caller keeps for one conversation) holds the previous request's items and what they became: the
    items this request starts with again (equal, compared in C) reuse it, so appending a turn
    converts only the new items. The messages returned are shared between requests: never modify
    one.

    >>> memo = {}; convert(["a", "b"], lambda it, i: [{"content": it}], memo)
    [{'content': 'a'}, {'content': 'b'}]
    >>> convert(["a", "b", "c"], f, memo)   # f sees only "c"
    """
    memo = {} if memo is None else memo
    k = common_prefix(items, memo.get("items", []))
    out = memo.get("out", [])[:k] + [convert_item(it, i) for i, it in enumerate(items[k:], k)]
    # stored only once every item converted: a bad request changes nothing
    memo["items"] = items
    memo["out"] = out
    return [m for ms in out for m in ms]


def expect(cond: bool, message: str, param: Optional[str], code: Optional[str] = None):
    """A 400 with ``message`` unless ``cond``; its code: "invalid_type" for a "must be", else
    "invalid_value"."""
    if not cond:
        code = code or ("invalid_type" if "must be" in message else "invalid_value")
        raise BadRequest(message, param, code)


def must_be(cond: bool, param: str, what: str):
    """A 400 "'param' must be what" (code invalid_type) unless ``cond``."""
    expect(cond, f"'{param}' must be {what}", param)


def text_of(content: Any, param: str) -> str:
    """Content as a string or a list of parts -> one string (text parts joined by newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    must_be(isinstance(content, list), param, "a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        part = {"type": "text", "text": part} if isinstance(part, str) else part
        must_be(isinstance(part, dict), where, "an object")
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text"):
            must_be(isinstance(part.get("text"), str), where + ".text", "a string")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            message = f"content part type '{kind}' is not supported: this model reads text only"
            raise BadRequest(message, where + ".type", "unsupported_content")
    return "\n".join(texts)


def _number(key: str, value: Any, lo: float, hi: float, default, integer: bool = False):
    if value is None:
        return default
    is_number = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    must_be(is_number, key, "an integer" if integer else "a number")
    span = f"at least {lo}" if hi == math.inf else f"between {lo} and {hi}"
    expect(lo <= value <= hi, f"'{key}' must be {span}, got {value}", key, "invalid_value")
    return value


def settings(body: dict, max_tokens: Any, stop: Any) -> dict:
    """The Request's ``sampling``, ``stream`` and ``model``. ``max_tokens``, ``stop``: their values
    (names vary)."""
    max_tokens = _number("max_tokens", max_tokens, 1, math.inf, None, integer=True)
    stop = [stop] if isinstance(stop, str) else stop or []
    strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    must_be(strings, "stop", "a string or a list of strings")
    sampling = Sampling(
        max_tokens=max_tokens,
        stop=[s for s in stop if s],
        seed=_number("seed", body.get("seed"), -math.inf, math.inf, None, integer=True),
        temperature=float(_number("temperature", body.get("temperature"), 0.0, 2.0, 1.0)),
        top_p=float(_number("top_p", body.get("top_p"), 0.0, 1.0, 1.0)),
        # -1 (vLLM's "off") -> 0
        top_k=max(0, int(_number("top_k", body.get("top_k"), -1, 1e9, 0))),
    )
    return dict(
        sampling=sampling, stream=bool(body.get("stream")), model=str(body.get("model", ""))
    )


def openai_settings(body: dict) -> dict:
    """``settings`` + OpenAI's ``n`` (each choice is sampled and recorded as its own call) and
    ``include_usage``."""
    stream_options = body.get("stream_options") or {}
    must_be(isinstance(stream_options, dict), "stream_options", "an object")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    n = _number("n", body.get("n"), 1, 16, 1, integer=True)
    include_usage = bool(stream_options.get("include_usage"))
    return {**settings(body, max_tokens, body.get("stop")), "n": n, "include_usage": include_usage}


def tools_of(body: dict) -> dict:
    """``tools`` and ``tool_choice`` in any API's shape -> the Request's ``tools``, ``parse_tools``,
    ``force_tool``. Tools the model cannot call (server tools: web_search, namespace, Anthropic's
    bash_...: a type other than "function" and no input_schema) are left out."""
    tools = body.get("tools") or []
    must_be(isinstance(tools, list), "tools", "a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        must_be(isinstance(tool, dict), where, "an object")
        if tool.get("type", "function") != "function" and "input_schema" not in tool:
            continue
        # chat nests the function, the others do not
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        expect(isinstance(fn.get("name"), str), f"'{where}.name' must be a string", where)
        kept = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        out.append({**kept, "parameters": fn["input_schema"]} if "input_schema" in fn else kept)
    # "auto" | "none" | "required", or {"type": "auto" | "none" | "any" | "function" | "tool", ...}
    choice = body.get("tool_choice")
    known = choice in (None, "auto", "none", "required") or isinstance(choice, dict)
    must_be(known, "tool_choice", '"auto", "none", "required" or an object')
    kind = choice
    if isinstance(choice, dict):
        kind = choice.get("type")
    force = None
    if out and kind in ("required", "any"):
        force = ""
    elif out and kind in ("function", "tool"):
        fn = choice.get("function")
        force = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        expect(isinstance(force, str), "'tool_choice.name' must be a string", "tool_choice")
        message = f"tool_choice names '{force}', which is not in 'tools'"
        expect(force in {t["name"] for t in out}, message, "tool_choice")
    return {"tools": out, "parse_tools": bool(out) and kind != "none", "force_tool": force}


def response_format(fmt: Any, param: str) -> dict:
    """A JSON reply asked for -> the Request's ``response_schema``: chat's ``{"type": "json_schema",
    "json_schema": {"schema"}}``, the Responses API's and Anthropic's ``{"type": "json_schema",
    "schema"}``, ``{"type": "json_object"}``."""
    if fmt is None:
        return {}
    must_be(isinstance(fmt, dict), param, "an object")
    kind = fmt.get("type")
    known = kind in (None, "text", "json_object", "json_schema")
    must_be(known, param + ".type", '"text", "json_object" or "json_schema"')
    if kind == "json_schema":
        nested = fmt.get("json_schema")
        schema = nested.get("schema") if isinstance(nested, dict) else fmt.get("schema")
        expect(isinstance(schema, dict), f"'{param}' must hold its JSON schema as an object", param)
        return {"response_schema": schema}
    return {"response_schema": {"type": "object"}} if kind == "json_object" else {}


def json_object(body: Any) -> dict:
    message = "the request body must be a JSON object"
    expect(isinstance(body, dict), message, None, "invalid_request")
    return body


def messages_of(body: Any) -> tuple[dict, list]:
    """The body and its non-empty list of ``messages``."""
    body = json_object(body)
    must_be(isinstance(body.get("messages"), list), "messages", "a list")
    expect(body["messages"], "'messages' must not be empty", "messages")
    return body, body["messages"]


# ----------------------------------------------------------------------------- chat completions


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    must_be(isinstance(m, dict), param, "an object")
    role = m.get("role")
    must_be(isinstance(role, str), param + ".role", "a string")
    message = f"unknown role '{role}' in {param}; expected one of {sorted(ROLES)}"
    expect(role in ROLES, message, param + ".role")
    out: dict = {"role": ROLES[role], "content": text_of(m.get("content"), param + ".content")}
    if out["role"] == "assistant":
        # vLLM's name, OpenRouter's
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning and isinstance(reasoning, str):
            out["reasoning"] = reasoning
        calls = m.get("tool_calls")
        out.update(
            _calls(calls, param + ".tool_calls") if calls else _calls_as_text(out["content"])
        )
    if out["role"] == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    return out


def _calls(tool_calls: Any, param: str) -> dict:
    """Chat tool calls ``[{"id", "function": {"name", "arguments"}}]`` -> ``{"tool_calls": [{"id",
    "name", "arguments"}]}``."""
    must_be(isinstance(tool_calls, list), param, "a list")
    calls = []
    for j, call in enumerate(tool_calls):
        where = f"{param}[{j}]"
        is_call = isinstance(call, dict) and isinstance(call.get("function"), dict)
        must_be(is_call, where, "an object with a 'function'")
        fn = call["function"]
        must_be(isinstance(fn.get("name"), str), where + ".function.name", "a string")
        arguments = parse_arguments(fn.get("arguments", {}))
        calls.append({"id": str(call.get("id", "")), "name": fn["name"], "arguments": arguments})
    return {"tool_calls": calls}


CALLS_AS_TEXT = re.compile(r"\s*Calling tools:\s*(\[.*\])\s*", re.DOTALL)


def _calls_as_text(content: str) -> dict:
    """smolagents sends the tool calls it received back as text, ``Calling tools:\n[{'id': ...,
    'function': {...}}]`` (a Python repr): read them back as tool calls, so the turn matches the
    reply the proxy gave (README)."""
    match = CALLS_AS_TEXT.fullmatch(content)
    try:
        calls = ast.literal_eval(match.group(1)) if match else None
        return {"content": "", **_calls(calls, "content")} if calls else {}
    # not tool calls: the text it is
    except (ValueError, SyntaxError, MemoryError, RecursionError, BadRequest):
        return {}


def parse_chat_request(body: Any, memo: Optional[dict] = None) -> Request:
    """Validate a /v1/chat/completions body. Unknown fields (reasoning_effort, metadata, ...) are
    ignored."""
    body, messages = messages_of(body)
    # {"enable_thinking": false}, ...
    template_kwargs = body.get("chat_template_kwargs")
    template_kwargs = {} if template_kwargs is None else template_kwargs
    must_be(isinstance(template_kwargs, dict), "chat_template_kwargs", "an object")
    return Request(
        messages=convert(messages, lambda m, i: [_message(m, i)], memo),
        **tools_of(body),
        **response_format(body.get("response_format"), "response_format"),
        template_kwargs=template_kwargs,
        **openai_settings(body),
        logprobs=bool(body.get("logprobs")),
    )


def open_chat(body: Any, memo: dict, proxy):
    """The chat completions route's ``open_api`` (proxy.conversation)."""
    req = parse_chat_request(body, memo)
    return req, lambda n_prompt: ChatReply(req, proxy.model_name, n_prompt, proxy.tok)


# ---------------------------------------------------------------- replies and stream events, shared


def sse(obj: dict, event: Optional[str] = None) -> bytes:
    """One server-sent event: ``sse({"a": 1}, "x") == b'event: x\\ndata: {"a": 1}\\n\\n'``."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n".encode()


def rest(content: str, sent: str) -> str:
    """What of the final content the stream has not sent yet (sent is always a prefix of it)."""
    return content[len(sent) :] if content.startswith(sent) else ""


def usage(n_prompt: int, answers) -> dict:
    """One request's usage: its prompt once, the tokens of all its choices."""
    n = sum(len(call.response_ids) for call, _ in answers)
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}


def client_finish(call, reply) -> str:
    """What the client is told (README): "tool_calls" whenever it got calls to run, even from a cut
    reply; a reply the proxy's own cap cut (``capped``) as finished, not "length", which the record
    keeps."""
    if reply.get("tool_calls"):
        return "tool_calls"
    return "stop" if call.capped else call.finish_reason


def error_body(status: int, message: str, param=None, code=None) -> dict:
    """OpenAI's error body for an HTTP status (the proxy's errors but other APIs' shapes:
    hooks.ERROR_SHAPES)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_head(kind: str, prefix: str, req: Request, model: str) -> dict:
    """What every chunk (and body) of an OpenAI reply starts with: its id, object, creation time and
    model."""
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time())}
    return head | {"model": req.model or model}


class ChatReply:
    def __init__(self, req: Request, model: str, n_prompt: int, tok=None):
        """``tok``: to write the tokens of ``logprobs``."""
        self.req = req
        self.n_prompt = n_prompt
        self.tok = tok
        self.head = openai_head("chat.completion.chunk", "chatcmpl", req, model)
        self.id = self.head["id"]

    @staticmethod
    def _tool_calls(reply) -> list[dict]:
        out = []
        for t in reply.get("tool_calls", []):
            function = {"name": t["name"], "arguments": t["arguments"]}
            out.append({"id": t["id"], "type": "function", "function": function})
        return out

    def _choice(self, call, reply) -> dict:
        calls = self._tool_calls(reply)
        message = {"role": "assistant", "content": reply["content"]}
        # a reply of tool calls only: content null, as OpenAI's
        if calls and not reply["content"]:
            message["content"] = None
        if reply.get("reasoning"):
            message["reasoning_content"] = reply["reasoning"]
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if self.req.logprobs:
            tokens = [self.tok.decode([t]) for t in call.response_ids]
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, call.response_logprobs)
            ]
            logprobs = {"content": content}
        finish = client_finish(call, reply)
        return dict(index=call.choice, message=message, finish_reason=finish, logprobs=logprobs)

    def body(self, answers) -> dict:
        choices = [self._choice(call, reply) for call, reply in answers]
        usage_ = usage(self.n_prompt, answers)
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": usage_}

    def _chunk(self, index: int, delta: dict, finish=None) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        return sse({**self.head, "choices": [choice]})

    def start(self) -> bytes:
        opening = {"role": "assistant", "content": ""}
        return b"".join(self._chunk(i, opening) for i in range(self.req.n))

    def reasoning(self, delta: str) -> bytes:
        return self._chunk(0, {"reasoning_content": delta})

    def text(self, delta: str) -> bytes:
        return self._chunk(0, {"content": delta})

    def end(self, answers, sent: str = "", sent_reasoning: str = "") -> bytes:
        out = []
        fields = (("reasoning", "reasoning_content", sent_reasoning), ("content", "content", sent))
        for call, reply in answers:
            for key, field_, done in fields:
                # only choice 0 streams live
                unsent = rest(reply.get(key, ""), done if call.choice == 0 else "")
                if unsent:
                    out.append(self._chunk(call.choice, {field_: unsent}))
            for i, tool_call in enumerate(self._tool_calls(reply)):
                out.append(self._chunk(call.choice, {"tool_calls": [{"index": i, **tool_call}]}))
            out.append(self._chunk(call.choice, {}, client_finish(call, reply)))
        if self.req.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": usage(self.n_prompt, answers)}))
        return b"".join(out) + b"data: [DONE]\n\n"

    def error(self, message: str) -> bytes:
        return sse(error_body(500, message)) + b"data: [DONE]\n\n"
