"""Inference backends: prompt token ids in, response token ids + logprobs out. Every backend has the same small
surface, so the proxy never knows which one serves it:

    gen = await backend.generate(prompt_ids, Sampling(max_tokens=64, temperature=1.0), on_token=None)
    gen.response_ids, gen.logprobs, gen.finish_reason, gen.text
    backend.pause(); ...train...; backend.sync_weights(model); backend.resume()

``HFBackend`` is the embedded one (README: the embedded backend): a transformers model in this process (CPU,
or one GPU), for decoder-only models with full attention (Llama, SmolLM, Qwen2/2.5/3, Mistral without
sliding window); use vLLM for others. ``VLLMBackend`` sends the same token ids to vLLM OpenAI servers.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .extras import grammar
from .algo import sampling_support
from .chat import Sampling
from .models import eos_ids


@dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]  # logprob of each response id under the distribution it was sampled from
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    text: str  # decoded response, special tokens and a matched stop string removed
    version: int = 0  # the weights version that produced it


def sample_token(
    logits: torch.Tensor,
    s: Sampling,
    generator: Optional[torch.Generator] = None,
    allowed: Optional[torch.Tensor] = None,
) -> tuple[int, float]:
    """Sample one token from ``logits`` [V] and return it with its logprob under the *sampled* distribution:
    softmax(logits / T) on the top-k / top-p support (``algo.sampling_support``, the trainer's rule too),
    renormalized, so the trainer's importance ratio compares like with like. Greedy (T = 0) is not a
    distribution; it reports the logprob under softmax(logits). ``allowed`` [V] bool: a grammar's mask
    (grammar.Matcher), applied first, as vLLM applies it before its sampler.

    >>> sample_token(torch.tensor([0.0, 0.0, 10.0]), Sampling(temperature=0))
    (2, -9.08e-05)
    """
    x = logits.float() if allowed is None else logits.float().masked_fill(~allowed, float("-inf"))
    if s.temperature > 0:
        x = x / s.temperature
        if s.top_k > 0 or s.top_p < 1.0:
            keep = sampling_support(
                x[None], torch.tensor([s.top_k], device=x.device), x.new_tensor([s.top_p])
            )[0]
            x = x.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(x, -1)
    tok = (
        int(torch.multinomial(lp.exp(), 1, generator=generator))
        if s.temperature > 0
        else int(torch.argmax(lp))
    )
    return tok, float(lp[tok])


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling  # max_tokens: at most what the prompt leaves of the context
    future: asyncio.Future  # of the caller's event loop
    generator: Optional[torch.Generator]
    on_token: Optional[
        Callable[[int], None]
    ]  # called on the request's event loop with each sampled id
    matcher: Optional[grammar.Matcher] = None  # sampling.grammar's state
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _Gate:
    """pause() and resume() of both backends; ``_inflight``: the running batch (HF), the calls sent out (vLLM)."""

    def pause(self):
        """New work waits; returns when the work in flight has finished (before training touches the weights)."""
        with self._cond:
            self.paused = True
            while self._inflight:
                self._cond.wait()

    def resume(self):
        with self._cond:
            self.paused = False
            self._cond.notify_all()


def _max_new(prompt_ids: list[int], sampling: Sampling, max_model_len: int) -> int:
    """How many tokens a reply may have: ``max_tokens``, at most what the prompt leaves of the context."""
    room = max_model_len - len(prompt_ids)
    if not prompt_ids or room < 1:
        raise ValueError(
            f"a prompt of {len(prompt_ids)} tokens does not fit the model's context of {max_model_len}: "
            f"1 to {max_model_len - 1} tokens fit"
        )
    return min(sampling.max_tokens or room, room)


def _state_dict(model) -> dict:
    """The weights to serve: a module's (unwrapped from DDP), or a full state dict (gathered from FSDP shards)."""
    return model if isinstance(model, dict) else getattr(model, "module", model).state_dict()


class HFBackend(_Gate):
    """Embedded transformers backend with batching and a prefix KV cache. ``dtype`` bf16: every forward runs under
    bf16 autocast, as the trainer's does (train.py --dtype)."""

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int = 32,
        max_model_len: Optional[int] = None,
        prefix_cache_tokens: int = 32768,
        dtype: torch.dtype = torch.float32,
    ):
        self.model, self.tok, self.dtype = model, tokenizer, dtype
        self.device = next(model.parameters()).device
        if (
            model.config._attn_implementation == "sdpa"
        ):  # the same attention, without copying KV heads in decoding
            model.set_attn_implementation("grouped_sdpa")
        self.max_model_len = int(
            max_model_len or getattr(model.config, "max_position_embeddings", None) or 4096
        )
        self.max_batch_size = max_batch_size
        self.eos_ids = eos_ids(tokenizer, model.generation_config)
        self.version = 0
        self.stats = Counter(
            requests=0,
            prompt_tokens=0,
            cached_tokens=0,
            generated_tokens=0,
            cancelled=0,
            batches=0,
            busy_s=0.0,
        )
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefix: list[
            tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]
        ] = []  # least recently used first
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self.paused = self._inflight = self._closed = False
        self._thread = threading.Thread(target=self._worker, name="hf-backend", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        on_token: Optional[Callable[[int], None]] = None,
        rollout_id: str = "",
    ) -> Generation:
        """Sample a reply to ``prompt_ids``; ``on_token(id)``, when given, sees each id as it is sampled (streaming)."""
        sampling = replace(sampling, max_tokens=_max_new(prompt_ids, sampling, self.max_model_len))
        generator = (
            None
            if sampling.seed is None
            else torch.Generator(self.device).manual_seed(sampling.seed)
        )
        matcher = (
            grammar.Matcher(sampling.grammar, self.tok, self.model.config.vocab_size)
            if sampling.grammar
            else None
        )
        req = _Request(
            list(prompt_ids),
            sampling,
            asyncio.get_running_loop().create_future(),
            generator,
            on_token,
            matcher,
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("backend is closed")
            self._pending.append(req)
            self._cond.notify_all()
        return await req.future

    def pause(self):
        """As _Gate's; the prefix KV cache goes too: the weights are about to change (training, a sync), and
        training gets its memory (up to ``prefix_cache_tokens`` of KV)."""
        super().pause()
        self._prefix.clear()

    def sync_weights(self, model=None, version: Optional[int] = None):
        """Pause, then serve ``model``'s weights (see _state_dict; the module we serve: only stale caches go)."""
        self.pause()  # the running batch finishes on the old weights; no other starts; the stale KV goes
        if model is not None and model is not self.model:
            self.model.load_state_dict(_state_dict(model))
        self.version = self.version + 1 if version is None else version

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ worker

    def _worker(self):
        while True:
            with self._cond:
                while not self._closed and (self.paused or not self._pending):
                    self._cond.wait()
                if self._closed:
                    for r in self._pending:
                        r.future.get_loop().call_soon_threadsafe(
                            _settle, r.future, RuntimeError("backend closed")
                        )
                    return
                self._inflight = True
            t0 = time.time()
            try:
                # autocast is per thread: it is entered here, in the thread that runs the model
                with torch.autocast(
                    self.device.type, self.dtype, enabled=self.dtype != torch.float32
                ):
                    self._run()
            finally:
                with self._cond:
                    self._inflight = False
                    self.stats.update(batches=1, busy_s=time.time() - t0)
                    self._cond.notify_all()

    def _take(self, room: int) -> list[_Request]:
        """Pending requests that may join the running batch (none while paused)."""
        with self._cond:
            if self.paused:
                return []
            live = [
                r for r in self._pending if not r.future.cancelled()
            ]  # the others' clients went away
            self.stats["cancelled"] += len(self._pending) - len(live)
            new, self._pending = live[:room], live[room:]
            return new

    def _lookup(self, ids: list[int]) -> tuple[int, Optional[list]]:
        """Longest cached prefix of ``ids``, of 8 tokens or more (leaving at least one token to prefill)."""
        common = [len(os.path.commonprefix([toks, ids[:-1]])) for toks, _ in self._prefix]
        n = max(common, default=0)
        if n < 8:
            return 0, None
        entry = self._prefix.pop(common.index(n))
        self._prefix.append(entry)  # now the most recently used
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in entry[1]]

    def _store(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Remember the KV of ``ids``; entries that are a prefix of it become redundant and leave."""
        if len(ids) > self.prefix_cache_tokens:
            return
        self._prefix = [(toks, old) for toks, old in self._prefix if ids[: len(toks)] != toks]
        self._prefix.append((ids, kv))
        while sum(len(toks) for toks, _ in self._prefix) > self.prefix_cache_tokens:
            self._prefix.pop(0)  # the least recently used

    def _prefill(self, r: _Request):
        hit, kv = self._lookup(r.prompt_ids)
        rest = torch.tensor(
            [r.prompt_ids[hit:]], device=self.device
        )  # its positions follow the cache's
        cache = DynamicCache(ddp_cache_data=kv)  # kv None: an empty cache
        out = self.model(input_ids=rest, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.stats.update(prompt_tokens=len(r.prompt_ids), cached_tokens=hit)
        # Requests that arrive together often share a prompt (a GRPO group): let the next one reuse this one.
        self._store(list(r.prompt_ids), [(l.keys, l.values) for l in out.past_key_values.layers])
        return out.past_key_values, out.logits[0, -1]

    def _finish(self, r: _Request, tok: int) -> Optional[tuple[str, str]]:
        """(finish_reason, text) when ``r``, which just sampled ``tok``, is done; else None."""
        reason = (
            "stop"
            if tok in self.eos_ids
            else "length"
            if len(r.response_ids) >= r.sampling.max_tokens
            else None
        )
        if not (reason or r.sampling.stop):
            return None  # no need to decode
        text = self.tok.decode(r.response_ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in r.sampling.stop if s in text), default=None)
        if cut is not None:
            return "stop", text[:cut]
        return (reason, text) if reason else None

    @torch.inference_mode()
    def _run(self):
        """Decode until no request is left, admitting new requests at every step (continuous batching):
        a row that finishes is answered at once and leaves the batch, so an agent's next turn can join
        while the others still decode."""
        batch, version = (
            _Batch(self.device),
            self.version,
        )  # no weight sync can happen while a batch runs
        while True:
            new = self._take(self.max_batch_size - len(batch.rows))
            try:
                self.stats["requests"] += len(new)
                for r in new:  # prefill each on its own (with a cached prefix), then join the batch
                    batch.add(r, *self._prefill(r))
                if not batch.rows:
                    return
                keep = []
                for j, r in enumerate(batch.rows):
                    allowed = r.matcher.allowed().to(self.device) if r.matcher else None
                    tok, lp = sample_token(batch.last[j], r.sampling, r.generator, allowed)
                    if r.matcher:
                        r.matcher.consume(tok)
                    r.response_ids.append(tok)
                    r.logprobs.append(lp)
                    if r.on_token:
                        r.future.get_loop().call_soon_threadsafe(r.on_token, tok)
                    self.stats["generated_tokens"] += 1
                    if (
                        r.future.cancelled()
                    ):  # the client went away (the proxy cancels its call): stop generating
                        self.stats["cancelled"] += 1
                    elif done := self._finish(r, tok):
                        # the cache holds prompt + response[:-1]: keep it for this conversation's next turn
                        self._store(r.prompt_ids + r.response_ids[:-1], batch.row_cache(j))
                        gen = Generation(r.response_ids, r.logprobs, *done, version)
                        r.future.get_loop().call_soon_threadsafe(_settle, r.future, gen)
                    else:
                        keep.append(j)
                if len(keep) < len(batch.rows):
                    batch.keep(keep)
                if batch.rows:
                    batch.step(self.model)
            except (
                Exception
            ) as e:  # a backend failure fails these requests (the proxy reports it), never silently
                for r in batch.rows + new:
                    r.future.get_loop().call_soon_threadsafe(_settle, r.future, e)
                return


class _Batch:
    """The requests decoding together, their KV caches left-padded to one length so that every row's next
    token goes into the same column. ``mask`` hides the padding: row j's own cache is its last ``mask[j].sum()``
    columns, which is also the position of its next token. ``last``: each row's latest logits."""

    def __init__(self, device):
        self.device = device
        self.rows: list[_Request] = []
        self.cache = self.mask = self.last = None

    def add(self, r: _Request, cache, logit: torch.Tensor):
        """Join a prefilled request: its own cache, and the logits after its prompt."""
        n = cache.get_seq_length()
        if not self.rows:
            for layer in cache.layers:
                layer.__class__ = _RoomyLayer  # appends in place (see _RoomyLayer)
            self.cache, self.mask, self.last = (
                cache,
                logit.new_ones((1, n), dtype=torch.long),
                logit[None],
            )
        else:  # left-pad the batch or the newcomer to the longer of the two
            L, widen = max(self.mask.shape[1], n), max(n - self.mask.shape[1], 0)
            for k, layers in (
                (widen, self.cache.layers),
                (L - n, cache.layers),
            ):  # k columns of padding on the left
                for layer in layers if k > 0 else []:
                    layer.keys, layer.values = (
                        F.pad(t, (0, 0, k, 0)) for t in (layer.keys, layer.values)
                    )
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys, mine.values = (
                    torch.cat([mine.keys, theirs.keys]),
                    torch.cat([mine.values, theirs.values]),
                )
            row_mask = torch.arange(L, device=self.device)[None] >= L - n
            self.mask = torch.cat([F.pad(self.mask, (widen, 0)), row_mask.long()])
            self.last = torch.cat([self.last, logit[None]])
        self.rows.append(r)

    def row_cache(self, j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row j's own KV (without padding), copied out of the batch."""
        s = self.mask.shape[1] - int(self.mask[j].sum())
        return [
            (l.keys[j : j + 1, :, s:].clone(), l.values[j : j + 1, :, s:].clone())
            for l in self.cache.layers
        ]

    def keep(self, keep: list[int]):
        """Keep only rows ``keep``, then drop the columns that are padding for every row left."""
        self.rows = [self.rows[j] for j in keep]
        if not self.rows:  # the batch is over (add() starts a new one)
            return
        idx = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.last = self.mask[idx], self.last[idx]
        trim = self.mask.shape[1] - int(self.mask.sum(1).max())
        if trim > 0:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, trim:], layer.values[:, :, trim:]
            self.mask = self.mask[:, trim:]

    def step(self, model):
        """Feed each row its latest sampled token; the logits for the next one land in ``last``."""
        toks = torch.tensor([r.response_ids[-1] for r in self.rows], device=self.device)[:, None]
        pos = self.mask.sum(1, keepdim=True)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], 1)
        out = model(
            input_ids=toks,
            attention_mask=self.mask,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.last = out.logits[:, -1]


# ---------------------------------------------------------------------------- decoding at agent-length contexts
# Two copies per decode step dominate once the context is long (8k tokens, 135M model: ~1.5 GB of memory
# traffic per token against 0.5 GB of weights): DynamicCache appends by torch.cat, copying the whole cache,
# and transformers' SDPA repeats every KV head for each of its query heads whenever a mask is given, which
# batched decoding always does. The layer appends in place; the attention groups query heads instead.


class _RoomyLayer(DynamicLayer):
    """A cache layer whose keys/values are views into buffers with room for 256 more tokens: appending
    writes one column instead of copying the cache. When the batching code replaces .keys/.values (it
    pads, trims and selects rows), the next update copies them into a new buffer once."""

    def update(self, key_states, value_states, *args, **kwargs):
        n, m = self.keys.shape[-2], key_states.shape[-2]
        buf = getattr(self, "_buf", None)
        if (
            buf is None
            or buf[0].data_ptr() != self.keys.data_ptr()
            or buf[0].shape[:2] != self.keys.shape[:2]
            or buf[0].shape[2] < n + m
        ):
            buf = tuple(
                t.new_empty(t.shape[0], t.shape[1], n + m + 256, t.shape[3])
                for t in (self.keys, self.values)
            )
            buf[0][:, :, :n], buf[1][:, :, :n] = self.keys, self.values
            self._buf = buf
        buf[0][:, :, n : n + m], buf[1][:, :, n : n + m] = key_states, value_states
        self.keys, self.values = buf[0][:, :, : n + m], buf[1][:, :, : n + m]
        return self.keys, self.values


def _grouped_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA, except that a decode step (one query token per row) reads each KV head once:
    the query heads that share a KV head are laid out as that head's query positions (all rows' positions
    see the same keys under the same mask), which is exactly attention with repeated KV heads."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or n_rep == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    B, H, _, D = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // n_rep, n_rep, D), key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


AttentionInterface.register("grouped_sdpa", _grouped_sdpa)
AttentionMaskInterface.register("grouped_sdpa", sdpa_mask)


def _settle(fut: asyncio.Future, value):
    """The answer to a request: ``value``, raised there when it is an exception (not once it is cancelled)."""
    if not fut.done():
        (fut.set_exception if isinstance(value, BaseException) else fut.set_result)(value)


# ---------------------------------------------------------------------------- vLLM servers


class VLLMBackend(_Gate):
    """vLLM OpenAI servers behind the same surface (README: GPUs: vLLM): token ids in and out of
    ``/v1/completions``; ``sync_weights`` writes safetensors into ``sync_dir`` (a folder the servers can read)
    for every server to reload in place. The servers need ``--logprobs-mode processed_logprobs``,
    ``VLLM_SERVER_DEV_MODE=1`` (the weight-sync routes) and, for grammars (grammar.py), ``--structured-outputs-config
    '{"backend": "guidance"}'``; ``api_key`` (default $VLLM_API_KEY) goes with every request."""

    def __init__(
        self,
        urls: list[str],
        sync_dir: str,
        procs: Optional[list] = None,
        api_key: Optional[str] = None,
    ):
        self.urls, self.sync_dir, self.procs = [u.rstrip("/") for u in urls], sync_dir, procs or []
        self.api_key = api_key or os.environ.get("VLLM_API_KEY")
        self.dtype = None  # of the weight-sync file (train.py: --dtype's, half of fp32 in bf16); None: the weights' own
        try:
            models = [
                _http(u + "/v1/models", timeout=30, key=self.api_key)["data"][0] for u in self.urls
            ]
        except OSError as e:
            raise RuntimeError(
                f"no vLLM server answers at {' '.join(self.urls)} ({e}): start it (README: GPUs), or leave out --vllm-url"
            ) from None
        self.model_name, self.max_model_len = (
            models[0]["id"],
            min(m["max_model_len"] for m in models),
        )
        self.version, self.paused, self.sleeping, self._inflight, self._cond = (
            0,
            False,
            False,
            0,
            threading.Condition(),
        )
        self.stats = Counter(requests=0, prompt_tokens=0, generated_tokens=0)

    @classmethod
    def spawn(
        cls,
        model_dir: str,
        n: int = 1,
        python: str = "python",
        args: Optional[list] = None,
        timeout: float = 900,
        log_dir: str = ".",
        places: Optional[list] = None,
    ):
        """Start ``n`` servers of ``model_dir`` (or one per ``places`` entry, from ``placement``: the environment
        and arguments that put it on its GPUs) as subprocesses (logs in ``log_dir``/vllm_K.log); wait until healthy."""
        import secrets
        import socket
        import subprocess

        procs, urls, key = [], [], secrets.token_urlsafe(32)
        # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on vLLM's CPU build, which otherwise reserves 92% of memory (GPU builds ignore it)
        # The key in VLLM_API_KEY, not --api-key: ps shows command lines to every user, environments only to their own
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_API_KEY": key,
        }
        for k, (place_env, place_args) in enumerate(places or [({}, [])] * n):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--logprobs-mode",
                "processed_logprobs",
                "--generation-config",
                "vllm",
                "--structured-outputs-config",
                '{"backend": "guidance"}',
                *(args or []),
                *place_args,
            ]
            log = open(os.path.join(log_dir, f"vllm_{k}.log"), "w")
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**env, **place_env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        t0 = time.time()
        for k, (p, u) in enumerate(zip(procs, urls)):
            while True:
                if p.poll() is not None:
                    for q in procs:
                        q.kill()
                    raise RuntimeError(
                        f"vLLM server {k} exited with code {p.returncode}: see {os.path.join(log_dir, f'vllm_{k}.log')}"
                    )
                try:
                    _http(u + "/health", timeout=5)
                    break
                except OSError:
                    if time.time() - t0 > timeout:
                        raise TimeoutError(
                            f"vLLM server {k} not healthy after {timeout:.0f} s: see {log_dir}/vllm_{k}.log"
                        ) from None
                    time.sleep(2)
        backend = cls(urls, _sync_dir(model_dir), procs=procs, api_key=key)
        atexit.register(
            backend.close
        )  # a trainer that fails does not leave servers holding the GPU
        return backend

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        on_token: Optional[Callable[[int], None]] = None,
        rollout_id: str = "",
    ) -> Generation:
        import aiohttp

        max_new = _max_new(prompt_ids, sampling, self.max_model_len)
        while True:  # a sync is under way: wait for it (checked and counted under one lock, so pause() sees us)
            with self._cond:
                if not self.paused:
                    self._inflight += 1
                    version = self.version
                    break
            await asyncio.sleep(0.05)
        try:
            url = self.urls[zlib.crc32(rollout_id.encode()) % len(self.urls)]
            # Every sampling field explicit, the penalties and min_p neutral: vLLM fills an unset one from the model's
            # generation_config.json (Qwen2.5's repetition_penalty 1.05), a distribution the trainer never scores.
            body = {
                "model": self.model_name,
                "prompt": list(prompt_ids),
                "max_tokens": max_new,
                "seed": sampling.seed,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k or -1,
                "stop": sampling.stop,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "logprobs": 0,
                "return_token_ids": True,
                "stream": on_token is not None,
            }
            if sampling.grammar:  # the servers' guidance backend (llguidance) masks as grammar.Matcher does; the trainer replays it
                body["structured_outputs"] = {"grammar": sampling.grammar}
            ids, lps, text, finish = [], [], [], None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
                async with http.post(
                    url + "/v1/completions", json=body, headers=_auth(self.api_key)
                ) as r:
                    if r.status != 200:
                        hint = (
                            ' (a grammar: start the servers with --structured-outputs-config \'{"backend": "guidance"}\')'
                            if sampling.grammar
                            else ""
                        )
                        raise RuntimeError(
                            f"vLLM at {url} answered {r.status}: {(await r.text())[:500]}{hint}"
                        )
                    async for ch in _choices(r, body["stream"]):
                        new = ch.get("token_ids") or []
                        ids += new
                        lps += ch["logprobs"]["token_logprobs"] if new else []
                        text.append(ch.get("text") or "")
                        finish = ch.get("finish_reason") or finish
                        for t in new if on_token else []:
                            on_token(t)
            if finish not in ("stop", "length") or len(lps) != len(ids):
                raise RuntimeError(
                    f"vLLM at {url} ended a reply with finish_reason {finish!r} ({len(ids)} ids, {len(lps)} logprobs)"
                )
            self.stats.update(requests=1, prompt_tokens=len(prompt_ids), generated_tokens=len(ids))
            return Generation(ids, lps, finish, "".join(text), version)
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def sleep(self):
        """Free the servers' GPU memory (README: --vllm-sleep): sleep level 2 drops KV cache and weights; the
        next ``sync_weights`` wakes them and loads the new weights."""
        self.pause()
        for u in self.urls:
            _http(u + "/sleep?level=2", {}, key=self.api_key)
        self.sleeping = True

    def sync_weights(self, model=None, version: Optional[int] = None):
        """Every server serves ``model``'s weights (a module or a full state dict; None: only the version moves).
        Sleeping servers (level 2: no weights, no KV cache) wake in two steps, after the file is written (the
        trainer's copies are gone by then): the weights, reloaded, then the KV cache."""
        from safetensors.torch import save_file

        self.pause()
        if self.sleeping and model is None:
            raise ValueError(
                "the servers slept at level 2 and dropped their weights: sync_weights needs the model"
            )
        if model is not None:
            # tied embeddings share storage: write it once, under its first name (vLLM re-ties it)
            first = {v.data_ptr(): (k, v) for k, v in reversed(_state_dict(model).items())}
            out = {
                k: v.detach().to("cpu", self.dtype or v.dtype).contiguous()
                for k, v in first.values()
            }
            os.makedirs(self.sync_dir, exist_ok=True)
            save_file(out, os.path.join(self.sync_dir, "model.safetensors"))
            del first, out
        for u in self.urls if model is not None else ():
            if self.sleeping:
                _http(u + "/wake_up?tags=weights", {}, key=self.api_key)
            _http(
                u + "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": self.sync_dir}},
                key=self.api_key,
            )
            if self.sleeping:
                _http(u + "/wake_up?tags=kv_cache", {}, key=self.api_key)
            _http(u + "/reset_prefix_cache", {}, key=self.api_key)
        self.sleeping = False
        self.version = self.version + 1 if version is None else version

    def close(self):
        for p in self.procs:
            p.terminate()  # a no-op when it has exited
        for p in self.procs:
            p.wait(timeout=60)
        if self.procs:  # spawn() made the folder
            shutil.rmtree(self.sync_dir, ignore_errors=True)


def placement(
    gpu_sets: list[str], trainer_gpus: list[str], share: Optional[float] = None, args: list = ()
) -> list:
    """Each started server's (environment, arguments) for ``VLLMBackend.spawn``: one per GPU set, tensor-parallel
    over it, with ``share`` of each GPU's memory (default 0.3 beside the trainer, 0.9 alone: README: GPUs: vLLM).

    >>> placement(["0", "4,5"], trainer_gpus=["0", "1"])  # the trainer on GPUs 0 and 1
    [({'CUDA_VISIBLE_DEVICES': '0'}, ['--gpu-memory-utilization', '0.3', '--tensor-parallel-size', '1']),
     ({'CUDA_VISIBLE_DEVICES': '4,5'}, ['--gpu-memory-utilization', '0.9', '--tensor-parallel-size', '2'])]
    """
    ours = ("--tensor-parallel-size", "--gpu-memory-utilization")
    for a in args:
        flag = a.split("=")[0].replace("_", "-")
        if (
            flag == "-tp" or len(flag) > 2 and any(f.startswith(flag) for f in ours)
        ):  # argparse takes abbreviations
            raise ValueError(
                f"--vllm-args sets {a}: give the GPUs and memory share as --vllm-gpus, --vllm-gpu-memory"
            )
    places = []
    for s in gpu_sets:
        ids = s.split(",")
        mem = share or (0.3 if set(ids) & set(trainer_gpus) else 0.9)
        flags = ["--gpu-memory-utilization", str(mem), "--tensor-parallel-size", str(len(ids))]
        places.append(({"CUDA_VISIBLE_DEVICES": s}, flags))
    return places


def _sync_dir(model_dir: str) -> str:
    """A new folder for the weight syncs of servers on this machine: in memory (/dev/shm) when it holds the weights
    twice over (a bf16 checkpoint synced in fp32; Docker gives /dev/shm 64 MB by default), else on disk. A hub name
    (no folder here) has no size to check."""
    files = os.listdir(model_dir) if os.path.isdir(model_dir) else []
    need = 2 * sum(
        os.path.getsize(os.path.join(model_dir, f)) for f in files if f.endswith(".safetensors")
    )
    shm = (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need
        else None
    )
    return tempfile.mkdtemp(prefix="lightning-lite-weights-", dir=shm)


def _die_with_parent():
    """In a started server: get SIGTERM when the trainer dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _auth(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _http(url: str, body: Optional[dict] = None, timeout: float = 600, key: Optional[str] = None):
    """GET (or POST ``body`` as JSON, with API ``key``) and parse the answer; errors name the URL and what it said."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **_auth(key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        why = (
            "wrong or missing API key: --vllm-api-key"
            if e.code == 401
            else "sync routes need VLLM_SERVER_DEV_MODE=1"
        )
        raise RuntimeError(f"{url} answered {e.code}: {e.read()[:500]!r} ({why})") from None
    return json.loads(raw) if raw.strip() else None


async def _choices(r, stream: bool):
    """The completion's choice, or its server-sent chunks' as they arrive."""
    if not stream:
        yield (await r.json())["choices"][0]
        return
    async for line in r.content:
        if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
            yield json.loads(line[5:])["choices"][0]
