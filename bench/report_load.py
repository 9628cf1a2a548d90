"""How long the live page takes to load a long run: a run directory synthesized (not trained) with
--steps steps of --rollouts rollouts each, served by the report's server, opened in headless
Chromium until its charts are drawn and the newest step's rollouts are listed.

    python bench/report_load.py                       # 200 and 1,000 steps of 64 rollouts
    python bench/report_load.py --steps 1000 --rollouts 64
    python bench/report_load.py --smoke               # 20 steps of 8 rollouts, seconds

Each rollout has two calls (the second extends the first, as an agent's turn does), a reward and an
advantage; each step has a metrics row and a tokens/step_K.jsonl of 12 samples' per-token numbers,
as extras/recorder.py writes them. The table gives the synthesized sizes, the seconds to the page's
first full draw (``body[data-ready]``: metrics fetched and plotted, the heartbeat read, the newest
step's rollouts, samples and token records built by the server and drawn), and the size of the token
files per 1,000 trained tokens. Without Chromium or playwright it times the server's routes alone
and says so. Run it on a quiet machine: it measures wall-clock time. The page's load time is
measured here alone: tests/test_report.py checks that a 200-step run's page draws, not how fast.
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_lite.records import Call, to_json  # noqa: E402
from lightning_lite.samples import build_samples  # noqa: E402

# Ids of ordinary tokens of the embedded model's tokenizer (SmolLM2: 49,152 ids).
LOW, HIGH = 1000, 30000
PROMPT, TAIL, RESPONSE = 60, 20, 24


# Drawn once: each call's ids are a slice of it at a random place (drawing every id took seconds).
POOL = random.Random(0).choices(range(LOW, HIGH), k=65536)
LOGPROBS = [round(-x, 4) for x in random.Random(1).choices([i / 997 for i in range(997)], k=4096)]


def ids_at(rng: random.Random, n: int) -> list[int]:
    start = rng.randrange(len(POOL) - n)
    return POOL[start : start + n]


def make_calls(rid: str, rng: random.Random, version: int) -> list[Call]:
    """Two calls of a rollout: a prompt and a reply, then a tool's output and a second reply."""
    prompt = ids_at(rng, PROMPT)
    first = ids_at(rng, RESPONSE)
    tail = ids_at(rng, TAIL)
    second = ids_at(rng, RESPONSE)
    start = rng.randrange(len(LOGPROBS) - RESPONSE)
    logprobs = LOGPROBS[start : start + RESPONSE]
    common = dict(rollout_id=rid, api="chat", model_version=version, finish_reason="stop")
    a = Call(index=0, prompt_ids=prompt, response_ids=first, response_logprobs=logprobs, **common)
    b = Call(
        index=1,
        prompt_ids=prompt + first + tail,
        response_ids=second,
        response_logprobs=logprobs,
        parent=0,
        **common,
    )
    return [a, b]


def token_line(step: int, sample, advantage: float, rng: random.Random, why: str) -> dict:
    """A tokens/ line as extras/recorder.py writes it, with made-up trainer numbers."""
    positions = [p for p, m in enumerate(sample.loss_mask) if m]
    old = [sample.logprobs[p] for p in positions]
    new = [round(x + rng.gauss(0, 0.01), 6) for x in old]
    ratio = [round(2.718281828459045 ** (n - o), 6) for n, o in zip(new, old)]
    dlogp = [abs(n - o) for n, o in zip(new, old)]
    # from a generator of its own: the run's other numbers stay those ``rng`` drew without it
    own = random.Random(sample.rollout_id)
    entropy = [round(own.uniform(0, 3), 6) for _ in positions]
    return {
        "step": step,
        "rank": 0,
        "rollout_id": sample.rollout_id,
        "calls": sample.calls,
        "split": sample.split,
        "len": len(sample.tokens),
        "weight": 0.01,
        "dlogp_max": round(max(dlogp), 6),
        "trained": len(positions),
        "pos": positions,
        "token": [sample.tokens[p] for p in positions],
        "logprob": new,
        "old": old,
        "ratio": ratio,
        "clipped": [int(r > 1.28 or r < 0.8) for r in ratio],
        "adv": [advantage] * len(positions),
        "entropy": entropy,
        "call": [sample.call[p] for p in positions],
        "version": [sample.version[p] for p in positions],
        "why": why,
    }


def write_run(out: str, steps: int, rollouts: int, seed: int = 0) -> dict:
    """A run directory of ``steps`` steps of ``rollouts`` rollouts (groups of 4); returns its
    sizes. Every step's calls and token records are one step's, under its own rollout ids (JSON
    encoding each step anew took most of the time); rewards and metrics differ by step."""
    rng = random.Random(seed)
    for sub in ("calls", "rollouts", "tokens"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    config = {"model": "smollm2", "steps": steps, "batch_size": rollouts // 4, "group_size": 4}
    config["max_seq_len"] = 4096
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    # one step's calls and the recorder's selection (12 samples), "@@" standing for the step
    calls = []
    for r in range(rollouts):
        calls += make_calls(f"s@@-r{r}", rng, 0)
    calls_text = "".join(to_json(c) + "\n" for c in calls)
    lines = []
    for r in range(min(12, rollouts)):
        samples, _ = build_samples(calls[2 * r : 2 * r + 2])
        why = "worst"
        if r >= 8:
            why = "random"
        advantage = 0.5 - (r % 2)
        lines.append(token_line(-1, samples[0], advantage, rng, why))
    tokens_text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    trained_per_step = sum(line["trained"] for line in lines)
    metrics = []
    token_bytes = 0
    for k in range(steps):
        with open(os.path.join(out, "calls", f"step_{k}.jsonl"), "w") as f:
            f.write(calls_text.replace("s@@-", f"s{k}-"))
        text = tokens_text.replace("s@@-", f"s{k}-").replace('"step":-1', f'"step":{k}')
        with open(os.path.join(out, "tokens", f"step_{k}.jsonl"), "w") as f:
            f.write(text)
        token_bytes += len(text.encode())
        infos = []
        for r in range(rollouts):
            rid = f"s{k}-r{r}"
            reward = float(rng.random() < 0.5)
            info = {"rollout_id": rid, "task_id": f"t{k}-{r // 4}", "reward": reward}
            info.update(error=None, seconds=round(rng.uniform(1, 9), 2), call_rewards={})
            info.update(harness="calc", flags=[], advantage=0.5 - (r % 2))
            infos.append(info)
        with open(os.path.join(out, "rollouts", f"step_{k}.jsonl"), "w") as f:
            f.writelines(json.dumps(i) + "\n" for i in infos)
        reward = sum(i["reward"] for i in infos) / rollouts
        row = {"step": k + 1, "reward": reward, "success": reward, "rollouts": rollouts}
        row.update(failed=0, loss=rng.gauss(0, 0.01), grad_norm=rng.uniform(0.1, 1.0))
        row.update(dlogp_mean=rng.uniform(1e-4, 1e-3), dlogp_max=rng.uniform(0.01, 0.1))
        row.update(lr=1e-5, t_rollout=5.0, t_train=2.0, t_sync=0.1, time=1.7e9 + 10 * k)
        row.update(trainable_tokens=rollouts * 2 * RESPONSE, samples=rollouts)
        metrics.append(row)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in metrics)
    per_1000 = 1000 * token_bytes / max(trained_per_step * steps, 1)
    return {"steps": steps, "rollouts": rollouts, "token_bytes_per_1000": per_1000}


def start_server(run_dir: str):
    """The live page's server on a free loopback port, in a thread; returns (server, url)."""
    from lightning_lite.extras.report import make_server

    server = make_server([run_dir], "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browser_seconds(url: str):
    """Seconds from opening the page to its first full draw, in headless Chromium (None: no
    browser here)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        return None
    args = ["--headless", "--no-sandbox", "--disable-gpu"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
        page = browser.new_page()
        t0 = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        seconds = time.perf_counter() - t0
        browser.close()
    return seconds


def route_seconds(url: str, steps: int) -> float:
    """Seconds for the routes the page asks at load, one after another (no browser)."""
    t0 = time.perf_counter()
    for route in ("api/runs", "api/metrics?run=0", "api/status?run=0", "api/batches?run=0"):
        urllib.request.urlopen(url + route).read()
    urllib.request.urlopen(url + f"api/batch?run=0&kind=step&k={steps - 1}").read()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, action="append", help="default: 200 and 1000")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="20 steps of 8 rollouts")
    args = ap.parse_args()
    steps_list = args.steps or [200, 1000]
    rollouts = args.rollouts
    if args.smoke:
        steps_list = [20]
        rollouts = 8
    rows = []
    for steps in steps_list:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            sizes = write_run(out, steps, rollouts)
            written = time.perf_counter() - t0
            server, url = start_server(out)
            # the tokenizer loads once per server, at the first batch: not the page's time
            route_seconds(url, steps)
            routes = route_seconds(url, steps)
            seconds = browser_seconds(url)
            server.shutdown()
            server.server_close()
        shown = "no browser"
        if seconds is not None:
            shown = f"{seconds:.2f}"
        per_1000 = sizes["token_bytes_per_1000"] / 1000
        rows.append(
            f"| {steps} | {rollouts} | {written:.1f} | {routes:.2f} | {shown} | {per_1000:.1f} KB |"
        )
    head = "| steps | rollouts a step | synthesized in s | routes s | page load s (Chromium) |"
    print(head + " tokens/ per 1,000 trained tokens |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
