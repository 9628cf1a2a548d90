"""Constrained decoding (grammar.py): forced tool calls and JSON replies follow their schema on the embedded model,
in every API's shape, streaming and not; the trainer scores their tokens under the masks that drew them (replayed)
to fp32 noise; a schema llguidance cannot compile is a 400 with its message."""

import copy
import json

import anthropic
import openai
import pytest
import requests
import torch

from lightning_lite import toolcalls
from lightning_lite.extras import grammar, tool_formats
from lightning_lite.algo import collate, sampled_logprobs, trainer_logprobs
from lightning_lite.extras.grammar import unpack_bits
from lightning_lite.records import read_calls
from lightning_lite.samples import build_batch_samples

CALC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression, e.g. 3+4.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
SEARCH = {
    "name": "search",
    "description": "Search the notes.",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"],
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ARGS = '{"expression": "2+3"}'
# Each format's call as its templates write it (toolcalls.py's table), for the calculator with ARGS.
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": ' + ARGS + "}\n</tool_call>",
    "llama3": '{"name": "calculator", "parameters": ' + ARGS + "}",
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": ' + ARGS + "}]",
    "granite": '<|tool_call|>[{"name": "calculator", "arguments": ' + ARGS + "}]",
    "mistral_v11": "[TOOL_CALLS]calculator[ARGS]" + ARGS,
    "deepseek": tool_formats.DS_BEGIN
    + tool_formats.DS_CALL
    + "function"
    + tool_formats.DS_SEP
    + "calculator\n```json\n"
    + ARGS
    + "\n```"
    + tool_formats.DS_CALL_END
    + tool_formats.DS_END,
    "deepseek_v31": tool_formats.DS_BEGIN
    + tool_formats.DS_CALL
    + "calculator"
    + tool_formats.DS_SEP
    + ARGS
    + tool_formats.DS_CALL_END
    + tool_formats.DS_END,
    "harmony": "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
    + ARGS
    + "<|call|>",
    "qwen3_coder": "<tool_call>\n<function=calculator>\n<parameter=expression>\n2+3\n</parameter>\n</function>\n</tool_call>",
}

# the formats whose calls are tags: written from their own parts
for fmt in toolcalls.format_names():
    form = toolcalls.format_of(fmt)
    if form.call and fmt not in WRITTEN:
        before, after, _, quote = (*(form.param or ()), "", "", "", "")[:4]
        # a string parameter: text up to the closing tag or quote, else JSON
        value = quote + "2+3" + quote if after or quote else '"2+3"'
        param = value.join(p.replace("{name}", "expression") for p in (before, after))
        param = param if form.param else ARGS
        WRITTEN[fmt] = form.call[0] + "calculator" + form.call[1] + param + form.call[2]


def follows(grammar_text, tok, text):
    """Does the grammar take ``text`` (then EOS)? The trainer's replay raises on a token outside it."""
    try:
        grammar.replay(grammar_text, tok.encode(text) + [tok.eos_token_id], tok, len(tok))
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize(
    "fmt", [f for f in toolcalls.format_names() if toolcalls.format_of(f).call]
)
def test_each_formats_grammar_takes_the_call_its_template_writes_and_nothing_off_schema(tok, fmt):
    """What follows toolcalls.forced() for a named tool and for "required" (any of two tools): the template's own
    call text (which toolcalls.parse reads back) and nothing with arguments off the schema."""
    text = WRITTEN[fmt]
    assert json.loads(toolcalls.parse(fmt, text)["tool_calls"][0]["arguments"]) == {
        "expression": "2+3"
    }
    bad = (
        text.replace('"expression": "2+3"', '"expression": 5')
        if not toolcalls.format_of(fmt).param
        else text.replace("expression", "expr")
    )
    for name in ("calculator", ""):
        g = grammar.tool_grammar(fmt, [CALC, SEARCH], name, tok)
        assert grammar.check(g, tok) is None, g
        opening = toolcalls.forced(fmt, name)
        assert text.startswith(opening) and follows(g, tok, text[len(opening) :]), (fmt, name, g)
        assert not follows(g, tok, bad[len(opening) :]), (fmt, name)
        assert not follows(g, tok, text[len(opening) :] + " and more"), (
            fmt,
            name,
        )  # one call, then the turn ends


@pytest.mark.parametrize("fmt", ["olmo3", "lfm2", "minicpm3", "gemma4"])
def test_parameters_are_separated_between_the_values_given_and_optional_ones_may_be_left_out(
    tok, fmt
):
    """Python calls (OLMo 3, LFM2.5, MiniCPM3) and Gemma 4's: the required parameters first, the separator only
    between values, a string JSON in Python and quoted by <|"|> in Gemma 4 (a special token there: by id); what
    the grammar takes parses back to the same arguments."""
    properties = {
        "limit": {"type": "integer"},
        "query": {"type": "string"},
        "exact": {"type": "boolean"},
    }
    tool = {
        "name": "search",
        "parameters": {"type": "object", "properties": properties, "required": ["query"]},
    }
    special = copy.deepcopy(tok)
    special.add_special_tokens(
        {"additional_special_tokens": ['<|"|>', "<|tool_call>", "<tool_call|>"]}
    )
    tok = special if fmt == "gemma4" else tok
    form = toolcalls.format_of(fmt)
    before, _, sep, quote = (*form.param, "", "")[:4]
    string = quote + 'cats "and" dogs' + quote if quote else json.dumps('cats "and" dogs')
    arg = lambda k, v: before.replace("{name}", k) + v  # noqa: E731
    g = grammar.tool_grammar(fmt, [tool], "search", tok)
    assert not quote or f"<[{tok.convert_tokens_to_ids(quote)}]>" in g
    query = {"query": 'cats "and" dogs'}
    for args, expected in [
        ([arg("query", string)], query),
        ([arg("query", string), arg("exact", "true")], {**query, "exact": True}),
        (
            [arg("query", string), arg("limit", "3"), arg("exact", "false")],
            {**query, "limit": 3, "exact": False},
        ),
    ]:
        text = toolcalls.forced(fmt, "search") + sep.join(args) + form.call[2]
        assert follows(g, tok, sep.join(args) + form.call[2]), (fmt, text, g)
        assert json.loads(toolcalls.parse(fmt, text)["tool_calls"][0]["arguments"]) == expected
    # the required query left out, a separator with no value after it, a value that is not JSON
    for args in (
        [arg("limit", "3")],
        [arg("query", string), ""],
        [arg("query", string), arg("limit", "three")],
    ):
        assert not follows(g, tok, sep.join(args) + form.call[2]), (fmt, args)


def test_qwen3_coder_parameters_follow_their_own_schemas_refs_and_all(tok):
    """Qwen3-Coder writes each parameter on its own: a string as text up to its closing tag, anything else as JSON of
    the property's schema, whose "$ref" points into the tool's "$defs"; required parameters always, in schema order."""
    tool = {
        "name": "f",
        "parameters": {
            "type": "object",
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "properties": {"p": {"$ref": "#/$defs/P"}, "s": {"type": "string"}},
            "required": ["p"],
        },
    }
    g = grammar.tool_grammar("qwen3_coder", [tool], "f", tok)
    param = lambda k, v: f"<parameter={k}>\n{v}\n</parameter>\n"  # noqa: E731
    end = "</function>\n</tool_call>"
    assert follows(g, tok, param("p", '{"x": 3}') + param("s", "two\nlines </para") + end)
    assert follows(g, tok, param("p", '{"x": 3}') + end)  # s is optional
    assert not follows(g, tok, param("s", "a") + end)  # p is required
    assert not follows(g, tok, param("p", '{"x": "3"}') + end)  # x is an integer


def test_special_tokens_are_named_by_id_and_sampled_as_one_token(tok):
    """gpt-oss's markers are special tokens: their text is not text to llguidance, so the grammar names them by id
    (``<[id]>``) and the model's single token for each is what it takes."""
    special = copy.deepcopy(tok)
    special.add_special_tokens(
        {"additional_special_tokens": ["<|constrain|>", "<|message|>", "<|call|>"]}
    )
    g = grammar.tool_grammar("harmony", [CALC], "", special)
    ids = {
        t: special.convert_tokens_to_ids(t) for t in ("<|constrain|>", "<|message|>", "<|call|>")
    }
    assert all(f"<[{i}]>" in g for i in ids.values()) and "<|call|>" not in g, g
    rest = WRITTEN["harmony"][len(toolcalls.forced("harmony", "")) :]
    seq = special.encode(rest)
    assert all(i in seq for i in ids.values())
    masks = grammar.replay(g, seq + [special.eos_token_id], special, len(special))
    assert (
        unpack_bits(masks, len(special))[seq.index(ids["<|call|>"])].sum() == 1
    )  # after the arguments: only <|call|>


def test_a_schema_llguidance_cannot_compile_is_reported_with_its_message(tok):
    assert "Invalid type: objectx" in grammar.check(grammar.json_grammar({"type": "objectx"}), tok)
    assert grammar.check(grammar.json_grammar(PERSON), tok) is None


def test_objects_that_list_their_properties_get_no_others():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "properties": {"type": "string"},
        },
        "items": [{"properties": {}}],
    }
    closed = grammar._closed(schema)
    assert (
        closed["additionalProperties"] is False
        and closed["properties"]["a"]["additionalProperties"] is False
    )
    assert (
        "additionalProperties" not in closed["properties"]["properties"]
    )  # a property named "properties" is no schema keyword
    assert closed["items"][0]["additionalProperties"] is False
    assert (
        grammar._closed({"type": "object", "properties": {}, "additionalProperties": True})[
            "additionalProperties"
        ]
        is True
    )


def test_the_mask_comes_first_and_a_forced_token_has_logprob_0_and_no_gradient():
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 3, requires_grad=True)
    allowed = torch.tensor([[True, False, True], [False, True, False], [True, True, True]])
    one, k, p = torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3)
    lp = sampled_logprobs(logits, torch.tensor([0, 1, 0]), one, k, p, allowed)
    assert lp.tolist() == pytest.approx(
        [2 - torch.tensor([2.0, 0.0]).logsumexp(0).item(), 0.0, -0.4076], abs=1e-4
    )  # -0.127, forced, free
    lp[1].backward()
    assert logits.grad.abs().sum() == 0  # a forced token teaches nothing
    # top_p after the mask, on the renormalized probabilities: of [2, 0] (.88, .12) top_p 0.5 keeps token 0 alone
    assert (
        sampled_logprobs(
            logits.detach()[:1], torch.tensor([0]), one[:1], k[:1], torch.tensor([0.5]), allowed[:1]
        ).item()
        == 0.0
    )


def test_packed_masks_unpack_bit_by_bit_sign_bit_and_all():
    words = torch.tensor(
        [[5, -(2**31), -1], [0, 1 << 30, 2**31 - 1]], dtype=torch.int32
    )  # bit 31 is the sign bit
    naive = [
        [bool((int(w) & 0xFFFFFFFF) >> j & 1) for w in row for j in range(32)] for row in words
    ]
    assert unpack_bits(words, 96).tolist() == naive
    assert (
        unpack_bits(words, 70).tolist() == [r[:70] for r in naive]
        and unpack_bits(words[:, 1:], 40).dtype == torch.bool
    )


# ------------------------------------------------------------------------------------------ on the embedded model


def _valid(args: dict, schema: dict) -> bool:
    """Follows a flat object schema: the required keys, no others, the types and bounds (maxLength, minimum, maximum)."""

    def ok(p, v):
        if p["type"] == "string":
            return isinstance(v, str) and len(v) <= p.get("maxLength", len(v))
        return (
            isinstance(v, int)
            and not isinstance(v, bool)
            and p.get("minimum", v) <= v <= p.get("maximum", v)
        )

    props = schema["properties"]
    return set(schema["required"]) <= set(args) <= set(props) and all(
        ok(props[k], v) for k, v in args.items()
    )


# Bounded strings and numbers (schema features the grammar enforces): every call fits the requests' max_tokens
SHORT = {
    **CALC,
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 16}},
        "required": ["expression"],
    },
}
LOOKUP = {
    **SEARCH,
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 16},
            "limit": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["query", "limit"],
    },
}


def test_forced_calls_follow_their_schema_in_every_api_streaming_and_not(server, model, tok):
    """Named and "required" tool_choice, in chat completions, Anthropic Messages and the Responses API, streaming and
    not: every call the 135M model writes parses and follows its tool's schema (unconstrained it wrote `2` and junk
    to the token limit). Then the trainer scores every recorded token under its replayed mask: fp32 noise; without
    the masks the same tokens are off by whole nats."""
    rids = iter(
        f"grammar-calls-{i}" for i in range(100)
    )  # a rollout each: no call is a retry of another (samples.py)
    chat = lambda: openai.OpenAI(
        base_url=f"{server.url}/rollout/{next(rids)}/v1", api_key="x", max_retries=0
    )  # noqa: E731
    question = "What is 12 times 7? Look it up in the notes, or compute it."
    got = []  # (name, arguments)
    for seed, stream in ((1, False), (2, True)):
        for choice in ({"type": "function", "function": {"name": "search"}}, "required"):
            kw = dict(
                model="m",
                messages=[{"role": "user", "content": question}],
                tools=[{"type": "function", "function": t} for t in (SHORT, LOOKUP)],
                tool_choice=choice,
                max_tokens=64,
                temperature=1.0,
                seed=seed,
            )
            if stream:
                calls = {}
                for ch in chat().chat.completions.create(stream=True, **kw):
                    for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                        calls.setdefault(tc.index, [tc.function.name, ""])[1] += (
                            tc.function.arguments or ""
                        )
                got += [tuple(c) for c in calls.values()]
            else:
                m = chat().chat.completions.create(**kw).choices[0].message
                got += [(t.function.name, t.function.arguments) for t in m.tool_calls]
        tools = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in (SHORT, LOOKUP)
        ]
        kw = dict(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": question}],
            tools=tools,
            tool_choice={"type": "tool", "name": "search"},
            extra_body={"seed": seed, "temperature": 1.0},
        )
        msgs = anthropic.Anthropic(
            base_url=f"{server.url}/rollout/{next(rids)}", api_key="x", max_retries=0
        )
        if stream:
            with msgs.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = msgs.messages.create(**kw)
        got += [(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
        r = chat().responses.create(
            model="m",
            input=question,
            tools=[{"type": "function", **SHORT}],
            max_output_tokens=64,
            store=False,
            tool_choice={"type": "function", "name": "calculator"},
            extra_body={"seed": seed},
        )
        got += [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert len(got) == 8, (
        got
    )  # one call per request (named and "required" in chat, Anthropic, Responses; twice), each parsed
    schemas = {"calculator": SHORT["parameters"], "search": LOOKUP["parameters"]}
    assert all(_valid(json.loads(a), schemas[n]) for n, a in got), got
    assert (
        sum(n == "search" for n, _ in got) >= 4
    )  # the named ones (and "required" may pick either)

    calls = [
        c
        for c in read_calls(str(server.out / "calls.jsonl"), whole=True)
        if c.rollout_id.startswith("grammar-calls-")
    ]
    assert len(calls) == 8 and all(c.grammar for c in calls)
    samples, _ = build_batch_samples(calls)
    masks = [grammar.sample_masks(s, tok, model.config.vocab_size) for s in samples]
    assert sum(len(m[0]) for m in masks) == sum(
        sum(s.loss_mask) for s in samples
    )  # every trained token was constrained
    with torch.no_grad():
        for use in (True, False):
            b = collate(samples, [1.0] * len(samples))
            replay = None
            if use:
                replay = grammar.Replay(samples, tok, model.config.vocab_size)
            d = (trainer_logprobs(model, b, allowed=replay) - b["old_logprobs"])[
                b["loss_mask"] > 0
            ].abs()
            print(
                f"{'with' if use else 'without'} the masks: |dlogp| mean {d.mean():.2e} max {d.max():.2e} over {len(d)} tokens"
            )
            assert (d.max() < 1e-4) if use else (d.mean() > 0.5)


def test_json_replies_follow_their_schema_in_every_api(server):
    """response_format json_schema (chat), text.format (Responses), output_format and output_config.format (Anthropic),
    json_object: the reply's content is JSON of that schema."""
    base = f"{server.url}/rollout/grammar-json"
    chat, msgs = (
        openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0),
        anthropic.Anthropic(base_url=base, api_key="x", max_retries=0),
    )
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    texts = [
        chat.chat.completions.create(
            model="m",
            messages=ask,
            max_tokens=48,
            seed=1,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        .choices[0]
        .message.content
    ]
    texts.append(
        chat.responses.create(
            model="m",
            input=ask,
            max_output_tokens=48,
            store=False,
            extra_body={"seed": 2},
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        ).output_text
    )
    for key, fmt in (
        ("output_format", {"type": "json_schema", "schema": PERSON}),
        ("output_config", {"format": {"type": "json_schema", "schema": PERSON}}),
    ):
        m = msgs.messages.create(
            model="m", messages=ask, max_tokens=48, extra_body={key: fmt, "seed": 3}
        )
        texts.append(m.content[0].text)
    assert all(_valid(json.loads(t), PERSON) for t in texts), texts
    free = chat.chat.completions.create(
        model="m", messages=ask, max_tokens=48, seed=4, response_format={"type": "json_object"}
    )
    text = free.choices[
        0
    ].message.content  # any object: the grammar bounds nothing, so max_tokens may cut it
    assert (
        isinstance(json.loads(text), dict)
        if free.choices[0].finish_reason == "stop"
        else text.startswith("{")
    ), text


def test_a_schema_that_cannot_compile_is_a_400_in_the_apis_own_shape(server):
    base = f"{server.url}/rollout/grammar-bad"
    bad = {"type": "object", "properties": {"when": {"type": "string", "format": "not-a-format"}}}
    r = requests.post(
        base + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
            "tool_choice": "required",
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert (
        "not-a-format" in r.json()["error"]["message"]
        and "cannot be enforced" in r.json()["error"]["message"]
    )
    r = requests.post(
        base + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "output_format": {"type": "json_schema", "schema": {"type": "objectx"}},
        },
    )
    assert (
        r.status_code == 400
        and r.json()["type"] == "error"
        and "objectx" in r.json()["error"]["message"]
    ), r.text
    r = requests.post(
        base + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_the_default_grammar_constrains_nothing_and_the_extra_counts_what_it_constrained():
    """hooks.NoGrammar, the seam's default: a forced call opened by the prompt alone, a grammar
    refused naming extras/grammar.py, a micro-batch without one replayed as None. The extra's
    ``constrain`` leaves a request without a forced call or JSON reply alone, and ``Counts`` (a
    hooks.LOSS_METRICS) sums each micro-batch's Replay counts."""
    from types import SimpleNamespace

    from lightning_lite import hooks
    from lightning_lite.records import Sample

    plain = Sample("r", [1, 2], [0, 1], [0.0, -1.0])
    constrained = Sample("r", [1, 2], [0, 1], [0.0, -1.0], grammars={0: 'start: "x"'})
    default = hooks.NoGrammar()
    assert default.replay_samples([plain], None, 8) is None
    with pytest.raises(RuntimeError, match="extras/grammar.py"):
        default.replay_samples([plain, constrained], None, 8)
    with pytest.raises(RuntimeError, match="extras/grammar.py"):
        default.Matcher('start: "x"', None, 8)
    renderer = SimpleNamespace(forced_prefix=lambda tool, opened, json_reply: f"{tool}{json_reply}")
    req = SimpleNamespace(
        force_tool="f", response_schema=None, sampling=SimpleNamespace(grammar=None)
    )
    assert default.constrain(req, renderer, False) == "fFalse" and req.sampling.grammar is None
    assert hooks.grammar is grammar and grammar.Counts in hooks.LOSS_METRICS
    neither = SimpleNamespace(force_tool=None, response_schema=None, sampling=req.sampling)
    assert grammar.constrain(neither, renderer, False) == "" and req.sampling.grammar is None
    assert grammar.replay_samples([plain], None, 8) is None
    counts = grammar.Counts()
    counts.add([], {"allowed": None}, None, None)
    counts.add([], {"allowed": SimpleNamespace(constrained=5, forced=2)}, None, None)
    assert counts.result() == {"constrained_tokens": 5, "forced_tokens": 2}
