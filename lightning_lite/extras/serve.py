"""The live page of one or more runs, served while they train and after (docs/training.md, "Seeing a
run"):

    python -m lightning_lite.extras.report RUN_DIR [RUN_DIR ...] --serve [--port 8765] [--host H]

Its invariants: it only reads. It never writes into a run directory, answers GET alone, and serves a
file only from inside a run directory (a path that leaves it: 403; a missing one: 404). A file being
written is read as far as it is whole: a torn last line of a JSONL file (its writer is mid-line, or
was killed there) is skipped and said, a missing file is said, and neither is an error. The page
(live.html, with uPlot inlined: it needs no network) asks these routes, RUN being a run's index in
the order given:

    GET /                              the page
    GET /api/runs                      [{run, name, dir}]
    GET /api/metrics?run=RUN&from=N    the rows of metrics.jsonl after its N-th line, and what is
                                       missing or torn
    GET /api/status?run=RUN            its heartbeats (heartbeat*.json) and the files it lacks
    GET /api/batches?run=RUN           its steps and evaluations that have calls
    GET /api/batch?run=RUN&kind=step&k=K  a batch's rollouts and samples (report.build_batch), its
                                       token records (tokens/step_K*.jsonl) and the text of its ids
    GET /files/RUN/PATH                a file of the run directory, as it is
"""

import glob
import json
import os
import sys
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

from .. import hooks
from ..records import find_batches, finite
from . import report

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "live.html")
UPLOT = os.path.join(HERE, "uplot")
# The files a run directory holds once it has trained a step (README: the run directory).
EXPECTED = ["config.json", "metrics.jsonl", "calls", "rollouts"]


def read_lines(path: str, start: int = 0) -> tuple[list, int, list[str]]:
    """The JSON objects of a JSONL file from its ``start``-th line on, how many whole lines it has,
    and notes on what was skipped: a torn last line (no newline yet), a line that is not JSON. A
    missing file has no lines (the caller says it is missing)."""
    rows = []
    notes = []
    whole = 0
    if not os.path.isfile(path):
        return rows, whole, notes
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    # the text after the last newline: empty, or a line still being written
    tail = lines.pop()
    if tail.strip():
        notes.append(f"{os.path.basename(path)}: a torn last line ({len(tail)} bytes) skipped")
    for number, line in enumerate(lines, 1):
        whole = number
        if number <= start or not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            notes.append(f"{os.path.basename(path)}:{number}: not JSON ({e}), skipped")
            continue
        rows.append(row)
    return rows, whole, notes


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

    def config(self) -> dict:
        path = os.path.join(self.dir, "config.json")
        if not os.path.isfile(path):
            return {}
        try:
            return json.load(open(path), parse_constant=lambda _: None)
        except json.JSONDecodeError:
            return {}

    def missing(self) -> list[str]:
        return [name for name in EXPECTED if not os.path.exists(os.path.join(self.dir, name))]

    def token_kinds(self, config: dict):
        with self.lock:
            if self.kinds is None:
                self.tok = report.load_tok(config.get("model"))
                self.kinds = report.TokenKinds(self.tok, config.get("tool_format"))
            return self.kinds

    def warm(self):
        """Load the tokenizer now (it takes seconds), not at the page's first batch."""
        self.token_kinds(self.config())

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
        folder = os.path.join(self.dir, "tokens")
        recorded = set()
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                recorded.add(name.split(".")[0])
        found = []
        for kind, k in find_batches(self.dir):
            has_tokens = kind == "step" and f"step_{k}" in recorded
            label = report.batch_label(kind, k)
            found.append({"kind": kind, "k": k, "label": label, "tokens": has_tokens})
        return found

    def batch(self, kind: str, k: int) -> dict:
        """A batch as report.build_batch makes it for report.html (not packed), with its token
        records, each placed on its sample (``rollout``, ``sample``: indices into the rollouts and
        their samples; None where no sample has its calls and length), and the text of its ids."""
        config = self.config()
        files = find_batches(self.dir).get((kind, k))
        if files is None:
            return {"error": f"no calls/{kind}_{k} files in {self.dir}"}
        metrics_step = k
        if kind == "step":
            metrics_step = k + 1
        rows, _, _ = read_lines(os.path.join(self.dir, "metrics.jsonl"))
        rows = [r for r in rows if r.get("step") == metrics_step and "eval_reward" not in r]
        row = None
        if rows:
            row = rows[-1]
        max_seq_len = None
        if kind == "step":
            max_seq_len = config.get("max_seq_len")
        kinds = self.token_kinds(config)
        notes = []
        # a calls file being written has a torn last line: read_jsonl skips it with a warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                batch = report.build_batch(files, max_seq_len, kind, row, kinds)
            except ValueError as e:
                return {"error": str(e)}
        notes += [str(w.message) for w in caught]
        records = []
        if kind == "step":
            # step_K.jsonl, or step_K.rankR.jsonl under DDP
            pattern = os.path.join(self.dir, "tokens", f"step_{k}.*jsonl")
            for path in sorted(glob.glob(pattern)):
                lines, _, torn = read_lines(path)
                records += lines
                notes += torn
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
            "label": report.batch_label(kind, k),
            "metrics_step": metrics_step,
            **batch,
            "records": records,
            "vocab": texts,
            "notes": notes,
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
        path = os.path.join(run.dir, "metrics.jsonl")
        rows, lines, notes = read_lines(path, start)
        self.json(
            {
                "rows": [finite(row) for row in rows],
                "lines": lines,
                "notes": notes,
                "missing": run.missing(),
                "config": run.config(),
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
    # a run's --model may be an embedded model's name, its tokenizer resolved by that extra (and a
    # forced call's opening in its tool-call format, its grammar replayed), as report.py's main
    hooks.load_extras(["embedded", "tool_formats", "grammar"])
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
