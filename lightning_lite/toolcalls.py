"""Tool-call and reasoning formats of the model families: sampled text -> content, reasoning, tool calls.

The text is what the model sampled (chat.Renderer.sampled_text, after a forced call's opening). Each family
was taught its own way of writing a call; ``detect`` reads which from how a chat template renders one call:

    hermes        <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>          Qwen2.5, Qwen3, SmolLM, Hermes
    qwen3_coder   <tool_call>\\n<function=N>\\n<parameter=A>\\nV\\n</parameter>\\n</function>\\n</tool_call>   Qwen3-Coder, Qwen3.5
    llama3        {"name": N, "parameters": {...}}  (the whole reply, maybe after <|python_tag|>)   Llama 3.1-3.3
    mistral       [TOOL_CALLS][{"name": N, "arguments": {...}, "id": "abcdefghi"}]   Mistral v3, Nemo, Small 3.1
    mistral_v11   [TOOL_CALLS]N[CALL_ID]ID[ARGS]{...}  ([CALL_ID]ID optional)          Small 3.2, Magistral, Devstral
    deepseek      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>  R1, V3
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>  V3.1
    harmony       <|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>  gpt-oss
    granite       <|tool_call|>[{"name": N, "arguments": {...}}]                         Granite 3.x

Both mistral names and both deepseek names parse either shape; they differ in ``forced`` (and ``detect``).
Reasoning: harmony's analysis channel, else a think-tag pair at the start of the reply (``think``: ``<think>``,
Magistral's ``[THINK]``); ``opened``: the generation prompt opened it, the text starts inside (Qwen3.5, DeepSeek-R1).
"""

from __future__ import annotations

import json
import re
from typing import Optional

FORMATS = (
    "hermes",
    "qwen3_coder",
    "llama3",
    "mistral",
    "mistral_v11",
    "deepseek",
    "deepseek_v31",
    "harmony",
    "granite",
)
SENTINEL = (
    "LLSENTINEL7f3a"  # detect(): the name of the call rendered, with arguments {"llarg": "llval"}
)

PYTHON_TAG = "<|python_tag|>"
DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
# Where a call begins: content streams up to there (llama3 and harmony decide otherwise).
OPENERS = {
    "hermes": "<tool_call>",
    "qwen3_coder": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "mistral_v11": "[TOOL_CALLS]",
    "deepseek": DS_BEGIN,
    "deepseek_v31": DS_BEGIN,
    "granite": "<|tool_call|>",
}
HARMONY_MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)

TOOL_CALL_RE = re.compile(
    r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL
)  # unclosed at the end still counts
FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?", re.DOTALL)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
DEEPSEEK_RE = re.compile(re.escape(DS_BEGIN) + r"(.*?)(?:" + re.escape(DS_END) + r"|$)", re.DOTALL)
FENCED_RE = re.compile(
    r"\s*(\S+?)\s*```(?:json)?\s*(.*?)\s*(?:```)?\s*", re.DOTALL
)  # R1: NAME\n```json\n{...}\n```
MISTRAL_NAME_RE = re.compile(r"\s*([^\[\]\s{]+)\s*(?:\[CALL_ID\]\s*([^\[\s]+)\s*)?\[ARGS\]")
_JSON = json.JSONDecoder()
SPACE, CALL_SEPARATORS = (
    re.compile(r"\s*"),
    re.compile(r"[\s;]*"),
)  # llama3: calls ;- or space-separated


def _call(name: str, args, id: Optional[str] = None) -> dict:
    call = {
        "name": name,
        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
    }
    return {"id": id, **call} if id else call


def _from_obj(obj) -> Optional[dict]:
    """``{"name", "arguments" | "parameters", "id"?}`` -> a call; None when it is not one."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else None)


def _json_at(text: str, i: int):
    """(the JSON value starting at text[i], after whitespace; the index after it), or None."""
    try:
        return _JSON.raw_decode(text, SPACE.match(text, i).end())
    except json.JSONDecodeError:
        return None


def parse_arguments(args):
    """Tool-call arguments -> a dict where they are JSON (so compact and pretty JSON compare equal); also a
    Qwen3-Coder parameter, which is text: a JSON value where it parses (numbers, objects), else the string."""
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def _tag_body(body: str) -> Optional[dict]:
    """One ``<tool_call>`` body: Hermes JSON or Qwen3-Coder's ``<function=...>`` (either format reads both)."""
    if body.startswith("{"):
        return _from_obj(parse_arguments(body))
    m = FUNCTION_RE.fullmatch(body)
    if (
        not m or PARAMETER_RE.sub("", m.group(2)).strip()
    ):  # anything but parameters inside: not a call
        return None
    return _call(
        m.group(1).strip(),
        {k.strip(): parse_arguments(v) for k, v in PARAMETER_RE.findall(m.group(2))},
    )


def _deepseek(region: str) -> Optional[list[dict]]:
    """The calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``; None unless all parse."""
    first, *parts = region.split(DS_CALL)
    calls = []
    for part in parts:
        body, _, after = part.partition(DS_CALL_END)
        name, sep, args = body.partition(DS_SEP)
        if name.strip() == "function" and (
            fenced := FENCED_RE.fullmatch(args)
        ):  # R1/V3; V3.1 has NAME<sep>{...}
            name, args = fenced.groups()
        obj = parse_arguments(args)
        if after.strip() or not sep or not isinstance(obj, dict):
            return None
        calls.append(_call(name.strip(), obj))
    return calls if calls and not first.strip() else None


def _json_calls(text: str, i: int):
    """A JSON call or list of calls at text[i:] -> (calls, end), None when it is not that."""
    got = _json_at(text, i)
    if not got:
        return None
    calls = [_from_obj(o) for o in (got[0] if isinstance(got[0], list) else [got[0]])]
    return (calls, got[1]) if calls and all(calls) else None


def _mistral(text: str, i: int):
    """After ``[TOOL_CALLS]``: a JSON list (v3, Nemo) or ``NAME[CALL_ID]ID[ARGS]{...}`` (v11)."""
    m = MISTRAL_NAME_RE.match(text, i)
    if not m:
        return _json_calls(text, i)
    got = _json_at(text, m.end())
    return (
        ([_call(m.group(1), got[0], m.group(2))], got[1])
        if got and isinstance(got[0], dict)
        else None
    )


def _blocks(fmt: str, text: str) -> list[tuple[int, int, list[dict]]]:
    """``(start, end, calls)`` of every call block in ``text`` that parses; the content is the text around them."""
    if fmt in ("hermes", "qwen3_coder"):
        return [
            (m.start(), m.end(), [c])
            for m in TOOL_CALL_RE.finditer(text)
            if (c := _tag_body(m.group(1)))
        ]
    if fmt in ("deepseek", "deepseek_v31"):
        return [
            (m.start(), m.end(), cs)
            for m in DEEPSEEK_RE.finditer(text)
            if (cs := _deepseek(m.group(1)))
        ]
    marker, read, out = OPENERS[fmt], (_mistral if fmt.startswith("mistral") else _json_calls), []
    i = text.find(marker)
    while i >= 0:
        got = read(text, i + len(marker))
        if got:
            out.append((i, got[1], got[0]))
        i = text.find(marker, got[1] if got else i + 1)
    return out


def _llama3(text: str) -> tuple[str, list[dict]]:
    """Calls only when the whole reply is call JSON (``;``- or space-separated): prose with JSON in it is content."""
    s, i, calls = text.strip().removeprefix(PYTHON_TAG), 0, []
    while True:
        i = CALL_SEPARATORS.match(s, i).end()
        if i == len(s):
            return ("", calls) if calls else (text.strip(), [])
        got = _json_at(s, i)
        call = (
            got
            and isinstance(got[0], dict)
            and ("parameters" in got[0] or "arguments" in got[0])
            and _from_obj(got[0])
        )
        if not call:
            return text.strip(), []
        calls.append(call)
        i = got[1]


def hold_back(text: str, markers) -> str:
    """``text`` without a tail that may be the start of one of ``markers``."""
    n = max([k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])], default=0)
    return text[: len(text) - n]


def _think(text: str, think, opened: bool) -> tuple[str, str, bool]:
    """(reasoning, rest, closed) for a think block at the start of the reply; unclosed, all of it is reasoning."""
    if not think or not (opened or text.lstrip().startswith(think[0])):
        return "", text, True
    if not opened:
        text = text.lstrip()[len(think[0]) :]
    reasoning, close, rest = text.partition(think[1])
    return reasoning, rest, bool(close)


def _join(parts: list[str]) -> str:
    return "\n\n".join(p for p in (p.strip() for p in parts) if p)


def _harmony(text: str, partial: bool) -> dict:
    """gpt-oss messages ``[<|start|>assistant]<|channel|>C [to=R] ...<|message|>BODY<|end|>``: the analysis channel
    is the reasoning, a recipient (``to=functions.N``) makes a call, the rest (final, preambles) is the content.
    ``partial``: the text is still growing, so stop before the first call or unfinished header."""
    text = hold_back(text, HARMONY_MARKERS) if partial else text
    reasoning, content, calls = [], [], []
    segments = text.split("<|start|>")
    for k, seg in enumerate(segments):
        header, sep, body = seg.partition("<|message|>")
        if not sep:  # only a header (no message yet), or text the model wrote outside the format
            if partial and k == len(segments) - 1:
                break
            if seg.strip() and "<|channel|>" not in seg and seg.strip() != "assistant":
                content.append(seg)
            continue
        body = re.split(r"<\|(?:end|call|return)\|>", body)[0]
        to, channel = (
            re.search(r"to=([^\s<]+)", header),
            re.search(r"<\|channel\|>\s*([^\s<]+)", header),
        )
        if to:
            if partial:
                break
            args = parse_arguments(body)
            if isinstance(args, dict):
                calls.append(_call(to.group(1).removeprefix("functions."), args))
            else:  # a call whose body does not parse stays in the content, as the model wrote it
                content.append(header + sep + body)
        else:
            (reasoning if channel and channel.group(1) == "analysis" else content).append(body)
    return {"content": _join(content), "reasoning": _join(reasoning), "tool_calls": calls}


def parse(
    fmt: Optional[str], text: str, think: Optional[tuple[str, str]] = None, opened: bool = False
) -> dict:
    """Sampled text -> ``{"content", "reasoning", "tool_calls": [{"id"?, "name", "arguments": JSON str}]}``, content
    and reasoning stripped, "id" only where the model wrote one. A call whose body does not parse stays in the
    content: the harness sees what the model wrote. ``fmt`` None: no calls (tool_choice "none")."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "harmony":
        return _harmony(text, partial=False)
    reasoning, rest, _ = _think(text, think, opened)
    if fmt is None:
        content, calls = rest.strip(), []
    elif fmt == "llama3":
        content, calls = _llama3(rest)
    else:
        pos, kept, calls = 0, [], []
        for start, end, cs in _blocks(fmt, rest):
            kept.append(rest[pos:start])
            pos = end
            calls += cs
        content = ("".join(kept) + rest[pos:]).strip()
    return {"content": content, "reasoning": reasoning.strip(), "tool_calls": calls}


def visible(
    fmt: Optional[str], text: str, think: Optional[tuple[str, str]] = None, opened: bool = False
) -> tuple[str, str]:
    """(reasoning, content) that may be streamed while ``text`` still grows: each is a prefix of what ``parse``
    gives for any longer text. Held back: a character split across tokens, the start of a marker, trailing
    whitespace, and everything from the first call opening on (a call is sent whole, once parsed)."""
    text = text.rstrip("\ufffd")
    if fmt == "harmony":
        got = _harmony(text, partial=True)
        return got["reasoning"], got["content"]
    if think and not opened and think[0].startswith(text.lstrip()):
        return "", ""  # the think tag may still be coming
    reasoning, rest, closed = _think(text, think, opened)
    if not closed:
        return hold_back(reasoning, [think[1]]).strip(), ""
    if fmt == "llama3":  # a reply that starts like JSON may be a call: all of it waits
        s = rest.lstrip()
        return reasoning.strip(), "" if s.startswith("{") or PYTHON_TAG.startswith(
            s[: len(PYTHON_TAG)]
        ) else rest.strip()
    if fmt is None:
        return reasoning.strip(), rest.strip()
    cut = rest.find(OPENERS[fmt])
    return reasoning.strip(), (rest[:cut] if cut >= 0 else hold_back(rest, [OPENERS[fmt]])).strip()


def forced(
    fmt: str,
    name: Optional[str],
    opened: bool = False,
    think: Optional[tuple[str, str]] = ("<think>", "</think>"),
) -> str:
    """Text that opens a forced call (tool_choice), at the end of the prompt (not trained: the model did not sample
    it) and before the sampled text when parsing. ``name`` "" lets the model pick the tool ("required"), None opens
    a reply in JSON (response_format: gpt-oss's final channel); with ``opened`` (the prompt opened a think block) it
    closes the reasoning first."""
    opening = (
        ("<|channel|>final<|message|>" if fmt == "harmony" else "")
        if name is None
        else {
            "hermes": '<tool_call>\n{"name": "' + (name + '", "arguments": ' if name else ""),
            "qwen3_coder": "<tool_call>\n<function=" + (name + ">\n" if name else ""),
            "llama3": '{"name": "' + (name + '", "parameters": ' if name else ""),
            "mistral": '[TOOL_CALLS][{"name": "' + (name + '", "arguments": ' if name else ""),
            "mistral_v11": "[TOOL_CALLS]" + (name + "[ARGS]" if name else ""),
            "deepseek": DS_BEGIN
            + DS_CALL
            + "function"
            + DS_SEP
            + (name + "\n```json\n" if name else ""),
            "deepseek_v31": DS_BEGIN + DS_CALL + (name + DS_SEP if name else ""),
            "harmony": "<|channel|>commentary to=functions."
            + (name + " <|constrain|>json<|message|>" if name else ""),
            "granite": '<|tool_call|>[{"name": "' + (name + '", "arguments": ' if name else ""),
        }[fmt]
    )
    # No space after the last ':': the model's own first token carries it (' {'), as the template writes it; a
    # space here made the 135M model write two, and the template's rendering of the turn then differs.
    return (think[1] + "\n\n" if opened and think and fmt != "harmony" else "") + opening.rstrip(
        " "
    )


def detect(rendered: str) -> Optional[str]:
    """The format of a chat template, from its rendering of an assistant turn holding one call named
    ``SENTINEL`` with arguments ``{"llarg": "llval"}`` (the whole conversation, or only what follows the
    generation prompt); None when it did not render the call or in no known way."""
    i = rendered.find(SENTINEL)
    if i < 0 or "llval" not in rendered[i:]:
        return None
    before, after = rendered[:i], rendered[i + len(SENTINEL) :]
    if after.startswith(DS_SEP):
        return "deepseek_v31"
    json_call = re.search(
        r'\[?\s*\{\s*"name"\s*:\s*"$', before
    )  # a JSON call: which marker comes before it?
    if not json_call:
        markers = (
            ("to=functions.", "harmony"),
            ("<function=", "qwen3_coder"),
            (DS_SEP, "deepseek"),
            ("[TOOL_CALLS]", "mistral_v11"),
        )
        return next((fmt for marker, fmt in markers if before.endswith(marker)), None)
    head = before[: json_call.start()].rstrip()
    markers = (
        ("<tool_call>", "hermes"),
        ("[TOOL_CALLS]", "mistral"),
        ("<|tool_call|>", "granite"),
        (PYTHON_TAG, "llama3"),
        ("<|end_header_id|>", "llama3"),
    )
    # nothing before the JSON: it starts the rendered reply (llama3)
    return next(
        (fmt for marker, fmt in markers if head.endswith(marker)), None if head else "llama3"
    )


def think_tags(template_source: str) -> Optional[tuple[str, str]]:
    """The think-tag pair a chat template uses, None when it has none."""
    if "[THINK]" in template_source:
        return ("[THINK]", "[/THINK]")
    return (
        ("<think>", "</think>")
        if "<think>" in template_source or "</think>" in template_source
        else None
    )
