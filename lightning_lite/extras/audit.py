"""Audit a rollout's tool calls and tool results on the wire: the proxy recorded every reply the
model sent and every prompt the harness sent back, so a harness can name what a rollout must not do
(read the hidden tests, run ``git log --all``, edit a test file) as regexes, and get each offending
call flagged, without trusting the agent.

    actions = {"git_log_all": r"git log .*--all", "edit_tests": r'"path": "tests/'}  # replies
    results = {"hidden_tests": r"def test_hidden_"}                 # in what came back
    call 0: prompt "<task>"     reply tool call bash {"cmd": "cat tests/hidden.py"}
    call 1: prompt "<task>" + call 0 + "<tool>def test_hidden_a(): ..."
            (it extends call 0: only the last part is new)
            reply tool call bash {"cmd": "git log --oneline --all"}
    call 2: the same prompt as call 1 again (a retry): nothing new, nothing flagged twice
    -> scan(calls, actions, results, tok.decode) ==
       [{"kind": "audit", "what": "hidden_tests", "call": 1, "where": "result",
         "match": "<tool>def test_hidden_a(): ..."},
        {"kind": "audit", "what": "git_log_all", "call": 1, "where": "action",
         "match": 'bash {"cmd": "git log --oneline --all"}'}]

A reply is audited as its text and each tool call as ``name + " " + arguments``, not its reasoning
(thinking about a file is not reading it). A result is the prompt text a call added to what earlier
calls held (after its parent's prompt + response, or the longest prefix it shares with one: a
retry, a rewritten history), so each tool output is searched once. The task is new text too: a
result pattern should match what only a tool prints (the hidden tests).

A harness names its patterns in fields this file reads (the Harness base class has none):
``audit = {name: regex}`` over the replies, ``audit_results = {name: regex}`` over the tool
results, and ``zero_flagged = True`` for reward 0 on a rollout with any flag.

The hooks: at import this file adds ``setup`` to ``hooks.ROLLOUT_SETUP`` (an ``Auditor`` of
train.py's harnesses; a bad pattern fails there, before any rollout) and ``flag_rollouts`` to
``hooks.ROLLOUT_FILTERS`` (each batch of rollouts' flags).
"""

import json
import os
import re
from typing import Callable, Iterator

from .. import hooks
from ..records import Call, common_prefix, full_prompt

# characters of a flag's "match": the match and what surrounds it
CONTEXT = 200


def compile_patterns(patterns: dict[str, str]) -> dict[str, re.Pattern]:
    """name -> compiled regex; a bad one raises ValueError naming it (at start-up, not mid-run)."""
    out = {}
    for name, pattern in patterns.items():
        try:
            out[name] = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(
                f"audit pattern {name!r} = {pattern!r} is not a valid regular expression ({e}); "
                "fix it in the harness's audit patterns (Python `re` syntax)"
            ) from None
    return out


def escape_patterns(out_dir: str, home: str, port: int) -> dict[str, re.Pattern]:
    """What a sandboxed agent's commands must not name (kind "escape"; the sandbox makes them fail):
    the run's out dir, the trainer's HOME, another process's /proc, a loopback port but the proxy's.
    ``escape_patterns("/w/runs/x", "/root", 8000)["another local port"]`` finds ``curl
    localhost:9000``, not ``curl 127.0.0.1:8000/v1``."""
    # a HOME of / would match every path
    home = home.rstrip("/") or "/nonexistent-home"
    # (?![\w.-]): not a sibling such as /runs/xy
    patterns = {"the run's out dir": re.escape(os.path.abspath(out_dir)) + r"(?![\w.-])"}
    patterns["the trainer's HOME"] = re.escape(home) + r"(?![\w.-])"
    patterns["another process"] = r"/proc/(?!self\b|thread-self\b)\d+"
    patterns["another local port"] = rf"(?:127\.0\.0\.1|localhost|\[::1\]):(?!{port}\b)\d+"
    return compile_patterns(patterns)


def _new_in_prompts(calls: list[Call]) -> Iterator[tuple[Call, list[int]]]:
    """Each call (by index) with the prompt ids it added to what earlier calls of its rollout
    already held."""
    by_index = {c.index: c for c in calls}
    # index -> len(prompt + response): where a call extending it starts adding
    size: dict[int, int] = {}
    # (parent, ids added): a retry or choice 1.. of a request adds nothing new
    seen_tails: set[tuple] = set()
    earlier: list[Call] = []
    for c in sorted(calls, key=lambda c: c.index):
        # the proxy built this prompt on its parent's: the rest is what came back
        if c.parent in size:
            if c.prompt_ids is None:
                tail = c.prompt_tail
            else:
                tail = c.prompt_ids[size[c.parent] :]
            key = (c.parent, tuple(tail))
            new = tail
            if key in seen_tails:
                new = []
            seen_tails.add(key)
            prompt_len = size[c.parent] + len(tail)
        # rare (splits): skip what any earlier call's prompt + response already held
        else:
            prompt = c.prompt_ids
            if prompt is None:
                prompt = full_prompt(c, by_index)
            held = (full_prompt(e, by_index) + e.response_ids for e in earlier)
            done = max((common_prefix(prompt, ids) for ids in held), default=0)
            new = prompt[done:]
            prompt_len = len(prompt)
        size[c.index] = prompt_len + len(c.response_ids)
        earlier.append(c)
        yield c, new


def _actions(call: Call, decode: Callable[[list[int]], str]) -> list[str]:
    """What the model did in ``call``: its reply's text, then each tool call as ``name
    arguments``."""
    reply = call.response or {}
    if call.response is None:
        # a completions call has no parsed reply: its sampled text is what it did
        parts = [decode(call.response_ids)]
    else:
        parts = [reply.get("content") or ""]
    for tool_call in reply.get("tool_calls") or []:
        args = tool_call.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        parts.append(f"{tool_call.get('name')} {args}")
    return [part for part in parts if part]


def _flag(name: str, index: int, where: str, text: str, pattern) -> dict | None:
    """The flag of ``pattern``'s first match in ``text``, with up to CONTEXT characters around
    it."""
    if match := re.search(pattern, text):
        pad = max(0, (CONTEXT - (match.end() - match.start())) // 2)
        start = max(0, match.start() - pad)
        around = text[start : start + CONTEXT]
        return {"kind": "audit", "what": name, "call": index, "where": where, "match": around}
    return None


def scan(calls: list[Call], actions: dict, results: dict, decode: Callable) -> list[dict]:
    """The flags of ONE rollout for patterns ``actions`` and ``results`` (name -> regex, a string
    or compiled): {"kind": "audit", "what": name, "call": index, "where": "action" | "result",
    "match": up to 200 characters around the match}, at most one per (name, call, where), in call
    order (a call's result before its action: the harness sent it first). ``calls``: whole prompts
    (the proxy's) or as in a calls file (``prompt_ids`` None + ``prompt_tail``); ``decode``: token
    ids -> text (the tokenizer's decode)."""
    # the common case: nothing to decode
    if not actions and not results:
        return []
    flags = []
    for c, new in _new_in_prompts(calls):
        if new and results:
            text = decode(new)
            flags += [_flag(name, c.index, "result", text, p) for name, p in results.items()]
        parts = _actions(c, decode) if actions else []
        for name, pattern in actions.items():
            # the first part that matches: one flag per (name, call)
            found = (_flag(name, c.index, "action", part, pattern) for part in parts)
            flags.append(next(filter(None, found), None))
    return [f for f in flags if f]


class Auditor:
    """The flagging of train.py's rollouts: each harness's ``audit`` / ``audit_results`` patterns,
    and the escape patterns (kind "escape") for those whose rollouts run in a sandbox (the
    harness's ``sandbox``, as extras/sandbox.py set it)."""

    def __init__(self, harnesses, out_dir: str, port: int):
        # bad patterns raise ValueError here, before any rollout
        self.actions = {h.name: compile_patterns(getattr(h, "audit", {})) for h in harnesses}
        self.results = {
            h.name: compile_patterns(getattr(h, "audit_results", {})) for h in harnesses
        }
        self.zero_flagged = {h.name for h in harnesses if getattr(h, "zero_flagged", False)}
        escapes = escape_patterns(out_dir, os.path.expanduser("~"), port)
        # harness name -> its escape patterns: none for a harness that runs on the host
        self.escapes = {}
        for h in harnesses:
            sandbox = getattr(getattr(h, "sandbox", None), "name", "none")
            self.escapes[h.name] = {} if sandbox == "none" else escapes

    def flag(self, results, calls_of: dict[str, list[Call]], decode) -> None:
        """Add to each result's ``flags`` what its calls match (after what the proxy refused it,
        which train.py put there); a flagged rollout of a ``zero_flagged`` harness gets reward 0
        and no call rewards."""
        for r in results:
            actions = self.actions[r.harness]
            escapes = self.escapes[r.harness]
            calls = calls_of.get(r.rollout_id, [])
            found = scan(calls, {**actions, **escapes}, self.results[r.harness], decode)
            for f in found:
                if f["what"] in escapes:
                    f["kind"] = "escape"
            r.flags = r.flags + found
            if r.flags and r.harness in self.zero_flagged and r.reward is not None:
                r.reward = 0.0
                r.call_rewards = {}


# train.py's auditor: built before the first rollout (setup), used after each batch (flag_rollouts)
auditor = None


def setup(harnesses, args, server, log):
    """hooks.ROLLOUT_SETUP: the Auditor of train.py's harnesses. It runs after extras/sandbox.py's
    setup (train.py loads sandbox before audit, and the setups run in that order): the escape
    patterns are for the harnesses whose sandbox that setup chose."""
    global auditor
    auditor = Auditor(harnesses, args.out, server.port)


def flag_rollouts(results, calls_of, decode):
    """hooks.ROLLOUT_FILTERS: the audit's flags on a batch of rollouts, after what the proxy refused
    each (train.py put those in its ``flags``)."""
    auditor.flag(results, calls_of, decode)


hooks.ROLLOUT_SETUP.append(setup)
hooks.ROLLOUT_FILTERS.append(flag_rollouts)
