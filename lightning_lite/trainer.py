"""The trainer's side of a step: the policy, AdamW, and one update.

    config = TrainConfig.from_flags(args)
    learner = Learner(config, tok, device, dtype, world, master, resume_dir, log, adapter=None)
    metrics, grad_norm, skipped = learner.update(samples, step, has_signal)

One update: samples -> micro-batches -> logprobs -> loss -> backward -> one AdamW step. algo.py
holds the math; this file holds which copies of the policy exist and who owns them:

- ``model``, the policy that is trained, in fp32 (the master weights; autocast computes in --dtype).
  Under a model adapter (--lora) it is the frozen base in --dtype with fp32 adapters.
- ``served``, what the embedded backend serves: ``model`` itself, unless its parameters change
  while rollouts run (--async), are shards (FSDP) or use an attention decoding lacks (flex). Then
  it is a copy of its own, which each weight sync refreshes with what training changed
  (``trained``). vLLM always serves its own copy, in its own processes.
- ``ref_model``, the reference of the KL term (--kl-coef > 0), frozen. Under a model adapter there
  is none: the reference is ``model`` with its adapters switched off.

The loss of a micro-batch is multiplied by the world size before backward: DDP and FSDP average
gradients over ranks, and the sample weights (algo.sample_weights) already make the global sum.
"""

import contextlib
import ctypes
import glob
import math
import os
import platform
import sys
from dataclasses import dataclass, fields
from typing import Optional

import torch
from tqdm import tqdm

from . import algo, hooks, parallel
from .models import load_model
from .records import Sample, common_prefix


def return_freed_memory():
    """Give the heap memory freed since the last call back to the system (glibc's malloc_trim; a
    no-op under other C libraries). On a CPU tensors live in glibc's heap, which keeps what a tensor
    below its mmap threshold (up to 32 MB) freed: a run would hold its backward's activations until
    it ends (bench/memory.py, the instruct demo's settings: 5.4 GB between steps; with this 2.0,
    a full fine-tune's weights, gradients and AdamW state)."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class TrainConfig:
    """The knobs the Learner reads: train.py's flags of the same names (README: the training
    knobs)."""

    model: str
    steps: int
    lr: float
    warmup_steps: int
    lr_schedule: str
    weight_decay: float
    grad_clip: float
    # the most tokens one forward takes, its samples packed as a prefix tree
    micro_batch_tokens: int
    # each sample its own padded row instead of a packed tree
    no_tree: bool
    attn: Optional[str]
    parallel: str
    # what each layer's backward recomputes: None, "full" or "selective" (parallel.wrap)
    activation_checkpointing: Optional[str]
    max_model_len: Optional[int]
    keep_checkpoints: int
    # the loss: policy_loss's options of the same names, and the normalization
    loss: str
    clip_low: float
    clip_high: float
    clip_ratio_c: float
    tis_cap: float
    kl_coef: float
    norm: str
    norm_const: float
    # who serves the policy while it trains: does the embedded backend need a copy of its own
    backend: str
    async_steps: int
    # the most updates between sampling a token and training it (a check on every update)
    max_staleness: int = 0
    # the mismatch corrections, policy_loss's options of the same names (off: the plain loss)
    rollout_correction: str = "none"
    correction_min: float = 0.0
    correction_max: float = 3.0
    reject_token: Optional[tuple] = None
    reject_seq_mean: Optional[tuple] = None
    ppo_ratio: str = "sampler"
    # the guard on the served weights: the most mean |trainer - sampler logprob| of the tokens the
    # trained weights sampled (inf: off; MAX_MISMATCH)
    max_mismatch: float = math.inf

    @classmethod
    def from_flags(cls, args, **overrides) -> "TrainConfig":
        """The config of train.py's parsed flags (an argparse Namespace), with ``overrides``."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)


# The guard's default bound on the mean |trainer - sampler logprob| of a step's fresh tokens, by the
# dtypes in use (train.py --max-mismatch; docs/gpus.md: the guard on the served weights): measured
# on the calc task on a CPU, fp32 on both sides 2e-6, bf16 sampling 2e-2 (vLLM's: up to 0.047); a
# served copy with noise of std 0.02 on its MLPs 1.2, another RoPE base 0.7.
MAX_MISMATCH = {"fp32": 0.01, "bf16": 0.2}
MISMATCH_ERROR = (
    "step {step}: the sampler's logprobs are not the trainer's: the mean |trainer - sampler "
    "logprob| of the {tokens} tokens the trained weights sampled is {mean:.4g} (max {max:.4g}), "
    "past --max-mismatch {bound:g} for these dtypes (fp32 on both sides: ~1e-5; bf16: ~2e-2). "
    "Nothing was updated or saved. Likely causes: the sampler serves weights that were not "
    "synced, a --lora run's adapters were not loaded (the base served), or another model, "
    "config or chat template is served. If this gap is expected, raise --max-mismatch (inf: off)."
)

# the TrainConfig fields that are policy_loss's options of the same names
LOSS_OPTIONS = ("loss", "clip_low", "clip_high", "clip_ratio_c", "tis_cap", "kl_coef")
LOSS_OPTIONS += ("rollout_correction", "correction_min", "correction_max", "ppo_ratio")
LOSS_OPTIONS += ("reject_token", "reject_seq_mean")


class TokenCounts:
    """The core's metrics of a backward pass besides the loss's own, of the hooks.LOSS_METRICS
    protocol (``add`` each trained micro-batch, then ``result``, a collective): the tokens forwarded
    (fwd_tokens) and, by staleness (the updates between sampling a token and training it), the
    trained tokens (staleness) and their mean |trainer - rollout logprob| (dlogp_by_staleness).
    Under --async 1, e.g. {"staleness": {0: 90, 1: 10}, "dlogp_by_staleness": {0: 2e-6, 1: 0.03}};
    without it every token has staleness 0. A token staler than ``max_age`` stops the pass (a
    bug: the run allows no more)."""

    def __init__(self, version: int, max_age: int, async_steps: int):
        self.version = version
        self.max_age = max_age
        self.async_steps = async_steps
        self.fwd_tokens = 0
        # by staleness: the trained tokens, and their summed |dlogp|
        self.tokens = torch.zeros(max_age + 1, dtype=torch.float64)
        self.dlogp = torch.zeros(max_age + 1, dtype=torch.float64)

    def add(self, samples, batch, logprobs, entropy):
        self.fwd_tokens += batch["fwd_tokens"]
        trained = batch["loss_mask"] > 0
        # [N]: each trained token's staleness
        age = self.version - batch["version"][trained]
        if age.numel() and not 0 <= int(age.min()) <= int(age.max()) <= self.max_age:
            raise RuntimeError(
                f"a token sampled {int(age.max())} updates ago, more than the {self.max_age} "
                f"updates this run allows (--async {self.async_steps})"
            )
        dlogp = (logprobs - batch["old_logprobs"])[trained].abs().double()
        self.tokens += torch.bincount(age, minlength=self.max_age + 1).double().cpu()
        self.dlogp += torch.bincount(age, dlogp, minlength=self.max_age + 1).cpu()

    def result(self) -> dict:
        # summed over ranks, in one collective
        n = self.max_age + 1
        summed = algo.all_reduce([self.fwd_tokens, *self.tokens.tolist(), *self.dlogp.tolist()])
        tokens = summed[1 : n + 1]
        dlogp = summed[n + 1 :]
        return {
            "fwd_tokens": int(summed[0]),
            "staleness": {age: int(k) for age, k in enumerate(tokens) if k},
            "dlogp_by_staleness": {age: dlogp[age] / k for age, k in enumerate(tokens) if k},
        }


class Learner:
    def __init__(
        self,
        config: TrainConfig,
        tok,
        device,
        dtype,
        world: int,
        master: bool,
        resume_dir,
        log,
        adapter=None,
    ):
        self.config = config
        self.tok = tok
        self.device = device
        self.dtype = dtype
        self.log = log
        self.world = world
        self.master = master
        # A model adapter (--lora, extras/lora.py: hooks.adapter): a frozen base with trained
        # adapters. It wraps the loaded base (wrap), gives the KL reference (reference: a context
        # yielding the model to score with), and says whether its adapters train apart
        # (trains_apart: a backward leaves the others without gradients, and it makes the update
        # itself with update, which train.py calls instead of Learner.update). None: the whole
        # model trains.
        self.adapter = adapter
        fsdp = config.parallel == "fsdp"
        self.model = self.load(resume_dir, torch.float32, policy=True)
        # The reference and served copies hold the weights as the trainer's forward sees them:
        # FSDP gathers them in --dtype, DDP's autocast casts fp32 weights op by op.
        held = torch.float32
        if fsdp:
            held = dtype
        self.ref_model = None
        if config.kl_coef > 0 and self.adapter is None:
            self.ref_model = load_model(config.model, device, held, config.max_model_len)
            self.ref_model.requires_grad_(False)
        self.served = self.model
        own_copy = fsdp or config.async_steps or config.attn == "flex_attention"
        if config.backend == "hf" and own_copy:
            self.served = self.load(resume_dir, held)
        for net in (self.model, self.ref_model):
            if net is not None and config.attn:
                net.set_attn_implementation(config.attn)
            # extras/fast_decode.py: on a CPU, a packed tree's attention skips the keys that no
            # block of rows sees.
            if net is not None:
                hooks.fast_decode.install_trainer(net)
        why = algo.tree_unsupported(self.model.config)
        if not config.no_tree and why:
            log(
                "training each sample as its own row (--no-tree): this model cannot run a packed "
                f"tree, {why}"
            )
            config.no_tree = True
        # Adapters that train apart leave the others without gradients in a backward, which DDP must
        # be told of.
        unused = self.adapter is not None and self.adapter.trains_apart
        self.train_model = parallel.wrap(
            self.model, config.parallel, world, config.activation_checkpointing, dtype, unused
        )
        if self.ref_model is not None and fsdp:
            # sharded like the policy, without an optimizer: its forwards are collectives too
            parallel.wrap(self.ref_model, "fsdp", world, dtype=dtype)
        # What training changes, by name: the parameters AdamW updates (under LoRA every adapter,
        # active or not). A weight sync into the served copy copies these; the rest is the same in
        # both copies. Taken after sharding: AdamW's state is over the shards.
        self.trained = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        params = list(self.trained.values())
        betas = (0.9, 0.99)
        self.opt = torch.optim.AdamW(params, config.lr, betas, weight_decay=config.weight_decay)
        self.start_step = 0
        if resume_dir:
            # mapped from the file into host memory, not onto the GPU: the ranks of a node share the
            # page cache's one copy (12 bytes/param) and each takes its part (FSDP) or all (DDP)
            path = os.path.join(resume_dir, "trainer_state.pt")
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            parallel.load_optimizer_state(self.model, self.opt, state["optimizer"], config.parallel)
            self.start_step = state["step"]
            log(f"resumed from {resume_dir} at step {self.start_step}")

    def load(self, resume_dir, dtype, policy=False):
        """The policy: the last checkpoint's, or the base model. Under a model adapter: the base in
        --dtype, trained and served alike, with its adapters (fresh, or the checkpoint's).
        ``policy``: the copy that trains, which a sharding extra may build its own way
        (parallel.load)."""
        config = self.config
        if self.adapter is not None:
            base = load_model(config.model, self.device, self.dtype, config.max_model_len)
            return self.adapter.wrap(base, resume_dir)
        # A --lora run's checkpoint holds peft's adapters, not a model: the first adapter's config
        # in the folder, or each in a folder of its name.
        if resume_dir:
            pattern = os.path.join(resume_dir, "**", "adapter_config.json")
            if glob.glob(pattern, recursive=True):
                sys.exit(
                    f"--resume: {resume_dir} holds adapters, not a model (a --lora run's): resume "
                    "with the checkpoint's flags, or start a new run in another --out"
                )
        path = resume_dir or config.model

        def whole(device):
            return load_model(path, device, dtype, config.max_model_len)

        if not policy:
            return whole(self.device)
        return parallel.load(whole, self.device, config.parallel)

    def lr_at(self, step: int) -> float:
        """Linear warmup, then constant or cosine down to 10%."""
        config = self.config
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))
        if config.lr_schedule == "cosine":
            return config.lr * cosine
        return config.lr

    def update(self, samples: list[Sample], step: int, has_signal: bool):
        """Loss, backward and AdamW on the step's samples; skipped, saying why, when nothing carries
        a signal or the gradient is not finite. Returns (metrics, gradient norm, why skipped). (A
        model adapter whose adapters train apart makes its update from the steps below.)"""
        if not has_signal:
            self.log(
                f"step {step + 1}: every rollout failed or every group has zero advantage; "
                "skipping the update"
            )
            return {}, None, "no_signal"
        self.start_update(step)
        metrics = self.backward(samples, version=step)
        grad_norm, skipped = self.clip(list(self.model.parameters()), step)
        self.finish_update()
        return metrics, grad_norm, skipped

    def start_update(self, step: int):
        # what the run is doing, as it happens (hooks.PROGRESS: the report's heartbeat.json)
        hooks.progress("phase", phase="train", step=step)
        self.model.train()
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)

    def clip(self, params: list, step: int, what="the gradient norm") -> tuple[float, str | None]:
        """Clip ``params``' gradients (reduced over ranks) to --grad-clip by their norm. Returns
        (the norm, why skipped): a non-finite norm drops their gradients, so the AdamW step leaves
        them be."""
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
        grad_norm = parallel.scalar(norm)
        if math.isfinite(grad_norm):
            return grad_norm, None
        # one NaN/inf gradient would make every weight NaN
        for p in params:
            p.grad = None
        self.log(
            f"step {step + 1}: WARNING: {what} is {grad_norm}, skipping its update "
            "(a non-finite loss or logprob: see loss, dlogp_max)"
        )
        return grad_norm, "nonfinite_grad"

    def finish_update(self):
        """One AdamW step (parameters without gradients stay as they are), then the gradients'
        memory is free for the rollouts (and woken vLLM servers), and returned to the system."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        return_freed_memory()

    def micro_batches(self, samples: list[Sample], weights: list[float]) -> list:
        """Sorted by tokens (a rollout's leaves and a group's samples side by side: neighbours share
        prefixes), cut into micro-batches of at most --micro-batch-tokens. Packed, each sample adds
        what follows its common prefix with the one before (exactly ``algo.pack``'s row when
        sorted); with --no-tree each micro-batch is padded to [B, T]."""
        limit = self.config.micro_batch_tokens
        batches = []
        size = 0
        previous = []
        for i in sorted(range(len(samples)), key=lambda i: samples[i].tokens):
            tokens = samples[i].tokens
            if not batches:
                grown = 0
            elif self.config.no_tree:
                # rows: B x the longest
                longest = max(len(samples[j].tokens) for j in batches[-1] + [i])
                grown = longest * (len(batches[-1]) + 1)
            else:
                grown = size + len(tokens) - common_prefix(previous, tokens)
            if batches and grown <= limit:
                batches[-1].append(i)
                size = grown
            else:
                batches.append([i])
                size = len(tokens)
            previous = tokens
        return [([samples[i] for i in mb], [weights[i] for i in mb]) for mb in batches]

    def backward(self, samples: list[Sample], version: int, sync: bool = True) -> dict:
        """Loss and backward over this rank's micro-batches. The gradients are summed over ranks by
        DDP or FSDP after the last one (``sync`` False: not yet, more backward passes follow).
        Returns the metrics: the loss's own (algo.reduce_metrics), the core's ``TokenCounts`` (the
        tokens forwarded, and the trained ones and their mean |trainer - rollout logprob| by
        staleness) and the extras' (hooks.LOSS_METRICS). Stops the run when that mean of the tokens
        the trained weights sampled is past --max-mismatch (``check_mismatch``)."""
        config = self.config
        # the denominators are all-reduced before any backward: exact under any micro-batch split
        denoms = algo.global_denominators(samples)
        weights = algo.sample_weights(samples, config.norm, denoms, config.norm_const)
        batches = self.micro_batches(samples, weights)
        # Every rank runs as many micro-batches as a collective needs, each of one shape under
        # flex_attention (parallel.py: the padding).
        pad = parallel.padding(self.tok.eos_token_id)
        padded = parallel.pad_micro_batches(batches, config.parallel, pad)
        pad_to = parallel.row_length(self.model, config.micro_batch_tokens)
        options = dict(pad_id=self.tok.pad_token_id or 0, tree=not config.no_tree, pad_to=pad_to)
        loss_options = {k: getattr(config, k) for k in LOSS_OPTIONS}
        # What the pass measures besides the loss (the core's counts and the extras' metrics), and
        # what an extra records of each trained token (hooks.TOKEN_RECORDERS: extras/recorder.py).
        metrics = [TokenCounts(version, config.max_staleness, config.async_steps)]
        metrics += [make() for make in hooks.LOSS_METRICS]
        recorders = [make(version, loss_options) for make in hooks.TOKEN_RECORDERS]
        rows = []
        quiet = not (self.master and sys.stderr.isatty())
        vocab = self.model.config.vocab_size
        bar = tqdm(padded, desc="train", unit="mb", leave=False, disable=quiet)
        for i, (mb_samples, mb_weights) in enumerate(bar):
            batch = algo.collate(mb_samples, mb_weights, self.device, **options)
            # what a grammar allowed each token it constrained, replayed (None: it constrained none)
            batch["allowed"] = hooks.grammar.replay_samples(mb_samples, self.tok, vocab)
            last = sync and i == len(padded) - 1
            with parallel.accumulating(self.train_model, config.parallel, last=last):
                ref, logprobs, entropy = self.logprobs(batch)
                # [B, T] each, and the sample weights [B]
                loss, row = algo.policy_loss(
                    logprobs,
                    batch["old_logprobs"],
                    batch["advantages"],
                    batch["loss_mask"],
                    batch["weights"],
                    ref_logprobs=ref,
                    entropy=entropy,
                    **loss_options,
                )
                # DDP and FSDP average gradients over ranks; the weights already make the global sum
                (loss * self.world).backward()
            # a padding micro-batch trains nothing, and is not measured
            if i >= len(batches):
                continue
            rows.append(row)
            for each in metrics + recorders:
                each.add(mb_samples, batch, logprobs.detach(), entropy)
        result = algo.reduce_metrics(rows)
        for metric in metrics:
            result.update(metric.result())
        for recorder in recorders:
            recorder.close()
        self.check_mismatch(result, version)
        return result

    def logprobs(self, batch: dict):
        """[B, T] each: the KL reference's logprobs of ``batch``'s trainable tokens (None without
        the KL term), the policy's (with gradient) and their entropies (without); under autocast in
        --dtype (bf16: over the fp32 weights)."""
        autocast = self.dtype != torch.float32
        with torch.autocast(self.device.type, self.dtype, enabled=autocast):
            # The reference first: under FSDP and a model adapter it is the policy's own module,
            # whose forward without gradient left the root's weights resharded (torch 2.13, peft
            # 0.22), and the policy's LM head, run outside the root's forward, needs them gathered
            # in its backward.
            ref = None
            if self.config.kl_coef > 0:
                with torch.no_grad(), self.reference() as ref_model:
                    ref = algo.trainer_logprobs(ref_model, batch, allowed=batch["allowed"])
            logprobs, entropy = algo.trainer_logprobs_and_entropy(
                self.train_model, batch, allowed=batch["allowed"]
            )
        return ref, logprobs, entropy

    def check_mismatch(self, metrics: dict, version: int):
        """The guard on the served weights, on every rank alike (the metrics are over all ranks):
        the tokens sampled by the weights being trained (staleness 0) are scored the same by both
        sides, to the dtypes' noise. Past --max-mismatch the run stops (SystemExit) before any
        update: the sampler serves other weights, and an update would learn from noise."""
        fresh = metrics["staleness"].get(0, 0)
        if fresh and metrics["dlogp_by_staleness"][0] > self.config.max_mismatch:
            mean = metrics["dlogp_by_staleness"][0]
            largest = metrics.get("dlogp_max", math.nan)
            numbers = dict(tokens=fresh, mean=mean, max=largest, bound=self.config.max_mismatch)
            sys.exit(MISMATCH_ERROR.format(step=version + 1, **numbers))

    def reference(self):
        """A context that gives the KL term's reference: the frozen initial model, or under a model
        adapter the policy with its adapters switched off."""
        if self.adapter is not None:
            return self.adapter.reference(self.model)
        return contextlib.nullcontext(self.ref_model)

    def save(self, step: int, run, config: dict) -> str | None:
        """A checkpoint of the trained weights (under --async the served copy is a step behind) and
        the optimizer state: every rank helps gather them (FSDP), rank 0 writes them and says where
        (the path; None on other ranks)."""
        weights = parallel.full_state_dict(self.model, self.config.parallel)
        optim = parallel.optimizer_state(self.model, self.opt, self.config.parallel)
        if not self.master:
            return None
        # the served copy is of the plain class: the checkpoint loads anywhere
        keep = self.config.keep_checkpoints
        path = run.save_checkpoint(
            step, self.served, self.tok, weights, optim, self.dtype, config, keep
        )
        self.log(f"saved {path}")
        return path
