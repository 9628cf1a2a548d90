"""Every tool-call format but Hermes: one :class:`~lightning_lite.toolcalls.Format` each in
``FORMATS``, a comment above each entry showing how its family writes one call (the families and
their templates: docs/tool-calls.md), and the families' template quirks (``TemplateQuirks``, into
hooks.template_quirks): their dialects, the check of a template that renders calls, the places some
templates take the tool list in, and the families known by their list.

Both mistral names and both deepseek names parse either shape; they differ in how a call is forced
and detected. qwen3_coder parses as Hermes does here (``HERMES_BODIES``: both read both bodies, and
Python-dict arguments). A new format: its functions here, its entry in ``FORMATS``. Its hooks,
filled at the bottom: ``HERMES_BODIES`` in the place of the core's Hermes, then every entry of
``FORMATS`` into hooks.TOOL_FORMATS, in order: the order toolcalls.detect() tries them in, and
--tool-format lists them in."""

import ast
import hashlib
import json
import re
from dataclasses import replace
from functools import partial
from typing import Optional

from .. import hooks
from ..chat import PROBE_TOOL, call_text, probe_calls, rendered
from ..toolcalls import HERMES, Format, Param, call_from_json, calls_of, hold_back, make_call
from ..toolcalls import JSON_CALL_OPENING, TOOL_CALL_RE, detect, format_of, parse, parse_arguments
from ..toolcalls import TAG_RE, up_to

PYTHON_TAG = "<|python_tag|>"
M3 = "]<]minimax[>["
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_CLOSE = DS_CALL_END + DS_END
HARMONY_MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)

DS_UNIT = re.compile(
    rf"\s*{re.escape(DS_CALL)}(.*?){re.escape(DS_SEP)}(.*?)(?:{re.escape(DS_CALL_END)}|\Z)\s*", re.S
)
# R1: NAME\n```json\n{...}\n```
FENCED_RE = re.compile(r"\s*(\S+?)\s*```(?:json)?\s*(.*?)\s*(?:```)?\s*", re.DOTALL)
MISTRAL_NAME_RE = re.compile(r"\s*([^\[\]\s{]+)\s*(?:\[CALL_ID\]\s*([^\[\s]+)\s*)?\[ARGS\]")
SPACE = re.compile(r"\s*")
# Llama 3: calls ;- or space-separated
CALL_SEPARATORS = re.compile(r"[\s;]*")


def json_call_after(before: str) -> Optional[str]:
    """For ``detect``: the rendering before a call written as JSON (``[{"name": "``), stripped; None
    if not JSON."""
    m = re.search(JSON_CALL_OPENING, before)
    return before[: m.start()].rstrip() if m else None


def json_at(text: str, i: int):
    """(the JSON value at text[i], after whitespace; the index after it), or None."""
    try:
        return json.JSONDecoder().raw_decode(text, SPACE.match(text, i).end())
    except json.JSONDecodeError:
        return None


def json_calls(text: str, i: int):
    """A JSON call or list of calls at text[i:] -> (calls, end); None when it is not that."""
    value = json_at(text, i)
    calls = calls_of(value[0]) if value else None
    return (calls, value[1]) if calls else None


def literal_calls(text: str) -> Optional[list[dict]]:
    """A call or a list of calls written as JSON, or as a Python literal (arguments as a Python
    dict: Apriel) -> the calls; None unless every one is a call."""
    value = parse_arguments(text)
    if isinstance(value, str):
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return calls_of(value)


FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?", re.DOTALL)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def tag_body(body: str) -> Optional[list[dict]]:
    """One ``<tool_call>`` body: Hermes JSON (or a Python literal) or Qwen3-Coder's
    ``<function=N><parameter=A>V</parameter></function>`` (hermes and qwen3_coder read both; a
    parameter is a JSON value where it parses, else text). None: not a call."""
    if body.startswith(("{", "[")):
        return literal_calls(body)
    m = FUNCTION_RE.fullmatch(body)
    # anything but parameters inside: not a call
    if m and not PARAMETER_RE.sub("", m.group(2)).strip():
        params = {k.strip(): parse_arguments(v) for k, v in PARAMETER_RE.findall(m.group(2))}
        return [make_call(m.group(1).strip(), params)]


def regex_blocks(pattern: re.Pattern, read):
    """A ``Format.blocks``: each match of ``pattern`` whose group 1 ``read`` turns into calls (None:
    not calls)."""
    return lambda text: [
        (m.start(), m.end(), c) for m in pattern.finditer(text) if (c := read(m.group(1)))
    ]


def flex(text: str) -> str:
    """A regex for the literal ``text`` in which each run of whitespace may be any whitespace, or
    none."""
    return r"\s*".join(map(re.escape, re.split(r"\s+", text)))


def region(start: str, end: str) -> re.Pattern:
    """From ``start`` to ``end`` (or the end of the reply): group 1 is what is between."""
    return re.compile(flex(start) + r"(.*?)(?:" + flex(end) + r"|\Z)", re.S)


def each(unit: re.Pattern, read):
    """A region's calls: every match of ``unit`` read into one (``read(match)``, None: not a call),
    nothing else."""

    def calls(text: str) -> Optional[list[dict]]:
        found = [read(m) for m in unit.finditer(text)]
        return found if found and all(found) and not unit.sub("", text).strip() else None

    return calls


def dict_call(name: str, arguments: str, id: Optional[str] = None) -> Optional[dict]:
    args = parse_arguments(arguments)
    return make_call(name, args, id) if isinstance(args, dict) else None


def marker_blocks(marker: str, read):
    """A ``Format.blocks``: each ``marker`` followed by what ``read(text, i)`` parses into ``(calls,
    end)``."""

    def blocks(text: str):
        out, i = [], text.find(marker)
        while i >= 0:
            found = read(text, i + len(marker))
            if found:
                out.append((i, found[1], found[0]))
            i = text.find(marker, found[1] if found else i + 1)
        return out

    return blocks


def json_after(marker: str):
    """A ``Format.detect``: the template writes the call as JSON right after ``marker``."""
    return lambda before, after: (json_call_after(before) or "").endswith(marker)


def mistral_calls(text: str, i: int):
    """After ``[TOOL_CALLS]``: a JSON list (v3, Nemo) or ``NAME[CALL_ID]ID[ARGS]{...}`` (v11)."""
    m = MISTRAL_NAME_RE.match(text, i)
    if not m:
        return json_calls(text, i)
    args = json_at(text, m.end())
    if not (args and isinstance(args[0], dict)):
        return None
    return [make_call(m.group(1), args[0], m.group(2))], args[1]


def deepseek_call(m: re.Match) -> Optional[dict]:
    """R1/V3: function<sep>NAME```json{...}```; V3.1: NAME<sep>{...}"""
    name, args = m.groups()
    fenced = FENCED_RE.fullmatch(args) if name.strip() == "function" else None
    return dict_call(*(fenced.groups() if fenced else (name.strip(), args)))


def llama3_blocks(text: str):
    """Calls only when the whole reply is call JSON (``;``- or space-separated): prose with JSON in
    it is content.

    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}' -> two calls
    'Use {"name": ...}' -> none
    """
    rest, i, calls = text.strip().removeprefix(PYTHON_TAG), 0, []
    while (i := CALL_SEPARATORS.match(rest, i).end()) < len(rest):
        value = json_at(rest, i)
        # one call, or a list of them (xLAM-2)
        objs = value[0] if value and isinstance(value[0], list) else [value[0] if value else None]
        is_call = lambda o: isinstance(o, dict) and ("parameters" in o or "arguments" in o)
        found = [call_from_json(o) if is_call(o) else None for o in objs]
        if not found or not all(found):
            return []
        calls, i = calls + found, value[1]
    return [(0, len(text), calls)] if calls else []


def llama3_stream(rest: str) -> str:
    """A reply that starts like JSON may be a call: all of it waits."""
    start = rest.lstrip()
    return "" if start.startswith("{") or PYTHON_TAG.startswith(start[: len(PYTHON_TAG)]) else rest


def _join(parts: list[str]) -> str:
    return "\n\n".join(p for p in (p.strip() for p in parts) if p)


def harmony(text: str, partial: bool) -> dict:
    """gpt-oss messages ``[<|start|>assistant]<|channel|>C [to=R] ...<|message|>BODY<|end|>``: the
    analysis channel is the reasoning, a recipient (``to=functions.N``) makes a call, the rest
    (final, preambles) is the content. ``partial``: the text is still growing, so stop before the
    first call or unfinished header."""
    text = hold_back(text, HARMONY_MARKERS) if partial else text
    reasoning, content, calls = [], [], []
    segments = text.split("<|start|>")
    for k, segment in enumerate(segments):
        header, sep, body = segment.partition("<|message|>")
        # only a header (no message yet), or text the model wrote outside the format
        if not sep:
            if partial and k == len(segments) - 1:
                break
            if segment.strip() and "<|channel|>" not in segment and segment.strip() != "assistant":
                content.append(segment)
            continue
        body = re.split(r"<\|(?:end|call|return)\|>", body)[0]
        to = re.search(r"to=([^\s<]+)", header)
        channel = re.search(r"<\|channel\|>\s*([^\s<]+)", header)
        if to and partial:
            break
        args = parse_arguments(body) if to else None
        if isinstance(args, dict):
            calls.append(make_call(to.group(1).removeprefix("functions."), args))
        # a call whose body does not parse stays in the content, as the model wrote it
        elif to:
            content.append(header + sep + body)
        else:
            (reasoning if channel and channel.group(1) == "analysis" else content).append(body)
    return {"content": _join(content), "reasoning": _join(reasoning), "tool_calls": calls}


def harmony_messages(messages: list[dict]) -> list[dict]:
    """gpt-oss's template refuses content and reasoning both next to a call: they share its one
    slot, the analysis."""
    out = []
    for m in messages:
        if m.get("thinking") and m.get("tool_calls") and m["content"]:
            m = {**m, "content": "", "thinking": m["thinking"] + "\n\n" + m["content"]}
        out.append(m)
    return out


def rewritten(messages: list[dict], call, result=None) -> list[dict]:
    """The messages with each tool call (OpenAI's shape) as ``call(c)`` writes it, and each tool
    result's ``tool_call_id`` as ``result(id)`` does (None: as it is)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [call(c) for c in m["tool_calls"]]}
        if m["role"] == "tool" and result is not None:
            m = {**m, "tool_call_id": result(m["tool_call_id"])}
        out.append(m)
    return out


def kimi_messages(messages: list[dict]) -> list[dict]:
    """Kimi's templates name a call by its id, functions.NAME:K for the conversation's K-th call:
    other ids are written so, a call's and its result's alike."""
    named = {}

    def named_call(c: dict) -> dict:
        if not c["id"].startswith("functions."):
            named.setdefault(c["id"], f"functions.{c['function']['name']}:{len(named)}")
        return {**c, "id": named.get(c["id"], c["id"])}

    return rewritten(messages, named_call, lambda id: named.get(id, id))


# ----------------------------------------------------------------------------- templates' quirks
# What some templates want of the messages besides OpenAI's shape (TemplateQuirks.dialects):
# chat.probe finds which a template needs, and every conversation is written in them; and the check
# of a template that renders calls (TemplateQuirks.calls_kept).


def short_id(s: str) -> str:
    """``s`` as 9 alphanumerics (Mistral's templates accept no other tool-call id): kept when it is
    one, otherwise a hash of it, so a call and its result keep matching ids. The Anthropic API hands
    the proxy's ids out as ``toolu_`` + the id: they come back as the id the model sampled."""
    core = s.removeprefix("toolu_")
    if len(core) == 9 and core.isalnum():
        return core
    n = int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return "".join(alphabet[(n >> (6 * i)) % 62] for i in range(9))


def short_ids(messages: list[dict]) -> list[dict]:
    """Every call id as 9 alphanumerics (``short_id``; Mistral)."""
    return rewritten(messages, lambda c: {**c, "id": short_id(c["id"])}, short_id)


def string_args(messages: list[dict]) -> list[dict]:
    """Each call's arguments as a JSON string: DeepSeek-R1's templates write them as given."""

    def with_string_args(c: dict) -> dict:
        arguments = json.dumps(c["function"]["arguments"], ensure_ascii=False)
        return {**c, "function": {**c["function"], "arguments": arguments}}

    return rewritten(messages, with_string_args)


def merge_roles(messages: list[dict]) -> list[dict]:
    """Two messages in a row of one role as one, but for tool results and calls: Gemma's and
    Mistral's templates want roles to alternate (and the Hermes fallback writes tool results as user
    turns). A turn of tool results is not merged into the turn before it: a result with no call
    before it stays the template's to refuse."""
    out = []
    for m in messages:
        results = m["role"] == "tool" or m["content"].startswith("<tool_response>")
        mergeable = not results and not m.get("tool_calls")
        previous = out[-1] if out else {}
        if mergeable and previous.get("role") == m["role"] and not previous.get("tool_calls"):
            out[-1] = {**previous, "content": previous["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def system_in_user(messages: list[dict]) -> list[dict]:
    """A leading system message written at the start of the first user message, as Gemma 2's model
    card says to: its template refuses the system role, and those of Mistral 7B v0.1's kin want user
    and assistant to alternate from the first message. Harnesses send a system prompt, and the Hermes
    fallback writes the tool list into one.

        [system "Be brief.", user "Hi."] -> [user "Be brief.\n\nHi."]
    """
    starts_with_system = len(messages) > 1 and messages[0]["role"] == "system"
    if not starts_with_system or messages[1]["role"] != "user":
        return messages
    system, user = messages[0], messages[1]
    merged = {**user, "content": system["content"] + "\n\n" + user["content"]}
    return [merged, *messages[2:]]


def tool_names(messages: list[dict]) -> list[dict]:
    """Each tool result with the name of the call it answers (FunctionGemma's template writes it)."""
    names = {t["id"]: t["function"]["name"] for m in messages for t in m.get("tool_calls") or ()}
    out = []
    for m in messages:
        if m["role"] == "tool":
            m = {**m, "name": names.get(m.get("tool_call_id"), "")}
        out.append(m)
    return out


MISTRAL = Format(
    call=('[TOOL_CALLS][{"name": "', '", "arguments": ', "}]"),
    detect=json_after("[TOOL_CALLS]"),
    blocks=marker_blocks("[TOOL_CALLS]", mistral_calls),
    stream=up_to("[TOOL_CALLS]"),
)
DEEPSEEK = Format(
    call=(DS_BEGIN + DS_CALL + "function" + DS_SEP, "\n```json\n", "\n```" + DS_CLOSE),
    detect=lambda before, after: before.endswith(DS_SEP),
    blocks=regex_blocks(region(DS_BEGIN, DS_END), each(DS_UNIT, deepseek_call)),
    stream=up_to(DS_BEGIN),
)


def tagged(start: str, between: str, end: str, param: tuple[str, str], block=("", "")) -> Format:
    """Calls as tags, a tag a parameter (GLM, MiniMax, DeepSeek-V3.2 and V4, MiniCPM): ``block[0]``,
    then for each call ``start`` NAME ``between`` its parameters ``end``, then ``block[1]``. A
    parameter: ``param[0]`` with its key for {name}, its value (JSON where it parses, else text; one
    newline around it is the tags'), ``param[1]``. A run of whitespace in them may be any, or none:
    GLM 4.5's
    ``<tool_call>f\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>`` and GLM
    5's, without the newlines, are both f({"city": "Paris"})."""
    key_start, key_end = param[0].split("{name}")
    # DeepSeek's string="true" | "false" after the key: any attributes
    key_end = r'"[^>]*>' if key_end.startswith('"') else flex(key_end.rstrip())
    # a close that names the key again (MiniMax M3's </city>)
    close = flex(param[1].lstrip()).replace(re.escape("{name}"), r"\1")
    param_re = re.compile(flex(key_start) + r"(.+?)" + key_end + r"\n?(.*?)\n?" + close, re.S)
    call_re = re.compile(
        flex(start) + r"([^\s<>\"'=]+)" + flex(between) + r"(.*?)" + flex(end), re.S
    )

    def value(text: str):
        """A parameter's value; MiniMax M3 writes an object's as its keys' tags, a list's as <item>
        tags."""
        inner = param_re.findall(text) if "{name}" in param[1] else []
        if not inner or param_re.sub("", text).strip():
            return parse_arguments(text)
        if {k for k, _ in inner} == {"item"}:
            return [value(v) for _, v in inner]
        return {k.strip(): value(v) for k, v in inner}

    def read(m: re.Match) -> Optional[dict]:
        params = {k.strip(): value(v) for k, v in param_re.findall(m.group(2))}
        return None if param_re.sub("", m.group(2)).strip() else make_call(m.group(1), params)

    opening = re.compile(flex(block[0] + start) + r"\Z")
    detect = lambda before, after: bool(
        opening.search(before) and re.match(flex(between + key_start), after)
    )
    whole = region(*block) if block[0] else re.compile(f"({call_re.pattern})", re.S)
    call, stream = (block[0] + start, between, end + block[1]), up_to((block[0] or start).strip())
    blocks = regex_blocks(whole, each(call_re, read))
    return Format(call, detect, blocks, stream, param=Param(*param))


def glm(prefix: str = "", suffix: str = "", sep: str = "", block: bool = False) -> Format:
    """GLM's calls (Ring, Laguna, HyperCLOVAX too), its tags with a ``prefix`` (LongCat) or
    ``suffix`` and a ``sep`` tag after the name inside a ``block`` (Hy3)."""
    tag = lambda name, close="": f"<{close}{prefix}{name}{suffix}>"
    key = tag("arg_key") + "{name}" + tag("arg_key", "/") + "\n" + tag("arg_value")
    blocked = (tag("tool_calls") + "\n", "\n" + tag("tool_calls", "/")) if block else ("", "")
    between, end = (tag(sep) if sep else "") + "\n", "\n" + tag("tool_call", "/")
    return tagged(tag("tool_call"), between, end, (key, tag("arg_value", "/") + "\n"), blocked)


def dsml(block: str) -> Format:
    """DeepSeek-V3.2's (``function_calls``) and V4's (``tool_calls``) DSML."""
    param = ('<｜DSML｜parameter name="{name}" string="true">', "</｜DSML｜parameter>\n")
    blocked = (f"<｜DSML｜{block}>\n", f"</｜DSML｜{block}>")
    return tagged('<｜DSML｜invoke name="', '">\n', "</｜DSML｜invoke>\n", param, blocked)


def json_tagged(start: str, end: str = "", listed: bool = False) -> Format:
    """Calls as JSON (a list of them where ``listed``) after ``start``, up to ``end``: Nemotron's
    ``<TOOLCALL>[{"name": N, "arguments": {...}}]</TOOLCALL>``; the arguments may be a Python dict
    (Apriel)."""

    read = lambda body: literal_calls(body.strip())
    left, right = ("[", "]") if listed else ("", "")
    call = (start + left + '{"name": "', '", "arguments": ', "}" + right + end)
    blocks = regex_blocks(region(start, end), read) if end else marker_blocks(start, json_calls)
    return Format(call, json_after(start.strip()), blocks, up_to(start.strip()))


class _JsonConstants(ast.NodeTransformer):
    """JSON's true, false and null as Python's constants: OLMo 3's templates write them into Python
    calls."""

    def visit_Name(self, node):
        constants = {"true": True, "false": False, "null": None}
        return ast.Constant(constants[node.id]) if node.id in constants else node


def pythonic_calls(body: str) -> Optional[list[dict]]:
    """``[f(a=1), g()]``, or one call a line, with literal keyword arguments (OLMo 3, LFM2.5) ->
    calls, else None."""
    try:
        source = body.strip().removeprefix("```python").removesuffix("```")
        tree = _JsonConstants().visit(ast.parse(source))
        nodes = [n.value for n in tree.body if isinstance(n, ast.Expr)]
        exprs = [e for n in nodes for e in (n.elts if isinstance(n, ast.List) else [n])]
        calls = [
            make_call(e.func.id, {k.arg: ast.literal_eval(k.value) for k in e.keywords})
            for e in exprs
            if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and not e.args
        ]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return calls if calls and len(calls) == len(exprs) and len(nodes) == len(tree.body) else None


def pythonic(start: str, end: str, listed: bool = False, sep: str = ", ") -> Format:
    """Python calls between ``start`` and ``end`` (in a list where ``listed``); a forced call's
    arguments are JSON values, which Python reads too (JSON's constants as ``_JsonConstants`` reads
    them)."""
    detect = lambda before, after: bool(re.search(flex(start) + r"\[?\Z", before))
    left, right = ("[", "]") if listed else ("", "")
    call = (start + left, "(", ")" + right + end)
    blocks = regex_blocks(region(start, end), pythonic_calls)
    return Format(call, detect, blocks, up_to(start), param=Param("{name}=", "", sep))


# Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>, strings quoted by <|"|>, keys
# bare
GEMMA4_CALL = re.compile(r"<\|tool_call>call:([^{\s]+)(\{.*?\})(?:<tool_call\|>|\Z)", re.S)
GEMMA4_JSON = re.compile(r'<\|"\|>(.*?)<\|"\|>|(?<=[{,])\s*([A-Za-z_][\w.-]*)\s*(?=:)', re.S)


# FunctionGemma: <start_function_call>call:NAME{key:<escape>text<escape>,n:1}<end_function_call>
FUNCTIONGEMMA_CALL = re.compile(
    r"<start_function_call>call:([^{\s]+)(\{.*?\})(?:<end_function_call>|\Z)", re.S
)
FUNCTIONGEMMA_JSON = re.compile(
    r"<escape>(.*?)<escape>|(?<=[{,])\s*([A-Za-z_][\w.-]*)\s*(?=:)", re.S
)


def functiongemma_call(m: re.Match) -> Optional[dict]:
    """A call's arguments as JSON: each <escape>-quoted string and each bare key quoted."""

    def quote(t: re.Match) -> str:
        if t.group(1) is not None:
            return json.dumps(t.group(1))
        return json.dumps(t.group(2))

    return dict_call(m.group(1), FUNCTIONGEMMA_JSON.sub(quote, m.group(2)))


def gemma4_call(m: re.Match) -> Optional[dict]:
    quote = lambda t: json.dumps(t.group(1) if t.group(1) is not None else t.group(2))
    return dict_call(m.group(1), GEMMA4_JSON.sub(quote, m.group(2)))


# Kimi K2: the NAME is in the call's id, functions.NAME:K
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CLOSE, KIMI_OPEN = "<|tool_call_end|>" + KIMI_END, KIMI_BEGIN + "<|tool_call_begin|>"
KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(functions\.([^\s:<]+):\d+)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
    re.S,
)
kimi_call = lambda m: dict_call(m.group(2), m.group(3), m.group(1))
# Hunyuan: <tool_calls><tool_call>NAME\n```json\n{...}\n```</tool_call></tool_calls>
HUNYUAN_CALL = re.compile(
    r"\s*<tool_call>\s*(\S+?)\s*```(?:json)?\s*(.*?)\s*```\s*</tool_call>\s*", re.S
)
hunyuan_call = lambda m: dict_call(m.group(1), m.group(2))


# Functionary v3.1, Kanana: <function=NAME>{...}</function>
FUNCTIONARY = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.S)
functionary = regex_blocks(
    re.compile(f"((?:{FUNCTIONARY.pattern})+)", re.S),
    each(FUNCTIONARY, lambda m: dict_call(*m.groups())),
)
CODER_PARAM = ("<parameter={name}>\n", "\n</parameter>\n")
SEED_BLOCK = ("<seed:tool_call>\n", "\n</seed:tool_call>")
# GLM-4-9B-chat and GLM-4-0414: the name on a line of its own, the arguments as JSON after it; the
# calls end the reply, text may come before them
GLM4_NAME = re.compile(r"\s*([A-Za-z_][\w.-]*)\n")
# what a GLM-4 reply's last lines may still grow into calls from: a name, its line's end, JSON
GLM4_MAYBE = re.compile(r"\s*[A-Za-z_]?[\w.-]*(\n\s*(\{.*)?)?\Z", re.S)


def glm4_calls(text: str, pos: int) -> list[dict]:
    """The calls ``text[pos:]`` is, each a name on its line with a JSON object after it; [] where
    it is not only calls."""
    calls = []
    while pos < len(text.rstrip()):
        name = GLM4_NAME.match(text, pos)
        if name is None:
            return []
        value = json_at(text, name.end())
        if value is None or not isinstance(value[0], dict):
            return []
        calls.append(make_call(name.group(1), value[0]))
        pos = value[1]
    return calls


def line_starts(text: str) -> list[int]:
    """Where each line of ``text`` starts."""
    return [0] + [m.end() for m in re.finditer("\n", text)]


def glm4_blocks(text: str) -> list[tuple[int, int, list[dict]]]:
    """The calls that end the reply, from the first line where all that follows is calls."""
    for start in line_starts(text):
        calls = glm4_calls(text, start)
        if calls:
            return [(start, len(text), calls)]
    return []


def glm4_stream(text: str) -> str:
    """The text before the first line from which all that follows may still grow into calls."""
    for start in line_starts(text):
        if GLM4_MAYBE.match(text, start):
            return text[:start]
    return text


# tagged()'s param and block of MiniMax M2 and M3, its param of Solar
MINIMAX_PARAM = ('<parameter name="{name}">', "</parameter>\n")
MINIMAX_BLOCK = ("<minimax:tool_call>\n", "</minimax:tool_call>")
MINIMAX_M3 = (M3 + "<{name}>", M3 + "</{name}>"), (M3 + "<tool_call>\n", M3 + "</tool_call>")
SOLAR_PARAM = ("<|tool_arg:start|>{name}<|tool_arg:value|>", "<|tool_arg:end|>\n")
# Hermes as other families write it too: a <tool_call> body may be Qwen3-Coder's, a call's arguments a
# Python dict. It takes the core's place in hooks.TOOL_FORMATS (below).
HERMES_BODIES = replace(HERMES, blocks=regex_blocks(TOOL_CALL_RE, tag_body))
# A format that parses as another does (either of its shapes) differs in how a call is forced and
# detected.
FORMATS = {
    # Qwen3-Coder, Qwen3.5:
    # <tool_call>\n<function=N>\n<parameter=A>\nV\n</parameter>\n</function>\n</tool_call>
    "qwen3_coder": replace(
        HERMES_BODIES,
        call=("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>"),
        detect=lambda before, after: bool(re.search(r"<tool_call>\s*<function=\Z", before)),
        param=Param(*CODER_PARAM),
    ),
    # Llama 3.1-3.3: {"name": N, "parameters": {...}}, the whole reply, maybe after <|python_tag|>
    "llama3": Format(
        call=('{"name": "', '", "parameters": ', "}"),
        # JSON after <|python_tag|>, after the header, or first in the reply
        detect=lambda before, after: (
            (head := json_call_after(before)) == ""
            or (head or "").endswith((PYTHON_TAG, "<|end_header_id|>"))
        ),
        blocks=llama3_blocks,
        stream=llama3_stream,
    ),
    # Mistral v3, Nemo, Small 3.1: [TOOL_CALLS][{"name": N, "arguments": {...}, "id": "abcdefghi"}]
    "mistral": MISTRAL,
    # Small 3.2, Magistral, Devstral: [TOOL_CALLS]N[CALL_ID]ID[ARGS]{...} ([CALL_ID]ID optional)
    "mistral_v11": replace(
        MISTRAL,
        call=("[TOOL_CALLS]", "[ARGS]", ""),
        detect=lambda before, after: before.endswith("[TOOL_CALLS]"),
    ),
    # DeepSeek R1, V3:
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```
    # <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    "deepseek": DEEPSEEK,
    # DeepSeek V3.1:
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    "deepseek_v31": replace(
        DEEPSEEK,
        call=(DS_BEGIN + DS_CALL, DS_SEP, DS_CLOSE),
        detect=lambda before, after: after.startswith(DS_SEP),
    ),
    # gpt-oss: <|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>commentary
    # to=functions.N <|constrain|>json<|message|>{...}<|call|>
    "harmony": Format(
        call=("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "<|call|>"),
        detect=lambda before, after: before.endswith("to=functions."),
        whole=harmony,
        json_reply="<|channel|>final<|message|>",
        messages=harmony_messages,
    ),
    # Granite 3.x: <|tool_call|>[{"name": N, "arguments": {...}}]
    "granite": json_tagged("<|tool_call|>", listed=True),
    # GLM 4.5-5.2: <tool_call>N<arg_key>A</arg_key><arg_value>V</arg_value></tool_call>; a tag a
    # parameter (tagged) as LongCat, MiniMax M2 and M3 (<invoke name=N>), DeepSeek-V3.2 and V4
    # (DSML), MiniCPM, Solar, Hy3 below
    "glm": glm(),
    "longcat": glm(prefix="longcat_"),
    "minimax": tagged('<invoke name="', '">\n', "</invoke>\n", MINIMAX_PARAM, MINIMAX_BLOCK),
    "minimax_m3": tagged(M3 + '<invoke name="', '">', M3 + "</invoke>\n", *MINIMAX_M3),
    "deepseek_v32": dsml("function_calls"),
    "deepseek_v4": dsml("tool_calls"),
    "minicpm": tagged(
        '<function name="', '">', "</function>", ('<param name="{name}">', "</param>")
    ),
    "solar": tagged("<|tool_call:start|>", "\n", "\n<|tool_call:end|>", SOLAR_PARAM),
    "hy3_preview": glm(sep="tool_sep", block=True),
    "hy3": glm(suffix=":opensource", sep="tool_sep", block=True),
    "hunyuan": Format(
        call=("<tool_calls><tool_call>", "\n```json\n", "\n```</tool_call></tool_calls>"),
        detect=lambda before, after: (
            before.endswith("<tool_calls><tool_call>") and "```json" in after
        ),
        blocks=regex_blocks(
            region("<tool_calls>", "</tool_calls>"), each(HUNYUAN_CALL, hunyuan_call)
        ),
        stream=up_to("<tool_calls>"),
    ),
    # JSON after a marker (json_tagged): Nemotron <TOOLCALL>[...]</TOOLCALL>, GigaChat, Jamba,
    # Intern-S1, LongCat, Command-R7B
    "nemotron": json_tagged("<TOOLCALL>", "</TOOLCALL>", listed=True),
    "gigachat": json_tagged("<|function_call|>"),
    "tool_calls_json": json_tagged("<tool_calls>", "</tool_calls>", listed=True),
    "intern": json_tagged("<|action_start|><|plugin|>\n", "<|action_end|>"),
    "longcat_json": json_tagged("<longcat_tool_call>\n", "\n</longcat_tool_call>"),
    "command_r": json_tagged("<|START_ACTION|>", "<|END_ACTION|>", listed=True),
    # Python calls: OLMo 3 <function_calls>N(a="v")</function_calls>, LFM2.5 [N(a="v")], MiniCPM3
    "olmo3": pythonic("<function_calls>", "</function_calls>"),
    "lfm2": pythonic("<|tool_call_start|>", "<|tool_call_end|>", listed=True),
    "minicpm3": pythonic("<|tool_call_start|>\n```python\n", "\n```\n<|tool_call_end|>", sep=","),
    "step3": tagged(
        '<｜tool_call_begin>｜>\nfunction<｜tool_sep｜><steptml:invoke name="',
        '">',
        "</steptml:invoke><｜tool_call_end｜>\n",
        ('<steptml:parameter name="{name}">', "</steptml:parameter>"),
        ("<｜tool_calls_begin｜>\n", "<｜tool_calls_end｜>"),
    ),
    # Gemma 4: <|tool_call>call:N{a:<|"|>v<|"|>}<tool_call|>
    "gemma4": Format(
        call=("<|tool_call>call:", "{", "}<tool_call|>"),
        param=Param("{name}:", "", ",", '<|"|>'),
        detect=lambda before, after: before.endswith("<|tool_call>call:"),
        blocks=regex_blocks(
            re.compile(f"({GEMMA4_CALL.pattern})", re.S), each(GEMMA4_CALL, gemma4_call)
        ),
        stream=up_to("<|tool_call>"),
    ),
    # Kimi K2: the name in the call's id, functions.N:K
    "kimi": Format(
        call=(KIMI_OPEN + "functions.", ":0<|tool_call_argument_begin|>", KIMI_CLOSE),
        detect=lambda before, after: KIMI_OPEN in before,
        blocks=regex_blocks(region(KIMI_BEGIN, KIMI_END), each(KIMI_CALL, kimi_call)),
        stream=up_to(KIMI_BEGIN),
        messages=kimi_messages,
    ),
    # Functionary v3.1, Kanana: <function=N>{...}</function>
    "functionary": Format(
        call=("<function=", ">", "</function>"),
        detect=lambda before, after: before.endswith("<function=") and after.startswith(">{"),
        blocks=functionary,
        stream=up_to("<function="),
    ),
    # Qwen3-Coder's calls in Seed-OSS's block, and without one (FrogBoss)
    "seed_oss": tagged("<function=", ">\n", "\n</function>", CODER_PARAM, SEED_BLOCK),
    "function_tags": tagged("<function=", ">\n", "\n</function>", CODER_PARAM),
    # FunctionGemma: <start_function_call>call:N{a:<escape>v<escape>}<end_function_call>
    "functiongemma": Format(
        call=("<start_function_call>call:", "{", "}<end_function_call>"),
        param=Param("{name}:", "", ",", "<escape>"),
        detect=lambda before, after: before.endswith("<start_function_call>call:"),
        blocks=regex_blocks(
            re.compile(f"({FUNCTIONGEMMA_CALL.pattern})", re.S),
            each(FUNCTIONGEMMA_CALL, functiongemma_call),
        ),
        stream=up_to("<start_function_call>"),
    ),
    # The families whose templates render the tool list but no call (TOOL_FAMILIES below
    # names each by its list). Phi-4 mini: <|tool_call|>[{"name": N, "arguments": {...}}]<|/tool_call|>
    "phi4": json_tagged("<|tool_call|>", "<|/tool_call|>", listed=True),
    # Nemotron Mini: <toolcall> {"name": N, "arguments": {...}} </toolcall>
    "nemotron_mini": json_tagged("<toolcall> ", " </toolcall>"),
    # GLM-4-9B-chat, GLM-4-0414: N\n{...} on lines of their own at the reply's end (its template
    # writes N as the turn's metadata)
    "glm4": Format(
        call=("", "\n", ""),
        detect=lambda before, after: False,
        blocks=glm4_blocks,
        stream=glm4_stream,
    ),
}


def system_tools(messages: list[dict], tools: list[dict], as_json: bool = False):
    """The tool list in the system message's ``tools`` (a system message of its own where there is
    none): a list as GLM-4-9B-chat's template reads it, a JSON string as Phi-4's (``as_json``)."""
    listed = tools
    if as_json:
        listed = json.dumps(tools, ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": listed}] + messages[1:], {}
    return [{"role": "system", "content": "", "tools": listed}] + messages, {}


def available_tools(messages: list[dict], tools: list[dict]):
    """The tool list as ``tools`` and as ``available_tools``: some Granite 3.3 templates write
    their tool instructions for the one and the list for the other."""
    return messages, {"tools": tools, "available_tools": tools}


def system_message_tools(messages: list[dict], tools: list[dict]):
    """The tool list as ``tools``, beside a system message (an empty one where there is none):
    some templates write the list inside the system message's turn (Virtuoso)."""
    if messages and messages[0]["role"] == "system":
        return messages, {"tools": tools}
    return [{"role": "system", "content": ""}] + messages, {"tools": tools}


def tools_list(messages: list[dict], tools: list[dict]):
    """The tool list as the JSON text ``tools_list`` (FrontiersMind's Lumma takes it so)."""
    return messages, {"tools_list": json.dumps(tools, ensure_ascii=False)}


def unwrapped_tools(messages: list[dict], tools: list[dict]):
    """Each tool as its function alone (``{"name", "description", "parameters"}``)."""
    return messages, {"tools": [t["function"] for t in tools]}


# The format a family's models write where its template renders the list but neither a call nor
# instructions that name a format: a marker of the family's list -> the format
# (TemplateQuirks.family).
TOOL_FAMILIES = {
    # LFM2, LFM2.5: List of tools: <|tool_list_start|>[...]<|tool_list_end|>
    "<|tool_list_start|>": "lfm2",
    # LFM2.5 and its finetunes: List of tools: [...] (the markers gone from the template)
    "List of tools: [": "lfm2",
    # Granite 3.0: <|start_of_role|>available_tools<|end_of_role|>[...], without instructions
    "available_tools<|end_of_role|>": "granite",
    # Kimi K2: <|im_system|>tool_declare<|im_middle|>[...]
    "tool_declare": "kimi",
    # Phi-4 mini and multimodal: <|system|>...<|tool|>[...]<|/tool|>
    "<|tool|>": "phi4",
    # Nemotron Mini: <tool> {...} </tool>
    "<tool> ": "nemotron_mini",
    # GLM-4-9B-chat, GLM-4-0414: # 可用工具 ("available tools"), then one "## N" a tool
    "# 可用工具": "glm4",
    # Llama 3.2's Python list, as FrontiersMind's Lumma and baseten's templates ask for it:
    # [func_name1(params_name1=params_value1, ...)] (python_list: extras/tool_formats.py's last block)
    "(params_name": "python_list",
}


def special_format(specials) -> Optional[str]:
    """The format a tokenizer's special tokens name: the one whose first tag is one of them, with
    the most of its tags among them (Phi-4's <|tool_call|> and <|/tool_call|>: phi4, not granite).
    Ties go to the format registered first; None where none's first tag is special."""
    special = set(specials)
    best = None
    best_count = 0
    for name, form in hooks.TOOL_FORMATS.items():
        tags = TAG_RE.findall(form.call[0] + form.call[2])
        if not tags or tags[0] not in special:
            continue
        count = sum(1 for tag in tags if tag in special)
        if count > best_count:
            best = name
            best_count = count
    return best


class TemplateQuirks(hooks.NoTemplateQuirks):
    """The families' template quirks, as chat.probe tries them (hooks.NoTemplateQuirks says what
    each is for)."""

    # in the order tried (system_in_user after merge_roles: a template that wants both gets two
    # system messages in a row as one first)
    dialects = {
        f.__name__: f for f in [short_ids, string_args, merge_roles, tool_names, system_in_user]
    }
    # where templates take the tool list instead of the tools argument, in the order tried
    places = [
        system_tools,
        # Phi-4's: a JSON string
        partial(system_tools, as_json=True),
        available_tools,
        unwrapped_tools,
        system_message_tools,
        tools_list,
    ]

    def tool_place(self, info, lists):
        for place in [info.tools_at, *self.places]:
            tried = replace(info, tools_at=place)
            if lists(tried):
                return tried, True
        return info, False

    def in_dialect(self, info, attempt):
        more = [name for name in self.dialects if name not in info.dialects]
        for tried in [info] + [replace(info, dialects=[*info.dialects, name]) for name in more]:
            result = attempt(tried)
            if result is not None:
                return tried, result
        return info, None

    def calls_kept(self, tok, info, call: str) -> bool:
        """Does the template write a call after a tool result as it wrote the first (``call``), so
        that the history keeps every call in the format? DeepSeek-R1's drops the opening there.
        Each call is read up to the turn close, as the model's EOS ends it. A format that rewrites
        the messages (Kimi's call ids) reads its calls as it writes them: nothing to compare
        there."""
        fmt = detect(call)
        if not fmt or format_of(fmt).messages:
            return True
        head = rendered(tok, info, probe_calls(), [PROBE_TOOL], True)
        twice = rendered(tok, info, probe_calls(rounds=2), [PROBE_TOOL], False)
        if head is None or twice is None:
            return False
        close = info.turn_close.strip()

        def calls(text: str) -> int:
            # GigaChat 3 closes the content with the turn close before a call: up to the next one
            if close:
                text = next((piece for piece in text.split(close) if piece.strip()), "")
            return len(parse(fmt, text)["tool_calls"])

        return calls(call) > 0 and calls(call_text(head, twice)) > 0

    def family(self, instructions: str, specials: list) -> Optional[str]:
        """The family's format by a marker of its list (TOOL_FAMILIES), else by the tokenizer's
        special tokens (``special_format``)."""
        for marker, family in TOOL_FAMILIES.items():
            if marker in instructions:
                return family
        return special_format(specials)


hooks.TOOL_FORMATS["hermes"] = HERMES_BODIES
hooks.TOOL_FORMATS.update(FORMATS)
hooks.template_quirks = TemplateQuirks()


# ------------------------------------------------------------------ the formats once refused
# The families whose templates render calls in formats read nowhere above (issue 48): Llama 4,
# Apertus, Solar Open 100B, GigaChat 3, HyperCLOVAX SEED Think 14B, the Python lists of Typhoon 2.1
# and baseten's Llama 3.2, Functionary v3.2 and Step-Audio R1.1. Each is detected from the call its
# own template renders. They are tried after every format above, so that none of them takes a
# template that one of those reads.

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
TOOLS_PREFIX = "<|tools_prefix|>"
TOOLS_SUFFIX = "<|tools_suffix|>"
GIGACHAT3_CALL = "function call<|role_sep|>"
MESSAGE_SEP = "<|message_sep|>"
HYPERCLOVAX_CALL = "-> tool/function_call"
SOLAR_OPEN_BLOCK = ("<|tool_calls|>", "<|calls|>")
SOLAR_OPEN_CALL = re.compile(
    r"\s*<\|tool_call:begin\|>([^<]*)<\|tool_call:name\|>([^<\s]+)<\|tool_call:args\|>"
    r"(.*?)(?:<\|tool_call:end\|>|\Z)\s*",
    re.S,
)
STEP_AUDIO_CALL = re.compile(
    r"\s*<\|CALL_START\|>function\n([^\n<]+)\n(.*?)(?:<\|CALL_END\|>|\Z)\s*", re.S
)
# Functionary v3.2: what follows >>> is a recipient, a function's name or "all" (the content)
FUNCTIONARY_RECIPIENT = re.compile(r"([A-Za-z_][\w.-]*)\n")
# Python calls at the start of a line or right after a tag (Typhoon's, baseten's template)
LIST_OPENS_REPLY = re.compile(r"(?:\A|[\n>])\s*\[\Z")
# A value written bare in a Python call (baseten's template writes strings without quotes): up to
# the next comma or the call's close.
BARE_VALUE = re.compile(
    r"(?<=[(,])(\s*[A-Za-z_]\w*\s*=\s*)([^\s\"'\[\]{}(),=][^\"'\[\]{}(),=]*?)(?=\s*[,)])"
)
PYTHON_LITERAL = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|True|False|None")


def json_call_run(text: str, i: int):
    """JSON calls one after another at text[i:] (Llama 4's template writes them with nothing
    between; ``;`` or whitespace may be) -> (calls, end); None when there is none."""
    calls = []
    end = i
    while True:
        found = json_calls(text, CALL_SEPARATORS.match(text, end).end())
        if not found:
            break
        calls = calls + found[0]
        end = found[1]
    if not calls:
        return None
    return calls, end


def closed_by(read, close: str):
    """A ``marker_blocks`` reader: what ``read`` parses, and ``close`` with it where it follows
    (the call's own close, which the model may or may not write before its EOS)."""

    def calls(text: str, i: int):
        found = read(text, i)
        if not found:
            return None
        after = SPACE.match(text, found[1]).end()
        if text.startswith(close, after):
            return found[0], after + len(close)
        return found

    return calls


def led_by(blocks, lead: str):
    """``blocks`` (a ``Format.blocks``), each taking in ``lead`` (a regex) right before it: what the
    template writes between the content and a call (GigaChat 3 closes the content with
    <|message_sep|>, HyperCLOVAX with <|im_end|> and a new turn's header)."""
    ending = re.compile(f"(?:{lead})\\Z")

    def with_lead(text: str):
        out = []
        previous_end = 0
        for start, end, calls in blocks(text):
            # the lead is searched for between the block before and this one
            m = ending.search(text, previous_end, start)
            begin = start
            if m:
                begin = m.start()
            out.append((begin, end, calls))
            previous_end = end
        return out

    return with_lead


def streamed_up_to(*openers: str):
    """A ``Format.stream``: the content up to the first of ``openers``, less a tail that may be the
    start of one."""

    def stream(text: str) -> str:
        for opener in openers:
            text = up_to(opener)(text)
        return text

    return stream


def llama4_blocks(text: str):
    """Llama 4's template writes the content inside <|python_start|>...<|python_end|> and the calls
    after it, as JSON: each run of JSON calls after <|python_end|> is a block, and the
    <|python_start|> that opened the content before it another, without calls. Python calls inside
    the tags (``[f(a=1)]``, as vLLM's llama4_pythonic reads Llama 4) are calls too."""
    python = regex_blocks(region(PYTHON_START, PYTHON_END), pythonic_calls)(text)
    if python:
        return python
    out = []
    previous_end = 0
    for start, end, calls in marker_blocks(PYTHON_END, json_call_run)(text):
        opener = text.rfind(PYTHON_START, previous_end, start)
        if opener >= 0:
            out.append((opener, opener + len(PYTHON_START), []))
        out.append((start, end, calls))
        previous_end = end
    return out


def apertus_calls(text: str, i: int):
    """``[{"NAME": {...}}, ...]`` at text[i:] (Apertus: each call an object of one key, its name)
    -> (calls, end); None when it is not that."""
    value = json_at(text, i)
    if not value or not isinstance(value[0], list) or not value[0]:
        return None
    calls = []
    for obj in value[0]:
        if not isinstance(obj, dict) or len(obj) != 1:
            return None
        name, arguments = next(iter(obj.items()))
        if not isinstance(arguments, dict):
            return None
        calls.append(make_call(name, arguments))
    return calls, value[1]


def solar_open_call(m: re.Match) -> Optional[dict]:
    """One Solar Open call: its id (kept where the model wrote one), name and JSON arguments."""
    id, name, arguments = m.groups()
    return dict_call(name, arguments, id.strip() or None)


def quoted_bare_values(body: str) -> str:
    """Python calls with each value written bare (``city=Paris``, as baseten's template writes a
    string) quoted as a string, unless it is a number or a constant."""

    def quoted(m: re.Match) -> str:
        value = m.group(2).strip()
        if PYTHON_LITERAL.fullmatch(value):
            return m.group(0)
        return m.group(1) + json.dumps(value)

    return BARE_VALUE.sub(quoted, body)


def closing_bracket(text: str, start: int) -> int:
    """Where the bracket at text[start] is closed, brackets and quoted strings inside skipped; -1
    while it is not."""
    depth = 0
    quote = ""
    k = start
    while k < len(text):
        c = text[k]
        if quote and c == "\\":
            # the escaped character is skipped with it
            k += 1
        elif quote and c == quote:
            quote = ""
        elif not quote and c in "\"'":
            quote = c
        elif not quote and c in "([{":
            depth += 1
        elif not quote and c in ")]}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return -1


def leading_call_list(text: str):
    """A Python list of calls that opens ``text`` (after whitespace) -> (calls, where it ends); None
    when it does not open with one. A value written bare, as baseten's template writes a string,
    reads as that string."""
    start = SPACE.match(text).end()
    if not text.startswith("[", start):
        return None
    close = closing_bracket(text, start)
    if close < 0:
        return None
    body = text[start : close + 1]
    calls = pythonic_calls(body) or pythonic_calls(quoted_bare_values(body))
    if not calls:
        return None
    return calls, close + 1


def python_list_blocks(text: str):
    """Calls only where a Python list of them opens the reply, ``[f(a="v"), g()]`` (Typhoon 2.1,
    baseten's Llama 3.2; Typhoon's template writes the content after it): a list later in prose is
    content."""
    found = leading_call_list(text)
    if not found:
        return []
    calls, end = found
    return [(0, end, calls)]


def python_list_stream(rest: str) -> str:
    """A reply that starts as a list may be calls: nothing streams until the list closes as calls,
    then the content after them."""
    if not rest.lstrip().startswith("["):
        return rest
    found = leading_call_list(rest)
    if not found:
        return ""
    return rest[found[1] :]


def functionary_v32_segment(text: str, i: int):
    """What follows a >>> (the generation prompt writes the first): "all" and the content, or a
    function's name and its JSON arguments -> ([] or [the call], where it ends); None: neither."""
    if text.startswith("all\n", i):
        return [], i + len("all\n")
    m = FUNCTIONARY_RECIPIENT.match(text, i)
    if not m:
        return None
    arguments = json_at(text, m.end())
    if not arguments or not isinstance(arguments[0], dict):
        return None
    return [make_call(m.group(1), arguments[0])], arguments[1]


def functionary_v32_blocks(text: str):
    """Functionary v3.2: ``all\\nCONTENT>>>NAME\\n{...}>>>NAME\\n{...}``, the first recipient
    right after the generation prompt's >>>. Each recipient is a block ("all": without calls)."""
    out = []
    first_end = 0
    first = functionary_v32_segment(text, SPACE.match(text).end())
    if first:
        calls, first_end = first
        out.append((0, first_end, calls))
    later = marker_blocks(">>>", functionary_v32_segment)(text)
    # a >>> inside the first call's arguments is theirs
    return out + [block for block in later if block[0] >= first_end]


def functionary_v32_stream(rest: str) -> str:
    """The content streams after "all", up to the next >>>; a reply that opens with a name is a
    call, and nothing of it streams."""
    opening = rest.lstrip()
    if opening.startswith("all\n"):
        return up_to(">>>")(opening[len("all\n") :])
    return ""


REFUSED_FORMATS = {
    # Llama 4: <|python_start|>CONTENT<|python_end|>{"name": N, "parameters": {...}}
    "llama4": Format(
        call=(PYTHON_START + PYTHON_END + '{"name": "', '", "parameters": ', "}"),
        detect=json_after(PYTHON_END),
        blocks=llama4_blocks,
        stream=streamed_up_to(PYTHON_START, PYTHON_END),
    ),
    # Apertus: <|tools_prefix|>[{"N": {...}}]<|tools_suffix|>
    "apertus": Format(
        call=(TOOLS_PREFIX + '[{"', '": ', "}]" + TOOLS_SUFFIX),
        detect=lambda before, after: bool(
            re.search(re.escape(TOOLS_PREFIX) + r'\s*\[\s*\{\s*"\Z', before)
            and after.startswith('":')
        ),
        blocks=marker_blocks(TOOLS_PREFIX, closed_by(apertus_calls, TOOLS_SUFFIX)),
        stream=up_to(TOOLS_PREFIX),
    ),
    # Solar Open 100B: <|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>N<|tool_call:args|>{...}
    # <|tool_call:end|><|calls|> (a forced call's id left empty: the proxy gives it one)
    "solar_open": Format(
        call=(
            SOLAR_OPEN_BLOCK[0] + "<|tool_call:begin|><|tool_call:name|>",
            "<|tool_call:args|>",
            "<|tool_call:end|>" + SOLAR_OPEN_BLOCK[1],
        ),
        detect=lambda before, after: (
            before.endswith("<|tool_call:name|>") and after.startswith("<|tool_call:args|>")
        ),
        blocks=regex_blocks(region(*SOLAR_OPEN_BLOCK), each(SOLAR_OPEN_CALL, solar_open_call)),
        stream=up_to(SOLAR_OPEN_BLOCK[0]),
    ),
    # GigaChat 3: CONTENT<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": N, "arguments": {...}}
    "gigachat3": Format(
        call=(MESSAGE_SEP + "\n\n" + GIGACHAT3_CALL + '\n{"name": "', '", "arguments": ', "}"),
        detect=json_after(GIGACHAT3_CALL),
        blocks=led_by(
            marker_blocks(GIGACHAT3_CALL, closed_by(json_calls, MESSAGE_SEP)),
            re.escape(MESSAGE_SEP) + r"\s*",
        ),
        stream=streamed_up_to(MESSAGE_SEP, GIGACHAT3_CALL),
    ),
    # HyperCLOVAX SEED Think 14B: CONTENT<|im_end|>\n<|im_start|>assistant -> tool/function_call\n
    # [{"name": N, "arguments": {...}}]<|im_end|> (without content: right after the generation
    # prompt's <|im_start|>assistant)
    "hyperclovax": Format(
        call=(" " + HYPERCLOVAX_CALL + '\n[{"name": "', '", "arguments": ', "}]"),
        detect=json_after(HYPERCLOVAX_CALL),
        blocks=led_by(
            marker_blocks(
                HYPERCLOVAX_CALL, closed_by(closed_by(json_calls, "<|im_end|>"), "<|stop|>")
            ),
            r"(?:<\|im_end\|>\s*<\|im_start\|>assistant)?\s*",
        ),
        stream=streamed_up_to("<|im_end|>", HYPERCLOVAX_CALL),
    ),
    # Typhoon 2.1, baseten's Llama 3.2: [N(a="v"), M()] opening the reply (Typhoon's template writes
    # the content after it, baseten's a string bare: a=v)
    "python_list": Format(
        call=("[", "(", ")]"),
        detect=lambda before, after: (
            bool(LIST_OPENS_REPLY.search(before)) and after.startswith("(")
        ),
        blocks=python_list_blocks,
        stream=python_list_stream,
        param=Param("{name}=", "", ", "),
    ),
    # Functionary v3.2: (>>> in the generation prompt) all\nCONTENT>>>N\n{...}>>>M\n{...}
    "functionary_v32": Format(
        call=("", "\n", ""),
        # The generation prompt wrote the >>>: the call opens the reply with the name.
        detect=lambda before, after: before.strip() in ("", ">>>") and after.startswith("\n{"),
        blocks=functionary_v32_blocks,
        stream=functionary_v32_stream,
    ),
    # Step-Audio R1.1: <|CALL_START|>function\nN\n{...}<|CALL_END|>
    "step_audio": Format(
        call=("<|CALL_START|>function\n", "\n", "<|CALL_END|>"),
        detect=lambda before, after: before.endswith("<|CALL_START|>function\n"),
        blocks=regex_blocks(
            re.compile(f"((?:{STEP_AUDIO_CALL.pattern})+)", re.S),
            each(STEP_AUDIO_CALL, lambda m: dict_call(*m.groups())),
        ),
        stream=up_to("<|CALL_START|>"),
    ),
}

FORMATS.update(REFUSED_FORMATS)
hooks.TOOL_FORMATS.update(REFUSED_FORMATS)
