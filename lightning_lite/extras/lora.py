"""LoRA (``--lora RANK``; docs/training.md#lora): the base model frozen in --dtype, AdamW over peft's adapters
(fp32) on every decoder linear layer or ``--lora-targets``. The embedded backend serves the adapted module; the
KL reference is it with its adapters disabled; checkpoints hold the adapters (peft's format) and their AdamW
state. Hooks: trainer.Learner calls ``wrap`` after loading the base, ``base_only`` around the reference;
train.py sends vLLM ``adapters`` at a sync. --lora-per-harness: an adapter per harness, named as it, that
serves its rollouts (the backends' ``adapter_of``) and trains on them alone (``update_each``).

    python -m lightning_lite.extras.lora merge CHECKPOINT OUT   # base + adapters: a plain transformers model
"""

import argparse
import contextlib
import os
import sys

import torch

from ..algo import all_reduce


def add_args(parser):
    group = parser.add_argument_group("LoRA (--lora RANK)")
    group.add_argument("--lora", type=int, metavar="RANK", help="train rank-RANK adapters only")
    group.add_argument("--lora-alpha", type=float, help="adapters scale by alpha / rank (2 x rank)")
    group.add_argument("--lora-targets", help="module names, comma-separated (all decoder linears)")
    help = "an adapter per --harness: it serves that harness's rollouts and trains on them alone"
    group.add_argument("--lora-per-harness", action="store_true", help=help)


def check(args, ddp: bool, cuda: bool):
    """Bad flags exit before anything starts; the targets are matched on an empty (meta) copy."""
    if args.lora is None and (args.lora_alpha or args.lora_targets or args.lora_per_harness):
        sys.exit("--lora-alpha, --lora-targets, --lora-per-harness shape adapters: add --lora RANK")
    if args.lora_per_harness and len(args.harness) < 2:
        sys.exit("--lora-per-harness gives each --harness an adapter: name two or more --harness")
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
    one = argparse.Namespace(**{**vars(args), "lora_per_harness": None})
    with torch.device("meta"):
        wrap(AutoModelForCausalLM.from_config(config), one)


def wrap(model, args, resume_dir=None):
    """``model`` frozen, with fresh adapters or ``resume_dir``'s, trainable and in fp32 (peft's default):
    "default", or one per harness (--lora-per-harness, which train.py sets to the harnesses' names)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    names = args.lora_per_harness or ["default"]
    if resume_dir:
        # peft's layout: "default" in the folder itself, another adapter in a folder of its name
        folder = lambda name: os.path.join(resume_dir, "" if name == "default" else name)
        model = PeftModel.from_pretrained(model, folder(names[0]), names[0], is_trainable=True)
        for name in names[1:]:
            model.load_adapter(folder(name), name, is_trainable=True)
        return activate(model, names[0])
    targets = args.lora_targets.split(",") if args.lora_targets else "all-linear"
    alpha = args.lora_alpha or 2 * args.lora
    config = LoraConfig(r=args.lora, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    try:
        model = get_peft_model(model, config, adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, config)
        return activate(model, names[0])
    except ValueError as e:
        linear = {
            n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear
        }
        sys.exit(
            f"--lora-targets {args.lora_targets}: {e} (its linear layers: {','.join(sorted(linear))})"
        )


def activate(model, name: str):
    """Training's forwards go through adapter ``name``; all stay trainable (peft's set_adapter freezes
    the others), and AdamW skips those without gradients."""
    model.set_adapter(name)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    # serving (peft mixes adapters in a batch in eval mode only); Learner.update trains
    return model.eval()


def update_each(learner, samples: list, results: list, step: int, names: list):
    """--lora-per-harness: each harness's adapter trained on its samples alone, one after another: its
    own loss denominators, gradient norm and AdamW step. Returns the metrics, as keys ending in /NAME."""
    harness_of = {r.rollout_id: r.harness for r in results}
    row, kl = {}, learner.args.kl_coef > 0
    for name in names:
        mine = [s for s in samples if harness_of[s.rollout_id] == name]
        signal = all_reduce([sum(kl or any(s.advantages) for s in mine)])[0] > 0
        activate(learner.model, name)
        m, norm, skipped = learner.update(mine, step, signal)
        row |= {f"{k}/{name}": v for k, v in (m | dict(grad_norm=norm, skipped=skipped)).items()}
    return row, None, None


def adapters(model) -> dict:
    """What vLLM servers load at a sync: {name: (its peft config, its weights as peft saves them)}.
    FSDP's shards are gathered (a collective: every rank calls it)."""
    from peft import get_peft_model_state_dict

    full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
    trained = {n: full(p) for n, p in model.named_parameters() if "lora_" in n}
    return {
        name: (config, get_peft_model_state_dict(model, trained, name))
        for name, config in model.peft_config.items()
    }


def base_only(model, on: bool):
    """A context in which ``model`` computes as its base model: its adapters disabled (``on``)."""
    return model.disable_adapter() if on else contextlib.nullcontext()


def merge(checkpoint: str, out: str, model: str | None = None, adapter: str = "default"):
    """A checkpoint's adapter merged into the base model it was trained on (or ``model``): a plain
    transformers model in ``out``, in the run's --dtype, with the tokenizer."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from ..models import load_model

    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)
    folder = os.path.join(checkpoint, "" if adapter == "default" else adapter)
    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        held = [n for n in os.listdir(checkpoint) if os.path.isdir(os.path.join(checkpoint, n))]
        sys.exit(
            f"{folder} holds no adapter: a --lora run's checkpoint, with --adapter one of {held}"
        )
    adapted = PeftModel.from_pretrained(load_model(model or state["args"]["model"]), folder)
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
    parser.add_argument("--adapter", default="default", help="--lora-per-harness: a harness's")
    a = parser.parse_args()
    path = merge(a.checkpoint, a.out, a.model, a.adapter)
    print(f"wrote {path}: load it as any transformers model")
