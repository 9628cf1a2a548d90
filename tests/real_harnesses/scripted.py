"""A scripted policy: a test-only backend that drives any harness through one tool round trip.

It implements the backend interface (``async generate(prompt_ids, sampling)``)
without a model. It reads the rendered prompt back as text and answers:

- the first call of a conversation that offers tools: ONE call of the
  harness's own shell tool (``echo hello``), in the Hermes form the proxy
  parses (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
- a later call (the prompt holds a tool result or an earlier tool call): ``Done.``, or a
  call of a finishing tool (``final_answer``) when the harness forces a tool
  call (``tool_choice: required``), or the harness's own finishing shell
  command where its prompt asks for one (mini-swe-agent);
- a call without tools (title generation and other side requests): a short text.

Every answer is real token ids from the tokenizer, closed with the EOS token,
exactly as a model would sample them, so the proxy's parsing, recording and
merging all run as in training.
"""

from __future__ import annotations

import json
import re

from lightning_lite.backends import Generation
from lightning_lite.chat import Renderer

# Shell-like tool names of the real harnesses, best first.
SHELL_TOOLS = [
    "bash",
    "Bash",
    "terminal",
    "execute_bash",
    "shell",
    "exec_command",
    "run_shell_command",
    "local_shell",
    "run_command",
    "execute_command",
    "run_terminal_cmd",
    "exec",
]
FINISH_TOOLS = ["final_answer", "finish", "submit", "attempt_completion", "task_complete"]
# Harnesses that want a tool call in every answer finish through the shell (mini-swe-agent).
FINISH_COMMANDS = ["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
COMMAND_KEYS = ["command", "cmd", "commands", "script", "code", "input"]
TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


def parse_tools(prompt_text: str) -> list[dict]:
    """The tool functions written into the prompt (Hermes ``<tools>`` block, one JSON object a line)."""
    for block in reversed(TOOLS_BLOCK.findall(prompt_text)):
        try:
            tools = [json.loads(line) for line in block.splitlines() if line.strip()]
        except json.JSONDecodeError:
            continue  # a "<tools>" that is not the tool block (e.g. inside a system prompt)
        return [t.get("function", t) for t in tools if isinstance(t, dict)]
    return []


def pick_tool(tools: list[dict], names: list[str]) -> dict | None:
    by_name = {t.get("name"): t for t in tools}
    return next((by_name[n] for n in names if n in by_name), None)


def fill_arguments(schema: dict, command: str, text: str) -> dict:
    """Values for the schema's required fields: the command where one is asked, sensible defaults elsewhere."""
    props = schema.get("properties") or {}
    args = {}
    for key in schema.get("required") or []:
        p = props.get(key) or {}
        kind = p.get("type")
        kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
        if key in COMMAND_KEYS:
            args[key] = ["bash", "-lc", command] if kind == "array" else command
        elif p.get("enum"):
            args[key] = p["enum"][0]
        elif "default" in p:
            args[key] = p["default"]
        elif kind == "boolean":
            args[key] = False
        elif kind in ("integer", "number"):
            args[key] = p.get("minimum", 30) if isinstance(p.get("minimum"), (int, float)) else 30
        elif kind == "array":
            args[key] = []
        elif kind == "object":
            args[key] = {}
        else:
            args[key] = text
    return args


class ScriptedBackend:
    """Backend interface without a model; see the module docstring."""

    def __init__(
        self,
        tokenizer,
        command: str = "echo hello",
        final: str = "Done.",
        max_model_len: int = 1 << 20,
    ):
        self.tok = tokenizer
        self.command, self.final = command, final
        self.max_model_len = max_model_len
        self.version = 0
        self.stats = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.eos_ids = {tokenizer.eos_token_id}
        r = Renderer(tokenizer)
        # The text that opens an assistant turn (SmolLM2: "<|im_start|>assistant\n").
        user = [{"role": "user", "content": "x"}]
        self.assistant_open = r.render_text(user, [], True)[
            len(r.render_text(user, [], False)) :
        ].strip()
        self.turn_end = tokenizer.decode([tokenizer.eos_token_id])  # "<|im_end|>"

    def answer(self, prompt: str) -> str:
        """The text to emit (without EOS) for a decoded prompt."""
        tools = parse_tools(prompt)
        # A later call: a tool result is back, or an earlier assistant turn ran our command
        # (smolagents sends its calls and results back as text). Injected "Got it" turns do not count.
        history = prompt[: prompt.rfind(self.assistant_open)]
        assistant_turns = [
            t.split(self.turn_end)[0] for t in history.split(self.assistant_open)[1:]
        ]
        later = "<tool_response>" in history or any(self.command in t for t in assistant_turns)
        forced = re.search(r'<tool_call>\n\{"name": "(?:([^"]*)", "arguments": )?$', prompt)
        if forced:  # tool_choice forces a call; the proxy already wrote the start of it
            name = forced.group(1)
            tool = (
                pick_tool(
                    tools,
                    [name]
                    if name
                    else (FINISH_TOOLS + SHELL_TOOLS if later else SHELL_TOOLS + FINISH_TOOLS),
                )
                or tools[0]
            )
            args = json.dumps(
                fill_arguments(tool.get("parameters") or {}, self.command, self.final)
            )
            return (args if name else tool["name"] + '", "arguments": ' + args) + "}\n</tool_call>"
        if not tools:
            return "Hello" if "title" in prompt.lower() else self.final
        tool = pick_tool(tools, SHELL_TOOLS)
        command = self.command
        if later:
            command = next((c for c in FINISH_COMMANDS if c in history), None)
            if command is None:
                return self.final
        if tool is None:
            return self.final
        call = {
            "name": tool["name"],
            "arguments": fill_arguments(tool.get("parameters") or {}, command, "Run the command"),
        }
        return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"

    async def generate(self, prompt_ids, sampling, **kwargs) -> Generation:
        # kwargs: optional extras of the interface (e.g. live token streaming); the answer is ready at once
        text = self.answer(self.tok.decode(prompt_ids))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop"
        if sampling.max_tokens and len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
            text = self.tok.decode(ids, skip_special_tokens=True)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt_ids)
        self.stats["generated_tokens"] += len(ids)
        return Generation(ids, [0.0] * len(ids), finish, text, self.version)

    def pause(self):
        pass

    def resume(self):
        pass

    def sync_weights(self, model=None, version=None):
        self.version = self.version + 1 if version is None else version

    def close(self):
        pass
