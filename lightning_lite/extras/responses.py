"""The OpenAI Responses API (``/v1/responses``, what Codex sends; docs/serving.md).
Its hook, filled at the bottom: the route ``"/v1/responses"`` in hooks.ROUTES. A request becomes the
same :class:`~chat.Request` as a chat completion's and takes the same path (``Proxy.converse``).
``previous_response_id`` names an earlier response of the same rollout: its conversation (input +
output) is kept in the rollout's memo for this API."""

import json
import time
import uuid
from typing import Any, Callable, Optional

from .. import apis, hooks
from ..chat import ROLES, BadRequest, Request, parse_arguments
from ..proxy import conversation


def open_responses(body: Any, memo: dict, proxy):
    """The route's ``open_api`` (proxy.conversation). The writer keeps the answered conversation
    under its response id (``memo["responses"]``), for a request that continues it."""
    conversations = memo.setdefault("responses", {})

    def previous(response_id: str) -> list[dict]:
        if response_id not in conversations:
            message = f"previous_response_id {response_id[:80]!r} is not a response of this rollout"
            raise BadRequest(message, "previous_response_id", "invalid_value", 404)
        return conversations[response_id]

    req = parse_responses_request(body, previous, memo)
    previous_id = body.get("previous_response_id")
    return req, lambda n_prompt: ResponsesReply(
        req, proxy.model_name, n_prompt, previous_id, conversations
    )


def _part_texts(parts: Any) -> str:
    """The texts of a list of parts ({"type", "text"}), joined by newlines; anything else: ""."""
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    return "\n".join(t for t in texts if isinstance(t, str))


def _to_messages(item: Any, i: int) -> list[dict]:
    """One input item -> a message, or a tool call (no "role": joined to its turn by the caller)."""
    where = f"input[{i}]"
    apis.must_be(isinstance(item, dict), where, "an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        roles = ("user", "assistant", "system", "developer")
        apis.expect(role in roles, f"unknown role {role!r} in {where}", where + ".role")
        content = apis.text_of(item.get("content"), where + ".content")
        return [{"role": ROLES[role], "content": content}]
    if kind == "function_call":
        apis.must_be(isinstance(item.get("name"), str), where + ".name", "a string")
        arguments = parse_arguments(item.get("arguments", "{}"))
        return [{"id": str(item.get("call_id", "")), "name": item["name"], "arguments": arguments}]
    if kind == "function_call_output":
        output = apis.text_of(item.get("output"), where + ".output")
        return [{"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output}]
    # its reasoning_text parts, else its summary; encrypted only: nothing to read
    if kind == "reasoning":
        text = _part_texts(item.get("content")) or _part_texts(item.get("summary"))
        return [{"role": "assistant", "content": "", "reasoning": text}] if text else []
    # item references and calls of tools the model cannot use: ignored
    return []


def parse_responses_request(
    body: Any, previous: Callable[[str], list[dict]], memo: Optional[dict] = None
) -> Request:
    """Validate a /v1/responses body. ``previous(id)``: the conversation (input + output) of this
    rollout's response."""
    body = apis.json_object(body)
    history, previous_id = [], body.get("previous_response_id")
    if previous_id is not None:
        apis.must_be(isinstance(previous_id, str), "previous_response_id", "a string")
        history = list(previous(previous_id))
    items = body.get("input", [])
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    apis.expect(isinstance(items, list), "'input' must be a string or a list of items", "input")
    # one assistant turn: its reasoning, its message, its calls (new dicts: memo's are shared)
    for m in apis.convert(items, _to_messages, memo):
        last = history[-1] if history and history[-1]["role"] == "assistant" else None
        thought = last and last.keys() == {"role", "content", "reasoning"} and not last["content"]
        # a call joins the turn before it
        if "role" not in m and last is not None:
            history[-1] = {**last, "tool_calls": last.get("tool_calls", []) + [m]}
        elif "role" not in m:
            history.append({"role": "assistant", "content": "", "tool_calls": [m]})
        # the message after a reasoning item
        elif m["role"] == "assistant" and thought:
            reasoning = "\n".join(r for r in (last["reasoning"], m.get("reasoning")) if r)
            history[-1] = {**m, "reasoning": reasoning}
        else:
            history.append(m)
    apis.expect(history, "'input' must not be empty", "input")
    system = body.get("instructions")
    system = [{"role": "system", "content": apis.text_of(system, "instructions")}] if system else []
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return Request(
        messages=system + history,
        **apis.tools_of(body),
        **apis.response_format(text.get("format"), "text.format"),
        **apis.settings(body, body.get("max_output_tokens"), None),
        n_instructions=len(system),
    )


class ResponsesReply:
    def __init__(
        self, req: Request, model: str, n_prompt: int, previous_id=None, conversations=None
    ):
        """``conversations``: response id -> its conversation, where this one's is kept once
        answered."""
        self.req, self.n_prompt, self.seq, self.model = req, n_prompt, 0, req.model or model
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.previous_id = int(time.time()), previous_id
        self.conversations = conversations
        # the reasoning item, and its text streamed so far
        self.rs_id, self.thought = f"rs_{uuid.uuid4().hex}", ""
        # the open item ("reasoning", "message" or None), its output index (else the next one's)
        self.open, self.index = None, 0

    def _reasoning_item(self, *texts: str) -> dict:
        content = [{"type": "reasoning_text", "text": text} for text in texts]
        return {"type": "reasoning", "id": self.rs_id, "summary": [], "content": content}

    def _message_item(self, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant"}

    def _output(self, reply) -> list[dict]:
        out = [self._reasoning_item(reply["reasoning"])] if reply.get("reasoning") else []
        if reply["content"] or not reply.get("tool_calls"):
            part = {"type": "output_text", "text": reply["content"], "annotations": []}
            out.append({**self._message_item("completed"), "content": [{**part, "logprobs": []}]})
        for tc in reply.get("tool_calls", []):
            args = tc["arguments"]
            args = args if isinstance(args, str) else json.dumps(args)
            fc_id = "fc_" + tc["id"].removeprefix("call_")
            item = {"type": "function_call", "id": fc_id, "call_id": tc["id"], "name": tc["name"]}
            out.append({**item, "arguments": args, "status": "completed"})
        return out

    def _response(self, status: str, output: list, call=None) -> dict:
        n_out = len(call.response_ids) if call else 0
        s, incomplete = self.req.sampling, {"reason": "max_output_tokens"}
        # the Responses API's response object, its fields in the order OpenAI's has them
        details = {"cached_tokens": 0, "cache_write_tokens": 0}
        usage = {"input_tokens": self.n_prompt, "input_tokens_details": details}
        usage |= {"output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}}
        usage["total_tokens"] = self.n_prompt + n_out
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status}
        out |= {"model": self.model, "output": output, "error": None}
        out["incomplete_details"] = incomplete if status == "incomplete" else None
        out |= {"instructions": None, "previous_response_id": self.previous_id}
        out |= {"parallel_tool_calls": True, "tool_choice": "auto"}
        out["tools"] = [{"type": "function", **t} for t in self.req.tools]
        out |= {"temperature": s.temperature, "top_p": s.top_p, "max_output_tokens": s.max_tokens}
        out |= {"store": True, "text": {"format": {"type": "text"}}, "truncation": "disabled"}
        return out | {"metadata": {}, "usage": usage}

    def body(self, answers) -> dict:
        ((call, reply),) = answers
        if self.conversations is not None:
            # for previous_response_id; a new request's instructions replace these
            self.conversations[self.id] = self.req.messages[self.req.n_instructions :] + [reply]
        status = "incomplete" if apis.client_finish(call, reply) == "length" else "completed"
        return self._response(status, self._output(reply), call)

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return apis.sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def _at(self, item_id: str) -> dict:
        return dict(item_id=item_id, output_index=self.index, content_index=0)

    def start(self) -> bytes:
        response = self._response("in_progress", [])
        created = self._event("response.created", response=response)
        return created + self._event("response.in_progress", response=response)

    def _begin(self, kind: str, item: dict, part: dict) -> bytes:
        """Unless an item of this kind is open: end the reasoning if open, then add the item and its
        part."""
        if self.open == kind:
            return b""
        out = self._done(self._reasoning_item(self.thought)) if self.open == "reasoning" else b""
        self.open = kind
        out += self._event("response.output_item.added", output_index=self.index, item=item)
        return out + self._event("response.content_part.added", **self._at(item["id"]), part=part)

    def reasoning(self, delta: str) -> bytes:
        part = {"type": "reasoning_text", "text": ""}
        out = self._begin("reasoning", self._reasoning_item(), part)
        self.thought, at = self.thought + delta, self._at(self.rs_id)
        return out + self._event("response.reasoning_text.delta", **at, delta=delta)

    def text(self, delta: str) -> bytes:
        part = {"type": "output_text", "text": "", "annotations": []}
        out = self._begin("message", {**self._message_item("in_progress"), "content": []}, part)
        at = self._at(self.msg_id)
        return out + self._event("response.output_text.delta", **at, delta=delta, logprobs=[])

    def _done(self, item: dict) -> bytes:
        """The events that end the open item (the reasoning or the message): its text, its content
        part, itself."""
        part, at = item["content"][0], self._at(item["id"])
        logprobs = {"logprobs": []} if item["type"] == "message" else {}
        out = self._event(f"response.{part['type']}.done", **at, text=part["text"], **logprobs)
        out += self._event("response.content_part.done", **at, part=part)
        out += self._event("response.output_item.done", output_index=self.index, item=item)
        self.open, self.index = None, self.index + 1
        return out

    def end(self, answers, sent: str = "", sent_reasoning: str = "") -> bytes:
        response, out = self.body(answers), []
        # from the first item not ended yet (the reasoning ends once the text begins)
        for i, item in enumerate(response["output"][self.index :], self.index):
            if item["type"] == "function_call":
                at, args = dict(item_id=item["id"], output_index=i), item["arguments"]
                added = {**item, "arguments": "", "status": "in_progress"}
                out += [
                    self._event("response.output_item.added", output_index=i, item=added),
                    self._event("response.function_call_arguments.delta", **at, delta=args),
                    self._event("response.function_call_arguments.done", **at, arguments=args),
                    self._event("response.output_item.done", output_index=i, item=item),
                ]
            # the reasoning or the message: what was not streamed yet, then its end
            else:
                reasoning = item["type"] == "reasoning"
                send, done = (self.reasoning, sent_reasoning) if reasoning else (self.text, sent)
                unsent = apis.rest(item["content"][0]["text"], done)
                out.append(send(unsent) if unsent or self.open != item["type"] else b"")
                out.append(self._done(item))
        out.append(self._event(f"response.{response['status']}", response=response))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)


hooks.ROUTES["/v1/responses"] = conversation("responses", open_responses)
