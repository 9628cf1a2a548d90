"""What our proxy adds to a call, next to a bare server and to LiteLLM's proxy; and how that grows with a conversation.

    python bench/proxy_overhead.py                          # both parts
    python bench/proxy_overhead.py --part latency --requests 2000 --concurrency 1,64
    python bench/proxy_overhead.py --part turns --turns 200
    python bench/proxy_overhead.py --no-litellm             # skip LiteLLM (and its install)
    python bench/proxy_overhead.py --smoke                  # both parts, small, no LiteLLM

Part 1, latency: a short chat request (system + user message, max_tokens 16), as JSON and
streamed (SSE), at each --concurrency, --requests per cell after --warmup, from an aiohttp
client in this process. Every server runs in its own process:

  direct          a bare aiohttp "fake engine" that answers at once with a fixed completion
                  (the same text, one SSE chunk per token, when streaming): the baseline
  lightning-lite  our Proxy in a ProxyServer, as train.py runs it, recording every call to
                  calls.jsonl in a temp dir, on an in-process backend that answers the same
                  tokens of the embedded model's tokenizer at once (each request its own rollout)
  litellm         LiteLLM's proxy (one uvicorn worker, its default; a master key, which it
                  needs to start, checked in memory: no database) with an openai/ model whose
                  api_base is the fake engine. Installed on first use into .venv-litellm at the
                  repo root (--litellm-spec, pinned to 1.106.12: 1.108.14 and 1.110.2 want
                  litellm-proxy / litellm-proxy-extras versions PyPI does not have, 1.107.x is
                  not on PyPI). A failed install or start is printed and its rows say so.

The table gives p50/p99 latency (last byte), requests/s, the latency added over direct, and
LiteLLM's added latency divided by ours. Not like for like in one respect: LiteLLM forwards
to the fake engine over one more local HTTP hop (what it always does), while our proxy
calls its backend in-process (what it does with the embedded backend). At high
concurrency the single client process is part of what is measured (it caps direct's req/s).

Part 2, turns: one agent conversation of --turns calls through our proxy (system + task,
then per turn: the assistant message exactly as the proxy returned it, a tool call, and the
tool's result of ~--tool-words words), once with reuse_tokens (train.py's setting) and once
with Proxy(reuse_tokens=False). Each call also goes, with the same body, to the fake engine;
the proxy's added ms is the difference, median over each --ranges turn range, with the
prompt length in tokens at the range's end. A flat added cost means appending a turn costs
the same whatever the conversation's length. It also prints the size of the conversation's
calls.jsonl against what it would be with every call's whole prompt written out.

Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# --model smollm2 by name needs the embedded-model extra (train.py and proxy.py load it too).
import lightning_lite.extras.embedded  # noqa: E402, F401
import lightning_lite.extras.tool_formats  # noqa: E402, F401
import lightning_lite.extras.grammar  # noqa: E402, F401
import lightning_lite.extras.fast_decode  # noqa: E402, F401

REPLY = "The capital of France is Paris."
TOOL_REPLY = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la src"}}\n</tool_call>'
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
WORDS = (
    "src",
    "main.py",
    "utils",
    "test",
    "config",
    "import",
    "def",
    "return",
    "error",
    "None",
    "self",
    "value",
    "-rw-r--r--",
    "1",
    "root",
    "4096",
    "Nov",
    "30",
    "data",
    "model",
    "json",
    "path",
    "file",
    "line",
)


# The defaults --smoke sets (tests/test_bench.py runs it): both parts in seconds, on loopback alone.
# LiteLLM is left out: its install needs the network.
SMOKE = {
    "requests": 20,
    "warmup": 5,
    "concurrency": "1,4",
    "no_litellm": True,
    "turns": 12,
    "ranges": "1-5,8-12",
}


# ---------------------------------------------------------------------- the servers (each in its own process)


def serve_engine(pieces):
    """The fake engine: POST /v1/chat/completions answers ``pieces`` joined, at once (SSE: a chunk per piece)."""
    from aiohttp import web

    text = "".join(pieces)

    async def chat(request):
        body = await request.json()  # a real server reads and parses the body too
        head = {
            "id": "chatcmpl-fake",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
        }
        usage = {
            "prompt_tokens": 20,
            "completion_tokens": len(pieces),
            "total_tokens": 20 + len(pieces),
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion",
                    "usage": usage,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                    ],
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        chunk = lambda delta, finish=None: (
            "data: "
            + json.dumps(
                {
                    **head,
                    "object": "chat.completion.chunk",
                    "choices": [  # noqa: E731
                        {"index": 0, "delta": delta, "finish_reason": finish}
                    ],
                }
            )
            + "\n\n"
        ).encode()
        await resp.write(chunk({"role": "assistant", "content": ""}))
        for p in pieces:
            await resp.write(chunk({"content": p}))
        await resp.write(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                (
                    "data: "
                    + json.dumps(
                        {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                    )
                    + "\n\n"
                ).encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run():
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(json.dumps({"port": site._server.sockets[0].getsockname()[1]}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def serve_ours(reply, out_dir, reuse):
    """Our proxy as train.py runs it (ProxyServer, recording to out_dir), on a backend that answers ``reply``'s tokens at once."""
    from lightning_lite.backends import Generation
    from lightning_lite.models import load_tokenizer
    from lightning_lite.proxy import Proxy, ProxyServer

    tok = load_tokenizer("smollm2")
    ids = tok.encode(reply, add_special_tokens=False)

    class FakeBackend:  # as in tests/test_faults.py
        eos_ids, version, stats = set(), 0, {}
        max_model_len = (
            10**7
        )  # the turns part runs past the model's context; nothing is computed on the ids

        async def generate(self, prompt_ids, sampling, on_token=None, rollout_id=""):
            for t in ids:
                if on_token:
                    on_token(t)
            return Generation(list(ids), [-0.1] * len(ids), "stop", reply, self.version)

    srv = ProxyServer(Proxy(FakeBackend(), tok, out_dir=out_dir, reuse_tokens=reuse)).start()
    print(json.dumps({"port": srv.port, "pieces": [tok.decode([t]) for t in ids]}), flush=True)
    threading.Event().wait()


def spawn(args, log_path):
    """Start this script in a --serve mode; return (process, the JSON line it printed once listening)."""
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdout=subprocess.PIPE,
        stderr=open(log_path, "w"),
        text=True,
    )
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(
            f"{args[:2]} did not start; {log_path}:\n{open(log_path).read()[-2000:]}"
        )
    return p, json.loads(line)


def stop(p):
    if p is not None and p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


# ---------------------------------------------------------------------- LiteLLM


def ensure_litellm(venv: str, spec: str) -> str:
    """The ``litellm`` executable of ``venv``, installed there first when missing. Raises with the pip log's tail."""
    exe = os.path.join(venv, "bin", "litellm")
    if os.path.exists(exe):
        return exe
    print(f"installing {spec} into {venv} (once; a few minutes) ...", flush=True)
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", venv], check=True)
        # This folder sits at the repo root and .gitignore only covers .venv/: keep git (and tools that copy
        # the untracked work tree) away from its thousands of files.
        with open(os.path.join(venv, ".gitignore"), "w") as f:
            f.write("*\n")
    log_path = os.path.join(venv, "pip-install.log")
    with open(log_path, "w") as log_file:
        r = subprocess.run(
            [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", spec],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    if r.returncode != 0 or not os.path.exists(exe):
        tail = "".join(line for line in open(log_path) if not line.startswith("WARNING"))[
            -1500:
        ]  # pip warns per index
        raise RuntimeError(
            f"pip install {spec!r} failed (exit {r.returncode}); {log_path} ends:\n{tail}"
        )
    return exe


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_litellm(exe, engine_url, tmp, timeout, key):
    """LiteLLM's proxy serving model "fake" from the fake engine; (process, url) once /health/liveliness answers."""
    port = free_port()
    cfg = os.path.join(tmp, "litellm.yaml")
    with open(cfg, "w") as f:  # JSON is YAML
        json.dump(
            {
                "model_list": [
                    {
                        "model_name": "fake",
                        "litellm_params": {
                            "model": "openai/fake",
                            "api_base": engine_url + "/v1",
                            "api_key": "sk-fake",
                        },
                    }
                ],
                "litellm_settings": {"drop_params": True},
                "general_settings": {"master_key": key},
            },
            f,
        )  # it refuses to start without one (no database: checked in memory)
    log_path = os.path.join(tmp, "litellm.log")
    # No network here: the cost map must not be fetched. LITELLM_LOG=ERROR also silences uvicorn's access log
    # (our proxy keeps none either).
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    p = subprocess.Popen(
        [exe, "--config", cfg, "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            raise RuntimeError(
                f"litellm exited ({p.returncode}); {log_path} ends:\n{open(log_path).read()[-1500:]}"
            )
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=2) as r:
                if r.status == 200:
                    return p, url
        except OSError:
            time.sleep(0.5)
    stop(p)
    raise RuntimeError(
        f"litellm not healthy after {timeout:.0f} s; {log_path} ends:\n{open(log_path).read()[-1500:]}"
    )


# ---------------------------------------------------------------------- the client


def row(*cells):
    """A markdown table row of ``cells``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def reply_text(raw, stream):
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    chunks = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
    ]
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )


async def cell(url_of, headers, body, concurrency, n, warmup):
    """n requests, ``concurrency`` at a time; returns (latencies s, requests/s). url_of(k): the k-th request's URL."""
    import aiohttp

    data, headers = json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    stream = body.get("stream", False)
    lat = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=120)
    ) as s:

        async def run(ks, out):
            async def worker():
                for k in ks:
                    t0 = time.perf_counter()
                    async with s.post(url_of(k), data=data, headers=headers) as r:
                        raw = await r.read()  # streamed: to the last byte
                    if r.status != 200 or (stream and b"[DONE]" not in raw):
                        raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
                    if (
                        k == -warmup and reply_text(raw, stream) != REPLY
                    ):  # once per cell: the whole reply got through
                        raise RuntimeError(f"got {reply_text(raw, stream)!r}, not {REPLY!r}")
                    out.append(time.perf_counter() - t0)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await run(iter(range(-warmup, 0)), [])  # shared iterator: workers take the next k
        t0 = time.perf_counter()
        await run(iter(range(n)), lat)
        wall = time.perf_counter() - t0
    return lat, n / wall


async def conversation(ours, engine, rid, a):
    """One agent conversation of a.turns calls; per call (ms through our proxy, ms direct, prompt tokens)."""
    import aiohttp

    rng = random.Random(a.seed)  # the same tool results in every run
    messages = [
        {
            "role": "system",
            "content": "You are a coding agent. Use the bash tool to inspect and fix the repository.",
        },
        {
            "role": "user",
            "content": "The tests in src/ fail with an ImportError. Find the cause and fix it.",
        },
    ]
    rows, headers = [], {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def post(url, data):
            t0 = time.perf_counter()
            async with s.post(url, data=data, headers=headers) as r:
                raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
            return (time.perf_counter() - t0) * 1e3, raw

        warm = json.dumps(
            {"model": "fake", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        ).encode()
        await post(
            f"{ours}/rollout/{rid}-warmup/v1/chat/completions", warm
        )  # first-call costs (template compile) stay out
        await post(f"{engine}/v1/chat/completions", warm)
        for _ in range(a.turns):
            data = json.dumps(
                {
                    "model": "fake",
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": 64,
                    "temperature": 0,
                }
            ).encode()
            t_ours, raw = await post(f"{ours}/rollout/{rid}/v1/chat/completions", data)
            t_direct, _ = await post(f"{engine}/v1/chat/completions", data)
            answer = json.loads(raw)
            msg = answer["choices"][0]["message"]
            rows.append((t_ours, t_direct, answer["usage"]["prompt_tokens"]))
            messages.append(msg)  # exactly as returned, as a harness does
            result = " ".join(rng.choice(WORDS) for _ in range(a.tool_words))
            if msg.get("tool_calls"):
                messages.append(
                    {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": result}
                )
            else:
                messages.append({"role": "user", "content": result})
    return rows


# ---------------------------------------------------------------------- the two parts


def latency_part(a, tmp, procs):
    ours_p, ours = spawn(
        ["--serve", "ours", "--reply", REPLY, "--out-dir", os.path.join(tmp, "ours")],
        os.path.join(tmp, "ours.log"),
    )
    procs.append(ours_p)
    engine_p, engine = spawn(
        ["--serve", "engine", "--pieces", json.dumps(ours["pieces"])],
        os.path.join(tmp, "engine.log"),
    )
    procs.append(engine_p)
    ours_url, engine_url = f"http://127.0.0.1:{ours['port']}", f"http://127.0.0.1:{engine['port']}"
    targets = {
        "direct": (lambda k: engine_url + "/v1/chat/completions", {}),
        "lightning-lite": (lambda k: f"{ours_url}/rollout/bench-{k}/v1/chat/completions", {}),
    }  # a rollout per request, as in training
    litellm_error = None
    if a.no_litellm:
        litellm_error = "skipped (--no-litellm)"
    else:
        try:
            exe = ensure_litellm(a.litellm_venv, a.litellm_spec)
            key = "sk-" + secrets.token_hex(32)
            p, url = start_litellm(exe, engine_url, tmp, a.litellm_timeout, key)
            procs.append(p)
            targets["litellm"] = (
                lambda k: url + "/v1/chat/completions",
                {"Authorization": f"Bearer {key}"},
            )
        except Exception as e:  # report and go on with the other rows
            print(f"litellm: {type(e).__name__}: {e}", flush=True)
            litellm_error = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:70]}; see above)"

    results = {}  # (stream, concurrency, target) -> (p50 ms, p99 ms, req/s) or an error string
    for stream in (False, True):
        for c in a.concurrency:
            body = {
                "model": "fake",
                "messages": MESSAGES,
                "max_tokens": 16,
                "temperature": 0,
                **({"stream": True} if stream else {}),
            }
            for name, (
                url_of,
                headers,
            ) in targets.items():  # interleaved: drift on a shared machine hits every row alike
                try:
                    lat, rps = asyncio.run(cell(url_of, headers, body, c, a.requests, a.warmup))
                    results[stream, c, name] = (pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, rps)
                except Exception as e:
                    results[stream, c, name] = f"failed: {type(e).__name__}: {str(e)[:80]}"

    print(
        f"\nPart 1: a short chat request ({a.requests} per cell after {a.warmup} warm-up), latency to the last byte\n"
    )
    print(
        "| mode | conc | target | p50 ms | p99 ms | req/s | +p50 ms | +p99 ms "
        "| litellm/ours +p50 | +p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stream in (False, True):
        for c in a.concurrency:
            base, ours_r = (
                results.get((stream, c, "direct")),
                results.get((stream, c, "lightning-lite")),
            )
            for name in ("direct", "lightning-lite", "litellm"):
                r = results.get((stream, c, name), litellm_error if name == "litellm" else None)
                cells = ["stream" if stream else "json", c, name]
                if isinstance(r, str) or r is None:
                    print(row(*cells, r))
                    continue
                p50, p99, rps = r
                cells += [f"{p50:.2f}", f"{p99:.2f}", f"{rps:.0f}"]
                if name != "direct" and isinstance(base, tuple):
                    cells += [f"{p50 - base[0]:.2f}", f"{p99 - base[1]:.2f}"]
                    if name == "litellm" and isinstance(ours_r, tuple):
                        ratio = lambda x, y: f"{x / y:.1f}x" if y > 0 else "n/a"  # noqa: E731
                        cells += [
                            ratio(p50 - base[0], ours_r[0] - base[0]),
                            ratio(p99 - base[1], ours_r[1] - base[1]),
                        ]
                print(row(*cells))
    # LiteLLM may fail to install or start (reported above); our proxy and the bare engine must not.
    failed = [k for k, r in results.items() if k[2] != "litellm" and isinstance(r, str)]
    if failed:
        sys.exit(f"{len(failed)} cells of direct or lightning-lite failed: see the table")


def turns_part(a, tmp, procs):
    from lightning_lite.records import read_calls, to_json

    engine_p, engine = spawn(
        ["--serve", "engine", "--pieces", json.dumps([TOOL_REPLY])],
        os.path.join(tmp, "engine-turns.log"),
    )
    procs.append(engine_p)
    engine_url = f"http://127.0.0.1:{engine['port']}"
    runs, merged = {}, {}
    for reuse in (True, False):
        out = os.path.join(tmp, f"turns-reuse-{reuse}")
        p, ours = spawn(
            ["--serve", "ours", "--reply", TOOL_REPLY, "--out-dir", out]
            + ([] if reuse else ["--no-reuse"]),
            os.path.join(tmp, f"ours-turns-{reuse}.log"),
        )
        procs.append(p)
        runs[reuse] = asyncio.run(
            conversation(f"http://127.0.0.1:{ours['port']}", engine_url, "agent", a)
        )
        stop(p)
        calls = [
            c
            for c in read_calls(os.path.join(out, "calls.jsonl"), whole=True)
            if c.rollout_id == "agent"
        ]
        merged[reuse] = sum(c.parent == c.index - 1 for c in calls[1:])
        if (
            reuse
        ):  # the conversation's bytes on disk, and with every call's whole prompt written out
            disk = sum(
                len(line)
                for line in open(os.path.join(out, "calls.jsonl"))
                if '"rollout_id":"agent"' in line
            )
            whole = sum(len(to_json(c)) + 1 for c in calls)

    ranges = []
    for r in a.ranges.split(","):
        lo, hi = (int(x) for x in r.split("-"))
        if lo <= a.turns:
            ranges.append((lo, min(hi, a.turns)))
    print(
        f"\nPart 2: one agent conversation of {a.turns} calls through our proxy (tool results of ~{a.tool_words} words);"
        "\nmedian ms per call over each turn range; added = through the proxy - the same body sent to the fake engine\n"
    )
    print(
        "| turns | prompt tok | reuse on: ms | added ms | reuse off: ms | added ms | prompt tok "
        "| direct ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for lo, hi in ranges:
        on, off = runs[True][lo - 1 : hi], runs[False][lo - 1 : hi]
        med = lambda rows, f: f"{statistics.median(f(r) for r in rows):.2f}"  # noqa: E731
        total, added, direct = (lambda r: r[0]), (lambda r: r[0] - r[1]), (lambda r: r[1])
        print(
            row(
                f"{lo}-{hi}",
                on[-1][2],
                med(on, total),
                med(on, added),
                med(off, total),
                med(off, added),
                off[-1][2],
                med(on + off, direct),
            )
        )
    print(
        f"\ncalls that extended the previous call's tokens (merge into one sample): "
        f"reuse on {merged[True]}/{a.turns - 1}, reuse off {merged[False]}/{a.turns - 1}"
    )
    print(
        f"calls.jsonl of the conversation (reuse on): {disk / 1e6:.2f} MB, each prompt id written once; "
        f"{whole / 1e6:.1f} MB with every call's whole prompt ({whole / disk:.0f}x)"
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=["both", "latency", "turns"], default="both")
    ap.add_argument("--requests", type=int, default=1000, help="measured requests per cell")
    ap.add_argument("--warmup", type=int, default=100, help="requests per cell before measuring")
    ap.add_argument("--concurrency", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--litellm-venv", default=os.path.join(ROOT, ".venv-litellm"))
    ap.add_argument(
        "--litellm-spec",
        default="litellm[proxy]==1.106.12",
        help="what pip installs into --litellm-venv",
    )
    ap.add_argument(
        "--litellm-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for LiteLLM to become healthy",
    )
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--ranges", default="1-10,30-40,100-110,190-200")
    ap.add_argument(
        "--tool-words", type=int, default=80, help="words per tool result (~1.5 tokens each)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds' run of every code path, for the tests: the numbers mean nothing",
    )
    # internal: this script started as one of the servers
    ap.add_argument("--serve", choices=["engine", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--pieces", help=argparse.SUPPRESS)
    ap.add_argument("--reply", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--no-reuse", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    if a.serve == "engine":
        return serve_engine(json.loads(a.pieces))
    if a.serve == "ours":
        return serve_ours(a.reply, a.out_dir, not a.no_reuse)

    tmp, procs = tempfile.mkdtemp(prefix="proxy-overhead-"), []
    try:
        if a.part in ("both", "latency"):
            latency_part(a, tmp, procs)
        if a.part in ("both", "turns"):
            turns_part(a, tmp, procs)
    finally:
        for p in procs:
            stop(p)
    print(f"\nserver logs and recorded calls: {tmp}")


if __name__ == "__main__":
    main()
