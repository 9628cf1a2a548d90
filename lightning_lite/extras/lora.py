"""LoRA (``--lora RANK``; docs/training.md#lora): the base model frozen in --dtype, AdamW over
peft's adapters (fp32) on every decoder linear layer or ``--lora-targets``. The embedded backend
serves the adapted module; the KL reference is it with its adapters disabled; checkpoints hold the
adapters (peft's format) and their AdamW state, keyed by parameter name.

Its seam: ``check`` sets ``hooks.adapter`` to a :class:`LoRA` when --lora is given, the model
adapter trainer.Learner asks to wrap the loaded base (``wrap``, after ``check_resume``), to give the
KL reference (``reference``: the adapters switched off) and, with an adapter per harness, to make
the update (``update``); vLLM's sync sends its ``weights``. --lora-per-harness: an adapter per
harness, named as it, that serves its rollouts (``route``, then ``serving``, which the backends
ask) and trains on them alone (``update``: every adapter in one backward pass).

python -m lightning_lite.extras.lora merge CHECKPOINT OUT   # base + adapters: a plain transformers
model"""

import argparse
import contextlib
import os
import sys

import torch

from .. import hooks
from ..algo import all_reduce

ALPHA_HELP = "adapters scale by alpha / rank (default 2 x rank)"
RSLORA_HELP = "rank-stabilized: scale by alpha / sqrt(rank) (give --lora-alpha too)"
PER_HARNESS_HELP = (
    "an adapter per --harness: it serves that harness's rollouts, trains on them alone"
)


def add_args(parser):
    group = parser.add_argument_group("LoRA (--lora RANK)")
    group.add_argument("--lora", type=int, metavar="RANK", help="train rank-RANK adapters only")
    group.add_argument("--lora-alpha", type=float, help=ALPHA_HELP)
    group.add_argument("--lora-rslora", action="store_true", help=RSLORA_HELP)
    group.add_argument("--lora-targets", help="module names, comma-separated (all decoder linears)")
    group.add_argument("--lora-per-harness", action="store_true", help=PER_HARNESS_HELP)


def check(args, ddp: bool, cuda: bool):
    """Bad flags exit before anything starts; the targets are matched on an empty (meta) copy of the
    model."""
    shaping = {
        "--lora-alpha": args.lora_alpha is not None,
        "--lora-rslora": args.lora_rslora,
        "--lora-targets": args.lora_targets is not None,
        "--lora-per-harness": args.lora_per_harness,
    }
    if args.lora is None and any(shaping.values()):
        given = ", ".join(flag for flag, on in shaping.items() if on)
        sys.exit(f"{given} shape adapters: add --lora RANK")
    if args.lora is None:
        return
    if args.lora < 1:
        sys.exit(f"--lora {args.lora}: a rank is a positive integer (8, 16 or 64 are usual)")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        sys.exit(
            f"--lora-alpha {args.lora_alpha}: the adapters' scale is alpha / rank, so alpha must "
            f"be > 0 (leave it out for 2 x rank = {2 * args.lora})"
        )
    if args.lora_rslora and args.lora_alpha is None:
        sys.exit(
            "--lora-rslora scales by alpha / sqrt(rank), where 2 x rank would give "
            f"{2 * args.lora**0.5:.1f}: give --lora-alpha too (e.g. 16)"
        )
    if args.lora_per_harness and len(args.harness or []) < 2:
        sys.exit("--lora-per-harness gives each --harness an adapter: name two or more --harness")
    if args.backend == "vllm" and args.lora > 512:
        sys.exit(f"--lora {args.lora}: vLLM serves adapters of rank 512 at most")
    try:
        import peft  # noqa: F401
    except ImportError:
        sys.exit("--lora trains peft's adapters: pip install peft (or 'lightning-lite[lora]')")
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models import resolve

    config = AutoConfig.from_pretrained(resolve(args.model))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    if args.lora_targets:
        check_targets(meta, args.lora_targets.split(","), args.backend)
    adapter = LoRA(args)
    adapter.wrap(meta)
    hooks.adapter = adapter


def check_targets(model, targets: list, backend: str):
    """Each of ``targets`` names modules of ``model`` as peft matches them (the whole name, or its
    last parts: ``q_proj``, ``self_attn.q_proj``), and vLLM serves adapters on them."""
    modules = dict(model.named_modules())
    linear = _linear_names(model)
    for target in targets:
        matched = [
            m for name, m in modules.items() if name == target or name.endswith("." + target)
        ]
        if not matched:
            sys.exit(
                f"--lora-targets: {target!r} names no module of {model.config.model_type} "
                f"(its linear layers: {linear})"
            )
        head = model.get_output_embeddings()
        unserved = any(isinstance(m, torch.nn.Embedding) or m is head for m in matched)
        if backend == "vllm" and unserved:
            sys.exit(
                f"--lora-targets {target}: vLLM serves adapters on the decoder's linear layers, "
                f"not on embeddings or the output head (its linear layers: {linear})"
            )


def _linear_names(model) -> str:
    """The last parts of the names of ``model``'s linear layers, for an error message."""
    names = {
        name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is torch.nn.Linear
    }
    return ",".join(sorted(names))


def check_resume(adapter: "LoRA", resume_dir: str):
    """A --resume goes on with the adapters its checkpoint holds: one whose adapters (their names),
    rank, alpha, rsLoRA or targets differ from the checkpoint's is refused, saying what differs. The
    --harness order may change: the AdamW state is restored by parameter name."""
    path = os.path.join(resume_dir, "trainer_state.pt")
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["args"]
    then = {"--lora": None}
    if saved.get("lora") is not None:
        then = LoRA(argparse.Namespace(**saved)).shape(_saved_adapters(resume_dir))
    now = adapter.shape(adapter.names)
    differ = [
        f"{key} {then[key]} (now {now.get(key)})" for key in then if then[key] != now.get(key)
    ]
    if differ:
        sys.exit(
            f"--resume: {resume_dir} holds other adapters: {'; '.join(differ)}. Resume with the "
            "checkpoint's flags, or start a new run in another --out"
        )


def _saved_adapters(checkpoint: str) -> list:
    """The names of the adapters a checkpoint holds, each where peft lays it out (``_folder``)."""
    names = []
    for name in ["default"] + os.listdir(checkpoint):
        if os.path.exists(os.path.join(_folder(checkpoint, name), "adapter_config.json")):
            names.append(name)
    return names


class LoRA(hooks.NoAdapter):
    """The model adapter that --lora asks for (``hooks.adapter``; trainer.Learner says what it asks
    of it): rank-``rank`` adapters named ``names``, "default", or one per harness."""

    def __init__(self, args):
        self.rank = args.lora
        self.alpha = args.lora_alpha or 2 * args.lora
        self.rslora = args.lora_rslora
        self.targets = args.lora_targets
        # --lora-per-harness: named after the harnesses once they are loaded (name_after)
        self.per_harness = args.lora_per_harness
        self.names = ["default"]
        # Each harness's adapter trains on its own samples (update): a backward leaves the others
        # without gradients.
        self.trains_apart = self.per_harness
        # --lora-per-harness: rollout id -> the adapter that serves it, the last batch's (route)
        self.adapter_of = {}

    @property
    def model_adapter(self):
        """What trainer.Learner wraps the base model with: this."""
        return self

    def shape(self, names: list) -> dict:
        """What these flags make of adapters ``names``, comparable across runs (their order aside):
        check_resume compares a checkpoint's with the run's."""
        targets = "all decoder linears"
        if self.targets:
            targets = sorted(self.targets.split(","))
        return {
            "--lora": self.rank,
            "--lora-alpha": self.alpha,
            "--lora-rslora": bool(self.rslora),
            "--lora-targets": targets,
            "adapters": sorted(names),
        }

    def name_after(self, tasks):
        """--lora-per-harness: an adapter per harness of ``tasks`` (harness.Tasks), named as it. Its
        rollouts must be grouped apart from other harnesses' (``tasks.groups_across`` False): one
        adapter's rewards must not be another's baseline."""
        if not self.per_harness:
            return
        if getattr(tasks, "groups_across", False):
            sys.exit(
                "--group-across-harnesses with --lora-per-harness would make one adapter's "
                "rewards the baseline of another's: each adapter's rollouts are grouped on their "
                "own, so leave out one of the two"
            )
        self.names = tasks.names()

    def route(self, harness_of: dict) -> dict:
        """--lora-per-harness: each rollout of the batch to its harness's adapter, {rollout id: its
        name}, the name its endpoint and the backends know it by (``serving``). Without: none, the
        one adapter is active in the served model."""
        self.adapter_of = {}
        if self.per_harness:
            self.adapter_of = {rid: harness.name for rid, harness in harness_of.items()}
        return self.adapter_of

    def serving(self, rollout_id: str):
        """The adapter that serves ``rollout_id`` (the last batch's ``route``); None: the one
        adapter, active in the served model."""
        return self.adapter_of.get(rollout_id)

    def wrap(self, model, resume_dir=None):
        """``model`` frozen, with fresh adapters or ``resume_dir``'s (after ``check_resume``),
        trainable and in fp32 (peft's default), named ``names``: "default", or one per harness."""
        from peft import LoraConfig, PeftModel, get_peft_model

        first, *others = self.names
        if resume_dir:
            check_resume(self, resume_dir)
            path = _folder(resume_dir, first)
            model = PeftModel.from_pretrained(model, path, first, is_trainable=True)
            for name in others:
                model.load_adapter(_folder(resume_dir, name), name, is_trainable=True)
            # serving (peft mixes adapters in a batch in eval mode only); Learner.update trains
            return activate(model, first).eval()
        targets = "all-linear"
        if self.targets:
            targets = self.targets.split(",")
        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            use_rslora=self.rslora,
            target_modules=targets,
            lora_dropout=0.0,
        )
        try:
            model = get_peft_model(model, config, adapter_name=first)
        except ValueError as e:
            sys.exit(
                f"--lora-targets {self.targets}: {e} (its linear layers: {_linear_names(model)})"
            )
        for name in others:
            model.add_adapter(name, config)
        return activate(model, first).eval()

    @contextlib.contextmanager
    def reference(self, model):
        """The KL term's reference: ``model`` with its adapters disabled. It leaves trainable what
        it found trainable: peft, re-enabling them, freezes every adapter but the active one."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        with model.disable_adapter():
            yield model
        for p in trainable:
            p.requires_grad_(True)

    def update(self, learner, samples: list, results: list, step: int):
        """--lora-per-harness: every harness's adapter trained on its own samples, in one backward
        pass.

        Each harness's samples run through its adapter with their own loss denominators, as if that
        adapter trained alone; the gradients of all adapters accumulate and reduce over ranks once;
        each adapter is clipped by its own gradient norm; one AdamW step updates them all. An
        adapter without a signal this step (no advantage on any rank, no KL term) is left out: it
        and its AdamW moments stay as they are. Returns the metrics, as keys ending in /NAME."""
        harness_of = {r.rollout_id: r.harness for r in results}
        samples_of = {n: [s for s in samples if harness_of[s.rollout_id] == n] for n in self.names}
        kl = learner.config.kl_coef > 0
        # one decision on every rank: the adapters with a signal on any of them
        signals = [sum(kl or any(s.advantages) for s in samples_of[name]) for name in self.names]
        signals = all_reduce(signals)
        training = [name for name, n in zip(self.names, signals) if n > 0]
        row = {f"skipped/{name}": "no_signal" for name in self.names if name not in training}
        if not training:
            learner.log(f"step {step + 1}: no adapter has a signal; skipping the update")
            return row, None, None
        learner.start_update(step)
        for i, name in enumerate(training):
            activate(learner.model, name)
            # the gradients reduce over ranks after the last adapter's last micro-batch
            last = i == len(training) - 1
            metrics = learner.backward(samples_of[name], version=step, sync=last)
            row |= {f"{key}/{name}": value for key, value in metrics.items()}
        params = [(adapter_of_param(n), p) for n, p in learner.model.named_parameters()]
        for name in training:
            its_params = [p for adapter, p in params if adapter == name]
            grad_norm, skipped = learner.clip(its_params, step, f"adapter {name}'s gradient norm")
            row |= {f"grad_norm/{name}": grad_norm, f"skipped/{name}": skipped}
        learner.finish_update()
        return row, None, None

    def weights(self, model, dtype: torch.dtype) -> dict:
        """What vLLM servers load at a sync: {name: (its peft config, its weights in ``dtype``, the
        served one, as peft names them)}. FSDP's shards are gathered (a collective: every rank calls
        it)."""
        from peft import get_peft_model_state_dict

        trained = {}
        for n, p in model.named_parameters():
            if adapter_of_param(n) is None:
                continue
            if hasattr(p, "full_tensor"):
                p = p.full_tensor()
            trained[n] = p.detach().cpu().to(dtype)
        # save_embedding_layers=False: the adapters alone ("auto" reads the base's config, even a
        # hub's)
        adapters = {}
        for name, config in model.peft_config.items():
            state = get_peft_model_state_dict(model, trained, name, save_embedding_layers=False)
            adapters[name] = (config, state)
        return adapters


def _folder(checkpoint: str, name: str) -> str:
    """Where a checkpoint holds adapter ``name``, as peft lays them out: "default" in the folder
    itself, any other in a folder of its name."""
    if name == "default":
        return checkpoint
    return os.path.join(checkpoint, name)


def adapter_of_param(param_name: str):
    """The adapter a parameter belongs to, by peft's names (``...q_proj.lora_A.NAME.weight``), or
    None for the base model's."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def activate(model, name: str):
    """Training's forwards go through adapter ``name``; all stay trainable (peft's set_adapter
    freezes the others), and AdamW skips those without gradients."""
    model.set_adapter(name)
    for n, p in model.named_parameters():
        p.requires_grad_(adapter_of_param(n) is not None)
    return model


def merge(checkpoint: str, out: str, model: str | None = None, adapter: str = "default"):
    """A checkpoint's adapter merged into the base model it was trained on (or ``model``): a plain
    transformers model in ``out``, in the run's --dtype, with the tokenizer, and with the run's
    served context (--max-model-len past the model's: its YaRN RoPE scaling)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from ..models import load_model

    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)
    run = state["args"]
    folder = _folder(checkpoint, adapter)
    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        held = [n for n in os.listdir(checkpoint) if os.path.isdir(os.path.join(checkpoint, n))]
        sys.exit(
            f"{folder} holds no adapter: a --lora run's checkpoint, with --adapter one of {held}"
        )
    base = load_model(model or run["model"], max_model_len=run.get("max_model_len"))
    adapted = PeftModel.from_pretrained(base, folder)
    dtype = torch.bfloat16 if run["dtype"] == "bf16" else torch.float32
    adapted.merge_and_unload().to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out


if __name__ == "__main__":
    # a run's --model may be an embedded model's name
    hooks.load_extras(["embedded"])
    parser = argparse.ArgumentParser(description=merge.__doc__)
    parser.add_argument("command", choices=["merge"])
    parser.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N of a --lora run")
    parser.add_argument("out", help="the model directory to write")
    parser.add_argument("--model", help="the base model (default: the run's --model)")
    parser.add_argument("--adapter", default="default", help="--lora-per-harness: a harness's")
    a = parser.parse_args()
    path = merge(a.checkpoint, a.out, a.model, a.adapter)
    print(f"wrote {path}: load it as any transformers model")
