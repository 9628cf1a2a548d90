"""Started vLLM servers: where they run (extras/vllm.py placement) and the API key they are started with, which the
backend sends on every request. No vLLM needed: spawn() runs a stand-in `vllm.entrypoints.openai.api_server`
(FAKE below, put first on PYTHONPATH) that answers only with the right bearer key and records how it was started."""

import asyncio
import collections
import json
import os
import shutil
import sys

import pytest
import torch

from lightning_lite.extras.vllm import VLLMBackend, placement
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
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        ok = path == "/health" or self.headers.get("Authorization") == f"Bearer {key}"  # dev routes too, unlike vLLM
        if ok:
            with open(f"{out}/{port}.log", "a") as f:
                f.write(self.path + "\n")
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
    assert placement(
        ["0"], [], args=["--dtype", "bfloat16", "--max-model-len", "4096", "-O3"]
    )  # other flags pass


@pytest.mark.parametrize(
    "flag",
    [
        ["--tensor-parallel-size", "2"],
        ["-tp", "2"],
        ["--gpu_memory_utilization=0.5"],
        ["--gpu-mem", "0.5"],
    ],
)
def test_placement_refuses_vllm_args_that_set_what_it_sets(flag):
    with pytest.raises(ValueError, match="--vllm-args sets .*--vllm-gpus, --vllm-gpu-memory"):
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


def test_weight_syncs_go_through_dev_shm_only_when_it_holds_the_weights(tmp_path, monkeypatch):
    """Docker and Kubernetes give /dev/shm 64 MB by default: a 9B model's weights would fill it mid-write."""
    from lightning_lite.extras.vllm import _sync_dir

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    (tmp_path / "model.safetensors").write_bytes(
        b"0" * 1000
    )  # 2000 bytes to sync in fp32 from a bf16 file
    usage = collections.namedtuple("usage", "total used free")
    for free, in_memory in ((64 * 2**20, True), (1999, False)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(free, 0, free))
        d = _sync_dir(str(tmp_path))
        assert d.startswith("/dev/shm/") == in_memory and os.path.basename(d).startswith(
            "lightning-lite-weights-"
        ), d
        os.rmdir(d)
    os.rmdir(
        _sync_dir("Qwen/Qwen3-8B")
    )  # a hub name vLLM downloads itself: no local size, and no crash
