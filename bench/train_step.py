"""Training-phase cost with and without tree packing, on the embedded model: tokens through the model (fwd_tokens)
and wall-clock seconds of forward + backward of the policy loss, the same samples both ways.

    python bench/train_step.py [--calc CALLS.jsonl] [--search CALLS.jsonl] [--micro-batch-tokens 4096] [--repeat 1]

Three workloads, side by side:

  calc     GRPO groups of the calc agent (examples/calc: tool calls, several turns): a group's samples share the
           system prompt, tool schema and question. Recorded by one train.py step (--batch-size 2 --group-size 4)
           unless --calc names a calls.jsonl.
  search   the search agent with context compaction (examples/search, context_budget=1): each compaction rewrites
           the history, so a rollout is two leaves that share the system prompt and question. Recorded likewise.
  qwen3    synthetic: rollouts of --turns turns under a Qwen3-style template that strips each turn's reasoning from
           the history, so every call starts a new leaf that repeats the whole history before it (K leaves, O(K^2)
           tokens); token ids of chat-template-like text, the sizes below.

Each goes through train.py's own path (micro_batches read from its source, algo.collate, algo.trainer_logprobs,
algo.policy_loss, backward), once packed as trees (train.py's default) and once --no-tree (a padded row per sample);
no optimizer step (the same whatever the layout). Run it on a quiet machine: it measures wall-clock time.
"""

import argparse
import ast
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

from lightning_lite import algo  # noqa: E402
from lightning_lite.models import load_model, load_tokenizer  # noqa: E402
from lightning_lite.records import Call, common_prefix, read_calls  # noqa: E402
from lightning_lite.samples import build_batch_samples  # noqa: E402


def from_train_py(names, namespace):
    """train.py's top-level functions ``names``, compiled into ``namespace``. Importing train.py would
    parse its command line and start a run, so the functions are taken from its source instead."""
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        sys.exit(f"train.py no longer defines {sorted(missing)}: update bench/train_step.py")
    namespace.setdefault("common_prefix", common_prefix)  # what they use from train.py's imports
    exec(compile(ast.Module(body=found, type_ignores=[]), "train.py", "exec"), namespace)
    return [namespace[n] for n in names]


def record(harness, args, out):
    """One train.py step of ``harness``; returns its calls (calls/step_0.jsonl)."""
    cmd = [
        sys.executable,
        "train.py",
        "--harness",
        harness,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--group-size",
        "4",
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
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = random.Random(a.seed)
    tok = load_tokenizer(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        calc = (
            read_calls(a.calc)
            if a.calc
            else record("calc", ["--harness-arg", "max_tokens=32"], os.path.join(tmp, "calc"))
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
            )
        )
    workloads = {
        "calc": list(calc),
        "search": list(search),
        "qwen3": qwen3_calls(tok, a.rollouts, a.turns, rng),
    }
    torch.manual_seed(a.seed)
    model = load_model(a.model, a.device).train()  # fp32, as train.py loads it
    ns = {
        "args": SimpleNamespace(micro_batch_tokens=a.micro_batch_tokens, no_tree=False)
    }  # the train.py globals it reads
    (micro_batches,) = from_train_py(["micro_batches"], ns)

    def step(mbs, tree):
        """Forward + backward over the micro-batches; returns (seconds, tokens through the model)."""
        model.zero_grad(set_to_none=True)
        sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
        sync()
        t0, fwd = time.perf_counter(), 0
        for mb in mbs:
            b = algo.collate(*mb, device=a.device, tree=tree)
            lp = algo.trainer_logprobs(model, b)
            loss, _ = algo.policy_loss(
                lp, b["old_logprobs"], b["advantages"], b["loss_mask"], b["weights"]
            )
            loss.backward()
            fwd += b["fwd_tokens"]
        sync()
        return time.perf_counter() - t0, fwd

    head = (
        f"{'workload':<8} {'rollouts':>8} {'samples':>7} {'trainable':>9} {'fwd tree':>9} {'fwd rows':>9} {'ratio':>6} "
        f"{'s tree':>7} {'s rows':>7} {'speedup':>7} {'trainable tok/s tree':>20} {'rows':>6}"
    )
    lines = []
    for name, calls in workloads.items():
        samples, stats = build_batch_samples(calls)
        for s in samples:
            sign = rng.choice([-1.0, 1.0])
            s.advantages = [sign * m for m in s.loss_mask]
        weights = algo.sample_weights(samples, "token-mean", algo.global_denominators(samples))
        step(micro_batches(samples[:1], weights[:1]), True)  # warm-up: first-call allocations
        res = {}
        for tree in (True, False):
            ns["args"].no_tree = not tree
            mbs = micro_batches(samples, weights)
            res[tree] = min(step(mbs, tree) for _ in range(a.repeat))
            print(
                f"{name}: {'tree' if tree else 'rows'} {len(mbs)} micro-batches, {res[tree][1]} tokens, {res[tree][0]:.1f} s",
                flush=True,
            )
        (t_tree, f_tree), (t_rows, f_rows) = res[True], res[False]
        n = stats["trainable_tokens"]
        lines.append(
            f"{name:<8} {stats['rollouts']:>8} {len(samples):>7} {n:>9} {f_tree:>9} {f_rows:>9} {f_rows / f_tree:>5.2f}x "
            f"{t_tree:>7.1f} {t_rows:>7.1f} {t_rows / t_tree:>6.2f}x {n / t_tree:>20.0f} {n / t_rows:>6.0f}"
        )
    print(
        f"\n{a.model} {a.device} fp32, {torch.get_num_threads()} threads, micro-batches of <= {a.micro_batch_tokens} tokens\n"
    )
    print(head)
    print("-" * len(head))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
