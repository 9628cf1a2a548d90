"""Our RL step against TRL's GRPOTrainer on the same task, model and settings.

    make setup-trl                              # TRL in its own venv, .venv-trl (once, ~2 min)
    python bench/vs_trl.py --steps 30 --seeds 2 # the full comparison: ~50 min a seed on 2 cores
    python bench/vs_trl.py --first-seed 1 --out runs/vs_trl1    # one more seed, in another session
    python bench/vs_trl.py --table runs/vs_trl/vs_trl.json runs/vs_trl1/vs_trl.json  # both, one table
    python bench/vs_trl.py --smoke              # 2 small steps a side, 4 held-out tasks: for the tests

The task is the instruct demo's (examples/instruct: IFEval-style constraints checked by code, the reward
the fraction met) on the embedded SmolLM2-135M-Instruct in fp32: 4 prompts x 8 rollouts a step, at most 96
new tokens at temperature 0.7, lr 2e-5 after 2 warmup steps, no KL, clip 0.2 / 0.28, the same prompts in
the same order. Our side is train.py itself (this venv's python); TRL's side is this file run again by
.venv-trl's python (--trl-side), where GRPOTrainer calls the harness's own `score` as its reward function
(imported from examples/instruct/harness.py, not copied) on the prompts our `Tasks` draws for each step.
Each side runs in a child process of this script, one after the other.

What it measures, per side (the table's columns):

- step, rollouts, training: the median seconds of a step (over the steps after the first, which warms
  up) and of its two parts. Ours: train.py's metrics.jsonl (t_step, t_rollout, t_train). TRL's: a
  TrainerCallback's on_step_begin..on_step_end, and the time in `_generate_and_score_completions`
  (generation, decoding and the reward); training is the rest of the step (loss, backward, AdamW).
- gen tok/s: the step's generated tokens over its rollouts' seconds (the median step's ratio).
- trained tok/s: the tokens of the step's samples, prompt and completion, one row per sample as
  train.py counts them (its train_tok_s), over the training seconds. Our packed tree forwards fewer
  tokens than that (the group's prompt once); TRL pads every row to the batch's longest.
- peak RSS: the child process's high-water mark of resident memory (wait4's ru_maxrss), model load
  and all.
- held-out reward before and after: one evaluator for both, train.py --steps 0 on the base model and on
  each side's trained weights (the same held-out prompts, the same sampling, seed and reward code);
  +- is the standard error over the held-out tasks. With several seeds the last rows give each side's
  mean gain and its standard deviation over seeds.

Every setting that one side has and the other cannot match is printed before the table. Timings mean
something only on a quiet machine: another process on the 2 cores changes them by several times.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_lite.records import read_jsonl  # noqa: E402

TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")

# The instruct demo's settings (Makefile: demo-instruct) that both sides take. The rest (clip, dual
# clip, warmup, weight decay, gradient clip, advantage, normalization) are read back from our run's
# config.json, so that TRL gets what train.py ran with.
SETTINGS = {"batch_size": 4, "group_size": 8, "max_tokens": 96, "temperature": 0.7, "lr": 2e-5}
# --smoke: two small steps a side and a tiny evaluation, in a few minutes.
SMOKE = {"batch_size": 2, "group_size": 4, "max_tokens": 16, "temperature": 0.7, "lr": 2e-5}
# train.py fails a rollout after --rollout-timeout seconds (300 by default), which a step's 32 rollouts
# can take on a busy 2-core machine; TRL has no such limit, so neither side gets one here.
ROLLOUT_TIMEOUT = "3600"
# AdamW's betas in trainer.py's Learner (not a flag); eps (1e-8) is torch's default on both sides.
BETAS = (0.9, 0.99)

# What differs and cannot be matched: printed before the table. TRL's loss_type "grpo" (each
# completion's token mean, then the mean over completions) is the closest to our default normalization:
# with one sample per rollout, as here, --norm rollout-mean is the same sum.
DIFFERENCES = [
    "generation: ours the embedded backend (continuous batching of the step's rollouts, fast_decode); "
    "TRL's transformers generate() on one left-padded batch of the step's completions",
    "training forward: ours one packed prefix tree (each group's prompt computed once); TRL one "
    "padded row per completion",
    "normalization: ours --norm rollout-mean; TRL loss_type='grpo' (per-completion token mean, then "
    "the mean): the same here, one sample per rollout",
    "advantage: both (r - group mean) / (group std, n-1); eps 1e-6 ours, 1e-4 TRL's",
    "no-signal steps: ours skips the update when every group's rewards are equal; TRL steps anyway "
    "(zero gradients, but AdamW's moments still move the weights)",
    "dual clip: ours --clip-ratio-c 3 (A < 0 and ratio > 3: loss -3A, no gradient); TRL delta=3 "
    "(the ratio clamped at 3 in the unclipped branch), which is the same for A < 0 and inert for A > 0",
    "ratio: ours trainer logprob against the backend's sampled logprob (near 1); TRL's old logprobs "
    "are the trainer's own, detached (exactly 1): no clipping on either side in one on-policy update",
    "warmup: both linear over 2 steps from lr/2 (TRL given our schedule as a LambdaLR: its own "
    "constant_with_warmup starts at 0)",
    "sampling RNG: the same seed, different generators: the same prompts, not the same completions",
    "what a rollout is: ours an OpenAI chat call through the proxy, the reply decoded by the "
    "harness; TRL's completion decoded with skip_special_tokens; both score it with the same function",
]


# ----------------------------------------------------------------------------- running a child


def run_child(cmd: list[str], out: str) -> float:
    """Run ``cmd``, which writes its run folder ``out``, from the repository's root, its output to
    out.log. Returns its peak resident memory in GB (the kernel's high-water mark for the child, from
    wait4); exits with the log's tail if it fails."""
    # A run's folder from an earlier bench is replaced, not appended to.
    shutil.rmtree(out, ignore_errors=True)
    log_path = out + ".log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
        # Popen must not wait for a child that wait4 has reaped.
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(
            f"{' '.join(cmd[:4])} ... failed ({p.returncode}); {log_path} ends:\n{tail}"
        )
    # ru_maxrss is in KiB on Linux.
    return usage.ru_maxrss / 2**20


def ours(settings: dict, steps: int, seed: int, out: str) -> dict:
    """train.py with the demo's settings, no evaluation (the evaluator runs apart). Returns its steps'
    timings and token counts, its peak RSS, its config and where its trained weights are."""
    cmd = [sys.executable, "train.py", "--harness", "instruct"]
    cmd += ["--harness-arg", f"max_tokens={settings['max_tokens']}"]
    cmd += ["--harness-arg", f"temperature={settings['temperature']}"]
    cmd += ["--batch-size", str(settings["batch_size"])]
    cmd += ["--group-size", str(settings["group_size"])]
    cmd += ["--lr", str(settings["lr"]), "--max-concurrency", "32", "--dtype", "fp32"]
    cmd += ["--rollout-timeout", ROLLOUT_TIMEOUT]
    cmd += ["--steps", str(steps), "--seed", str(seed), "--eval-tasks", "0", "--out", out]
    peak = run_child(cmd, out)
    rows = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "t_step" in r]
    step_rows = []
    for r in rows:
        step_rows.append(
            {
                "t_step": r["t_step"],
                "t_rollout": r["t_rollout"],
                "t_train": r["t_train"],
                "gen_tokens": r["response_tokens_mean"] * r["calls"],
                # train.py's train_tok_s is its samples' tokens over t_train (None: update skipped)
                "trained_tokens": (r["train_tok_s"] or 0) * r["t_train"],
                "reward": r["reward"],
                "failed": r["failed"],
                # the update skipped: every group's rewards equal (or a non-finite gradient)
                "no_signal": r["skipped"] is not None,
            }
        )
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    calls = read_jsonl(os.path.join(out, "calls", "step_0.jsonl"))
    first = min(calls, key=lambda c: c["rollout_id"])
    weights = os.path.join(out, "checkpoints", f"step_{steps}")
    return {
        "steps": step_rows,
        "peak_gb": peak,
        "config": config,
        "weights": weights,
        "first_prompt_ids": first["prompt_ids"],
    }


def trl(settings: dict, config: dict, steps: int, seed: int, out: str) -> dict:
    """This file under .venv-trl's python (--trl-side), with our run's resolved settings."""
    spec = out + ".spec.json"
    with open(spec, "w") as f:
        json.dump({"settings": settings, "config": config, "steps": steps, "seed": seed}, f)
    peak = run_child([TRL_PYTHON, os.path.abspath(__file__), "--trl-side", spec, out], out)
    with open(os.path.join(out, "trl.json")) as f:
        got = json.load(f)
    return {**got, "peak_gb": peak, "weights": os.path.join(out, "model")}


def evaluate(model: str, settings: dict, tasks: int, seed: int, out: str) -> tuple[float, float]:
    """train.py --steps 0 on ``model``: the mean held-out reward over the first ``tasks`` test prompts
    and its standard error over them."""
    cmd = [sys.executable, "train.py", "--harness", "instruct", "--model", model]
    cmd += ["--harness-arg", f"max_tokens={settings['max_tokens']}"]
    cmd += ["--harness-arg", f"temperature={settings['temperature']}"]
    cmd += ["--steps", "0", "--eval-tasks", str(tasks), "--max-concurrency", "32"]
    cmd += ["--dtype", "fp32", "--seed", str(seed), "--rollout-timeout", ROLLOUT_TIMEOUT]
    cmd += ["--out", out]
    run_child(cmd, out)
    rewards = [
        r["reward"] or 0.0 for r in read_jsonl(os.path.join(out, "rollouts", "eval_0.jsonl"))
    ]
    # The step-0 checkpoint train.py writes is a copy of ``model``: 0.5 GB each, not kept.
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    se = statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else 0.0
    return statistics.mean(rewards), se


# ----------------------------------------------------------------------------- TRL's side


def trl_side(spec_path: str, out: str):
    """Run in .venv-trl: GRPOTrainer on the steps' prompts, timed; writes trl.json and model/."""
    import torch
    import transformers
    import trl as trl_lib
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from examples.instruct.harness import SYSTEM_PROMPT, score
    from lightning_lite.harness import Tasks
    from lightning_lite.models import cache_dir

    os.makedirs(out, exist_ok=True)
    with open(spec_path) as f:
        spec = json.load(f)
    settings, config, steps, seed = spec["settings"], spec["config"], spec["steps"], spec["seed"]
    base = os.path.join(cache_dir(), "smollm2")
    # The prompts of each step in train.py's order: its Tasks with the same seed and batch size.
    tasks = Tasks(["instruct"], [], settings["batch_size"], settings["group_size"], 0, seed, print)
    rows = []
    for step in range(steps):
        for group in tasks.pick(step):
            task = group[0][1]
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task.prompt},
            ]
            # JSON: a constraint's arg is an int, a string or None, which one Arrow column cannot hold.
            rows.append({"prompt": messages, "constraints": json.dumps(task.answer)})

    def instruct_reward(prompts, completions, constraints, **kwargs):
        """The harness's reward: the fraction of the prompt's constraints the reply meets."""
        return [score(c[0]["content"], json.loads(cs)) for c, cs in zip(completions, constraints)]

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=os.path.join(out, "trainer"),
        per_device_train_batch_size=settings["batch_size"] * settings["group_size"],
        gradient_accumulation_steps=1,
        num_generations=settings["group_size"],
        max_completion_length=settings["max_tokens"],
        temperature=settings["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=settings["lr"],
        max_steps=steps,
        beta=0.0,
        epsilon=config["clip_low"],
        epsilon_high=config["clip_high"],
        delta=config["clip_ratio_c"],
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        max_grad_norm=config["grad_clip"],
        weight_decay=config["weight_decay"],
        shuffle_dataset=False,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    # Our AdamW and schedule: linear warmup from lr / warmup to lr, then constant (trainer.py's lr_at).
    opt = torch.optim.AdamW(
        model.parameters(), settings["lr"], betas=BETAS, weight_decay=config["weight_decay"]
    )
    warmup = config["warmup_steps"]

    def lr_factor(step):
        return (step + 1) / warmup if step < warmup else 1.0

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    timings = []

    class StepTimer(TrainerCallback):
        """A step's wall time: from the batch's arrival to the end of its AdamW step."""

        def on_step_begin(self, args, state, control, **kwargs):
            timings.append({"start": time.perf_counter(), "t_rollout": 0.0})

        def on_step_end(self, args, state, control, **kwargs):
            timings[-1]["t_step"] = time.perf_counter() - timings[-1].pop("start")

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=instruct_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[StepTimer()],
        optimizers=(opt, schedule),
    )
    first_prompt = []
    generate_and_score = trainer._generate_and_score_completions
    generate = trainer._generate_single_turn

    def timed_generate(prompt_ids, *a, **kw):
        if not first_prompt:
            first_prompt.append(list(prompt_ids[0]))
        return generate(prompt_ids, *a, **kw)

    def timed_generate_and_score(inputs):
        # Rollouts: generation, decoding and the reward; what it returns holds the step's tokens.
        t0 = time.perf_counter()
        batch = generate_and_score(inputs)
        timings[-1]["t_rollout"] += time.perf_counter() - t0
        prompt_tokens = batch["prompt_mask"].sum().item()
        completion_tokens = batch["completion_mask"].sum().item()
        timings[-1]["gen_tokens"] = completion_tokens
        timings[-1]["trained_tokens"] = prompt_tokens + completion_tokens
        return batch

    trainer._generate_single_turn = timed_generate
    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    step_rows = []
    for t, logged in zip(timings, [h for h in trainer.state.log_history if "reward" in h]):
        t["t_train"] = t["t_step"] - t["t_rollout"]
        t["reward"] = logged["reward"]
        # every group's rewards equal: TRL steps on zero gradients (ours skips such a step)
        t["no_signal"] = logged["frac_reward_zero_std"] == 1.0
        step_rows.append(t)
    # The trained weights beside the base model's tokenizer, chat template and generation config, so
    # that the evaluator serves them exactly as it serves the base model.
    model_dir = os.path.join(out, "model")
    trainer.model.save_pretrained(model_dir)
    for name in os.listdir(base):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(base, name), model_dir)
    versions = {
        "trl": trl_lib.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(os.path.join(out, "trl.json"), "w") as f:
        json.dump(
            {"steps": step_rows, "first_prompt_ids": first_prompt[0], "versions": versions}, f
        )


# ----------------------------------------------------------------------------- the table


def summary(steps: list[dict]) -> dict:
    """The median step's numbers, over the steps after the first (it warms up) where there are more
    than two."""
    steps = steps[1:] if len(steps) > 2 else steps
    trained = [s for s in steps if s["trained_tokens"] > 0]
    return {
        "t_step": statistics.median(s["t_step"] for s in steps),
        "t_rollout": statistics.median(s["t_rollout"] for s in steps),
        "t_train": statistics.median(s["t_train"] for s in trained) if trained else None,
        "gen_tok_s": statistics.median(s["gen_tokens"] / s["t_rollout"] for s in steps),
        "train_tok_s": (
            statistics.median(s["trained_tokens"] / s["t_train"] for s in trained)
            if trained
            else None
        ),
    }


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def report(data: dict):
    """What matched, every difference, and the table: per seed a row a side, then each side's mean
    gain over seeds (with two or more)."""
    settings, results, versions = data["settings"], data["results"], data["versions"]
    config = results[0]["ours"]["config"]
    same_prompt = all(
        r["ours"]["first_prompt_ids"] == r["trl"]["first_prompt_ids"] for r in results
    )
    print(
        f"\nTRL {versions['trl']}, transformers {versions['transformers']}, torch {versions['torch']}"
    )
    print(
        f"matched: {settings['batch_size']} prompts x {settings['group_size']} rollouts a step, "
        f"{settings['max_tokens']} new tokens at temperature {settings['temperature']} (top-p 1, no "
        f"top-k), lr {settings['lr']} with {config['warmup_steps']} warmup steps then constant, AdamW "
        f"betas {BETAS} eps 1e-8 weight decay {config['weight_decay']}, gradient clip "
        f"{config['grad_clip']}, fp32, no KL, clip {config['clip_low']} / {config['clip_high']}, "
        f"dual clip {config['clip_ratio_c']}, one update a batch, no gradient checkpointing, no "
        "rollout timeout, the "
        "same prompts in the same order (seed by seed)"
    )
    print(f"the first prompt's tokens identical on both sides: {'yes' if same_prompt else 'NO'}")
    print("differences:")
    for d in data["differences"]:
        print(f"- {d}")
    print(
        f"\n{data['steps']} steps a side, {data['seeds']} seed(s), {data['eval_tasks']} held-out "
        f"prompts; {data['minutes']:.0f} min"
    )
    head = "| side | seed | step s | rollouts s | training s | gen tok/s | trained tok/s | peak RSS GB "
    head += "| no-signal steps | held-out before | after | gain |"
    print(head)
    print("|---" * 12 + "|")
    names = {"ours": "ours (train.py)", "trl": f"TRL {versions['trl']}"}
    gains = {"ours": [], "trl": []}
    ratios = []
    for r in results:
        before, before_se = r["before"]
        for side, name in names.items():
            got = r[side]
            s = summary(got["steps"])
            after, after_se = got["eval"]
            gains[side].append(after - before)
            no_signal = sum(step["no_signal"] for step in got["steps"])
            print(
                f"| {name} | {r['seed']} | {fmt(s['t_step'])} | {fmt(s['t_rollout'])} | "
                f"{fmt(s['t_train'])} | {fmt(s['gen_tok_s'])} | {fmt(s['train_tok_s'], '.0f')} | "
                f"{got['peak_gb']:.2f} | {no_signal} | {before:.3f} +- {before_se:.3f} | "
                f"{after:.3f} +- {after_se:.3f} | {after - before:+.3f} |"
            )
        ratios.append(summary(r["trl"]["steps"])["t_step"] / summary(r["ours"]["steps"])["t_step"])
    if len(results) > 1:
        for side, name in names.items():
            g = gains[side]
            cells = " | " * 10
            print(
                f"| {name} | mean of {len(g)}{cells}{statistics.mean(g):+.3f} +- "
                f"{statistics.stdev(g):.3f} (sd) |"
            )
    failed = sum(step.get("failed", 0) for r in results for step in r["ours"]["steps"])
    if failed:
        print(
            f"\nWARNING: {failed} of our rollouts failed (train.py's log says why): not comparable"
        )
    print(f"\nTRL's median step / ours: {', '.join(f'{x:.2f}x' for x in ratios)} (by seed)")


def merged(paths: list[str]) -> dict:
    """The runs of several vs_trl.json files (seeds measured apart, e.g. in two sessions) as one:
    their results one after the other. They must share the task, settings, steps and evaluation."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]
    for path, run in zip(paths, runs):
        for key in ("settings", "steps", "eval_tasks", "versions"):
            if run[key] != first[key]:
                raise SystemExit(
                    f"{path}: its {key} ({run[key]}) differ from {paths[0]}'s ({first[key]}): "
                    "only runs of the same settings make one table"
                )
    data = dict(first)
    data["results"] = [r for run in runs for r in run["results"]]
    seeds = [r["seed"] for r in data["results"]]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"a seed is in two of the files (seeds {seeds}): give each seed once")
    data["seeds"] = len(data["results"])
    data["minutes"] = sum(run["minutes"] for run in runs)
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="RL steps a side")
    ap.add_argument("--seeds", type=int, default=1, help="how many seeds, each side once a seed")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds FIRST..FIRST+N-1")
    ap.add_argument("--eval-tasks", type=int, default=100, help="held-out prompts an evaluation")
    ap.add_argument("--out", default="runs/vs_trl", help="logs, runs and vs_trl.json")
    ap.add_argument("--smoke", action="store_true", help="2 small steps a side: for the tests")
    ap.add_argument(
        "--table", nargs="+", metavar="JSON", help="print the report of saved vs_trl.json files"
    )
    ap.add_argument("--trl-side", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_side:
        trl_side(*a.trl_side)
        return
    if a.table:
        report(merged(a.table))
        return
    if not os.path.exists(TRL_PYTHON):
        raise SystemExit(f"TRL is not installed ({TRL_PYTHON} is missing): run make setup-trl")
    settings = SETTINGS
    if a.smoke:
        settings, a.steps, a.seeds, a.eval_tasks = SMOKE, 2, 1, 4
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    seeds = range(a.first_seed, a.first_seed + a.seeds)
    print(f"settings: {settings}, {a.steps} steps, seeds {list(seeds)}, {a.eval_tasks} held-out")
    results = []
    t_start = time.time()
    for seed in seeds:
        run = os.path.join(out, f"seed{seed}")
        print(f"seed {seed}: evaluating the base model ...", flush=True)
        before = evaluate("smollm2", settings, a.eval_tasks, seed, run + "-eval-base")
        print(f"seed {seed}: train.py ...", flush=True)
        our = ours(settings, a.steps, seed, run + "-ours")
        our["eval"] = evaluate(our["weights"], settings, a.eval_tasks, seed, run + "-eval-ours")
        shutil.rmtree(os.path.join(run + "-ours", "checkpoints"), ignore_errors=True)
        print(f"seed {seed}: TRL ...", flush=True)
        their = trl(settings, our["config"], a.steps, seed, run + "-trl")
        their["eval"] = evaluate(their["weights"], settings, a.eval_tasks, seed, run + "-eval-trl")
        shutil.rmtree(their["weights"], ignore_errors=True)
        results.append({"seed": seed, "before": before, "ours": our, "trl": their})
    data = {
        "settings": settings,
        "steps": a.steps,
        "seeds": a.seeds,
        "eval_tasks": a.eval_tasks,
        "versions": results[0]["trl"]["versions"],
        "differences": DIFFERENCES,
        "results": results,
        "minutes": (time.time() - t_start) / 60,
    }
    path = os.path.join(out, "vs_trl.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    report(data)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
