"""Plot a run's metrics.jsonl: training reward per step and held-out evaluations."""

import json


def plot_metrics(metrics_path: str, out_png: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward (mean over rollouts)", alpha=0.6)
        ax.plot([r["step"] for r in train], [r["success"] for r in train], "--", label="train success", alpha=0.6)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_success"] for r in evals], "o-", color="k", label=f"held-out success ({evals[0]['eval_tasks']} tasks)")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
