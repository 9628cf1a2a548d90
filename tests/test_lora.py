"""LoRA (extras/lora.py, train.py --lora) on the embedded model: only the adapters train, the embedded backend
serves the adapted module with the trainer's logprobs, the KL reference is the base, bad flags exit naming the fix;
end to end (make test-slow): two DDP ranks, a checkpoint of the adapters alone, --resume, the merge command."""

import argparse
import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch


from lightning_lite import algo, hooks
from lightning_lite.apis import Sampling
from lightning_lite.backends import HFBackend
from lightning_lite.extras import lora
from lightning_lite.models import load_model
from lightning_lite.records import Sample
from lightning_lite.rundir import RunDir
from lightning_lite.trainer import Learner, TrainConfig
from conftest import ROOT
from test_train import rows, run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def flags(**kw):
    base = dict(lora=8, lora_alpha=None, lora_targets=None, model="smollm2", backend="hf")
    base |= dict(lora_rslora=False, lora_per_harness=None, harness=["calc"], vllm_sleep=False)
    return argparse.Namespace(**{**base, **kw})


def an_adapter(names=None, **kw):
    """The adapter --lora's flags ``kw`` ask for: "default", or one per harness of ``names``."""
    adapter = lora.LoRA(flags(lora_per_harness=bool(names), **kw))
    if names:
        adapter.names = list(names)
    return adapter


@pytest.fixture(autouse=True)
def no_adapter_left_behind():
    """lora.check sets hooks.adapter, as train.py wants it: each test leaves the default behind."""
    yield
    hooks.adapter = hooks.NoAdapter()


@pytest.fixture(scope="module")
def adapted():
    """SmolLM2 with rank-8 adapters that change its outputs (peft starts lora_B at 0: no change)."""
    net = an_adapter().wrap(load_model("smollm2")).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return net


def test_only_the_adapters_train_and_the_reference_is_the_base(adapted, model, tok):
    trainable = {n: p.numel() for n, p in adapted.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # rank 8 on the 7 linear layers of 30 decoder layers (hidden 576, MLP 1536, 3 KV heads of 64):
    # 8 x (in + out) = q, o: 8 x 1152; k, v: 8 x 768; gate, up, down: 8 x 2112 -> 81,408 a layer
    assert sum(trainable.values()) == 30 * 81_408 == 2_442_240
    assert all(p.dtype == torch.float32 for n, p in adapted.named_parameters() if n in trainable)
    # more than 8 tokens: the session's model, which a backend serves, multiplies a few rows
    # weight-first (extras/fast_decode.py), other numbers at float noise than the adapted model's
    ids = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    assert ids.shape[1] > 8
    with torch.no_grad():
        plain, tuned = model(input_ids=ids).logits, adapted(input_ids=ids).logits
        with an_adapter().reference(adapted):
            base = adapted(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 0.1
    assert torch.allclose(base, plain, atol=1e-5)


def test_targets_and_alpha_choose_the_layers_and_the_scale():
    adapter = an_adapter(lora=4, lora_alpha=16.0, lora_targets="q_proj,v_proj")
    net = adapter.wrap(load_model("smollm2"))
    trainable = {n: p.numel() for n, p in net.named_parameters() if p.requires_grad}
    # rank 4 on q (576 -> 576) and v (576 -> 192) of 30 layers: 4 x (1152 + 768) a layer
    assert sum(trainable.values()) == 30 * 4 * (1152 + 768)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert net.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 16.0 / 4


def sample_and_score(backend, prompt, rollouts, score):
    """A reply to ``prompt`` for each rollout id, sampled at once (one batch) by ``backend``; each reply's
    max |trainer - sampled logprob|, the trainer's being ``score(rollout id)(batch)`` (a packed tree)."""

    async def sample():
        jobs = [
            (rid, Sampling(max_tokens=12, temperature=1.0, seed=i))
            for i, rid in enumerate(rollouts)
        ]
        return await asyncio.gather(
            *(backend.generate(prompt, s, rollout_id=rid) for rid, s in jobs)
        )

    try:
        replies = asyncio.run(sample())
    finally:
        backend.close()
    gaps = {}
    for rid, g in zip(rollouts, replies):
        n, m = len(prompt), len(g.response_ids)
        s = Sample(rid, prompt + g.response_ids, [0] * n + [1] * m, [0.0] * n + g.logprobs)
        s.temperature, s.top_k, s.top_p = [1.0] * (n + m), [0] * (n + m), [1.0] * (n + m)
        b = algo.collate([s], [1.0], tree=True)
        with torch.no_grad():
            gaps[rid] = float((score(rid)(b) - b["old_logprobs"])[b["loss_mask"] > 0].abs().max())
    return gaps


def test_the_embedded_backend_serves_the_adapters_with_the_trainers_logprobs(adapted, tok):
    """Two replies sampled by the backend serving the adapted module, scored as the trainer scores them:
    the same logprobs at fp32, to the 1e-5 level."""
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    )
    score = lambda rid: lambda b: algo.trainer_logprobs(adapted, b)  # noqa: E731
    assert (
        max(sample_and_score(HFBackend(adapted, tok), prompt, ["r1", "r2"], score).values()) < 1e-4
    )


def test_one_batch_serves_each_harness_its_adapter_with_the_trainers_logprobs(tok):
    """--lora-per-harness: the embedded backend decodes a batch that mixes two adapters (peft's adapter_names),
    each rollout through its harness's (LoRA.route, as train.py routes a batch); the trainer, training one
    adapter at a time (lora.activate), scores each reply as it was sampled, to the 1e-5 level, and under the
    other adapter it does not."""
    adapter = an_adapter(["planner", "coder"])
    net = adapter.wrap(load_model("smollm2"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    adapter_of = {"p0": "planner", "c0": "coder", "p1": "planner", "c1": "coder"}
    hooks.adapter = adapter
    harness_of = {rid: argparse.Namespace(name=name) for rid, name in adapter_of.items()}
    assert adapter.route(harness_of) == adapter_of and adapter.serving("c1") == "coder"
    backend = HFBackend(net, tok)
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    )

    def under(adapter):
        return lambda b: algo.trainer_logprobs(lora.activate(net, adapter), b)

    other = {"planner": "coder", "coder": "planner"}
    own = sample_and_score(backend, prompt, adapter_of, lambda rid: under(adapter_of[rid]))
    assert max(own.values()) < 1e-4, own
    backend = HFBackend(net, tok)
    swapped = sample_and_score(
        backend, prompt, adapter_of, lambda rid: under(other[adapter_of[rid]])
    )
    assert min(swapped.values()) > 0.01, swapped


def test_a_rollout_is_routed_to_an_adapter_only_under_lora_per_harness():
    """train.py's rollouts ask hooks.adapter for each rollout's adapter: none by default or with one
    --lora adapter (the endpoint names --model, the backends serve the model as it is), its harness's
    under --lora-per-harness."""
    harness_of = {"r0": argparse.Namespace(name="calc")}
    for adapter in (hooks.NoAdapter(), an_adapter()):
        assert adapter.route(harness_of) == {} and adapter.serving("r0") is None
    assert hooks.NoAdapter().model_adapter is None and not hooks.NoAdapter().trains_apart
    per_harness = an_adapter(["calc", "search"])
    assert per_harness.route(harness_of) == {"r0": "calc"} and per_harness.serving("r0") == "calc"
    assert per_harness.model_adapter is per_harness and per_harness.trains_apart


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(lora=0), "positive integer"),
        (dict(lora_targets="qproj"), "q_proj"),
        (dict(lora=None, lora_alpha=32.0), "add --lora RANK"),
        (dict(backend="vllm", lora=600), "rank 512 at most"),
        (dict(lora=None, lora_per_harness=True, harness=["calc", "search"]), "add --lora RANK"),
        (dict(lora_per_harness=True), "name two or more --harness"),
        (dict(lora_targets="q_proj,vproj"), "'vproj' names no module of llama"),
        (dict(lora_targets="q_proj,vproj"), "down_proj,gate_proj,k_proj,lm_head,o_proj"),
        (dict(backend="vllm", lora_targets="q_proj,lm_head"), "not on embeddings or the output"),
        (dict(backend="vllm", lora_targets="embed_tokens"), "not on embeddings or the output"),
        (dict(lora_alpha=0.0), "alpha must be > 0 (leave it out for 2 x rank = 16)"),
        (dict(lora_alpha=-16.0), "alpha must be > 0"),
        (dict(lora_rslora=True), "give --lora-alpha too"),
        (dict(lora=None, lora_alpha=0.0), "--lora-alpha shape adapters: add --lora RANK"),
    ],
)
def test_bad_lora_flags_exit_before_anything_starts_naming_the_fix(kw, says):
    with pytest.raises(SystemExit) as e:
        lora.check(flags(**kw), ddp=False, cuda=False)
    assert says in str(e.value)


def test_lora_refuses_what_other_features_would_break():
    """Refusals that need another feature's state: harnesses grouped across (their Tasks), vLLM
    servers put to sleep (the vLLM extra's start, before any server starts)."""
    from lightning_lite.extras import vllm

    tasks = argparse.Namespace(groups_across=True, names=lambda: ["calc", "search"])
    with pytest.raises(SystemExit) as e:
        an_adapter(["calc", "search"]).name_after(tasks)
    assert "one adapter's rewards the baseline of another's" in str(e.value)
    learner = argparse.Namespace(model=argparse.Namespace(config=None), dtype=None)
    learner.adapter = an_adapter()
    with pytest.raises(SystemExit) as e:
        vllm.start(argparse.Namespace(vllm_sleep=True), learner, None, torch.device("cpu"))
    assert "--vllm-sleep drops the base model" in str(e.value)


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank():
    net = an_adapter(lora=16, lora_alpha=8.0, lora_rslora=True).wrap(load_model("smollm2"))
    assert net.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 8.0 / 4
    lora.check(flags(lora=16, lora_alpha=8.0, lora_rslora=True), ddp=False, cuda=False)


def learner_flags(**kw):
    """The flags trainer.Learner reads, as train.py's defaults set them (a learning rate that moves)."""
    base = dict(parallel="ddp", async_steps=0, attn=None, no_tree=False, fsdp_offload=False)
    base |= dict(activation_checkpointing=None, from_calls=None, max_model_len=None, steps=10)
    base |= dict(lr=1e-3, weight_decay=0.0, warmup_steps=0, lr_schedule="constant", grad_clip=1.0)
    base |= dict(micro_batch_tokens=4096, norm="rollout-mean", norm_const=1024, loss="ppo")
    base |= dict(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, tis_cap=2.0, kl_coef=0.0)
    base |= dict(keep_checkpoints=2, dtype="fp32")
    return flags(**{**base, **kw})


def a_learner(tok, names, resume_dir=None, **kw):
    """A Learner of SmolLM2 with an adapter per harness of ``names``, the same one whenever it is made
    (seeded)."""
    torch.manual_seed(0)
    config = TrainConfig.from_flags(learner_flags(**kw))
    cpu = torch.device("cpu")
    return Learner(config, tok, cpu, torch.float32, 1, True, resume_dir, print, an_adapter(names))


def harness_batch(learner, names: list, advantages: dict):
    """Two samples per harness (random tokens, their second half sampled), with the rollout logprobs of
    its own adapter minus noise and ``advantages[name]`` on each sampled token; and the rollouts'
    results (id, harness)."""
    g = torch.Generator().manual_seed(1)
    samples, results = [], []
    for name in names:
        for i, T in enumerate((14, 20)):
            rid = f"{name}-{i}"
            tokens = torch.randint(0, 49152, (T,), generator=g).tolist()
            mask = [0] * (T // 2) + [1] * (T - T // 2)
            s = Sample(rid, tokens, mask, [0.0] * T)
            with torch.no_grad():
                own = algo.trainer_logprobs(
                    lora.activate(learner.model, name), algo.collate([s], [1.0])
                )
            noisy = (own[0] - 0.05 * torch.rand(T, generator=g)).tolist()
            s.logprobs = [x * m for x, m in zip(noisy, mask)]
            s.advantages = [advantages[name] * (1 - 2 * i) * m for m in mask]
            samples.append(s)
            results.append(argparse.Namespace(rollout_id=rid, harness=name))
    return samples, results


def adapter_weights(model, name: str) -> dict:
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if lora.adapter_of_param(n) == name
    }


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_one_pass_trains_every_adapter_as_the_per_harness_loop_did(tok, kl):
    """--lora-per-harness trains all adapters in one backward pass and one AdamW step: each adapter's
    gradient norm, loss and new weights are those of training it alone on its harness's samples (the loop
    of one update per harness it replaces), to fp32 noise; an adapter without a signal keeps its weights
    and gets no AdamW state."""
    names = ["planner", "coder", "idle"]
    advantages = {"planner": 1.0, "coder": -0.7, "idle": 0.0}
    one, loop = (
        a_learner(tok, names, kl_coef=kl),
        a_learner(tok, names, kl_coef=kl),
    )
    samples, results = harness_batch(one, names, advantages)
    before = {name: adapter_weights(one.model, name) for name in names}
    row, _, _ = one.adapter.update(one, samples, results, 0)
    for name in names:
        mine = [s for s in samples if s.rollout_id.startswith(name)]
        if kl or advantages[name]:
            lora.activate(loop.model, name)
            m, grad_norm, _ = loop.update(mine, 0, True)
            assert abs(row[f"grad_norm/{name}"] - grad_norm) <= 1e-5 * grad_norm, name
            assert abs(row[f"loss/{name}"] - m["loss"]) <= 1e-6 + 1e-5 * abs(m["loss"]), name
    for name in names:
        got, want = adapter_weights(one.model, name), adapter_weights(loop.model, name)
        step = max((want[n] - before[name][n]).abs().max().item() for n in want)
        diff = max((got[n] - want[n]).abs().max().item() for n in want)
        assert diff <= 1e-2 * max(step, 1e-6), (name, diff, step)
        if name == "idle" and not kl:
            assert step == 0 and row["skipped/idle"] == "no_signal" and "loss/idle" not in row
            assert not any(one.opt.state.get(p) for p in adapter_params(one, "idle"))
        else:
            assert row[f"skipped/{name}"] is None, name
        # (with KL an adapter without advantages trains too: at its start it is the base, no KL gradient)
        assert step > 1e-4 or name == "idle", name


def adapter_params(learner, name):
    return [p for n, p in learner.model.named_parameters() if lora.adapter_of_param(n) == name]


@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_a_sync_copies_every_adapter_into_the_served_copy(tok, kl):
    """Under --async the embedded backend serves a copy of its own: a sync copies every adapter into it,
    trained or frozen, active or not (peft's disable_adapter, the KL reference, leaves all but the active
    one frozen: a sync once skipped them, and harness A was sampled from its first adapter all run long)."""
    names = ["planner", "coder"]
    learner = a_learner(tok, names, kl_coef=kl, async_steps=1)
    assert learner.served is not learner.model
    samples, results = harness_batch(learner, names, {"planner": 1.0, "coder": 0.5})
    learner.adapter.update(learner, samples, results, 0)
    # frozen by hand, as peft leaves an inactive adapter: what a sync copies does not depend on it
    for p in adapter_params(learner, "planner"):
        p.requires_grad_(False)
    served = dict(learner.served.named_parameters())
    stale = {n: p.detach().clone() for n, p in served.items()}
    backend = HFBackend(learner.served, tok)
    try:
        # what train.py's sync_weights sends the embedded backend that serves a copy
        backend.sync_weights(learner.trained, version=1)
    finally:
        backend.close()
    for name in names:
        trained = adapter_weights(learner.model, name)
        assert all(torch.equal(served[n], w) for n, w in trained.items()), name
        assert any(not torch.equal(stale[n], w) for n, w in trained.items()), name
    assert set(learner.trained) == {n for n in served if lora.adapter_of_param(n)}


def test_a_resume_restores_each_adapters_adamw_state_by_name_and_refuses_other_adapters(
    tok, tmp_path
):
    """The AdamW moments go back to the parameters of their names, whatever the --harness order (they
    were restored by position: swapping two harnesses swapped their adapters' moments); a resume whose
    adapters differ from the checkpoint's is refused, saying what differs."""
    names = ["planner", "coder"]
    learner = a_learner(tok, names)
    samples, results = harness_batch(learner, names, {"planner": 1.0, "coder": 0.5})
    learner.adapter.update(learner, samples, results, 0)
    recorded = vars(learner_flags(lora_per_harness=True))
    ckpt = learner.save(1, RunDir(str(tmp_path), 0, False), recorded)
    moments = {n: learner.opt.state[p]["exp_avg"].clone() for n, p in learner.trained.items()}
    lora.check_resume(an_adapter(names[::-1]), ckpt)
    torch.manual_seed(1)
    resumed = a_learner(tok, names[::-1], resume_dir=ckpt)
    assert resumed.start_step == 1 and list(resumed.trained) != list(learner.trained)
    for n, p in resumed.trained.items():
        assert torch.equal(resumed.opt.state[p]["exp_avg"], moments[n]), n
        assert torch.equal(p, learner.trained[n]), n
    for adapter, says in [
        (
            an_adapter(["planner", "critic"]),
            "adapters ['coder', 'planner'] (now ['critic', 'planner'])",
        ),
        (an_adapter(names, lora=4), "--lora 8 (now 4)"),
        (an_adapter(names, lora_alpha=8.0), "--lora-alpha 16 (now 8.0)"),
        (an_adapter(names, lora_targets="q_proj"), "--lora-targets all decoder linears"),
    ]:
        with pytest.raises(SystemExit) as e:
            lora.check_resume(adapter, ckpt)
        assert says in str(e.value) and "holds other adapters" in str(e.value), str(e.value)
    # without --lora: the checkpoint holds adapters, not a model
    config = TrainConfig.from_flags(learner_flags())
    with pytest.raises(SystemExit) as e:
        Learner(config, tok, torch.device("cpu"), torch.float32, 1, True, ckpt, print)
    assert "holds adapters" in str(e.value)


def test_merge_keeps_the_runs_served_context(tok, tmp_path):
    """A run served past the model's context (--max-model-len: YaRN) merges into a model with that
    context and RoPE scaling, computing what the run's adapted model computed."""
    adapted = an_adapter().wrap(load_model("smollm2", max_model_len=16384))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    ckpt, merged = str(tmp_path / "step_1"), str(tmp_path / "merged")
    adapted.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    run_flags = {"model": "smollm2", "dtype": "fp32", "max_model_len": 16384}
    torch.save({"args": run_flags, "step": 1}, os.path.join(ckpt, "trainer_state.pt"))
    lora.merge(ckpt, merged)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(merged)
    assert config.max_position_embeddings == 16384
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_adapters_go_to_vllm_in_the_served_dtype_without_asking_a_hub(adapted, monkeypatch):
    import peft.utils.save_and_load as save_and_load

    def no_hub(*a, **kw):
        raise AssertionError("looked up the base model's files")

    monkeypatch.setattr(save_and_load, "check_file_exists_on_hf_hub", no_hub, raising=False)
    monkeypatch.setattr(
        adapted.peft_config["default"], "base_model_name_or_path", "org/no-such-model"
    )
    config, weights = an_adapter().weights(adapted, torch.bfloat16)["default"]
    assert config.r == 8 and len(weights) == 2 * 7 * 30
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in weights)


@pytest.mark.parametrize(
    "status, body, says",
    [
        (404, '{"detail":"Not Found"}', "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        (
            400,
            '{"error":{"message":"LoRA rank 64 is greater than max_lora_rank 16."}}',
            "LoRA rank 64",
        ),
    ],
)
def test_a_server_that_refuses_an_adapter_stops_the_run_with_what_it_said(
    tmp_path, status, body, says
):
    """vLLM's own error reaches the user; the hint to start the servers otherwise only when the server
    has no route to load adapters (404)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from peft import LoraConfig

    from lightning_lite.extras.vllm import VLLMBackend

    class Handler(BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            models = {"data": [{"id": "base", "max_model_len": 64}]}
            code, text = (200, json.dumps(models)) if self.path == "/v1/models" else (status, body)
            self.send_response(code)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())

        do_GET = do_POST = answer

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = VLLMBackend([f"http://127.0.0.1:{server.server_port}"], str(tmp_path / "w"))
        backend.adapter = an_adapter()
        backend.checkpoint = {"layer.weight": "BF16"}  # the stub serves no checkpoint: its names
        weights = {"base_model.model.layer.lora_A.weight": torch.zeros(8, 4)}
        with pytest.raises(SystemExit) as e:
            backend.sync_weights({"default": (LoraConfig(r=8), weights)}, version=1)
    finally:
        server.shutdown()
    message = str(e.value)
    assert message.startswith("--lora: loading adapter 'default' failed") and says in message
    assert "started with --enable-lora --max-lora-rank 8 --max-loras 1" in message, message
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in message) == (status == 404), message


@pytest.mark.slow  # minutes: two torchrun runs and a merge
def test_lora_trains_under_ddp_checkpoints_the_adapters_resumes_and_merges(tmp_path, tok):
    out = str(tmp_path / "run")
    calc = ["train.py", "--harness", "calc", "--harness-arg", "max_tokens=32"]
    calc += ["--harness-arg", "tool_first=False", "--batch-size", "4", "--group-size", "4"]
    calc += ["--eval-tasks", "0", "--lr", "1e-3", "--lora", "8", "--kl-coef", "0.05", "--out", out]
    run(TORCHRUN + calc + ["--steps", "2", "--save-every", "1"], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and any(r["grad_norm"] for r in steps)
    # served from the adapted module: what was sampled is what is trained
    assert all(r["dlogp_mean"] is None or r["dlogp_mean"] < 1e-4 for r in steps)
    # the adapters in peft's format and their AdamW state, not the base model
    ckpt = os.path.join(out, "checkpoints", "step_2")
    files = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert len(state["optimizer"]["state"]) == 2 * 7 * 30  # lora_A and lora_B of 210 layers
    run(TORCHRUN + calc + ["--steps", "3", "--resume"], timeout=900)
    assert [r["step"] for r in rows(out) if "reward" in r] == [1, 2, 3]
    # merged: a plain transformers model computing what base + adapters compute
    merged = str(tmp_path / "merged")
    ckpt = os.path.join(out, "checkpoints", "step_3")
    run([sys.executable, "-m", "lightning_lite.extras.lora", "merge", ckpt, merged])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        want = PeftModel.from_pretrained(load_model("smollm2"), ckpt)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        plain = load_model("smollm2")(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4) and (got - plain).abs().max() > 1e-3
    # the run's calls trained on again, imitated (--from-calls, --loss sft)
    again = str(tmp_path / "again")
    run(
        [sys.executable, "train.py", "--from-calls", out, "--lora", "8", "--loss", "sft"]
        + ["--steps", "1", "--batch-size", "2", "--out", again]
    )
    assert [r["grad_norm"] > 0 for r in rows(again)] == [True]


# bf16 on a CPU without AVX-512 BF16 runs its matmuls about 30x slower than fp32 (measured here):
# the bf16 run takes LengthHarness's short prompt; the forced calculator call, whose tool list
# makes a long prompt, runs in fp32 (in bf16 it took ~300 s of CI). Both rewards are lengths, so
# every step has a signal: calc's was 0 for all 16 rollouts of a run (no forced call computed the
# problem, no answer was right), and adapters at their start (lora_B 0) are the KL's reference
# itself, so the KL term alone moves nothing.
FSDP_LORA_RUNS = {
    "bf16": ["--harness", "tests/harnesses.py:LengthHarness", "--dtype", "bf16"],
    "forced_calls": [
        "--harness",
        "tests/harnesses.py:SamplingHarness",
        "--harness-arg",
        "setting=constrained",
    ],
}


@pytest.mark.slow  # a minute each: one torchrun run
@pytest.mark.parametrize("run_kind", FSDP_LORA_RUNS)
def test_lora_under_fsdp_async(tmp_path, run_kind):
    """FSDP2 shards the adapted layers, the base in bf16 (or a calculator call forced under its
    schema's grammar and a JSON reply, in fp32); rollouts run during training (the served copy gets
    the adapters alone)."""
    out = str(tmp_path / "run")
    args = TORCHRUN + ["train.py", *FSDP_LORA_RUNS[run_kind], "--batch-size", "2"]
    args += ["--group-size", "4", "--eval-tasks", "0", "--lora", "8", "--parallel", "fsdp"]
    args += ["--async", "--steps", "2"]
    # a KL term: its reference is the base, under FSDP too
    args += ["--kl-coef", "0.05"]
    run(args + ["--out", out], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert len(steps) == 2
    assert steps[1]["staleness"] and all(r["grad_norm"] for r in steps)
    if run_kind == "forced_calls":
        assert all(r["forced_tokens"] > 0 for r in steps)
    else:
        config = json.load(open(os.path.join(out, "config.json")))
        assert config["dtype"] == "bf16"
    assert "adapter_model.safetensors" in os.listdir(os.path.join(out, "checkpoints", "step_2"))


@pytest.mark.slow  # minutes: two torchrun runs and a merge
def test_an_adapter_per_harness_trains_on_its_harness_alone_under_ddp(tmp_path, tok):
    """--lora-per-harness with two harnesses on two DDP ranks: "length" has a signal every step, "constant"
    (a reward of 0.5 whatever the reply) never does. Each rollout is served by its harness's adapter, each
    adapter trains on its harness's samples alone: length's moves, has AdamW state and its metrics;
    constant's stays at its start (lora_B 0) with none. The checkpoint holds an adapter folder per harness;
    --resume continues; the merge command takes one by name."""
    out = str(tmp_path / "run")
    two = ["train.py", "--harness", "tests/harnesses.py:LengthHarness"]
    two += ["--harness", "tests/harnesses.py:ConstantHarness", "--harness-arg", "max_tokens=12"]
    two += ["--batch-size", "4", "--group-size", "4", "--eval-tasks", "0", "--lr", "1e-3"]
    two += ["--lora", "8", "--lora-per-harness", "--out", out]
    run(TORCHRUN + two + ["--steps", "2", "--save-every", "2"], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["grad_norm/length"] > 0 and r["dlogp_mean/length"] < 1e-4, r
        assert r["skipped/constant"] == "no_signal" and "loss/constant" not in r, r
    from safetensors.torch import load_file

    ckpt = os.path.join(out, "checkpoints", "step_2")
    weights = {
        h: load_file(os.path.join(ckpt, h, "adapter_model.safetensors"))
        for h in ("length", "constant")
    }
    moved = lambda h: max(float(w.abs().max()) for k, w in weights[h].items() if "lora_B" in k)  # noqa: E731
    assert moved("length") > 0 and moved("constant") == 0
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert len(state["optimizer"]["state"]) == 2 * 7 * 30  # length's lora_A and lora_B alone
    run(TORCHRUN + two + ["--steps", "3", "--resume"], timeout=900)
    assert [r["step"] for r in rows(out) if "reward" in r] == [1, 2, 3]
    merged = str(tmp_path / "merged")
    ckpt = os.path.join(out, "checkpoints", "step_3")
    merge = [sys.executable, "-m", "lightning_lite.extras.lora", "merge", ckpt, merged]
    p = subprocess.run(merge, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "--adapter one of" in p.stderr and "'length'" in p.stderr, p.stderr
    run(merge + ["--adapter", "length"])
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        plain = load_model("smollm2")(input_ids=ids).logits
    assert (got - plain).abs().max() > 1e-3


@pytest.mark.slow  # minutes: two torchrun runs
@pytest.mark.parametrize("kl", ["0", "0.05"])
def test_fsdps_served_copy_gets_every_adapter_at_each_sync(tmp_path, kl):
    """Under FSDP the embedded backend serves a copy of its own, which each sync refreshes: with an adapter
    per harness, each harness's rollouts are sampled from its adapter as trained so far, so the trainer
    scores what was sampled (|dlogp| at fp32 noise) for every harness at every step. With the KL term a sync
    once copied only the last harness's adapter, and the others' |dlogp| grew from step 2 on."""
    out = str(tmp_path / "run")
    two = ["train.py", "--harness", "tests/harnesses.py:LengthHarness"]
    two += ["--harness", "tests/harnesses.py:BranchingHarness", "--harness-arg", "max_tokens=8"]
    two += ["--batch-size", "2", "--group-size", "4", "--eval-tasks", "0", "--lr", "1e-3"]
    two += ["--lora", "8", "--lora-per-harness", "--parallel", "fsdp", "--kl-coef", kl]
    run(TORCHRUN + two + ["--steps", "3", "--out", out], timeout=900)
    steps = [r for r in rows(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for name in ("length", "branching"):
            assert r[f"grad_norm/{name}"] > 0 and r[f"dlogp_mean/{name}"] < 1e-4, (name, r)
