"""A training run seen in a browser (docs/training.md, "Seeing a run"): one HTML page written after
the run, or the live page served while it trains.

    python -m lightning_lite.extras.report RUN_DIR        # writes RUN_DIR/report.html
    python -m lightning_lite.extras.report RUN_DIR [RUN_DIR ...] --serve [--port 8765] [--host H]

metrics.jsonl says *that* the reward moved; the recorded calls say *why*. The trajectories are built
into samples by ``samples.build_samples`` exactly as train.py built them, and what is shown as
trained follows train.py's rule, from the files the run wrote: a rollout trains when it finished
and rollouts/step_K.jsonl gives it an advantage (``algo.assign_advantages`` keeps its samples, and
``rundir.step_counts`` counts their tokens as metrics.jsonl's ``trainable_tokens``), unless the
step's update was skipped (metrics ``skipped``) or, under --lora-per-harness, its harness's adapter's
(``skipped/NAME``). Each token is drawn as what it is: prompt, the opening of a forced call the
proxy wrote into the prompt, sampled freely or under a grammar (and forced by it), trained or not.
Both pages are one file that opens without a network (report.html; live.html, uPlot inlined).

A long agent run records gigabytes of prompt tokens, so report.html keeps the trajectories of at
most ``--max-batches`` batches (one step_K or eval_K, all ranks) and stores each sample as the ids
after its longest prefix shared with another sample of the batch (a system prompt once per batch),
gzip-compressed.

The live page's server only reads. It never writes into a run directory, answers GET alone, and
serves a file only from inside a run directory (a path that leaves it: 403; a missing one: 404). A
file being written is read as far as it is whole: a torn last line of a JSONL file (its writer is
mid-line, or was killed there) is skipped and said, a missing file is said, and neither is an
error. It shows what extras/recorder.py wrote, when the run had it (tokens/step_K.jsonl,
heartbeat.json), and says what is missing. Its routes, RUN being a run's index in the order given:

    GET /                              the page
    GET /api/runs                      [{run, name, dir}]
    GET /api/metrics?run=RUN&from=N    the rows of metrics.jsonl after its first N, how many it
                                       has, and what is missing or torn
    GET /api/status?run=RUN            its heartbeats (heartbeat*.json) and the files it lacks
    GET /api/batches?run=RUN           its steps and evaluations that have calls
    GET /api/batch?run=RUN&kind=step&k=K  a batch's rollouts and samples (``build_batch``), its
                                       token records (tokens/step_K*.jsonl) and the text of its ids
    GET /files/RUN/PATH                a file of the run directory, as it is

The hook: at import this file adds ``after_run`` to ``hooks.AFTER_RUN``: train.py's rank 0 writes
the report of the run it just finished.
"""

import argparse
import base64
import glob
import gzip
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Optional
from urllib.parse import parse_qs, unquote, urlparse

from tqdm import tqdm

from .. import hooks
from ..algo import assign_advantages
from ..chat import Renderer
from ..records import Call, common_prefix, find_batches, finite, read_calls, read_jsonl
from ..rundir import step_counts
from ..samples import build_samples

# A tool's name no tool has: a forced opening of it splits into what comes before and after a name.
NAME_MARK = "\x00"
HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "report.html")
PAGE = os.path.join(HERE, "live.html")
UPLOT = os.path.join(HERE, "uplot")
# The files a run directory holds once it has trained a step (docs/training.md: the run folder).
EXPECTED = ["config.json", "metrics.jsonl", "calls", "rollouts"]


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


class TokenKinds:
    """What a call's tokens are beyond their ids, found with the core's and the grammar's own code:
    how many of its prompt's last ids are the opening of a forced call (or JSON reply) that the
    proxy wrote there (``Renderer.forced_prefix``, encoded as the proxy encodes it, matched against
    the prompt's end: a call records that it was forced only through its grammar, and not at all
    without extras/grammar.py), and which of its response ids its grammar forced (its masks
    replayed as the trainer replays them; a mask that allows one token forced it). Without a
    tokenizer (``tok`` None) or a chat template, neither is found."""

    def __init__(self, tok, tool_format: Optional[str]):
        self.tok = tok
        self.renderer = None
        # (tool name, opened, JSON reply) -> the ids of that forced opening
        self.openings: dict = {}
        if tok is None:
            return
        try:
            self.renderer = Renderer(tok, tool_format=tool_format)
        # a tokenizer without a chat template, a format whose extra is missing, ...
        except Exception as e:
            why = f"cannot probe the chat template ({type(e).__name__}: {e})"
            print(f"report: {why}; forced openings are shown as prompt", file=sys.stderr)

    def opening_ids(self, name: Optional[str], opened: bool, json_reply: bool) -> list[int]:
        key = (name, opened, json_reply)
        if key not in self.openings:
            text = self.renderer.forced_prefix(name, opened, json_reply)
            self.openings[key] = self.renderer.encode(text)
        return self.openings[key]

    def forced_opening(self, call: Call) -> int:
        """How many of ``call``'s last prompt ids are a forced opening (0: none): a JSON reply's,
        a call of any tool's, or a call of the tool named between what every named opening has
        before and after the name (its reply may be cut before it parses); each tried after a
        closed reasoning block first, the longer text, and kept only where its ids end the
        prompt."""
        if self.renderer is None or not call.prompt_ids:
            return 0
        candidates = [(None, True), ("", False)]
        before, after = self.renderer.forced_prefix(NAME_MARK).split(NAME_MARK)
        # 64 ids: longer than any opening of a tool's name
        tail = self.tok.decode(call.prompt_ids[-64:], skip_special_tokens=False)
        at = tail.rfind(before)
        if at >= 0 and tail.endswith(after):
            candidates.append((tail[at + len(before) : len(tail) - len(after)], False))
        for name, json_reply in candidates:
            for opened in (True, False):
                ids = self.opening_ids(name, opened, json_reply)
                if ids and call.prompt_ids[-len(ids) :] == ids:
                    return len(ids)
        return 0

    def grammar_forced(self, call: Call) -> list[int]:
        """The positions in ``call``'s response where its grammar allowed that token alone
        (empty without a grammar, or without extras/grammar.py)."""
        if self.tok is None or isinstance(hooks.grammar, hooks.NoGrammar) or not call.grammar:
            return []
        n_vocab = len(self.tok)
        try:
            masks = hooks.grammar.replay(call.grammar, call.response_ids, self.tok, n_vocab)
        # a grammar this llguidance cannot read (a run of another version): no token marked
        except Exception as e:
            print(f"report: cannot replay a grammar ({type(e).__name__}: {e})", file=sys.stderr)
            return []
        allowed = hooks.grammar.unpack_bits(masks, n_vocab).sum(1).tolist()
        return [i for i, n in enumerate(allowed) if n == 1]


def training_of(kind: str, info: dict, row: Optional[dict], has_rollouts_file: bool) -> tuple:
    """Whether a rollout's samples were trained (True, False, None: unknown) and why not, by
    train.py's rule: it finished and has an advantage (rollouts/step_K.jsonl), and neither the
    step's update (metrics ``skipped``) nor its adapter's (``skipped/NAME``) was skipped."""
    if kind == "eval":
        return False, "an evaluation"
    if not has_rollouts_file:
        return None, "unknown: no rollouts/ file"
    # its calls were recorded, its line is missing (a rollouts file cut short)
    if info.get("unlisted"):
        return None, "unknown: rollouts/ has no line of it"
    if info["error"] is not None:
        return False, "it failed"
    if info["advantage"] is None:
        return False, "no advantage (a dropped group, or --loss sft below --sft-min-reward)"
    if row is None:
        return None, "unknown: metrics.jsonl has no row of this step (the run stopped in it)"
    if row.get("skipped"):
        return False, f"the step's update was skipped ({row['skipped']})"
    harness = info.get("harness") or ""
    if row.get(f"skipped/{harness}"):
        why = row[f"skipped/{harness}"]
        return False, f"adapter {harness}'s update was skipped ({why})"
    return True, ""


def rollout_view(
    calls: list[Call],
    info: dict,
    max_seq_len: Optional[int],
    seqs: list[list[int]],
    kinds: TokenKinds,
) -> tuple[dict, list, Counter]:
    """One rollout for the page: its result, its calls, and its samples; each sample's tokens are
    appended to ``seqs`` (the batch's token store) and referred to by position. Returns the view,
    the samples and their merge statistics (samples.build_samples's)."""
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
            # the last `forced` prompt ids: the forced opening the proxy wrote
            "forced": kinds.forced_opening(c),
            # sampled under a grammar, and where it allowed one token alone
            "constrained": bool(c.grammar),
            "grammar_forced": kinds.grammar_forced(c),
        }
        view["calls"].append(row)
    # a malformed record: show the rollout, say why it has no samples
    try:
        samples, stats = build_samples(calls, max_seq_len)
    except ValueError as e:
        samples = []
        stats = Counter()
        view["samples_error"] = str(e)
    for s in samples:
        view["samples"].append(dict(seq=len(seqs), calls=s.calls, mask=s.loss_mask, split=s.split))
        seqs.append(s.tokens)
    return view, samples, stats


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


def train_counts(infos: dict, calls: list[Call], finished: list, merge_stats: Counter) -> tuple:
    """The step's samples and trainable tokens as train.py counted them for metrics.jsonl: the
    finished rollouts' samples (``finished``) that ``algo.assign_advantages`` keeps under the
    advantages of rollouts/step_K.jsonl, summed by ``rundir.step_counts``. Returns (those counts,
    {rollout id: its trainable tokens})."""
    advantages = {}
    for rid, info in infos.items():
        advantage = info["advantage"]
        if advantage is None:
            continue
        # a per-call advantage: JSON's keys are strings, a sample's calls are indices
        if isinstance(advantage, dict):
            advantage = {int(k): v for k, v in advantage.items()}
        advantages[rid] = advantage
    kept = assign_advantages(finished, advantages)
    results = [SimpleNamespace(**{"flags": [], "harness": "", **info}) for info in infos.values()]
    # this process's files hold every rank's: nothing to reduce
    sums = step_counts(results, calls, kept, merge_stats, lambda values: values)
    counts = {"samples": int(sums["samples"]), "trainable_tokens": int(sums["trainable_tokens"])}
    trainable_of: dict[str, int] = defaultdict(int)
    for s in kept:
        trainable_of[s.rollout_id] += sum(s.loss_mask)
    return counts, trainable_of


def metrics_step(kind: str, k: int) -> int:
    """The step of the metrics row of the update a batch fed: step_K's is K + 1, eval_K's is K."""
    if kind == "step":
        return k + 1
    return k


def build_batch(
    files: dict[str, list[str]],
    config: dict,
    metrics: list[dict],
    kind: str,
    k: int,
    kinds: TokenKinds,
    notes: Optional[list] = None,
) -> dict:
    """Batch K's rollouts (from rollouts/ when the run wrote it, else from the calls alone), each
    said trained or not (``training_of``) by the metrics row of the update it fed (the last, if a
    Ctrl-C logged it twice); a step's counts as metrics.jsonl's (``train_counts``). ``files``:
    ``records.find_batches``'s; ``config``: config.json's; ``notes``: where a torn last line of a
    file is said (``records.read_jsonl``; None: warned)."""
    # an eval's samples were never trained on: none is cut
    max_seq_len = None
    if kind == "step":
        max_seq_len = config.get("max_seq_len")
    step = metrics_step(kind, k)
    rows = [r for r in metrics if r.get("step") == step and "eval_reward" not in r]
    row = None
    if rows:
        row = rows[-1]
    calls_of: dict[str, list[Call]] = defaultdict(list)
    # whole prompts: the page draws where each call's prompt ends
    for path in files["calls"]:
        for c in read_calls(path, whole=True, notes=notes):
            calls_of[c.rollout_id].append(c)
    infos = {
        r["rollout_id"]: r for path in files["rollouts"] for r in read_jsonl(path, None, notes)
    }
    has_rollouts_file = bool(files["rollouts"])
    # a rollout with no line in rollouts/: all but its id unknown
    unknown = dict.fromkeys(["task_id", "harness", "reward", "error", "seconds", "advantage"])
    for rid in calls_of:
        infos.setdefault(rid, {"rollout_id": rid, **unknown, "call_rewards": {}, "unlisted": True})
    every_call = [c for rollout_calls in calls_of.values() for c in rollout_calls]
    seqs: list[list[int]] = []
    rollouts = []
    # what train.py built samples of: the finished rollouts' calls (train.py make_samples)
    finished = []
    merge_stats: Counter = Counter()
    for rid, info in infos.items():
        view, samples, stats = rollout_view(calls_of.get(rid, []), info, max_seq_len, seqs, kinds)
        trained, why = training_of(kind, info, row, has_rollouts_file)
        view["trained"] = trained
        view["untrained_why"] = why
        rollouts.append(view)
        if info["error"] is None and rid in calls_of:
            finished += samples
            merge_stats.update(stats)
    batch = {"rollouts": rollouts, "seqs": share_prefixes(seqs)}
    batch["has_rollouts_file"] = has_rollouts_file
    # None: not a step of a run that wrote rollouts/ (an evaluation, an older run)
    batch["counts"] = None
    if kind == "step" and has_rollouts_file:
        counts, trainable_of = train_counts(infos, every_call, finished, merge_stats)
        for view in rollouts:
            view["trainable"] = trainable_of.get(view["rollout_id"], 0)
        trained = [view["trainable"] for view in rollouts if view["trained"]]
        counts["trained_tokens"] = sum(trained)
        batch["counts"] = counts
    return batch


def load_tok(model: Optional[str]):
    """The run's tokenizer, or None when it cannot be loaded: the page then shows ids."""
    # the extras a run's files may need, where this copy has them: a --model that names an embedded
    # model (its tokenizer resolved by embedded.py); a forced call's opening in its tool-call format
    # (tool_formats.py) and its grammar replayed (grammar.py), by TokenKinds
    hooks.load_extras(["embedded", "tool_formats", "grammar"])
    try:
        from ..models import load_tokenizer

        return load_tokenizer(model or "smollm2")
    # a hub name without a network, a missing package, ...
    except Exception as e:
        why = f"cannot load the tokenizer of {model!r} ({type(e).__name__}: {e})"
        print(f"report: {why}; showing token ids", file=sys.stderr)
        return None


def pack(obj) -> str:
    """gzip + base64: the page unpacks it with the browser's DecompressionStream."""
    packed = gzip.compress(json.dumps(obj, separators=(",", ":")).encode(), mtime=0)
    return base64.b64encode(packed).decode()


def read_config(run_dir: str) -> dict:
    """The run's config.json ({} where it is missing or not yet whole), a NaN in it as None: the
    pages' data is JSON."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        return json.load(open(path), parse_constant=lambda _: None)
    except json.JSONDecodeError:
        return {}


def write_report(run_dir: str, max_batches: int = 20) -> tuple[str, int, int]:
    """Write RUN_DIR/report.html; return its path, how many batches it holds, how many were
    found."""
    config = read_config(run_dir)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = []
    # a run of --steps 0 with no evaluation has no rows; no NaN: the page's data is JSON
    if os.path.isfile(metrics_path):
        metrics = [finite(row) for row in read_jsonl(metrics_path)]
    found = find_batches(run_dir)
    kept = spread(list(found), max_batches)
    batches = []
    tok = None
    if kept:
        tok = load_tok(config.get("model"))
    kinds = TokenKinds(tok, config.get("tool_format"))
    # the token ids the kept batches hold: the page shows each one's text
    ids = set()
    quiet = not sys.stderr.isatty()
    for kind, k in tqdm(kept, desc="report: building samples", unit="batch", disable=quiet):
        batch = build_batch(found[(kind, k)], config, metrics, kind, k, kinds)
        ids.update(t for seq in batch["seqs"] for t in seq["tail"])
        batch_row = {"kind": kind, "label": batch_label(kind, k)}
        batch_row["metrics_step"] = metrics_step(kind, k)
        batches.append({**batch_row, "blob": pack(batch)})
    # id -> text, each id decoded alone (a character split over two tokens shows as U+FFFD); None:
    # the tokenizer could not be loaded
    texts = {}
    if tok is not None:
        texts = {i: tok.decode([i]) for i in sorted(ids)}
    elif kept:
        texts = None
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


# ----------------------------------------------------------------------------- the live page
class Run:
    """One run directory as the server reads it; its tokenizer is loaded once, when a batch first
    needs it."""

    def __init__(self, index: int, run_dir: str):
        self.index = index
        self.dir = os.path.realpath(run_dir)
        self.name = os.path.basename(self.dir)
        self.lock = threading.Lock()
        self.kinds = None
        self.tok = None

    def missing(self) -> list[str]:
        return [name for name in EXPECTED if not os.path.exists(os.path.join(self.dir, name))]

    def rows(self, name: str, notes: list) -> list:
        """The objects of the run's JSONL file ``name`` (it may be being written) as far as it is
        whole: none where it is missing (``missing`` says so); a torn last line, or a bad line and
        every line after it, skipped and said in ``notes``, which name it from the run directory."""
        rows = []
        said = []
        path = os.path.join(self.dir, name)
        if not os.path.isfile(path):
            return rows
        try:
            for row in read_jsonl(path, None, said):
                rows.append(row)
        except ValueError as e:
            said.append(f"{e}: it and the lines after it skipped")
        notes += [note.replace(self.dir + os.sep, "") for note in said]
        return rows

    def token_kinds(self, config: dict):
        with self.lock:
            if self.kinds is None:
                self.tok = load_tok(config.get("model"))
                self.kinds = TokenKinds(self.tok, config.get("tool_format"))
            return self.kinds

    def warm(self):
        """Load the tokenizer now (it takes seconds), not at the page's first batch."""
        self.token_kinds(read_config(self.dir))

    def status(self) -> dict:
        beats = []
        notes = []
        for path in sorted(glob.glob(os.path.join(self.dir, "heartbeat*.json"))):
            try:
                beats.append(json.load(open(path)))
            except (OSError, json.JSONDecodeError) as e:
                notes.append(f"{os.path.basename(path)}: unreadable ({e})")
        return {"heartbeats": beats, "missing": self.missing(), "notes": notes}

    def batches(self) -> list[dict]:
        """Its steps and evaluations that have calls, and whether tokens/ has a step's records (the
        folder listed once: a glob per step took a second at 1,000 steps)."""
        recorded = find_batches(self.dir, ("tokens",))
        found = []
        for kind, k in find_batches(self.dir):
            label = batch_label(kind, k)
            has_tokens = (kind, k) in recorded
            found.append({"kind": kind, "k": k, "label": label, "tokens": has_tokens})
        return found

    def batch(self, kind: str, k: int) -> dict:
        """A batch as ``build_batch`` makes it for report.html (not packed), with its token records
        (tokens/step_K.jsonl, step_K.rankR.jsonl under DDP), each placed on its sample
        (``rollout``, ``sample``: indices into the rollouts and their samples; None where no sample
        has its calls and length), and the text of its ids."""
        config = read_config(self.dir)
        files = find_batches(self.dir).get((kind, k))
        if files is None:
            return {"error": f"no calls/{kind}_{k} files in {self.dir}"}
        # metrics.jsonl's torn line is said above the charts already
        metrics = self.rows("metrics.jsonl", [])
        kinds = self.token_kinds(config)
        notes = []
        try:
            batch = build_batch(files, config, metrics, kind, k, kinds, notes)
        except ValueError as e:
            return {"error": str(e)}
        records = []
        token_files = find_batches(self.dir, ("tokens",)).get((kind, k), {"tokens": []})
        for path in token_files["tokens"]:
            records += self.rows(os.path.relpath(path, self.dir), notes)
        place_records(batch, records)
        ids = set()
        for seq in batch["seqs"]:
            ids.update(seq["tail"])
        for record in records:
            ids.update(record["token"])
        texts = None
        if self.tok is not None:
            texts = {i: self.tok.decode([i]) for i in sorted(ids)}
        return {
            "kind": kind,
            "k": k,
            "label": batch_label(kind, k),
            "metrics_step": metrics_step(kind, k),
            **batch,
            "records": records,
            "vocab": texts,
            "notes": [note.replace(self.dir + os.sep, "") for note in notes],
        }


def place_records(batch: dict, records: list[dict]):
    """Set each token record's ``rollout`` and ``sample``: the sample of its rollout built from the
    same calls, of the same length (the trainer's sample, rebuilt from calls/ as train.py built
    it)."""
    where = {}
    for r, view in enumerate(batch["rollouts"]):
        for n, sample in enumerate(view["samples"]):
            where[(view["rollout_id"], tuple(sample["calls"]))] = (r, n, len(sample["mask"]))
    for record in records:
        record["rollout"] = None
        record["sample"] = None
        found = where.get((record["rollout_id"], tuple(record["calls"])))
        if found is not None and found[2] == record["len"]:
            record["rollout"] = found[0]
            record["sample"] = found[1]


def page_html() -> str:
    """live.html with uPlot's script and styles inlined (no network needed)."""
    html = open(PAGE).read()
    script = open(os.path.join(UPLOT, "uPlot.iife.min.js")).read().replace("</", "<\\/")
    css = open(os.path.join(UPLOT, "uPlot.min.css")).read()
    html = html.replace("/*UPLOT_CSS*/", css)
    return html.replace("/*UPLOT_JS*/", script)


class Handler(BaseHTTPRequestHandler):
    """GET only; every answer JSON but the page and the files."""

    runs: list = []
    page = ""

    def log_message(self, format, *args):
        # quiet: the page polls every few seconds
        pass

    def send(self, status: int, body: bytes, kind: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def json(self, obj, status: int = 200):
        """``obj`` as JSON; a NaN or inf (JSON has none: a file written by hand, an older run) as
        null."""
        try:
            text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
        except ValueError:
            text = json.dumps(finite(obj), separators=(",", ":"))
        self.send(status, text.encode(), "application/json")

    def refuse(self, status: int, message: str):
        self.json({"error": message}, status)

    def do_POST(self):
        self.refuse(405, "read-only: GET only")

    do_PUT = do_POST
    do_DELETE = do_POST

    def run_of(self, query: dict):
        """The run a query names (``run``, default 0), or None after answering 404."""
        try:
            index = int(query.get("run", ["0"])[0])
            return self.runs[index]
        except (ValueError, IndexError):
            self.refuse(404, f"no run {query.get('run')}; there are {len(self.runs)}")
            return None

    def do_GET(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        path = url.path
        if path == "/":
            self.send(200, self.page.encode(), "text/html; charset=utf-8")
            return
        if path == "/favicon.ico":
            self.send(204, b"", "image/x-icon")
            return
        if path.startswith("/files/"):
            self.file(unquote(path[len("/files/") :]))
            return
        routes = {
            "/api/runs": self.api_runs,
            "/api/metrics": self.api_metrics,
            "/api/status": self.api_status,
            "/api/batches": self.api_batches,
            "/api/batch": self.api_batch,
        }
        route = routes.get(path)
        if route is None:
            self.refuse(404, f"no route {path}")
            return
        route(query)

    def api_runs(self, query):
        runs = [{"run": run.index, "name": run.name, "dir": run.dir} for run in self.runs]
        self.json(runs)

    def api_metrics(self, query):
        run = self.run_of(query)
        if run is None:
            return
        start = int(query.get("from", ["0"])[0])
        notes = []
        rows = run.rows("metrics.jsonl", notes)
        self.json(
            {
                "rows": [finite(row) for row in rows[start:]],
                "lines": len(rows),
                "notes": notes,
                "missing": run.missing(),
                "config": read_config(run.dir),
            }
        )

    def api_status(self, query):
        run = self.run_of(query)
        if run is not None:
            self.json({"now": time.time(), **run.status()})

    def api_batches(self, query):
        run = self.run_of(query)
        if run is not None:
            self.json(run.batches())

    def api_batch(self, query):
        run = self.run_of(query)
        if run is None:
            return
        kind = query.get("kind", ["step"])[0]
        try:
            k = int(query.get("k", [""])[0])
        except ValueError:
            self.refuse(404, "k must be a step number")
            return
        self.json(run.batch(kind, k))

    def file(self, rest: str):
        """/files/RUN/PATH: the file as it is, from inside the run directory only."""
        head, _, relative = rest.partition("/")
        run = self.run_of({"run": [head]})
        if run is None:
            return
        full = os.path.realpath(os.path.join(run.dir, relative))
        if full != run.dir and not full.startswith(run.dir + os.sep):
            self.refuse(403, f"{relative} is outside the run directory")
            return
        if not os.path.isfile(full):
            self.refuse(404, f"no file {relative} in {run.dir}")
            return
        with open(full, "rb") as f:
            body = f.read()
        self.send(200, body, "application/octet-stream")


def make_server(run_dirs: list[str], host: str = "127.0.0.1", port: int = 8765):
    """The server of ``run_dirs`` (not yet serving: ``serve_forever``); port 0: any free one."""
    runs = [Run(i, run_dir) for i, run_dir in enumerate(run_dirs)]
    # each run's tokenizer loads now, in the background: the page's first batch need not wait
    for run in runs:
        threading.Thread(target=run.warm, daemon=True).start()
    handler = type("RunHandler", (Handler,), {"runs": runs, "page": page_html()})
    return ThreadingHTTPServer((host, port), handler)


def serve(run_dirs: list[str], host: str, port: int):
    server = make_server(run_dirs, host, port)
    url = f"http://{host}:{server.server_address[1]}/"
    print(f"serving {', '.join(run_dirs)} at {url} (read-only; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()


def main(argv: Optional[list[str]] = None) -> None:
    what = (
        "Write RUN_DIR/report.html: plots, config and a trajectory browser of a train.py run; "
        "or, with --serve, serve the live page of one or more runs while they train."
    )
    ap = argparse.ArgumentParser(prog="python -m lightning_lite.extras.report", description=what)
    help = "the --out folder of a train.py run (config.json, metrics.jsonl, calls/, rollouts/)"
    ap.add_argument("run_dir", nargs="+", help=help + "; several with --serve")
    help = "keep trajectories of at most this many steps/evals, evenly spaced (0: all); default 20"
    ap.add_argument("--max-batches", type=int, default=20, help=help)
    help = "serve the live page (read-only) instead of writing report.html"
    ap.add_argument("--serve", action="store_true", help=help)
    ap.add_argument("--port", type=int, default=8765, help="--serve: the port (0: any free one)")
    help = "--serve: the address (default loopback; another opens the page to that network)"
    ap.add_argument("--host", default="127.0.0.1", help=help)
    args = ap.parse_args(argv)
    if args.serve:
        # a run may not have begun yet: the page says what is missing
        serve(args.run_dir, args.host, args.port)
        return
    if len(args.run_dir) > 1:
        ap.error("one RUN_DIR at a time without --serve (the live page shows several)")
    args.run_dir = args.run_dir[0]
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
