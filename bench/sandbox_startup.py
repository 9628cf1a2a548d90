"""What a sandbox adds to each rollout's start: the wall time of a trivial program run inside it, per sandbox.

    python bench/sandbox_startup.py                                  # none, bwrap, docker; 20 runs; concurrency 1 and 8
    python bench/sandbox_startup.py --sandboxes bwrap --runs 50 --concurrency 1,2,8
    python bench/sandbox_startup.py --image lightning-lite/sandbox:bookworm   # docker's image (make setup-sandbox builds it)
    python bench/sandbox_startup.py --smoke                          # none, bwrap where it works; 2 runs; concurrency 1 and 2

What is timed (lightning_lite.extras.sandbox.make(NAME).wrap(...), exec'd as the runner does, with env {"PATH": ...},
in a fresh temporary cwd):

  exit      ``python3 -c pass`` from the start of the host command to its exit: set-up, interpreter start, tear-down
            (docker: container created, started, removed by --rm).
  request   (bwrap, docker: ``none`` has no bridge) with ``socket=``/``port=`` (the proxy bridge): from the start
            of the host command until a tiny HTTP server on a host Unix socket (standard library, in this process)
            has answered the first request from inside, i.e. until the harness could make its first model call;
            the program inside retries until it gets an answer.
  exec      (docker) ``docker exec`` of ``python3 -c pass`` in a container started beforehand (``--network none``,
            ``sleep infinity``): what a warm pool of containers would still pay per rollout, next to ``exit``.

--runs per cell after one unmeasured warm-up run (its time is the "first" column), at each --concurrency: that many
threads each starting sandboxes back to back, as concurrent rollouts do. Columns: median and p90 per start, and
starts per second over the cell. Run it on a quiet machine: it measures wall-clock time.

Example output (2 shared cores, not quiet; Debian bookworm, docker.io 20.10.24 with overlay2, bubblewrap 0.8.0,
the image lightning-lite/sandbox:bookworm):

    | sandbox | conc | measure | first (s) | median (s) | p90 (s) | starts/s |
    |---|---|---|---|---|---|---|
    | none | 1 | exit | 0.027 | 0.016 | 0.018 | 56.6 |
    | none | 8 | exit | 0.018 | 0.064 | 0.081 | 107.2 |
    | bwrap | 1 | exit | 0.021 | 0.020 | 0.023 | 47.4 |
    | bwrap | 1 | request | 0.090 | 0.077 | 0.088 | 10.1 |
    | bwrap | 8 | exit | 0.022 | 0.069 | 0.105 | 94.3 |
    | bwrap | 8 | request | 0.078 | 0.333 | 0.382 | 19.5 |
    | docker | 1 | exit | 0.319 | 0.355 | 0.379 | 2.7 |
    | docker | 1 | request | 0.359 | 0.356 | 0.386 | 2.1 |
    | docker | 1 | exec | 0.095 | 0.109 | 0.145 | 8.7 |
    | docker | 8 | exit | 0.583 | 1.882 | 2.778 | 3.7 |
    | docker | 8 | request | 0.346 | 1.325 | 1.769 | 4.2 |
    | docker | 8 | exec | 0.113 | 0.645 | 0.738 | 13.3 |

and with --sandboxes bwrap,docker --concurrency 32 --runs 64 --measures request,exec (a batch of 32 rollouts
starting at once):

    | bwrap | 32 | request | 0.079 | 1.257 | 1.553 | 16.5 |
    | docker | 32 | request | 0.337 | 5.658 | 9.827 | 4.0 |
    | docker | 32 | exec | 0.114 | 2.345 | 4.070 | 12.9 |

bwrap costs a few ms over a bare process (+~55 ms for the bridge's own interpreter); docker ~0.35 s per start,
and dockerd/containerd/runc cap it at ~4 starts/s on 2 cores, so concurrent starts queue. Against a rollout of
tens of seconds to minutes that is ~1% one at a time; a warm pool (exec) would cut it ~3x.
"""

import argparse
import os
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_lite.extras import sandbox  # noqa: E402

# Runs inside: ask 127.0.0.1:PORT/ID until an HTTP answer comes back (a connection the bridge accepts but cannot
# pass on is closed at once: retry), for at most 30 s.
CLIENT = r"""
import socket, sys, time
port, rid = int(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"GET /{rid} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        if data.startswith(b"HTTP/1.0 200"):
            break
    except OSError:
        pass
    time.sleep(0.005)
else:
    sys.exit(f"no answer from 127.0.0.1:{port} in 30 s")
"""
PORT = 8000
# The defaults --smoke sets (tests/test_bench.py runs it): a second's run, without docker. A sandbox
# that does not work here (bwrap without bubblewrap) is skipped, as in any run.
SMOKE = {"sandboxes": "none,bwrap", "runs": 2, "concurrency": "1,2"}


class Answerer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A one-line HTTP server on a Unix socket that notes when it first answered each request id."""

    daemon_threads = True

    def __init__(self, path):
        self.answered = {}  # request id -> time.perf_counter() of its answer

        class Handler(socketserver.StreamRequestHandler):
            def handle(h):
                line = h.rfile.readline().decode()
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                h.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
                h.wfile.flush()
                self.answered.setdefault(line.split()[1].lstrip("/"), time.perf_counter())

        super().__init__(path, Handler)


def one_start(box, kind, measure, rid, tmp, image, server):
    """Seconds for one start (see the module docstring); raises with the sandbox's output when it failed."""
    cwd = tempfile.mkdtemp(dir=tmp)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": cwd}
    name = f"ll-bench-{os.getpid()}-{rid}" if kind == "docker" else None
    kw = dict(image=image, name=name)
    if measure == "exit":
        argv = box.wrap(["python3", "-c", "pass"], env, cwd, **kw)
    else:
        argv = box.wrap(
            ["python3", "-c", CLIENT, str(PORT), rid],
            env,
            cwd,
            socket=server.server_address,
            port=PORT,
            **kw,
        )
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            argv, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=120
        )
        t1 = time.perf_counter()
    finally:
        box.kill(name)
        shutil.rmtree(cwd, ignore_errors=True)
    if p.returncode:
        raise RuntimeError(
            f"{kind} {measure}: exit code {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}"
        )
    return (server.answered[rid] if measure == "request" else t1) - t0


def one_exec(cli, container):
    t0 = time.perf_counter()
    p = subprocess.run(
        [cli, "exec", container, "python3", "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if p.returncode:
        raise RuntimeError(f"docker exec: exit code {p.returncode}: {p.stderr.strip()}")
    return time.perf_counter() - t0


def cell(box, kind, measure, runs, conc, tmp, image, server):
    """The first (warm-up) time, every measured time, and starts/s, for `runs` starts on `conc` threads."""
    if measure == "exec":
        container = f"ll-bench-{os.getpid()}-pool"
        subprocess.run(
            [
                box.cli,
                "run",
                "-d",
                "--rm",
                "--network",
                "none",
                "--name",
                container,
                image,
                "sleep",
                "infinity",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        start = lambda i: one_exec(box.cli, container)  # noqa: E731
    else:
        start = lambda i: one_start(
            box, kind, measure, f"{kind}-{measure}-{conc}-{i}", tmp, image, server
        )  # noqa: E731
    try:
        first = start("warm")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            times = list(pool.map(start, range(runs)))
        return first, times, runs / (time.perf_counter() - t0)
    finally:
        if measure == "exec":
            box.kill(container)


def p90(xs):
    return sorted(xs)[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sandboxes", default="none,bwrap,docker", type=lambda s: s.split(","))
    ap.add_argument("--runs", type=int, default=20, help="measured starts per cell")
    ap.add_argument("--concurrency", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument(
        "--measures",
        default="exit,request,exec",
        type=lambda s: s.split(","),
        help="of exit, request, exec",
    )
    ap.add_argument("--image", default="lightning-lite/sandbox:bookworm", help="docker's image")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds' run of every code path, for the tests: the numbers mean nothing",
    )
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()

    # Outside HOME and /tmp's other users: bwrap makes HOME and /tmp private, then binds cwd and the socket back in.
    tmp = tempfile.mkdtemp(prefix="ll-sandbox-bench-")
    server = Answerer(os.path.join(tmp, "proxy.sock"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = []
    try:
        for kind in a.sandboxes:
            try:
                box = sandbox.make(kind)
            except ValueError as e:
                print(f"{kind}: skipped: {e}", file=sys.stderr)
                continue
            for conc in a.concurrency:
                for measure in a.measures:
                    if measure == "request" and kind == "none":
                        continue  # no bridge without a sandbox: the harness is given the proxy's own TCP URL
                    if measure == "exec" and kind != "docker":
                        continue
                    first, times, rate = cell(
                        box, kind, measure, a.runs, conc, tmp, a.image, server
                    )
                    rows.append(
                        (kind, conc, measure, first, statistics.median(times), p90(times), rate)
                    )
                    print(
                        f"  {kind} conc={conc} {measure}: median {rows[-1][4]:.3f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{a.runs} starts per cell after one warm-up ('first'); {os.cpu_count()} CPUs\n")
    print("| sandbox | conc | measure | first (s) | median (s) | p90 (s) | starts/s |")
    print("|---|---|---|---|---|---|---|")
    for kind, conc, measure, first, med, q90, rate in rows:
        print(f"| {kind} | {conc} | {measure} | {first:.3f} | {med:.3f} | {q90:.3f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
