"""Time to the first streamed content vs the whole answer, per API shape, on the embedded model.

    python bench/stream_latency.py [--tokens 64] [--repeat 3]

Each shape gets the same prompt at temperature 0, streamed; the table shows the median time
to the first content delta, to the last byte, and the generated tokens. Run it on a quiet
machine: it measures wall-clock time.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = "Tell me a long story about a dragon who learns to bake bread."


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
    a = ap.parse_args()
    from lightning_lite.backends import HFBackend
    from lightning_lite.models import load_model, load_tokenizer
    from lightning_lite.proxy import Proxy, ProxyServer
    from lightning_lite.records import read_calls

    tok = load_tokenizer("smollm2")
    backend = HFBackend(load_model("smollm2").eval(), tok)
    out = tempfile.mkdtemp(prefix="stream-latency-")
    srv = ProxyServer(Proxy(backend, tok, out_dir=out)).start()
    print(f"{'api':<10} {'first content (s)':>18} {'whole answer (s)':>17} {'tokens':>7}")
    for api, (path, body, marker) in bodies(a.tokens).items():
        firsts, totals = [], []
        for i in range(a.repeat):
            t0, first = time.time(), None
            with requests.post(
                f"{srv.url}/rollout/bench-{api}-{i}{path}", json=body, stream=True
            ) as r:
                for line in r.iter_lines():
                    if first is None and marker in line.decode():
                        first = time.time() - t0
            firsts.append(first)
            totals.append(time.time() - t0)
        n = len(read_calls(os.path.join(out, "calls.jsonl"))[-1].response_ids)
        print(
            f"{api:<10} {statistics.median(firsts):>18.2f} {statistics.median(totals):>17.2f} {n:>7}"
        )
    srv.stop()
    backend.close()


if __name__ == "__main__":
    main()
