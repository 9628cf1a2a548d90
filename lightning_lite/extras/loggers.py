"""Metrics to TensorBoard and Weights & Biases besides metrics.jsonl (docs/training.md: loggers).

The hook: at import this file adds ``open_loggers`` to ``hooks.METRIC_SINKS``; train.py's rank 0
opens it, and every metrics row goes to ``Loggers.log`` (numbers only: a None, not measured, is
left out) besides metrics.jsonl.
"""

import os
import sys

from .. import hooks


def add_args(parser):
    group = parser.add_argument_group("loggers")
    group.add_argument("--tensorboard", action="store_true", help="also to OUT/tensorboard")
    group.add_argument(
        "--wandb", metavar="PROJECT", help="also to W&B (WANDB_MODE=offline: no network)"
    )


class Loggers:
    def __init__(self, args, config: dict):
        # each imported only when asked for
        self.tensorboard = None
        self.wandb = None
        try:
            if args.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(os.path.join(args.out, "tensorboard"))
            if args.wandb:
                import wandb

                name = os.path.basename(os.path.abspath(args.out))
                self.wandb = wandb.init(project=args.wandb, config=config, dir=args.out, name=name)
        except ImportError as e:
            sys.exit(
                f"--tensorboard / --wandb need their package ({e}): pip install tensorboard / wandb"
            )

    def log(self, row: dict):
        numbers = {
            k: v
            for k, v in row.items()
            if isinstance(v, (int, float)) and k not in ("step", "time")
        }
        if self.tensorboard:
            for k, v in numbers.items():
                self.tensorboard.add_scalar(k, v, row["step"])
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(numbers, step=row["step"])

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def open_loggers(args, config: dict):
    """hooks.METRIC_SINKS: the Loggers that --tensorboard and --wandb ask for; None without them."""
    if not args.tensorboard and not args.wandb:
        return None
    return Loggers(args, config)


hooks.METRIC_SINKS.append(open_loggers)
