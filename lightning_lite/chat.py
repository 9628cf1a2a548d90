"""Chat: one :class:`Request` (apis.py maps every API onto it) -> prompt ids; sampled text -> a
reply (toolcalls.py); ``ContentStream``: what of a reply may stream while it is sampled.

Why it exists: rendering a conversation through the chat template again often does not give back the
ids the model sampled (a template rewrites earlier turns, the tokenizer splits text otherwise), and
training needs the exact ids. So the :class:`Renderer` finds the latest turn a request extends (by
its messages' fingerprints) and appends only the new messages' ids to that turn's prompt + response
ids: call k+1's prompt starts with call k's exact ids (docs/serving.md). At
start-up ``probe`` learns what the template renders (a :class:`TemplateInfo`): its tool-call
format, and whether it renders tools, calls and results itself, as a ChatML/Hermes template does;
the quirks of other families' templates are hooks.template_quirks' (extras/tool_formats.py).

Example (SmolLM2, no native tool support)::

    messages = [{"role": "user", "content": "2+3?"}]
    tools    = [{"name": "calculator", "parameters": {...}}]
    render  -> "<|im_start|>system\\n# Tools ... <tools>{...}</tools> ...<|im_end|>\\n"
               "<|im_start|>user\\n2+3?<|im_end|>\\n<|im_start|>assistant\\n"
    model   -> '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+3"}}\\n</tool_call><|im_end|>'
    parse   -> content "", tool_calls [{"id": "call_…", "name": "calculator", "arguments": '{"expression": "2+3"}'}]
"""

import hashlib
import json
import os
import re
import uuid
from dataclasses import InitVar, dataclass, field, replace
from functools import partial
from typing import Callable, Optional

from . import hooks, toolcalls
from .records import common_prefix
from .toolcalls import SENTINEL, dumps, parse_arguments

# a message's role -> the role it has here
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

    def __init__(self, message: str, param=None, code=None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


@dataclass
class Sampling:
    # None: up to the model's context
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    # 0: off
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    # what the reply must follow (extras/grammar.py): a forced tool call, a response_format
    grammar: Optional[str] = None


@dataclass
class Request:
    """One API request in the shape every API maps to. ``messages`` are normalized: ``{"role",
    "content": str}`` plus ``tool_calls: [{"id", "name", "arguments": dict | str}]`` on assistant
    messages and ``tool_call_id`` on tool messages. ``prompt_ids`` is set instead of messages for
    the completions API."""

    messages: list[dict] = field(default_factory=list)
    # [{"name", "description", "parameters"}]
    tools: list[dict] = field(default_factory=list)
    # False for tool_choice "none"
    parse_tools: bool = True
    # tool_choice "required" -> "", a named function -> its name
    force_tool: Optional[str] = None
    # response_format: the JSON schema the reply follows
    response_schema: Optional[dict] = None
    sampling: Sampling = field(default_factory=Sampling)
    # choices: each is recorded as its own call
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = ""
    prompt_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None
    # Responses API: leading messages from ``instructions`` (not carried to the next response)
    n_instructions: int = 0
    # chat_template_kwargs: passed to the chat template (enable_thinking, ...)
    template_kwargs: dict = field(default_factory=dict)


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
    """What of a reply may be sent while it is still being sampled: reasoning and content, each
    always a prefix of what ``parse_reply`` makes of the whole reply (toolcalls.visible; here, a
    stop string and its start are held).

    >>> s = ContentStream(renderer, stops=[], parse_tools=True)
    >>> s.feed(ids_of("Let me"))  ->  ("", "Let me");   s.feed(ids_of("Let me <tool"))  ->  ("", "")
    """

    def __init__(self, renderer, stops: list[str], parse_tools: bool, forced="", opened=False):
        self.renderer = renderer
        self.forced = forced
        self.opened = opened
        self.stops = [s for s in stops if s]
        self.format = renderer.format if parse_tools else None
        # what was sent so far
        self.reasoning = self.sent = ""

    def feed(self, ids: list[int]) -> tuple[str, str]:
        """The new (reasoning, content) to send, given every id sampled so far."""
        r = self.renderer
        text = toolcalls.hold_back(r.sampled_text(ids, self.stops), self.stops)
        shown = toolcalls.visible(self.format, self.forced + text, r.think, self.opened)
        reasoning, content = (r.specials.sub("", part).strip() for part in shown)
        # only what extends what was sent: never a contradiction
        new_reasoning = _after(reasoning, self.reasoning) or ""
        new_content = _after(content, self.sent) or ""
        self.reasoning += new_reasoning
        self.sent += new_content
        return new_reasoning, new_content


# ------------------------------------------------------------ finding the turn a request extends

THINK_BLOCK = re.compile(r"\A\s*(<((?:\w+:)?think)>.*?</\2>|\[THINK\].*?\[/THINK\])", re.DOTALL)


def message_key(m: dict) -> str:
    """What identifies a normalized message: role, stripped content, tool calls by name and parsed
    arguments (not their ids, nor how the arguments' JSON was formatted, nor reasoning: echoed in
    its own field, in the content, or dropped, it is the same reply; whether the template renders it
    as sampled is build_prompt's call)."""
    content = m.get("content") or ""
    content = (THINK_BLOCK.sub("", content) if m["role"] == "assistant" else content).strip()
    # the length keeps content and tool calls apart
    key = f"{m['role']}\0{len(content)}\0{content}"
    if m.get("tool_calls"):
        calls = [[t["name"], parse_arguments(t["arguments"])] for t in m["tool_calls"]]
        key += "\0" + json.dumps(calls, sort_keys=True)
    return key


def extend_fingerprint(fingerprint: bytes, m: dict) -> bytes:
    """The fingerprint of a conversation whose fingerprint was ``fingerprint``, extended by the
    message ``m``."""
    data = fingerprint + message_key(m).encode(errors="surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest()


def fingerprints(messages: list[dict], tools: list[dict], known: Optional["Turn"] = None):
    """``fps[k]`` identifies ``tools`` and ``messages[:k]`` (by ``message_key``): the earlier turn a
    request extends is found by a dictionary lookup. ``known``: the session's latest turn, whose
    fingerprints of the messages this request shares with it (equal dicts, compared in C) are
    reused: an append hashes only its new ones.

    >>> fingerprints([{"role": "user", "content": "hi "}], []) == fingerprints([{"role": "user", "content": "hi"}], [])
    True
    """
    if known is not None and known.tools == tools:
        k = common_prefix(messages, known.messages)
        fps = known.fps[: k + 1]
    else:
        tools_json = json.dumps(tools, sort_keys=True).encode()
        k = 0
        fps = [hashlib.blake2b(tools_json, digest_size=16).digest()]
    for m in messages[k:]:
        fps.append(extend_fingerprint(fps[-1], m))
    return fps


@dataclass(eq=False, repr=False)
class Turn:
    """What a session remembers of one answered call (DESIGN.md "The ids decide"): the reply, the
    ids its prompt adds to its ``parent`` turn's prompt + response (``tail``: each id held once),
    its response ids, the forced opening (tool_choice), ``fp_request`` (what a retry starts with)
    and ``fp`` (with the reply: what an extension starts with). Only the latest turn keeps
    ``messages``, ``tools``, ``fps``: the caller drops them from the turn before when it adds one
    (fingerprints() reuses only the latest turn's, so memory stays linear)."""

    index: int
    messages: Optional[list]
    tools: Optional[list]
    reply: dict
    # not kept: the turn keeps its tail
    prompt_ids: InitVar[list]
    response_ids: list
    fps: Optional[list] = None
    forced: str = ""
    parent: Optional["Turn"] = None

    def __post_init__(self, prompt_ids: list[int]):
        self.fps = self.fps or fingerprints(self.messages, self.tools)
        self.fp_request = self.fps[-1]
        self.fp = extend_fingerprint(self.fp_request, self.reply)
        self.tail = prompt_ids[self.parent.size :] if self.parent else prompt_ids
        self.size = len(prompt_ids) + len(self.response_ids)

    def tokens(self) -> list[int]:
        """Prompt + response ids, root first: what a call extending this turn starts with (a loop:
        chains are long)."""
        parts = []
        turn = self
        while turn is not None:
            parts += [turn.response_ids, turn.tail]
            turn = turn.parent
        return [i for part in reversed(parts) for i in part]


# ----------------------------------------------------------------------------- probing a template

# What the probes of a template render: a user message, a tool, and a call of it (arguments
# {"llarg": "llval"}).
PROBE_USER = [{"role": "user", "content": "x"}]
PROBE_PARAMETERS = {"type": "object", "properties": {"llarg": {"type": "string"}}}
PROBE_TOOL = {"name": SENTINEL, "description": "d", "parameters": PROBE_PARAMETERS}


def tools_argument(messages: list[dict], tools: list[dict]):
    """The tool list as the template's ``tools`` argument, where most templates take it: (messages,
    template arguments)."""
    return messages, {"tools": tools}


@dataclass(frozen=True)
class TemplateInfo:
    """What a chat template does with a conversation, as ``probe`` finds it by what the template
    renders. A Hermes template that renders tools, calls and results itself (SmolLM2's, Qwen's) is
    the defaults, with its own ``turn_close`` and ``per_message``."""

    # the tool-call format the model writes, its replies parsed in (toolcalls.format_of)
    format: str = "hermes"
    # The template renders the tool list it is given; else the list goes into the system prompt
    # (TOOLS_PROMPT).
    native_tools: bool = True
    # It renders calls given in OpenAI's shape; else they are written as text in the format.
    native_calls: bool = True
    # It renders tool messages; else results go into user turns (the Hermes convention).
    native_results: bool = True
    # Where it takes the tool list: fn(messages, tools) -> (messages, template arguments), the
    # tools argument or a place of hooks.template_quirks (Phi-4's system message).
    tools_at: Callable = tools_argument
    # The names of the dialects of hooks.template_quirks its messages are written in, in order.
    dialects: list = field(default_factory=list)
    # What it writes after an assistant message's content (ChatML: "<|im_end|>\n").
    turn_close: str = ""
    # It renders each message on its own: the messages after a turn render without those before.
    per_message: bool = False
    # The format the template teaches, where --tool-format names another (describe() says so).
    contradicted: Optional[str] = None


def probe(tok, tool_format: Optional[str] = None) -> TemplateInfo:
    """What the chat template of ``tok`` does, probed once at start-up by what it renders
    (DESIGN.md "The template decides the format"), one fact after another: each probe renders as
    the facts found before it say. ``tool_format``: the format the model writes, where the user
    names it (--tool-format). A template that cannot be served raises ValueError, saying why."""
    quirks = hooks.template_quirks
    info = TemplateInfo(turn_close=_turn_close(tok))
    # Where the template takes the list: the calls are probed with the tools given there (Apertus
    # 2509's renders calls only once it can render its list).
    info, listed = quirks.tool_place(info, partial(_lists_tools, tok))
    _must_render(tok, info, "a tool call in OpenAI's shape", probe_calls(), [PROBE_TOOL])
    # Some templates render calls only in a dialect (Mistral's 9-alphanumeric ids): then every
    # conversation is written in it.
    info, call = quirks.in_dialect(info, partial(_native_call, tok))
    info = replace(info, native_tools=listed, native_calls=call is not None)
    taught = _taught_format(tok, info, call)
    if not tool_format and not taught and (call or info.native_tools):
        _refuse_untaught(tok, info, call)
    info = replace(info, format=tool_format or taught or "hermes")
    # an unknown name raises here, at start-up
    toolcalls.format_of(info.format)
    if tool_format and taught and taught != tool_format:
        info = replace(info, contradicted=taught)
    # Calls written as text beside a tool list the template renders (Granite 3.x): their results go
    # in the template's tool turns where it renders them; else in the Hermes convention's user
    # turns.
    if not info.native_calls:
        info = replace(info, native_results=info.native_tools and _renders_results(tok, info))
    # Two user messages in a row: the Hermes fallback writes tool results as user turns, and clients
    # send such pairs; a template that wants roles to alternate (Gemma, Mistral) refuses them, and
    # takes them in a dialect that merges them.
    two_users = PROBE_USER + PROBE_USER
    _must_render(tok, info, "two user messages in a row", two_users, [], True)
    info, _ = quirks.in_dialect(info, partial(rendered, tok, messages=two_users, tools=[]))
    # A system message first: harnesses send one, and the Hermes fallback writes the tool list into
    # one. A template that refuses it (Gemma 2) takes it in a dialect that writes it into the first
    # user message; where none helps, such a request gets the template's 400.
    system_first = [{"role": "system", "content": "s"}] + PROBE_USER
    info, _ = quirks.in_dialect(info, partial(rendered, tok, messages=system_first, tools=[]))
    return replace(info, per_message=_renders_per_message(tok, info))


def _turn_close(tok) -> str:
    """The text a template writes after an assistant message's content (ChatML:
    "<|im_end|>\\n")."""
    reply = {"role": "assistant", "content": SENTINEL}
    why = "it leaves out the assistant message's text"
    try:
        text = render(tok, TemplateInfo(), PROBE_USER + [reply], [], False)
    except BadRequest as e:
        text = ""
        why = e.message
    if SENTINEL not in text:
        raise ValueError(
            f"{template_name(tok)} cannot render a plain user/assistant conversation of text "
            f"({why}); serve a chat model whose template can, or set tokenizer.chat_template to one"
        )
    return text[text.rindex(SENTINEL) + len(SENTINEL) :]


def _lists_tools(tok, info: TemplateInfo) -> bool:
    """Does the template render the tool list it is given, where ``info`` gives it?"""
    head = rendered(tok, info, PROBE_USER, [PROBE_TOOL])
    return head is not None and SENTINEL in head


def _must_render(tok, info: TemplateInfo, what: str, messages, tools, gen=False) -> None:
    """Refuse the template where it refuses ``messages`` (``what``, in words) and
    hooks.template_quirks has no dialects that might make it render them: never served as if it
    took OpenAI's shape where it may want a dialect that is not loaded."""
    if hooks.template_quirks.dialects:
        return
    try:
        render(tok, info, messages, tools, gen)
    except BadRequest as e:
        what = f"{template_name(tok)}, which refuses {what} ({e.message}),"
        raise ValueError(hooks.missing(what, "tool_formats")) from None


def _native_call(tok, info: TemplateInfo) -> Optional[str]:
    """The template's text for the probe's call after its generation prompt (``call_text``); None
    where it refuses the probe, leaves out the call's arguments, or fails hooks.template_quirks'
    check (DeepSeek-R1's drops the opening of a call after a tool result): then calls are written
    as text."""
    head = rendered(tok, info, PROBE_USER, [PROBE_TOOL])
    full = rendered(tok, info, probe_calls(), [PROBE_TOOL], False)
    if head is None or full is None:
        return None
    call = call_text(head, full)
    if "llval" not in call or not hooks.template_quirks.calls_kept(tok, info, call):
        return None
    return call


def _taught_format(tok, info: TemplateInfo, call: Optional[str]) -> Optional[str]:
    """The format the template teaches: its calls' where it renders them; else, where it renders
    the tool list, the one its instructions name (toolcalls.taught), else its family's
    (hooks.template_quirks). None where it teaches none."""
    if call is not None:
        return toolcalls.detect(call)
    if not info.native_tools:
        return None
    instructions = tool_instructions(tok, info)
    specials = tok.all_special_tokens
    return toolcalls.taught(instructions) or hooks.template_quirks.family(instructions, specials)


def _refuse_untaught(tok, info: TemplateInfo, call: Optional[str]) -> None:
    """Refuse a template that renders calls or the tool list but teaches no format parsed here:
    never served as if it were another format, the harness would get its calls back as text."""
    if call:
        shown = call.replace(SENTINEL, "get_weather")[:160]
        what = f"writes tool calls in a format lightning-lite does not parse: {shown!r}"
    else:
        shown = tool_instructions(tok, info).replace(SENTINEL, "get_weather")[:300]
        what = (
            "renders the tool list but neither a tool call nor instructions that name a format "
            f"lightning-lite parses: {shown!r}"
        )
    raise ValueError(
        f"{template_name(tok)} {what}; name the format the model writes with --tool-format, "
        f"{toolcalls.known_formats()}"
    )


def tool_instructions(tok, info: TemplateInfo) -> str:
    """What the template writes for a tool list, around it included: its text with the SENTINEL
    tool where its text without tools differs."""
    listed = rendered(tok, info, PROBE_USER, [PROBE_TOOL]) or ""
    bare = rendered(tok, info, PROBE_USER, []) or ""
    start = len(os.path.commonprefix([listed, bare]))
    end = len(os.path.commonprefix([listed[start:][::-1], bare[start:][::-1]]))
    return listed[start : len(listed) - end]


def _renders_results(tok, info: TemplateInfo) -> bool:
    """Does the template render a tool message's content (Granite's tool role), after an assistant
    turn of text?"""
    reply = {"role": "assistant", "content": "a"}
    result = {"role": "tool", "content": SENTINEL, "tool_call_id": "call_0"}
    text = rendered(
        tok, replace(info, native_results=True), PROBE_USER + [reply, result], [], False
    )
    return text is not None and SENTINEL in text


def _renders_per_message(tok, info: TemplateInfo) -> bool:
    """Does the template render each message on its own (ChatML: SmolLM2, Qwen2.5)? Then the text
    of the messages after a turn can be rendered without the whole conversation before it.
    Templates that rewrite earlier turns (Qwen3 drops <think> from them) fail this probe and render
    in full."""
    system = [{"role": "system", "content": "s"}]
    messages = system + probe_calls("<think>\nt\n</think>\n\na")
    messages += [{"role": "tool", "content": "r2", "tool_call_id": messages[-1]["tool_call_id"]}]
    messages += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "v"}]
    render_info = partial(render, tok, info)
    try:
        for k in (3, 6):
            in_full = turn_texts(render_info, messages, k, [PROBE_TOOL], {}, False).new
            alone = turn_texts(render_info, messages, k, [PROBE_TOOL], {}, True).new
            if in_full is None or in_full != alone:
                return False
        return True
    # e.g. a template that refuses a system message or two tool results
    except BadRequest:
        return False


def probe_calls(content: str = "", rounds: int = 1) -> list[dict]:
    """A user message, then ``rounds`` times an assistant message calling the SENTINEL tool and its
    result."""
    out = list(PROBE_USER)
    for k in range(rounds):
        id = "call_0123456789abcdef0123456" + str(k)
        call = {"id": id, "name": SENTINEL, "arguments": {"llarg": "llval"}}
        out.append({"role": "assistant", "content": content, "tool_calls": [call]})
        out.append({"role": "tool", "content": "r", "tool_call_id": id})
    return out


# ----------------------------------------------------------------------------- rendering


def template_name(tok) -> str:
    """The chat template as start-up messages name it: by its model."""
    name = getattr(tok, "name_or_path", None) or "this model"
    return f"the chat template of {name!r}"


def render(
    tok, info: TemplateInfo, messages, tools, add_generation_prompt=True, kwargs=None
) -> str:
    """The template's text for a conversation, given to it as ``info`` says it takes it. A template
    that refuses it (Llama's single tool call, roles that must alternate, ids of the wrong shape)
    is the client's error: a BadRequest with the template's message."""
    kwargs = {"add_generation_prompt": add_generation_prompt, **(kwargs or {})}
    try:
        messages = template_messages(info, messages, tools)
        if info.native_tools and tools:
            listed = [{"type": "function", "function": t} for t in tools]
            messages, given = info.tools_at(messages, listed)
            kwargs.update(given)
        return tok.apply_chat_template(messages, tokenize=False, **kwargs)
    # jinja2's TemplateError (raise_exception), and what a template's filters raise on odd input
    except Exception as e:
        message = f"the model's chat template refused this conversation: {e} ({template_name(tok)})"
        raise BadRequest(message, "messages", "template_error") from None


def rendered(tok, info: TemplateInfo, messages, tools, gen=True) -> Optional[str]:
    """``render``'s text for a probe, None where the template refuses it."""
    try:
        return render(tok, info, messages, tools, gen)
    except BadRequest:
        return None


def in_dialects(names: list[str], messages: list[dict]) -> list[dict]:
    """The messages written in the dialects of hooks.template_quirks named, in order."""
    for name in names:
        messages = hooks.template_quirks.dialects[name](messages)
    return messages


def template_messages(info: TemplateInfo, messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages as the template takes them: OpenAI's shape (arguments as a dict) where it
    renders calls, else calls written as text in the format (``toolcalls.write``) and results in
    the template's tool turns where it renders them (``native_results``), else in a user turn's
    ``<tool_response>`` tags (the Hermes convention). A tool list the template does not render
    goes into the system prompt."""
    out = []
    if tools and not info.native_tools:
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] + "\n\n" if has_system else ""
        out.append({"role": "system", "content": system + _tools_prompt(info.format, tools)})
        messages = messages[1:] if has_system else messages
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not info.native_results:
            text = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            # consecutive tool results share one user turn
            if i and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            continue
        message = {"role": m["role"], "content": m["content"]}
        if m["role"] == "tool":
            message["tool_call_id"] = m.get("tool_call_id", "")
        out.append(message)
        if not info.native_calls:
            calls = (toolcalls.write(info.format, **_parsed(t)) for t in m.get("tool_calls") or ())
            message["content"] = "\n".join(filter(None, [m["content"], *calls]))
            continue
        # the key Qwen's templates read, and the one gpt-oss's reads
        if m.get("reasoning"):
            message["reasoning_content"] = message["thinking"] = m["reasoning"]
        for t in m.get("tool_calls") or ():
            call = {"id": t["id"], "type": "function", "function": _parsed(t)}
            message.setdefault("tool_calls", []).append(call)
    # then as the template's dialects and the format's own templates take them (Kimi's ids)
    out = in_dialects(info.dialects, out)
    form = toolcalls.format_of(info.format)
    return form.messages(out) if form.messages else out


def _tools_prompt(fmt: str, tools: list[dict]) -> str:
    """The tool list in the system prompt (TOOLS_PROMPT), how to call one in the format the model
    writes."""
    listed = "\n".join(dumps({"type": "function", "function": t}) for t in tools)
    prompt = TOOLS_PROMPT.format(tools=listed)
    if fmt == "hermes":
        return prompt
    example = toolcalls.write(fmt, "<function-name>", {"<argument>": "<value>"})
    return prompt[: prompt.index("For each")] + f"Write each function call as here:\n{example}"


@dataclass
class TurnTexts:
    """What ``turn_texts`` cuts three renderings into."""

    # the template's text for the assistant turn messages[k - 1], from after the generation prompt
    # to the end of its turn close: what the model must have sampled for the history to render as
    # sampled
    turn: Optional[str]
    # its text for messages[k:] + the generation prompt, after messages[:k]; None where it renders
    # those k otherwise once more follows
    new: Optional[str]
    # the whole conversation's text; None where per_message stood in for it
    full: Optional[str]


def turn_texts(render, messages: list[dict], k: int, tools, kw: dict, per_message: bool):
    """The template's texts around the assistant turn ``messages[k - 1]`` (a TurnTexts), rendered
    by ``render(messages, tools, add_generation_prompt, template_kwargs)``. ``per_message``:
    ``messages[:k]`` is stood in for by the system prompt, a user message and message k-1, which
    render alike, at a flat cost."""
    context = messages[:k]
    if per_message:
        system = []
        if messages[0]["role"] == "system" and k > 1:
            system = messages[:1]
        context = system + PROBE_USER + [messages[k - 1]]
    before = render(context[:-1], tools, True, kw)
    head = render(context, tools, False, kw)
    full = render(context + messages[k:], tools, True, kw)
    texts = TurnTexts(turn=_after(head, before), new=_after(full, head), full=full)
    if per_message:
        texts.full = None
    return texts


class Renderer:
    """Chat template + tool-call format of one tokenizer: a conversation -> prompt ids that reuse
    the sampled ones, sampled ids -> a reply. What the template does is probed once (``info``)."""

    def __init__(self, tokenizer, eos_ids=None, tool_format=None, keep_history_tokens=False):
        """``eos_ids``: every token that ends the model's turn, the set generation stops on
        (models.eos_ids). ``tool_format``: override the detected format. ``keep_history_tokens``:
        reuse the sampled tokens of an echoed turn even where the template renders it differently
        (see ``build_prompt``)."""
        self.tok = tokenizer
        self.keep_history_tokens = keep_history_tokens
        templates = tokenizer.chat_template or ""
        if not templates:
            raise ValueError(
                f"{template_name(tokenizer)} is missing: serve a chat model, or set "
                "tokenizer.chat_template"
            )
        source = "\n".join(templates.values()) if isinstance(templates, dict) else templates
        self.eos_ids = set(eos_ids or ()) | {t for t in [tokenizer.eos_token_id] if t is not None}
        specials = sorted(filter(None, tokenizer.all_special_tokens), key=len, reverse=True)
        self.specials = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        self.think = think_tags(source)
        self.info = probe(tokenizer, tool_format)
        # the format every reply is parsed in (extras/grammar.py reads it too)
        self.format = self.info.format

    def describe(self) -> str:
        info = self.info
        think = "reasoning in {}...{}".format(*self.think) if self.think else "no reasoning tags"
        where = {
            (True, True): "rendered by the template",
            (False, True): "rendered by the template, its tool list written into the system prompt",
            (True, False): "its tool list rendered by the template, calls written as text",
            (False, False): "written into the system prompt (the template has no tool support)",
        }[info.native_tools, info.native_calls]
        said = f"chat template: tool calls in the {info.format} format, {where}; {think}"
        if info.contradicted:
            said += (
                f"; --tool-format {info.format} is used, though the template teaches the "
                f"{info.contradicted} format"
            )
        return said

    def encode(self, text: str) -> list[int]:
        # the template writes BOS etc. itself
        return self.tok.encode(text, add_special_tokens=False)

    def new_id(self) -> str:
        """A tool-call id for a parsed call, as the template's dialects write it."""
        result = {"role": "tool", "content": "", "tool_call_id": "call_" + uuid.uuid4().hex[:24]}
        return in_dialects(self.info.dialects, [result])[0]["tool_call_id"]

    def render_text(self, messages, tools, add_generation_prompt=True, template_kwargs=None) -> str:
        """The template's text for a conversation (``render``): a BadRequest where it refuses it."""
        return render(self.tok, self.info, messages, tools, add_generation_prompt, template_kwargs)

    def build_prompt(self, messages, tools, history, reuse=True, fps=None, template_kwargs=None):
        """Prompt ids for ``messages``, reusing the sampled tokens of an earlier turn it extends
        where the template renders that turn as sampled (DESIGN.md "Reuse what was sampled").
        Returns ``(prompt_ids, parent, split)``: the call whose prompt + response ids it starts
        with, or why none (None: nothing to extend). ``fps``: the request's fingerprints if known.
        ``reuse=False``: render fresh (it still merges if that starts with them)."""
        kw = template_kwargs or {}
        fps = fps or fingerprints(messages, tools, history[-1] if history else None)
        # The latest turn whose messages + reply this request starts with, the longest such (fps
        # include the tools).
        by_fp = {t.fp: t for t in history}
        k = next((k for k in range(len(messages), 0, -1) if fps[k] in by_fp), 0)
        parent = by_fp[fps[k]] if k else None
        full = None
        if parent is not None and reuse:
            ids, full = self._extend(parent, messages, k, tools, kw)
            if ids is not None:
                return ids, parent.index, None
        if full is None:
            full = self.render_text(messages, tools, True, kw)
        ids = self.encode(full)
        if parent is not None:
            # rendered anew, it still extends the turn where it starts with the turn's ids
            if ids[: parent.size] == parent.tokens():
                return ids, parent.index, None
            return ids, None, "template_mismatch"
        if not history:
            return ids, None, None
        # Did it resend an earlier request's messages (or start with them), with another reply than
        # it got? The fingerprints include the tools: with other tools the prompt starts otherwise,
        # a new thread (as samples.py would tell from the ids).
        asked = {t.fp_request for t in history}
        k = next((k for k in range(len(messages), 0, -1) if fps[k] in asked), None)
        if k is None:
            return ids, None, "new_thread"
        if k == len(messages):
            return ids, None, "retry"
        return ids, None, "rewrote_history"

    def _extend(self, parent: Turn, messages, k: int, tools, kw):
        """(``parent``'s prompt + response ids + the ids of the messages after its reply
        ``messages[k - 1]``, where the template renders that turn as sampled, else None; the whole
        conversation's text if rendered on the way)."""
        texts = turn_texts(self.render_text, messages, k, tools, kw, self.info.per_message)
        new = texts.new
        # The sampled turn is reused when the template's text for it starts with what was sampled;
        # the rest of that text (its turn close, minus an EOS the model sampled) is the glue before
        # the new messages.
        sampled = parent.forced + self.tok.decode(parent.response_ids, skip_special_tokens=False)
        glue = None
        if texts.turn is not None and texts.turn.startswith(sampled):
            glue = texts.turn[len(sampled) :]
        if glue is None and self.keep_history_tokens:
            glue = self._kept_turn_glue(parent)
        # The template rewrites that turn once more follows: render what follows it after the turn
        # as sampled, reasoning too (Qwen3 writes an empty think block otherwise).
        if glue is not None and new is None and self.keep_history_tokens:
            echoed = dict(messages[k - 1])
            if parent.reply.get("reasoning"):
                echoed["reasoning"] = parent.reply["reasoning"]
            echoed_messages = messages[: k - 1] + [echoed] + messages[k:]
            new = turn_texts(self.render_text, echoed_messages, k, tools, kw, True).new
        if glue is None or new is None:
            return None, texts.full
        return parent.tokens() + self.encode(glue + new), texts.full

    def _kept_turn_glue(self, parent: Turn) -> str:
        """The text after a turn the template renders otherwise, kept as sampled
        (``keep_history_tokens``): the template's turn close, less the end marker it starts with
        when the model sampled one (gpt-oss ends a call with <|call|>, its turn close is
        <|return|>)."""
        glue = self.info.turn_close
        if parent.response_ids and parent.response_ids[-1] in self.eos_ids:
            ends = (self.tok.decode([e]) for e in self.eos_ids)
            glue = next((glue[len(end) :] for end in ends if glue.startswith(end)), glue)
        return glue

    def opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Does the prompt end inside a reasoning block (Qwen3.5's and DeepSeek-R1's generation
        prompt opens it)?"""
        end = self.tok.decode(prompt_ids[-8:], skip_special_tokens=False)
        return bool(self.think) and end.rstrip().endswith(self.think[0])

    def forced_prefix(self, force_tool: Optional[str], opened=False, json_reply=False) -> str:
        """The text the prompt ends with for a forced call, or for a reply that is JSON
        (``json_reply``), else ""."""
        forced = force_tool is not None or json_reply
        return toolcalls.forced(self.format, force_tool, opened, self.think) if forced else ""

    def sampled_text(self, response_ids: list[int], stops: list[str]) -> str:
        """The reply as the parser reads it: special tokens kept (Mistral's [TOOL_CALLS], Llama's
        <|python_tag|>, harmony's markers), without the EOS that ended it, cut at the stop string
        that ended it."""
        if response_ids and response_ids[-1] in self.eos_ids:
            response_ids = response_ids[:-1]
        text = self.tok.decode(response_ids, skip_special_tokens=False)
        return text[: min([text.find(s) for s in stops if s in text], default=len(text))]

    def parse_reply(self, text: str, parse_tools: bool, opened: bool = False) -> dict:
        """The assistant message for a sampled text, parsed in the template's format, special tokens
        dropped::

        '<think>hm</think>Sure.<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>'  (Qwen3)
        -> {"role": "assistant", "content": "Sure.", "reasoning": "hm",
            "tool_calls": [{"id": "call_…", "name": "f", "arguments": "{}"}]}
        """
        parsed = toolcalls.parse(self.format, text, self.think, opened)
        # tool_choice "none", or no tools: what looks like a call is text
        if not parse_tools and parsed["tool_calls"]:
            parsed = toolcalls.parse(None, text, self.think, opened)
        message = {"role": "assistant", "content": self.specials.sub("", parsed["content"]).strip()}
        if parsed["reasoning"]:
            message["reasoning"] = self.specials.sub("", parsed["reasoning"]).strip()
        if parsed["tool_calls"]:
            # the model's own call ids where it wrote them
            calls = parsed["tool_calls"]
            message["tool_calls"] = [t if "id" in t else {"id": self.new_id(), **t} for t in calls]
        return message


def think_tags(template_source: str) -> Optional[tuple[str, str]]:
    """The think-tag pair a chat template uses (``<think>``, Magistral's ``[THINK]``, Seed-OSS's
    ``<seed:think>``, MiniMax M3's ``<mm:think>``), None when it has none."""
    if "[THINK]" in template_source:
        return ("[THINK]", "[/THINK]")
    m = re.search(r"</?((?:\w+:)?think)>", template_source)
    return (f"<{m[1]}>", f"</{m[1]}>") if m else None


def call_text(head: str, full: str) -> str:
    """What ``full`` (a history that ends in the assistant's turn) writes where it leaves ``head``
    (the generation prompt), from the tag or line where they part: a generation prompt may open a
    block the history's turns lack (a think block, open or empty; Cohere's ``<|START_THINKING|>``;
    Apriel's "Here are my reasoning steps:"). call_text("<|A|>\\n<think>\\n",
    "<|A|>\\n<tool_call>{}") -> "<tool_call>{}" """
    n = len(os.path.commonprefix([head, full]))
    n = n if n == len(head) else max(head.rfind(">", 0, n), head.rfind("\n", 0, n)) + 1
    return full[n:]


def _parsed(call: dict) -> dict:
    """A call's name and arguments, the arguments a dict where they are JSON (as templates take
    them)."""
    return {"name": call["name"], "arguments": parse_arguments(call["arguments"])}


def _after(text: str, head: str) -> Optional[str]:
    """What ``text`` adds to ``head``; None when it does not start with it."""
    return text[len(head) :] if text.startswith(head) else None
