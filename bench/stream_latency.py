"""Time to the first streamed content vs the whole answer, per API shape, on the embedded model.

    python bench/stream_latency.py [--tokens 64] [--repeat 3]
    python bench/stream_latency.py --smoke      # --tokens 4 --repeat 1: for the tests

Each shape gets the same prompt at temperature 0, streamed; the table shows the median time
to the first content delta, to the last byte, and the generated tokens. Run it on a quiet
machine: it measures wall-clock time.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# smollm2 by name and its fast decoding: extras, which train.py and proxy.py load too.
import lightning_lite.extras.embedded  # noqa: E402, F401
import lightning_lite.extras.responses  # noqa: E402, F401
import lightning_lite.extras.anthropic  # noqa: E402, F401
import lightning_lite.extras.completions  # noqa: E402, F401
import lightning_lite.extras.fast_decode  # noqa: E402, F401

PROMPT = "Tell me a long story about a dragon who learns to bake bread."
# The defaults --smoke sets (tests/test_bench.py runs it): a few seconds on a CPU.
SMOKE = {"tokens": 4, "repeat": 1}


def bodies(n):
    msgs = [{"role": "user", "content": PROMPT}]
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": "m", "messages": msgs, "max_tokens": n, "temperature": 0, "stream": True},
            '"delta": {"content": "',
        ),
        "responses": (
            "/v1/responses",
            {
                "model": "m",
                "input": PROMPT,
                "max_output_tokens": n,
                "temperature": 0,
                "stream": True,
            },
            "output_text.delta",
        ),
        "anthropic": (
            "/v1/messages",
            {"model": "m", "messages": msgs, "max_tokens": n, "temperature": 0, "stream": True},
            "text_delta",
        ),
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
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
    from lightning_lite.backends import HFBackend
    from lightning_lite.models import load_model, load_tokenizer
    from lightning_lite.proxy import Proxy, ProxyServer
    from lightning_lite.records import read_calls

    tok = load_tokenizer("smollm2")
    backend = HFBackend(load_model("smollm2").eval(), tok)
    out = tempfile.mkdtemp(prefix="stream-latency-")
    srv = ProxyServer(Proxy(backend, tok, out_dir=out)).start()
    print("| api | first content (s) | whole answer (s) | tokens |")
    print("|---|---|---|---|")
    try:
        for api, (path, body, marker) in bodies(a.tokens).items():
            firsts, totals = [], []
            for i in range(a.repeat):
                t0, first = time.time(), None
                with requests.post(
                    f"{srv.url}/rollout/bench-{api}-{i}{path}", json=body, stream=True
                ) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if first is None and marker in line.decode():
                            first = time.time() - t0
                if first is None:
                    sys.exit(f"{api}: the stream had no content delta ({marker!r})")
                firsts.append(first)
                totals.append(time.time() - t0)
            n = len(read_calls(os.path.join(out, "calls.jsonl"))[-1].response_ids)
            first_s, total_s = statistics.median(firsts), statistics.median(totals)
            print(f"| {api} | {first_s:.2f} | {total_s:.2f} | {n} |", flush=True)
    finally:
        # Also after a failed request: no server, thread or temporary folder left behind.
        srv.stop()
        backend.close()
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
