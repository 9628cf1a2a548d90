"""Harnessed agentic RL in one loop (README: Training).

    python train.py --harness calc                          # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 train.py --harness calc     # DDP: gloo on CPU, NCCL on GPU

Every rank serves the policy through its own proxy and runs its share of the step's tasks:

    rollouts -> samples -> advantages -> loss + backward -> optimizer step -> weight sync -> log

In --out: config.json, metrics.jsonl, calls/, rollouts/, checkpoints/, report.html (README: the run
directory). The optional features (lightning_lite/extras/) add their flag groups after the core's.
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist

from lightning_lite import algo, parallel, records
from lightning_lite.backends import HFBackend
from lightning_lite.extras import audit, from_calls, fsdp, harnesses, loggers, lora, sandbox, vllm
from lightning_lite.harness import fail_rollouts_the_backend_failed, resolve_call_rewards
from lightning_lite.harness import run_rollouts
from lightning_lite.models import load_tokenizer
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import UNANSWERED, read_calls
from lightning_lite.rundir import COUNTED, LOSS_METRICS, RunDir, step_counts, step_rates
from lightning_lite.trainer import Learner
from lightning_lite.samples import build_batch_samples
from lightning_lite.toolcalls import FORMATS

# ----------------------------------------------------------------------------- flags
# what the longer help texts say (README: the training knobs; docs/ for each extra's)
HARNESS_HELP = "examples/NAME/harness.py, a .py file or module[:Name]; repeat it, with WEIGHTs"
ARG_HELP = "a keyword argument for the harness ([SPEC:]K=V: for the one SPEC names); repeatable"
DTYPE_HELP = "auto: bf16 on GPUs; bf16 autocasts over fp32 master weights and AdamW state"
HISTORY_HELP = "keep sampled tokens where the template renders a turn otherwise"
LOSS_HELP = "ppo: clipped token ratio; gspo: sequence ratio; tis: truncated IS; sft: imitate"
ASYNC_HELP = "this many next steps' rollouts run while one trains (no value: 1)"
PARALLEL_HELP = "ddp: all whole on every rank; fsdp: weights, grads, AdamW state sharded"
raw = argparse.RawDescriptionHelpFormatter
parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
group = parser.add_argument_group("run")
group.add_argument("--harness", action="append", metavar="SPEC[:WEIGHT]", help=HARNESS_HELP)
group.add_argument("--harness-arg", action="append", default=[], metavar="K=V", help=ARG_HELP)
group.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a model directory")
group.add_argument("--out", default="runs/train", help="the run directory")
group.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --out")
group.add_argument("--seed", type=int, default=0)
group.add_argument("--steps", type=int, default=20)
group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
group.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help=DTYPE_HELP)
group.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps, and last")
group.add_argument("--keep-checkpoints", type=int, default=2, help="the newest N (0: all)")
group = parser.add_argument_group("rollouts")
group.add_argument("--batch-size", type=int, default=8, help="tasks per step, over all ranks")
group.add_argument("--group-size", type=int, default=4, help="rollouts per task (a GRPO group)")
group.add_argument("--max-concurrency", type=int, default=8, help="rollouts in flight per rank")
group.add_argument("--rollout-timeout", type=float, default=300.0, help="seconds, then it fails")
group.add_argument("--max-new-tokens", type=int, default=1024, help="the most one call generates")
group.add_argument("--max-model-len", type=int, help="served context; past the trained: YaRN")
group.add_argument("--max-batch-size", type=int, default=32, help="hf: requests decoded together")
group.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="hf: in this process")
group.add_argument("--proxy-host", default="127.0.0.1", help="not loopback: open to that network")
group.add_argument("--pause-retry-after", type=float, help="weight sync: 429 with this, not wait")
group.add_argument("--tool-format", choices=FORMATS, help="default: detected from the template")
group.add_argument("--keep-history-tokens", action="store_true", help=HISTORY_HELP)
group.add_argument(
    "--async", dest="async_steps", type=int, nargs="?", const=1, default=0, help=ASYNC_HELP
)
group.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps, first, last")
group.add_argument("--eval-tasks", type=int, default=100, help="test tasks an evaluation (0: none)")
group = parser.add_argument_group("algorithm (README: the tables)")
group.add_argument("--adv", default="grpo", choices=algo.ESTIMATORS, help="advantage estimator")
group.add_argument("--gamma", type=float, default=1.0, help="--adv returns: discount per call")
group.add_argument("--drop-zero-variance", action="store_true", help="drop groups of equal rewards")
group.add_argument("--loss", default="ppo", choices=algo.LOSSES, help=LOSS_HELP)
group.add_argument("--sft-min-reward", type=float, help="sft: imitate rollouts rewarded >= this")
group.add_argument("--norm", default="rollout-mean", choices=algo.NORMS, help="normalization")
group.add_argument("--norm-const", type=float, help="Dr. GRPO's C (default: --max-new-tokens)")
group.add_argument("--clip-low", type=float, help="ratio clip below 1 (ppo 0.2, gspo 3e-4)")
group.add_argument("--clip-high", type=float, help="ratio clip above 1 (ppo 0.28, gspo 4e-4)")
group.add_argument("--clip-ratio-c", type=float, default=3.0, help="dual clip (inf: off)")
group.add_argument("--tis-cap", type=float, default=2.0, help="--loss tis: the IS weight's cap")
group.add_argument("--kl-coef", type=float, default=0.0, help="KL to the initial model (0: off)")
group = parser.add_argument_group("optimization")
group.add_argument("--lr", type=float, default=1e-5)
group.add_argument("--warmup-steps", type=int, default=2)
group.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"])
group.add_argument("--weight-decay", type=float, default=0.0)
group.add_argument("--grad-clip", type=float, default=1.0)
group.add_argument("--micro-batch-tokens", type=int, default=4096, help="a forward's (packed)")
group.add_argument(
    "--max-seq-len", type=int, help="longer samples cut or dropped (default: context)"
)
group.add_argument("--no-tree", action="store_true", help="one padded row a sample, not packed")
group.add_argument("--attn", choices=["sdpa", "eager", "flex_attention"], help="the trainer's")
group.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help=PARALLEL_HELP)
group.add_argument("--activation-checkpointing", action="store_true", help="memory for compute")
for extra in (harnesses, from_calls, vllm, fsdp, lora, sandbox, loggers):
    extra.add_args(parser)
args = parser.parse_args()

# ----------------------------------------------------------------------------- set-up
# the one place each derived default is resolved (config.json records what ran)
args.clip_low, args.clip_high = algo.clip_range(args.loss, args.clip_low, args.clip_high)
args.norm_const = args.norm_const or args.max_new_tokens
args.harness = args.harness or ([] if args.from_calls else ["calc"])

ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
master = rank == 0
cuda = args.device == "cuda"
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else args.device)
if cuda:
    torch.cuda.set_device(device)
args.dtype = args.dtype if args.dtype != "auto" else "bf16" if cuda else "fp32"
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
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
for extra in (harnesses, from_calls, vllm, fsdp, lora):
    extra.check(args, ddp, cuda)
torch.manual_seed(args.seed + rank)
random.seed(args.seed + rank)


def log(*a):
    if master:
        print(*a, flush=True)


# ----------------------------------------------------------------------------- model, resume
run = RunDir(args.out, rank, ddp)
tok = load_tokenizer(args.model)
load_args = (args.from_calls, args.model, len(tok), args.loss, args.adv, args.sft_min_reward, log)
recorded = from_calls.load(*load_args) if args.from_calls else None
tasks = harnesses.Tasks(args, log)
# --lora-per-harness: the adapters' names
args.lora_per_harness = args.lora_per_harness and tasks.names()
resume_dir = run.latest_checkpoint() if args.resume else None
if args.resume and not resume_dir:
    log(f"--resume: no checkpoint in {run.checkpoints}, starting from step 0")
lora.check_resume(args, resume_dir)
learner = Learner(args, tok, device, dtype, world, master, resume_dir, log)
model, start_step = learner.model, learner.start_step
# what can be served can be trained on
args.max_seq_len = args.max_seq_len or model.config.max_position_embeddings
evaluated = run.drop_after(start_step, resumed=bool(resume_dir))
config = {**vars(args), "world_size": world, "start_step": start_step}
log(json.dumps(config, indent=1))
if master:
    json.dump(config, open(os.path.join(args.out, "config.json"), "w"), indent=1)
metrics = loggers.Loggers(args, config) if master else None

# ----------------------------------------------------------------------------- backend, proxy, harnesses
if args.backend == "vllm":
    backend = vllm.start(args, model.config, dtype, resume_dir, device)
else:
    backend = HFBackend(learner.served, tok, args.max_batch_size, args.max_model_len, dtype=dtype)
backend.version = start_step
# each rollout is served under a token of its own (extras/isolation.py)
proxy_flags = ("max_new_tokens", "pause_retry_after", "tool_format", "keep_history_tokens")
proxy_options = {k: getattr(args, k) for k in proxy_flags} | dict(call_timeout=args.rollout_timeout)
proxy = Proxy(backend, tok, model_name=args.model, rollout_tokens=True, **proxy_options)
server = ProxyServer(proxy, host=args.proxy_host).start()
# where each harness's rollouts run, and what is flagged on them (bad audit patterns fail here)
sandbox_of = sandbox.setup(tasks.harnesses, args.sandbox, args.sandbox_image, args.out, log)
auditor = audit.Auditor(tasks.harnesses, sandbox_of, args.out, server.port)
log(proxy.renderer.describe())
log(f"rank 0 proxy at {server.url}")


def rollouts(jobs, name):
    """Run ``jobs`` (rollout id, task, harness) through this rank's proxy; return (results, calls,
    seconds). Calls come back from disk (the proxy keeps none in memory); call rewards, POSTed or
    returned, are keyed by call index from here on; flagged rollouts as their harness says."""
    proxy.set_output(run.file("calls", name))
    t0 = time.time()
    harness_of = {rid: h.name for rid, _, h in jobs}
    # --lora-per-harness: each rollout served by its harness's adapter, which its endpoint names
    backend.adapter_of = harness_of.get if args.lora_per_harness else None

    def endpoint_for(rid):
        # a token in the URL only this rollout knows; a sandboxed one gets a Unix socket of its own
        bridged = sandbox_of[harness_of[rid]] in sandbox.BRIDGED
        model = harness_of[rid] if args.lora_per_harness else args.model
        return server.endpoint(rid, model, socket=bridged)

    options = dict(posted_reward=proxy.reward, desc=name.replace("_", " "), progress=master)
    limits = args.max_concurrency, args.rollout_timeout
    results = asyncio.run(run_rollouts(jobs, endpoint_for, *limits, **options))
    proxy.set_output(None)
    server.close_sockets([rid for rid, *_ in jobs])
    calls = read_calls(run.file("calls", name))
    calls_of = {}
    for c in calls:
        calls_of.setdefault(c.rollout_id, []).append(c)
    resolve_call_rewards(results, calls_of, proxy.call_rewards)
    # what the proxy refused a rollout (another's route, a reward of its own), what the audit found
    auditor.flag(results, calls_of, proxy.flags, tok.decode)
    proxy.reset()
    fail_rollouts_the_backend_failed(results, calls)
    return results, calls, time.time() - t0


def step_rollouts(step):
    """This rank's share of the step's task groups, each task --group-size times:
    ({rollout id: its advantage group}, results, calls, seconds)."""
    if recorded:
        t0 = time.time()
        groups, results, calls = recorded.step(step, rank, world, args.batch_size, tasks.draw)
        # as a harness step's: the report shows them, a later run reads them
        records.write_jsonl(run.file("calls", f"step_{step}"), calls)
        return groups, results, calls, time.time() - t0
    jobs, groups = [], {}
    for i, group in enumerate(tasks.pick(step)[rank::world]):
        for g, (h, task, group_id) in enumerate(group):
            jobs.append((f"s{step}-r{rank}-t{i}-g{g}", task, h))
            groups[jobs[-1][0]] = group_id
    return groups, *rollouts(jobs, f"step_{step}")


ahead = {}  # --async: step -> its rollouts, run in step order by one worker thread
worker = None
if args.async_steps:
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")


def evaluate(step):
    """Each harness's test split once; its row (eval_reward, eval_success, ...) to metrics.jsonl."""
    every = tasks.test_jobs()
    if not every:
        return
    # --async: the proxy records one run at a time
    concurrent.futures.wait(ahead.values())
    jobs = [(f"eval{step}-r{rank}-{i}", t, h) for i, (h, t) in enumerate(every[rank::world])]
    results, _, secs = rollouts(jobs, f"eval_{step}")
    run.save_rollouts(f"eval_{step}", results, {})
    row = {"step": step, **tasks.eval_row(results, secs)}
    log(
        f"eval @ step {step}: reward {row['eval_reward']:.3f}  success {row['eval_success']:.3f} over "
        f"{row['eval_tasks']} tasks ({secs:.0f}s)" + tasks.by_harness(row, "eval_reward")
    )
    run.append_metrics(row, metrics)


def make_samples(results, calls):
    """Each finished rollout's calls merged into samples, by harness (each one's merge counts)."""
    finished = {r.rollout_id for r in results if r.error is None}
    harness_of = {r.rollout_id: r.harness for r in results}
    samples, stats = [], {}
    for name in dict.fromkeys(harness_of.values()):
        mine = [c for c in calls if harness_of[c.rollout_id] == name and c.rollout_id in finished]
        got, stats[name] = build_batch_samples(mine, args.max_seq_len)
        samples += got
    for s in samples if args.loss == "sft" else ():
        # -logprob under the model's own softmax, and without a grammar's mask: the model learns
        # to write what the sampler's settings or a grammar made it write
        n = len(s.tokens)
        s.temperature, s.top_k, s.top_p, s.grammars = [1.0] * n, [0] * n, [1.0] * n, {}
    for s in samples if recorded else ():
        # sampled before this run began: by its version 0, `step` updates ago
        s.version = [0] * len(s.tokens)
    return samples, stats


def advantages(groups, results, calls):
    """{rollout id: advantage, or {call index: advantage}} of this rank's finished rollouts: GRPO-style
    within each task group (all ranks' rewards), or per call. sft: 1 for what it should imitate."""
    finished = {r.rollout_id: r.reward for r in results if r.error is None}
    if args.loss == "sft":
        keep = lambda x: args.sft_min_reward is None or x is not None and x >= args.sft_min_reward
        return {rid: 1.0 for rid, x in finished.items() if keep(x)}, {}
    answered = {}
    for c in calls:
        if c.finish_reason not in UNANSWERED:
            answered.setdefault(c.rollout_id, []).append(c.index)
    call_rewards = {r.rollout_id: r.call_rewards for r in results if r.rollout_id in finished}
    rewards, group_of, call_rewards, answered = algo.gather_rewards(
        finished, {rid: groups[rid] for rid in finished}, call_rewards, answered
    )
    kw = dict(drop_zero_variance=args.drop_zero_variance, call_rewards=call_rewards, calls=answered)
    return algo.compute_advantages(rewards, group_of, args.adv, gamma=args.gamma, **kw)


def sync_weights(version):
    """The backend serves the trained weights (every rank calls it: a collective). Calls in flight
    finish on the old weights, new calls wait, then get the new ones. vLLM gets them whole (FSDP:
    gathered into rank 0's host memory; --lora: the adapters alone); the embedded backend serves the
    module itself, or copies what training changes into its own copy (--lora: every adapter; FSDP's
    shards gathered one at a time)."""
    served = model
    if args.backend == "vllm" and args.lora:
        served = lora.adapters(model, dtype)
    elif args.backend == "vllm":
        served = parallel.full_state_dict(model, args.parallel)
    elif learner.served is not model:
        # the embedded backend's own copy gets what training changes
        served = learner.trained
    backend.pause()
    # every rank's calls have finished before anything reloads (vLLM servers are shared)
    if ddp:
        dist.barrier()
    backend.sync_weights(served, version=version)
    if ddp:
        dist.barrier()
    backend.resume()


def save(step):
    if path := learner.save(step, run, vars(args)):
        log(f"saved {path}")


# ----------------------------------------------------------------------------- the loop
def log_step(row, step):
    """The step's line (README: reading a log line); '-' is not measured."""
    show = lambda k, spec: "-" if row[k] is None else format(row[k], spec)
    waited = f" | waited {row['t_wait']:.1f}s, tokens by staleness {row['staleness']}"
    log(
        f"step {step + 1:4d} | reward {show('reward', '.3f')} succ {show('success', '.2f')} | "
        f"fail {row['failed']} | samples {row['samples']} tok {row['trainable_tokens']} "
        f"fwd {show('fwd_tokens', 'd')} merge {show('merge_ratio', '.2f')}x | "
        f"loss {show('loss', '+.4f')} gnorm {show('grad_norm', '.3f')} clip {show('clip_frac', '.3f')} "
        f"|dlogp| {show('dlogp_mean', '.4f')} | roll {row['t_rollout']:.1f}s ({show('gen_tok_s', '.0f')} tok/s) "
        f"train {row['t_train']:.1f}s ({show('train_tok_s', '.0f')} tok/s) sync {row['t_sync']:.2f}s"
        + (waited if worker else "")
        + (f" | {row['calls']} recorded calls, {step} updates stale" if recorded else "")
        + tasks.by_harness(row, "reward")
        + (" | loss" + tasks.by_harness(row, "loss") if args.lora_per_harness else "")
    )


def make_room_for_training():
    """No generation while the weights change (--async: the backend serves its own copy), and vLLM
    servers on the training GPUs free their memory (--vllm-sleep). Returns the seconds it took."""
    t0 = time.time()
    if not worker:
        backend.pause()
    if args.backend == "vllm" and args.vllm_sleep and master:
        backend.sleep()
    return time.time() - t0


def eval_due(k):
    return k in (0, args.steps) or (args.eval_every > 0 and k % args.eval_every == 0)


# A Ctrl-C marks the run interrupted and is checked at every step too: Python drops a
# KeyboardInterrupt raised while a finalizer runs (a run once went on for 20 steps).
interrupted = False


def on_ctrl_c(signum, frame):
    global interrupted
    interrupted = True
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    # in the rollouts' event loop: cancel them (their clients close), as asyncio.run would;
    # then wake its select(), which the signal does not end
    for t in asyncio.all_tasks(loop):
        t.cancel()
    loop.call_soon_threadsafe(lambda: None)


signal.signal(signal.SIGINT, on_ctrl_c)
# steps_done: steps whose update is applied (or skipped), what a checkpoint holds; unlogged: its
# metrics row while it is not in metrics.jsonl (a Ctrl-C writes it)
step = steps_done = start_step
unlogged = None
try:
    if args.backend == "vllm" and (args.vllm_url or args.lora):
        # servers a user started may serve other weights (a previous run's, before --resume); --lora's
        # serve the base model until they load the adapter
        sync_weights(start_step)
    if eval_due(start_step) and start_step not in evaluated:
        evaluate(start_step)
    for step in range(start_step, args.steps):
        if interrupted:
            raise KeyboardInterrupt
        t_step = time.time()
        # 1. rollouts. Under --async N those of the next N steps start now, in the background:
        # step s's once version s - N is served, so no trained token is more than N updates old.
        for s in range(step, min(step + args.async_steps, args.steps - 1) + 1) if worker else ():
            ahead[s] = ahead.get(s) or worker.submit(step_rollouts, s)
        groups, results, calls, t_roll = ahead.pop(step).result() if worker else step_rollouts(step)
        t_wait = time.time() - t_step
        # 2. samples: each finished rollout's calls merged (a failed rollout is never trained on)
        samples, merge_stats = make_samples(results, calls)
        # 3. advantages, written on each trainable token; zero ones stay (they count in the denominators)
        adv, adv_stats = advantages(groups, results, calls)
        samples = algo.assign_advantages(samples, adv)
        run.save_rollouts(f"step_{step}", results, adv)
        n = step_counts(results, calls, samples, merge_stats, tasks.names(), algo.all_reduce)
        if n["dropped"]:
            log(
                f"step {step + 1}: {int(n['dropped'])} samples dropped: a first turn > --max-seq-len"
            )
        # 4-6. loss and backward, optimizer step
        t_sleep = make_room_for_training()
        t0 = time.time()
        has_signal = n["signal"] > 0 or (n["samples"] > 0 and args.kl_coef > 0)
        if args.lora_per_harness:
            # each harness's adapter on its own samples, all in one pass (metrics as KEY/NAME)
            m, gnorm, skipped = lora.update_all(learner, samples, results, step, tasks.names())
        else:
            m, gnorm, skipped = learner.update(samples, step, has_signal)
        t_train = time.time() - t0
        row = {
            "step": step + 1,
            **step_rates(n, tasks.names()),
            **{k: int(n[k]) for k in COUNTED},
            **{k: m.get(k) for k in LOSS_METRICS},
            **{k: v for k, v in m.items() if "/" in k},
            "staleness": m.get("staleness", {}),
            "dlogp_by_staleness": m.get("dlogp_by_staleness", {}),
            "skipped": skipped,
            "zero_var_groups": adv_stats.get("zero_variance_groups", 0),
            "grad_norm": gnorm,
            "lr": learner.lr_at(step),
            "t_rollout": round(t_roll, 2),
            "t_wait": round(t_wait, 2),
            "t_train": round(t_train, 2),
            "t_sleep": round(t_sleep, 3),
            "t_sync": None,
            "t_step": None,
            # None: not measured (recorded calls were not generated here)
            "gen_tok_s": None if recorded else n["gen"] / max(t_roll, 1e-9) / world,
            "train_tok_s": n["kept_tokens"] / (t_train * world) if m and t_train else None,
        }
        # the update is applied (or skipped): a checkpoint from now on is of step + 1
        unlogged, steps_done = row, step + 1
        # 7. weight sync
        t0 = time.time()
        if args.backend == "vllm" and args.vllm_sleep and cuda:
            # what training freed goes back to the GPU before the servers wake
            torch.cuda.empty_cache()
        sync_weights(step + 1)
        row.update(t_sync=round(time.time() - t0, 3), t_step=round(time.time() - t_step, 2))
        if cuda:
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        # 8. log: one line a step (README: reading a log line), one metrics row
        log_step(row, step)
        run.append_metrics(row, metrics)
        unlogged = None
        if eval_due(step + 1):
            evaluate(step + 1)
        if args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1)
    save(args.steps)
except (KeyboardInterrupt, asyncio.CancelledError):
    # in step + 1, whose update may be applied already (steps_done): --resume goes on from there
    log(f"interrupted in step {step + 1}: saving a checkpoint of step {steps_done} before exiting")
    if unlogged:
        run.append_metrics(unlogged, metrics)
    if worker:
        worker.shutdown(wait=False, cancel_futures=True)
    save(steps_done)
    sys.exit(130)
finally:
    server.stop()
    backend.close()

# ----------------------------------------------------------------------------- the report
if master:
    from lightning_lite.extras.report import write_report

    print(f"wrote {write_report(args.out)[0]}: plots and trajectories, open it in a browser")
    metrics.close()
if ddp:
    dist.destroy_process_group()
