"""The trainer's side of a step: the policy (and its reference and served copies), AdamW, and one
update: samples -> micro-batches -> logprobs -> loss -> backward -> optimizer step.

    learner = Learner(args, tok, device, dtype, world, master, resume_dir, log)
    metrics, grad_norm, skipped = learner.update(samples, step, has_signal)

``args`` are train.py's flags (README: the training knobs); algo.py holds the math.
"""

import math
import os
import sys

import torch
from tqdm import tqdm

from . import algo, parallel
from .extras import grammar, lora
from .models import load_model
from .records import Sample, common_prefix

# train.py's flags that are policy_loss's options of the same names
LOSS_FLAGS = ("loss", "clip_low", "clip_high", "clip_ratio_c", "tis_cap", "kl_coef")


class Learner:
    def __init__(self, args, tok, device, dtype, world: int, master: bool, resume_dir, log):
        self.args, self.tok, self.device, self.dtype, self.log = args, tok, device, dtype, log
        self.world, self.master = world, master
        fsdp = args.parallel == "fsdp"
        # fp32: the master weights (--lora: the base frozen in --dtype, fp32 adapters)
        self.model = self.load(resume_dir, torch.float32)
        # The reference and served copies hold the weights as the trainer's forward sees them:
        # FSDP gathers them in --dtype, DDP's autocast casts fp32 weights op by op.
        held = dtype if fsdp else torch.float32
        self.ref_model = None
        # (--lora: the reference is the model with its adapters disabled)
        if args.kl_coef > 0 and not args.lora:
            self.ref_model = load_model(args.model, device, held, args.max_model_len)
            self.ref_model.requires_grad_(False)
        # The embedded backend serves the trained module itself, unless its parameters are FSDP
        # shards, change while rollouts run (--async), or use an attention decoding lacks (flex):
        # then a copy of its own, which each weight sync refreshes. vLLM always has its own.
        self.served = self.model
        if args.backend == "hf" and (fsdp or args.async_steps or args.attn == "flex_attention"):
            self.served = self.load(resume_dir, held)
        for net in [m for m in (self.model, self.ref_model) if m is not None and args.attn]:
            net.set_attn_implementation(args.attn)
        if not args.no_tree and (why := algo.tree_unsupported(self.model.config)):
            log(
                f"training each sample as its own row (--no-tree): this model cannot run a packed tree, {why}"
            )
            args.no_tree = True
        offload, checkpointing = args.fsdp_offload, args.activation_checkpointing
        unused = bool(args.lora_per_harness)
        self.train_model = parallel.wrap(
            self.model, args.parallel, world, offload, checkpointing, dtype, unused
        )
        if self.ref_model is not None and fsdp:
            # sharded like the policy, without an optimizer: its forwards are collectives too
            parallel.wrap(self.ref_model, "fsdp", world, offload, dtype=dtype)
        # after sharding: AdamW's state is over the shards
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, args.lr, (0.9, 0.99), weight_decay=args.weight_decay)
        # What training changes, by name: the parameters AdamW updates (under LoRA every adapter, active
        # or not). A weight sync into the served copy copies these; the rest is the same in both copies.
        updated = {id(p) for p in params}
        self.trained = {n: p for n, p in self.model.named_parameters() if id(p) in updated}
        self.start_step = 0
        if resume_dir:
            # mapped from the file into host memory, not onto the GPU: the ranks of a node share the
            # page cache's one copy (12 bytes/param) and each takes its part (FSDP) or all (DDP)
            path = os.path.join(resume_dir, "trainer_state.pt")
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            parallel.load_optimizer_state(self.model, self.opt, state["optimizer"], args.parallel)
            self.start_step = state["step"]
            log(f"resumed from {resume_dir} at step {self.start_step}")

    def load(self, resume_dir, dtype):
        """The policy: the last checkpoint's, or the base model (--lora: in --dtype, trained and served
        alike, with its adapters)."""
        a = self.args
        if not a.lora:
            return load_model(resume_dir or a.model, self.device, dtype, a.max_model_len)
        base = load_model(a.model, self.device, self.dtype, a.max_model_len)
        return lora.wrap(base, a, resume_dir)

    def lr_at(self, step: int) -> float:
        """Linear warmup, then constant or cosine down to 10%."""
        a = self.args
        if step < a.warmup_steps:
            return a.lr * (step + 1) / a.warmup_steps
        t = min(1.0, (step - a.warmup_steps) / max(1, a.steps - a.warmup_steps))
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * t))
        return a.lr * (cosine if a.lr_schedule == "cosine" else 1.0)

    def update(self, samples: list[Sample], step: int, has_signal: bool):
        """Loss, backward and AdamW on the step's samples; skipped, saying why, when nothing carries
        a signal or the gradient is not finite. Returns (metrics, gradient norm, why skipped)."""
        if not has_signal:
            self.log(
                f"step {step + 1}: every rollout failed or every group has zero advantage; skipping the update"
            )
            return {}, None, "no_signal"
        self.start_update(step)
        metrics = self.backward(samples, version=step)
        grad_norm, skipped = self.clip(list(self.model.parameters()), step)
        self.finish_update()
        return metrics, grad_norm, skipped

    def start_update(self, step: int):
        self.model.train()
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)

    def clip(self, params: list, step: int, what="the gradient norm") -> tuple[float, str | None]:
        """Clip ``params``' gradients (reduced over ranks) to --grad-clip by their norm. Returns (the
        norm, why skipped): a non-finite norm drops their gradients, so the AdamW step leaves them be."""
        grad_norm = parallel.scalar(torch.nn.utils.clip_grad_norm_(params, self.args.grad_clip))
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
        """One AdamW step (parameters without gradients stay as they are), then the gradients' memory
        is free for the rollouts (and woken vLLM servers)."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()

    def micro_batches(self, samples: list[Sample], weights: list[float]) -> list:
        """Sorted by tokens (a rollout's leaves and a group's samples side by side: neighbours share
        prefixes), cut into micro-batches of at most --micro-batch-tokens: packed, each sample adding
        what follows its common prefix with the one before (exactly ``algo.pack``'s row when
        sorted), or, --no-tree, padded [B, T]."""
        limit, batches, size, prev = self.args.micro_batch_tokens, [], 0, []
        for i in sorted(range(len(samples)), key=lambda i: samples[i].tokens):
            t = samples[i].tokens
            if self.args.no_tree:
                # rows: B x the longest
                longest = max(len(samples[j].tokens) for j in batches[-1] + [i]) if batches else 0
                grown = longest * (len(batches[-1]) + 1) if batches else 0
            else:
                grown = size + len(t) - common_prefix(prev, t)
            if batches and grown <= limit:
                batches[-1].append(i)
                size = grown
            else:
                batches.append([i])
                size = len(t)
            prev = t
        return [([samples[i] for i in mb], [weights[i] for i in mb]) for mb in batches]

    def backward(self, samples: list[Sample], version: int, sync: bool = True) -> dict:
        """Loss and backward over this rank's micro-batches (gradients summed over ranks by DDP or
        FSDP after the last one; ``sync`` False: not yet, more backward passes follow). Metrics, with
        the trained tokens and their mean |trainer - rollout logprob| by staleness (updates since
        they were sampled)."""
        a, tok, model = self.args, self.tok, self.model
        # the most updates between sampling a token and training it
        max_age = a.steps if a.from_calls else a.async_steps
        # the denominators are all-reduced before any backward: exact under any micro-batch split
        denoms = algo.global_denominators(samples)
        weights = algo.sample_weights(samples, a.norm, denoms, a.norm_const)
        # FSDP: every rank runs as many forwards as the others (None: a zero-weight one)
        mbs = parallel.pad_micro_batches(self.micro_batches(samples, weights), a.parallel)
        flex = model.config._attn_implementation == "flex_attention"
        # the grammars' masks are over the model's vocabulary; bf16 and fp16 run under autocast
        vocab, autocast = model.config.vocab_size, self.dtype != torch.float32
        # [2, age]: tokens and their summed |dlogp| by staleness; fwd, constrained, forced tokens
        stale, counts, rows = torch.zeros(2, max_age + 1, dtype=torch.float64), torch.zeros(3), []
        quiet = not (self.master and sys.stderr.isatty())
        for i, mb in enumerate(tqdm(mbs, desc="train", unit="mb", leave=False, disable=quiet)):
            pad = mb is None
            mb = ([Sample("pad", [tok.eos_token_id] * 2, [0, 1], [0.0, 0.0])], [0.0]) if pad else mb
            # the masks a grammar sampled under (a forced call's schema), replayed: scored under them
            masks = [grammar.sample_masks(s, tok, vocab) if s.grammars else None for s in mb[0]]
            # flex_attention compiles for each new shape: its rows are padded to one
            pad_to, pad_id = a.micro_batch_tokens if flex else 1, tok.pad_token_id or 0
            options = dict(pad_id=pad_id, tree=not a.no_tree, pad_to=pad_to, masks=masks)
            b = algo.collate(*mb, self.device, **options)
            last = sync and i == len(mbs) - 1
            with parallel.accumulating(self.train_model, a.parallel, last=last):
                with torch.autocast(self.device.type, self.dtype, enabled=autocast):
                    # [B, T]
                    logprobs = algo.trainer_logprobs(self.train_model, b)
                    with torch.no_grad(), lora.base_only(model, a.lora and a.kl_coef > 0):
                        ref_model = self.ref_model or model
                        ref = algo.trainer_logprobs(ref_model, b) if a.kl_coef > 0 else None
                # [B, T] each, weights [B]
                batch = (b[k] for k in ("old_logprobs", "advantages", "loss_mask", "weights"))
                loss_options = {k: getattr(a, k) for k in LOSS_FLAGS}
                loss, m = algo.policy_loss(logprobs, *batch, ref_logprobs=ref, **loss_options)
                # DDP and FSDP average gradients over ranks; the weights already make the global sum
                (loss * self.world).backward()
            if pad:
                continue
            rows.append(m)
            constrained = sum(len(x[0]) for x in masks if x)
            forced = sum(grammar.forced(x[1]) for x in masks if x)
            counts += torch.tensor([b["fwd_tokens"], constrained, forced])
            on = b["loss_mask"] > 0
            # [N]: each trained token's staleness
            age = version - b["version"][on]
            if age.numel() and not 0 <= int(age.min()) <= int(age.max()) <= max_age:
                raise RuntimeError(
                    f"a token sampled {int(age.max())} updates ago, more than --async {a.async_steps} allows"
                )
            dlogp = (logprobs - b["old_logprobs"])[on].abs().detach().double()
            stale[0] += torch.bincount(age, minlength=max_age + 1).double().cpu()
            stale[1] += torch.bincount(age, dlogp, minlength=max_age + 1).cpu()
        *by_age, fwd, constrained, forced = algo.all_reduce(
            stale.view(-1).tolist() + counts.tolist()
        )
        n, total = torch.tensor(by_age).view(2, -1).tolist()
        return {
            **algo.reduce_metrics(rows),
            "fwd_tokens": int(fwd),
            "constrained_tokens": int(constrained),
            "forced_tokens": int(forced),
            "staleness": {k: int(x) for k, x in enumerate(n) if x},
            "dlogp_by_staleness": {k: d / x for k, (x, d) in enumerate(zip(n, total)) if x},
        }

    def save(self, step: int, run, config: dict) -> str | None:
        """A checkpoint of the trained weights (under --async the served copy is a step behind) and
        the optimizer state: every rank helps gather them (FSDP), rank 0 writes them."""
        weights = parallel.full_state_dict(self.model, self.args.parallel)
        optim = parallel.optimizer_state(self.model, self.opt, self.args.parallel)
        if not self.master:
            return None
        # the served copy is of the plain class: the checkpoint loads anywhere
        checkpoint = (self.served, self.tok, weights, optim, self.dtype, config)
        return run.save_checkpoint(step, *checkpoint, self.args.keep_checkpoints)
