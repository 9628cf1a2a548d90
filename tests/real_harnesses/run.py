"""Run the real harnesses (installed by install.sh) against the proxy, one task each.

    python tests/real_harnesses/run.py                        # all harnesses, both modes
    python tests/real_harnesses/run.py --only codex,opencode --mode scripted
    python tests/real_harnesses/run.py --mode model --max-model-len 32768

Modes:
  scripted  the policy is ScriptedBackend (scripted.py): one shell tool call, then
            "Done.". Passes when the harness exits 0, every HTTP request got a 2xx,
            and the calls of its main thread (those offering tools) merge into
            ONE sample.
  model     the embedded SmolLM2-135M (HFBackend). Passes when the harness exits 0
            within the timeout and every HTTP request got a 2xx (the tiny model
            may fail the task itself); its calls are recorded under its rollout.

The proxy runs in this process on a free port; each harness gets its own rollout
id, a fresh workspace and HOME, and a timeout after which its whole process
group is killed. Calls go to OUT/MODE/calls.jsonl, HTTP requests to
OUT/MODE/requests.jsonl, harness output to OUT/MODE/NAME.log. Prints one
table per mode; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]

from aiohttp import web  # noqa: E402

from commands import HARNESSES, command  # noqa: E402
from lightning_lite import hooks  # noqa: E402
from lightning_lite.models import load_tokenizer  # noqa: E402
from lightning_lite.proxy import Proxy, ProxyServer  # noqa: E402
from lightning_lite.records import read_calls  # noqa: E402
from lightning_lite.samples import build_samples  # noqa: E402
from scripted import ScriptedBackend  # noqa: E402

# The extras proxy.py serves with: the other APIs' routes, tool-call formats, grammars for forced
# calls, the embedded model by name and its fast decoding.
hooks.load_extras(
    ["responses", "anthropic", "completions", "tool_formats", "grammar", "embedded", "fast_decode"]
)

TASK = "Run `echo hello` in the shell, then reply Done."
RID = re.compile(r"^/rollout/([^/]+)(/.*)?$")
APIS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "anthropic",
    "/v1/completions": "completions",
}


class LoggingProxy(Proxy):
    """The project's Proxy, plus a log of every HTTP request: path, stream flag, status, error body."""

    requests: list[dict] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def log_requests(request: web.Request, handler):
            m = RID.match(request.path)
            entry = {
                "rid": m.group(1) if m else "default",
                "method": request.method,
                "path": (m.group(2) or "/") if m else request.path,
                "stream": None,
            }
            self.requests.append(entry)
            if request.method == "POST":
                try:  # aiohttp caches the body: the handler reads it again
                    entry["stream"] = bool(json.loads(await request.read()).get("stream"))
                except Exception:
                    pass
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                entry["status"], entry["error"] = e.status, (e.text or "")[:300]
                raise
            entry["status"] = resp.status
            if resp.status >= 400 and isinstance(resp, web.Response) and resp.body:
                entry["error"] = resp.body.decode(errors="replace")[:300]
            return resp

        app.middlewares.insert(0, log_requests)  # outermost: sees the final status
        return app


def make_backend(mode: str, tok, max_model_len: int | None, threads: int):
    if mode == "scripted":
        return ScriptedBackend(tok)
    import torch

    torch.set_num_threads(threads)
    from lightning_lite.backends import HFBackend
    from lightning_lite.models import load_model

    model = load_model(
        "smollm2", max_model_len=max_model_len
    ).eval()  # beyond 8192: YaRN-scaled RoPE
    return HFBackend(model, tok, max_model_len=max_model_len)


def run_harness(
    name: str, root: str, rid: str, task: str, log_path: str, timeout: float
) -> tuple[int | None, float]:
    """Start the harness in its own process group, wait, kill the group; return (exit code or None on timeout, seconds)."""
    tmp = tempfile.mkdtemp(prefix=f"harness-{name}-")
    work, home = os.path.join(tmp, "work"), os.path.join(tmp, "home")
    os.makedirs(work)
    os.makedirs(home)
    argv, env = command(name, root, rid, task, work, home)
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        p = subprocess.Popen(
            argv,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also on Ctrl-C / SIGTERM: end the harness and anything it left running
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    return rc, time.time() - t0


def last_line(path: str) -> str:
    lines = [l.strip() for l in open(path, errors="replace") if l.strip()]
    return lines[-1][:160] if lines else ""


def evaluate(name, mode, rc, secs, requests, calls, tok, log_path) -> dict:
    """One row of the table: what the harness sent, how its calls merged, pass or fail and why."""
    posts = [r for r in requests if r["method"] == "POST"]
    apis = sorted({APIS.get(r["path"].split("?")[0], r["path"]) for r in posts}) or [
        HARNESSES[name] + "?"
    ]
    streams = {r["stream"] for r in posts if r["stream"] is not None}
    main = [
        c for c in calls if "<tools>\n" in tok.decode(c.prompt_ids)
    ]  # the agent's thread: calls that offer tools
    _, st = build_samples(calls) if calls else (None, Counter())
    main_samples, main_st = build_samples(main) if main else ([], Counter())
    splits = ",".join(f"{k[6:]}={v}" for k, v in sorted(st.items()) if k.startswith("split_") and v)
    errors = [r for r in requests if r.get("status", 200) >= 400]
    reason = ""
    if errors:
        e = errors[0]
        msg = e.get("error", "")
        try:
            msg = json.loads(msg)["error"]["message"]
        except Exception:
            pass
        reason = f"HTTP {e['status']} {e['method']} {e['path']}: {msg}"[:200]
    elif rc is None:
        reason = "timeout"
    elif rc != 0:
        reason = f"exit {rc}: {last_line(log_path)}"
    elif not calls:
        reason = "no call recorded"
    elif mode == "scripted" and len(main) < 2:
        reason = f"main thread has {len(main)} call(s), expected the tool round trip (2)"
    elif mode == "scripted" and len(main_samples) != 1:
        reason = f"main thread split into {len(main_samples)} samples: " + ",".join(
            k[6:] for k, v in main_st.items() if k.startswith("split_") and v
        )
    return {
        "harness": name,
        "mode": mode,
        "api": "+".join(apis),
        "stream": {frozenset(): "-", frozenset([True]): "yes", frozenset([False]): "no"}.get(
            frozenset(streams), "mixed"
        ),
        "requests": len(requests),
        "calls": len(calls),
        "main": len(main),
        "samples": st["samples"],
        "main_samples": len(main_samples),
        "splits": splits or "-",
        "max_prompt": max((len(c.prompt_ids) for c in calls), default=0),
        "secs": round(secs, 1),
        "rc": rc,
        "ok": not reason,
        "reason": reason,
    }


def print_table(rows: list[dict]):
    cols = [
        ("harness", 16),
        ("mode", 8),
        ("api", 10),
        ("stream", 6),
        ("requests", 8),
        ("calls", 5),
        ("main", 4),
        ("samples", 7),
        ("main_samples", 12),
        ("splits", 16),
        ("max_prompt", 10),
        ("secs", 6),
    ]
    print(" ".join(f"{c:<{w}}" for c, w in cols) + " result")
    for r in rows:
        print(
            " ".join(f"{str(r[c]):<{w}}" for c, w in cols)
            + " "
            + ("PASS" if r["ok"] else "FAIL " + r["reason"])
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only", default="", help=f"comma-separated harnesses (default all): {','.join(HARNESSES)}"
    )
    ap.add_argument("--mode", choices=["scripted", "model", "both"], default="both")
    ap.add_argument("--task", default=TASK)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="model mode: context limit (default: the model's, 8192)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="model mode: cap on each answer's length"
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="model mode: CPU threads for the model (the harness needs CPU too)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per harness run (default 180 scripted, 900 model)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join("runs", "real-harnesses"),
        help="calls.jsonl, harness logs, results.json",
    )
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(HARNESSES)
    unknown = [n for n in names if n not in HARNESSES]
    if unknown:
        ap.error(f"unknown harness {unknown}; choose from {list(HARNESSES)}")
    modes = ["scripted", "model"] if a.mode == "both" else [a.mode]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in the finally blocks
    tok = load_tokenizer("smollm2")
    all_rows = []
    for mode in modes:
        out = os.path.join(a.out, mode)
        shutil.rmtree(out, ignore_errors=True)  # the proxy appends: start each mode afresh
        os.makedirs(out)
        backend = make_backend(mode, tok, a.max_model_len, a.torch_threads)
        # the trainer's per-call cap keeps CPU runs short (harnesses are told the reply is finished)
        proxy = LoggingProxy(
            backend,
            tok,
            model_name="smollm2",
            out_dir=out,
            max_new_tokens=a.max_tokens if mode == "model" else None,
        )
        proxy.requests = []
        server = ProxyServer(proxy, port=0).start()
        timeout = a.timeout or (180 if mode == "scripted" else 900)
        print(
            f"== mode {mode}: proxy on {server.url}, context {backend.max_model_len}, calls -> {out}/calls.jsonl",
            flush=True,
        )
        rows, t_mode = [], time.time()
        try:
            for name in names:
                rid = f"{mode}-{name}-{int(time.time())}"
                log_path = os.path.join(out, f"{name}.log")
                rc, secs = run_harness(name, server.url, rid, a.task, log_path, timeout)
                reqs = [r for r in proxy.requests if r["rid"] == rid]
                calls = [
                    c
                    for c in read_calls(os.path.join(out, "calls.jsonl"), whole=True)
                    if c.rollout_id == rid
                ]
                rows.append(evaluate(name, mode, rc, secs, reqs, calls, tok, log_path))
                r = rows[-1]
                print(
                    f"  {name:<16} {'PASS' if r['ok'] else 'FAIL'} {r['secs']:>6}s  {r['calls']} calls  {r['reason']}",
                    flush=True,
                )
        finally:
            server.stop()
            backend.close()
        print(f"\n{mode} mode: {time.time() - t_mode:.0f}s")
        print_table(rows)
        print()
        all_rows += rows
        with open(os.path.join(out, "requests.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in proxy.requests)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(all_rows, f, indent=1)
    failed = [f"{r['harness']}/{r['mode']}" for r in all_rows if not r["ok"]]
    print(
        f"{len(all_rows) - len(failed)}/{len(all_rows)} passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
