"""Inference backends: prompt token ids in, response token ids and their logprobs out. Every backend
has the same small surface, so the proxy never knows which one serves it:

    gen = await backend.generate(prompt_ids, Sampling(max_tokens=64, temperature=1.0))
    gen.response_ids, gen.logprobs, gen.finish_reason, gen.text, gen.version
    backend.pause(); ...train...; backend.sync_weights(model, version=1); backend.resume()
    backend.version, backend.max_model_len, backend.stats, backend.close()

``HFBackend`` is the embedded one (README: quick start; docs/serving.md): a transformers model in
this process (CPU, or one GPU), for decoder-only models with full attention (Llama, SmolLM,
Qwen2/2.5/3, Mistral without sliding window). extras/vllm.py's ``VLLMBackend`` sends the same token
ids to vLLM servers.

Two extras add to HFBackend through lightning_lite/hooks.py, and it runs without either:
``hooks.fast_decode`` (extras/fast_decode.py) makes decoding at agent-length contexts fast (a prefix
KV cache, cache layers that append in place, grouped-query attention), and ``hooks.grammar``
(extras/grammar.py) gives the ``Matcher`` that a request with a grammar is sampled under.
"""

import asyncio
import ctypes
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch.nn import functional as F
from transformers.cache_utils import DynamicCache

from . import hooks
from .algo import sampling_support
from .chat import Sampling
from .models import eos_ids


@dataclass
class Generation:
    response_ids: list[int]
    # logprob of each response id under the distribution it was sampled from
    logprobs: list[float]
    # "stop" (EOS or a stop string) | "length"
    finish_reason: str
    # decoded response, special tokens and a matched stop string removed
    text: str
    # the weights version that produced it
    version: int = 0


def sample_token(
    logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator] = None
) -> tuple[int, float]:
    """Sample one token from ``logits`` [V] and return it with its logprob under the *sampled*
    distribution: softmax(logits / T) on the top-k / top-p support (``algo.sampling_support``, the
    trainer's rule too), renormalized, so the trainer's importance ratio compares like with like.
    Greedy (T = 0) is not a distribution; it reports the logprob under softmax(logits).

    >>> sample_token(torch.tensor([0.0, 0.0, 10.0]), Sampling(temperature=0))
    (2, -9.08e-05)
    """
    # [V]
    x = logits.float()
    if s.temperature > 0:
        x = x / s.temperature
        if s.top_k > 0 or s.top_p < 1.0:
            top_k, top_p = torch.tensor([s.top_k], device=x.device), x.new_tensor([s.top_p])
            x = x.masked_fill(~sampling_support(x[None], top_k, top_p)[0], float("-inf"))
    logprobs = torch.log_softmax(x, -1)
    if s.temperature <= 0:
        return int(logprobs.argmax()), float(logprobs.max())
    token = draw(logprobs.exp(), generator)
    return token, float(logprobs[token])


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """A token drawn from ``probs`` [V] (unnormalized is fine) by an exponential race: token i
    waits a time E_i / p_i, E_i ~ Exp(1), and the first to finish wins, with probability
    p_i / sum(p) exactly; a token of probability 0 never finishes.

    Whether a token wins depends on its own probability and clock, not on a sum over the others,
    so logits that differ by float noise (a resumed run, another batch shape, a cached prefix) draw
    the same token under the same seed. Inverting the CDF at one uniform number, which reads a
    cumulative sum, moved 4.5% of draws at a logit noise of 1e-4 on a 49k vocabulary; the race
    moved none of 4,000. The clocks are -log(u) of uniform numbers: 0.3-0.45 ms a row for 49k tokens
    on this CPU, where torch.multinomial (the same race, through exponential_) takes ~1.2 ms.

    >>> draw(torch.tensor([0.0, 0.25, 0.0, 0.75]), torch.Generator().manual_seed(1))
    3
    """
    # [V] uniform in [0, 1), a 0 raised to the smallest positive float: every clock is finite
    u = torch.rand(probs.shape, generator=generator, device=probs.device)
    u = u.clamp_(min=torch.finfo(u.dtype).tiny)
    # [V] E_i ~ Exp(1); the token with the largest p_i / E_i finishes first
    clocks = -torch.log(u)
    return int((probs / clocks).argmax())


class PauseGate:
    """pause() and resume() of every backend. A subclass sets ``paused``, ``_cond`` (a Condition)
    and ``_inflight``: the running batch (HF), the calls sent out (vLLM)."""

    # train.py syncs the trained weights before the first rollout when the backend may serve others
    # (vLLM servers a user started)
    first_sync = False

    def make_room(self):
        """Before training: free what training needs (vLLM's --vllm-sleep). Nothing by default."""

    def pause(self):
        """New work waits; returns once the work in flight is done (before training runs)."""
        with self._cond:
            self.paused = True
            while self._inflight:
                self._cond.wait()

    def resume(self):
        with self._cond:
            self.paused = False
            self._cond.notify_all()


def release_cpu_threads():
    """Let the calling thread's OpenMP worker threads exit; its next parallel region starts new ones
    (about 50 us). Why: libgomp gives every thread that runs a parallel region a team of its own,
    and while the process holds more of its threads than there are CPUs, every idle worker sleeps
    at once instead of spinning, so each small parallel region pays a wake-up. A decode step runs
    hundreds of them. On 2 cores, the embedded backend decoded 30% slower once the trainer had run
    a forward on the main thread, and training ran 8% slower beside the backend's idle team
    (docs/benchmarks.md). So each side lets its team go when it hands the CPUs over. A no-op
    where the OpenMP runtime has no ``omp_pause_resource_all`` (OpenMP 5.0)."""
    if os.name != "posix":
        return
    # PyDLL: the call keeps the GIL (about 50 us), so no other thread finalizes the interpreter
    # while this one is in it.
    pause_all = getattr(ctypes.PyDLL(None), "omp_pause_resource_all", None)
    if pause_all is not None:
        OMP_PAUSE_SOFT = 1
        pause_all(OMP_PAUSE_SOFT)


def max_reply_tokens(prompt_ids: list[int], sampling: Sampling, max_model_len: int) -> int:
    """How many tokens a reply may have: ``max_tokens``, at most what the prompt leaves."""
    room = max_model_len - len(prompt_ids)
    if not prompt_ids or room < 1:
        raise ValueError(
            f"a prompt of {len(prompt_ids)} tokens does not fit the model's context of "
            f"{max_model_len}: 1 to {max_model_len - 1} tokens fit"
        )
    return min(sampling.max_tokens or room, room)


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16: a GPU from Ampere on; any CPU, where torch computes bf16
    in software without AVX512-BF16 or AMX (the same numbers, slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True


def served_state_dict(model) -> dict:
    """The weights to serve: a module's (unwrapped from DDP), or a state dict (gathered by FSDP)."""
    return model if isinstance(model, dict) else getattr(model, "module", model).state_dict()


# Each layer's (keys, values), [1, H_kv, n, D] each: the KV cache of n tokens.
KV = list[tuple[torch.Tensor, torch.Tensor]]
# HFBackend.stats's counters.
STATS = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens", "cancelled", "batches")


@torch.no_grad()
def copy_weights(source, dst):
    """Load ``source``'s weights into ``dst``, a plain copy of the trained model: all of a module's
    (DDP-wrapped, or FSDP-sharded: every rank calls this, and each DTensor is gathered, copied and
    freed in turn, so no rank holds the whole model twice), or those of a dict of named tensors
    (under LoRA the adapters alone, whose frozen base is the same in both copies)."""
    targets = dst.state_dict()
    for name, value in served_state_dict(source).items():
        targets[name].copy_(value.full_tensor() if hasattr(value, "full_tensor") else value)


@dataclass
class _Request:
    prompt_ids: list[int]
    # Its max_tokens is at most what the prompt leaves of the context.
    sampling: Sampling
    # The future the caller awaits, on the caller's event loop.
    future: asyncio.Future
    # Called on the caller's event loop with each sampled id (streaming).
    on_token: Optional[Callable[[int], None]]
    # The LoRA adapter that serves it, under --lora-per-harness.
    adapter: Optional[str] = None
    # The random generator seeded by sampling.seed, when it has a seed.
    generator: Optional[torch.Generator] = None
    # The state of sampling.grammar, when it has one: a hooks.grammar.Matcher.
    matcher: Optional[object] = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HFBackend(PauseGate):
    """Embedded transformers backend: one worker thread decodes the requests together (continuous
    batching), reusing the KV cache of prompts seen before when extras/fast_decode.py gives a prefix
    cache. With ``dtype`` bf16 every forward runs under bf16 autocast, as the trainer's does
    (train.py --dtype)."""

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int = 32,
        max_model_len: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
    ):
        # Decoding keeps each layer's keys and values; a recurrent layer (Qwen3.5's linear
        # attention, a Mamba block) keeps a state instead, which the batch's cache cannot hold.
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
        attention = {"full_attention", "sliding_attention", "chunked_attention"}
        recurrent = sorted(set(layer_types) - attention)
        if recurrent:
            raise ValueError(
                f"the embedded backend cannot serve {model.config.model_type}: its {recurrent} "
                "layers keep a recurrent state, not keys and values; serve it with --backend vllm"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = next(model.parameters()).device
        # The same attention, faster in decoding (extras/fast_decode.py: without copying KV heads).
        hooks.fast_decode.install(model)
        # The KV of the prompts seen before, which a prompt that extends one of them starts from
        # (extras/fast_decode.py; the default keeps nothing: every prompt is prefilled whole).
        self.prefix_cache = hooks.fast_decode.PrefixCache()
        default_len = getattr(model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = int(max_model_len or default_len)
        self.max_batch_size = max_batch_size
        self.eos_ids = eos_ids(tokenizer, model.generation_config)
        self.version = 0
        # What was served since the start (GET /status); busy_s is the seconds spent decoding.
        self.stats = Counter(dict.fromkeys(STATS, 0), busy_s=0.0)
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        # _inflight: a batch is decoding.
        self.paused = self._inflight = self._closed = False
        self._thread = threading.Thread(target=self._worker, name="hf-backend", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the backend surface

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        on_token: Optional[Callable[[int], None]] = None,
        rollout_id: str = "",
    ) -> Generation:
        """Sample a reply to ``prompt_ids``; ``on_token(id)``, when given, sees each id as it is
        sampled (streaming). ``rollout_id`` picks its adapter (hooks.adapter.serving) or vLLM
        server."""
        max_tokens = max_reply_tokens(prompt_ids, sampling, self.max_model_len)
        sampling = replace(sampling, max_tokens=max_tokens)
        future = asyncio.get_running_loop().create_future()
        request = _Request(list(prompt_ids), sampling, future, on_token)
        # --lora-per-harness: its harness's adapter (a batch may mix them: peft's adapter_names)
        request.adapter = hooks.adapter.serving(rollout_id)
        if sampling.seed is not None:
            request.generator = torch.Generator(self.device).manual_seed(sampling.seed)
        if sampling.grammar:
            # Only extras/grammar.py sets a grammar (the proxy's constrain); without it the seam's
            # default Matcher refuses, naming the file.
            vocab_size = self.model.config.vocab_size
            request.matcher = hooks.grammar.Matcher(sampling.grammar, self.tokenizer, vocab_size)
        with self._cond:
            if self._closed:
                raise RuntimeError("backend is closed")
            self._pending.append(request)
            self._cond.notify_all()
        return await future

    def pause(self):
        """As PauseGate's; the prefix KV cache goes too: the weights are about to change (training,
        a sync), and training gets its memory."""
        super().pause()
        self.prefix_cache.clear()

    def resume(self):
        """As PauseGate's, once the caller (the trainer's thread) has let its OpenMP threads go:
        they would slow every decode step (``release_cpu_threads``)."""
        release_cpu_threads()
        super().resume()

    def payload(self, learner):
        """What a weight sync from ``learner`` (trainer.Learner) hands ``sync_weights``: the trained
        module itself when this backend serves it (nothing to copy), else what training changed
        (``learner.trained``), to copy into the served copy."""
        if self.model is learner.model:
            return learner.model
        return learner.trained

    def sync_weights(self, model=None, version: Optional[int] = None):
        """Pause (the running batch finishes on the old weights; no other starts), then serve
        ``model``'s weights: when it is the module served, only the stale caches go; else they are
        copied in (``copy_weights``: a module, DDP-wrapped or FSDP-sharded, or a state dict)."""
        self.pause()
        if model is not None and model is not self.model:
            copy_weights(model, self.model)
        self.version = self.version + 1 if version is None else version

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the worker thread

    def _worker(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (not self.paused and self._pending))
                if self._closed:
                    for request in self._pending:
                        _answer(request.future, RuntimeError("backend closed"))
                    return
                self._inflight = True
            t0 = time.time()
            try:
                # Autocast is per thread: it is entered here, in the thread that runs the model.
                bf16 = self.dtype != torch.float32
                with torch.autocast(self.device.type, self.dtype, enabled=bf16):
                    self._run()
                # Idle now: the CPUs go to whoever runs next (training), without this thread's
                # OpenMP team beside it.
                release_cpu_threads()
            finally:
                with self._cond:
                    self._inflight = False
                    self.stats.update(batches=1, busy_s=time.time() - t0)
                    self._cond.notify_all()

    @torch.inference_mode()
    def _run(self):
        """Decode until no request is left, admitting new requests at every step (continuous
        batching): a row that finishes is answered at once and leaves the batch, so an agent's next
        turn can join while the others still decode."""
        batch = _Batch(self.device)
        # No weight sync can happen while a batch runs: all its replies are of this version.
        version = self.version
        while True:
            new = self._take(self.max_batch_size - len(batch.rows))
            try:
                # Prefill each on its own (after a cached prefix), then all join the batch.
                batch.add([(request, *self._prefill(request)) for request in new])
                if not batch.rows:
                    return
                keep = [j for j in range(len(batch.rows)) if self._sample_next(batch, j, version)]
                if len(keep) < len(batch.rows):
                    batch.keep(keep)
                if batch.rows:
                    batch.step(self.model)
            # A backend failure fails these requests (the proxy reports it), never silently.
            except Exception as e:
                for request in batch.rows + new:
                    _answer(request.future, e)
                return

    def _take(self, room: int) -> list[_Request]:
        """Pending requests that may join the running batch (none while paused)."""
        with self._cond:
            if self.paused:
                return []
            # The others' clients went away.
            live = [r for r in self._pending if not r.future.cancelled()]
            self.stats["cancelled"] += len(self._pending) - len(live)
            new, self._pending = live[:room], live[room:]
            self.stats["requests"] += len(new)
            return new

    def _prefill(self, request: _Request) -> tuple[DynamicCache, torch.Tensor]:
        """The prompt's KV cache (batch 1) and the logits [V] of the first reply token."""
        # The longest cached prefix of the prompt: its length and KV (None: an empty cache), and
        # the logits after it when it is the whole prompt.
        hit, kv, logits = self.prefix_cache.lookup(request.prompt_ids, request.adapter)
        cache = DynamicCache(ddp_cache_data=kv)
        self.stats.update(prompt_tokens=len(request.prompt_ids), cached_tokens=hit)
        if logits is not None:
            # This prompt was prefilled before (a GRPO group's requests share one): no forward.
            return cache, logits
        # [1, T - hit]: its positions follow the cache's.
        rest = torch.tensor([request.prompt_ids[hit:]], device=self.device)
        inputs = dict(input_ids=rest, past_key_values=cache, use_cache=True, logits_to_keep=1)
        out = self.model(**inputs, **_adapters([request]))
        logits = out.logits[0, -1]
        # Requests that arrive together often share a prompt: the next one reuses this one.
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self.prefix_cache.store(request.prompt_ids, kv, request.adapter, logits)
        return cache, logits

    def _sample_next(self, batch: "_Batch", j: int, version: int) -> bool:
        """Sample row j's next token; False when its request is over (answered, or client gone)."""
        request = batch.rows[j]
        logits = batch.last[j]
        if request.matcher is not None:
            # The grammar's mask first, as vLLM applies it before its sampler.
            allowed = request.matcher.allowed().to(self.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        token, logprob = sample_token(logits, request.sampling, request.generator)
        if request.matcher is not None:
            request.matcher.consume(token)
        request.response_ids.append(token)
        request.logprobs.append(logprob)
        if request.on_token:
            request.future.get_loop().call_soon_threadsafe(request.on_token, token)
        self.stats["generated_tokens"] += 1
        # The client went away (the proxy cancels its call): stop generating.
        if request.future.cancelled():
            self.stats["cancelled"] += 1
            return False
        done = self._finish(request, token)
        if done is None:
            return True
        # The cache holds prompt + response[:-1]: keep it for this conversation's next turn.
        ids = request.prompt_ids + request.response_ids[:-1]
        self.prefix_cache.store(ids, batch.row_cache(j), request.adapter)
        generation = Generation(request.response_ids, request.logprobs, *done, version)
        _answer(request.future, generation)
        return False

    def _finish(self, request: _Request, token: int) -> Optional[tuple[str, str]]:
        """(finish_reason, text) once ``request``, which sampled ``token``, is done; else None."""
        ended = token in self.eos_ids
        full = len(request.response_ids) >= request.sampling.max_tokens
        # No stop string to look for: no need to decode.
        if not (ended or full or request.sampling.stop):
            return None
        text = self.tokenizer.decode(request.response_ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in request.sampling.stop if s in text), default=None)
        if cut is not None:
            return "stop", text[:cut]
        if ended:
            return "stop", text
        if full:
            return "length", text
        return None


class _Batch:
    """The requests decoding together, their KV caches left-padded to one length T so that every
    row's next token goes into the same column: each layer's keys and values are [B, H_kv, T, D].
    Row j's own cache is its last ``lengths[j]`` columns, and ``lengths[j]`` is also the position
    of its next token."""

    def __init__(self, device):
        self.device = device
        self.rows: list[_Request] = []
        self.lengths: list[int] = []
        # The batch's DynamicCache, once a request has joined.
        self.cache = None
        # [B, V]: each row's latest logits.
        self.last = None

    def add(self, joining: list[tuple[_Request, DynamicCache, torch.Tensor]]):
        """Join prefilled requests, each with its own cache [1, H_kv, n, D] and the logits [V]
        after it, all in one copy of the batch's cache."""
        if not joining:
            return
        was_empty = not self.rows
        self.rows += [request for request, _, _ in joining]
        self.lengths += [cache.get_seq_length() for _, cache, _ in joining]
        caches = [cache for _, cache, _ in joining]
        # [len(joining), V]
        logits = torch.stack([row_logits for _, _, row_logits in joining])
        if was_empty:
            # The first one's cache becomes the batch's (extras/fast_decode.py: with layers that
            # append in place; the default keeps transformers' DynamicLayer, which copies the
            # whole cache at each token).
            self.cache = hooks.fast_decode.batch_cache(caches.pop(0))
            self.last = logits
        else:
            self.last = torch.cat([self.last, logits])
        if not caches:
            return
        # Left-pad the batch and the newcomers to the longest of them, T columns:
        # [B, H_kv, T, D] + k x [1, H_kv, T, D] -> [B + k, H_kv, T, D]
        T = max(cache.get_seq_length() for cache in [self.cache] + caches)
        for i, mine in enumerate(self.cache.layers):
            theirs = [cache.layers[i] for cache in caches]
            mine.keys = torch.cat([_left_pad(layer.keys, T) for layer in [mine] + theirs])
            mine.values = torch.cat([_left_pad(layer.values, T) for layer in [mine] + theirs])

    def row_cache(self, j: int) -> KV:
        """Row j's own KV (without padding), copied out of the batch."""
        start = self.cache.get_seq_length() - self.lengths[j]
        return [
            (layer.keys[j : j + 1, :, start:].clone(), layer.values[j : j + 1, :, start:].clone())
            for layer in self.cache.layers
        ]

    def keep(self, keep: list[int]):
        """Keep only rows ``keep``, then drop the columns that are padding for every row left."""
        self.rows, self.lengths = [self.rows[j] for j in keep], [self.lengths[j] for j in keep]
        # The batch is over (add() starts a new one).
        if not self.rows:
            return
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.last = self.last[index]
        trim = self.cache.get_seq_length() - max(self.lengths)
        if trim > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, trim:]
                layer.values = layer.values[:, :, trim:]

    def step(self, model):
        """Feed each row its latest sampled token; the logits for the next one land in ``last``."""
        # [B, 1] each: the token, its position (the row's own length)
        tokens = torch.tensor([[r.response_ids[-1]] for r in self.rows], device=self.device)
        positions = torch.tensor(self.lengths, device=self.device)[:, None]
        self.lengths = [n + 1 for n in self.lengths]
        # [B, T + 1]: 1 on each row's own columns, the last ``lengths[j]``
        T = self.cache.get_seq_length() + 1
        mask = (torch.arange(T, device=self.device) >= T - 1 - positions).long()
        inputs = dict(input_ids=tokens, attention_mask=mask, position_ids=positions)
        out = model(**inputs, past_key_values=self.cache, use_cache=True, **_adapters(self.rows))
        # [B, V]
        self.last = out.logits[:, -1]


def _adapters(rows: list) -> dict:
    """The forward's argument that runs each row through its adapter (--lora-per-harness: peft's
    adapter_names); none without adapters."""
    if rows[0].adapter is None:
        return {}
    return {"adapter_names": [r.adapter for r in rows]}


def _left_pad(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H_kv, n, D] -> [B, H_kv, T, D], zeros in the first T - n columns (masked out)."""
    return F.pad(x, (0, 0, T - x.shape[2], 0)) if x.shape[2] < T else x


def _answer(future: asyncio.Future, value):
    """From the worker thread, on the caller's event loop: the request's answer, ``value``, raised
    there when it is an exception (not once the request is cancelled)."""

    def settle():
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    future.get_loop().call_soon_threadsafe(settle)
