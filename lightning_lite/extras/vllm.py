"""vLLM servers as the backend (README: GPUs: vLLM). Its seam is the backend class: ``VLLMBackend``
has HFBackend's surface (generate, pause/resume, payload, sync_weights, make_room, close, version,
max_model_len, stats), plus ``sleep``. train.py chooses it with ``--backend vllm`` and gets it from
``start`` (``hooks.BACKENDS["vllm"]``); proxy.py from ``--vllm-url``.

    backend = start(args, learner, resume_dir, device)          # rank 0 starts the servers
    gen = await backend.generate(prompt_ids, sampling, rollout_id="r1")
    backend.sync_weights(state_dict, version=1)                # rank 0 writes, the servers reload
"""

import asyncio
import atexit
import glob
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

from .. import hooks, parallel
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
ARGS_HELP = "more arguments for the started servers, e.g. '--dtype bfloat16 --max-model-len 4096'"
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
    the same servers; rank 0 writes the weight syncs, in the trainer's compute dtype. The trained
    model's config gives the context and RoPE. Under a model adapter (--lora) the servers serve the
    base model and load each sync's adapters."""
    config = learner.model.config
    dtype = learner.dtype
    adapter = learner.adapter
    if args.vllm_sleep and adapter is not None:
        sys.exit("--vllm-sleep drops the base model the adapters need: leave it out with --lora")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not args.vllm_url and local_world < world:
        sys.exit(
            "--backend vllm starts its servers on rank 0's node, at 127.0.0.1: "
            "over several nodes start them yourself and pass --vllm-url"
        )
    # --max-model-len: the servers get the trainer's context and RoPE scaling (models.load_model:
    # YaRN past the trained length), or every logprob differs
    context = []
    if args.max_model_len:
        n = config.max_position_embeddings
        overrides = {"max_position_embeddings": n, "rope_parameters": config.rope_parameters}
        context = ["--max-model-len", str(n), "--hf-overrides", json.dumps(overrides)]
    backend, urls, key = None, args.vllm_url, args.vllm_api_key
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
        python, n = args.vllm_python, args.vllm_servers
        model_dir = resolve(resume_dir or args.model)
        if adapter is not None:
            # the checkpoint holds adapters: the servers serve the base model
            model_dir = resolve(args.model)
        backend = VLLMBackend.spawn(model_dir, n, python, flags, log_dir=args.out, places=places)
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
    backend.parallel = args.parallel
    # servers a user started may serve other weights (a previous run's, before --resume); under an
    # adapter they serve the base model until they load the adapters
    backend.first_sync = bool(args.vllm_url) or adapter is not None
    if args.vllm_url and context and backend.max_model_len != args.max_model_len:
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


def placement(gpu_sets: list[str], trainer_gpus: list[str], share=None, args: list = ()) -> list:
    """Each started server's (environment, arguments) for ``VLLMBackend.spawn``: one per GPU set,
    tensor-parallel over it, with ``share`` of each GPU's memory (default 0.3 beside the trainer,
    0.9 alone).

    >>> placement(["0", "4,5"], trainer_gpus=["0", "1"])  # the trainer on GPUs 0 and 1
    [({'CUDA_VISIBLE_DEVICES': '0'}, ['--gpu-memory-utilization', '0.3', '--tensor-parallel-size', '1']),
     ({'CUDA_VISIBLE_DEVICES': '4,5'}, ['--gpu-memory-utilization', '0.9', '--tensor-parallel-size', '2'])]
    """
    ours = ("--tensor-parallel-size", "--gpu-memory-utilization")
    for arg in args:
        flag = arg.split("=")[0].replace("_", "-")
        # argparse takes abbreviations: --gpu-mem sets --gpu-memory-utilization
        if flag == "-tp" or len(flag) > 2 and any(f.startswith(flag) for f in ours):
            raise ValueError(
                f"--vllm-args sets {arg}: give the GPUs and memory share as --vllm-gpus, "
                "--vllm-gpu-memory"
            )
    places = []
    for gpu_set in gpu_sets:
        ids = gpu_set.split(",")
        memory = share or (0.3 if set(ids) & set(trainer_gpus) else 0.9)
        flags = ["--gpu-memory-utilization", str(memory), "--tensor-parallel-size", str(len(ids))]
        places.append(({"CUDA_VISIBLE_DEVICES": gpu_set}, flags))
    return places


def lora_flags(rank, adapters=1) -> list:
    """--lora RANK: the server flags for its adapters (vLLM takes ranks 1, 8, 16, ... 512)."""
    rank = next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(adapters)]


# What every started server needs: processed logprobs (of the distribution sampled from), vLLM's
# sampling defaults (not generation_config.json's), grammars by the guidance backend (llguidance)
_SERVER_ARGS = [
    *"--host 127.0.0.1 --logprobs-mode processed_logprobs --generation-config vllm".split(),
    *["--structured-outputs-config", '{"backend": "guidance"}'],
]
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
        # of the weight-sync file (train.py: --dtype's, half of fp32 in bf16); None: the weights'
        # own
        self.dtype = None
        try:
            answers = [_http(u + "/v1/models", timeout=30, key=self.api_key) for u in self.urls]
        except OSError as e:
            raise RuntimeError(
                f"no vLLM server answers at {' '.join(self.urls)} ({e}): "
                "start it (README: GPUs), or leave out --vllm-url"
            ) from None
        # each server's one model: {"id": name, "max_model_len": n, ...}
        models = [answer["data"][0] for answer in answers]
        self.model_name = models[0]["id"]
        self.max_model_len = min(m["max_model_len"] for m in models)
        self.version, self.paused, self.sleeping = 0, False, False
        # train.py's (start): --vllm-sleep, the run's --parallel, and whether the first step must
        # sync the trained weights before any rollout
        self.sleep_while_training = False
        self.parallel = "ddp"
        self.first_sync = False
        # a model adapter (--lora): the servers serve the base model, and adapter NAME of version K
        # as "NAME-vK"
        self.adapter, self.lora_loaded = None, None
        # --lora-per-harness: a rollout id's adapter (None: "default")
        self.adapter_of = None
        # the calls sent out and not answered yet
        self._inflight, self._cond = 0, threading.Condition()
        self.stats = Counter(requests=0, prompt_tokens=0, generated_tokens=0)

    @classmethod
    def spawn(
        cls, model_dir: str, n=1, python="python", args=None, timeout=900, log_dir=".", places=None
    ):
        """Start ``n`` servers of ``model_dir`` with server flags ``args`` (or one per ``places``
        entry: the environment and arguments that put it on its GPUs) as subprocesses, logs in
        ``log_dir``/vllm_K.log; wait until healthy (``timeout`` seconds)."""
        import secrets
        import subprocess

        procs, urls, key = [], [], secrets.token_urlsafe(32)
        # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on vLLM's CPU build, which otherwise reserves 92%
        # of memory (GPU builds ignore it). The key in VLLM_API_KEY, not --api-key: ps shows command
        # lines to every user, environments only to their own.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
        env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key}
        env |= {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
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
        backend = cls(urls, _sync_dir(model_dir), procs=procs, api_key=key)
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
            adapter = self.adapter_of(rollout_id) if self.adapter_of else "default"
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
        whole model (FSDP's shards gathered into rank 0's host memory: a collective)."""
        if self.adapter is not None:
            return self.adapter.weights(learner.model, self.dtype)
        return parallel.full_state_dict(learner.model, self.parallel)

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
        """Every server serves ``model``'s weights (a module, a full state dict or, --lora, the
        adapters: ``LoRA.weights``'; None: only the version moves). Sleeping servers (level 2: no
        weights, no KV cache) wake in two steps, after the file is written (the trainer's copies are
        gone by then): the weights, reloaded, then the KV cache."""
        self.pause()
        if self.sleep_while_training and torch.cuda.is_available():
            # what training freed goes back to the GPU before the servers wake
            torch.cuda.empty_cache()
        model = model if self.writes_weights else None
        if self.sleeping and model is None:
            raise ValueError(
                "the servers slept at level 2 and dropped their weights: sync_weights needs the "
                "model"
            )
        version = self.version + 1 if version is None else version
        if model is not None and self.adapter is not None:
            self._load_adapters(model, version)
        elif model is not None:
            self._write(served_state_dict(model))
            if self.sleeping:
                self._post("/wake_up?tags=weights")
            reload = {"method": "reload_weights", "kwargs": {"weights_path": self.sync_dir}}
            self._post("/collective_rpc", reload)
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
            save_file(weights, os.path.join(path, "adapter_model.safetensors"))
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
        if old is not None:
            shutil.rmtree(os.path.join(self.sync_dir, f"v{old}"))

    def _post(self, route: str, body: Optional[dict] = None, **kwargs):
        """POST ``body`` (JSON, {} by default) to ``route`` of every server, with the API key."""
        for url in self.urls:
            _http(url + route, body or {}, key=self.api_key, **kwargs)

    def _write(self, state_dict: dict):
        """``sync_dir``/model.safetensors, in ``self.dtype``. Tied embeddings share storage: written
        once, under its first name (vLLM re-ties it)."""
        from safetensors.torch import save_file

        first = {v.data_ptr(): (k, v) for k, v in reversed(state_dict.items())}
        out = {}
        for k, v in first.values():
            out[k] = v.detach().to("cpu", self.dtype or v.dtype).contiguous()
        os.makedirs(self.sync_dir, exist_ok=True)
        save_file(out, os.path.join(self.sync_dir, "model.safetensors"))

    def close(self):
        # terminate: a no-op when it has exited
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=60)
        # spawn() made the folder
        if self.procs:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


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


def _sync_dir(model_dir: str) -> str:
    """A new folder for the weight syncs of servers on this machine: in memory (/dev/shm) when it
    holds the weights twice over (a bf16 checkpoint synced in fp32; Docker gives /dev/shm 64 MB by
    default), else on disk. A hub name (no folder here) has no size to check."""
    need = 2 * sum(map(os.path.getsize, glob.glob(glob.escape(model_dir) + "/*.safetensors")))
    in_memory = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need
    return tempfile.mkdtemp(prefix="lightning-lite-weights-", dir="/dev/shm" if in_memory else None)


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
