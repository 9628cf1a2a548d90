"""Anthropic Messages (``/v1/messages``, what Claude Code sends; docs/serving.md) and
its ``/v1/messages/count_tokens``. Its hooks, filled at the bottom: the routes ``"/v1/messages"``
and ``"/v1/messages/count_tokens"`` in hooks.ROUTES, and Anthropic's error body on them in
hooks.ERROR_SHAPES. A request becomes the same :class:`~chat.Request` as a chat completion's and
takes the same path (``Proxy.converse``)."""

import json
import uuid
from typing import Any, Optional

from aiohttp import web

from .. import apis, hooks
from ..chat import BadRequest, Request, parse_arguments
from ..proxy import conversation


def open_messages(body: Any, memo: dict, proxy):
    """The route's ``open_api`` (proxy.conversation)."""
    req = parse_anthropic_request(body, memo)
    return req, lambda n_prompt: AnthropicReply(req, proxy.model_name, n_prompt)


async def count_tokens(proxy, request: web.Request):
    """``{"input_tokens": n}``: the length of the prompt the request would get, rendered fresh."""
    req = parse_anthropic_request((await proxy.read(request))[1])
    prompt_ids = proxy.renderer.build_prompt(req.messages, req.tools, [])[0]
    return web.json_response({"input_tokens": len(prompt_ids)})


# The type of Anthropic's error body for an HTTP status; other statuses: api_error from 500 on,
# invalid_request_error below.
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, param=None, code=None) -> dict:
    """Anthropic's error body for an HTTP status (its hook: hooks.ERROR_SHAPES); it has no param or
    code."""
    kind = "api_error" if status >= 500 else "invalid_request_error"
    kind = ERROR_TYPES.get(status, kind)
    return {"type": "error", "error": {"type": kind, "message": message}}


def _to_messages(m: Any, i: int) -> list[dict]:
    """One Anthropic message -> one tool message per tool_result block, then the turn's text and
    calls."""
    where, out = f"messages[{i}]", []
    apis.expect(isinstance(m, dict), f"'{where}' must be an object", where)
    role = m.get("role")
    message = f"unknown role {role!r} in {where}; expected user, assistant or system"
    apis.expect(role in ("user", "assistant", "system"), message, where + ".role")
    texts, calls, thoughts, content = [], [], [], m.get("content")
    text_only = content is None or isinstance(content, str)
    blocks = [{"type": "text", "text": content or ""}] if text_only else content
    is_blocks = isinstance(blocks, list) and all(isinstance(b, dict) for b in blocks)
    apis.must_be(is_blocks, where + ".content", "a string or a list of content blocks")
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            texts.append(apis.text_of([block], at))
        elif kind == "tool_use" and role == "assistant":
            name, call_id = block.get("name"), str(block.get("id", ""))
            apis.expect(isinstance(name, str), f"'{at}.name' must be a string", at + ".name")
            calls.append({"id": call_id, "name": name, "arguments": block.get("input") or {}})
        # results come first in a user turn: one tool message each
        elif kind == "tool_result":
            result = apis.text_of(block.get("content"), at + ".content")
            call_id = str(block.get("tool_use_id", ""))
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "thinking" and isinstance(block.get("thinking"), str) and block["thinking"]:
            thoughts.append(block["thinking"])
        elif kind in ("image", "document"):
            message = f"content block type '{kind}' is not supported: this model reads text only"
            raise BadRequest(message, at + ".type", "unsupported_content")
        # redacted_thinking (encrypted), server tool blocks: nothing this model can use
    if role == "assistant":
        turn = {"role": "assistant", "content": "\n".join(texts)}
        turn.update({"reasoning": "\n".join(thoughts)} if thoughts else {})
        out.append({**turn, **({"tool_calls": calls} if calls else {})})
    elif texts:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def parse_anthropic_request(body: Any, memo: Optional[dict] = None) -> Request:
    """Validate a /v1/messages body (docs/serving.md: what Claude Code sends)."""
    body, messages = apis.messages_of(body)
    system = body.get("system")
    system = [{"role": "system", "content": apis.text_of(system, "system")}] if system else []
    # structured outputs: output_config.format, or the beta's output_format
    config = body.get("output_config") if isinstance(body.get("output_config"), dict) else None
    if config:
        fmt = apis.response_format(config.get("format"), "output_config.format")
    else:
        fmt = apis.response_format(body.get("output_format"), "output_format")
    return Request(
        messages=system + apis.convert(messages, _to_messages, memo),
        **apis.tools_of(body),
        **fmt,
        **apis.settings(body, body.get("max_tokens"), body.get("stop_sequences")),
    )


def _event(kind: str, **fields) -> bytes:
    return apis.sse({"type": kind, **fields}, kind)


class AnthropicReply:
    STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

    def __init__(self, req: Request, model: str, n_prompt: int):
        self.req, self.n_prompt = req, n_prompt
        # the stream's open block's type (or None) and its index (else the next one's)
        self.open, self.index = None, 0
        self.id, self.model = f"msg_{uuid.uuid4().hex[:24]}", req.model or model

    def _message(self, content: list, stop_reason, output_tokens: int) -> dict:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model}
        out |= {"content": content, "stop_reason": stop_reason, "stop_sequence": None}
        return out | {"usage": {"input_tokens": self.n_prompt, "output_tokens": output_tokens}}

    def body(self, answers) -> dict:
        ((call, reply),) = answers
        content = []
        if reply.get("reasoning"):
            content.append({"type": "thinking", "thinking": reply["reasoning"], "signature": ""})
        if reply["content"] or not reply.get("tool_calls"):
            content.append({"type": "text", "text": reply["content"]})
        for tc in reply.get("tool_calls", []):
            # arguments that are not a JSON object: no input
            args = parse_arguments(tc["arguments"])
            args = args if isinstance(args, dict) else {}
            use_id = "toolu_" + tc["id"].removeprefix("call_")
            content.append({"type": "tool_use", "id": use_id, "name": tc["name"], "input": args})
        stop_reason = self.STOP[apis.client_finish(call, reply)]
        return self._message(content, stop_reason, len(call.response_ids))

    def start(self) -> bytes:
        return _event("message_start", message=self._message([], None, 0))

    def _block_delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)

    def _delta(self, kind: str, delta: str) -> bytes:
        """``delta`` in the open block of this kind ("thinking" or "text"), closing the other and
        starting this one first."""
        block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        out = b"" if self.open == kind else self._start(block)
        return out + self._block_delta({"type": kind + "_delta", kind: delta})

    def _start(self, block: dict) -> bytes:
        out, self.open = self._close(), block["type"]
        return out + _event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        # a thinking block ends with its signature: none here (nothing to verify it against later)
        signature = {"type": "signature_delta", "signature": ""}
        out = self._block_delta(signature) if self.open == "thinking" else b""
        out += _event("content_block_stop", index=self.index)
        self.open, self.index = None, self.index + 1
        return out

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
                unsent = apis.rest(block[kind], sent_reasoning if kind == "thinking" else sent)
                out.append(self._delta(kind, unsent) if unsent or self.open != kind else b"")
            # a tool_use, sent whole: closed by the next block, or the end
            else:
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                out += [self._start({**block, "input": {}}), self._block_delta(delta)]
        out.append(self._close())
        stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
        usage = {"output_tokens": message["usage"]["output_tokens"]}
        out += [_event("message_delta", delta=stop, usage=usage), _event("message_stop")]
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return apis.sse(error_body(500, message), "error")


# Its routes (``?beta=true`` too), and its errors' shape on them.
hooks.ROUTES["/v1/messages"] = conversation("anthropic", open_messages)
hooks.ROUTES["/v1/messages/count_tokens"] = count_tokens
hooks.ERROR_SHAPES["/v1/messages"] = error_body
