"""Chat: one :class:`Request` (apis.py maps every API onto it) -> prompt ids, reusing the tokens the model sampled
(README "Reuse of sampled tokens"); sampled text -> a reply (toolcalls.py); ``ContentStream``: what may stream.

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
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from . import toolcalls
from .records import common_prefix
from .toolcalls import parse_arguments

log = logging.getLogger("lightning_lite.chat")
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}


class BadRequest(Exception):
    """A client error: becomes a 4xx with an error body in the API's own format."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
    ):
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
    grammar: Optional[str] = (
        None  # what the reply must follow (grammar.py): a forced tool call, a response_format
    )


@dataclass
class Request:
    """One API request in the shape every API maps to. ``messages`` are normalized: ``{"role", "content": str}``
    plus ``tool_calls: [{"id", "name", "arguments": dict | str}]`` on assistant messages and ``tool_call_id`` on
    tool messages. ``prompt_ids`` is set instead of messages for the completions API."""

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # [{"name", "description", "parameters"}]
    parse_tools: bool = True  # False for tool_choice "none"
    force_tool: Optional[str] = None  # tool_choice "required" -> "", a named function -> its name
    response_schema: Optional[dict] = None  # response_format: the JSON schema the reply follows
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 1  # choices: each is recorded as its own call
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = ""
    prompt_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None
    n_instructions: int = 0  # Responses API: leading messages from ``instructions`` (not carried to the next response)
    template_kwargs: dict = field(
        default_factory=dict
    )  # chat_template_kwargs: passed to the chat template (enable_thinking, ...)


# ----------------------------------------------------------------------------- tool calls in text


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


class ContentStream:
    """What of a reply may be sent while it is still being sampled: reasoning and content, each always a prefix of
    what ``parse_reply`` makes of the whole reply (toolcalls.visible; here, a stop string and its start are held).

    >>> s = ContentStream(renderer, stops=[], parse_tools=True)
    >>> s.feed(ids_of("Let me"))  ->  ("", "Let me");   s.feed(ids_of("Let me <tool"))  ->  ("", "")
    """

    def __init__(
        self,
        renderer: "Renderer",
        stops: list[str],
        parse_tools: bool,
        forced: str = "",
        opened: bool = False,
    ):
        self.r, self.stops, self.forced, self.opened = (
            renderer,
            [m for m in stops if m],
            forced,
            opened,
        )
        self.format = renderer.format if parse_tools else None
        self.reasoning = self.sent = ""

    def feed(self, ids: list[int]) -> tuple[str, str]:
        """The new (reasoning, content) to send, given every id sampled so far."""
        text = toolcalls.hold_back(self.r.sampled_text(ids, self.stops), self.stops)
        reasoning, content = toolcalls.visible(
            self.format, self.forced + text, self.r.think, self.opened
        )
        reasoning, content = (
            self.r.specials.sub("", reasoning).strip(),
            self.r.specials.sub("", content).strip(),
        )
        r_delta = (
            reasoning[len(self.reasoning) :] if reasoning.startswith(self.reasoning) else ""
        )  # never send a contradiction
        c_delta = content[len(self.sent) :] if content.startswith(self.sent) else ""
        self.reasoning, self.sent = self.reasoning + r_delta, self.sent + c_delta
        return r_delta, c_delta


def fingerprints(
    messages: list[dict], tools: list[dict], known: Optional["Turn"] = None
) -> list[bytes]:
    """``fps[k]`` identifies ``tools`` and ``messages[:k]`` after parsing (``_key``): the earlier turn a request
    extends is found by a dictionary lookup. ``known``: the session's latest turn, whose fingerprints of the
    messages this request shares with it (equal dicts, compared in C) are reused: an append hashes only its new ones.

    >>> fingerprints([{"role": "user", "content": "hi "}], []) == fingerprints([{"role": "user", "content": "hi"}], [])
    True
    """
    if known is not None and known.tools == tools:
        k = common_prefix(messages, known.messages)
        fps = known.fps[: k + 1]
    else:
        k, fps = (
            0,
            [hashlib.blake2b(json.dumps(tools, sort_keys=True).encode(), digest_size=16).digest()],
        )
    for m in messages[k:]:
        fps.append(_link(fps[-1], m))
    return fps


THINK_BLOCK = re.compile(r"\A\s*(<think>.*?</think>|\[THINK\].*?\[/THINK\])", re.DOTALL)


def _key(m: dict) -> str:
    """What identifies a normalized message: role, stripped content, tool calls by name and parsed arguments
    (not their ids, nor how the arguments' JSON was formatted, nor reasoning: echoed in its own field, in the
    content, or dropped, it is the same reply; whether the template renders it as sampled is build_prompt's call)."""
    content = m.get("content") or ""
    content = (THINK_BLOCK.sub("", content) if m["role"] == "assistant" else content).strip()
    key = f"{m['role']}\0{len(content)}\0{content}"  # the length keeps content and tool calls apart
    if m.get("tool_calls"):
        key += "\0" + json.dumps(
            [[t["name"], parse_arguments(t["arguments"])] for t in m["tool_calls"]], sort_keys=True
        )
    return key


def _link(fp: bytes, m: dict) -> bytes:
    """The fingerprint of a conversation whose fingerprint was ``fp``, extended by message ``m``."""
    return hashlib.blake2b(fp + _key(m).encode(errors="surrogatepass"), digest_size=16).digest()


# ----------------------------------------------------------------------------- rendering


class Turn:
    """What a session remembers of one answered call (DESIGN.md "The ids decide"): the ids its prompt adds to the
    turn it extends (``parent``), its response, two fingerprints; messages, tools, ``fps`` only while the latest."""

    def __init__(
        self,
        index: int,
        messages: list[dict],
        tools: list[dict],
        reply: dict,
        prompt_ids: list[int],
        response_ids: list[int],
        fps: Optional[list[bytes]] = None,
        forced: str = "",
        history: Optional[list["Turn"]] = None,
        parent: Optional[int] = None,
    ):
        """``reply``: the assistant message the harness received; ``fps``: fingerprints(messages, tools) if known;
        ``forced``: the call opening the prompt ended with (tool_choice); ``history``: the session's turns so far."""
        self.index, self.reply, self.response_ids, self.forced = index, reply, response_ids, forced
        self.messages, self.tools, self.fps = messages, tools, fps or fingerprints(messages, tools)
        self.fp_request = self.fps[-1]  # tools + messages: a retry of this request starts with it
        self.fp = _link(
            self.fps[-1], reply
        )  # and the reply: what a request that extends this turn starts with
        self.parent = (
            next(t for t in reversed(history) if t.index == parent) if parent is not None else None
        )
        self.tail = prompt_ids[self.parent.size :] if self.parent else prompt_ids
        self.size = len(prompt_ids) + len(response_ids)
        if history:  # only the latest turn keeps them
            history[-1].messages = history[-1].tools = history[-1].fps = None

    def tokens(self) -> list[int]:
        """Prompt + response ids, root first: what a call extending this turn starts with (a loop: chains are long)."""
        parts, t = [], self
        while t is not None:
            parts += [t.response_ids, t.tail]
            t = t.parent
        return [i for part in reversed(parts) for i in part]


class Renderer:
    """Chat template + tool-call format of one tokenizer, probed once at start-up by what the template renders
    (DESIGN.md "The template decides the format")."""

    SENTINEL = toolcalls.SENTINEL  # the tool and call rendered; detect() looks for it

    def __init__(
        self,
        tokenizer,
        eos_ids: Optional[set[int]] = None,
        tool_format: Optional[str] = None,
        keep_history_tokens: bool = False,
    ):
        """``eos_ids``: every token that ends the model's turn, the set generation stops on (models.eos_ids).
        ``tool_format``: override the detected format. ``keep_history_tokens``: reuse the sampled tokens of an
        echoed turn even where the template renders it differently (see ``build_prompt``)."""
        self.tok, self.keep_history_tokens = tokenizer, keep_history_tokens
        templates = tokenizer.chat_template or ""
        if not templates:
            raise ValueError(
                "the tokenizer has no chat template; use a chat/instruct model or set tokenizer.chat_template"
            )
        source = "\n".join(templates.values()) if isinstance(templates, dict) else templates
        self.eos_ids = set(eos_ids or ()) | {t for t in [tokenizer.eos_token_id] if t is not None}
        self.specials = re.compile(
            "|".join(
                re.escape(t)
                for t in sorted(tokenizer.all_special_tokens, key=len, reverse=True)
                if t
            )
            or "(?!)"
        )
        self.think = toolcalls.think_tags(source)
        self.native_tools, self.short_ids, self.merge_roles = False, False, False
        user = [{"role": "user", "content": "x"}]
        try:  # The text a template writes after an assistant message's content (e.g. "<|im_end|>\n").
            probe = self.render_text(
                user + [{"role": "assistant", "content": self.SENTINEL}], [], False
            )
        except BadRequest as e:
            raise ValueError(
                f"the chat template of {getattr(tokenizer, 'name_or_path', 'this model')!r} cannot render a plain "
                f"user/assistant conversation ({e.message}); give the tokenizer a chat template that can"
            ) from None
        self.turn_close = probe[probe.rindex(self.SENTINEL) + len(self.SENTINEL) :]
        # Native tools: the tool list and a call both show in what the template renders. Some templates want
        # call ids of their own shape (Mistral: 9 alphanumerics): then every id is written in that shape.
        tools = [
            {
                "name": self.SENTINEL,
                "description": "d",
                "parameters": {"type": "object", "properties": {"llarg": {"type": "string"}}},
            }
        ]
        self.native_tools, call_text = True, None
        for self.short_ids in (False, True):
            try:
                head = self.render_text(user, tools, True)
                full = self.render_text(self._probe_calls(), tools, False)
            except BadRequest:
                continue
            if (
                self.think and head.rstrip().endswith(self.think[0]) and not full.startswith(head)
            ):  # DeepSeek-R1: the generation
                head = head.rstrip()[
                    : -len(self.think[0])
                ]  # prompt opens <think>, which history turns do not have
            if self.SENTINEL in head and "llval" in full[len(head) :] and full.startswith(head):
                call_text = full[len(head) :]
                break
        self.native_tools = call_text is not None
        self.short_ids = self.short_ids and self.native_tools
        detected = toolcalls.detect(call_text) if call_text else None
        if call_text and not detected and not tool_format:
            log.warning(
                "the chat template writes tool calls in a format lightning-lite does not know; parsing them as hermes "
                "(pass --tool-format NAME: %s)",
                ", ".join(toolcalls.FORMATS),
            )
        self.format = tool_format or detected or "hermes"
        if self.format not in toolcalls.FORMATS:
            raise ValueError(
                f"unknown tool format {self.format!r}: use one of {', '.join(toolcalls.FORMATS)}"
            )
        try:  # the Hermes fallback writes tool results as user turns, clients send two user or system messages in a row: a
            # template that wants roles to alternate (Gemma, Mistral) gets them merged
            self.render_text(user + user, [], True)
        except BadRequest:
            self.merge_roles = True
        # Does the template render each message on its own (ChatML: SmolLM2, Qwen2.5)? Then the text of the
        # messages after a turn can be rendered without the whole conversation before it. Templates that
        # rewrite earlier turns (Qwen3 drops <think> from them) fail this probe and render in full.
        probe = [{"role": "system", "content": "s"}] + self._probe_calls(
            "<think>\nt\n</think>\n\na"
        )
        probe += [
            {"role": "tool", "content": "r2", "tool_call_id": probe[-1]["tool_call_id"]},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "v"},
        ]
        try:
            deltas = [
                [self._texts(probe, k, tools, {}, alone)[1] for alone in (False, True)]
                for k in (3, 6)
            ]
            self.per_message = all(full is not None and full == alone for full, alone in deltas)
        except BadRequest:  # e.g. a template that refuses a system message or two tool results
            self.per_message = False

    def _probe_calls(self, content: str = "") -> list[dict]:
        call = {
            "id": "a1b2c3d4e" if self.short_ids else "call_0123456789abcdef01234567",
            "name": self.SENTINEL,
            "arguments": {"llarg": "llval"},
        }
        return [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "content": "r", "tool_call_id": call["id"]},
        ]

    def describe(self) -> str:
        think = (
            f"reasoning in {self.think[0]}...{self.think[1]}" if self.think else "no reasoning tags"
        )
        where = (
            "rendered by the template"
            if self.native_tools
            else "written into the system prompt (the template has no tool support)"
        )
        return f"chat template: tool calls in the {self.format} format, {where}; {think}"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(
            text, add_special_tokens=False
        )  # the template writes BOS etc. itself

    def new_id(self) -> str:
        """A tool-call id for a parsed call, in the shape the template accepts."""
        return _short_id(uuid.uuid4().hex) if self.short_ids else "call_" + uuid.uuid4().hex[:24]

    def _id(self, i: str) -> str:
        return _short_id(i) if self.short_ids else i

    def _hf_messages(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        out: list[dict] = []
        if self.native_tools:
            for m in messages:
                if (
                    self.merge_roles
                    and out
                    and m["role"] in ("user", "system")
                    and out[-1]["role"] == m["role"]
                ):  # Mistral: roles
                    out[-1] = {
                        **out[-1],
                        "content": out[-1]["content"] + "\n\n" + m["content"],
                    }  # must alternate, one system
                    continue
                h = {"role": m["role"], "content": m["content"]}
                if m.get("reasoning"):  # the key Qwen's templates read, and the one gpt-oss's reads
                    h["reasoning_content"] = h["thinking"] = m["reasoning"]
                    if (
                        self.format == "harmony" and m.get("tool_calls") and m["content"]
                    ):  # gpt-oss's template refuses both next
                        h["content"], h["thinking"] = (
                            "",
                            m["reasoning"] + "\n\n" + m["content"],
                        )  # to a call: its one slot, the analysis
                if m.get("tool_calls"):
                    h["tool_calls"] = [
                        {
                            "id": self._id(t["id"]),
                            "type": "function",
                            "function": {
                                "name": t["name"],
                                "arguments": parse_arguments(t["arguments"]),
                            },
                        }
                        for t in m["tool_calls"]
                    ]
                if m["role"] == "tool":
                    h["tool_call_id"] = self._id(m.get("tool_call_id", ""))
                out.append(h)
            return out
        # No tool support in the template: write the Hermes convention as text.
        if tools:
            block = TOOLS_PROMPT.format(
                tools="\n".join(
                    json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                    for t in tools
                )
            )
            system = (
                messages[0]["content"] + "\n\n"
                if messages and messages[0]["role"] == "system"
                else ""
            )
            out.append({"role": "system", "content": system + block})
            messages = messages[1:] if system else messages
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {"name": t["name"], "arguments": parse_arguments(t["arguments"])}
                    for t in m["tool_calls"]
                ]
                text = "\n".join(
                    f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls
                )
                out.append(
                    {
                        "role": "assistant",
                        "content": (m["content"] + "\n" if m["content"] else "") + text,
                    }
                )
            elif m["role"] == "tool":
                text = "<tool_response>\n" + m["content"] + "\n</tool_response>"
                if (
                    i and messages[i - 1]["role"] == "tool"
                ):  # consecutive tool results share one user turn
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text})
            elif (
                self.merge_roles and out and out[-1]["role"] == m["role"]
            ):  # a template that wants roles to alternate
                out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return out

    def render_text(
        self,
        messages: list[dict],
        tools: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: Optional[dict] = None,
    ) -> str:
        """The template's text for a conversation. A template that refuses it (Llama's single tool call, roles that
        must alternate, ids of the wrong shape) is the client's error: a BadRequest with the template's message."""
        kwargs = (
            {"tools": [{"type": "function", "function": t} for t in tools]}
            if (self.native_tools and tools)
            else {}
        )
        try:
            return self.tok.apply_chat_template(
                self._hf_messages(messages, tools),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
                **kwargs,
            )
        except Exception as e:  # jinja2's TemplateError (raise_exception), and what a template's filters raise on odd input
            raise BadRequest(
                f"the model's chat template refused this conversation: {e}",
                "messages",
                "template_error",
            ) from None

    def build_prompt(
        self,
        messages: list[dict],
        tools: list[dict],
        history: list[Turn],
        reuse: bool = True,
        fps: Optional[list[bytes]] = None,
        template_kwargs: Optional[dict] = None,
    ) -> tuple[list[int], Optional[int], Optional[str]]:
        """Prompt ids for ``messages``, reusing the sampled tokens of an earlier turn it extends where the template
        renders that turn as sampled (DESIGN.md "Reuse what was sampled"). Returns ``(prompt_ids, parent, split)``:
        the call whose prompt + response ids it starts with, or why none (None: nothing to extend). ``fps``: the
        request's fingerprints if known. ``reuse=False``: render fresh (it still merges if that starts with them)."""
        kw = template_kwargs or {}
        fps = fps or fingerprints(messages, tools, history[-1] if history else None)
        # The longest earlier turn whose messages + reply this request starts with (the latest such turn).
        by_fp = {t.fp: t for t in history}  # fingerprints include the tools
        k, best = next(
            ((k, by_fp[fps[k]]) for k in range(len(messages), 0, -1) if fps[k] in by_fp), (0, None)
        )
        text = None  # the whole conversation's rendering, where it was made on the way
        if best is not None and reuse:
            turn, new, full = self._texts(messages, k, tools, kw, self.per_message)
            text = None if self.per_message else full
            # The sampled turn is reused when the template's text for it starts with what was sampled; the rest
            # of that text (its turn close, minus an EOS the model sampled) is the glue before the new messages.
            sampled = best.forced + self.tok.decode(best.response_ids, skip_special_tokens=False)
            glue = turn[len(sampled) :] if turn is not None and turn.startswith(sampled) else None
            if (
                glue is None and self.keep_history_tokens
            ):  # the template renders it otherwise: keep it anyway
                glue = self.turn_close  # less the end marker it starts with when the model sampled one (gpt-oss ends a call
                if (
                    best.response_ids and best.response_ids[-1] in self.eos_ids
                ):  # with <|call|>, its close is <|return|>)
                    glue = next(
                        (
                            glue[len(t) :]
                            for t in map(self.tok.decode, ([e] for e in self.eos_ids))
                            if glue.startswith(t)
                        ),
                        glue,
                    )
            if glue is not None:
                if (
                    new is None and self.keep_history_tokens
                ):  # the template rewrites that turn once more follows: render
                    # what follows it after the turn as sampled, reasoning too (Qwen3 writes an empty think block otherwise)
                    echoed = {
                        **messages[k - 1],
                        **(
                            {"reasoning": best.reply["reasoning"]}
                            if best.reply.get("reasoning")
                            else {}
                        ),
                    }
                    new = self._texts(
                        messages[: k - 1] + [echoed] + messages[k:], k, tools, kw, True
                    )[1]
                if new is not None:
                    ids = best.tokens()  # one copy of the long part
                    ids += self.encode(glue + new)
                    return ids, best.index, None
        ids = self.encode(text if text is not None else self.render_text(messages, tools, True, kw))
        if best is not None:
            prev = best.tokens()
            return (
                (ids, best.index, None)
                if ids[: len(prev)] == prev
                else (ids, None, "template_mismatch")
            )
        if not history:
            return ids, None, None
        # Did it resend an earlier request's messages (or start with them), with another reply than it got? The
        # fingerprints include the tools: with other tools the prompt starts otherwise, a new thread (as
        # samples.py would tell from the ids).
        asked = {t.fp_request for t in history}
        k = next((k for k in range(len(messages), 0, -1) if fps[k] in asked), None)
        return (
            ids,
            None,
            "new_thread" if k is None else "retry" if k == len(messages) else "rewrote_history",
        )

    def _texts(
        self, messages: list[dict], k: int, tools: list[dict], kw: dict, per_message: bool
    ) -> tuple[Optional[str], Optional[str], str]:
        """Three renderings cut into: the template's text for the assistant turn ``messages[k - 1]``, from after the
        generation prompt to the end of its turn close (what the model must have sampled for the history to render
        as sampled); its text for ``messages[k:]`` + the generation prompt after ``messages[:k]`` (None where it
        renders those k otherwise once more follows); the last rendering. ``per_message``: ``messages[:k]`` is
        stood in for by the system prompt, a user message and message k-1, which render alike, at a flat cost."""
        if per_message:
            system = messages[:1] if messages[0]["role"] == "system" and k > 1 else []
            ctx = system + [{"role": "user", "content": "x"}, messages[k - 1]]
        else:
            ctx = messages[:k]
        before, head = (
            self.render_text(ctx[:-1], tools, True, kw),
            self.render_text(ctx, tools, False, kw),
        )
        full = self.render_text(ctx + messages[k:], tools, True, kw)
        return _after(head, before), _after(full, head), full

    def opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Does the prompt end inside a reasoning block (Qwen3.5's and DeepSeek-R1's generation prompt opens it)?"""
        return bool(self.think) and self.tok.decode(
            prompt_ids[-8:], skip_special_tokens=False
        ).rstrip().endswith(self.think[0])

    def forced_prefix(
        self, force_tool: Optional[str], opened: bool = False, json_reply: bool = False
    ) -> str:
        """The text the prompt ends with for a forced call, or for a reply that is JSON (``json_reply``), else ""."""
        return (
            toolcalls.forced(self.format, force_tool, opened, self.think)
            if force_tool is not None or json_reply
            else ""
        )

    def sampled_text(self, response_ids: list[int], stops: list[str]) -> str:
        """The reply as the parser reads it: special tokens kept (Mistral's [TOOL_CALLS], Llama's <|python_tag|>,
        harmony's markers), without the EOS that ended it, cut at the stop string that ended it."""
        ids = (
            response_ids[:-1] if response_ids and response_ids[-1] in self.eos_ids else response_ids
        )
        text = self.tok.decode(ids, skip_special_tokens=False)
        return text[: min([text.find(s) for s in stops if s in text], default=len(text))]

    def parse_reply(self, text: str, parse_tools: bool, opened: bool = False) -> dict:
        """The assistant message for a sampled text, parsed in the template's format, special tokens dropped."""
        r = toolcalls.parse(self.format, text, self.think, opened)
        if not parse_tools and r.get(
            "tool_calls"
        ):  # tool_choice "none", or no tools: what looks like a call is text
            r = toolcalls.parse(None, text, self.think, opened)
        msg = {"role": "assistant", "content": self.specials.sub("", r["content"]).strip()}
        if r.get("reasoning"):
            msg["reasoning"] = self.specials.sub("", r["reasoning"]).strip()
        if r.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": t.get("id") or self.new_id(), "name": t["name"], "arguments": t["arguments"]}
                for t in r["tool_calls"]
            ]
        return msg


def _after(text: str, head: str) -> Optional[str]:
    return text[len(head) :] if text.startswith(head) else None


def _short_id(s: str) -> str:
    """``s`` as 9 alphanumerics (Mistral's templates accept no other tool-call id): kept when it is one, otherwise
    a hash of it, so a call and its result keep matching ids. The Anthropic API hands the proxy's ids out as
    ``toolu_`` + the id: they come back as the id the model sampled."""
    if len(core := s.removeprefix("toolu_")) == 9 and core.isalnum():
        return core
    n = int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")
    return "".join(
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[(n >> (6 * i)) % 62]
        for i in range(9)
    )
