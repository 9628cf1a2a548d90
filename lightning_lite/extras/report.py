"""One HTML page to look at a training run (README: "Seeing a run"):

    python -m lightning_lite.extras.report RUN_DIR        # writes RUN_DIR/report.html

metrics.jsonl says *that* the reward moved; the recorded calls say *why*. The trajectories are built
into samples by ``samples.build_samples`` exactly as train.py built them, so what is highlighted as
trainable is what was trained. The page is one file that opens without a network (layout and
script: report.html).

A long agent run records gigabytes of prompt tokens, so the page keeps the trajectories of at most
``--max-batches`` batches (one step_K or eval_K, all ranks) and stores each sample as the ids after
its longest prefix shared with another sample of the batch (a system prompt once per batch),
gzip-compressed.

The hook: at import this file adds ``after_run`` to ``hooks.AFTER_RUN``: train.py's rank 0 writes
the report of the run it just finished.
"""

import argparse
import base64
import gzip
import json
import os
import sys
from collections import defaultdict
from typing import Optional

from tqdm import tqdm

from .. import hooks
from ..records import Call, common_prefix, find_batches, finite, read_calls, read_jsonl
from ..samples import build_samples

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.html")


def batch_label(kind: str, k: int) -> str:
    if kind == "eval":
        return f"eval at step {k} (calls/eval_{k})"
    return f"train step {k + 1} (calls/step_{k}: the rollouts update {k + 1} trained on)"


def spread(items: list, n: int) -> list:
    """At most n of items, evenly spaced, the first and the last always in (n <= 0: all)."""
    if n <= 0 or len(items) <= n:
        return items
    if n == 1:
        return items[-1:]
    return [items[i] for i in sorted({round(j * (len(items) - 1) / (n - 1)) for j in range(n)})]


def rollout_view(
    calls: list[Call], info: dict, max_seq_len: Optional[int], seqs: list[list[int]]
) -> dict:
    """One rollout for the page: its result, its calls, and its samples; each sample's
    tokens are appended to ``seqs`` (the batch's token store) and referred to by position."""
    calls = sorted(calls, key=lambda c: c.index)
    view = {**info, "calls": [], "samples": [], "samples_error": None}
    for c in calls:
        row = {
            "index": c.index,
            "parent": c.parent,
            "split": c.split,
            "choice": c.choice,
            "finish": c.finish_reason,
            "prompt": len(c.prompt_ids),
            "response": len(c.response_ids),
            "latency": c.latency_s,
            "version": c.model_version,
        }
        view["calls"].append(row)
    # a malformed record: show the rollout, say why it has no samples
    try:
        samples = build_samples(calls, max_seq_len)[0]
    except ValueError as e:
        samples = []
        view["samples_error"] = str(e)
    for s in samples:
        view["samples"].append(dict(seq=len(seqs), calls=s.calls, mask=s.loss_mask, split=s.split))
        seqs.append(s.tokens)
    return view


def share_prefixes(seqs: list[list[int]]) -> list[dict]:
    """Store each token sequence as {"base": [j, n], "tail": ids}: the first n tokens of
    sequence j, then tail. Sorted lexicographically, a sequence's longest common prefix with
    any other is with a neighbour, so comparing each with the one sorted before it is enough."""
    out = [{"tail": s} for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    for prev, cur in zip(order, order[1:]):
        n = common_prefix(seqs[prev], seqs[cur])
        if n >= 16:
            out[cur] = {"base": [prev, n], "tail": seqs[cur][n:]}
    return out


def build_batch(files: dict[str, list[str]], max_seq_len: Optional[int]) -> dict:
    """One batch's rollouts (from rollouts/ when the run wrote it, else from the calls alone)."""
    calls_of: dict[str, list[Call]] = defaultdict(list)
    # whole prompts: the page draws where each call's prompt ends
    for path in files["calls"]:
        for c in read_calls(path, whole=True):
            calls_of[c.rollout_id].append(c)
    infos = {r["rollout_id"]: r for path in files["rollouts"] for r in read_jsonl(path)}
    # a rollout with no line in rollouts/: all but its id unknown
    unknown = dict.fromkeys(["task_id", "harness", "reward", "error", "seconds", "advantage"])
    for rid in calls_of:
        infos.setdefault(rid, {"rollout_id": rid, **unknown, "call_rewards": {}})
    seqs: list[list[int]] = []
    rollouts = [
        rollout_view(calls_of.get(rid, []), info, max_seq_len, seqs) for rid, info in infos.items()
    ]
    return {
        "rollouts": rollouts,
        "seqs": share_prefixes(seqs),
        "has_rollouts_file": bool(files["rollouts"]),
    }


def token_texts(model: Optional[str], ids: set[int]) -> Optional[dict[int, str]]:
    """id -> text, each id decoded alone (a character split over two tokens shows as U+FFFD).
    None when the run's tokenizer cannot be loaded: the page then shows ids."""
    try:
        from ..models import load_tokenizer

        tok = load_tokenizer(model or "smollm2")
    # a hub name without a network, a missing package, ...
    except Exception as e:
        why = f"cannot load the tokenizer of {model!r} ({type(e).__name__}: {e})"
        print(f"report: {why}; showing token ids", file=sys.stderr)
        return None
    return {i: tok.decode([i]) for i in sorted(ids)}


def pack(obj) -> str:
    """gzip + base64: the page unpacks it with the browser's DecompressionStream."""
    packed = gzip.compress(json.dumps(obj, separators=(",", ":")).encode(), mtime=0)
    return base64.b64encode(packed).decode()


def write_report(run_dir: str, max_batches: int = 20) -> tuple[str, int, int]:
    """Write RUN_DIR/report.html; return its path, how many batches it holds, how many were
    found."""
    config_path = os.path.join(run_dir, "config.json")
    # The page's data is JSON: no NaN, in the config or in the metrics.
    config = {}
    if os.path.isfile(config_path):
        config = json.load(open(config_path), parse_constant=lambda _: None)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = []
    # a run of --steps 0 with no evaluation has no rows
    if os.path.isfile(metrics_path):
        metrics = [finite(row) for row in read_jsonl(metrics_path)]
    found = find_batches(run_dir)
    kept = spread(list(found), max_batches)
    batches = []
    # the token ids the kept batches hold: the page shows each one's text
    ids = set()
    quiet = not sys.stderr.isatty()
    for kind, k in tqdm(kept, desc="report: building samples", unit="batch", disable=quiet):
        # an eval's samples were never trained on: none is cut
        max_seq_len = None
        if kind == "step":
            max_seq_len = config.get("max_seq_len")
        batch = build_batch(found[(kind, k)], max_seq_len)
        ids.update(t for seq in batch["seqs"] for t in seq["tail"])
        # the metrics row of a step's update is step K + 1; an eval's is its step
        metrics_step = k
        if kind == "step":
            metrics_step = k + 1
        batch_row = {"kind": kind, "label": batch_label(kind, k), "metrics_step": metrics_step}
        batches.append({**batch_row, "blob": pack(batch)})
    texts = {}
    if ids:
        texts = token_texts(config.get("model"), ids)
    data = {"run_dir": os.path.abspath(run_dir), "config": config, "metrics": metrics}
    data["batches"] = batches
    data["batches_found"] = len(found)
    # None: the tokenizer could not be loaded (the page shows ids)
    data["vocab"] = None
    if texts is not None:
        data["vocab"] = pack(texts)
    # "</" inside a <script> would end it early (a config string, a token text).
    script = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    out = os.path.join(run_dir, "report.html")
    with open(out, "w") as f:
        f.write(open(TEMPLATE).read().replace("/*DATA*/null", script))
    return out, len(kept), len(found)


def main(argv: Optional[list[str]] = None) -> None:
    what = "Write RUN_DIR/report.html: plots, config and a trajectory browser of a train.py run."
    ap = argparse.ArgumentParser(prog="python -m lightning_lite.extras.report", description=what)
    help = "the --out folder of a train.py run (config.json, metrics.jsonl, calls/, rollouts/)"
    ap.add_argument("run_dir", help=help)
    help = "keep trajectories of at most this many steps/evals, evenly spaced (0: all); default 20"
    ap.add_argument("--max-batches", type=int, default=20, help=help)
    args = ap.parse_args(argv)
    # a run's --model may be an embedded model's name, its tokenizer resolved by that extra
    hooks.load_extras(["embedded"])
    if not os.path.isfile(os.path.join(args.run_dir, "metrics.jsonl")):
        why = " has no metrics.jsonl" if os.path.isdir(args.run_dir) else ": no such folder"
        ap.error(
            f"{args.run_dir}{why}; pass the --out folder of a train.py run "
            "(config.json, metrics.jsonl, calls/step_K.jsonl, rollouts/step_K.jsonl)"
        )
    path, n, total = write_report(args.run_dir, args.max_batches)
    kept = f"trajectories of {n} of {total} steps/evals"
    kept += " (--max-batches 0 keeps all)" if n < total else ""
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB; {kept})")


def after_run(run_dir: str) -> None:
    """hooks.AFTER_RUN: the report of the run train.py just finished."""
    print(f"wrote {write_report(run_dir)[0]}: plots and trajectories, open it in a browser")


hooks.AFTER_RUN.append(after_run)

if __name__ == "__main__":
    main()
