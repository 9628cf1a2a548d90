"""Started vLLM servers: where they run (extras/vllm.py placement) and the API key they are started with, which the
backend sends on every request. No vLLM needed: spawn() runs a stand-in `vllm.entrypoints.openai.api_server`
(FAKE below, put first on PYTHONPATH) that answers only with the right bearer key and records how it was started."""

import argparse
import asyncio
import collections
import json
import os
import shutil
import sys
import tempfile
import types

import pytest
import torch
from safetensors.torch import load_file

from lightning_lite.extras import vllm
from lightning_lite.extras.vllm import (
    VLLMBackend,
    _sync_dir,
    check_room,
    check_servers_fit,
    kv_cache_bytes,
    placement,
)
from lightning_lite.chat import Sampling

FAKE = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, out, key = sys.argv[sys.argv.index("--port") + 1], os.environ["FAKE_VLLM_OUT"], os.environ.get("VLLM_API_KEY")
json.dump({"argv": sys.argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "key": key}, open(f"{out}/{port}.json", "w"))
ANSWERS = {"/v1/models": {"data": [{"id": "fake", "max_model_len": 64}]},
           "/v1/completions": {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "text": "ab",
                                            "finish_reason": "stop"}]}}


class Handler(BaseHTTPRequestHandler):
    def answer(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        ok = path == "/health" or self.headers.get("Authorization") == f"Bearer {key}"  # dev routes too, unlike vLLM
        if ok:
            with open(f"{out}/{port}.log", "a") as f:
                f.write(self.path + "\n")
            if body:
                with open(f"{out}/{port}.bodies", "a") as f:
                    f.write(json.dumps({"path": path, "body": json.loads(body)}) + "\n")
        body = json.dumps(ANSWERS.get(path, {}) if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = answer

    def log_message(self, *a):
        pass


ThreadingHTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()
"""


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fake_vllm")
    mod = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    mod.mkdir(parents=True)
    (mod / "api_server.py").write_text(FAKE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(tmp_path / "site"))
        env.setenv("FAKE_VLLM_OUT", str(tmp_path))
        env.setenv(
            "CUDA_VISIBLE_DEVICES", "2,3"
        )  # the trainer's (torchrun's): each server's replaces it
        env.delenv("VLLM_API_KEY", raising=False)
        places = placement(["2", "4,5"], trainer_gpus=["2", "3"])
        b = VLLMBackend.spawn(
            "no-such-model",
            python=sys.executable,
            args=["--dtype", "bfloat16"],
            log_dir=str(tmp_path),
            places=places,
        )
    yield b, tmp_path
    b.close()


def started(tmp_path, url):
    port = url.rsplit(":", 1)[1]
    log = tmp_path / f"{port}.log"
    return json.loads(
        (tmp_path / f"{port}.json").read_text()
    ), log.read_text().split() if log.exists() else []


def test_placement_puts_one_server_on_each_gpu_set_with_a_memory_share_that_leaves_the_trainer_room():
    (env0, args0), (env1, args1) = placement(["0", "4,5"], trainer_gpus=["0", "1"])
    assert env0 == {"CUDA_VISIBLE_DEVICES": "0"} and args0 == [
        "--gpu-memory-utilization",
        "0.3",
        "--tensor-parallel-size",
        "1",
    ]
    assert env1 == {"CUDA_VISIBLE_DEVICES": "4,5"} and args1 == [
        "--gpu-memory-utilization",
        "0.9",
        "--tensor-parallel-size",
        "2",
    ]
    assert [a[1] for _, a in placement(["1,6", "7"], trainer_gpus=["0", "1"])] == [
        "0.3",
        "0.9",
    ]  # one trainer GPU in the set
    assert [a[1] for _, a in placement(["0", "7"], trainer_gpus=["0"], share=0.5)] == ["0.5", "0.5"]
    # other flags pass: not refused, and the placement is what it is without them (start() puts
    # them on the command line, test_vllm_servers_n_starts_n_servers_...)
    alone = [
        (
            {"CUDA_VISIBLE_DEVICES": "0"},
            ["--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1"],
        )
    ]
    assert (
        placement(["0"], [], args=["--dtype", "bfloat16", "--max-num-seqs", "64", "-O3"]) == alone
    )


@pytest.mark.parametrize(
    "flag",
    [
        ["--tensor-parallel-size", "2"],
        ["-tp", "2"],
        ["--gpu_memory_utilization=0.5"],
        ["--gpu-mem", "0.5"],
        ["--max-model-len", "4096"],  # the trainer's context too: train.py's --max-model-len
        ["--max-model=4096"],
    ],
)
def test_placement_refuses_vllm_args_that_set_what_it_sets(flag):
    with pytest.raises(
        ValueError, match="--vllm-args sets .*--vllm-gpus, --vllm-gpu-memory, --max-model-len"
    ):
        placement(["0"], ["0"], args=["--dtype", "bfloat16", *flag])


def test_spawned_servers_run_where_placed_with_a_key_only_they_and_the_backend_know(fake_vllm):
    b, tmp_path = fake_vllm
    (s0, _), (s1, _) = (started(tmp_path, u) for u in b.urls)
    assert (s0["cuda"], s1["cuda"]) == ("2", "4,5")
    assert s0["argv"][-6:] == [
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.3",
        "--tensor-parallel-size",
        "1",
    ]
    assert s1["argv"][-4:] == ["--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2"]
    assert (
        s0["key"] == s1["key"] == b.api_key
        and len(b.api_key) >= 32
        and not any(b.api_key in a for a in s0["argv"])
    )  # not in ps
    gen = asyncio.run(b.generate([1, 2, 3], Sampling(max_tokens=4), rollout_id="r"))
    assert gen.response_ids == [5, 6] and gen.logprobs == [-0.1, -0.2]
    b.checkpoint = {"w": "F32"}  # the stand-in serves no checkpoint: its tensors' names given
    b.sync_weights(
        {"w": torch.zeros(2)}
    )  # every request carries the key: the stand-in guards the dev routes too
    b.sleep()
    b.sync_weights({"w": torch.ones(2)})
    paths = started(tmp_path, b.urls[0])[1]
    assert "/v1/completions" in sum((started(tmp_path, u)[1] for u in b.urls), [])
    assert {"/v1/models", "/collective_rpc", "/reset_prefix_cache", "/sleep?level=2"} <= set(
        paths
    ) and any(p.startswith("/wake_up") for p in paths)


def test_a_backend_without_the_key_is_told_the_key_is_wrong_or_missing(fake_vllm, monkeypatch):
    b, tmp_path = fake_vllm
    for key in (None, "wrong"):
        with pytest.raises(
            RuntimeError, match="answered 401.*wrong or missing API key: --vllm-api-key"
        ):
            VLLMBackend(b.urls, str(tmp_path / "w"), api_key=key)
    monkeypatch.setenv("VLLM_API_KEY", b.api_key)  # the default, as vLLM's own
    assert VLLMBackend(b.urls, str(tmp_path / "w")).model_name == "fake"


def test_weight_syncs_go_through_dev_shm_only_when_it_holds_them_else_a_disk_with_room(monkeypatch):
    """Docker and Kubernetes give /dev/shm 64 MB by default: a 9B model's weights would fill it
    mid-write. The size is what a sync writes, known for a hub name too (it once went unchecked)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    usage = collections.namedtuple("usage", "total used free")
    free = {"/dev/shm": 64 * 2**20, tempfile.gettempdir(): 100 * 2**30}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, free[path]))
    assert _sync_dir(10 * 2**20) == "/dev/shm"
    assert _sync_dir(16 * 2**30) == tempfile.gettempdir()  # 16 GiB: Qwen3-8B in bf16
    free[tempfile.gettempdir()] = 2**30
    with pytest.raises(SystemExit) as e:
        _sync_dir(16 * 2**30)
    assert str(e.value).startswith(
        f"a weight sync writes 16.00 GiB into {tempfile.gettempdir()}, whose file system has 1.00 "
        "GiB free: /dev/shm has 0.06 GiB free: give it more (docker run --shm-size"
    ) and str(e.value).endswith("or set TMPDIR to a folder with room")


def test_check_room_checks_the_folder_a_sync_will_make(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    seen = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: seen.append(path) or usage(0, 0, 1000))
    check_room(str(tmp_path / "run" / "weights"), 1000)  # not made yet: its parent's file system
    assert seen == [str(tmp_path)]
    with pytest.raises(SystemExit, match=r"writes 0.00 GiB into .*/weights, whose .* free: do X"):
        check_room(str(tmp_path / "weights"), 1001, "do X")


# The cache of one request, by hand (kv_cache_bytes's docstring), from the configs' fields:
# Qwen/Qwen3-8B's config.json, and Qwen3.5-9B's text_config (transformers' Qwen3_5TextConfig
# defaults: 32 layers, every 4th full attention, 4 KV heads of 256; 16 key and 32 value heads of
# 128 in the linear ones).
QWEN3_8B = {
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
}
QWEN35_9B = {
    "model_type": "qwen3_5",
    "text_config": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "max_position_embeddings": 262144,
    },
}
# 24 linear layers' state: conv 3 x (2 x 16 x 128 + 32 x 128) = 24,576, recurrent 32 x 128 x 128
QWEN35_STATE = 24 * (3 * 8192 + 32 * 128 * 128) * 2


def test_one_requests_cache_by_hand_for_a_dense_a_hybrid_and_an_mla_model():
    assert kv_cache_bytes(QWEN3_8B, 1, 2) == 36 * 2 * 8 * 128 * 2 == 147_456
    assert kv_cache_bytes(QWEN3_8B, 40960, 2) == 6_039_797_760  # 5.6 GiB
    # 8 full-attention layers of 32 (layers 3, 7, ... 31)
    assert QWEN35_STATE == 26_345_472
    assert kv_cache_bytes(QWEN35_9B, 262144, 2) == 8 * 2 * 4 * 256 * 2 * 262144 + QWEN35_STATE
    assert kv_cache_bytes(QWEN35_9B, 262144, 2) == 8_616_280_064  # 8.0 GiB
    # the same config with its layers listed (as transformers' to_dict() gives it)
    text = QWEN35_9B["text_config"]
    listed = {
        **text,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ]
        * 8,
    }
    assert kv_cache_bytes(listed, 262144, 2) == 8_616_280_064
    # 8 KV heads over 16 GPUs: each GPU holds one, 16 in all
    assert kv_cache_bytes(QWEN3_8B, 1, 2, tensor_parallel=16) == 2 * 147_456
    # sliding-window layers hold at most their window
    gemma = {
        **QWEN3_8B,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention"] * 30 + ["full_attention"] * 6,
    }
    assert kv_cache_bytes(gemma, 40960, 2) == (30 * 1024 + 6 * 40960) * 2 * 8 * 128 * 2
    # DeepSeek-V3: MLA's latent of 512 + 64 a token and layer, on every GPU of the set
    mla = {
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_key_value_heads": 128,
    }
    assert kv_cache_bytes(mla, 1000, 2, tensor_parallel=8) == 61 * 576 * 1000 * 2 * 8


GIB = 2**30


def test_a_server_whose_share_cannot_hold_the_weights_and_one_request_is_refused_with_what_fits():
    """Qwen3.5-9B at 0.3 of an 80 GiB GPU beside rank 0 (train.py's default): its 16.8 GiB of bf16
    weights fit, its 8.0 GiB for one request of 262,144 tokens do not."""
    weights = 9_000_000_000 * 2
    h100 = {"0": 80 * GIB, "1": 80 * GIB}
    beside = placement(["0"], trainer_gpus=["0"])
    with pytest.raises(SystemExit) as e:
        check_servers_fit(beside, h100, weights, QWEN35_9B, 262144, torch.bfloat16)
    # room 0.3 x 80 = 24 GiB; need 16.76 + 8.02; at most (24 GiB - weights - state) / 32,768
    fitting_len = (int(0.3 * 80 * GIB) - weights - QWEN35_STATE) // 32768
    assert fitting_len == 236_311  # 7,743,458,304 / 32,768
    assert str(e.value) == (
        "the vLLM server on GPU 0 gets 0.3 of its 80.0 GiB, 24.0 GiB: less than its weights "
        "(16.8 GiB in bfloat16) and the KV cache of one request of --max-model-len 262144 tokens "
        "(8.0 GiB) need, before vLLM's activations. Lower --max-model-len (at most 236311 fits), "
        "raise --vllm-gpu-memory (above 0.31; beside the trainer, shard it with --parallel fsdp "
        "to leave the room), or give the servers GPUs of their own (--vllm-gpus)"
    )
    check_servers_fit(beside, h100, weights, QWEN35_9B, 32768, torch.bfloat16)
    check_servers_fit(placement(["1"], ["0"]), h100, weights, QWEN35_9B, 262144, torch.bfloat16)
    # Qwen3-8B (8.19e9 parameters: 15.3 GiB) and 5.6 GiB at its 40,960 fit the 24 GiB
    check_servers_fit(beside, h100, 8_190_735_360 * 2, QWEN3_8B, 40960, torch.bfloat16)
    # a tensor-parallel pair sums its GPUs (0.9 of 2 x 16 GiB); GPU 7, which we do not see
    # (CUDA_VISIBLE_DEVICES=6), counts as large as ours
    small = {"6": 16 * GIB}
    check_servers_fit(placement(["6,7"], ["0"]), small, weights, QWEN35_9B, 262144, torch.bfloat16)
    with pytest.raises(SystemExit, match="on GPU 6 gets 0.9 of its 16.0 GiB, 14.4 GiB"):
        check_servers_fit(
            placement(["6"], ["0"]), small, weights, QWEN35_9B, 262144, torch.bfloat16
        )


def tiny_learner(adapter=None):
    """What start() reads of train.py's Learner: a 2-layer model whose context is 256 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    # a tokenizer without a length of its own says 1e30, as transformers' do
    tok = types.SimpleNamespace(model_max_length=int(1e30))
    return types.SimpleNamespace(
        model=LlamaForCausalLM(config), dtype=torch.bfloat16, adapter=adapter, tok=tok
    )


def vllm_flags(out, **flags):
    """train.py's flags for start(), its defaults but ``flags``."""
    args = dict(vllm_sleep=False, vllm_url=None, vllm_api_key=None, vllm_args="", vllm_servers=1)
    args |= dict(vllm_python=sys.executable, vllm_gpus=None, vllm_gpu_memory=None)
    args |= dict(max_model_len=None, model="test/tiny", out=str(out), parallel="ddp")
    args |= dict(serve_dtype="bf16")
    return argparse.Namespace(**(args | flags))


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """The stand-in vLLM of ``fake_vllm`` for start() to spawn; each server's record in tmp_path."""
    mod = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    mod.mkdir(parents=True)
    (mod / "api_server.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_VLLM_OUT", str(tmp_path))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return tmp_path


@pytest.mark.parametrize("max_model_len", [None, 100, 512])
def test_every_started_server_gets_the_trainers_context(fake_env, max_model_len):
    """Without --max-model-len vLLM would take the model's whole context (Qwen3.5: 262,144), which
    the memory check must size; below the trained one it is --max-model-len's, not the model's."""
    learner = tiny_learner()
    if max_model_len:
        learner.model.config.max_position_embeddings = max(256, max_model_len)  # load_model's YaRN
    args = vllm_flags(fake_env, max_model_len=max_model_len, vllm_servers=2)
    backend = vllm.start(args, learner, None, torch.device("cpu"))
    try:
        for url in backend.urls:
            argv = started(fake_env, url)[0]["argv"]
            assert argv[argv.index("--max-model-len") + 1] == str(max_model_len or 256)
            assert ("--hf-overrides" in argv) == bool(max_model_len)
    finally:
        backend.close()


def bodies(tmp_path, url) -> list:
    """What the stand-in at ``url`` was sent: {"path", "body"} of each request with a body."""
    path = tmp_path / f"{url.rsplit(':', 1)[1]}.bodies"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_vllm_servers_n_starts_n_servers_one_a_gpu_spreads_rollouts_and_syncs_each(
    fake_env, monkeypatch
):
    """docs/gpus.md (vLLM): ``--vllm-servers N`` starts N servers, server k on GPU k (GPU 0 beside
    the trainer, at 0.3 of its memory; the others 0.9), each on a port of its own, logged to
    OUT/vllm_K.log, with --vllm-args on its command line after ours. Every call of a rollout goes to
    one server and the rollouts spread over all of them; a weight sync reloads every server from
    the file it wrote. More servers than GPUs is refused (--vllm-gpus places them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpu = types.SimpleNamespace(total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    learner, cuda = tiny_learner(), torch.device("cuda")
    args = vllm_flags(fake_env, vllm_servers=3, vllm_args="--max-num-seqs 64 -O3")
    backend = vllm.start(args, learner, None, cuda)
    try:
        ports = [url.rsplit(":", 1)[1] for url in backend.urls]
        assert len(set(ports)) == 3 and {p.stem for p in fake_env.glob("*.json")} == set(ports)
        assert sorted(p.name for p in fake_env.glob("vllm_*.log")) == [
            "vllm_0.log",
            "vllm_1.log",
            "vllm_2.log",
        ]
        for k, port in enumerate(ports):
            record = json.loads((fake_env / f"{port}.json").read_text())
            argv = record["argv"]
            assert record["cuda"] == str(k) and argv[argv.index("--port") + 1] == port
            share = "0.3" if k == 0 else "0.9"
            assert argv[-4:] == ["--gpu-memory-utilization", share, "--tensor-parallel-size", "1"]
            flags = argv.index("--max-num-seqs")
            assert argv[flags : flags + 3] == ["--max-num-seqs", "64", "-O3"], argv
            assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv.index("--dtype") < flags

        async def rollouts():
            for i in range(12):
                for _ in range(2):  # a rollout's two calls
                    await backend.generate([i + 1, 7], Sampling(max_tokens=2), rollout_id=f"r{i}")

        asyncio.run(rollouts())
        prompts = [
            [tuple(b["body"]["prompt"]) for b in bodies(fake_env, url) if "prompt" in b["body"]]
            for url in backend.urls
        ]
        assert all(prompts), prompts  # every server served some rollouts
        for i in range(12):
            assert sorted(served.count((i + 1, 7)) for served in prompts) == [0, 0, 2], prompts

        backend.checkpoint = {"w": "F32"}  # the stand-in serves no checkpoint: its tensors' names
        backend.sync_weights({"w": torch.ones(2)})
        for url in backend.urls:
            reloads = [b["body"] for b in bodies(fake_env, url) if b["path"] == "/collective_rpc"]
            assert [r["kwargs"] for r in reloads] == [{"weights_path": backend.sync_dir}], url
            assert started(fake_env, url)[1][-1] == "/reset_prefix_cache"
        synced = load_file(os.path.join(backend.sync_dir, "model.safetensors"))
        assert synced["w"].tolist() == [1.0, 1.0]
    finally:
        backend.close()
    with pytest.raises(SystemExit, match="--vllm-servers 5 > 4 GPUs: place them with --vllm-gpus"):
        vllm.start(vllm_flags(fake_env, vllm_servers=5), learner, None, cuda)


def test_a_started_servers_context_is_at_most_its_tokenizers(fake_env):
    """vLLM refuses a --max-model-len past the tokenizer's model_max_length: the model's context is
    cut to it."""
    learner = tiny_learner()
    learner.tok.model_max_length = 128
    backend = vllm.start(vllm_flags(fake_env), learner, None, torch.device("cpu"))
    argv = started(fake_env, backend.urls[0])[0]["argv"]
    backend.close()
    assert argv[argv.index("--max-model-len") + 1] == "128"


def test_start_refuses_servers_that_cannot_fit_before_starting_any(fake_env, monkeypatch):
    learner = tiny_learner()
    gpu = types.SimpleNamespace(total_memory=20_000)  # 0.9 of it: less than 13 kB + 16 kB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SystemExit, match="the vLLM server on GPU 0 gets 0.9 of its 0.0 GiB"):
        vllm.start(vllm_flags(fake_env), learner, None, torch.device("cpu"))
    assert not list(fake_env.glob("*.json"))  # no server started


def test_sync_sizes_are_the_served_weights_or_the_adapters_twice():
    learner = tiny_learner()
    params = sum(p.numel() for p in learner.model.parameters())
    bf16 = torch.bfloat16
    assert vllm._sync_bytes(learner, bf16) == vllm._served_bytes(learner, bf16) == 2 * params
    adapter = learner.model.model.layers[0].self_attn.q_proj.weight  # stands in for --lora's
    for p in learner.model.parameters():
        p.requires_grad_(p is adapter)
    learner.adapter = object()
    assert vllm._sync_bytes(learner, bf16) == 2 * 2 * adapter.numel()  # the previous version stays
    assert vllm._served_bytes(learner, bf16) == 2 * (params - adapter.numel())


def test_servers_started_elsewhere_get_a_sync_folder_with_room(fake_vllm, monkeypatch):
    b, tmp_path = fake_vllm
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 100))
    args = vllm_flags(tmp_path / "run", vllm_url=b.urls, vllm_api_key=b.api_key)
    with pytest.raises(
        SystemExit, match=r"into .*/run/weights, whose file system has 0.00 GiB free"
    ):
        vllm.start(args, tiny_learner(), None, torch.device("cpu"))
