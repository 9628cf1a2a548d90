"""The two JSONL contracts of DESIGN.md as plain dataclasses: ``calls.jsonl`` (one :class:`Call` per
line) and ``samples.jsonl`` (one :class:`Sample`). A crashed run leaves every line it finished
readable, and ``jq`` or ``pandas.read_json(path, lines=True)`` read them as they are."""

import dataclasses
import json
import math
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

# Why a call did not simply extend an earlier call of its rollout (see samples.py).
SPLIT_REASONS = ("rewrote_history", "template_mismatch", "new_thread", "retry")
# Calls the proxy recorded but did not answer: the backend failed ("error": the rollout fails) or
# the client went away ("cancelled"). Their response is empty; samples skip them.
UNANSWERED = ("error", "cancelled")
# A run folder's per-batch files (train.py): calls|rollouts/step_K or eval_K, .rankR under DDP.
RUN_FILE = re.compile(r"(step|eval)_(\d+)(?:\.rank\d+)?\.jsonl")


@dataclass
class Call:
    """One LLM call, token-exact: the ids the backend consumed and sampled, and their logprobs under
    the distribution they were sampled from (each field: README, the Call and Sample contracts)."""

    rollout_id: str
    index: int
    # "chat" | "completions" | "responses" | "anthropic"
    api: str
    model_version: int
    # None: the call extends its parent (prompt_tail)
    prompt_ids: Optional[list[int]]
    response_ids: list[int]
    response_logprobs: list[float]
    # "stop" | "length" | "tool_calls"; unanswered (never trained): "error" | "cancelled"
    finish_reason: str
    # the n choices of one request are n calls with consecutive indices, choice 0..n-1
    choice: int = 0
    # the proxy's per-call cap (--max-new-tokens), not the request, cut the reply
    capped: bool = False
    # the call whose prompt_ids + response_ids the proxy built this prompt on
    parent: Optional[int] = None
    # why it extends no earlier call (SPLIT_REASONS); None: nothing to extend
    split: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    created: float = 0.0
    latency_s: float = 0.0
    # the assistant message the harness received
    response: Optional[dict] = None
    # with prompt_ids None: the prompt ids after the parent's prompt + response
    prompt_tail: Optional[list[int]] = None
    # the id the API gave its reply (chatcmpl-..., msg_..., resp_...): a reward may name the call by
    # it
    reply_id: Optional[str] = None
    # the grammar its response was sampled under (grammar.py: a forced call, a response_format)
    grammar: Optional[str] = None


@dataclass
class Sample:
    """One training sequence, a leaf of a rollout's prefix tree: ``loss_mask[i] == 1`` exactly where
    ``tokens[i]`` was sampled and is trained here, ``logprobs[i]``, ``temperature[i]``,
    ``top_k[i]``, ``top_p[i]`` its rollout logprob and the settings it was sampled with (0.0, 1.0,
    0, 1.0 where the mask is 0), ``call[i]`` the call that sampled it: a per-call reward reaches
    exactly that call's tokens."""

    rollout_id: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    # indices of the calls merged into it
    calls: list[int] = field(default_factory=list)
    # why its first call began a new sample (SPLIT_REASONS); None: the rollout's first
    split: Optional[str] = None
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    # the policy version that sampled each token (0 where the mask is 0)
    version: list[int] = field(default_factory=list)
    # the index of the call that sampled each token (-1 where the mask is 0)
    call: list[int] = field(default_factory=list)
    # each token's advantage (algo.assign_advantages; 0.0 where the mask is 0)
    advantages: list[float] = field(default_factory=list)
    # call index -> the grammar its tokens were sampled under (grammar.py), if any
    grammars: dict = field(default_factory=dict)


def to_json(obj: Any, **replace: Any) -> str:
    """One JSONL line for a dataclass or dict, with the fields in ``replace`` replaced or added."""
    # A shallow dict: dataclasses.asdict deep-copies every list element by element, which made
    # writing one 32k-token call 20 ms (the fields are already plain JSON values).
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return json.dumps({**obj, **replace}, separators=(",", ":"))


def from_dict(cls: type, d: dict) -> Any:
    """Build ``cls`` from a dict, ignoring keys it does not know (newer writers add fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def finite(value: Any) -> Any:
    """``value`` (a metrics row, any JSON value) with every NaN and inf in it, which JSON lacks, as
    None (not measured), in nested dicts and lists too: ``finite({"a": [1.0, nan]}) == {"a": [1.0,
    None]}``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_jsonl(path: str, items: Iterable[Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(to_json(it) + "\n" for it in items)


def read_jsonl(path: str, cls: Optional[type] = None, notes=None) -> Iterator[Any]:
    """Yield the objects of a JSONL file. A last line cut short (no newline, not JSON: its writer is
    mid-line, or was killed there) is skipped and said: appended to ``notes`` where given (a reader
    of a file still being written shows them), else warned. Every line before it was complete. A
    bad line elsewhere is an error."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n") and not f.read():
                    torn = f"{path}:{lineno}: a torn last line ({len(line)} bytes) skipped"
                    if notes is None:
                        warnings.warn(torn)
                    else:
                        notes.append(torn)
                    return
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e}); is this a calls/samples .jsonl file?"
                ) from None
            yield from_dict(cls, d) if cls is not None else d


def read_calls(path: str, whole: bool = False, notes=None) -> list[Call]:
    """The calls of a calls.jsonl file, as written: a call that extends its parent keeps
    ``prompt_ids`` None and ``prompt_tail`` (n turns of L tokens hold L ids, not n * L / 2).
    ``whole``: every call with its whole prompt. ``notes``: as ``read_jsonl``'s."""
    calls, seen = [], {}
    for c in read_jsonl(path, Call, notes):
        if c.prompt_ids is None:
            p = seen.get((c.rollout_id, c.parent))
            if p is None or c.prompt_tail is None:
                why = f"extends call {c.parent}, which no earlier line holds"
                why = "no prompt_tail" if c.prompt_tail is None else why
                where = f"{path}: call {c.index} of rollout {c.rollout_id!r}"
                raise ValueError(f"{where} has no prompt_ids, and {why}")
            if whole:
                c.prompt_ids, c.prompt_tail = p.prompt_ids + p.response_ids + c.prompt_tail, None
        seen[c.rollout_id, c.index] = c
        calls.append(c)
    return calls


def find_batches(run_dir: str, folders=("calls", "rollouts")) -> dict[tuple, dict[str, list[str]]]:
    """(kind, K) -> {"calls": files, "rollouts": files} over all ranks, in the order the run
    made them: eval_K before step_K (both use the policy after K updates; the eval ran first).
    ``folders``: which of the run's folders of per-batch files to look in."""
    found: dict = defaultdict(lambda: {sub: [] for sub in folders})
    for sub in folders:
        folder = os.path.join(run_dir, sub)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if m := RUN_FILE.fullmatch(name):
                found[(m[1], int(m[2]))][sub].append(os.path.join(folder, name))
    return dict(sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0] == "step")))


def common_prefix(a: list, b: list) -> int:
    """How many leading elements ``a`` and ``b`` share: ``common_prefix([1, 2, 3], [1, 2, 4]) ==
    2``. Compared in C, on slices: the shorter length first (one list extending the other, the usual
    case: one comparison), else a binary search."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def full_prompt(call: Call, calls: dict[int, Call]) -> list[int]:
    """The whole prompt ids of ``call``: its parents' prompt + response ids, then its
    ``prompt_tail``. ``calls``: the calls of its rollout by index (``{c.index: c for c in
    calls_of_the_rollout}``)."""
    parts = []
    while call.prompt_ids is None:
        if call.parent not in calls:
            where = f"call {call.index} of rollout {call.rollout_id!r}"
            raise ValueError(f"{where} extends call {call.parent}, which is not among its calls")
        parts.append(call.prompt_tail)
        call = calls[call.parent]
        parts.append(call.response_ids)
    return [i for p in [call.prompt_ids, *reversed(parts)] for i in p]


# How every line of a Call starts (to_json keeps the dataclass's field order): a file's calls are
# numbered without parsing the ids of each line.
_HEAD = re.compile(rb'\{"rollout_id":"([^"\\]*)","index":(\d+)[,}]')


def prepare_append(path: str) -> tuple[dict[str, int], int]:
    """Make a calls file ready for a writer that appends to it (a restarted proxy); return (each
    rollout's next free call index there: one past its highest, bytes cut off). A torn last line
    (its writer was killed mid-line) is cut off: the next record would be glued onto it, and the
    file unreadable."""
    nxt: dict[str, int] = {}
    if not os.path.exists(path):
        return nxt, 0
    with open(path, "r+b") as f:
        good = 0
        for line in f:
            if not line.endswith(b"\n"):
                break
            good += len(line)
            if m := _HEAD.match(line):
                rid = m[1].decode()
                nxt[rid] = max(nxt.get(rid, 0), int(m[2]) + 1)
        cut = f.seek(0, os.SEEK_END) - good
        if cut:
            f.truncate(good)
    return nxt, cut
