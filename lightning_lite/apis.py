"""API shapes: each one's request -> the internal :class:`~chat.Request`, one conversation of normalized messages
whatever the API (README "Serving and recording": what each route accepts), and the internal reply -> its answer.

Writers (``ChatReply``, ``AnthropicReply``, ``ResponsesReply``; ``CompletionsReply``) turn the answered calls
into the JSON body (``body(answers)``) or server-sent events: ``start()`` before the first token,
``reasoning(delta)`` and ``text(delta)`` as they are sampled (all reasoning before any text),
``end(answers, sent, sent_reasoning)`` for what was not sent yet (tool calls are sent whole, once parsed),
``error(message)`` when the backend fails mid-stream.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
import uuid
from typing import Any, Callable, Optional

from .chat import ROLES, BadRequest, Request, Sampling, parse_arguments
from .records import common_prefix


def _convert(
    items: list, convert: Callable[[Any, int], list[dict]], memo: Optional[dict]
) -> list[dict]:
    """``convert(items[i], i)`` for every item, concatenated. ``memo`` (None, or a dict the caller keeps for
    one conversation) holds the previous request's items and what they became: the items this request
    starts with again (equal, compared in C) reuse it, so appending a turn converts only the new items.
    The messages returned are shared between requests: never modify one."""
    memo = {} if memo is None else memo
    k = common_prefix(items, memo.get("items", []))
    out = memo.get("out", [])[:k] + [convert(it, i) for i, it in enumerate(items[k:], k)]
    memo["items"], memo["out"] = (
        items,
        out,
    )  # only once every item converted: a bad request changes nothing
    return [m for ms in out for m in ms]


def _expect(cond: bool, message: str, param: Optional[str], code: Optional[str] = None):
    if not cond:
        raise BadRequest(
            message, param, code or ("invalid_type" if "must be" in message else "invalid_value")
        )


def _text_of(content: Any, param: str) -> str:
    """Content as a string or a list of parts -> one string (text parts joined by newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    _expect(
        isinstance(content, list), f"'{param}' must be a string or a list of content parts", param
    )
    texts = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        part = {"type": "text", "text": part} if isinstance(part, str) else part
        _expect(isinstance(part, dict), f"'{p}' must be an object", p)
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text"):
            _expect(isinstance(part.get("text"), str), f"'{p}.text' must be a string", p + ".text")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise BadRequest(
                f"content part type '{kind}' is not supported: this model reads text only",
                p + ".type",
                "unsupported_content",
            )
    return "\n".join(texts)


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    _expect(isinstance(m, dict), f"'{param}' must be an object", param)
    role = m.get("role")
    _expect(isinstance(role, str), f"'{param}.role' must be a string", param + ".role")
    _expect(
        role in ROLES,
        f"unknown role '{role}' in {param}; expected one of {sorted(ROLES)}",
        param + ".role",
    )
    out: dict = {"role": ROLES[role], "content": _text_of(m.get("content"), param + ".content")}
    if out["role"] == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning")  # vLLM's name, OpenRouter's
        if reasoning and isinstance(reasoning, str):
            out["reasoning"] = reasoning
        out.update(
            _calls(m["tool_calls"], param + ".tool_calls")
            if m.get("tool_calls")
            else _calls_as_text(out["content"])
        )
    if out["role"] == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    return out


def _calls(tcs: Any, param: str) -> dict:
    """Chat tool calls ``[{"id", "function": {"name", "arguments"}}]`` -> ``{"tool_calls": [{"id", "name", "arguments"}]}``."""
    _expect(isinstance(tcs, list), f"'{param}' must be a list", param)
    calls = []
    for j, tc in enumerate(tcs):
        p = f"{param}[{j}]"
        _expect(
            isinstance(tc, dict) and isinstance(tc.get("function"), dict),
            f"'{p}' must be an object with a 'function'",
            p,
        )
        fn = tc["function"]
        _expect(
            isinstance(fn.get("name"), str),
            f"'{p}.function.name' must be a string",
            p + ".function.name",
        )
        calls.append(
            {
                "id": str(tc.get("id", "")),
                "name": fn["name"],
                "arguments": parse_arguments(fn.get("arguments", {})),
            }
        )
    return {"tool_calls": calls}


CALLS_AS_TEXT = re.compile(r"\s*Calling tools:\s*(\[.*\])\s*", re.DOTALL)


def _calls_as_text(content: str) -> dict:
    """smolagents sends the tool calls it received back as text, ``Calling tools:\n[{'id': ..., 'function': {...}}]``
    (a Python repr): read them back as tool calls, so the turn matches the reply the proxy gave (README)."""
    m = CALLS_AS_TEXT.fullmatch(content)
    try:
        calls = ast.literal_eval(m.group(1)) if m else None
        return {"content": "", **_calls(calls, "content")} if calls else {}
    except (
        ValueError,
        SyntaxError,
        MemoryError,
        RecursionError,
        BadRequest,
    ):  # not tool calls: the text it is
        return {}


def _number(key: str, v: Any, lo: float, hi: float, default, integer: bool = False):
    if v is None:
        return default
    _expect(
        isinstance(v, int if integer else (int, float)) and not isinstance(v, bool),
        f"'{key}' must be {'an integer' if integer else 'a number'}",
        key,
    )
    span = f"at least {lo}" if hi == math.inf else f"between {lo} and {hi}"
    _expect(lo <= v <= hi, f"'{key}' must be {span}, got {v}", key, "invalid_value")
    return v


def _settings(body: dict, max_tokens: Any, stop: Any) -> dict:
    """The Request's ``sampling``, ``stream`` and ``model``. ``max_tokens``, ``stop``: their values (names vary)."""
    max_tokens = _number("max_tokens", max_tokens, 1, math.inf, None, integer=True)
    stop = [stop] if isinstance(stop, str) else stop or []
    _expect(
        isinstance(stop, list) and all(isinstance(s, str) for s in stop),
        "'stop' must be a string or a list of strings",
        "stop",
    )
    sampling = Sampling(
        max_tokens=max_tokens,
        stop=[s for s in stop if s],
        seed=_number("seed", body.get("seed"), -math.inf, math.inf, None, integer=True),
        temperature=float(_number("temperature", body.get("temperature"), 0.0, 2.0, 1.0)),
        top_p=float(_number("top_p", body.get("top_p"), 0.0, 1.0, 1.0)),
        top_k=max(0, int(_number("top_k", body.get("top_k"), -1, 1e9, 0))),
    )  # -1 (vLLM's "off") -> 0
    return {
        "sampling": sampling,
        "stream": bool(body.get("stream", False)),
        "model": str(body.get("model", "")),
    }


def _tools(body: dict) -> dict:
    """``tools`` and ``tool_choice`` in any API's shape -> the Request's ``tools``, ``parse_tools``, ``force_tool``.
    Tools the model cannot call (server tools: web_search, namespace, Anthropic's bash_...: a type other than
    "function" and no input_schema) are left out."""
    tools = body.get("tools") or []
    _expect(isinstance(tools, list), "'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        _expect(isinstance(t, dict), f"'tools[{i}]' must be an object", f"tools[{i}]")
        if t.get("type", "function") != "function" and "input_schema" not in t:
            continue
        fn = (
            t["function"] if isinstance(t.get("function"), dict) else t
        )  # chat nests the function, the others do not
        _expect(
            isinstance(fn.get("name"), str), f"'tools[{i}].name' must be a string", f"tools[{i}]"
        )
        tool = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        out.append({**tool, "parameters": fn["input_schema"]} if "input_schema" in fn else tool)
    choice = body.get(
        "tool_choice"
    )  # "auto" | "none" | "required", or {"type": "auto" | "none" | "any" | "function" | "tool", ...}
    _expect(
        choice in (None, "auto", "none", "required") or isinstance(choice, dict),
        '\'tool_choice\' must be "auto", "none", "required" or an object',
        "tool_choice",
    )
    kind, force = choice.get("type") if isinstance(choice, dict) else choice, None
    if out and kind in ("required", "any"):
        force = ""
    elif out and kind in ("function", "tool"):
        fn = choice.get("function")
        force = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        _expect(isinstance(force, str), "'tool_choice.name' must be a string", "tool_choice")
        if force not in {t["name"] for t in out}:
            raise BadRequest(
                f"tool_choice names '{force}', which is not in 'tools'",
                "tool_choice",
                "invalid_value",
            )
    return {"tools": out, "parse_tools": bool(out) and kind != "none", "force_tool": force}


def _response_format(fmt: Any, param: str) -> dict:
    """A JSON reply asked for -> the Request's ``response_schema``: chat's ``{"type": "json_schema", "json_schema":
    {"schema"}}``, the Responses API's and Anthropic's ``{"type": "json_schema", "schema"}``, ``{"type": "json_object"}``."""
    if fmt is None:
        return {}
    _expect(isinstance(fmt, dict), f"'{param}' must be an object", param)
    kind = fmt.get("type")
    _expect(
        kind in (None, "text", "json_object", "json_schema"),
        f'\'{param}.type\' must be "text", "json_object" or "json_schema"',
        param + ".type",
    )
    if kind == "json_schema":
        schema = (
            fmt["json_schema"].get("schema")
            if isinstance(fmt.get("json_schema"), dict)
            else fmt.get("schema")
        )
        _expect(
            isinstance(schema, dict), f"'{param}' must hold its JSON schema as an object", param
        )
        return {"response_schema": schema}
    return {"response_schema": {"type": "object"}} if kind == "json_object" else {}


def _body(body: Any) -> dict:
    _expect(
        isinstance(body, dict), "the request body must be a JSON object", None, "invalid_request"
    )
    return body


def _messages(body: Any) -> tuple[dict, list]:
    body = _body(body)
    _expect(isinstance(body.get("messages"), list), "'messages' must be a list", "messages")
    _expect(body["messages"], "'messages' must not be empty", "messages")
    return body, body["messages"]


def _openai_settings(body: dict) -> dict:
    stream_options = body.get("stream_options") or {}
    _expect(
        isinstance(stream_options, dict), "'stream_options' must be an object", "stream_options"
    )
    settings = _settings(
        body, body.get("max_completion_tokens", body.get("max_tokens")), body.get("stop")
    )
    n = _number(
        "n", body.get("n"), 1, 16, 1, integer=True
    )  # each choice is sampled and recorded as its own call
    return {**settings, "n": n, "include_usage": bool(stream_options.get("include_usage", False))}


def parse_chat_request(body: Any, memo: Optional[dict] = None) -> Request:
    """Validate a /v1/chat/completions body. Unknown fields (reasoning_effort, metadata, ...) are ignored."""
    body, msgs = _messages(body)
    template_kwargs = (
        {} if body.get("chat_template_kwargs") is None else body["chat_template_kwargs"]
    )  # {"enable_thinking": false}, ...
    _expect(
        isinstance(template_kwargs, dict),
        "'chat_template_kwargs' must be an object",
        "chat_template_kwargs",
    )
    return Request(
        messages=_convert(msgs, lambda m, i: [_message(m, i)], memo),
        **_tools(body),
        **_response_format(body.get("response_format"), "response_format"),
        template_kwargs=template_kwargs,
        **_openai_settings(body),
        logprobs=bool(body.get("logprobs")),
    )


def parse_completions_request(body: Any) -> Request:
    """Validate a /v1/completions body: the prompt is a string or a list of token ids."""
    body = _body(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    req = Request(**_openai_settings(body), logprobs=body.get("logprobs") is not None)
    _expect(not body.get("echo"), "'echo' is not supported", "echo")
    ids = (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    _expect(
        isinstance(prompt, str) or ids,
        "'prompt' must be a non-empty string or a non-empty list of token ids "
        "(one prompt per request)",
        "prompt",
    )
    req.prompt_text, req.prompt_ids = (
        (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    )
    return req


# ----------------------------------------------------------------------------- Anthropic Messages


def parse_anthropic_request(body: Any, memo: Optional[dict] = None) -> Request:
    """Validate a /v1/messages body (README: what Claude Code sends)."""
    body, msgs = _messages(body)

    def message(
        m: Any, i: int
    ) -> list[dict]:  # one tool message per tool_result, then the turn's text and calls
        p, out = f"messages[{i}]", []
        _expect(isinstance(m, dict), f"'{p}' must be an object", p)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequest(
                f"unknown role {role!r} in {p}; expected user, assistant or system",
                p + ".role",
                "invalid_value",
            )
        texts, calls, thoughts, content = [], [], [], m.get("content")
        blocks = (
            [{"type": "text", "text": content or ""}]
            if content is None or isinstance(content, str)
            else content
        )
        _expect(
            isinstance(blocks, list) and all(isinstance(b, dict) for b in blocks),
            f"'{p}.content' must be a string or a list of content blocks",
            p + ".content",
        )
        for j, b in enumerate(blocks):
            kind, q = b.get("type"), f"{p}.content[{j}]"
            if kind == "text":
                texts.append(_text_of([b], q))
            elif kind == "tool_use" and role == "assistant":
                _expect(isinstance(b.get("name"), str), f"'{q}.name' must be a string", q + ".name")
                calls.append(
                    {
                        "id": str(b.get("id", "")),
                        "name": b["name"],
                        "arguments": b.get("input") or {},
                    }
                )
            elif kind == "tool_result":  # results come first in a user turn: one tool message each
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(b.get("tool_use_id", "")),
                        "content": _text_of(b.get("content"), q + ".content"),
                    }
                )
            elif kind == "thinking" and isinstance(b.get("thinking"), str) and b["thinking"]:
                thoughts.append(b["thinking"])
            elif kind in ("image", "document"):
                raise BadRequest(
                    f"content block type '{kind}' is not supported: this model reads text only",
                    q + ".type",
                    "unsupported_content",
                )
            # redacted_thinking (encrypted), server tool blocks: nothing this model can use
        if role == "assistant":
            out.append(
                {
                    "role": "assistant",
                    "content": "\n".join(texts),
                    **({"reasoning": "\n".join(thoughts)} if thoughts else {}),
                    **({"tool_calls": calls} if calls else {}),
                }
            )
        elif texts:
            out.append({"role": role, "content": "\n".join(texts)})
        return out

    system = (
        [{"role": "system", "content": _text_of(body["system"], "system")}]
        if body.get("system")
        else []
    )
    # structured outputs: output_config.format, or the beta's output_format
    config = body.get("output_config") if isinstance(body.get("output_config"), dict) else None
    fmt = (
        _response_format(config.get("format"), "output_config.format")
        if config
        else _response_format(body.get("output_format"), "output_format")
    )
    return Request(
        messages=system + _convert(msgs, message, memo),
        **_tools(body),
        **fmt,
        **_settings(body, body.get("max_tokens"), body.get("stop_sequences")),
    )


# ----------------------------------------------------------------------------- Responses API


def _part_texts(parts: Any) -> str:
    """The texts of a list of parts ({"type", "text"}), joined by newlines; anything else: ""."""
    return (
        "\n".join(
            p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
        if isinstance(parts, list)
        else ""
    )


def parse_responses_request(
    body: Any, previous: Callable[[str], list[dict]], memo: Optional[dict] = None
) -> Request:
    """Validate a /v1/responses body. ``previous(id)``: the conversation (input + output) of this rollout's response."""
    body = _body(body)
    history = []
    if body.get("previous_response_id") is not None:
        _expect(
            isinstance(body["previous_response_id"], str),
            "'previous_response_id' must be a string",
            "previous_response_id",
        )
        history = list(previous(body["previous_response_id"]))
    items = body.get("input", [])
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    _expect(isinstance(items, list), "'input' must be a string or a list of items", "input")

    def item(it: Any, i: int) -> list[dict]:  # a message, or a tool call (no "role": joined below)
        p = f"input[{i}]"
        _expect(isinstance(it, dict), f"'{p}' must be an object", p)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            _expect(
                role in ("user", "assistant", "system", "developer"),
                f"unknown role {role!r} in {p}",
                p + ".role",
            )
            return [{"role": ROLES[role], "content": _text_of(it.get("content"), p + ".content")}]
        if kind == "function_call":
            _expect(isinstance(it.get("name"), str), f"'{p}.name' must be a string", p + ".name")
            return [
                {
                    "id": str(it.get("call_id", "")),
                    "name": it["name"],
                    "arguments": parse_arguments(it.get("arguments", "{}")),
                }
            ]
        if kind == "function_call_output":
            output = _text_of(it.get("output"), p + ".output")
            return [{"role": "tool", "tool_call_id": str(it.get("call_id", "")), "content": output}]
        if (
            kind == "reasoning"
        ):  # its reasoning_text parts, else its summary; encrypted only: nothing to read
            text = _part_texts(it.get("content")) or _part_texts(it.get("summary"))
            return [{"role": "assistant", "content": "", "reasoning": text}] if text else []
        return []  # item references and calls of tools the model cannot use: ignored

    for m in _convert(
        items, item, memo
    ):  # one assistant turn: its reasoning, its message, its calls (new dicts: memo's are shared)
        last = history[-1] if history and history[-1]["role"] == "assistant" else None
        if "role" not in m and last is not None:  # a call joins the turn before it
            history[-1] = {**last, "tool_calls": last.get("tool_calls", []) + [m]}
        elif "role" not in m:
            history.append({"role": "assistant", "content": "", "tool_calls": [m]})
        elif (
            m["role"] == "assistant"
            and last is not None
            and last.keys() == {"role", "content", "reasoning"}
            and not last["content"]
        ):
            history[-1] = {
                **m,
                "reasoning": "\n".join(r for r in (last["reasoning"], m.get("reasoning")) if r),
            }  # the message after a reasoning item
        else:
            history.append(m)
    _expect(history, "'input' must not be empty", "input")
    instructions = (
        [{"role": "system", "content": _text_of(body["instructions"], "instructions")}]
        if body.get("instructions")
        else []
    )
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return Request(
        messages=instructions + history,
        **_tools(body),
        **_response_format(text.get("format"), "text.format"),
        **_settings(body, body.get("max_output_tokens"), None),
        n_instructions=len(instructions),
    )


# ----------------------------------------------------------------------------- replies and stream events
#
# ``answers`` are (call, reply) pairs: the recorded Call and the parsed assistant message ({"role", "content",
# "reasoning"?, "tool_calls"?}). ``sent``, ``sent_reasoning``: the content and reasoning already streamed.


def sse(obj: dict, event: Optional[str] = None) -> bytes:
    return (
        (f"event: {event}\n" if event else "").encode()
        + b"data: "
        + json.dumps(obj).encode()
        + b"\n\n"
    )


def _rest(content: str, sent: str) -> str:
    """What of the final content the stream has not sent yet (sent is always a prefix of it)."""
    return content[len(sent) :] if content.startswith(sent) else ""


def _usage(n_prompt: int, answers) -> dict:
    """One request's usage: its prompt once, the tokens of all its choices."""
    c = sum(len(call.response_ids) for call, _ in answers)
    return {"prompt_tokens": n_prompt, "completion_tokens": c, "total_tokens": n_prompt + c}


def client_finish(call, reply) -> str:
    """What the client is told (README): "tool_calls" whenever it got calls to run, even from a cut reply; a reply
    the proxy's own cap cut (``capped``) as finished, not "length", which the record keeps."""
    if reply.get("tool_calls"):
        return "tool_calls"
    return "stop" if call.capped else call.finish_reason


def error_body(
    api: str, message: str, type_: str = "invalid_request_error", param=None, code=None
) -> dict:
    if api == "anthropic":
        return {"type": "error", "error": {"type": type_, "message": message}}
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ChatReply:
    def __init__(self, req: Request, model: str, n_prompt: int, tok=None):
        self.req, self.n_prompt, self.tok, self.id = (
            req,
            n_prompt,
            tok,
            f"chatcmpl-{uuid.uuid4().hex}",
        )  # tok: to write the tokens of ``logprobs``
        self.head = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model or model,
        }

    @staticmethod
    def _tool_calls(reply) -> list[dict]:
        return [
            {
                "id": t["id"],
                "type": "function",
                "function": {"name": t["name"], "arguments": t["arguments"]},
            }
            for t in reply.get("tool_calls", [])
        ]

    def body(self, answers) -> dict:
        choices = []
        for call, reply in answers:
            calls = self._tool_calls(reply)
            msg = {
                "role": "assistant",
                "content": reply["content"] if (reply["content"] or not calls) else None,
                **({"reasoning_content": reply["reasoning"]} if reply.get("reasoning") else {}),
                **({"tool_calls": calls} if calls else {}),
            }
            c = {
                "index": call.choice,
                "message": msg,
                "finish_reason": client_finish(call, reply),
                "logprobs": None,
            }
            if self.req.logprobs:
                tokens = [self.tok.decode([t]) for t in call.response_ids]
                c["logprobs"] = {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, call.response_logprobs)
                    ]
                }
            choices.append(c)
        return {
            **self.head,
            "object": "chat.completion",
            "choices": choices,
            "usage": _usage(self.n_prompt, answers),
        }

    def _chunk(self, index: int, delta: dict, finish=None) -> bytes:
        return sse(
            {**self.head, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        )

    def start(self) -> bytes:
        return b"".join(
            self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.req.n)
        )

    def reasoning(self, delta: str) -> bytes:
        return self._chunk(0, {"reasoning_content": delta})

    def text(self, delta: str) -> bytes:
        return self._chunk(0, {"content": delta})

    def end(self, answers, sent: str = "", sent_reasoning: str = "") -> bytes:
        out = []
        for call, reply in answers:
            for key, field_, done in (
                ("reasoning", "reasoning_content", sent_reasoning),
                ("content", "content", sent),
            ):
                rest = _rest(
                    reply.get(key, ""), done if call.choice == 0 else ""
                )  # only choice 0 streams live
                if rest:
                    out.append(self._chunk(call.choice, {field_: rest}))
            for i, tc in enumerate(self._tool_calls(reply)):
                out.append(self._chunk(call.choice, {"tool_calls": [{"index": i, **tc}]}))
            out.append(self._chunk(call.choice, {}, client_finish(call, reply)))
        if self.req.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": _usage(self.n_prompt, answers)}))
        return b"".join(out) + b"data: [DONE]\n\n"

    def error(self, message: str) -> bytes:
        return sse(error_body("chat", message, "server_error")) + b"data: [DONE]\n\n"


class CompletionsReply:
    """/v1/completions: ``answers`` are (call, text) pairs; a stream is sent once generated, in word-sized pieces."""

    def __init__(self, req: Request, model: str, n_prompt: int, tok=None):
        self.req, self.n_prompt, self.tok, self.id = req, n_prompt, tok, f"cmpl-{uuid.uuid4().hex}"
        self.head = {
            "id": self.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or model,
        }

    def body(self, answers) -> dict:
        choices = []
        for call, text in answers:
            c = {
                "index": call.choice,
                "text": text,
                "finish_reason": client_finish(call, {}),
                "logprobs": None,
            }
            if self.req.logprobs:
                c["logprobs"] = {
                    "tokens": [self.tok.decode([t]) for t in call.response_ids],
                    "token_logprobs": call.response_logprobs,
                }
            choices.append(c)
        return {**self.head, "choices": choices, "usage": _usage(self.n_prompt, answers)}

    def _chunk(self, index: int, text: str, finish=None) -> bytes:
        return sse(
            {
                **self.head,
                "choices": [
                    {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
                ],
            }
        )

    def end(self, answers) -> bytes:
        out = []
        for call, text in answers:
            out += [
                self._chunk(call.choice, piece) for piece in re.findall(r"\s*\S+|\s+", text or "")
            ]
            out.append(self._chunk(call.choice, "", client_finish(call, {})))
        if self.req.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": _usage(self.n_prompt, answers)}))
        return b"".join(out) + b"data: [DONE]\n\n"


class AnthropicReply:
    STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

    def __init__(self, req: Request, model: str, n_prompt: int):
        self.req, self.n_prompt = req, n_prompt
        self.open, self.index = (
            None,
            0,
        )  # the stream's open block's type (or None) and its index (else the next one's)
        self.id, self.model = f"msg_{uuid.uuid4().hex[:24]}", req.model or model

    def _message(self, content: list, stop_reason, output_tokens: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": self.n_prompt, "output_tokens": output_tokens},
        }

    def body(self, answers) -> dict:
        ((call, reply),) = answers
        content = (
            [{"type": "thinking", "thinking": reply["reasoning"], "signature": ""}]
            if reply.get("reasoning")
            else []
        )
        content += (
            [{"type": "text", "text": reply["content"]}]
            if reply["content"] or not reply.get("tool_calls")
            else []
        )
        for tc in reply.get("tool_calls", []):
            args = parse_arguments(
                tc["arguments"]
            )  # arguments that are not a JSON object: no input
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + tc["id"].removeprefix("call_"),
                    "name": tc["name"],
                    "input": args if isinstance(args, dict) else {},
                }
            )
        return self._message(content, self.STOP[client_finish(call, reply)], len(call.response_ids))

    def start(self) -> bytes:
        return sse(
            {"type": "message_start", "message": self._message([], None, 0)}, "message_start"
        )

    def _delta(self, kind: str, delta: str) -> bytes:
        """``delta`` in the open block of this kind ("thinking" or "text"), closing the other and starting this one first."""
        block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        out = b"" if self.open == kind else self._start(block)
        return out + sse(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": kind + "_delta", kind: delta},
            },
            "content_block_delta",
        )

    def _start(self, block: dict) -> bytes:
        out, self.open = self._close(), block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + sse(start, "content_block_start")

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        # a thinking block ends with its signature: none here (nothing to verify it against when it comes back)
        out = (
            sse(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""},
                },
                "content_block_delta",
            )
            if self.open == "thinking"
            else b""
        )
        self.open, self.index = None, self.index + 1
        return out + sse(
            {"type": "content_block_stop", "index": self.index - 1}, "content_block_stop"
        )

    def reasoning(self, delta: str) -> bytes:
        return self._delta("thinking", delta)

    def text(self, delta: str) -> bytes:
        return self._delta("text", delta)

    def end(self, answers, sent: str = "", sent_reasoning: str = "") -> bytes:
        message, out = self.body(answers), []
        # from the first block not closed yet (the thinking closes once the text begins)
        for block in message["content"][self.index :]:
            kind = block["type"]
            if kind in ("thinking", "text"):
                rest = _rest(block[kind], sent_reasoning if kind == "thinking" else sent)
                out.append(self._delta(kind, rest) if rest or self.open != kind else b"")
            else:  # a tool_use, sent whole: closed by the next block, or the end
                out.append(self._start({**block, "input": {}}))
                out.append(
                    sse(
                        {
                            "type": "content_block_delta",
                            "index": self.index,
                            "delta": {
                                "type": "input_json_delta",
                                "partial_json": json.dumps(block["input"]),
                            },
                        },
                        "content_block_delta",
                    )
                )
        out.append(self._close())
        out.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                    "usage": {"output_tokens": message["usage"]["output_tokens"]},
                },
                "message_delta",
            )
        )
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return sse(error_body("anthropic", message, "api_error"), "error")


class ResponsesReply:
    def __init__(self, req: Request, model: str, n_prompt: int, previous_id: Optional[str] = None):
        self.req, self.n_prompt, self.seq = req, n_prompt, 0
        self.id, self.msg_id, self.model = (
            f"resp_{uuid.uuid4().hex}",
            f"msg_{uuid.uuid4().hex}",
            req.model or model,
        )
        self.created, self.previous_id = int(time.time()), previous_id
        self.rs_id, self.thought = (
            f"rs_{uuid.uuid4().hex}",
            "",
        )  # the reasoning item, and its text streamed so far
        self.open, self.index = (
            None,
            0,
        )  # the stream's open item ("reasoning" or "message", or None) and its output index (else the next one's)

    def _reasoning_item(self, text: str) -> dict:
        return {
            "type": "reasoning",
            "id": self.rs_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def _output(self, reply) -> list[dict]:
        out = [self._reasoning_item(reply["reasoning"])] if reply.get("reasoning") else []
        if reply["content"] or not reply.get("tool_calls"):
            out.append(
                {
                    "type": "message",
                    "id": self.msg_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": reply["content"],
                            "annotations": [],
                            "logprobs": [],
                        }
                    ],
                }
            )
        out += [
            {
                "type": "function_call",
                "id": "fc_" + tc["id"].removeprefix("call_"),
                "call_id": tc["id"],
                "name": tc["name"],
                "arguments": tc["arguments"]
                if isinstance(tc["arguments"], str)
                else json.dumps(tc["arguments"]),
                "status": "completed",
            }
            for tc in reply.get("tool_calls", [])
        ]
        return out

    def _response(self, status: str, output: list, call=None) -> dict:
        n_out = len(call.response_ids) if call else 0
        s = self.req.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": None,
            "previous_response_id": self.previous_id,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [{"type": "function", **t} for t in self.req.tools],
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_output_tokens": s.max_tokens,
            "store": True,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "usage": {
                "input_tokens": self.n_prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.n_prompt + n_out,
            },
        }

    def body(self, answers) -> dict:
        ((call, reply),) = answers
        status = "incomplete" if client_finish(call, reply) == "length" else "completed"
        return self._response(status, self._output(reply), call)

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def start(self) -> bytes:
        r = self._response("in_progress", [])
        return self._event("response.created", response=r) + self._event(
            "response.in_progress", response=r
        )

    def reasoning(self, delta: str) -> bytes:
        out, at = b"", dict(item_id=self.rs_id, output_index=self.index, content_index=0)
        if self.open != "reasoning":
            self.open = "reasoning"
            out = self._event(
                "response.output_item.added",
                output_index=self.index,
                item={"type": "reasoning", "id": self.rs_id, "summary": [], "content": []},
            )
            out += self._event(
                "response.content_part.added", **at, part={"type": "reasoning_text", "text": ""}
            )
        self.thought += delta
        return out + self._event("response.reasoning_text.delta", **at, delta=delta)

    def _done(self, item: dict) -> bytes:
        """The events that end the open item (the reasoning or the message): its text, its content part, itself."""
        part, at = (
            item["content"][0],
            dict(item_id=item["id"], output_index=self.index, content_index=0),
        )
        logprobs = {"logprobs": []} if item["type"] == "message" else {}
        out = self._event(f"response.{part['type']}.done", **at, text=part["text"], **logprobs)
        out += self._event("response.content_part.done", **at, part=part)
        self.open, self.index = None, self.index + 1
        return out + self._event(
            "response.output_item.done", output_index=self.index - 1, item=item
        )

    def text(self, delta: str) -> bytes:
        out = self._done(self._reasoning_item(self.thought)) if self.open == "reasoning" else b""
        if self.open != "message":
            self.open = "message"
            out += self._event(
                "response.output_item.added",
                output_index=self.index,
                item={
                    "type": "message",
                    "id": self.msg_id,
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                },
            )
            out += self._event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=self.index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
        return out + self._event(
            "response.output_text.delta",
            item_id=self.msg_id,
            output_index=self.index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def end(self, answers, sent: str = "", sent_reasoning: str = "") -> bytes:
        response, out = self.body(answers), []
        # from the first item not ended yet (the reasoning ends once the text begins)
        for i, item in enumerate(response["output"][self.index :], self.index):
            if item["type"] == "function_call":
                out.append(
                    self._event(
                        "response.output_item.added",
                        output_index=i,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                )
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=i,
                        delta=item["arguments"],
                    )
                )
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=i,
                        arguments=item["arguments"],
                    )
                )
                out.append(self._event("response.output_item.done", output_index=i, item=item))
            else:  # the reasoning or the message: what was not streamed yet, then its end
                send, done = (
                    (self.reasoning, sent_reasoning)
                    if item["type"] == "reasoning"
                    else (self.text, sent)
                )
                rest = _rest(item["content"][0]["text"], done)
                out.append(send(rest) if rest or self.open != item["type"] else b"")
                out.append(self._done(item))
        out.append(self._event(f"response.{response['status']}", response=response))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)
