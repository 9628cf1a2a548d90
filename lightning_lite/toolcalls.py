"""Tool calls in sampled text (chat.Renderer.sampled_text): the Hermes format, and the one place
every format is looked up (``format_of``, in hooks.TOOL_FORMATS; the other families' are in
extras/tool_formats.py). Hermes::

    parse("hermes", 'Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    -> {"content": "Sure.", "reasoning": "", "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}]}

Reasoning: a think-tag pair (``think``) at the start of the reply; ``opened``: the generation prompt
opened it, so the text starts inside (Qwen3.5, DeepSeek-R1)."""

import json
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from . import hooks

# detect(): the name of the call a template renders, with the arguments {"llarg": "llval"}
SENTINEL = "LLSENTINEL7f3a"


class Param(NamedTuple):
    """How a format writes arguments a parameter at a time, not as one JSON object (Qwen3-Coder's
    ``<parameter=A>\nV\n</parameter>\n``, OLMo 3's ``A=V, B=W``)."""

    # the text before a value ({name}: the key)
    before: str
    # the text after a value ({name}: the key, MiniMax M3's close)
    after: str
    # the text between two parameters
    sep: str = ""
    # The text around a string value, written then as text, not JSON.
    quote: str = ""


@dataclass(frozen=True)
class Format:
    """One family's way of writing tool calls: a few small functions and strings."""

    # One call's text around its name and its arguments: what opens a forced call (``forced``) and
    # what a constrained call's grammar writes around the arguments (extras/grammar.py).
    call: tuple[str, str, str]
    # Is this the format, given a template's rendering of the SENTINEL call before and after the
    # name?
    detect: Callable[[str, str], bool]
    # blocks and stream are needed unless the format parses the whole reply itself (whole). (start,
    # end, calls) of each call block of a reply that parses: the content is the text around them.
    blocks: Optional[Callable[[str], list[tuple[int, int, list[dict]]]]] = None
    # What of a growing reply's content may stream: up_to(where a call begins), or all of it or
    # nothing (Llama 3).
    stream: Optional[Callable[[str], str]] = None
    # A format that parses the whole reply itself, reasoning included: (text, partial) -> parse()'s
    # dict.
    whole: Optional[Callable[[str, bool], dict]] = None
    # What opens a reply that is JSON (response_format), where the format has a place for it.
    json_reply: str = ""
    # The messages as the family's templates take them, from OpenAI's shape where the template
    # renders calls (gpt-oss's reasoning beside a call, Kimi's call ids): messages -> messages.
    messages: Optional[Callable[[list[dict]], list[dict]]] = None
    # Arguments written a parameter at a time, not as one JSON object.
    param: Optional[Param] = None


def make_call(name: str, args, id: Optional[str] = None) -> dict:
    """A parsed call: arguments as a JSON string, "id" only where the model wrote one."""
    arguments = args if isinstance(args, str) else dumps(args)
    return ({"id": id} if id else {}) | {"name": name, "arguments": arguments}


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def write(fmt: str, name: str, arguments) -> str:
    """One call as the format writes it (a history whose template drops calls, a prompt's example),
    from its parts::

        write("hermes", "f", {"x": 1})
        -> '<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
    """
    form = format_of(fmt)
    start, between, end = form.call
    if not form.param or not isinstance(arguments, dict):
        return start + name + between + dumps(arguments) + end
    param = form.param
    params = []
    for key, value in arguments.items():
        params.append(param.before.replace("{name}", key) + _value(param, value) + param.after)
    return start + name + between + param.sep.join(params) + end


def _value(param: Param, value) -> str:
    """A parameter's value as a format writes it: a string as text where the format closes it with
    a tag or quote, else JSON (Python calls: OLMo 3's ``A="v"``)."""
    if isinstance(value, str) and (param.after or param.quote):
        return param.quote + value + param.quote
    return dumps(value)


def call_from_json(obj) -> Optional[dict]:
    """``{"name", "arguments" | "parameters", "id"?}``, or OpenAI's ``{"id", "type", "function":
    {...}}`` (Falcon3) -> a call; None when it is not one."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = {"id": obj.get("id"), **obj["function"]}
    obj = {**obj, "name": obj.get("name", obj.get("tool_name"))} if isinstance(obj, dict) else obj
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        id = obj.get("id") if isinstance(obj.get("id"), str) else None
        return make_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), id)


def parse_arguments(args):
    """Tool-call arguments -> a dict where they are JSON (compact and pretty JSON compare equal),
    else as given."""
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def calls_of(value) -> Optional[list[dict]]:
    """A parsed call or list of calls (``call_from_json``) -> the calls; None unless every one is a
    call."""
    calls = [call_from_json(o) for o in (value if isinstance(value, list) else [value])]
    return calls if calls and all(calls) else None


def hold_back(text: str, markers) -> str:
    """``text`` without a tail that may be the start of one of ``markers``: hold_back("a <tool",
    ["<tool_call>"]) -> "a "."""
    n = max([k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])], default=0)
    return text[: len(text) - n]


def up_to(opener: str) -> Callable[[str], str]:
    """A ``Format.stream``: the content up to where a call begins, less a tail that may be its
    start."""
    return lambda text: text[: text.find(opener)] if opener in text else hold_back(text, [opener])


# An unclosed <tool_call> at the end (EOS right after the JSON) still counts.
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def hermes_blocks(text: str) -> list[tuple[int, int, list[dict]]]:
    """Each ``<tool_call>`` block whose body is a call or a list of calls written as JSON
    (extras/tool_formats.py reads the other families' bodies there too)."""
    found = ((m, calls_of(parse_arguments(m.group(1)))) for m in TOOL_CALL_RE.finditer(text))
    return [(m.start(), m.end(), calls) for m, calls in found if calls]


# detect(): a call written as JSON up to its name's value, {"name": " (after "tool_call_id" too:
# StepFun; in OpenAI's shape: Falcon3), maybe in a list
JSON_CALL_OPENING = (
    r'\[?\s*\{\s*(?:"tool_call_id"\s*:\s*"[^"]*",\s*)?(?:"id"\s*:\s*"[^"]*",\s*"type"\s*:\s*"function",\s*'
    r'"function"\s*:\s*\{\s*)?"(?:tool_)?name"\s*:\s*"$'
)
HERMES_CALL_RE = re.compile(r"<tool_call>\s*" + JSON_CALL_OPENING)
HERMES = Format(
    call=('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
    detect=lambda before, after: bool(HERMES_CALL_RE.search(before)),
    blocks=hermes_blocks,
    stream=up_to("<tool_call>"),
)


hooks.TOOL_FORMATS["hermes"] = HERMES


def format_names() -> list[str]:
    """The --tool-format choices: every registered format, in the order detect() tries them."""
    return list(hooks.TOOL_FORMATS)


def known_formats() -> str:
    """The registered formats, as a message names them; where Hermes is the only one, the file the
    other families' are in."""
    known = f"one of {', '.join(format_names())}"
    if len(hooks.TOOL_FORMATS) == 1:
        known += "; " + hooks.missing("every other family's format", "tool_formats")
    return known


def format_of(name: Optional[str]) -> Optional[Format]:
    """The format named ``name`` (None: no calls): the one place a format is looked up, in
    hooks.TOOL_FORMATS (Hermes here; the other families' from extras/tool_formats.py)."""
    if name is None:
        return None
    if name not in hooks.TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; use {known_formats()}")
    return hooks.TOOL_FORMATS[name]


def split_think(text: str, think, opened: bool) -> tuple[str, str, bool]:
    """(reasoning, rest, closed) for a think block at the start of the reply; unclosed, all of it is
    reasoning.

    >>> split_think("<think>hm</think>Hi", ("<think>", "</think>"), False)
    ('hm', 'Hi', True)
    """
    # an empty block written as its close alone (MiniMax M3)
    if think and not opened and text.lstrip().startswith(think[1]):
        return "", text.lstrip()[len(think[1]) :], True
    if not think or not (opened or text.lstrip().startswith(think[0])):
        return "", text, True
    if not opened:
        text = text.lstrip()[len(think[0]) :]
    reasoning, close, rest = text.partition(think[1])
    return reasoning, rest, bool(close)


def parse(fmt: Optional[str], text: str, think=None, opened: bool = False) -> dict:
    """Sampled text -> ``{"content", "reasoning", "tool_calls": [{"id"?, "name", "arguments": JSON
    str}]}``, content and reasoning stripped. A call whose body does not parse stays in the content:
    the harness sees what the model wrote. ``fmt`` None: no calls (tool_choice "none")."""
    form = format_of(fmt)
    if form and form.whole:
        return form.whole(text, False)
    reasoning, rest, _ = split_think(text, think, opened)
    kept, calls, pos = [], [], 0
    for start, end, found in form.blocks(rest) if form else []:
        kept.append(rest[pos:start])
        calls, pos = calls + found, end
    content = "".join(kept) + rest[pos:]
    return {"content": content.strip(), "reasoning": reasoning.strip(), "tool_calls": calls}


def visible(fmt: Optional[str], text: str, think=None, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) that may be streamed while ``text`` still grows: each is a prefix of
    what ``parse`` gives for any longer text. Held back: a character split across tokens, the start
    of a marker, trailing whitespace, and everything from the first call opening on (a call is sent
    whole, once parsed)."""
    text = text.rstrip("\ufffd")
    form = format_of(fmt)
    if form and form.whole:
        partial = form.whole(text, True)
        return partial["reasoning"], partial["content"]
    # the think tag may still be coming
    if think and not opened and any(tag.startswith(text.lstrip()) for tag in think):
        return "", ""
    reasoning, rest, closed = split_think(text, think, opened)
    if not closed:
        return hold_back(reasoning, [think[1]]).strip(), ""
    return reasoning.strip(), (form.stream(rest) if form else rest).strip()


def forced(fmt: str, name: Optional[str], opened=False, think=("<think>", "</think>")) -> str:
    """Text that opens a forced call (tool_choice) at the end of the prompt, and before the sampled
    text when parsing. ``name`` "": the model picks the tool; None: a reply in JSON
    (response_format); ``opened``: the prompt opened a think block, closed first. Hermes:
    '<tool_call>\\n{"name": "f", "arguments":' for "f"."""
    form = format_of(fmt)
    start, before_args, _ = form.call
    opening = form.json_reply if name is None else start + (name + before_args if name else "")
    close_reasoning = think[1] + "\n\n" if opened and think and not form.whole else ""
    # No space after the last ':': the model's own first token carries it (' {'), as the template
    # writes it.
    return close_reasoning + opening.rstrip(" ")


# A marker tag in a call's text: <tool_call>, <|tool_call|>, [TOOL_CALLS]
TAG_RE = re.compile(r"<[^<>\s]+>|\[[A-Z_]+\]")


def taught(instructions: str) -> Optional[str]:
    """The format a template's tool instructions teach: the registered format whose call opening
    (``Format.call[0]``, from its first tag on) they write the longest prefix of, whitespace aside
    (Granite's "respond only with <|tool_call|> followed by a JSON list": granite; SmolLM3's
    '<tool_call>\\n{"name": <function-name>': hermes, written further than GLM's '<tool_call>'). Ties
    go to the format registered first; None where they name none."""
    text = re.sub(r"\s+", "", instructions)
    best = None
    best_length = 0
    for name, form in hooks.TOOL_FORMATS.items():
        opening = re.sub(r"\s+", "", form.call[0])
        first = TAG_RE.match(opening)
        if first is None:
            continue
        # the longest prefix of the opening the instructions write, from its first tag on
        for length in range(len(opening), first.end() - 1, -1):
            if opening[:length] in text:
                break
        else:
            continue
        if length > best_length:
            best = name
            best_length = length
    return best


def detect(rendered: str) -> Optional[str]:
    """The format of a chat template, from its rendering of an assistant turn holding one call named
    ``SENTINEL`` with arguments ``{"llarg": "llval"}``; None when it did not render the call or in
    no known way."""
    # Kimi's templates write no name, only the call's id
    before, _, after = rendered.partition(SENTINEL)
    if "llval" not in rendered:
        return None
    found = (name for name, form in hooks.TOOL_FORMATS.items() if form.detect(before, after))
    return next(found, None)
