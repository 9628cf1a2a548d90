"""Harnessed agentic RL in one loop (README: Training).

    python train.py --harness calc                          # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 train.py --harness calc     # DDP: gloo on CPU, NCCL on GPU
    torchrun --nproc_per_node 8 train.py --parallel fsdp ...   # FSDP2: weights, grads, AdamW state sharded

Every rank serves the policy through its own proxy and runs its share of the step's tasks through the harness:

    rollouts -> samples -> advantages -> micro-batches -> loss + backward -> AdamW -> weight sync -> log

In --out: config.json, metrics.jsonl, calls/, rollouts/, checkpoints/, report.html (README: what each holds).
"""

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from tqdm import tqdm

from lightning_lite import algo, audit, grammar, parallel, sandbox
from lightning_lite.backends import HFBackend
from lightning_lite.harness import (
    SubprocessHarness,
    fail_rollouts_the_backend_failed,
    load_harness,
    parse_kwargs,
    run_rollouts,
)
from lightning_lite.models import load_model, load_tokenizer, resolve
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import (
    SPLIT_REASONS,
    UNANSWERED,
    Sample,
    common_prefix,
    find_batches,
    read_calls,
    read_jsonl,
    write_jsonl,
)
from lightning_lite.extras import from_calls
from lightning_lite.extras.report import write_report
from lightning_lite.samples import build_batch_samples
from lightning_lite.toolcalls import FORMATS

# ----------------------------------------------------------------------------- config (defaults in one place)
p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
p.add_argument(
    "--harness",
    action="append",
    default=None,
    metavar="SPEC[:WEIGHT]",
    help="examples/NAME/harness.py, a .py path, or "
    "package.module[:Name] (default calc); repeat it to train through several at once, tasks drawn in proportion to WEIGHT (default 1)",
)
p.add_argument(
    "--harness-arg",
    action="append",
    default=[],
    metavar="[SPEC:]K=V",
    help="keyword argument for the harness, or for the one --harness SPEC names (repeatable)",
)
p.add_argument(
    "--group-across-harnesses",
    action="store_true",
    help="several --harness that run the same tasks (by id): each task's "
    "group holds every harness's rollouts of it (--group-size split by WEIGHT), one advantage group",
)
p.add_argument(
    "--from-calls",
    nargs="+",
    default=None,
    metavar="DIR",
    help="train on calls recorded by proxy.py --out DIR (rewards "
    "POSTed while it served) or by a train.py run, instead of running a harness (README: Training from recorded calls); "
    "--harness then only evaluates",
)
p.add_argument(
    "--model", default="smollm2", help="'smollm2' (embedded) or a transformers model directory"
)
p.add_argument("--out", default="runs/train")
p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--batch-size", type=int, default=8, help="tasks per step, over all ranks")
p.add_argument("--group-size", type=int, default=4, help="rollouts per task (a GRPO group)")
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--warmup-steps", type=int, default=2)
p.add_argument(
    "--lr-schedule",
    default="constant",
    choices=["constant", "cosine"],
    help="after warmup: constant, or cosine to 10%%",
)
p.add_argument("--weight-decay", type=float, default=0.0)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument(
    "--loss",
    default="ppo",
    choices=algo.LOSSES,
    help="ppo: clipped token ratio; gspo: clipped sequence ratio; tis: REINFORCE "
    "x truncated IS weight; sft: -logprob of the rollouts with reward >= --sft-min-reward (rejection-sampling fine-tuning)",
)
p.add_argument(
    "--sft-min-reward",
    type=float,
    default=None,
    help="--loss sft: train on the rollouts whose reward is at least this "
    "(default: every rollout, rewarded or not: imitate recorded traces)",
)
p.add_argument(
    "--norm",
    default="rollout-mean",
    choices=algo.NORMS,
    help="loss normalization (README: the normalization table)",
)
p.add_argument(
    "--adv",
    default="grpo",
    choices=algo.ESTIMATORS,
    help="advantage estimator (README: the table); grpo-step and returns: "
    "per call, with per-call rewards",
)
p.add_argument("--gamma", type=float, default=1.0, help="--adv returns: the discount per call")
p.add_argument(
    "--clip-low",
    type=float,
    default=None,
    help="ratio clip below 1 (default: the loss's own: ppo 0.2, gspo 3e-4, the GSPO paper's)",
)
p.add_argument(
    "--clip-high",
    type=float,
    default=None,
    help="ratio clip above 1 (default: ppo 0.28, gspo 4e-4)",
)
p.add_argument(
    "--clip-ratio-c",
    type=float,
    default=3.0,
    help="ppo, gspo: dual clip, for a negative advantage a ratio above C counts as C (verl's clip_ratio_c; inf: off)",
)
p.add_argument("--tis-cap", type=float, default=2.0)
p.add_argument(
    "--kl-coef",
    type=float,
    default=0.0,
    help="KL penalty to the initial model (0: off, no reference model loaded)",
)
p.add_argument(
    "--norm-const",
    type=float,
    default=None,
    help="C of seq-mean-token-sum-norm: Dr. GRPO's generation budget, a fixed token count (default: --max-new-tokens, what one call may generate)",
)
p.add_argument(
    "--drop-zero-variance",
    action="store_true",
    help="drop groups whose rollouts all got the same reward",
)
p.add_argument(
    "--max-seq-len",
    type=int,
    default=None,
    help="longer samples are cut at a turn boundary, or dropped when their first turn is longer (counted, warned) (default: the served context)",
)
p.add_argument(
    "--max-new-tokens",
    type=int,
    default=1024,
    help="the most tokens one call may generate, whatever the harness asks (many ask nothing)",
)
p.add_argument(
    "--max-model-len",
    type=int,
    default=None,
    help="context of the served model (default: the model's); beyond what it was trained for, RoPE is scaled (YaRN)",
)
p.add_argument(
    "--micro-batch-tokens",
    type=int,
    default=4096,
    help="tokens per forward/backward: packed (a shared prefix counts once), or --no-tree padded [B, T]",
)
p.add_argument(
    "--no-tree",
    action="store_true",
    help="train each sample (a leaf of a rollout's prefix tree) as its own padded row, "
    "not the micro-batch packed as one tree with each shared prefix once (the same loss and gradient; for comparison)",
)
p.add_argument(
    "--attn",
    default=None,
    choices=["sdpa", "eager", "flex_attention"],
    help="the trainer's attention (default: the model's, "
    "sdpa): a packed tree's mask is [L, L] under sdpa and eager; flex_attention's block mask is O(L^2/128^2), for long rows on GPUs",
)
p.add_argument(
    "--parallel",
    default="ddp",
    choices=["ddp", "fsdp"],
    help="ddp: weights, grads and AdamW state whole on every rank (~16 B/param); fsdp: all three sharded over the ranks (FSDP2, per decoder layer)",
)
p.add_argument(
    "--fsdp-offload",
    action="store_true",
    help="fsdp: keep parameters, gradients and optimizer state in CPU memory",
)
p.add_argument(
    "--activation-checkpointing",
    action="store_true",
    help="recompute each layer's activations in backward: less memory, ~1/3 more compute",
)
p.add_argument("--max-concurrency", type=int, default=8, help="rollouts in flight per rank")
p.add_argument(
    "--rollout-timeout",
    type=float,
    default=300.0,
    help="seconds before a rollout is killed and marked failed",
)
p.add_argument(
    "--sandbox",
    default="auto",
    help='where a program harness\'s rollouts run (README "Sandboxes"): auto (bwrap, else an '
    "error that says how to install it), bwrap, docker, podman, none (the host), or a command template with {argv}",
)
p.add_argument("--sandbox-image", default=None, help="docker's image for tasks that name none")
p.add_argument(
    "--proxy-host",
    default="127.0.0.1",
    help="the address the proxy serves on and rollouts' base URLs name; another "
    "than loopback only for rollouts on other machines (a command-template sandbox): it is open to that network",
)
p.add_argument(
    "--eval-every",
    type=int,
    default=0,
    help="evaluate on the test split every N steps (0: only before and after)",
)
p.add_argument(
    "--eval-tasks", type=int, default=100, help="test tasks per evaluation (0: no evaluation)"
)
p.add_argument(
    "--save-every", type=int, default=0, help="checkpoint every N steps (always at the end)"
)
p.add_argument(
    "--keep-checkpoints",
    type=int,
    default=2,
    help="keep the newest N checkpoints, delete older ones (0: keep all); one is ~12 bytes/param with AdamW state",
)
p.add_argument(
    "--max-batch-size", type=int, default=32, help="hf backend: requests decoded together"
)
p.add_argument(
    "--backend",
    default="hf",
    choices=["hf", "vllm"],
    help="hf: the embedded transformers backend, in this process; vllm: vLLM servers (--vllm-url, or started here)",
)
p.add_argument(
    "--vllm-url",
    nargs="+",
    default=None,
    metavar="URL",
    help="vllm: servers already running this model (VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs) that can read --out; default: start --vllm-servers",
)
p.add_argument(
    "--vllm-servers",
    type=int,
    default=1,
    help="vllm: servers to start (rank 0 starts them; logs in OUT/vllm_K.log)",
)
p.add_argument(
    "--vllm-python",
    default=".venv-vllm/bin/python" if os.path.exists(".venv-vllm/bin/python") else sys.executable,
    help="vllm: the Python that has vLLM",
)
p.add_argument(
    "--vllm-args",
    default="",
    help="vllm: more arguments for the started servers, e.g. '--dtype bfloat16 --max-model-len 4096'",
)
p.add_argument(
    "--vllm-sleep",
    action="store_true",
    help="vllm, servers on the training GPUs: they free their GPU memory while the trainer computes (sleep level 2; started ones get --enable-sleep-mode)",
)
p.add_argument(
    "--vllm-gpus",
    nargs="+",
    default=None,
    metavar="IDS",
    help="vllm, GPUs: a started server per GPU "
    "set, e.g. '4,5 6,7' (nvidia-smi's ids; replaces --vllm-servers); default: server k on GPU k (README)",
)
p.add_argument(
    "--vllm-gpu-memory",
    type=float,
    default=None,
    metavar="SHARE",
    help="vllm, GPUs: each started server's "
    "--gpu-memory-utilization; default 0.3 on the trainer's GPUs (README: GPUs: vLLM), 0.9 on others",
)
p.add_argument(
    "--vllm-api-key",
    metavar="KEY",
    help="vllm: the API key of the --vllm-url servers (or $VLLM_API_KEY)",
)
p.add_argument(
    "--async",
    dest="async_steps",
    type=int,
    nargs="?",
    const=1,
    default=0,
    metavar="N",
    help="the next steps' rollouts run while this step trains, on weights at most N updates old (default 1); the loss's ratio to the recorded logprobs corrects for it",
)
p.add_argument(
    "--pause-retry-after",
    type=float,
    default=None,
    help="during a weight sync new calls wait (default), or are answered 429 with this Retry-After",
)
p.add_argument(
    "--tool-format",
    default=None,
    choices=FORMATS,
    help="the model family's tool-call format (default: detected from the chat template)",
)
p.add_argument(
    "--keep-history-tokens",
    action="store_true",
    help="where the chat template renders an earlier turn otherwise than it was "
    "sampled, keep the sampled tokens (one sample per rollout) instead of the template's text (template_mismatch)",
)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument(
    "--dtype",
    default="auto",
    choices=["auto", "fp32", "bf16"],
    help="of the trainer's compute and the "
    "served model (auto: bf16 on GPUs, fp32 on CPUs); bf16: autocast (FSDP: weights gathered in bf16), with "
    "fp32 master weights, AdamW state, gradient reductions and checkpoint weights",
)
p.add_argument(
    "--tensorboard",
    action="store_true",
    help="also log metrics to OUT/tensorboard (needs: pip install tensorboard)",
)
p.add_argument(
    "--wandb",
    metavar="PROJECT",
    default=None,
    help="also log metrics to Weights & Biases (needs: pip install wandb; WANDB_MODE=offline without a network)",
)
args = p.parse_args()
# each loss's own clip range unless given (config.json records what ran)
args.clip_low, args.clip_high = algo.clip_range(args.loss, args.clip_low, args.clip_high)
args.norm_const = args.norm_const or args.max_new_tokens
max_age = (
    args.steps if args.from_calls else args.async_steps
)  # the most updates between sampling a token and training it

# ----------------------------------------------------------------------------- distributed setup
ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
device = torch.device(
    f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else args.device
)
if device.type == "cuda":
    torch.cuda.set_device(device)
if args.dtype == "auto":  # config.json records what ran
    args.dtype = "bf16" if device.type == "cuda" else "fp32"
dtype = (
    torch.bfloat16 if args.dtype == "bf16" else torch.float32
)  # of the trainer's compute and of the served model
master = rank == 0
if args.batch_size % world:
    sys.exit(
        f"--batch-size {args.batch_size} does not divide over {world} ranks: use a multiple of {world} (GRPO groups stay on one rank)"
    )
if args.fsdp_offload and (args.parallel != "fsdp" or device.type != "cuda"):
    sys.exit(
        "--fsdp-offload moves FSDP's shards from GPU memory to CPU memory: it needs --parallel fsdp on GPUs"
    )
if args.parallel == "fsdp" and not ddp:
    sys.exit(
        "--parallel fsdp shards over ranks: start it with torchrun --nproc_per_node N (N >= 2); one process trains whole"
    )
if args.vllm_sleep and (args.backend != "vllm" or args.async_steps):
    sys.exit(
        "--vllm-sleep frees the vLLM servers' GPU memory while training: it needs --backend vllm, and no --async (rollouts would run then)"
    )
if args.attn == "flex_attention" and device.type == "cpu":
    sys.exit(
        "--attn flex_attention trains on GPUs: torch has no CPU backward for FlexAttention (sdpa, the default, runs a packed tree on CPUs)"
    )
if args.kl_coef < 0 or args.group_size < 1 or args.steps < 0:
    sys.exit("--kl-coef must be >= 0, --group-size >= 1 and --steps >= 0")
if args.from_calls and args.async_steps:
    sys.exit(
        "--from-calls trains on calls recorded before: --async (rollouts while training) has none to run"
    )
args.harness = args.harness or (
    [] if args.from_calls else ["calc"]
)  # under --from-calls a harness only evaluates
if args.group_across_harnesses and (len(args.harness) < 2 or args.from_calls):
    sys.exit(
        "--group-across-harnesses groups the rollouts of several --harness that run the same tasks: give two or more"
    )
torch.manual_seed(args.seed + rank)
random.seed(args.seed + rank)
os.makedirs(os.path.join(args.out, "calls"), exist_ok=True)
metrics_path, ckpt_root = (
    os.path.join(args.out, "metrics.jsonl"),
    os.path.join(args.out, "checkpoints"),
)


def log(*a):
    if master:
        print(*a, flush=True)


def append_metrics(row):
    """One line of metrics.jsonl (None: not measured; NaN and inf, which JSON has not, too), also to --tensorboard
    and --wandb, which leave a None out. The file is written last: a row in it has been logged everywhere."""
    if master:
        row = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
        }
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if tb:
            for k, v in numbers.items():
                tb.add_scalar(k, v, row["step"])
            tb.flush()
        if wb:
            wb.log(numbers, step=row["step"])
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def run_file(
    kind, name
):  # a step's (or an evaluation's) calls or rollouts: one file per rank under DDP
    return os.path.join(args.out, kind, f"{name}.rank{rank}.jsonl" if ddp else f"{name}.jsonl")


def save_rollouts(name, results, adv):
    """One line per rollout: task, harness, reward (null: failed), call rewards, why it failed, seconds, advantage
    (a number, {call index: number} for a per-call estimator, or null: not trained)."""
    write_jsonl(
        run_file("rollouts", name),
        [{**dataclasses.asdict(r), "advantage": adv.get(r.rollout_id)} for r in results],
    )


# ----------------------------------------------------------------------------- model, optimizer, resume
start_step, resume_dir = 0, None
if args.resume and os.path.exists(os.path.join(ckpt_root, "latest")):
    resume_dir = os.path.join(ckpt_root, open(os.path.join(ckpt_root, "latest")).read().strip())
elif args.resume:
    log(f"--resume: no checkpoint in {ckpt_root}, starting from step 0")
tok = load_tokenizer(args.model)
# --from-calls: the recorded rollouts to train on, read and checked once (extras/from_calls.py)
recorded = (
    from_calls.load(
        args.from_calls, args.model, len(tok), args.loss, args.adv, args.sft_min_reward, log
    )
    if args.from_calls
    else None
)
model = load_model(
    resume_dir or args.model, device, max_model_len=args.max_model_len
)  # fp32: the master weights
fsdp = args.parallel == "fsdp"
# The reference model and the backend's copy hold the weights as the trainer's forward sees them: FSDP gathers them in
# --dtype, DDP's autocast casts fp32 weights op by op (bf16 weights under autocast differ from that by |dlogp| 0.03)
held = dtype if fsdp else torch.float32
ref_model = (
    load_model(args.model, device, held, args.max_model_len).requires_grad_(False)
    if args.kl_coef > 0
    else None
)
args.max_seq_len = (
    args.max_seq_len or model.config.max_position_embeddings
)  # what can be served can be trained on
# The embedded backend serves infer_model: the trained module itself (one process, DDP: a weight sync only drops
# stale KV caches) or, under FSDP (the parameters are shards), --async (rollouts run while they change) and --attn
# flex_attention (the trainer's attention: decoding keeps sdpa), a copy of its own that each sync refreshes. vLLM
# always has its own.
infer_model = model
if (fsdp or args.async_steps or args.attn == "flex_attention") and args.backend == "hf":
    infer_model = load_model(resume_dir or args.model, device, held, args.max_model_len)
for net in [m for m in (model, ref_model) if m is not None and args.attn]:
    net.set_attn_implementation(args.attn)
if not args.no_tree and (why := algo.tree_unsupported(model.config)):
    log(
        f"training each sample as its own row (--no-tree): this model cannot run a packed tree, {why}"
    )
    args.no_tree = True
train_model = parallel.wrap(
    model,
    args.parallel,
    device,
    world,
    args.fsdp_offload,
    args.activation_checkpointing,
    dtype=dtype,
)
if (
    ref_model is not None and fsdp
):  # sharded like the policy, without an optimizer; its forwards are collectives too
    parallel.wrap(ref_model, "fsdp", device, world, args.fsdp_offload, dtype=dtype)
opt = torch.optim.AdamW(
    model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99)
)  # after sharding: over the shards


def lr_at(step):  # linear warmup, then constant or cosine down to 10%
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (
        0.1 + 0.45 * (1 + math.cos(math.pi * t)) if args.lr_schedule == "cosine" else 1.0
    )


def share(total, weights):
    """``total`` split in proportion to ``weights``, largest remainders first: share(4, [3, 1]) == [3, 1]."""
    raw = [total * w / sum(weights) for w in weights]
    n = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: n[i] - raw[i])[: total - sum(n)]:
        n[i] += 1
    return n


def draw(items, step, n):
    """The step's n items of a fixed shuffle per epoch, so --resume sees the same order."""
    epoch, k = divmod(step, max(1, len(items) // max(1, n)))
    items = list(items)
    random.Random(args.seed * 1000 + epoch).shuffle(items)
    return items[k * n : (k + 1) * n]


if resume_dir:
    # mapped from the file into host memory, not onto the GPU: every rank of a node shares the one copy the page
    # cache holds (12 bytes/param: 108 GB for 9B) and takes its part (FSDP) or all of it (DDP)
    state = torch.load(
        os.path.join(resume_dir, "trainer_state.pt"),
        map_location="cpu",
        mmap=True,
        weights_only=False,
    )
    parallel.load_optimizer_state(model, opt, state["optimizer"], args.parallel)
    start_step = state["step"]
    log(f"resumed from {resume_dir} at step {start_step}")


# A run that starts at step k drops what an earlier attempt wrote after checkpoint k: those steps run again on the
# same tasks (step_rollouts), so a run killed between checkpoints loses no data and trains none twice; an evaluation
# without its metrics row was cut short: dropped, it runs again. Rank 0 drops every rank's files (the attempt may
# have had another world size), then the others wait.
prev = (
    read_jsonl(metrics_path) if resume_dir and os.path.exists(metrics_path) else []
)  # skips a torn last line
rows = {
    (r["step"], "eval_reward" in r): r for r in prev if r["step"] <= start_step
}  # once each (Ctrl-C may log twice)
evaluated = {s for s, is_eval in rows if is_eval}
for (kind, k), files in find_batches(args.out).items() if master else ():
    if kind == "step" and k >= start_step or kind == "eval" and k not in evaluated:
        for path in files["calls"] + files["rollouts"]:
            os.remove(path)
if master and os.path.exists(metrics_path):  # a new file, then a rename: a kill here loses no row
    write_jsonl(metrics_path + ".tmp", rows.values())
    os.replace(metrics_path + ".tmp", metrics_path)
if ddp:
    dist.barrier()
config = {**vars(args), "world_size": world, "start_step": start_step}
log(json.dumps(config, indent=1))
tb = wb = None  # --tensorboard, --wandb: imported only when asked for
if master:
    json.dump(config, open(os.path.join(args.out, "config.json"), "w"), indent=1)
    try:
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(os.path.join(args.out, "tensorboard"))
        if args.wandb:
            import wandb

            wb = wandb.init(
                project=args.wandb,
                config=config,
                dir=args.out,
                name=os.path.basename(os.path.abspath(args.out)),
            )
    except ImportError as e:
        sys.exit(
            f"--tensorboard / --wandb need their package ({e}): pip install tensorboard / wandb"
        )

# ----------------------------------------------------------------------------- backend, proxy, harness
if args.backend == "vllm":
    from lightning_lite.extras import vllm

    backend = vllm.start(args, model.config, dtype, resume_dir or resolve(args.model), device)
else:
    backend = HFBackend(
        infer_model,
        tok,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        dtype=dtype,
    )
backend.version = start_step
proxy = Proxy(
    backend,
    tok,
    model_name=args.model,
    max_new_tokens=args.max_new_tokens,
    call_timeout=args.rollout_timeout,
    pause_retry_after=args.pause_retry_after,
    tool_format=args.tool_format,
    keep_history_tokens=args.keep_history_tokens,
    rollout_tokens=True,
)
server = ProxyServer(proxy, host=args.proxy_host).start()
# "search:2" -> ("search", 2.0); "file.py:Class" keeps its class
specs = [
    (m[1], float(m[2])) if (m := re.fullmatch(r"(.+):(\d+(?:\.\d+)?)", h)) else (h, 1.0)
    for h in args.harness
]
hs, weights, audits = (
    [],
    [w for _, w in specs],
    {},
)  # the harnesses, their weights, name -> (their audit patterns)
targets = {item.partition("=")[0].rpartition(":")[0] for item in args.harness_arg} - {
    "",
    *(sp for sp, _ in specs),
}
if targets or any(w <= 0 for w in weights):
    sys.exit(
        f"--harness-arg {sorted(targets)[0]}:K=V names no --harness"
        if targets
        else "a --harness WEIGHT must be > 0"
    )
for spec, _ in specs:  # "K=V" goes to every harness, "SPEC:K=V" to that one
    kw = parse_kwargs(
        [
            k.rpartition(":")[2] + "=" + v
            for k, _, v in (i.partition("=") for i in args.harness_arg)
            if k.rpartition(":")[0] in ("", spec)
        ]
    )
    h = load_harness(spec, **kw)
    h.name = h.name if h.name not in audits else f"{h.name}{len(hs)}"  # metrics are kept by name
    audits[h.name] = (
        audit.compile_patterns(h.audit),
        audit.compile_patterns(h.audit_results),
    )  # bad ones fail here
    hs.append(h)
for (
    h
) in hs:  # a Python harness runs in this process: its tools are its own code, no program to sandbox
    if isinstance(h, SubprocessHarness) and h.sandbox is None:
        try:
            h.sandbox = sandbox.make(args.sandbox, hide=[args.out], image=args.sandbox_image)
        except ValueError as e:
            sys.exit(f"--sandbox {args.sandbox}: {e}")
        log(f"{h.name}'s rollouts run in sandbox {h.sandbox.name}")
box = {
    h.name: getattr(getattr(h, "sandbox", None), "name", "none") for h in hs
}  # where each one's rollouts run
escapes = (
    audit.escape_patterns(args.out, os.path.expanduser("~"), server.port)
    if set(box.values()) - {"none"}
    else {}
)
train_tasks = {h.name: h.tasks("train") for h in hs}
test_tasks = {h.name: h.tasks("test")[: args.eval_tasks] for h in hs}
by_id = {h.name: {t.id: t for t in train_tasks[h.name]} for h in hs}
common = (
    [t for t in train_tasks[hs[0].name] if all(t.id in by_id[h.name] for h in hs)] if hs else []
)
if args.group_across_harnesses and not common:
    sys.exit(f"--group-across-harnesses: harnesses {', '.join(by_id)} share no train task id")
if hs and 0 in share(args.group_size if args.group_across_harnesses else args.batch_size, weights):
    sys.exit(
        f"{'--group-size' if args.group_across_harnesses else '--batch-size'} is too small to give each of the {len(hs)} harnesses "
        f"(weights {', '.join(f'{w:g}' for w in weights)}) a {'rollout in every group' if args.group_across_harnesses else 'task a step'}"
    )
log(proxy.renderer.describe())
for h, (spec, w) in zip(hs, specs):
    log(
        f"harness {h.name} ({spec}, weight {w:g}): {len(train_tasks[h.name])} train / {len(test_tasks[h.name])} test tasks"
    )
log(f"rank 0 proxy at {server.url}")
harness_of = {}  # rollout id -> the harness that runs it


def endpoint_for(
    rid,
):  # a token in the URL only this rollout knows; a sandboxed one gets a Unix socket of its own
    return server.endpoint(rid, args.model, socket=box[harness_of[rid].name] in ("bwrap", "docker"))


def rollouts(jobs, name):
    """Run jobs (rollout id, task, harness) on this rank's proxy; return (results, calls, seconds). Call rewards
    (POSTed, or returned by run()) are keyed by call index from here on."""
    proxy.set_output(run_file("calls", name))
    t0 = time.time()
    harness_of.update({rid: h for rid, _, h in jobs})
    results = asyncio.run(
        run_rollouts(
            None,
            jobs,
            endpoint_for,
            args.max_concurrency,
            args.rollout_timeout,
            posted_reward=proxy.reward,
            desc=name.replace("_", " "),
            progress=master,
        )
    )
    proxy.set_output(None)
    server.close_sockets([rid for rid, *_ in jobs])
    calls = read_calls(run_file("calls", name))  # from disk: the proxy keeps none in memory
    calls_of = {}
    for c in calls:
        calls_of.setdefault(c.rollout_id, []).append(c)
    for r in results:  # what the proxy refused it (another rollout's route, a reward of its own), what the audit found
        h, mine = (
            harness_of.pop(r.rollout_id),
            [c for c in calls_of.get(r.rollout_id, []) if c.finish_reason not in UNANSWERED],
        )
        esc = (
            escapes if box[h.name] != "none" else {}
        )  # an escape is looked for in sandboxed rollouts
        found = audit.scan(
            calls_of.get(r.rollout_id, []),
            {**audits[h.name][0], **esc},
            audits[h.name][1],
            tok.decode,
        )
        r.flags = proxy.flags(r.rollout_id) + [
            {**f, "kind": "escape"} if f["what"] in esc else f for f in found
        ]
        ids = Counter(
            c.reply_id for c in mine
        )  # a call is named by its index, or by its reply's id (one choice)
        key = {c.index: c.index for c in mine} | {
            c.reply_id: c.index for c in mine if ids[c.reply_id] == 1
        }
        got = {**proxy.call_rewards(r.rollout_id), **r.call_rewards}
        if r.reward is not None and (bad := [k for k in got if k not in key]):
            r.reward, r.error = (
                None,
                f"rewards for calls it does not have: {bad[:3]} (name a call by its index in the rollout or its reply's id)",
            )
        r.call_rewards = {key[k]: v for k, v in got.items()} if r.reward is not None else {}
        if r.flags and h.zero_flagged and r.reward is not None:
            r.reward, r.call_rewards = 0.0, {}
    proxy.reset()
    fail_rollouts_the_backend_failed(results, calls)
    return results, calls, time.time() - t0


def step_rollouts(step):
    """This rank's share of the step's tasks, each group_size times (split over the harnesses, or each harness's share
    of the tasks): ({rollout id: its advantage group}, results, calls, seconds)."""
    if (
        args.group_across_harnesses
    ):  # one task list; each task's group split over the harnesses by weight
        picked = [
            [
                (h, by_id[h.name][t.id])
                for h, n in zip(hs, share(args.group_size, weights))
                for _ in range(n)
            ]
            for t in draw(common, step, args.batch_size)
        ]
    else:
        picked = [
            [(h, t)] * args.group_size
            for h, n in zip(hs, share(args.batch_size, weights))
            for t in draw(train_tasks[h.name], step, n)
        ]
    jobs, groups = [], {}
    for i, group in enumerate(picked[rank::world]):
        for g, (h, t) in enumerate(group):
            jobs.append((f"s{step}-r{rank}-t{i}-g{g}", t, h))
            groups[jobs[-1][0]] = t.id if args.group_across_harnesses else f"{h.name}/{t.id}"
    return groups, *rollouts(jobs, f"step_{step}")


def recorded_step(step):
    """--from-calls: this rank's share of the step's --batch-size groups of recorded rollouts, as step_rollouts."""
    t0 = time.time()
    groups, results, calls = recorded.step(step, rank, world, args.batch_size, draw)
    # as a harness step's: the report shows them, a later run reads them
    write_jsonl(run_file("calls", f"step_{step}"), calls)
    return groups, results, calls, time.time() - t0


ahead = {}  # --async: step -> its rollouts, run in step order by one worker thread
worker = (
    concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
    if args.async_steps
    else None
)


def evaluate(step):
    """Run each harness's test split once (its own sampling settings) and append the result to metrics.jsonl (with
    several harnesses, each one's too: eval_reward/NAME)."""
    every = [(h, t) for h in hs for t in test_tasks[h.name]]
    if not every:
        return
    concurrent.futures.wait(ahead.values())  # --async: the proxy records one run at a time
    jobs = [(f"eval{step}-r{rank}-{i}", t, h) for i, (h, t) in enumerate(every[rank::world])]
    results, _, secs = rollouts(jobs, f"eval_{step}")
    save_rollouts(f"eval_{step}", results, {})
    ev = {"step": step}
    for name in [""] + ([h.name for h in hs] if len(hs) > 1 else []):  # "": all of them
        mine = [r for r in results if r.harness == name or not name]
        ok = [r.reward for r in mine if r.reward is not None]
        n, total, success, failed = algo.all_reduce(
            [len(mine), sum(ok), sum(r >= 1.0 for r in ok), len(mine) - len(ok)]
        )
        sfx = f"/{name}" if name else ""
        ev.update(
            {"eval_reward" + sfx: total / max(1, n), "eval_success" + sfx: success / max(1, n)}
        )
        if not name:
            ev.update(eval_tasks=int(n), eval_failed=int(failed), eval_s=round(secs, 1))
    log(
        f"eval @ step {step}: reward {ev['eval_reward']:.3f}  success {ev['eval_success']:.3f} over {ev['eval_tasks']} tasks ({secs:.0f}s)"
        + "".join(f" | {h.name} {ev['eval_reward/' + h.name]:.3f}" for h in hs if len(hs) > 1)
    )
    append_metrics(ev)


def save(step):
    """Checkpoint in transformers format + the whole optimizer state, written by rank 0 (under FSDP every
    rank first helps gather them; the plain-class copy writes them, so the checkpoint loads anywhere)."""
    weights = parallel.full_state_dict(
        model, args.parallel
    )  # the trained ones: under --async infer_model is a step behind
    optim = parallel.optimizer_state(model, opt, args.parallel)
    if not master:
        return
    d = os.path.join(ckpt_root, f"step_{step}")
    tmp = d + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    infer_model.save_pretrained(tmp, state_dict=weights)
    infer_model.config.dtype = (
        dtype  # it wrote the module's: a loader's (a vLLM server's) dtype "auto" takes this one
    )
    infer_model.config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save(
        {"optimizer": optim, "step": step, "args": vars(args)},
        os.path.join(tmp, "trainer_state.pt"),
    )
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    with open(os.path.join(ckpt_root, "latest"), "w") as f:
        f.write(f"step_{step}")
    log(f"saved {d}")
    if args.keep_checkpoints:
        kept = sorted(
            (n for n in os.listdir(ckpt_root) if re.fullmatch(r"step_\d+", n)),
            key=lambda n: -int(n[5:]),
        )
        for n in kept[args.keep_checkpoints :]:
            shutil.rmtree(os.path.join(ckpt_root, n))


def micro_batches(samples, weights, order=None):
    """Sort by tokens (a rollout's leaves and a group's samples side by side: neighbours share prefixes), or take
    ``order`` (bench/train_step.py), then cut into micro-batches of at most --micro-batch-tokens tokens: packed,
    each sample adding what follows its common prefix with the one before (exactly the packed row's length when
    sorted: ``algo.pack``), or, --no-tree, padded [B, T]."""
    mbs, size, prev = [], 0, []
    for i in (
        sorted(range(len(samples)), key=lambda i: samples[i].tokens) if order is None else order
    ):
        t = samples[i].tokens
        if args.no_tree:  # rows: B x the longest
            grown = (
                max(len(samples[j].tokens) for j in mbs[-1] + [i]) * (len(mbs[-1]) + 1)
                if mbs
                else 0
            )
        else:  # packed: what follows its common prefix with the sample before
            grown = size + len(t) - common_prefix(prev, t)
        if mbs and grown <= args.micro_batch_tokens:
            mbs[-1].append(i)
            size = grown
        else:
            mbs.append([i])
            size = len(t)
        prev = t
    return [([samples[i] for i in mb], [weights[i] for i in mb]) for mb in mbs]


def per(a, b):  # None: not measured (a 0 would claim a measurement)
    return a / b if b else None


def tally(results, calls, st):
    """One step's sums over ``results`` (a rank's, or one harness's of them), their calls and samples.build_samples's
    ``st``: summed over ranks, ``rates`` makes the metrics row's numbers of them."""
    rewarded = [
        r.reward for r in results if r.error is None and r.reward is not None
    ]  # None: an unrewarded trace (sft)
    return {
        "rollouts": len(results),
        "failed": sum(r.error is not None for r in results),
        "flagged": sum(bool(r.flags) for r in results),
        "rewarded": len(rewarded),
        "reward": sum(rewarded),
        "success": sum(x >= 1.0 for x in rewarded),
        "calls": len(calls),
        "gen": sum(len(c.response_ids) for c in calls),
        **{k: st[k] for k in ("tokens", "tokens_unmerged", "truncated", "dropped")},
        **{"split_" + r: st["split_" + r] for r in SPLIT_REASONS},
    }


def rates(n, sfx=""):
    """The row's reward, success, calls per rollout, merge ratio and splits from ``tally``'s sums (keys ending in sfx)."""
    return {
        "reward" + sfx: per(n["reward" + sfx], n["rewarded" + sfx]),
        "success" + sfx: per(n["success" + sfx], n["rewarded" + sfx]),
        "calls_per_rollout" + sfx: per(n["calls" + sfx], n["rollouts" + sfx]),
        "merge_ratio" + sfx: per(n["tokens_unmerged" + sfx], n["tokens" + sfx]),
        "splits" + sfx: {
            r: int(n[f"split_{r}{sfx}"]) for r in SPLIT_REASONS if n[f"split_{r}{sfx}"]
        },
    }


def train_on(samples, version):
    """Loss and backward over this rank's micro-batches; gradients summed over ranks by DDP or FSDP. Returns metrics,
    with the trained tokens and their mean |trainer - rollout logprob| by staleness (updates since they were sampled)."""
    # the denominators are all-reduced before any backward: exact under any split
    weights = algo.sample_weights(
        samples, args.norm, algo.global_denominators(samples), args.norm_const
    )
    mbs = parallel.pad_micro_batches(
        micro_batches(samples, weights), args.parallel
    )  # None: a zero-loss step, to join the collectives
    metrics, stale = (
        [],
        torch.zeros(2, max_age + 1, dtype=torch.float64),
    )  # tokens, sum |dlogp| by age
    fwd = constrained = forced = (
        0  # tokens through the model (a packed tree: each shared prefix once); under a grammar, forced by it
    )
    bar = tqdm(
        mbs, desc="train", unit="mb", leave=False, disable=not (master and sys.stderr.isatty())
    )  # quiet in logs
    autocast = torch.autocast(
        device.type, dtype, enabled=dtype != torch.float32
    )  # the forwards; backward follows
    for i, mb in enumerate(bar):
        with parallel.accumulating(train_model, args.parallel, last=i == len(mbs) - 1):
            pad = (
                mb is None
            )  # a zero-weight micro-batch through the same forwards: under FSDP each is a collective
            mb = ([Sample("pad", [tok.eos_token_id] * 2, [0, 1], [0.0, 0.0])], [0.0]) if pad else mb
            # the masks a grammar drew tokens under (a forced call's schema), replayed: the trainer scores them under the same
            masks = [
                grammar.sample_masks(s, tok, model.config.vocab_size) if s.grammars else None
                for s in mb[0]
            ]
            # flex_attention compiles for each new shape: the rows are padded to one
            b = algo.collate(
                *mb,
                device=device,
                pad_id=tok.pad_token_id or 0,
                tree=not args.no_tree,
                masks=masks,
                pad_to=args.micro_batch_tokens
                if model.config._attn_implementation == "flex_attention"
                else 1,
            )
            with autocast:
                lp = algo.trainer_logprobs(train_model, b)
                with torch.no_grad():
                    ref = algo.trainer_logprobs(ref_model, b) if ref_model is not None else None
            loss, m = algo.policy_loss(
                lp,
                b["old_logprobs"],
                b["advantages"],
                b["loss_mask"],
                b["weights"],
                loss=args.loss,
                clip_low=args.clip_low,
                clip_high=args.clip_high,
                clip_ratio_c=args.clip_ratio_c,
                tis_cap=args.tis_cap,
                kl_coef=args.kl_coef,
                ref_logprobs=ref,
            )
            (
                loss * world
            ).backward()  # DDP and FSDP average gradients over ranks; the weights already make the global sum
            if pad:
                continue
            metrics.append(m)
            fwd += b["fwd_tokens"]
            constrained += sum(len(x[0]) for x in masks if x)
            forced += sum(grammar.forced(x[1]) for x in masks if x)
            on = b["loss_mask"] > 0
            age = version - b["version"][on]
            if age.numel() and not 0 <= int(age.min()) <= int(age.max()) <= max_age:
                raise RuntimeError(
                    f"a token sampled {int(age.max())} updates ago, more than --async {args.async_steps} allows"
                )
            stale[0] += torch.bincount(age, minlength=len(stale[0])).double().cpu()
            stale[1] += torch.bincount(
                age, (lp - b["old_logprobs"])[on].abs().detach().double(), minlength=len(stale[0])
            ).cpu()
    *counts, fwd, constrained, forced = algo.all_reduce(
        stale.view(-1).tolist() + [fwd, constrained, forced]
    )
    n, d = torch.tensor(counts).view(2, -1).tolist()
    return {
        **algo.reduce_metrics(metrics),
        "fwd_tokens": int(fwd),
        "constrained_tokens": int(constrained),
        "forced_tokens": int(forced),
        "staleness": {a: int(k) for a, k in enumerate(n) if k},
        "dlogp_by_staleness": {a: x / k for a, (k, x) in enumerate(zip(n, d)) if k},
    }


def sync_weights(version):
    """The backend serves the trained weights; every rank calls it (a collective). vLLM gets them whole
    (under FSDP gathered into rank 0's host memory; rank 0 writes them); the embedded backend gets the
    module (it serves it, or copies it into its own copy, gathering FSDP's shards one at a time)."""
    served = model
    if args.backend == "vllm":
        served = parallel.full_state_dict(model, args.parallel)
    backend.pause()
    # every rank's calls have finished before anything reloads (vLLM servers are shared)
    if ddp:
        dist.barrier()
    backend.sync_weights(served, version=version)
    if ddp:
        dist.barrier()
    backend.resume()


# ----------------------------------------------------------------------------- the loop
def eval_due(k):  # before and after training, and every --eval-every steps
    return k in (0, args.steps) or (args.eval_every > 0 and k % args.eval_every == 0)


step = steps_done = (
    start_step  # steps_done: steps whose update is applied (or skipped): what a checkpoint holds
)
unlogged = (
    None  # the metrics row of step steps_done while it is not in metrics.jsonl: a Ctrl-C writes it
)
interrupted = (
    False  # a Ctrl-C: it stops the run at once, and again at the next step, as Python drops a
)
# KeyboardInterrupt raised while a finalizer runs (a __del__: "Exception ignored in"): a run once went on for 20 steps


def on_ctrl_c(signum, frame):
    global interrupted
    interrupted = True
    try:  # in the rollouts' event loop: cancel them (their clients close), asyncio.run raises CancelledError
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    for t in asyncio.all_tasks(loop):
        t.cancel()
    loop.call_soon_threadsafe(lambda: None)  # wakes its select(), which the signal does not end


signal.signal(signal.SIGINT, on_ctrl_c)
try:
    if (
        args.vllm_url
    ):  # servers a user started may serve other weights (a previous run's, before --resume): ours
        sync_weights(start_step)
    if (
        eval_due(start_step) and start_step not in evaluated
    ):  # a resumed run runs the one a Ctrl-C cut short
        evaluate(start_step)
    for step in range(start_step, args.steps):
        if interrupted:
            raise KeyboardInterrupt
        t_step = time.time()
        # 1. rollouts: every task group_size times, through this rank's proxy. Under --async N, those of the next N
        # steps start now, in the background: step s's start once version s - N is served, so no trained token is
        # more than N updates old (README: --async).
        for s in range(step, min(step + args.async_steps, args.steps - 1) + 1) if worker else ():
            ahead[s] = ahead.get(s) or worker.submit(step_rollouts, s)
        groups, results, calls, t_roll = (
            ahead.pop(step).result()
            if worker
            else (recorded_step if args.from_calls else step_rollouts)(step)
        )
        t_wait = time.time() - t_step
        ok = {
            r.rollout_id: r.reward for r in results if r.error is None
        }  # None: a recorded trace without reward (sft)
        # 2. samples: merge each rollout's calls (failed rollouts are never trained on), by harness (its own metrics)
        name_of = {r.rollout_id: r.harness for r in results}
        calls_of, answered = {}, {}
        for c in calls:
            calls_of.setdefault(name_of[c.rollout_id], []).append(c)
            if c.finish_reason not in UNANSWERED:
                answered.setdefault(c.rollout_id, []).append(c.index)
        samples, sstats, per_h = [], Counter(), {}
        for name, cs in calls_of.items():
            got, per_h[name] = build_batch_samples(
                [c for c in cs if c.rollout_id in ok], args.max_seq_len
            )
            samples += got
            sstats.update(per_h[name])
        if (
            args.loss == "sft"
        ):  # -logprob under the model's own softmax, whatever the settings that sampled them
            for s in (
                samples
            ):  # and without a grammar's mask: the model learns to write what the grammar forced
                s.temperature, s.top_k, s.top_p, s.grammars = (
                    [1.0] * len(s.tokens),
                    [0] * len(s.tokens),
                    [1.0] * len(s.tokens),
                    {},
                )
        if args.from_calls:  # sampled before this run began: by its version 0, `step` updates ago
            for s in samples:
                s.version = [0] * len(s.tokens)
        # 3. advantages: a group is the rollouts of one task (by one harness, or --group-across-harnesses by all), on
        # this rank; per-call estimators give each call its own. sft: advantage 1 for what it should imitate.
        if args.loss == "sft":
            adv, astats = (
                {
                    rid: 1.0
                    for rid, x in ok.items()
                    if args.sft_min_reward is None or x is not None and x >= args.sft_min_reward
                },
                {},
            )
        else:  # every rollout in ok has a reward
            got = algo.gather_rewards(
                ok,
                {rid: groups[rid] for rid in ok},  # all ranks' rollouts
                {r.rollout_id: r.call_rewards for r in results if r.rollout_id in ok},
                answered,
            )
            adv, astats = algo.compute_advantages(
                *got[:2],
                args.adv,
                drop_zero_variance=args.drop_zero_variance,
                call_rewards=got[2],
                calls=got[3],
                gamma=args.gamma,
            )
        samples = algo.assign_advantages(
            samples, adv
        )  # zero-advantage samples stay: they count in the denominators
        save_rollouts(f"step_{step}", results, adv)
        counts = {
            **tally(results, calls, sstats),
            "samples": len(samples),
            "signal": sum(any(s.advantages) for s in samples),
            "trainable_tokens": sum(sum(s.loss_mask) for s in samples),
            "kept_tokens": sum(len(s.tokens) for s in samples),
        }
        for h in (
            hs if len(hs) > 1 else ()
        ):  # each harness's own, side by side (the same keys on every rank)
            mine = tally(
                [r for r in results if r.harness == h.name],
                calls_of.get(h.name, []),
                per_h.get(h.name, Counter()),
            )
            counts.update({f"{k}/{h.name}": v for k, v in mine.items()})
        n = dict(zip(counts, algo.all_reduce(list(counts.values()))))  # summed over ranks
        if n["dropped"]:
            log(
                f"step {step + 1}: {int(n['dropped'])} samples dropped, first turn > --max-seq-len {args.max_seq_len}"
            )
        # 4-6. loss, backward, optimizer step (skipped when nothing carries a signal)
        t0 = time.time()
        if not worker:
            backend.pause()  # no generation while the weights change (--async: the backend serves its own copy)
        if args.vllm_sleep and master:
            backend.sleep()  # the trainer gets the GPU memory; the weight sync below wakes the servers
        t0, t_sleep = time.time(), time.time() - t0
        m, gnorm, skipped = {}, None, None  # None: not measured (no update, nothing to measure)
        if n["signal"] > 0 or (n["samples"] > 0 and args.kl_coef > 0):
            model.train()
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            m = train_on(samples, version=step)
            gnorm = parallel.scalar(
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            )
            if math.isfinite(gnorm):  # the norm of the reduced gradients: every rank decides alike
                opt.step()
            else:  # one NaN/inf gradient would make every weight NaN
                skipped = "nonfinite_grad"
                log(
                    f"step {step + 1}: WARNING: the gradient norm is {gnorm}, skipping the update (a non-finite loss or logprob: see loss, dlogp_max)"
                )
            opt.zero_grad(
                set_to_none=True
            )  # the gradients' memory is free for the rollouts (and woken vLLM servers)
            model.eval()
        else:
            skipped = "no_signal"
            log(
                f"step {step + 1}: every rollout failed or every group has zero advantage; skipping the update"
            )
        t_train = time.time() - t0
        row = {
            "step": step + 1,
            **rates(n),
            **{
                k: int(n[k])
                for k in (
                    "rollouts",
                    "failed",
                    "flagged",
                    "calls",
                    "samples",
                    "trainable_tokens",
                    "truncated",
                    "dropped",
                )
            },
            "fwd_tokens": m.get("fwd_tokens"),
            "constrained_tokens": m.get("constrained_tokens"),
            "forced_tokens": m.get("forced_tokens"),
            "zero_var_groups": astats.get("zero_variance_groups", 0),
            "skipped": skipped,
            "grad_norm": gnorm,
            **{
                k: m.get(k)
                for k in (
                    "loss",
                    "clip_frac",
                    "ratio_mean",
                    "ratio_min",
                    "ratio_max",
                    "prob_corr",
                    "dlogp_mean",
                    "dlogp_max",
                    "ratio_out_frac",
                )
            },
            "staleness": m.get("staleness", {}),
            "dlogp_by_staleness": m.get("dlogp_by_staleness", {}),
            "lr": lr_at(step),
            "t_rollout": round(t_roll, 2),
            "t_wait": round(t_wait, 2),
            "t_train": round(t_train, 2),
            "t_sleep": round(t_sleep, 3),
            "t_sync": None,
            "t_step": None,  # None: a Ctrl-C came first
            "gen_tok_s": None
            if args.from_calls
            else n["gen"] / max(t_roll, 1e-9) / world,  # None: recorded, not generated
            "train_tok_s": per(n["kept_tokens"], t_train * world) if m else None,
            **{k: v for h in hs if len(hs) > 1 for k, v in rates(n, "/" + h.name).items()},
        }
        unlogged, steps_done = (
            row,
            step + 1,
        )  # the update is applied (or skipped): a checkpoint from now is of step + 1
        # 7. weight sync: calls in flight finish on the old weights, new calls wait, then get the new ones
        t0 = time.time()
        if args.vllm_sleep and device.type == "cuda":
            torch.cuda.empty_cache()  # what training freed goes back to the GPU before the servers wake
        sync_weights(step + 1)
        row.update(t_sync=round(time.time() - t0, 3), t_step=round(time.time() - t_step, 2))
        if device.type == "cuda":
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        # log: one line per step
        show = lambda k, spec: "-" if row[k] is None else format(row[k], spec)  # noqa: E731  None: not measured
        log(
            f"step {step + 1:4d} | reward {show('reward', '.3f')} succ {show('success', '.2f')} | fail {row['failed']} | samples {row['samples']} "
            f"tok {row['trainable_tokens']} fwd {show('fwd_tokens', 'd')} merge {show('merge_ratio', '.2f')}x | loss {show('loss', '+.4f')} gnorm {show('grad_norm', '.3f')} clip {show('clip_frac', '.3f')} "
            f"|dlogp| {show('dlogp_mean', '.4f')} | roll {row['t_rollout']:.1f}s ({show('gen_tok_s', '.0f')} tok/s) train {row['t_train']:.1f}s ({show('train_tok_s', '.0f')} tok/s) "
            f"sync {row['t_sync']:.2f}s"
            + (
                f" | waited {row['t_wait']:.1f}s, tokens by staleness {row['staleness']}"
                if worker
                else ""
            )
            + (f" | {row['calls']} recorded calls, {step} updates stale" if args.from_calls else "")
            + "".join(f" | {h.name} {show('reward/' + h.name, '.3f')}" for h in hs if len(hs) > 1)
        )
        append_metrics(row)
        unlogged = None
        if eval_due(step + 1):
            evaluate(step + 1)
        if args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1)
    save(args.steps)
except (
    KeyboardInterrupt,
    asyncio.CancelledError,
):  # in step + 1; its update may be applied already (steps_done): --resume goes on from there
    log(f"interrupted in step {step + 1}: saving a checkpoint of step {steps_done} before exiting")
    if unlogged:
        append_metrics(unlogged)
    if worker:
        worker.shutdown(wait=False, cancel_futures=True)
    save(steps_done)
    sys.exit(130)
finally:
    server.stop()
    backend.close()

# ----------------------------------------------------------------------------- the end: the report
if master:
    print(f"wrote {write_report(args.out)[0]}: plots and trajectories, open it in a browser")
    if tb:
        tb.close()
    if wb:
        wb.finish()
if ddp:
    dist.destroy_process_group()
