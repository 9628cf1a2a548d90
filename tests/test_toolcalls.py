"""toolcalls.py without a model: every family's tool-call and reasoning format parsed from text and from token
ids, streamed safely (visible), forced, and detected from the fixture chat templates (tests/fixtures/templates)."""

import copy
import json
import os

import pytest

from lightning_lite.chat import think_tags
from lightning_lite.toolcalls import (
    SENTINEL,
    detect,
    forced,
    format_names,
    format_of,
    parse,
    visible,
)

# every registered format (conftest loaded extras/tool_formats.py), in detection order
FORMATS = format_names()

TEMPLATES = os.path.join(os.path.dirname(__file__), "fixtures", "templates")
THINK = ("<think>", "</think>")
B, C, S, E, F = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
BEFORE = (
    "Let me check, café."  # content before the call (non-ASCII: a character split across tokens)
)

# Per format, written by hand in the family's shape: a reply with content and the call get_weather({"city": "Paris"})
# (llama3: the whole reply is the call), two calls a({"x": 1}) and b({}), and a call that does not parse.
ONE = {
    "hermes": BEFORE
    + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": BEFORE
    + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": BEFORE
    + '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]',
    "mistral_v11": BEFORE + '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "deepseek": BEFORE
    + B
    + C
    + "function"
    + S
    + 'get_weather\n```json\n{"city": "Paris"}\n```'
    + E
    + F,
    "deepseek_v31": BEFORE + B + C + "get_weather" + S + '{"city": "Paris"}' + E + F,
    "harmony": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
    + BEFORE
    + '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
    "granite": BEFORE + '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
TWO = {
    "hermes": '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>",
    "llama3": '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "aaaaaaaa1"}, {"name": "b", "arguments": {}, "id": "bbbbbbbb2"}]',
    "mistral_v11": '[TOOL_CALLS]a[CALL_ID]aaaaaaaa1[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]bbbbbbbb2[ARGS]{}',
    "deepseek": B
    + C
    + "function"
    + S
    + 'a\n```json\n{"x": 1}\n```'
    + E
    + C
    + "function"
    + S
    + "b\n```json\n{}\n```"
    + E
    + F,
    "deepseek_v31": B + C + "a" + S + '{"x": 1}' + E + C + "b" + S + "{}" + E + F,
    "harmony": '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|><|start|>assistant to=functions.b<|channel|>commentary json<|message|>{}',
    "granite": '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
}
BAD = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=get_weather>\ncity: Paris\n</function>\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
    "mistral_v11": 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
    "deepseek": "Let me check."
    + B
    + C
    + "function"
    + S
    + 'get_weather\n```json\n{"city": \n```'
    + E
    + F,
    "deepseek_v31": "Let me check." + B + C + "get_weather" + S + '{"city"' + E + F,
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ',
    "granite": 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}',
}
# What the model writes after forced(fmt, "get_weather") and after forced(fmt, "") (it picks the tool itself).
CONTINUE = {
    "hermes": (
        '{"city": "Paris"}}\n</tool_call>',
        'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    "qwen3_coder": (
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    ),
    "llama3": ('{"city": "Paris"}}', 'get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": (
        '{"city": "Paris"}, "id": "abcdefghi"}]',
        'get_weather", "arguments": {"city": "Paris"}}]',
    ),
    "mistral_v11": ('{"city": "Paris"}', 'get_weather[ARGS]{"city": "Paris"}'),
    "deepseek": (
        '{"city": "Paris"}\n```' + E + F,
        'get_weather\n```json\n{"city": "Paris"}\n```' + E + F,
    ),
    "deepseek_v31": ('{"city": "Paris"}' + E + F, "get_weather" + S + '{"city": "Paris"}' + E + F),
    "harmony": ('{"city": "Paris"}', 'get_weather <|constrain|>json<|message|>{"city": "Paris"}'),
    "granite": ('{"city": "Paris"}}]', 'get_weather", "arguments": {"city": "Paris"}}]'),
}

# The families whose calls are JSON after a marker, Python, Gemma 4's, Kimi's and Hunyuan's
Q = '<|"|>'
ESC = "<escape>"
KIMI = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
KC = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
HY = "<tool_call>{}\n```json\n{}\n```</tool_call>"
SO = "<|tool_calls|>{}<|calls|>"
SC = "<|tool_call:begin|><|tool_call:name|>{}<|tool_call:args|>{}<|tool_call:end|>"
MORE = {
    # fmt: (ONE's call, TWO, BAD)
    "nemotron": (
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>',
        '<TOOLCALL>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</TOOLCALL>',
        'Let me check.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": }]</TOOLCALL>',
    ),
    "gigachat": (
        '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '<|function_call|>{"name": "a", "arguments": {"x": 1}}<|function_call|>{"name": "b", "arguments": {}}',
        'Let me check.<|function_call|>{"name": "get_weather", "arguments": {"city": ',
    ),
    "tool_calls_json": (
        '<tool_calls>[{"name": "get_weather", "arguments": {\'city\': \'Paris\'}}]</tool_calls>',
        '<tool_calls>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_calls>',
        'Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city"}]</tool_calls>',
    ),
    "intern": (
        '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>',
        '<|action_start|><|plugin|>\n[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]<|action_end|>',
        'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {<|action_end|>',
    ),
    "longcat_json": (
        '<longcat_tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</longcat_tool_call>',
        '<longcat_tool_call>\n[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]\n</longcat_tool_call>',
        'Let me check.<longcat_tool_call>\n{"name": "get_weather"\n</longcat_tool_call>',
    ),
    "olmo3": (
        '<function_calls>get_weather(city="Paris")</function_calls>',
        "<function_calls>a(x=1)\nb()</function_calls>",
        'Let me check.<function_calls>get_weather(city="Paris"</function_calls>',
    ),
    "lfm2": (
        "<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>",
        "<|tool_call_start|>[a(x=1), b()]<|tool_call_end|>",
        "Let me check.<|tool_call_start|>[get_weather(city=Paris)]<|tool_call_end|>",
    ),
    "gemma4": (
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>",
        "<|tool_call>call:a{x:1}<tool_call|><|tool_call>call:b{}<tool_call|>",
        f"Let me check.<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>",
    ),
    "kimi": (
        KIMI.format(KC.format("get_weather", 0, '{"city": "Paris"}')),
        KIMI.format(KC.format("a", 0, '{"x": 1}') + KC.format("b", 1, "{}")),
        "Let me check." + KIMI.format(KC.format("get_weather", 0, '{"city": ')),
    ),
    "command_r": (
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>',
        '<|START_ACTION|>[{"tool_name": "a", "parameters": {"x": 1}}, {"tool_name": "b", "parameters": {}}]<|END_ACTION|>',
        'Let me check.<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city"}]<|END_ACTION|>',
    ),
    "minicpm3": (
        '<|tool_call_start|>\n```python\nget_weather(city="Paris")\n```\n<|tool_call_end|>',
        "<|tool_call_start|>\n```python\na(x=1)\nb()\n```\n<|tool_call_end|>",
        "Let me check.<|tool_call_start|>\n```python\nget_weather(city=)\n```\n<|tool_call_end|>",
    ),
    "functionary": (
        '<function=get_weather>{"city": "Paris"}</function>',
        '<function=a>{"x": 1}</function>\n<function=b>{}</function>',
        'Let me check.<function=get_weather>{"city": </function>',
    ),
    "functiongemma": (
        f"<start_function_call>call:get_weather{{city:{ESC}Paris{ESC}}}<end_function_call>",
        "<start_function_call>call:a{x:1}<end_function_call><start_function_call>call:b{}<end_function_call>",
        f"Let me check.<start_function_call>call:get_weather{{city:{ESC}Paris}}<end_function_call>",
    ),
    "phi4": (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>',
        '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]<|/tool_call|>',
        'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": }]<|/tool_call|>',
    ),
    "nemotron_mini": (
        '<toolcall> {"name": "get_weather", "arguments": {"city": "Paris"}} </toolcall>',
        '<toolcall> {"name": "a", "arguments": {"x": 1}} </toolcall><toolcall> {"name": "b", "arguments": {}} </toolcall>',
        'Let me check.<toolcall> {"name": "get_weather", "arguments": {"city": </toolcall>',
    ),
    "hunyuan": (
        "<tool_calls>" + HY.format("get_weather", '{"city": "Paris"}') + "</tool_calls>",
        "<tool_calls>" + HY.format("a", '{"x": 1}') + HY.format("b", "{}") + "</tool_calls>",
        "Let me check.<tool_calls>" + HY.format("get_weather", '{"city"') + "</tool_calls>",
    ),
    # the formats once refused (issue 48): Llama 4, Apertus, Solar Open 100B, GigaChat 3, HyperCLOVAX
    # SEED Think 14B, Step-Audio R1.1
    "llama4": (
        '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_start|><|python_end|>{"name": "a", "parameters": {"x": 1}}{"name": "b", "parameters": {}}',
        'Let me check.<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": ',
    ),
    "apertus": (
        '<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>',
        '<|tools_prefix|>[{"a": {"x": 1}}, {"b": {}}]<|tools_suffix|>',
        'Let me check.<|tools_prefix|>[{"get_weather": {"city": }]<|tools_suffix|>',
    ),
    "solar_open": (
        SO.format(SC.format("get_weather", '{"city": "Paris"}')),
        SO.format(SC.format("a", '{"x": 1}') + SC.format("b", "{}")),
        "Let me check." + SO.format(SC.format("get_weather", '{"city": ')),
    ),
    "gigachat3": (
        '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        'function call<|role_sep|>\n[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        'Let me check.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", "arguments": {',
    ),
    "hyperclovax": (
        "<|im_end|>\n<|im_start|>assistant -> tool/function_call\n"
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|im_end|>',
        ' -> tool/function_call\n[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        'Let me check.<|im_end|>\n<|im_start|>assistant -> tool/function_call\n[{"name": "get_weather"',
    ),
    "step_audio": (
        '<|CALL_START|>function\nget_weather\n{"city": "Paris"}<|CALL_END|>',
        '<|CALL_START|>function\na\n{"x": 1}<|CALL_END|><|CALL_START|>function\nb\n{}<|CALL_END|>',
        'Let me check.<|CALL_START|>function\nget_weather\n{"city": <|CALL_END|>',
    ),
}
for fmt, (one, two, bad) in MORE.items():
    ONE[fmt], TWO[fmt], BAD[fmt] = BEFORE + one, two, bad
    # what follows forced(fmt, "get_weather"), and forced(fmt, "") ("required": the model names the tool)
    after_name = one.split("get_weather", 1)[1]
    args = after_name.removeprefix(format_of(fmt).call[1].rstrip(" ")).lstrip(" ")
    CONTINUE[fmt] = (args, "get_weather" + after_name)

# GLM-4: calls at the reply's end, each a name on its line and JSON arguments
ONE["glm4"], TWO["glm4"] = BEFORE + '\nget_weather\n{"city": "Paris"}', 'a\n{"x": 1}\nb\n{}'
BAD["glm4"] = 'get_weather\n{"city": '
CONTINUE["glm4"] = ('{"city": "Paris"}', 'get_weather\n{"city": "Paris"}')
# forced calls write "arguments", which InternLM's templates call "parameters"
CONTINUE["intern"] = (
    '{"city": "Paris"}}<|action_end|>',
    'get_weather", "arguments": {"city": "Paris"}}<|action_end|>',
)
CONTINUE["command_r"] = (
    '{"city": "Paris"}}]<|END_ACTION|>',
    'get_weather", "arguments": {"city": "Paris"}}]<|END_ACTION|>',
)
CONTINUE["kimi"] = tuple(
    f + '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    for f in ("", "get_weather:0<|tool_call_argument_begin|>")
)
CONTINUE["functionary"] = (
    '{"city": "Paris"}</function>',
    'get_weather>{"city": "Paris"}</function>',
)
# Typhoon's and baseten's Python list is the whole reply, as Llama 3's JSON is; Functionary v3.2's
# content follows "all", after the >>> the generation prompt writes
ONE["python_list"] = '[get_weather(city="Paris")]'
TWO["python_list"] = "[a(x=1), b()]"
BAD["python_list"] = '[get_weather(city="Paris"]'
CONTINUE["python_list"] = ('city="Paris")]', 'get_weather(city="Paris")]')
ONE["functionary_v32"] = "all\n" + BEFORE + '>>>get_weather\n{"city": "Paris"}'
TWO["functionary_v32"] = 'a\n{"x": 1}>>>b\n{}'
BAD["functionary_v32"] = 'Let me check.>>>get_weather\n{"city": '
CONTINUE["functionary_v32"] = ('{"city": "Paris"}', 'get_weather\n{"city": "Paris"}')


def tagged_texts(fmt: str) -> tuple[str, str, str, tuple[str, str]]:
    """ONE, TWO, BAD and CONTINUE of a format whose calls are tags (Format.param), written from its own parts."""
    start, between, end = format_of(fmt).call
    # (a close may name the key again: MiniMax M3's </city>)
    param = lambda k, v: v.join(p.replace("{name}", k) for p in format_of(fmt).param[:2])  # noqa: E731
    params = param("city", "Paris")
    one = BEFORE + start + "get_weather" + between + params + end
    two = start + "a" + between + param("x", "1") + end + start + "b" + between + end
    bad = "Let me check." + start + "get_weather" + between + "city: Paris" + end
    return one, two, bad, (params + end, "get_weather" + between + params + end)


for fmt in FORMATS:
    if format_of(fmt).param and fmt not in ONE:
        ONE[fmt], TWO[fmt], BAD[fmt], CONTINUE[fmt] = tagged_texts(fmt)

SPECIAL = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
    B,
    C,
    S,
    E,
    F,
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|tool_call|>",
    "<|/tool_call|>",
]


def calls_of(reply: dict) -> list:
    return [(c["name"], json.loads(c["arguments"])) for c in reply["tool_calls"]]


def replies(fmt: str) -> list[tuple[str, dict]]:
    """Every reply text of a format with the parse arguments it needs: the cases above, plus think blocks."""
    out = [(t, {}) for t in (ONE[fmt], TWO[fmt], BAD[fmt])]
    if fmt != "harmony":
        out += [
            ("<think>\nWeather? 🌤\n</think>\n\n" + ONE[fmt], {"think": THINK}),
            ("Weather? 🌤\n</think>\n\n" + BAD[fmt], {"think": THINK, "opened": True}),
        ]
    if fmt.startswith("mistral"):
        out.append(("[THINK]Weather?[/THINK]" + ONE[fmt], {"think": ("[THINK]", "[/THINK]")}))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_parse_content_one_call_parallel_calls_and_malformed(fmt):
    one = parse(fmt, ONE[fmt])
    assert calls_of(one) == [("get_weather", {"city": "Paris"})]
    assert one["content"] == ("" if fmt in ("llama3", "python_list") else BEFORE)
    assert one["reasoning"] == ("Need the weather." if fmt == "harmony" else "")
    assert calls_of(parse(fmt, TWO[fmt])) == [("a", {"x": 1}), ("b", {})]
    bad = parse(fmt, BAD[fmt])
    assert (
        bad["tool_calls"] == [] and bad["content"] == BAD[fmt].strip()
    )  # the harness sees what the model wrote
    # ids only where the model wrote them
    ids = [
        c.get("id") for c in parse(fmt, ONE[fmt])["tool_calls"] + parse(fmt, TWO[fmt])["tool_calls"]
    ]
    assert ids == {
        "mistral": ["abcdefghi", "aaaaaaaa1", "bbbbbbbb2"],
        "mistral_v11": [None, "aaaaaaaa1", "bbbbbbbb2"],
        "kimi": ["functions.get_weather:0", "functions.a:0", "functions.b:1"],
    }.get(fmt, [None] * 3)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "harmony"])
def test_think_blocks(fmt):
    r = parse(fmt, "<think>\nWeather? 🌤\n</think>\n\n" + ONE[fmt], THINK)
    assert r["reasoning"] == "Weather? 🌤" and calls_of(r) == [("get_weather", {"city": "Paris"})]
    r = parse(
        fmt, "Weather?\n</think>\n\n" + ONE[fmt], THINK, opened=True
    )  # the prompt opened <think>
    assert r["reasoning"] == "Weather?" and calls_of(r) == [("get_weather", {"city": "Paris"})]
    assert parse(fmt, "<think>\n\n</think>\n\nHello", THINK) == {
        "content": "Hello",
        "reasoning": "",
        "tool_calls": [],
    }  # /no_think
    assert parse(fmt, "still thinking " + ONE[fmt], THINK, opened=True) == {
        "content": "",
        "reasoning": ("still thinking " + ONE[fmt]).strip(),
        "tool_calls": [],
    }
    assert (
        parse(fmt, "Hello </think> x", THINK)["content"] == "Hello </think> x"
    )  # a think block counts only at the start
    assert (
        parse(fmt, "<think>a</think>b", None)["content"] == "<think>a</think>b"
    )  # no think tags: all is content
    if fmt.startswith("mistral"):
        r = parse(fmt, "[THINK]Weather?[/THINK]" + ONE[fmt], ("[THINK]", "[/THINK]"))
        assert r["reasoning"] == "Weather?" and r["content"] == BEFORE and len(r["tool_calls"]) == 1


def test_format_details():
    # Qwen3-Coder parameters are text: JSON values where they parse, else strings (inner newlines kept)
    r = parse(
        "qwen3_coder",
        '<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=o>\n{"k": [1]}\n</parameter>\n'
        "<parameter=s>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>",
    )
    assert calls_of(r) == [("f", {"n": 3, "o": {"k": [1]}, "s": "line 1\nline 2"})]
    # Llama 3: only a reply that is all call JSON is a call; <|python_tag|> may open it
    assert parse("llama3", 'Use {"name": "f", "parameters": {}} like this.')["tool_calls"] == []
    assert calls_of(parse("llama3", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}')) == [
        ("f", {"a": 1})
    ]
    assert calls_of(
        parse("llama3", '{"name": "f", "arguments": {}}\n{"name": "g", "parameters": {}}')
    ) == [("f", {}), ("g", {})]
    assert (
        parse("llama3", '{"name": "Bob", "age": 3}')["tool_calls"] == []
    )  # JSON that is not a call
    # harmony: reasoning and final answer; the recipient may sit in the role header; the prompt may not end in <|start|>assistant
    r = parse(
        "harmony",
        "<|start|>assistant<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
    )
    assert r == {"content": "Answer.", "reasoning": "Think.", "tool_calls": []}
    assert calls_of(
        parse(
            "harmony",
            "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
        )
    ) == [("f", {})]
    assert parse("harmony", "Plain text.")["content"] == "Plain text."
    # mistral: either shape under either name; Nemo also writes one object without the list
    assert (
        calls_of(parse("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}'))
        == calls_of(parse("mistral_v11", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'))
        == [("f", {"a": 1})]
    )
    # deepseek: both shapes under either name; a region with one broken call stays content whole
    assert calls_of(parse("deepseek", B + C + "f" + S + "{}" + E + F)) == [("f", {})]
    assert (
        parse("deepseek", B + C + "f" + S + "{}" + E + C + "g" + S + "{" + E + F)["tool_calls"]
        == []
    )
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse("nope", "x")


def test_minimax_m3_values_and_namespaced_think_tags():
    """MiniMax M3 writes an object's value as its keys' tags and a list's as <item> tags; its think tags are
    <mm:think> (Seed-OSS's <seed:think>), an empty block the close alone."""
    m3 = "]<]minimax[>["
    tag = lambda k, v: f"{m3}<{k}>{v}{m3}</{k}>"  # noqa: E731
    opts = tag("opts", tag("n", "3") + tag("tags", tag("item", "x") + tag("item", "y")))
    call = f'{m3}<invoke name="f">{tag("q", "a<b")}{opts}{tag("flag", "true")}{m3}</invoke>\n'
    text = f"</mm:think>{m3}<tool_call>\n{call}{m3}</tool_call>"
    think = think_tags("{{ '<mm:think>' + reasoning + '</mm:think>' }}")
    r = parse("minimax_m3", text, think)
    args = {"q": "a<b", "opts": {"n": 3, "tags": ["x", "y"]}, "flag": True}
    assert r["reasoning"] == r["content"] == "" and calls_of(r) == [("f", args)]
    assert visible("minimax_m3", "</mm:th", think) == ("", "")  # either tag may still be coming
    think = think_tags("{{ '<seed:think>' }}")
    assert parse("seed_oss", "<seed:think>hm</seed:think>Hi", think)["reasoning"] == "hm"


def test_the_format_names_are_the_formats_in_the_table():
    """--tool-format's choices (toolcalls.format_names(), hooks.TOOL_FORMATS) name Hermes and every format of
    extras/tool_formats.py, in the order detect() tries them (the one the hand-kept tuple had)."""
    from lightning_lite.extras import tool_formats

    assert FORMATS == ["hermes", *tool_formats.FORMATS]
    assert FORMATS == [
        *("hermes", "qwen3_coder", "llama3", "mistral", "mistral_v11", "deepseek", "deepseek_v31"),
        *("harmony", "granite", "glm", "longcat", "minimax", "minimax_m3", "deepseek_v32"),
        *("deepseek_v4", "minicpm", "solar", "hy3_preview", "hy3", "hunyuan", "nemotron"),
        *("gigachat", "tool_calls_json", "intern", "longcat_json", "command_r", "olmo3", "lfm2"),
        *("minicpm3", "step3", "gemma4", "kimi", "functionary", "seed_oss", "function_tags"),
        *("functiongemma", "phi4", "nemotron_mini", "glm4"),
        *("llama4", "apertus", "solar_open", "gigachat3", "hyperclovax", "python_list"),
        *("functionary_v32", "step_audio"),
    ]


def test_hermes_keeps_the_earlier_parser_behaviour():
    """What chat.parse_tool_calls did before the formats came: "parameters" too, string arguments kept as written,
    an unclosed block at the end (EOS right after the JSON) counts, broken JSON stays text."""
    r = parse(
        "hermes",
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    )
    assert r["content"] == "Let me compute." and r["tool_calls"] == [
        {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    ]
    assert calls_of(parse("hermes", '<tool_call>{"name": "f", "arguments": {}}')) == [("f", {})]
    text = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse("hermes", text) == {"content": text, "reasoning": "", "tool_calls": []}
    r = parse(
        "hermes",
        'a <tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call> b <tool_call>{"name": "g", "arguments": "raw"}</tool_call>',
    )
    assert r["content"] == "a  b" and r["tool_calls"] == [
        {"name": "f", "arguments": '{"x": 1}'},
        {"name": "g", "arguments": "raw"},
    ]
    assert (
        forced("hermes", "f") == '<tool_call>\n{"name": "f", "arguments":'
        and forced("hermes", "") == '<tool_call>\n{"name": "'
    )


def test_no_format_splits_only_the_reasoning():
    """fmt None (tool_choice "none"): what looks like a call is content; the reasoning is still split off."""
    text = "<think>\nhm\n</think>\n\n" + ONE["hermes"]
    assert parse(None, text, THINK) == {
        "content": ONE["hermes"],
        "reasoning": "hm",
        "tool_calls": [],
    }
    assert visible(None, text[:-3], THINK) == ("hm", ONE["hermes"][:-3]) and visible(
        None, "<think>\nhm ", THINK
    ) == ("hm", "")


@pytest.fixture(scope="module")
def special_tok(tok):
    t = copy.deepcopy(tok)  # the session tokenizer stays as it is
    t.add_special_tokens({"additional_special_tokens": SPECIAL})
    return t


@pytest.mark.parametrize("fmt", FORMATS)
def test_parse_from_ids_with_special_tokens(fmt, special_tok):
    """The proxy decodes the sampled ids with special tokens kept: markers that are single tokens parse the same."""
    assert all(len(special_tok.encode(m, add_special_tokens=False)) == 1 for m in SPECIAL)
    for text, kw in replies(fmt):
        ids = special_tok.encode(text, add_special_tokens=False)
        decoded = special_tok.decode(ids, skip_special_tokens=False)
        assert decoded == text and parse(fmt, decoded, **kw) == parse(fmt, text, **kw)


def _check_stream(fmt, prefixes, kw):
    """visible() of every prefix is a prefix of parse() of it and of every longer prefix, and grows monotonically."""
    finals = [parse(fmt, p, **kw) for p in prefixes]
    shown = [visible(fmt, p, **kw) for p in prefixes]
    for k, (reasoning, content) in enumerate(shown):
        assert all(
            f["reasoning"].startswith(reasoning) and f["content"].startswith(content)
            for f in finals[k:]
        ), (prefixes[k], shown[k])
        if k:
            assert reasoning.startswith(shown[k - 1][0]) and content.startswith(shown[k - 1][1]), (
                prefixes[k]
            )
    return shown


@pytest.mark.parametrize("fmt", FORMATS)
def test_visible_is_always_a_prefix_of_the_final_parse(fmt, special_tok):
    for text, kw in replies(fmt):
        _check_stream(fmt, [text[:k] for k in range(len(text) + 1)], kw)
        ids = special_tok.encode(
            text, add_special_tokens=False
        )  # token by token: split UTF-8 characters show as '\ufffd'
        _check_stream(
            fmt,
            [special_tok.decode(ids[:k], skip_special_tokens=False) for k in range(len(ids) + 1)],
            kw,
        )
    # content before a call and reasoning stream before the reply is done
    if fmt == "glm4":  # a word on a line of its own may be a call's name
        assert visible(fmt, "Sure, the weather ") == ("", "Sure, the weather")
        assert visible(fmt, 'Sure.\nget_weather\n{"ci') == ("", "Sure.")
    if fmt == "python_list":
        assert visible(fmt, "Sure, the weather ") == ("", "Sure, the weather")
        assert visible(fmt, " [get_we") == ("", "")
    elif fmt != "llama3":
        cut = ONE[fmt].index(BEFORE) + len(BEFORE)
        assert (
            visible(fmt, ONE[fmt][: cut + 2])[1] == BEFORE and visible(fmt, ONE[fmt])[1] == BEFORE
        )
    else:
        assert visible(fmt, "Sure, the weather ") == ("", "Sure, the weather") and visible(
            fmt, ' {"na'
        ) == ("", "")
    if fmt != "harmony":
        assert visible(fmt, "<think>\nWeather? 🌤\n</th", THINK) == ("Weather? 🌤", "")
        assert visible(fmt, "<thi", THINK) == ("", "") and visible(
            fmt, "Weather?", THINK, opened=True
        ) == ("Weather?", "")
    else:
        assert visible(fmt, "<|channel|>analysis<|message|>Need the") == ("Need the", "")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if format_of(f).call])
def test_forced_call_parses(fmt):
    named, required = CONTINUE[fmt]
    for name, cont in (("get_weather", named), ("", required)):
        assert calls_of(parse(fmt, forced(fmt, name) + cont)) == [
            ("get_weather", {"city": "Paris"})
        ]
        if fmt != "harmony":  # the prompt opened <think>: the forced text closes it first
            r = parse(fmt, forced(fmt, name, opened=True) + cont, THINK, opened=True)
            assert r["reasoning"] == "" and calls_of(r) == [("get_weather", {"city": "Paris"})]
        assert (
            visible(fmt, forced(fmt, name) + cont[:5])[1] == ""
        )  # a forced call streams no content


# fixture template -> (its format, does it render content next to calls, does it keep the last turn's reasoning)
FIXTURES = {
    "qwen3": ("hermes", True, True),
    "qwen3_coder": ("qwen3_coder", True, False),
    "qwen35": ("qwen3_coder", True, True),
    "llama3": ("llama3", False, False),
    "mistral_nemo": ("mistral", False, False),
    "mistral_small32": ("mistral_v11", True, False),
    "deepseek_r1": ("deepseek", True, False),
    "deepseek_v31": ("deepseek_v31", True, False),
    "gpt_oss": ("harmony", True, True),
    "granite": ("granite", True, False),
    "gemma3": (None, True, False),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
        return f.read()


def render(tok, name, messages, gen=False):
    return tok.apply_chat_template(
        messages,
        tools=TOOLS,
        chat_template=template(name),
        tokenize=False,
        add_generation_prompt=gen,
    )


def assistant(calls, content="", reasoning=""):
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "thinking": reasoning,
        "tool_calls": [
            {"id": id, "type": "function", "function": {"name": n, "arguments": a}}
            for id, n, a in calls
        ],
    }


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_detect_fixture_templates(name, tok):
    rendered = render(
        tok,
        name,
        [
            {"role": "user", "content": "x"},
            assistant([("abcdefghi", SENTINEL, {"llarg": "llval"})]),
        ],
    )
    assert detect(rendered) == FIXTURES[name][0]
    # the rendering after the generation prompt only (how the proxy probes a template) says the same
    prompt = render(tok, name, [{"role": "user", "content": "x"}], gen=True)
    if rendered.startswith(prompt):
        assert detect(rendered[len(prompt) :]) == FIXTURES[name][0]


def test_detect_none_and_think_tags(tok):
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}],
        tokenize=False,
    )
    assert detect(plain) is None  # SmolLM2's own template drops tool calls
    assert detect('Action: {"name": "LLSENTINEL7f3a", "arguments": {"llarg": "llval"}}') is None
    tags = {n: think_tags(template(n)) for n in FIXTURES}
    assert {n for n, t in tags.items() if t} == {
        "qwen3",
        "qwen35",
        "deepseek_r1",
        "deepseek_v31",
    } and tags["qwen3"] == THINK
    assert think_tags("{{ '[THINK]' + m.thinking + '[/THINK]' }}") == ("[THINK]", "[/THINK]")


@pytest.mark.parametrize("name", [n for n in sorted(FIXTURES) if FIXTURES[n][0]])
def test_template_rendering_parses_back(name, tok):
    """What each template writes for an assistant turn with calls is what the parser reads back."""
    fmt, keeps_content, keeps_reasoning = FIXTURES[name]
    calls = [
        ("abcdefgh1", "get_weather", {"city": "Paris", "n": 3}),
        ("abcdefgh2", "get_weather", {"city": "Oslo", "days": [1, 2]}),
    ]
    calls = calls[:1] if fmt == "llama3" else calls
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}]
    prompt, full = (
        render(tok, name, msgs, gen=True),
        render(tok, name, msgs + [assistant(calls, "Checking.", "Two cities.")]),
    )
    k = next(
        i
        for i in range(len(prompt) + 1)
        if i == len(prompt) or i == len(full) or prompt[i] != full[i]
    )
    reply = full[k:].rstrip()
    for close in (
        "<|im_end|>",
        "<|eot_id|>",
        "</s>",
        "<｜end▁of▁sentence｜>",
        "<|call|>",
        "<|end_of_text|>",
    ):
        reply = reply.removesuffix(close)
    think = think_tags(template(name))
    opened = bool(think) and prompt[:k].rstrip().endswith(
        think[0]
    )  # the generation prompt opened the think block
    assert opened == (name == "qwen35")
    r = parse(fmt, reply, think, opened)
    assert calls_of(r) == [(n, a) for _, n, a in calls]
    assert r["content"] == ("Checking." if keeps_content else "") and r["reasoning"] == (
        "Two cities." if keeps_reasoning else ""
    )


def test_template_errors_like_the_vendors(tok):
    two = assistant([("abcdefgh1", "f", {}), ("abcdefgh2", "g", {})])
    with pytest.raises(Exception, match="only supports single tool-calls at once"):
        render(tok, "llama3", [{"role": "user", "content": "x"}, two])
    with pytest.raises(Exception, match="alphanumeric strings with length 9"):
        render(
            tok,
            "mistral_nemo",
            [{"role": "user", "content": "x"}, assistant([("call_1", "f", {})])],
        )
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        render(tok, "gemma3", [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    # Qwen3 keeps reasoning only after the last user message; DeepSeek-R1 drops it from every assistant turn
    msgs = [
        {"role": "user", "content": "x"},
        assistant([], "a", "old thought"),
        {"role": "user", "content": "y"},
        assistant([], "b", "new thought"),
    ]
    assert "new thought" in render(tok, "qwen3", msgs) and "old thought" not in render(
        tok, "qwen3", msgs
    )
    r1 = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\na"},
    ]
    assert "old thought" not in render(tok, "deepseek_r1", r1) and render(
        tok, "deepseek_r1", r1
    ).endswith("<｜Assistant｜>a<｜end▁of▁sentence｜>")


def test_calls_in_openais_shape_and_literals_python_cannot_hash():
    """Falcon3 writes OpenAI's {"id", "type", "function": {...}} objects, pretty-printed, in a list in <tool_call>
    (Monostich in Granite's <|tool_call|>): read with their ids, and detected. A body Python reads as a set of dicts
    is no call, and no exception either."""
    call = '{\n  "id": "call_7",\n  "type": "function",\n  "function": {\n    "name": "f",\n    "arguments": {"x": 1}}}'
    for fmt, text in [
        ("hermes", f"<tool_call>\n[\n{call}\n]\n</tool_call>"),
        ("granite", f"<|tool_call|>[{call}]"),
    ]:
        assert parse(fmt, "Sure." + text) == {
            "content": "Sure.",
            "reasoning": "",
            "tool_calls": [{"id": "call_7", "name": "f", "arguments": '{"x": 1}'}],
        }
        assert (
            detect(text.replace('"f"', f'"{SENTINEL}"').replace('"x": 1', '"llarg": "llval"'))
            == fmt
        )
    for fmt, text in [
        ("hermes", "<tool_call>{{1: 2}}</tool_call>"),
        ("olmo3", "<function_calls>f(a={{1: 2}})</function_calls>"),
    ]:
        assert parse(fmt, text)["tool_calls"] == []


def test_the_format_a_template_s_words_or_tokens_teach():
    """toolcalls.taught: the format whose call opening the instructions write furthest (Hermes' full opening beats
    GLM's bare <tool_call>); special_format: the one with most of its tags among a tokenizer's special tokens."""
    from lightning_lite.extras.tool_formats import special_format
    from lightning_lite.toolcalls import taught

    granite = "When a tool is required, respond only with <|tool_call|> followed by a JSON list of tools used."
    assert taught(granite) == "granite"
    assert taught('return <tool_call>\n{"name": <function-name>, "arguments": <args>}') == "hermes"
    assert taught("<tool_call>\n<function=example_function_name>\n<parameter=x>") == "qwen3_coder"
    assert taught('Return calls as <tool_calls>[{"name": <function-name>, ...}]</tool_calls>') == (
        "tool_calls_json"
    )
    assert taught("You may call functions. Here they are: [...]") is None
    assert special_format(["<|tool_call|>", "<|/tool_call|>", "<|end|>"]) == "phi4"
    assert special_format(["<|tool_call|>"]) == "granite"
    assert special_format(["<|tool_call_start|>", "<|tool_call_end|>"]) == "lfm2"
    assert special_format(["<|im_end|>"]) is None
