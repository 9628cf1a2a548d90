"""LoRA (``--lora RANK``; docs/training.md#lora): the base model frozen in --dtype, AdamW over peft's adapters
(fp32) on every decoder linear layer or ``--lora-targets``. The embedded backend serves the adapted module; the
KL reference is it with its adapters disabled; checkpoints hold the adapters (peft's format) and their AdamW
state. Hooks: trainer.Learner calls ``wrap`` after loading the base, ``base_only`` around the reference.

    python -m lightning_lite.extras.lora merge CHECKPOINT OUT   # base + adapters: a plain transformers model
"""

import argparse
import contextlib
import os
import sys

import torch


def add_args(parser):
    group = parser.add_argument_group("LoRA (--lora RANK)")
    group.add_argument("--lora", type=int, metavar="RANK", help="train rank-RANK adapters only")
    group.add_argument("--lora-alpha", type=float, help="adapters scale by alpha / rank (2 x rank)")
    group.add_argument("--lora-targets", help="module names, comma-separated (all decoder linears)")


def check(args, ddp: bool, cuda: bool):
    """Bad flags exit before anything starts; the targets are matched on an empty (meta) copy."""
    if args.lora is None and (args.lora_alpha or args.lora_targets):
        sys.exit("--lora-alpha and --lora-targets shape adapters: add --lora RANK (e.g. 16)")
    if args.lora is not None and args.lora < 1:
        sys.exit(f"--lora {args.lora}: a rank is a positive integer (8, 16 or 64 are usual)")
    if args.lora is None:
        return
    if args.backend == "vllm" and args.lora > 512:
        sys.exit(f"--lora {args.lora}: vLLM serves adapters of rank 512 at most")
    if args.vllm_sleep:
        sys.exit("--vllm-sleep drops the base model the adapters need: leave it out with --lora")
    try:
        import peft  # noqa: F401
    except ImportError:
        sys.exit("--lora trains peft's adapters: pip install peft (or 'lightning-lite[lora]')")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models import resolve

    config = AutoConfig.from_pretrained(resolve(args.model))
    with torch.device("meta"):
        wrap(AutoModelForCausalLM.from_config(config), args)


def wrap(model, args, resume_dir=None):
    """``model`` frozen, with fresh adapters or ``resume_dir``'s, trainable and in fp32 (peft's default)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if resume_dir:
        return PeftModel.from_pretrained(model, resume_dir, is_trainable=True)
    targets = args.lora_targets.split(",") if args.lora_targets else "all-linear"
    alpha = args.lora_alpha or 2 * args.lora
    config = LoraConfig(r=args.lora, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        linear = {
            n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear
        }
        sys.exit(
            f"--lora-targets {args.lora_targets}: {e} (its linear layers: {','.join(sorted(linear))})"
        )


def adapter(model) -> tuple:
    """What vLLM servers load at a sync: (peft's config, the weights as peft saves them). FSDP's shards
    are gathered (a collective: every rank calls it)."""
    from peft import get_peft_model_state_dict

    full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
    trained = {n: full(p) for n, p in model.named_parameters() if "lora_" in n}
    return model.peft_config["default"], get_peft_model_state_dict(model, trained)


def base_only(model, on: bool):
    """A context in which ``model`` computes as its base model: its adapters disabled (``on``)."""
    return model.disable_adapter() if on else contextlib.nullcontext()


def merge(checkpoint: str, out: str, model: str | None = None):
    """A checkpoint's adapters merged into the base model it was trained on (or ``model``): a plain
    transformers model in ``out``, in the run's --dtype, with the tokenizer."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from ..models import load_model

    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)
    adapted = PeftModel.from_pretrained(load_model(model or state["args"]["model"]), checkpoint)
    dtype = torch.bfloat16 if state["args"]["dtype"] == "bf16" else torch.float32
    adapted.merge_and_unload().to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=merge.__doc__)
    parser.add_argument("command", choices=["merge"])
    parser.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N of a --lora run")
    parser.add_argument("out", help="the model directory to write")
    parser.add_argument("--model", help="the base model (default: the run's --model)")
    a = parser.parse_args()
    print(f"wrote {merge(a.checkpoint, a.out, a.model)}: load it as any transformers model")
