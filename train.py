"""Harnessed agentic RL in one loop (README: training knobs; docs/training.md).

    python train.py --harness calc                          # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 train.py --harness calc     # DDP: gloo on CPU, NCCL on GPU

Every rank serves the policy through its own proxy and runs its share of the step's tasks. A step:

    tasks.jobs(step, rank, world) -> (rollout id, Task, Harness), each task --group-size times
    run_rollouts(jobs) through the proxy -> RolloutResult each; the proxy records every Call to
        calls/step_K.jsonl, read back from there
    tasks.merge(calls) -> Sample: a rollout's calls merged, loss mask 1 on sampled tokens
    compute_advantages(rewards) -> {rollout id: advantage}, written on each trainable token
    learner.update(samples) -> loss, backward, one AdamW step
    sync_weights() -> the backend serves the new weights; a metrics row -> metrics.jsonl

In --out: config.json, metrics.jsonl, calls/, rollouts/, checkpoints/, report.html
(docs/training.md: the run folder). The optional features are the extras named in EXTRAS below:
each adds its flag group after the core's and fills its seams in lightning_lite/hooks.py. A missing one is skipped, and the
plain path (one harness, the embedded backend, DDP) runs with none of them.
"""

import argparse
import asyncio
import concurrent.futures
import json
import random
import sys
import time

import torch
import torch.distributed as dist

from lightning_lite import algo, hooks, parallel, records
from lightning_lite.backends import HFBackend, bf16_supported
from lightning_lite.harness import CtrlC, Tasks, run_rollouts, settle_rollouts
from lightning_lite.models import load_tokenizer
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import UNANSWERED, read_calls
from lightning_lite.rundir import COUNTED, LOSS_METRICS, RunDir, step_counts, step_line, step_rates
from lightning_lite.rundir import token_rates
from lightning_lite.trainer import MAX_MISMATCH, Learner, TrainConfig
from lightning_lite.samples import for_imitation
from lightning_lite.toolcalls import format_names

# ----------------------------------------------------------------------------- extras
# The extras this script uses, imported in this order: a missing file is skipped, a broken one fails
# loudly. Each fills its seams in lightning_lite/hooks.py, and those with flags add their group to
# the parser below.
EXTRAS = [
    "embedded",  # --model smollm2: the embedded models, converted once
    "fast_decode",  # the embedded backend's decoding at agent-length contexts
    "tool_formats",  # every tool-call format but Hermes
    "grammar",  # forced tool calls and JSON replies constrained to their schema
    "responses",  # the Responses API
    "anthropic",  # the Anthropic Messages API
    "completions",  # the legacy completions API
    "isolation",  # a route of its own per rollout, rewards only from the harness
    "vllm",  # --backend vllm
    "fsdp",  # --parallel fsdp
    "lora",  # --lora RANK
    "harnesses",  # several --harness, with weights
    "from_calls",  # --from-calls: train on recorded calls
    "programs",  # harnesses that are programs (SubprocessHarness)
    "sandbox",  # where a program harness's rollouts run (before audit, which reads it)
    "audit",  # flags from harness patterns and sandbox escapes
    "mismatch",  # prob_corr and the ratio's and |dlogp|'s extremes in metrics.jsonl
    "loggers",  # TensorBoard, W&B
    "recorder",  # per-token records (tokens/step_K.jsonl) and heartbeat.json, for the live page
    "report",  # report.html after the run (it reads recorder's files where the run wrote them)
]
extras = hooks.load_extras(EXTRAS)

# ----------------------------------------------------------------------------- flags
# README: the training knobs; docs/ for each extra's flags.
raw = argparse.RawDescriptionHelpFormatter
parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
group = parser.add_argument_group("run")
group.add_argument(
    "--harness",
    action="append",
    metavar="SPEC[:WEIGHT]",
    help="examples/NAME/harness.py, a .py file or module[:Name]; repeat it, with WEIGHTs",
)
group.add_argument(
    "--harness-arg",
    action="append",
    default=[],
    metavar="K=V",
    help="a keyword argument for the harness ([SPEC:]K=V: for the one SPEC names); repeatable",
)
group.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a model directory")
group.add_argument("--out", default="runs/train", help="the run directory")
group.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --out")
group.add_argument("--seed", type=int, default=0)
group.add_argument("--steps", type=int, default=20)
group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
group.add_argument(
    "--dtype",
    default="auto",
    choices=["auto", "fp32", "bf16"],
    help="auto: bf16 on GPUs; bf16 autocasts over fp32 master weights and AdamW state",
)
group.add_argument(
    "--serve-dtype",
    choices=["fp32", "bf16"],
    help="the sampler's (embedded backend, vLLM servers; default: --dtype's)",
)
group.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps, and last")
group.add_argument("--keep-checkpoints", type=int, default=2, help="the newest N (0: all)")
group = parser.add_argument_group("rollouts")
group.add_argument("--batch-size", type=int, default=8, help="tasks per step, over all ranks")
group.add_argument("--group-size", type=int, default=4, help="rollouts per task (a GRPO group)")
group.add_argument("--max-concurrency", type=int, default=8, help="rollouts in flight per rank")
group.add_argument("--rollout-timeout", type=float, default=300.0, help="seconds, then it fails")
group.add_argument("--max-new-tokens", type=int, default=1024, help="the most one call generates")
group.add_argument("--max-model-len", type=int, help="served context; past the trained: YaRN")
group.add_argument(
    "--max-batch-size",
    type=int,
    default=32,
    help="the embedded backend decodes up to this many requests together",
)
group.add_argument(
    "--backend",
    default="hf",
    choices=["hf", "vllm"],
    help="hf: the embedded backend, in this process; vllm: vLLM servers",
)
group.add_argument(
    "--proxy-host",
    default="127.0.0.1",
    help="the proxies' address (an address other than loopback opens them to that network)",
)
group.add_argument(
    "--pause-retry-after",
    type=float,
    help="during a weight sync, answer new calls 429 with Retry-After this, instead of waiting",
)
group.add_argument("--tool-format", choices=format_names(), help="default: the template's")
group.add_argument(
    "--keep-history-tokens",
    action="store_true",
    help="keep sampled tokens where the template renders a turn otherwise",
)
group.add_argument(
    "--async",
    dest="async_steps",
    type=int,
    nargs="?",
    const=1,
    default=0,
    help="this many next steps' rollouts run while one trains (no value: 1)",
)
group.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps, first, last")
group.add_argument("--eval-tasks", type=int, default=100, help="test tasks an evaluation (0: none)")
# the advantage, the loss, its normalization and the mismatch corrections, each help saying what it
# reduces to, beside the code they choose
algo.add_args(parser)
group = parser.add_argument_group("optimization")
group.add_argument("--lr", type=float, default=1e-5)
group.add_argument("--warmup-steps", type=int, default=2)
group.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
group.add_argument("--weight-decay", type=float, default=0.0)
group.add_argument("--grad-clip", type=float, default=1.0)
group.add_argument(
    "--micro-batch-tokens",
    type=int,
    default=4096,
    help="the most tokens one forward takes, its samples packed as a prefix tree",
)
group.add_argument(
    "--max-seq-len", type=int, help="longer samples cut or dropped (default: context)"
)
group.add_argument("--no-tree", action="store_true", help="one padded row a sample, not packed")
group.add_argument(
    "--attn",
    choices=["sdpa", "eager", "flex_attention"],
    help="the trainer's attention (default: the model's; on a CPU, fast_decode's block_sdpa)",
)
group.add_argument(
    "--parallel",
    default="ddp",
    choices=["ddp", "fsdp"],
    help="ddp: a whole copy on every rank; fsdp: weights, grads, AdamW state sharded",
)
group.add_argument(
    "--dist-timeout",
    type=float,
    default=parallel.DIST_TIMEOUT_MINUTES,
    metavar="MINUTES",
    help="torchrun: a collective fails after this long waiting for a rank (%(default)s)",
)
group.add_argument(
    "--activation-checkpointing",
    nargs="?",
    const="full",
    choices=["full", "selective"],
    help="recompute each layer in backward (full) or only its elementwise ops (selective)",
)
# the extras with flags: each adds its group, and may check its flags once they are parsed (check)
flagged = [extra for extra in extras if hasattr(extra, "add_args")]
for extra in flagged:
    extra.add_args(parser)
# a flag of an extra this copy does not have (--lora of lora.py) is refused naming the file
args = hooks.parse_args(parser, EXTRAS, extras)

# ----------------------------------------------------------------------------- set-up
# DDP under torchrun (NCCL and, for CPU tensors, gloo on GPUs; gloo on CPUs), else one process
ddp, rank, world, device = parallel.init(args.device, args.dist_timeout)
master = rank == 0
cuda = device.type == "cuda"
# The one place each derived default is resolved (config.json records what ran): the loss's clip
# range and C; corrections that cannot apply stop here.
algo.resolve_args(args)
# the most updates between sampling a token and training it (extras/from_calls.py: a run's steps)
args.max_staleness = args.async_steps
if args.dtype == "auto":
    args.dtype = "bf16" if cuda else "fp32"
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
args.serve_dtype = args.serve_dtype or args.dtype
serve_dtype = torch.bfloat16 if args.serve_dtype == "bf16" else torch.float32
if serve_dtype == torch.bfloat16 and not bf16_supported(device):
    sys.exit(f"--serve-dtype bf16: {device} computes no bf16 (a GPU before Ampere): use fp32")
if args.batch_size % world:
    sys.exit(
        f"--batch-size {args.batch_size} does not divide over {world} ranks: use a multiple "
        f"of {world} (GRPO groups stay on one rank)"
    )
if args.attn == "flex_attention" and not cuda:
    sys.exit(
        "--attn flex_attention trains on GPUs: torch has no CPU backward for FlexAttention "
        "(sdpa, the default, runs a packed tree on CPUs)"
    )
if args.kl_coef < 0 or args.group_size < 1 or args.steps < 0:
    sys.exit("--kl-coef must be >= 0, --group-size >= 1 and --steps >= 0")
if args.backend != "hf" and args.backend not in hooks.BACKENDS:
    sys.exit(hooks.missing(f"--backend {args.backend}", args.backend))
if args.parallel != "ddp" and args.parallel not in hooks.PARALLEL:
    sys.exit(hooks.missing(f"--parallel {args.parallel}", args.parallel))
# Each extra checks its own flags and, when they ask for it, fills its seams (--lora: the adapter).
for extra in flagged:
    if hasattr(extra, "check"):
        extra.check(args, ddp, cuda)
# The guard on the served weights (--max-mismatch), by the dtypes in use; off where the sampler's
# logprobs differ by design: sft scores at temperature 1 (extras/from_calls.py: recorded calls may be
# of other weights).
if args.max_mismatch is None:
    pair = "bf16" if "bf16" in (args.dtype, args.serve_dtype) else "fp32"
    args.max_mismatch = MAX_MISMATCH[pair]
    if args.loss == "sft":
        args.max_mismatch = float("inf")
# (--from-calls, which trains without a harness, leaves --harness to name what evaluates)
if args.harness is None:
    args.harness = ["calc"]
torch.manual_seed(args.seed + rank)
random.seed(args.seed + rank)


def log(*a):
    if master:
        print(*a, flush=True)


# ----------------------------------------------------------------------------- model, resume
run = RunDir(args.out, rank, ddp)
tok = load_tokenizer(args.model)
# --from-calls: a step's rollouts are read from recorded runs instead of run (extras/from_calls.py)
recorded = None
if hooks.step_source is not None:
    recorded = hooks.step_source(tok, log)
# one harness (harness.Tasks), or several with weights (extras/harnesses.py)
make_tasks = hooks.tasks or Tasks.from_flags
tasks = make_tasks(args, log)
# --lora (extras/lora.py): the model adapter (the default: none, the whole model trains)
adapter = hooks.adapter
adapter.name_after(tasks)
resume_dir = run.latest_checkpoint() if args.resume else None
if args.resume and not resume_dir:
    log(f"--resume: no checkpoint in {run.checkpoints}, starting from step 0")
learner_config = TrainConfig.from_flags(args)
learner = Learner(
    learner_config, tok, device, dtype, world, master, resume_dir, log, adapter.model_adapter
)
start_step = learner.start_step
# a sample may be as long as the served context
args.max_seq_len = args.max_seq_len or learner.model.config.max_position_embeddings
args.no_tree = learner.config.no_tree
evaluated = run.drop_after(start_step, resumed=bool(resume_dir))
config = {**vars(args), "world_size": world, "start_step": start_step}
log(json.dumps(config, indent=1))
run.start(args, config)

# ----------------------------------------------------------------------------- backend, proxy
if args.backend == "hf":
    # the sampler computes in --serve-dtype (bf16: under autocast), the trainer in --dtype
    backend = HFBackend(
        learner.served, tok, args.max_batch_size, args.max_model_len, dtype=serve_dtype
    )
else:
    backend = hooks.BACKENDS[args.backend](args, learner, resume_dir, device)
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
    # each rollout is served under a route of its own (extras/isolation.py), where there is one
    rollout_tokens=hooks.isolation is not hooks.NoIsolation,
)
server = ProxyServer(proxy, host=args.proxy_host).start()
# e.g. where each program harness's rollouts run (extras/sandbox.py) and what the audit flags
# (extras/audit.py); bad audit patterns fail here
for setup in hooks.ROLLOUT_SETUP:
    setup(tasks.harnesses, args, server, log)
log(proxy.renderer.describe())
log(f"rank 0 proxy at {server.url}")


def rollouts(jobs, name):
    """Run ``jobs`` (rollout id, task, harness) through this rank's proxy; return (results, calls,
    seconds). The calls come back from disk: the proxy keeps none in memory. From here on a call
    reward (POSTed or returned) is keyed by call index, and a rollout carries its flags."""
    proxy.set_output(run.file("calls", name))
    t0 = time.time()
    harness_of = {rid: harness for rid, _, harness in jobs}
    # --lora-per-harness: the adapter that serves each rollout, named as the model of its endpoint
    adapter_of = adapter.route(harness_of)

    def endpoint_for(rid):
        model_name = adapter_of.get(rid, args.model)
        # a sandboxed rollout reaches the proxy through a Unix socket of its own (extras/sandbox.py)
        bridged = getattr(harness_of[rid], "bridged", False)
        return server.endpoint(rid, model_name, socket=bridged)

    results = asyncio.run(
        run_rollouts(
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
    server.close_sockets([rid for rid, _, _ in jobs])
    calls = read_calls(run.file("calls", name))
    # call rewards keyed by index, flags, failed where the backend failed a call
    settle_rollouts(results, calls, proxy, tok.decode)
    proxy.reset()
    return results, calls, time.time() - t0


def step_rollouts(step):
    """This rank's share of the step's task groups, each task --group-size times:
    ({rollout id: its advantage group}, results, calls, seconds)."""
    t0 = time.time()
    if recorded:
        groups, results, calls = recorded.step(step, rank, world, args.batch_size, tasks.draw)
        # written as a harness step's are: the report shows them, a later run reads them
        records.write_jsonl(run.file("calls", f"step_{step}"), calls)
        return groups, results, calls, time.time() - t0
    jobs, groups = tasks.jobs(step, rank, world)
    results, calls, seconds = rollouts(jobs, f"step_{step}")
    return groups, results, calls, seconds


# --async: step -> the future of its rollouts, run in step order by one worker thread
ahead = {}
worker = None
if args.async_steps:
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")


def evaluate(step):
    """Each harness's test split once; its row (eval_reward, eval_success, ...) to metrics.jsonl."""
    if not any(tasks.test.values()):
        return
    hooks.progress("phase", phase="eval", step=step)
    # --async: the proxy records one run at a time
    concurrent.futures.wait(ahead.values())
    # each task's calls sample with its seed: the same draws at every evaluation (Tasks.eval_jobs)
    jobs, proxy.seeds = tasks.eval_jobs(step, rank, world)
    results, _, secs = rollouts(jobs, f"eval_{step}")
    proxy.seeds = {}
    run.save_rollouts(f"eval_{step}", results, {})
    row = {"step": step, **tasks.eval_row(results, secs)}
    log(
        f"eval @ step {step}: reward {row['eval_reward']:.3f}  success {row['eval_success']:.3f} "
        f"over {row['eval_tasks']} tasks ({secs:.0f}s)" + tasks.by_harness(row, "eval_reward")
    )
    run.append_metrics(row)


def make_samples(results, calls):
    """Each finished rollout's calls merged into samples, and the merge statistics."""
    finished = {r.rollout_id for r in results if r.error is None}
    its_calls = [c for c in calls if c.rollout_id in finished]
    # each harness's apart where there are several (extras/harnesses.py: its merge statistics)
    samples, stats = tasks.merge(results, its_calls, args.max_seq_len)
    if args.loss == "sft":
        samples = for_imitation(samples)
    return samples, stats


def advantages(groups, results, calls):
    """{rollout id: advantage, or {call index: advantage}} of this rank's finished rollouts:
    GRPO-style within each task group (all ranks' rewards), or per call. sft: 1 for what it should
    imitate."""
    finished = {r.rollout_id: r.reward for r in results if r.error is None}
    if args.loss == "sft":
        return algo.imitation_advantages(finished, args.sft_min_reward), {}
    answered = {}
    for c in calls:
        if c.finish_reason not in UNANSWERED:
            answered.setdefault(c.rollout_id, []).append(c.index)
    call_rewards = {r.rollout_id: r.call_rewards for r in results if r.rollout_id in finished}
    group_of = {rid: groups[rid] for rid in finished}
    # every rank's, so that a group's baseline is its whole group's
    rewards, group_of, call_rewards, answered = algo.gather_rewards(
        finished, group_of, call_rewards, answered
    )
    return algo.compute_advantages(
        rewards,
        group_of,
        args.adv,
        gamma=args.gamma,
        drop_zero_variance=args.drop_zero_variance,
        call_rewards=call_rewards,
        calls=answered,
    )


def sync_weights(version):
    """The backend serves the trained weights (every rank calls it: a collective). Calls in flight
    finish on the old weights; new calls wait, then get the new ones. What it gets is the backend's
    choice (``payload``): the embedded backend serves the module itself, or copies what training
    changed into its own copy; vLLM gets the whole model, or under --lora the adapters alone."""
    payload = backend.payload(learner)
    backend.pause()
    # every rank's calls have finished before anything reloads (vLLM servers are shared)
    parallel.barrier()
    backend.sync_weights(payload, version=version)
    parallel.barrier()
    backend.resume()


# ----------------------------------------------------------------------------- the loop
def log_step(row, step):
    """The step's line (README: reading a log line): rundir.step_line's, then what this run adds."""
    line = step_line(row)
    if worker:
        line += f" | waited {row['t_wait']:.1f}s, tokens by staleness {row['staleness']}"
    if recorded:
        line += f" | {row['calls']} recorded calls, {step} updates stale"
    # each harness's reward, and its loss where each has one (--lora-per-harness: its adapter's)
    line += tasks.by_harness(row, "reward", "loss")
    log(line)


def eval_due(k):
    return k in (0, args.steps) or (args.eval_every > 0 and k % args.eval_every == 0)


# A Ctrl-C cancels the rollouts in flight and is checked at every step (harness.CtrlC).
ctrl_c = CtrlC()
# steps_done: the steps whose update is applied (or skipped), what a checkpoint holds
step = start_step
steps_done = start_step
# the step's metrics row while it is not in metrics.jsonl (a Ctrl-C writes it)
unlogged = None
try:
    if backend.first_sync:
        # the backend may serve other weights than the trained ones (vLLM servers a user started)
        sync_weights(start_step)
    if eval_due(start_step) and start_step not in evaluated:
        evaluate(start_step)
    for step in range(start_step, args.steps):
        if ctrl_c.pressed:
            raise KeyboardInterrupt
        t_step = time.time()
        # what the run is doing, as it happens (hooks.PROGRESS: the report's heartbeat.json)
        hooks.progress("phase", phase="rollouts", step=step)
        # 1. rollouts. Under --async N those of the next N steps start now, in the background:
        # step s's once version s - N is served, so no trained token is more than N updates old.
        if worker:
            last_ahead = min(step + args.async_steps, args.steps - 1)
            for s in range(step, last_ahead + 1):
                if s not in ahead:
                    ahead[s] = worker.submit(step_rollouts, s)
            groups, results, calls, t_roll = ahead.pop(step).result()
        else:
            groups, results, calls, t_roll = step_rollouts(step)
        t_wait = time.time() - t_step
        # 2. samples: each finished rollout's calls merged (a failed rollout is never trained on)
        samples, merge_stats = make_samples(results, calls)
        # 3. advantages, written on each trainable token; zero ones stay (they count in the
        # denominators)
        adv, adv_stats = advantages(groups, results, calls)
        samples = algo.assign_advantages(samples, adv)
        run.save_rollouts(f"step_{step}", results, adv)
        # the step's sums over every rank (rollouts, tokens, rewards, merge statistics)
        sums = step_counts(results, calls, samples, merge_stats, algo.all_reduce)
        if sums["dropped"]:
            dropped = int(sums["dropped"])
            log(f"step {step + 1}: {dropped} samples dropped: a first turn > --max-seq-len")
        # 4-6. loss and backward, optimizer step
        t0 = time.time()
        # No generation while the weights change (under --async the backend serves its own copy),
        # and the backend frees what training needs (--vllm-sleep).
        if not worker:
            backend.pause()
        backend.make_room()
        t_sleep = time.time() - t0
        t0 = time.time()
        # something to learn from: an advantage, or the KL term on any sample
        has_signal = sums["signal"] > 0 or (sums["samples"] > 0 and args.kl_coef > 0)
        if adapter.trains_apart:
            # each harness's adapter on its own samples, all in one pass (metrics as KEY/NAME)
            metrics, grad_norm, skipped = adapter.update(learner, samples, results, step)
        else:
            metrics, grad_norm, skipped = learner.update(samples, step, has_signal)
        t_train = time.time() - t0
        row = {
            "step": step + 1,
            **step_rates(sums),
            # each harness's, where there are several (extras/harnesses.py): KEY/NAME
            **tasks.harness_columns(results, calls),
            **{k: int(sums[k]) for k in COUNTED},
            **{k: metrics.get(k) for k in LOSS_METRICS},
            # per adapter (--lora-per-harness): KEY/NAME
            **{k: v for k, v in metrics.items() if "/" in k},
            "staleness": metrics.get("staleness", {}),
            "dlogp_by_staleness": metrics.get("dlogp_by_staleness", {}),
            "skipped": skipped,
            "zero_var_groups": adv_stats.get("zero_variance_groups", 0),
            "grad_norm": grad_norm,
            "lr": learner.lr_at(step),
            "t_rollout": round(t_roll, 2),
            "t_wait": round(t_wait, 2),
            "t_train": round(t_train, 2),
            "t_sleep": round(t_sleep, 3),
            "t_sync": None,
            "t_step": None,
            **token_rates(sums, t_roll, t_train, world, not recorded, trained=bool(metrics)),
        }
        # the update is applied (or skipped): a checkpoint from now on is of step + 1
        unlogged = row
        steps_done = step + 1
        # 7. weight sync
        t0 = time.time()
        hooks.progress("phase", phase="sync", step=step)
        sync_weights(step + 1)
        row["t_sync"] = round(time.time() - t0, 3)
        row["t_step"] = round(time.time() - t_step, 2)
        if cuda:
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        # 8. log: one line a step (README: reading a log line), one metrics row
        log_step(row, step)
        run.append_metrics(row)
        unlogged = None
        if eval_due(step + 1):
            evaluate(step + 1)
        if args.save_every and (step + 1) % args.save_every == 0:
            learner.save(step + 1, run, vars(args))
    learner.save(args.steps, run, vars(args))
except (KeyboardInterrupt, asyncio.CancelledError):
    # in step + 1, whose update may be applied already (steps_done): --resume goes on from there
    log(f"interrupted in step {step + 1}: saving a checkpoint of step {steps_done} before exiting")
    if unlogged:
        run.append_metrics(unlogged)
    if worker:
        worker.shutdown(wait=False, cancel_futures=True)
    learner.save(steps_done, run, vars(args))
    sys.exit(130)
finally:
    server.stop()
    backend.close()

# ----------------------------------------------------------------------------- after the run
if master:
    # e.g. report.html (extras/report.py)
    for after in hooks.AFTER_RUN:
        after(args.out)
    run.close()
if ddp:
    dist.destroy_process_group()
