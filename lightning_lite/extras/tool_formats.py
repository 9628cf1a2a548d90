"""Every tool-call format but Hermes: one :class:`~lightning_lite.toolcalls.Format` each in ``FORMATS``, the table
toolcalls.py looks a format up in (its one hook). How each family writes one call:

    qwen3_coder   <tool_call>\\n<function=N>\\n<parameter=A>\\nV\\n</parameter>\\n</function>\\n</tool_call>   Qwen3-Coder, Qwen3.5
    llama3        {"name": N, "parameters": {...}}  (the whole reply, maybe after <|python_tag|>)   Llama 3.1-3.3
    mistral       [TOOL_CALLS][{"name": N, "arguments": {...}, "id": "abcdefghi"}]   Mistral v3, Nemo, Small 3.1
    mistral_v11   [TOOL_CALLS]N[CALL_ID]ID[ARGS]{...}  ([CALL_ID]ID optional)          Small 3.2, Magistral, Devstral
    deepseek      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>  R1, V3
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>  V3.1
    harmony       <|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>  gpt-oss
    granite       <|tool_call|>[{"name": N, "arguments": {...}}]                         Granite 3.x

Both mistral names and both deepseek names parse either shape; they differ in how a call is forced and detected.
qwen3_coder parses as Hermes does (both read both bodies). A new format: its functions here, its entry in ``FORMATS``, its name in ``toolcalls.FORMATS``.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Optional

from ..toolcalls import HERMES, Format, call_from_json, hold_back, make_call, parse_arguments, up_to

PYTHON_TAG = "<|python_tag|>"
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_CLOSE = DS_CALL_END + DS_END
HARMONY_MARKERS = (
    "<|start|> <|channel|> <|message|> <|constrain|> <|end|> <|call|> <|return|>".split()
)

DEEPSEEK_RE = re.compile(re.escape(DS_BEGIN) + r"(.*?)(?:" + re.escape(DS_END) + r"|$)", re.DOTALL)
# R1: NAME\n```json\n{...}\n```
FENCED_RE = re.compile(r"\s*(\S+?)\s*```(?:json)?\s*(.*?)\s*(?:```)?\s*", re.DOTALL)
MISTRAL_NAME_RE = re.compile(r"\s*([^\[\]\s{]+)\s*(?:\[CALL_ID\]\s*([^\[\s]+)\s*)?\[ARGS\]")
SPACE = re.compile(r"\s*")
# Llama 3: calls ;- or space-separated
CALL_SEPARATORS = re.compile(r"[\s;]*")


def json_call_after(before: str) -> Optional[str]:
    """For ``detect``: the rendering before a call written as JSON (``[{"name": "``), stripped; None if not JSON."""
    m = re.search(r'\[?\s*\{\s*"name"\s*:\s*"$', before)
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
    if not value:
        return None
    calls = [call_from_json(o) for o in (value[0] if isinstance(value[0], list) else [value[0]])]
    return (calls, value[1]) if calls and all(calls) else None


def regex_blocks(pattern: re.Pattern, read):
    """A ``Format.blocks``: each match of ``pattern`` whose group 1 ``read`` turns into calls (None: not calls)."""
    return lambda text: [
        (m.start(), m.end(), c) for m in pattern.finditer(text) if (c := read(m.group(1)))
    ]


def marker_blocks(marker: str, read):
    """A ``Format.blocks``: each ``marker`` followed by what ``read(text, i)`` parses into ``(calls, end)``."""

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


def deepseek_calls(region: str) -> Optional[list[dict]]:
    """The calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``; None unless all parse."""
    first, *parts = region.split(DS_CALL)
    calls = []
    for part in parts:
        body, _, after = part.partition(DS_CALL_END)
        name, sep, args = body.partition(DS_SEP)
        # R1/V3: function<sep>NAME```json{...}```; V3.1: NAME<sep>{...}
        if name.strip() == "function" and (fenced := FENCED_RE.fullmatch(args)):
            name, args = fenced.groups()
        obj = parse_arguments(args)
        if after.strip() or not sep or not isinstance(obj, dict):
            return None
        calls.append(make_call(name.strip(), obj))
    return calls if calls and not first.strip() else None


def llama3_blocks(text: str):
    """Calls only when the whole reply is call JSON (``;``- or space-separated): prose with JSON in it is content.

    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}' -> two calls; 'Use {"name": ...}' -> none."""
    rest, i, calls = text.strip().removeprefix(PYTHON_TAG), 0, []
    while (i := CALL_SEPARATORS.match(rest, i).end()) < len(rest):
        value = json_at(rest, i)
        obj = value[0] if value else None
        is_call = isinstance(obj, dict) and ("parameters" in obj or "arguments" in obj)
        call = is_call and call_from_json(obj)
        if not call:
            return []
        calls, i = calls + [call], value[1]
    return [(0, len(text), calls)] if calls else []


def llama3_stream(rest: str) -> str:
    """A reply that starts like JSON may be a call: all of it waits."""
    start = rest.lstrip()
    return "" if start.startswith("{") or PYTHON_TAG.startswith(start[: len(PYTHON_TAG)]) else rest


def _join(parts: list[str]) -> str:
    return "\n\n".join(p for p in (p.strip() for p in parts) if p)


def harmony(text: str, partial: bool) -> dict:
    """gpt-oss messages ``[<|start|>assistant]<|channel|>C [to=R] ...<|message|>BODY<|end|>``: the analysis channel
    is the reasoning, a recipient (``to=functions.N``) makes a call, the rest (final, preambles) is the content.
    ``partial``: the text is still growing, so stop before the first call or unfinished header."""
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


def harmony_message(message: dict, rendered: dict) -> dict:
    """gpt-oss's template refuses content and reasoning both next to a call: they share its one slot, the analysis."""
    if message.get("reasoning") and message.get("tool_calls") and message["content"]:
        thinking = message["reasoning"] + "\n\n" + message["content"]
        return {**rendered, "content": "", "thinking": thinking}
    return rendered


MISTRAL = Format(
    call=('[TOOL_CALLS][{"name": "', '", "arguments": ', "}]"),
    detect=json_after("[TOOL_CALLS]"),
    blocks=marker_blocks("[TOOL_CALLS]", mistral_calls),
    stream=up_to("[TOOL_CALLS]"),
)
DEEPSEEK = Format(
    call=(DS_BEGIN + DS_CALL + "function" + DS_SEP, "\n```json\n", "\n```" + DS_CLOSE),
    detect=lambda before, after: before.endswith(DS_SEP),
    blocks=regex_blocks(DEEPSEEK_RE, deepseek_calls),
    stream=up_to(DS_BEGIN),
)
# A format that parses as another does (either of its shapes) differs in how a call is forced and detected.
FORMATS = {
    "qwen3_coder": replace(
        HERMES,
        call=("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>"),
        detect=lambda before, after: before.endswith("<function="),
    ),
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
    "mistral": MISTRAL,
    "mistral_v11": replace(
        MISTRAL,
        call=("[TOOL_CALLS]", "[ARGS]", ""),
        detect=lambda before, after: before.endswith("[TOOL_CALLS]"),
    ),
    "deepseek": DEEPSEEK,
    "deepseek_v31": replace(
        DEEPSEEK,
        call=(DS_BEGIN + DS_CALL, DS_SEP, DS_CLOSE),
        detect=lambda before, after: after.startswith(DS_SEP),
    ),
    "harmony": Format(
        call=("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", "<|call|>"),
        detect=lambda before, after: before.endswith("to=functions."),
        whole=harmony,
        json_reply="<|channel|>final<|message|>",
        adjust=harmony_message,
    ),
    "granite": Format(
        call=('<|tool_call|>[{"name": "', '", "arguments": ', "}]"),
        detect=json_after("<|tool_call|>"),
        blocks=marker_blocks("<|tool_call|>", json_calls),
        stream=up_to("<|tool_call|>"),
    ),
}
