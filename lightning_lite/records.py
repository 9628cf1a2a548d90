"""What the proxy records and what the trainer trains on, as plain dataclasses.

Two JSONL contracts (DESIGN.md) live here:

- ``calls.jsonl``: one :class:`Call` per LLM call (answered, or ``error`` / ``cancelled``); a call
  that extends its parent stores only the new prompt ids (``prompt_tail``; read it with ``read_calls``).
- ``samples.jsonl``: one :class:`Sample` per training sequence.

Both are written one JSON object per line so that a crashed run leaves every
line it finished readable, and so that ``jq`` and pandas read them directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Type, TypeVar

# Why a call did not simply extend an earlier call of its rollout (see samples.py).
SPLIT_REASONS = ("rewrote_history", "template_mismatch", "new_thread", "retry")
# Calls the proxy recorded but did not answer: the backend failed ("error": the rollout fails) or the
# client went away ("cancelled"). Their response is empty; samples skip them.
UNANSWERED = ("error", "cancelled")
# A run folder's per-batch files (train.py): calls|rollouts/step_K or eval_K, .rankR under DDP.
RUN_FILE = re.compile(r"(step|eval)_(\d+)(?:\.rank\d+)?\.jsonl")


@dataclass
class Call:
    """One answered LLM call, token-exact.

    ``prompt_ids`` are exactly the ids the backend consumed, ``response_ids``
    exactly the ids it sampled, ``response_logprobs[i]`` the logprob of
    ``response_ids[i]`` under the distribution it was sampled from.

    ``parent`` is the index of the earlier call of the same rollout whose
    ``prompt_ids + response_ids`` this call's prompt starts with, when the
    proxy reused the sampled tokens; ``split_hint`` says why it could not
    (one of ``SPLIT_REASONS``), or is None when there was nothing to extend.

    A request for ``n`` choices is recorded as n calls with consecutive indices
    and ``choice`` 0..n-1: call ``index - choice`` is its request's first.
    ``finish_reason`` is ``length`` whenever the per-call token cap cut the
    reply, even if what was written parses as a tool call; ``error`` or
    ``cancelled`` (``UNANSWERED``) for a call that got no answer.
    """

    rollout_id: str
    index: int
    api: str  # "chat" | "completions" | "responses" | "anthropic"
    model_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "tool_calls"; unanswered (never trained): "error" | "cancelled"
    choice: int = 0
    capped: bool = False  # the proxy's per-call cap (--max-new-tokens), not the request, cut the reply
    parent: Optional[int] = None
    split_hint: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    created: float = 0.0
    latency_s: float = 0.0
    response: Optional[dict] = None  # the assistant message the harness received


@dataclass
class Sample:
    """One training sequence: the tokens of one leaf of a rollout's prefix tree.

    ``loss_mask[i] == 1`` exactly where ``tokens[i]`` was sampled by the
    policy (and is trained in this sample); ``logprobs[i]`` is its recorded
    rollout logprob, 0.0 where the mask is 0. ``temperature[i]``, ``top_k[i]``,
    ``top_p[i]`` are the settings of the call that sampled ``tokens[i]`` (1.0, 0,
    1.0 where the mask is 0): the trainer scores each token under its own.
    ``model_version`` is the oldest version among its calls.
    """

    rollout_id: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantage: float = 0.0
    calls: list[int] = field(default_factory=list)  # indices of the calls merged into it
    split: Optional[str] = None  # why its first call began a new sample (SPLIT_REASONS); None: the rollout's first
    model_version: int = 0
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    version: list[int] = field(default_factory=list)  # the policy version that sampled each token (0 where the mask is 0)


T = TypeVar("T")


def to_json(obj: Any, **replace: Any) -> str:
    """One JSONL line for a dataclass or dict, with the fields in ``replace`` replaced or added."""
    # A shallow dict: dataclasses.asdict deep-copies every list element by element, which made writing
    # one 32k-token call 20 ms (the fields are already plain JSON values).
    d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else obj
    return json.dumps({**d, **replace}, separators=(",", ":"))


def from_dict(cls: Type[T], d: dict) -> T:
    """Build ``cls`` from a dict, ignoring keys it does not know (newer writers add fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def write_jsonl(path: str, items: Iterable[Any], append: bool = False) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with open(path, "a" if append else "w") as f:
        for it in items:
            f.write(to_json(it) + "\n")
            n += 1
    return n


def read_jsonl(path: str, cls: Optional[Type[T]] = None) -> Iterator[Any]:
    """Yield the objects of a JSONL file. A last line cut short by a crash (no newline, not JSON) is
    skipped with a warning: every line before it was complete. A bad line anywhere else is an error."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n") and not f.read():
                    warnings.warn(f"{path}:{lineno}: skipped a torn last line ({len(line)} bytes; the writer was killed mid-line)")
                    return
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); is this a calls/samples .jsonl file?") from None
            yield from_dict(cls, d) if cls is not None else d


def read_calls(path: str) -> list[Call]:
    """The calls of a calls.jsonl file, each with its whole ``prompt_ids``. The proxy writes a call whose
    prompt extends its parent's ``prompt_ids + response_ids`` as ``"prompt_ids": null`` and ``prompt_tail``
    (the ids after them), so a rollout of n turns writes each id once, not n times; they are joined here."""
    calls, seen = [], {}
    for d in read_jsonl(path):
        c = from_dict(Call, d)
        if d.get("prompt_tail") is not None:
            p = seen.get((c.rollout_id, c.parent))
            if p is None:
                raise ValueError(f"{path}: call {c.index} of rollout {c.rollout_id!r} extends call {c.parent}, which no earlier line holds")
            c.prompt_ids = p.prompt_ids + p.response_ids + d["prompt_tail"]
        seen[c.rollout_id, c.index] = c
        calls.append(c)
    return calls


def read_samples(path: str) -> list[Sample]:
    return list(read_jsonl(path, Sample))
