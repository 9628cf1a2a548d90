"""Chat: one internal conversation -> prompt token ids, and sampled text -> a reply.

apis.py maps every API shape onto :class:`Request` (normalized messages, tools,
sampling); this file does the rest, as pure functions of (tokenizer, request):

1. ``parse_tool_calls`` / ``Renderer.parse_reply`` read tool calls out of the
   model's text, and ``ContentStream`` decides what of a reply may be streamed
   as content while it is still being sampled.
2. ``Renderer`` turns messages into prompt ids. A template with tool support
   (Qwen2.5, Qwen3) gets the tools as they are; a template without (SmolLM2)
   gets them written into the system prompt in the Hermes convention, and
   tool calls / tool results written as text in that convention.
3. ``Renderer.build_prompt`` reuses the tokens the model sampled: when the
   request extends an earlier call of the rollout (same earlier messages +
   the assistant message the proxy returned, compared after parsing), the
   prompt is ``earlier prompt ids + earlier response ids + ids of the new
   messages``, so the model sees its own tokens and the calls merge into one
   sample. Otherwise it renders fresh and says why (``split_hint``). The
   earlier turn is found by fingerprint (only the new messages are hashed), and
   with a template that renders each message on its own only the new messages
   are rendered: a call's Python work does not grow with the conversation.

Example (SmolLM2, no native tool support)::

    messages = [{"role": "user", "content": "2+3?"}]
    tools    = [{"name": "calculator", "parameters": {...}}]
    render  -> "<|im_start|>system\\n# Tools ... <tools>{...}</tools> ...<|im_end|>\\n"
               "<|im_start|>user\\n2+3?<|im_end|>\\n<|im_start|>assistant\\n"
    model   -> '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+3"}}\\n</tool_call><|im_end|>'
    parse   -> content "", tool_calls [{"id": "call_…", "name": "calculator", "arguments": '{"expression": "2+3"}'}]
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool"}


class BadRequest(Exception):
    """A client error: becomes a 4xx with an error body in the API's own format."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class Sampling:
    max_tokens: Optional[int] = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None


@dataclass
class Request:
    """One API request in the shape every API maps to.

    ``messages`` are normalized: ``{"role", "content": str}`` plus
    ``tool_calls: [{"id", "name", "arguments": dict | str}]`` on assistant
    messages and ``tool_call_id`` on tool messages. ``prompt_ids`` is set
    instead of messages for the completions API.
    """

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # [{"name", "description", "parameters"}]
    parse_tools: bool = True  # False for tool_choice "none"
    force_tool: Optional[str] = None  # tool_choice "required" -> "", a named function -> its name
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 1  # choices: each is recorded as its own call
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = ""
    prompt_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None
    n_instructions: int = 0  # Responses API: leading messages from ``instructions`` (not carried to the next response)


# ----------------------------------------------------------------------------- tool calls in text


def parse_arguments(args: Any) -> Any:
    """Tool-call arguments -> a dict where they are JSON (so compact and pretty JSON compare equal)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args



TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split model text into (content, tool_calls) in the Hermes ``<tool_call>{json}</tool_call>`` form.

    >>> parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    ('ok', [{'id': 'call_…', 'name': 'f', 'arguments': '{"x": 1}'}])

    A block whose JSON does not parse stays in the content as text: the
    harness then sees what the model wrote rather than a made-up call.
    """
    calls, kept, pos = [], [], 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


class ContentStream:
    """What of a reply may be sent as content while it is still being sampled.

    Fed the ids sampled so far, ``feed`` returns the new content: the decoded text
    up to the first stop string or ``<tool_call>`` (a tool call is sent whole, once
    parsed), holding back a character still split across tokens, the start of a
    possible marker and trailing whitespace, so that what was sent is always a
    prefix of the final, stripped content (``parse_reply``). A forced tool call
    streams no content at all.

    >>> s = ContentStream(tok, stops=[], parse_tools=True, forced=False)
    >>> s.feed(ids_of("Let me"))  ->  "Let me";   s.feed(ids_of("Let me <tool"))  ->  ""
    """

    def __init__(self, tokenizer, stops: list[str], parse_tools: bool, forced: bool):
        self.tok, self.sent, self.off = tokenizer, "", forced
        self.markers = [m for m in stops if m] + (["<tool_call>"] if parse_tools else [])

    def feed(self, ids: list[int]) -> str:
        if self.off:
            return ""
        text = self.tok.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a UTF-8 character split across tokens: wait for the rest
            return ""
        text = text[: min([text.find(m) for m in self.markers if m in text], default=len(text))]
        hold = max([k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])], default=0)
        visible = text[: len(text) - hold].strip()
        if not visible.startswith(self.sent):  # cannot happen with a prefix-stable decoder; never send a contradiction
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta


def fingerprints(messages: list[dict], tools: list[dict], known: Optional["Turn"] = None) -> list[bytes]:
    """``fps[k]`` identifies ``tools`` and ``messages[:k]`` as ``same_message`` compares them: finding the
    earlier turn a request extends is a dictionary lookup, not a comparison with every earlier turn.
    ``known``: an earlier turn; the fingerprints of the messages this request shares with it (equal
    dicts, compared in C) are reused, so a request that appends hashes only its new messages.

    >>> fingerprints([{"role": "user", "content": "hi "}], []) == fingerprints([{"role": "user", "content": "hi"}], [])
    True
    """
    if known is not None and known.tools == tools:
        k = common_prefix(messages, known.messages)
        fps = known.fps[: k + 1]
    else:
        k, fps = 0, [hashlib.blake2b(json.dumps(tools, sort_keys=True).encode(), digest_size=16).digest()]
    for m in messages[k:]:
        fps.append(_link(fps[-1], m))
    return fps


def common_prefix(a: list, b: list) -> int:
    """How many leading elements ``a`` and ``b`` share. ``common_prefix([1, 2, 3], [1, 2, 4]) == 2``"""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a request that appends), in one comparison in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _key(m: dict) -> str:
    """What identifies a normalized message: role, stripped content, tool calls by name and parsed arguments
    (not their ids, nor how the arguments' JSON was formatted)."""
    content = (m.get("content") or "").strip()
    key = f"{m['role']}\0{len(content)}\0{content}"  # the length keeps content and tool calls apart
    if m.get("tool_calls"):
        key += "\0" + json.dumps([[t["name"], parse_arguments(t["arguments"])] for t in m["tool_calls"]], sort_keys=True)
    return key


def _link(fp: bytes, m: dict) -> bytes:
    """The fingerprint of a conversation whose fingerprint was ``fp``, extended by message ``m``."""
    return hashlib.blake2b(fp + _key(m).encode(errors="surrogatepass"), digest_size=16).digest()


def same_message(a: dict, b: dict) -> bool:
    """Do two normalized messages say the same thing? (whitespace around content, JSON formatting of arguments
    and tool-call ids do not matter)."""
    return _key(a) == _key(b)


# ----------------------------------------------------------------------------- rendering


@dataclass
class Turn:
    """What a session remembers of one answered call, to extend it later."""

    index: int
    messages: list[dict]
    tools: list[dict]
    reply: dict  # the assistant message the harness received
    prompt_ids: list[int]
    response_ids: list[int]
    fps: Optional[list[bytes]] = None  # fingerprints(messages, tools), computed here when not given
    fp: bytes = b""  # the fingerprint of messages + [reply]: what a request that extends this turn starts with

    def __post_init__(self):
        self.fps = self.fps or fingerprints(self.messages, self.tools)
        self.fp = _link(self.fps[-1], self.reply)


class Renderer:
    """Chat template + tool convention of one tokenizer."""

    SENTINEL = "LLSENTINEL7f3a"

    def __init__(self, tokenizer, eos_ids: Optional[set[int]] = None):
        """``eos_ids``: every token that ends the model's turn, the same set generation stops on
        (the backend's: generation_config's EOS ids and the tokenizer's)."""
        self.tok = tokenizer
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("the tokenizer has no chat template; use a chat/instruct model or set tokenizer.chat_template")
        self.native_tools = "tools" in template
        self.eos_ids = set(eos_ids or ()) | {t for t in [tokenizer.eos_token_id] if t is not None}
        # The text a template writes after an assistant message's content (e.g. "<|im_end|>\n").
        probe = self.render_text([{"role": "user", "content": "x"}, {"role": "assistant", "content": self.SENTINEL}], [], False)
        self.turn_close = probe[probe.rindex(self.SENTINEL) + len(self.SENTINEL) :]
        # Does the template render each message on its own (ChatML: SmolLM2, Qwen2.5)? Then the text of the
        # messages after a turn can be rendered without the whole conversation before it. Templates that
        # rewrite earlier turns (Qwen3 drops <think> from them) fail this probe and render in full.
        calls = [{"id": "c1", "name": "f", "arguments": "{}"}]
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "<think>\nt\n</think>\n\na", "tool_calls": calls},
                 {"role": "tool", "content": "r", "tool_call_id": "c1"}, {"role": "tool", "content": "r2", "tool_call_id": "c1"},
                 {"role": "assistant", "content": "b"}, {"role": "user", "content": "v"}]
        tools = [{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
        deltas = [(self._full_delta(probe, k, tools), self._delta(probe, k, tools)) for k in (3, 6)]
        self.local = all(full is not None and full == local for full, local in deltas)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)  # the template writes BOS etc. itself

    def _hf_messages(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        if self.native_tools:
            out = []
            for m in messages:
                h = {"role": m["role"], "content": m["content"]}
                if m.get("tool_calls"):
                    h["tool_calls"] = [{"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": parse_arguments(t["arguments"])}} for t in m["tool_calls"]]
                if m["role"] == "tool":
                    h["tool_call_id"] = m.get("tool_call_id", "")
                out.append(h)
            return out
        # No tool support in the template: write the Hermes convention as text.
        out: list[dict] = []
        if tools:
            block = TOOLS_PROMPT.format(tools="\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools))
            if messages and messages[0]["role"] == "system":
                out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
                messages = messages[1:]
            else:
                out.append({"role": "system", "content": block})
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(
                    "<tool_call>\n" + json.dumps({"name": t["name"], "arguments": parse_arguments(t["arguments"])}, ensure_ascii=False) + "\n</tool_call>" for t in m["tool_calls"]
                )
                out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
            elif m["role"] == "tool":
                text = "<tool_response>\n" + m["content"] + "\n</tool_response>"
                if out and out[-1].get("_tool"):  # consecutive tool results share one user turn
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "_tool": True})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return [{k: v for k, v in m.items() if k != "_tool"} for m in out]

    def render_text(self, messages: list[dict], tools: list[dict], add_generation_prompt: bool = True) -> str:
        kwargs = {"tools": [{"type": "function", "function": t} for t in tools]} if (self.native_tools and tools) else {}
        return self.tok.apply_chat_template(self._hf_messages(messages, tools), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def build_prompt(self, messages: list[dict], tools: list[dict], history: list[Turn], reuse: bool = True,
                     fps: Optional[list[bytes]] = None) -> tuple[list[int], Optional[int], Optional[str]]:
        """Prompt ids for ``messages``, reusing sampled tokens of an earlier turn where it extends one.

        Returns ``(prompt_ids, parent, split_hint)``: ``parent`` is the index of
        the call whose prompt+response ids the prompt starts with, ``split_hint``
        why no earlier call could be extended (None when nothing was there to extend).
        ``fps``: ``fingerprints(messages, tools, ...)`` when the caller has them.
        With ``reuse=False`` every prompt is rendered fresh; a call still merges
        when the fresh rendering happens to start with the earlier tokens.
        """
        # The longest earlier turn whose messages + reply this request starts with (the latest such turn).
        by_fp = {t.fp: t for t in history}  # fingerprints include the tools
        fps = fps or fingerprints(messages, tools, history[-1] if history else None)
        best = next((by_fp[fps[k]] for k in range(len(messages), 0, -1) if fps[k] in by_fp), None)
        if best is not None and reuse:
            k = len(best.messages) + 1
            new = self._delta(messages, k, tools) if self.local else self._full_delta(messages, k, tools)
            if new is not None:
                # After the sampled tokens comes the template's turn close (minus the EOS the model
                # already sampled), then the new messages and the generation prompt.
                glue = self.turn_close
                if best.response_ids and best.response_ids[-1] in self.eos_ids:
                    eos_text = self.tok.decode([best.response_ids[-1]])
                    glue = glue[len(eos_text) :] if glue.startswith(eos_text) else glue
                return best.prompt_ids + (best.response_ids + self.encode(glue + new)), best.index, None  # one copy of the long part
        ids = self.encode(self.render_text(messages, tools, True))
        if best is not None:
            prev = best.prompt_ids + best.response_ids
            if ids[: len(prev)] == prev:
                return ids, best.index, None
            return ids, None, "template_mismatch"
        if not history:
            return ids, None, None
        # Did it resend an earlier request's messages, but with a different assistant reply?
        for t in reversed(history):
            n = len(t.messages)
            if len(messages) >= n and all(same_message(a, b) for a, b in zip(messages[:n], t.messages)):
                return ids, None, "retry" if len(messages) == n and t.tools == tools else "rewrote_history"
        return ids, None, "new_thread"

    def _full_delta(self, messages: list[dict], k: int, tools: list[dict]) -> Optional[str]:
        """The text the template writes for ``messages[k:]`` and the generation prompt, after ``messages[:k]``:
        the whole conversation rendered, minus the first k messages rendered; None when the template
        renders those k differently once more follows (it rewrote history)."""
        head, full = self.render_text(messages[:k], tools, False), self.render_text(messages, tools, True)
        return full[len(head):] if full.startswith(head) else None

    def _delta(self, messages: list[dict], k: int, tools: list[dict]) -> Optional[str]:
        """The same text for a template that renders each message on its own (``self.local``), at a cost
        that does not grow with the conversation: only the system prompt, message k-1 (the assistant
        turn being extended) and the new messages are rendered."""
        ctx = (messages[:1] if messages[0]["role"] == "system" and k > 1 else []) + [{"role": "user", "content": "x"}, messages[k - 1]]
        return self._full_delta(ctx + messages[k:], len(ctx), tools)

    @staticmethod
    def forced_prefix(force_tool: Optional[str]) -> str:
        """Text that starts the assistant turn when a tool call is required (tool_choice).

        It is appended to the prompt (the model did not sample it, so it is not
        trained) and prepended to the generated text before parsing. The model
        then only chooses the arguments (and the tool, for "required").
        """
        if force_tool is None:
            return ""
        return '<tool_call>\n{"name": "' + (force_tool + '", "arguments": ' if force_tool else "")

    def parse_reply(self, text: str, parse_tools: bool) -> dict:
        """The assistant message for a generated text: content (stripped) and, if any, tool calls."""
        if not parse_tools:
            return {"role": "assistant", "content": text.strip()}
        content, calls = parse_tool_calls(text)
        msg = {"role": "assistant", "content": content.strip()}
        if calls:
            msg["tool_calls"] = calls
        return msg
