"""Training-phase cost with and without tree packing, on the embedded model: tokens through the model (fwd_tokens)
and wall-clock seconds of forward + backward of the policy loss, the same samples both ways.

    python bench/train_step.py [--calc CALLS.jsonl] [--search CALLS.jsonl] [--micro-batch-tokens 4096] [--repeat 1]
    python bench/train_step.py --smoke     # one rollout per workload, 2 qwen3 turns: for the tests

Three workloads, side by side:

  calc     GRPO groups of the calc agent (examples/calc: tool calls, several turns): a group's samples share the
           system prompt, tool schema and question. Recorded by one train.py step (--record-tasks 2 tasks of
           --record-group 4 rollouts: its --batch-size and --group-size) unless --calc names a calls.jsonl.
  search   the search agent with context compaction (examples/search, context_budget=1): each compaction rewrites
           the history, so a rollout is two leaves that share the system prompt and question. Recorded likewise.
  qwen3    synthetic: rollouts of --turns turns under a Qwen3-style template that strips each turn's reasoning from
           the history, so every call starts a new leaf that repeats the whole history before it (K leaves, O(K^2)
           tokens); token ids of chat-template-like text, the sizes below.

Each goes through train.py's own path (trainer.Learner.micro_batches, algo.collate, algo.trainer_logprobs_and_entropy,
algo.policy_loss, backward), once packed as trees (train.py's default) and once --no-tree (a padded row per sample);
no optimizer step (the same whatever the layout). Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# --model smollm2 by name needs the embedded-model extra (train.py and proxy.py load it too).
import lightning_lite.extras.embedded  # noqa: E402, F401
from lightning_lite import algo  # noqa: E402
import lightning_lite.extras.fast_decode as fast_decode  # noqa: E402
from lightning_lite.models import load_model, load_tokenizer  # noqa: E402
from lightning_lite.records import Call, read_calls  # noqa: E402
from lightning_lite.samples import build_batch_samples  # noqa: E402
from lightning_lite.trainer import Learner  # noqa: E402

# The defaults --smoke sets (tests/test_bench.py runs it): every workload and layout, on one rollout
# each. Still the slowest smoke run, ~100 s on 2 CPU cores: two train.py steps to record (~25 s
# each), then the model's forward + backward over every sample twice (tree, rows) at ~100 tokens/s.
SMOKE = {
    "record_tasks": 1,
    "record_group": 1,
    "rollouts": 1,
    "turns": 2,
    "micro_batch_tokens": 1024,
}


def micro_batches(samples, weights, limit, tree):
    """train.py's micro-batches of at most ``limit`` tokens, packed as trees or padded rows.
    Learner.micro_batches reads only these two flags of its learner, so it is called on a stand-in
    that holds them: a real Learner would load the model again, with an optimizer."""
    learner = SimpleNamespace(config=SimpleNamespace(micro_batch_tokens=limit, no_tree=not tree))
    return Learner.micro_batches(learner, samples, weights)


def record(harness, args, out, tasks, group):
    """One train.py step of ``harness``, ``tasks`` tasks of ``group`` rollouts each; returns its
    calls (calls/step_0.jsonl)."""
    cmd = [
        sys.executable,
        "train.py",
        "--harness",
        harness,
        "--steps",
        "1",
        "--batch-size",
        str(tasks),
        "--group-size",
        str(group),
        "--eval-tasks",
        "0",
        "--out",
        out,
        *args,
    ]
    print(f"recording: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return list(read_calls(os.path.join(out, "calls", "step_0.jsonl")))


def qwen3_calls(tok, rollouts, turns, rng):
    """Calls of ``rollouts`` rollouts of ``turns`` turns each: call k's prompt is the system prompt and task, then
    turns 1..k-1 with their reasoning stripped (the tool call and its result kept), then the assistant header; its
    response is the reasoning (~80 tokens), then a tool call (~20). The tool results are ~50 tokens."""
    words = "the file tests config value error function returns list check path line result update module".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731  about a token a word
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    system = ids(
        f"<|im_start|>system\nYou are a coding agent. Tools: bash, edit. {text(150)}<|im_end|>\n"
        f"<|im_start|>user\nFix the failing test. {text(40)}<|im_end|>\n"
    )
    calls = []
    for r in range(rollouts):
        history = list(system)
        for k in range(turns):
            head = ids("<|im_start|>assistant\n")
            tool_call = ids(
                f'<tool_call>{{"name": "bash", "arguments": {{"cmd": "{text(12)}"}}}}</tool_call><|im_end|>\n'
            )
            think = ids(f"<think>{text(80)}</think>")
            calls.append(
                Call(
                    rollout_id=f"q{r}",
                    index=k,
                    api="chat",
                    model_version=0,
                    prompt_ids=history + head,
                    response_ids=think + tool_call,
                    response_logprobs=[-1.0] * (len(think) + len(tool_call)),
                    finish_reason="tool_calls",
                )
            )
            history += (
                head
                + tool_call
                + ids(f"<|im_start|>user\n<tool_response>{text(50)}</tool_response><|im_end|>\n")
            )
    return calls


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--calc", default=None, help="a calls.jsonl of calc rollouts (default: record one step)"
    )
    ap.add_argument(
        "--search",
        default=None,
        help="a calls.jsonl of search rollouts with compaction (default: record one step)",
    )
    ap.add_argument(
        "--rollouts",
        type=int,
        default=2,
        help="qwen3: rollouts (one task: they share the system prompt and task)",
    )
    ap.add_argument("--turns", type=int, default=10, help="qwen3: turns per rollout")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="train.py's default")
    ap.add_argument("--repeat", type=int, default=1, help="passes per layout; the fastest counts")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--record-tasks", type=int, default=2, help="tasks of a recorded step (its --batch-size)"
    )
    ap.add_argument(
        "--record-group", type=int, default=4, help="rollouts per task of a recorded step"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a short run of every code path, for the tests: the numbers mean nothing",
    )
    a = ap.parse_args()
    if a.smoke:
        # The smoke run's sizes become the defaults: flags given on the command line still win.
        ap.set_defaults(**SMOKE)
        a = ap.parse_args()
    size = (a.record_tasks, a.record_group)

    rng = random.Random(a.seed)
    tok = load_tokenizer(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        calc = (
            read_calls(a.calc)
            if a.calc
            else record(
                "calc", ["--harness-arg", "max_tokens=32"], os.path.join(tmp, "calc"), *size
            )
        )
        search = (
            read_calls(a.search)
            if a.search
            else record(
                "search",
                [
                    "--harness-arg",
                    "context_budget=1",
                    "--harness-arg",
                    "max_turns=4",
                    "--harness-arg",
                    "max_tokens=24",
                    "--harness-arg",
                    "summary_tokens=24",
                ],
                os.path.join(tmp, "search"),
                *size,
            )
        )
    workloads = {
        "calc": list(calc),
        "search": list(search),
        "qwen3": qwen3_calls(tok, a.rollouts, a.turns, rng),
    }
    torch.manual_seed(a.seed)
    model = load_model(a.model, a.device).train()  # fp32, as train.py loads it
    # the trainer's attention: on a CPU a tree skips the keys no block of rows sees
    fast_decode.install_trainer(model)

    def step(mbs, tree):
        """Forward + backward over the micro-batches; returns (seconds, tokens through the model)."""
        model.zero_grad(set_to_none=True)
        sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
        sync()
        t0, fwd = time.perf_counter(), 0
        for mb in mbs:
            b = algo.collate(*mb, device=a.device, tree=tree)
            # with each token's entropy, as trainer.Learner.backward computes it
            lp, entropy = algo.trainer_logprobs_and_entropy(model, b)
            loss, _ = algo.policy_loss(
                lp,
                b["old_logprobs"],
                b["advantages"],
                b["loss_mask"],
                b["weights"],
                entropy=entropy,
            )
            loss.backward()
            fwd += b["fwd_tokens"]
        sync()
        return time.perf_counter() - t0, fwd

    lines = []
    for name, calls in workloads.items():
        samples, stats = build_batch_samples(calls)
        for s in samples:
            sign = rng.choice([-1.0, 1.0])
            s.advantages = [sign * m for m in s.loss_mask]
        weights = algo.sample_weights(samples, "token-mean", algo.global_denominators(samples))
        # A warm-up: first-call allocations.
        step(micro_batches(samples[:1], weights[:1], a.micro_batch_tokens, True), True)
        res = {}
        for tree in (True, False):
            mbs = micro_batches(samples, weights, a.micro_batch_tokens, tree)
            res[tree] = min(step(mbs, tree) for _ in range(a.repeat))
            print(
                f"{name}: {'tree' if tree else 'rows'} {len(mbs)} micro-batches, {res[tree][1]} tokens, {res[tree][0]:.1f} s",
                flush=True,
            )
        (t_tree, f_tree), (t_rows, f_rows) = res[True], res[False]
        n = stats["trainable_tokens"]
        lines.append(
            f"| {name} | {stats['rollouts']} | {len(samples)} | {n} | {f_tree} | {f_rows} "
            f"| {f_rows / f_tree:.2f}x | {t_tree:.1f} | {t_rows:.1f} | {t_rows / t_tree:.2f}x "
            f"| {n / t_tree:.0f} | {n / t_rows:.0f} |"
        )
    print(
        f"\n{a.model} {a.device} fp32, {torch.get_num_threads()} threads, micro-batches of <= {a.micro_batch_tokens} tokens\n"
    )
    print(
        "| workload | rollouts | samples | trainable | fwd tree | fwd rows | ratio | s tree "
        "| s rows | speedup | trainable tok/s tree | rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
