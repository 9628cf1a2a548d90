"""vLLM servers as the backend (docs/gpus.md: GPUs: vLLM). Its seam is the backend class:
``VLLMBackend`` has HFBackend's surface (generate, pause/resume, payload, sync_weights, make_room,
close, version, max_model_len, stats), plus ``sleep``. train.py chooses it with ``--backend vllm``
and gets it from ``start`` (``hooks.BACKENDS["vllm"]``); proxy.py from ``--vllm-url``.

    backend = start(args, learner, resume_dir, device)          # rank 0 starts the servers
    gen = await backend.generate(prompt_ids, sampling, rollout_id="r1")
    backend.sync_weights(state_dict, version=1)                # rank 0 writes, the servers reload
"""

import asyncio
import atexit
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import hooks
from ..backends import Generation, PauseGate, max_reply_tokens, served_state_dict
from ..chat import Sampling
from ..models import resolve


def check(args, ddp: bool, cuda: bool):
    if args.vllm_sleep and (args.backend != "vllm" or args.async_steps):
        sys.exit(
            "--vllm-sleep frees the vLLM servers' GPU memory while training: it needs --backend "
            "vllm, and no --async (rollouts would run then)"
        )


# the flags' help texts
URL_HELP = "running servers of this model that can read --out (default: start --vllm-servers)"
URL_HELP += "; started with VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs"
SERVERS_HELP = "servers to start (rank 0 starts them; logs in OUT/vllm_K.log)"
ARGS_HELP = "more arguments for the started servers, e.g. '--enforce-eager --max-num-seqs 64'"
SLEEP_HELP = "servers on the training GPUs free their memory while it trains (sleep level 2)"
GPUS_HELP = (
    "a started server per GPU set, e.g. '4,5 6,7' (nvidia-smi's ids; replaces --vllm-servers)"
)
MEMORY_HELP = (
    "each started server's --gpu-memory-utilization; default 0.3 beside the trainer, else 0.9"
)


def add_args(parser):
    """The flags of ``--backend vllm``, as an argparse group."""
    group = parser.add_argument_group("vLLM servers (--backend vllm)")
    venv = ".venv-vllm/bin/python"
    python = venv if os.path.exists(venv) else sys.executable
    group.add_argument("--vllm-url", nargs="+", metavar="URL", help=URL_HELP)
    group.add_argument("--vllm-servers", type=int, default=1, help=SERVERS_HELP)
    group.add_argument("--vllm-python", default=python, help="the Python that has vLLM")
    group.add_argument("--vllm-args", default="", help=ARGS_HELP)
    group.add_argument("--vllm-sleep", action="store_true", help=SLEEP_HELP)
    group.add_argument("--vllm-gpus", nargs="+", metavar="IDS", help=GPUS_HELP)
    group.add_argument("--vllm-gpu-memory", type=float, metavar="SHARE", help=MEMORY_HELP)
    group.add_argument(
        "--vllm-api-key", metavar="KEY", help="the --vllm-url servers' (or $VLLM_API_KEY)"
    )


def start(args, learner, resume_dir, device: torch.device) -> "VLLMBackend":
    """train.py's vLLM backend: rank 0 starts ``--vllm-servers`` of ``resume_dir`` or --model
    (placed by ``placement``), unless ``--vllm-url`` names running ones; every rank's proxy sends to
    the same servers; rank 0 writes the weight syncs, in --serve-dtype (the servers'). The trained
    model's config gives the context and RoPE. Under a model adapter (--lora) the servers serve the
    base model and load each sync's adapters. Before any server starts, each one's share of its GPUs
    must hold the weights and one request's KV cache (``check_servers_fit``), and the folder the
    syncs go to must hold a sync (``check_room``)."""
    config = learner.model.config
    adapter = learner.adapter
    if args.vllm_sleep and adapter is not None:
        sys.exit("--vllm-sleep drops the base model the adapters need: leave it out with --lora")
    # the servers compute in --serve-dtype and the syncs are written in it; the trainer keeps --dtype
    dtype = torch.bfloat16 if args.serve_dtype == "bf16" else torch.float32
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not args.vllm_url and local_world < world:
        sys.exit(
            "--backend vllm starts its servers on rank 0's node, at 127.0.0.1: "
            "over several nodes start them yourself and pass --vllm-url"
        )
    # Every started server serves the trainer's context: --max-model-len, else the model's own, the
    # length the memory check below sizes (without the flag vLLM derives its own: the whole context,
    # scaled by some RoPE types, capped by the tokenizer's). With --max-model-len, the trainer's RoPE
    # scaling too (models.load_model: YaRN past the trained length), or every logprob differs.
    served_len = args.max_model_len
    if not served_len:
        # vLLM refuses a context past the tokenizer's model_max_length too
        served_len = int(min(config.max_position_embeddings, learner.tok.model_max_length))
    context = ["--max-model-len", str(served_len)]
    if args.max_model_len:
        positions = config.max_position_embeddings
        overrides = {
            "max_position_embeddings": positions,
            "rope_parameters": config.rope_parameters,
        }
        context += ["--hf-overrides", json.dumps(overrides)]
    backend, urls, key = None, args.vllm_url, args.vllm_api_key
    sync_bytes = _sync_bytes(learner, dtype)
    if rank == 0 and args.vllm_url:
        # the --vllm-url servers read the syncs from OUT/weights
        hint = "free space there, or give --out a folder with room that the servers read"
        check_room(os.path.join(os.path.abspath(args.out), "weights"), sync_bytes, hint)
    if rank == 0 and not args.vllm_url:
        extra = args.vllm_args.split()
        # the CPU build has no sleep mode
        sleep = ["--enable-sleep-mode"] if args.vllm_sleep and torch.cuda.is_available() else []
        lora = []
        if adapter is not None:
            lora = lora_flags(adapter.rank, len(adapter.names))
        # --vllm-args after ours: they may override
        flags = context + ["--dtype", str(dtype).removeprefix("torch.")] + lora + extra + sleep
        places = _places(args, device, local_world, extra)
        if places is not None:
            weights = _served_bytes(learner, dtype)
            text_config = config.get_text_config().to_dict()
            check_servers_fit(places, _gpu_memory(), weights, text_config, served_len, dtype)
        python, n = args.vllm_python, args.vllm_servers
        model_dir = resolve(resume_dir or args.model)
        if adapter is not None:
            # the checkpoint holds adapters: the servers serve the base model
            model_dir = resolve(args.model)
        backend = VLLMBackend.spawn(
            model_dir, n, python, flags, log_dir=args.out, places=places, sync_bytes=sync_bytes
        )
        urls, key = backend.urls, backend.api_key
    if world > 1:
        # the key too: every rank's proxy sends it
        shared = [urls, key]
        dist.broadcast_object_list(shared)
        urls, key = shared
    sync_dir = os.path.join(os.path.abspath(args.out), "weights")
    backend = backend or VLLMBackend(urls, sync_dir, api_key=key, writes_weights=rank == 0)
    backend.dtype = dtype
    backend.adapter = adapter
    backend.sleep_while_training = args.vllm_sleep
    backend.trained_from = resolve(args.model)
    # servers a user started may serve other weights (a previous run's, before --resume); under an
    # adapter they serve the base model until they load the adapters
    backend.first_sync = bool(args.vllm_url) or adapter is not None
    # servers a user started were started with their own context: it must be the trainer's
    if args.vllm_url and args.max_model_len and backend.max_model_len != args.max_model_len:
        sys.exit(
            f"--max-model-len {args.max_model_len}: start the --vllm-url servers with "
            f"{shlex.join(context)}, as the trainer"
        )
    return backend


def _places(args, device: torch.device, local_world: int, extra: list) -> Optional[list]:
    """Where each started server runs (see ``placement``): none on vLLM's CPU build; on GPUs server
    k on GPU k unless --vllm-gpus, in ids as CUDA_VISIBLE_DEVICES takes them (a server's replaces
    ours)."""
    if not torch.cuda.is_available():
        return None
    every = ",".join(map(str, range(torch.cuda.device_count())))
    # rank r trains on visible[r]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", every).split(",")
    if not args.vllm_gpus and args.vllm_servers > len(visible):
        sys.exit(
            f"--vllm-servers {args.vllm_servers} > {len(visible)} GPUs: place them with --vllm-gpus"
        )
    trainer = visible[:local_world] if device.type == "cuda" else []
    gpu_sets = args.vllm_gpus or visible[: args.vllm_servers]
    return placement(gpu_sets, trainer, args.vllm_gpu_memory, extra)


def _gpu_memory() -> dict:
    """Each GPU's total memory in bytes, by its id as CUDA_VISIBLE_DEVICES (ours, or every GPU)
    names it: the ids of ``placement``'s GPU sets."""
    every = ",".join(map(str, range(torch.cuda.device_count())))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", every).split(",")
    visible = visible[: torch.cuda.device_count()]
    return {gpu: torch.cuda.get_device_properties(i).total_memory for i, gpu in enumerate(visible)}


def _served_bytes(learner, dtype: torch.dtype) -> int:
    """The bytes of the weights the servers hold, in the served ``dtype``: the trained model's (under
    --lora its base; the adapters are what trains). A DTensor (FSDP) counts its whole size."""
    params = learner.model.parameters()
    if learner.adapter is not None:
        params = [p for p in learner.model.parameters() if not p.requires_grad]
    return sum(p.numel() for p in params) * dtype.itemsize


def _sync_bytes(learner, dtype: torch.dtype) -> int:
    """The bytes a weight sync writes, in the served ``dtype``: the whole model; under --lora its
    adapters (the trainable parameters), twice, as the previous version's stay until the servers
    load the new ones."""
    if learner.adapter is None:
        return _served_bytes(learner, dtype)
    adapters = [p for p in learner.model.parameters() if p.requires_grad]
    return 2 * sum(p.numel() for p in adapters) * dtype.itemsize


def placement(gpu_sets: list[str], trainer_gpus: list[str], share=None, args: list = ()) -> list:
    """Each started server's (environment, arguments) for ``VLLMBackend.spawn``: one per GPU set,
    tensor-parallel over it, with ``share`` of each GPU's memory (default 0.3 beside the trainer,
    0.9 alone).

    >>> placement(["0", "4,5"], trainer_gpus=["0", "1"])  # the trainer on GPUs 0 and 1
    [({'CUDA_VISIBLE_DEVICES': '0'}, ['--gpu-memory-utilization', '0.3', '--tensor-parallel-size', '1']),
     ({'CUDA_VISIBLE_DEVICES': '4,5'}, ['--gpu-memory-utilization', '0.9', '--tensor-parallel-size', '2'])]
    """
    # train.py's --max-model-len is the trainer's context too, and check_servers_fit sizes it
    ours = ("--tensor-parallel-size", "--gpu-memory-utilization", "--max-model-len")
    for arg in args:
        flag = arg.split("=")[0].replace("_", "-")
        # argparse takes abbreviations: --gpu-mem sets --gpu-memory-utilization
        if flag == "-tp" or len(flag) > 2 and any(f.startswith(flag) for f in ours):
            raise ValueError(
                f"--vllm-args sets {arg}: give the GPUs, memory share and context as "
                "--vllm-gpus, --vllm-gpu-memory, --max-model-len"
            )
    places = []
    for gpu_set in gpu_sets:
        ids = gpu_set.split(",")
        memory = share or (0.3 if set(ids) & set(trainer_gpus) else 0.9)
        flags = ["--gpu-memory-utilization", str(memory), "--tensor-parallel-size", str(len(ids))]
        places.append(({"CUDA_VISIBLE_DEVICES": gpu_set}, flags))
    return places


def kv_cache_bytes(config: dict, tokens: int, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """The bytes of cache one request of ``tokens`` tokens holds in a vLLM server, over its
    ``tensor_parallel`` GPUs together, from a model's config (a composite one's ``text_config``):

    - a full-attention layer: 2 (keys, values) x num_key_value_heads x head_dim x ``dtype_bytes``
      a token; each GPU holds at least one head, so past that many GPUs heads repeat;
    - a sliding-window layer (``layer_types``' "sliding_attention"): the same for at most
      ``sliding_window`` tokens (vLLM keeps a little more: the tokens of one scheduled batch);
    - a linear-attention layer (Qwen3.5, Qwen3-Next: ``layer_types``' "linear_attention", or all
      but every ``full_attention_interval``-th): a fixed state, the convolution's (kernel - 1) x
      (2 x key heads x key dim + value heads x value dim) and value heads x value dim x key dim, in
      ``dtype_bytes`` (vLLM may hold the latter in fp32: --mamba-ssm-cache-dtype);
    - MLA (DeepSeek: ``kv_lora_rank``): kv_lora_rank + qk_rope_head_dim a token and layer, on every
      GPU (it is not split over them).

    Qwen3-8B (36 layers, 8 KV heads of 128) in bf16: 36 x 2 x 8 x 128 x 2 = 147,456 bytes a token,
    6,039,797,760 (5.6 GiB) at its 40,960. Qwen3.5-9B (8 of 32 layers full, 4 KV heads of 256; 24
    linear with 16 key and 32 value heads of 128, kernel 4): 8 x 2 x 4 x 256 x 2 = 32,768 bytes a
    token, 8 GiB at 262,144, plus 24 x (3 x 8,192 + 32 x 128 x 128) x 2 = 26,345,472 of state.
    """
    text = config.get("text_config") or config
    layers = text["num_hidden_layers"]
    if text.get("kv_lora_rank"):
        latent = text["kv_lora_rank"] + text["qk_rope_head_dim"]
        return layers * latent * tokens * dtype_bytes * tensor_parallel
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    # heads a GPU holds (at least one), times the GPUs
    heads = -(-kv_heads // tensor_parallel) * tensor_parallel
    per_token = 2 * heads * head_dim * dtype_bytes
    layer_types = text.get("layer_types")
    if not layer_types and text.get("full_attention_interval"):
        interval = text["full_attention_interval"]
        layer_types = ["linear_attention"] * layers
        for i in range(interval - 1, layers, interval):
            layer_types[i] = "full_attention"
    layer_types = layer_types or ["full_attention"] * layers
    kinds = Counter(layer_types)
    # a layer of any other kind is counted as a full-attention one (more than it may hold)
    full = len(layer_types) - kinds["sliding_attention"] - kinds["linear_attention"]
    window = min(tokens, text.get("sliding_window") or tokens)
    total = full * tokens * per_token
    total += kinds["sliding_attention"] * window * per_token
    if kinds["linear_attention"]:
        key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
        conv = (text["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim)
        recurrent = value_dim * text["linear_key_head_dim"]
        total += kinds["linear_attention"] * (conv + recurrent) * dtype_bytes
    return total


def check_servers_fit(
    places: list, gpu_memory: dict, weight_bytes: int, config: dict, context: int, dtype
):
    """Stop, before any server starts, when a server's share of its GPUs' memory (``places``, from
    ``placement``; ``gpu_memory``: each GPU's bytes by id) cannot hold the weights (``weight_bytes``,
    in the served ``dtype``) and one request of ``context`` tokens (``kv_cache_bytes``): vLLM checks
    this after loading them, minutes in. A lower bound: vLLM also needs room for its activations
    and CUDA graphs (its log: "Available KV cache memory").

    Qwen3.5-9B (9.0e9 parameters, text only: 16.8 GiB in bf16; 8.0 GiB of cache for 262,144 tokens)
    at 0.3 of an 80 GiB GPU (24 GiB): 16.8 + 8.0 > 24, stop; at --max-model-len 32768 (1.0 GiB) or
    a 0.9 share (72 GiB) it fits.
    """
    dtype_bytes = dtype.itemsize
    # a GPU this process does not see (left out of its CUDA_VISIBLE_DEVICES): as large as the first
    # one it sees, as a machine's GPUs are as a rule
    first = list(gpu_memory.values())[0]
    for env, flags in places:
        gpu_set = env["CUDA_VISIBLE_DEVICES"]
        ids = gpu_set.split(",")
        share = float(flags[flags.index("--gpu-memory-utilization") + 1])
        total = sum(gpu_memory.get(gpu, first) for gpu in ids)
        room = int(total * share)
        kv = kv_cache_bytes(config, context, dtype_bytes, len(ids))
        if weight_bytes + kv <= room:
            continue
        # what would fit: the context at this share, the share at this context
        fixed = kv_cache_bytes(config, 0, dtype_bytes, len(ids))
        per_token = max(1, kv_cache_bytes(config, 1, dtype_bytes, len(ids)) - fixed)
        fitting_len = max(0, (room - weight_bytes - fixed) // per_token)
        fitting_share = (weight_bytes + kv) / total
        gib = 2**30
        served = str(dtype).removeprefix("torch.")
        raise SystemExit(
            f"the vLLM server on GPU {gpu_set} gets {share} of its {total / gib:.1f} GiB, "
            f"{room / gib:.1f} GiB: less than its weights ({weight_bytes / gib:.1f} GiB in "
            f"{served}) and the KV cache of one request of --max-model-len {context} tokens "
            f"({kv / gib:.1f} GiB) need, before vLLM's activations. Lower --max-model-len (at "
            f"most {fitting_len} fits), raise --vllm-gpu-memory (above {fitting_share:.2f}; "
            "beside the trainer, shard it with --parallel fsdp to leave the room), or give the "
            "servers GPUs of their own (--vllm-gpus)"
        )


def lora_flags(rank, adapters=1) -> list:
    """--lora RANK: the server flags for its adapters (vLLM takes ranks 1, 8, 16, ... 512)."""
    rank = next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(adapters)]


# What every started server needs: processed logprobs (of the distribution sampled from), vLLM's
# sampling defaults (not generation_config.json's), grammars by the guidance backend (llguidance),
# and the worker methods of extras/vllm_worker.py (a reload that says what it left out), importable
# from this checkout (spawn puts it on the servers' PYTHONPATH).
_SERVER_ARGS = [
    *"--host 127.0.0.1 --logprobs-mode processed_logprobs --generation-config vllm".split(),
    *["--structured-outputs-config", '{"backend": "guidance"}'],
    *["--worker-extension-cls", "lightning_lite.extras.vllm_worker.CountedReload"],
]
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_GRAMMAR_HINT = (
    ' (a grammar: start the servers with --structured-outputs-config \'{"backend": "guidance"}\')'
)


class VLLMBackend(PauseGate):
    """vLLM OpenAI servers behind HFBackend's surface: token ids in and out of ``/v1/completions``;
    ``sync_weights`` writes safetensors into ``sync_dir`` (a folder the servers can read) for every
    server to reload in place. The servers need ``--logprobs-mode processed_logprobs``,
    ``VLLM_SERVER_DEV_MODE=1`` (the weight-sync routes) and, for grammars,
    ``--structured-outputs-config '{"backend": "guidance"}'``. ``api_key`` (default $VLLM_API_KEY)
    goes with every request. ``writes_weights`` False (train.py's ranks but 0): a sync only moves
    the version."""

    def __init__(
        self, urls: list[str], sync_dir: str, procs=None, api_key=None, writes_weights=True
    ):
        self.urls, self.sync_dir, self.procs = [u.rstrip("/") for u in urls], sync_dir, procs or []
        self.api_key = api_key or os.environ.get("VLLM_API_KEY")
        self.writes_weights = writes_weights
        # of the weight-sync file (train.py: --serve-dtype's, half of fp32 in bf16); None: the weights'
        # own
        self.dtype = None
        try:
            answers = [_http(u + "/v1/models", timeout=30, key=self.api_key) for u in self.urls]
        except OSError as e:
            raise RuntimeError(
                f"no vLLM server answers at {' '.join(self.urls)} ({e}): "
                "start it (docs/gpus.md), or leave out --vllm-url"
            ) from None
        # each server's one model: {"id": name, "max_model_len": n, ...}
        models = [answer["data"][0] for answer in answers]
        self.model_name = models[0]["id"]
        self.max_model_len = min(m["max_model_len"] for m in models)
        self.version, self.paused, self.sleeping = 0, False, False
        # train.py's (start): --vllm-sleep, and whether the first step must sync the trained
        # weights before any rollout
        self.sleep_while_training = False
        self.first_sync = False
        # a model adapter (--lora): the servers serve the base model, and adapter NAME of version K
        # as "NAME-vK"
        self.adapter, self.lora_loaded = None, None
        # the calls sent out and not answered yet
        self._inflight, self._cond = 0, threading.Condition()
        self.stats = Counter(requests=0, prompt_tokens=0, generated_tokens=0)
        # the served checkpoint's tensors ({name: dtype}, read at the first sync) and the served
        # name of each trainer tensor named so far (``served_names``)
        self.checkpoint, self.served_as = None, {}
        # the model the trainer loaded (train.py's --model, set by start): its names stand for the
        # served checkpoint's when the servers' folder is not on this machine (servers on other
        # nodes), since the servers must serve the trained model
        self.trained_from = None

    @classmethod
    def spawn(
        cls,
        model_dir: str,
        n=1,
        python="python",
        args=None,
        timeout=900,
        log_dir=".",
        places=None,
        sync_bytes=0,
    ):
        """Start ``n`` servers of ``model_dir`` with server flags ``args`` (or one per ``places``
        entry: the environment and arguments that put it on its GPUs) as subprocesses, logs in
        ``log_dir``/vllm_K.log; wait until healthy (``timeout`` seconds). Their weight syncs, of
        ``sync_bytes`` each, go to a new folder where they fit (``_sync_dir``)."""
        import secrets
        import subprocess

        # before the servers start: a sync that does not fit stops the run now, not minutes in
        sync_parent = _sync_dir(sync_bytes)
        procs, urls, key = [], [], secrets.token_urlsafe(32)
        # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on vLLM's CPU build, which otherwise reserves 92%
        # of memory (GPU builds ignore it). The key in VLLM_API_KEY, not --api-key: ps shows command
        # lines to every user, environments only to their own.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
        env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key}
        env |= {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHECKOUT, env.get("PYTHONPATH")]))
        die = _die_with_parent if sys.platform == "linux" else None
        for k, (place_env, place_args) in enumerate(places or [({}, [])] * n):
            port = _free_port()
            cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
            cmd += ["--port", str(port), *_SERVER_ARGS, *(args or []), *place_args]
            log = open(os.path.join(log_dir, f"vllm_{k}.log"), "w")
            out = dict(stdout=log, stderr=subprocess.STDOUT)
            procs.append(subprocess.Popen(cmd, env=env | place_env, preexec_fn=die, **out))
            urls.append(f"http://127.0.0.1:{port}")
        _wait_healthy(procs, urls, timeout, log_dir)
        sync_dir = tempfile.mkdtemp(prefix="lightning-lite-weights-", dir=sync_parent)
        backend = cls(urls, sync_dir, procs=procs, api_key=key)
        # a trainer that fails does not leave servers holding the GPU
        atexit.register(backend.close)
        return backend

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        on_token: Optional[Callable[[int], None]] = None,
        rollout_id: str = "",
    ) -> Generation:
        """As HFBackend's; a rollout's calls all go to one server (its prefix cache), chosen by its
        id, and --lora's to its adapter."""
        import aiohttp

        max_new = max_reply_tokens(prompt_ids, sampling, self.max_model_len)
        # a sync is under way: wait for it (checked and counted under one lock, so pause() sees us)
        while True:
            with self._cond:
                if not self.paused:
                    self._inflight, version = self._inflight + 1, self.version
                    break
            await asyncio.sleep(0.05)
        try:
            url = self.urls[zlib.crc32(rollout_id.encode()) % len(self.urls)]
            body = self._request_body(prompt_ids, sampling, max_new, on_token is not None)
            # --lora-per-harness: its harness's adapter (hooks.adapter.serving; None: "default")
            adapter = hooks.adapter.serving(rollout_id) or "default"
            body["model"] = f"{adapter}-v{version}" if self.adapter else self.model_name
            ids, logprobs, text, finish = [], [], [], None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
                headers = _auth(self.api_key)
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        hint = _GRAMMAR_HINT if sampling.grammar else ""
                        raise RuntimeError(
                            f"vLLM at {url} answered {r.status}: {(await r.text())[:500]}{hint}"
                        )
                    async for choice in _choices(r, body["stream"]):
                        new_ids = choice.get("token_ids") or []
                        ids += new_ids
                        logprobs += choice["logprobs"]["token_logprobs"] if new_ids else []
                        text.append(choice.get("text") or "")
                        finish = choice.get("finish_reason") or finish
                        for token in new_ids if on_token else []:
                            on_token(token)
            if finish not in ("stop", "length") or len(logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM at {url} ended a reply with finish_reason {finish!r} "
                    f"({len(ids)} ids, {len(logprobs)} logprobs)"
                )
            self.stats.update(requests=1, prompt_tokens=len(prompt_ids), generated_tokens=len(ids))
            return Generation(ids, logprobs, finish, "".join(text), version)
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _request_body(self, prompt_ids, sampling: Sampling, max_new: int, stream: bool) -> dict:
        """Every sampling field explicit, the penalties and min_p neutral: vLLM fills an unset one
        from the model's generation_config.json (Qwen2.5's repetition_penalty 1.05), a distribution
        the trainer never scores."""
        s = sampling
        body = {"prompt": list(prompt_ids), "max_tokens": max_new}
        body |= {"seed": s.seed, "temperature": s.temperature, "top_p": s.top_p}
        body |= {"top_k": s.top_k or -1, "min_p": 0.0, "repetition_penalty": 1.0}
        body |= {"presence_penalty": 0.0, "frequency_penalty": 0.0, "stop": s.stop, "logprobs": 0}
        body |= {"return_token_ids": True, "stream": stream}
        # the servers' guidance backend (llguidance) masks as grammar.Matcher does; the trainer
        # replays it
        if sampling.grammar:
            body["structured_outputs"] = {"grammar": sampling.grammar}
        return body

    def payload(self, learner):
        """What a weight sync sends the servers: the adapters alone under a model adapter, else the
        model's own tensors (under FSDP each rank's shards, which the sync gathers one at a time as
        rank 0 writes them: no rank holds the whole model)."""
        if self.adapter is not None:
            return self.adapter.weights(learner.model, self.dtype)
        return served_state_dict(learner.model)

    def make_room(self):
        """Before training: with --vllm-sleep the servers on the training GPUs free their memory
        (rank 0 puts them to sleep)."""
        if self.sleep_while_training and self.writes_weights:
            self.sleep()

    def sleep(self):
        """Free the servers' GPU memory (--vllm-sleep): sleep level 2 drops KV cache and weights;
        the next ``sync_weights`` wakes them and loads the new weights."""
        self.pause()
        self._post("/sleep?level=2")
        self.sleeping = True

    def sync_weights(self, model=None, version: Optional[int] = None):
        """Every server serves ``model``'s weights (a module, a state dict, whole or FSDP's shards,
        or, --lora, the adapters: ``LoRA.weights``'; None: only the version moves). Every rank
        calls it; rank 0 (``writes_weights``) writes, the others give their shards. Sleeping
        servers (level 2: no weights, no KV cache) wake in two steps, after the file is written
        (the trainer's copies are gone by then): the weights, reloaded, then the KV cache."""
        self.pause()
        if self.sleep_while_training and torch.cuda.is_available():
            # what training freed goes back to the GPU before the servers wake
            torch.cuda.empty_cache()
        if model is not None and self.adapter is None and not self.writes_weights:
            state = served_state_dict(model)
            if _sharded(state):
                # FSDP: this rank's shards go into each tensor rank 0 gathers and writes
                _gather_for_writer(state)
        if not self.writes_weights:
            model = None
        if self.sleeping and model is None:
            raise ValueError(
                "the servers slept at level 2 and dropped their weights: sync_weights needs the "
                "model"
            )
        version = self.version + 1 if version is None else version
        if model is not None and self.adapter is not None:
            self._load_adapters(model, version)
        elif model is not None:
            state = served_state_dict(model)
            # the servers' names, each storage once; in fp32 what vLLM computes in fp32
            trainer_name = self._as_served(state)
            dtypes = {}
            for name, trainer in trainer_name.items():
                dtypes[name] = self.dtype or state[trainer].dtype
                if keeps_fp32(name, self.checkpoint):
                    dtypes[name] = torch.float32
            if _sharded(state):
                # what every other rank gathers with this one, in this order (_gather_for_writer)
                order = [[(trainer_name[name], dtype) for name, dtype in dtypes.items()]]
                dist.broadcast_object_list(order, src=0)
            self._write({name: state[trainer] for name, trainer in trainer_name.items()}, dtypes)
            if self.sleeping:
                self._post("/wake_up?tags=weights")
            # Servers this run started say what their reload left out (extras/vllm_worker.py);
            # others (--vllm-url) answer only that it ran.
            method = "reload_weights"
            if self.procs:
                method = "counted_reload"
            reload = {"method": method, "kwargs": {"weights_path": self.sync_dir}}
            for url, answer in zip(self.urls, self._post("/collective_rpc", reload)):
                check_reload(url, answer)
            if self.sleeping:
                self._post("/wake_up?tags=kv_cache")
            self._post("/reset_prefix_cache")
        self.sleeping, self.version = False, version

    def _load_adapters(self, adapters: dict, version: int):
        """--lora: every server loads each adapter (peft's files, from ``LoRA.weights``) as
        "NAME-v{version}", then drops the previous version's. A new name each time: vLLM's prefix
        cache is keyed by it. A server that refuses one stops the run with what it said."""
        from safetensors.torch import save_file

        old, self.lora_loaded = self.lora_loaded, version
        for name, (config, weights) in adapters.items():
            path = os.path.join(self.sync_dir, f"v{version}", name)
            config.save_pretrained(path)
            served = self._served_adapter(weights)
            save_file(served, os.path.join(path, "adapter_model.safetensors"))
            load = {"lora_name": f"{name}-v{version}", "lora_path": path}
            needs = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            try:
                self._post("/v1/load_lora_adapter", load, route_needs=needs)
            except RuntimeError as e:
                flags = shlex.join(lora_flags(config.r, len(adapters)))
                raise SystemExit(
                    f"--lora: loading adapter {name!r} failed: {e}\n"
                    f"(servers that load these adapters are started with {flags})"
                ) from None
            if old is not None:
                self._post("/v1/unload_lora_adapter", {"lora_name": f"{name}-v{old}"})
        # Servers this run started say which adapter modules matched none of theirs
        # (extras/vllm_worker.py): the base model would serve there.
        if self.procs:
            for url, answer in zip(self.urls, self._post("/collective_rpc", _UNMATCHED)):
                check_adapters(url, answer)
        if old is not None:
            shutil.rmtree(os.path.join(self.sync_dir, f"v{old}"))

    def _post(self, route: str, body: Optional[dict] = None, **kwargs) -> list:
        """POST ``body`` (JSON, {} by default) to ``route`` of every server, with the API key, and
        return their answers. An answer {"success": false} is an error: vLLM's
        /reset_prefix_cache answers so, with a 200, while requests hold KV blocks, and the prefix
        cache would then serve the old weights'."""
        answers = []
        for url in self.urls:
            answer = _http(url + route, body or {}, key=self.api_key, **kwargs)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise RuntimeError(
                    f"{url}{route} answered {answer}: it was not done (/reset_prefix_cache: "
                    "requests still hold KV blocks there; does another client send to it?)"
                )
            answers.append(answer)
        return answers

    def _write(self, tensors: dict, dtypes: dict):
        """``sync_dir``/model.safetensors: ``tensors``, each in its ``dtypes``, converted (and,
        sharded, gathered) and copied to host memory as it is written (``write_safetensors``)."""
        path = os.path.join(self.sync_dir, "model.safetensors")
        # the file system may have filled since start-up; the previous sync's file is overwritten
        nbytes = sum(t.numel() * dtypes[k].itemsize for k, t in tensors.items())
        previous = 0
        if os.path.exists(path):
            previous = os.path.getsize(path)
        check_room(self.sync_dir, nbytes - previous, "free space there, or set TMPDIR")
        os.makedirs(self.sync_dir, exist_ok=True)
        write_safetensors(path, tensors, dtypes)

    def _as_served(self, state_dict: dict) -> dict:
        """{served name: trainer name}: the name the served checkpoint gives each of the trainer's
        tensors (``_served_names``: vLLM maps a sync's names as the checkpoint's, and Qwen3.5's
        text model is ``model.language_model.*`` there), in the state dict's order. Tied embeddings
        (one storage, or a gathered state dict's two equal copies) go under the first of their
        names the checkpoint holds. A tensor it does not hold stops the run, before any server
        reloads. What the checkpoint holds and the trainer does not (a vision tower, MTP layers)
        is left out: vLLM 0.32's reload keeps the weights it serves for the layers a sync does not
        name."""
        checkpoint = self._checkpoint()
        served = self._served_names(list(state_dict))
        # the names of each storage: two for tied embeddings (a shard's: its local tensor's, since
        # every DTensor's own data_ptr is 0)
        names_of = {}
        for k, v in state_dict.items():
            names_of.setdefault(_local(v).data_ptr(), []).append(k)
        unnamed = [names for names in names_of.values() if all(served[k] is None for k in names)]
        named = [names for names in names_of.values() if names not in unnamed]
        for names in unnamed:
            value = _local(state_dict[names[0]])
            # tied embeddings that a gathered state dict holds as two equal copies
            twins = [n for n in named if torch.equal(_local(state_dict[n[0]]), value)]
            tied = names[0].endswith("lm_head.weight") and twins
            if not tied:
                raise SystemExit(
                    f"the weight sync: the trainer's {names[0]} has no tensor in the checkpoint "
                    f"the vLLM servers serve ({self._served_root()}; e.g. "
                    f"{', '.join(sorted(checkpoint)[:3])}): serve the model the trainer trains "
                    "(--model, or the --resume checkpoint)"
                )
        out = {}
        for names in named:
            first = next(k for k in names if served[k] is not None)
            out[served[first]] = first
        return out

    def _served_root(self) -> str:
        """What the servers were started with as --model (a folder, or a hub name): /v1/models'
        "root"."""
        answer = _http(self.urls[0] + "/v1/models", timeout=30, key=self.api_key)
        return answer["data"][0]["root"]

    def _checkpoint(self) -> dict:
        """The served checkpoint's tensors, {name: dtype} (``checkpoint_tensors``), read at the
        first sync."""
        if self.checkpoint is None:
            root = self._served_root()
            if not os.path.isdir(root) and self.trained_from is not None:
                root = self.trained_from
            self.checkpoint = checkpoint_tensors(_local_model_dir(root))
        return self.checkpoint

    def _served_names(self, names: list) -> dict:
        """{trainer name: served name or None} (``served_names``), for ``names`` and those before."""
        new = [name for name in names if name not in self.served_as]
        if new:
            self.served_as |= served_names(new, set(self._checkpoint()))
        return self.served_as

    def _served_adapter(self, weights: dict) -> dict:
        """peft's adapter tensors (``base_model.model.MODULE.lora_A.weight``, MODULE as the trainer
        names it) renamed as the served checkpoint names MODULE (``MODULE.weight``, the weight it
        adapts): vLLM maps an adapter's module names as the checkpoint's, and leaves out one that
        names no module it serves, saying so at debug level only (the base model serves there).
        A module the checkpoint does not hold stops the run."""
        prefix = "base_model.model."
        module_of = {key: key.removeprefix(prefix).split(".lora_")[0] for key in weights}
        served = self._served_names([module + ".weight" for module in module_of.values()])
        missing = sorted({m for m in module_of.values() if served[m + ".weight"] is None})
        if missing:
            raise SystemExit(
                f"--lora: the checkpoint the vLLM servers serve ({self._served_root()}) has no "
                f"{missing[0]}.weight, which adapter module {missing[0]} adapts ({len(missing)} "
                "such modules): serve the base model the trainer trains (--model)"
            )
        renamed = {}
        for key, value in weights.items():
            module = module_of[key]
            served_module = served[module + ".weight"].removesuffix(".weight")
            # ".lora_A.weight", ".lora_B.weight"
            tail = key.removeprefix(prefix)[len(module) :]
            renamed[prefix + served_module + tail] = value
        return renamed

    def close(self):
        # terminate: a no-op when it has exited
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=60)
        # spawn() made the folder
        if self.procs:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


def check_reload(url: str, answer):
    """Stop the run when a server's reload left parameters as they were in the modules the sync
    sent weights for: each worker's ``counted_reload`` answer ({"results": [{"parameters": N,
    "left_out": [...]}, ...]}, extras/vllm_worker.py). Anything else (a plain reload's empty 200,
    a model whose loader does not say what it loaded) has nothing to check."""
    if not isinstance(answer, dict):
        return
    for result in answer.get("results") or []:
        if isinstance(result, dict) and result.get("left_out"):
            left = result["left_out"]
            names = ", ".join(left[:8])
            if len(left) > 8:
                names += f" and {len(left) - 8} more"
            raise SystemExit(
                f"{url}: the weight sync reloaded {result['parameters'] - len(left)} of "
                f"{result['parameters']} parameters; {len(left)} in the synced modules kept their "
                f"old weights: {names}. vLLM skipped names it does not map: is the served model "
                "the trained one (--model)?"
            )


_UNMATCHED = {"method": "unmatched_adapter_modules"}


def check_adapters(url: str, answer):
    """Stop the run when a server holds an adapter with modules that match none of the served
    model's: each worker's ``unmatched_adapter_modules`` answer ({"results": [{id: [names]}]})."""
    for result in answer.get("results") or []:
        for adapter, names in result.items():
            if names:
                raise SystemExit(
                    f"{url}: adapter {adapter}'s modules {', '.join(names[:8])} ({len(names)}) "
                    "match no module of the served model: the base model would serve there. Is "
                    "the served model the trained one (--model)?"
                )


# --------------------------------------------------------------------------- the served names

# Parameters vLLM 0.32 creates in fp32 whatever --dtype says: Qwen3.5/Qwen3-Next GatedDeltaNet's
# A_log (layers/mamba/gdn/qwen_gdn_linear_attn.py), the MoE gates' e_score_correction_bias
# (models/deepseek_v2.py, glm4_moe.py, ...)
FP32_IN_VLLM = ("A_log", "e_score_correction_bias")


def keeps_fp32(name: str, checkpoint: dict) -> bool:
    """Whether a sync writes tensor ``name`` of the served ``checkpoint`` ({name: dtype}) in fp32
    whatever the sync's dtype: vLLM keeps it in fp32 (``FP32_IN_VLLM``), or the checkpoint stores
    it in fp32 beside tensors of lower precision (its authors kept it so)."""
    lower = any(dtype in ("BF16", "F16") for dtype in checkpoint.values())
    kept = checkpoint[name] == "F32" and lower
    return kept or name.rsplit(".", 1)[-1] in FP32_IN_VLLM


def checkpoint_tensors(model_dir: str) -> dict:
    """The tensors of the checkpoint in ``model_dir``, {name: dtype as safetensors says it ("BF16",
    "F32", ...)}, from its files' headers (no tensor is read)."""
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if not files:
        raise SystemExit(
            f"the vLLM servers serve {model_dir}, which holds no .safetensors: a weight sync writes "
            "the checkpoint's names, so serve a safetensors checkpoint"
        )
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_slice(name).get_dtype()
    return tensors


def _local_model_dir(root: str) -> str:
    """The folder of what the servers serve: ``root`` itself, or a hub name's in the hub cache
    (where the trainer, loading the same name, put it)."""
    if os.path.isdir(root):
        return root
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(root, allow_patterns=["*.safetensors"], local_files_only=True)
    # not in the cache, or a path (a folder on another machine), not a hub name
    except (LocalEntryNotFoundError, HFValidationError):
        raise SystemExit(
            f"the vLLM servers serve {root}, neither a folder here nor in this machine's hub "
            "cache: a weight sync names its tensors as that checkpoint does, so start the servers "
            "with a --model folder this machine reads too"
        ) from None


def served_names(trainer_names: list, checkpoint: set) -> dict:
    """Each of ``trainer_names`` as the served ``checkpoint`` (its tensor names) names it, or None
    where it holds none. A name it holds is kept. Any other is renamed by a prefix rule, learned
    from trainer names whose ending (of two parts or more, the longest found) ends checkpoint
    names after one prefix only. The trainer loads Qwen3.5's text model (``model.layers.0.*``);
    the checkpoint, a vision-language model, has it as ``model.language_model.layers.0.*``:

    >>> served_names(["model.norm.weight", "lm_head.weight", "model.layers.0.q.weight"],
    ...     {"model.language_model.norm.weight", "lm_head.weight", "model.visual.norm.weight",
    ...      "model.language_model.layers.0.q.weight"})
    {'model.norm.weight': 'model.language_model.norm.weight', 'lm_head.weight': 'lm_head.weight',
     'model.layers.0.q.weight': 'model.language_model.layers.0.q.weight'}

    ("norm.weight" ends two names; "layers.0.q.weight" one, after "model.language_model.": the
    rule "model." -> "model.language_model.")."""
    # each ending of two parts or more of a checkpoint name: the prefixes it follows
    prefixes = {}
    for name in checkpoint:
        parts = name.split(".")
        for k in range(len(parts) - 1):
            ending = ".".join(parts[k:])
            prefixes.setdefault(ending, set()).add(name[: len(name) - len(ending)])
    rules = set()
    for name in trainer_names:
        parts = name.split(".")
        for k in range(len(parts) - 1):
            ending = ".".join(parts[k:])
            found = prefixes.get(ending, set())
            if len(found) == 1:
                rules.add((name[: len(name) - len(ending)], next(iter(found))))
            if found:
                break
    renamed = {}
    for name in trainer_names:
        candidates = {new + name[len(old) :] for old, new in rules if name.startswith(old)}
        options = candidates & checkpoint
        if name in checkpoint:
            options = {name}
        renamed[name] = None
        if len(options) == 1:
            renamed[name] = options.pop()
    return renamed


# --------------------------------------------------------------------------- starting servers, HTTP


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(procs: list, urls: list, timeout: float, log_dir: str):
    """Until every server answers /health; a server that exits or does not answer in time fails it
    all."""
    t0 = time.time()
    for k, (proc, url) in enumerate(zip(procs, urls)):
        log = os.path.join(log_dir, f"vllm_{k}.log")
        while True:
            if proc.poll() is not None:
                for other in procs:
                    other.kill()
                raise RuntimeError(f"vLLM server {k} exited with code {proc.returncode}: see {log}")
            try:
                _http(url + "/health", timeout=5)
                break
            except OSError:
                if time.time() - t0 > timeout:
                    raise TimeoutError(
                        f"vLLM server {k} not healthy after {timeout:.0f} s: see {log}"
                    ) from None
                time.sleep(2)


def _sync_dir(nbytes: int) -> str:
    """Where the weight syncs of servers on this machine go, ``nbytes`` each (``_sync_bytes``): in
    memory (/dev/shm) when it has room for them (Docker gives it 64 MB by default), else the
    temporary folder on disk ($TMPDIR), which must have room (``check_room``). ``spawn`` makes a
    new folder in it once the servers are up."""
    shm_free = 0
    if os.path.isdir("/dev/shm"):
        shm_free = shutil.disk_usage("/dev/shm").free
        if shm_free >= nbytes:
            return "/dev/shm"
    on_disk = tempfile.gettempdir()
    hint = (
        f"/dev/shm has {shm_free / 2**30:.2f} GiB free: give it more (docker run --shm-size, "
        "a Kubernetes emptyDir of medium Memory) or set TMPDIR to a folder with room"
    )
    check_room(on_disk, nbytes, hint)
    return on_disk


# safetensors' names of the dtypes a sync writes
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SAFETENSORS_DTYPES |= {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str, tensors: dict, dtypes: dict):
    """Write ``tensors`` (name -> tensor, on any device) to ``path`` as safetensors, each converted
    to ``dtypes[name]`` and copied to host memory only when its turn comes: the host holds one
    tensor beside the file (safetensors' save_file takes every tensor in host memory first, 16 GB
    for an 8B model in bf16). The format: 8 bytes of header length (little-endian), the JSON
    header {name: {"dtype", "shape", "data_offsets": [begin, end]}} padded with spaces to 8 bytes,
    then the tensors' bytes in the header's order.

    A 2 x 3 tensor in BF16 then a 4-element one in F32: offsets [0, 12] and [12, 28]."""
    header = {}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * dtypes[name].itemsize
        dtype = SAFETENSORS_DTYPES[dtypes[name]]
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, t in tensors.items():
            host = _whole(t, dtypes[name]).to("cpu").contiguous().reshape(-1)
            f.write(memoryview(host.view(torch.uint8).numpy()))


def _whole(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, whole: a shard (FSDP's DTensor) is converted, then gathered from
    every rank (a collective: each rank calls this for the same tensors in the same order)."""
    tensor = tensor.detach().to(dtype)
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor


def _sharded(state_dict: dict) -> bool:
    """Whether ``state_dict`` holds shards (FSDP's DTensors) rather than whole tensors."""
    return any(hasattr(t, "full_tensor") for t in state_dict.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A shard's local part (this rank's), or a whole tensor itself."""
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    return tensor


def _gather_for_writer(state_dict: dict):
    """The side of a sync of FSDP's shards on the ranks that write nothing: gather each tensor rank
    0 writes, in the order and dtype it broadcasts (``sync_weights``), and drop it."""
    order = [None]
    dist.broadcast_object_list(order, src=0)
    for name, dtype in order[0]:
        _whole(state_dict[name], dtype)


def check_room(folder: str, nbytes: int, hint: str = "free space there"):
    """Stop the run when the file system of ``folder`` (made or not yet) has less than ``nbytes``
    free: the bytes a weight sync is about to write there (a file it overwrites counts as free:
    subtract its size). ``hint`` says what to do. At start-up for the sync folder; cheap enough
    (one statvfs) to call before each sync's write, as a file system can fill during a run.

    check_room("/dev/shm", 16 * 2**30)  # Docker's 64 MB /dev/shm: SystemExit, naming both numbers
    """
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if free < nbytes:
        raise SystemExit(
            f"a weight sync writes {nbytes / 2**30:.2f} GiB into {folder}, whose file system has "
            f"{free / 2**30:.2f} GiB free: {hint}"
        )


def _die_with_parent():
    """In a started server: get SIGTERM when the trainer dies, however it dies (Linux
    PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _auth(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _http(
    url: str,
    body: Optional[dict] = None,
    timeout: float = 600,
    key: Optional[str] = None,
    route_needs: str = "VLLM_SERVER_DEV_MODE=1",
):
    """GET (or POST ``body`` as JSON, with API ``key``): the answer, parsed when JSON (the LoRA
    routes answer text). Errors name the URL and what the server said; a route it does not have
    (404) says what a server must be started with to have it (``route_needs``)."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **_auth(key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        said = e.read()[:1000].decode(errors="replace")
        hint = ""
        if e.code == 401:
            hint = " (wrong or missing API key: --vllm-api-key)"
        elif e.code == 404:
            hint = f" (the server has no such route: start it with {route_needs})"
        raise RuntimeError(f"{url} answered {e.code}: {said}{hint}") from None
    return json.loads(raw) if raw.strip()[:1] in (b"{", b"[") else raw.decode()


async def _choices(response, stream: bool):
    """The completion's choice, or its server-sent chunks' as they arrive."""
    if not stream:
        yield (await response.json())["choices"][0]
        return
    async for line in response.content:
        if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
            yield json.loads(line[5:])["choices"][0]


hooks.BACKENDS["vllm"] = start
