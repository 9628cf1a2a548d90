"""Load the policy model and its tokenizer from a transformers directory, or a hub name where a hub
is reachable. The resolvers in ``hooks.MODEL_RESOLVERS`` map other names to a directory:
extras/embedded.py's maps the embedded models (smollm2, the default, and gemma3-270m) to the
directory it converts each into once.
"""

import contextlib
import os
from typing import Optional

import torch

from . import hooks


def cache_dir() -> str:
    """Where the converted models live: $LIGHTNING_LITE_CACHE, or ~/.cache/lightning-lite."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "lightning-lite")
    return os.environ.get("LIGHTNING_LITE_CACHE", default)


def resolve(model: str) -> str:
    """Map a --model value to what from_pretrained accepts: the directory that the first resolver of
    ``hooks.MODEL_RESOLVERS`` maps it to, or else the value as it is when it is a directory or a hub
    name (namespace/name). Any other value is an error that says what this copy knows."""
    for resolver in hooks.MODEL_RESOLVERS:
        path = resolver(model)
        if path is not None:
            return path
    if os.path.isdir(model) or "/" in model:
        return model
    if not hooks.MODEL_RESOLVERS:
        what = f"--model {model} (a name, not a directory or a hub name such as namespace/name)"
        raise ValueError(hooks.missing(what, "embedded"))
    raise ValueError(
        f"--model {model} is not a directory, a hub name (namespace/name), nor a name that a "
        "resolver of hooks.MODEL_RESOLVERS knows (extras/embedded.py: the embedded models)"
    )


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(model))


def eos_ids(tokenizer, generation_config=None) -> set[int]:
    """Every token id that ends the model's turn: generation_config's EOS ids (Llama 3: <|eot_id|>
    and <|eom_id|>; Qwen: <|im_end|> and <|endoftext|>; gpt-oss: <|return|> and <|call|>) and the
    tokenizer's. One definition for both backends and the renderer. ``generation_config`` is the
    model's, or else read from the tokenizer's folder."""
    if generation_config is None:
        from transformers import GenerationConfig

        # Without a generation_config.json, the tokenizer's EOS alone.
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
    """Load a causal LM. ``max_model_len`` beyond the context it was trained for extends it with
    YaRN RoPE scaling (factor max_model_len / trained length). YaRN, not dynamic NTK: its rotation
    does not depend on the length so far, so a growing conversation's KV cache and the trainer's
    one-pass forward see the same positions, and the logprobs are exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve(model)
    config = AutoConfig.from_pretrained(path)
    trained = getattr(config, "max_position_embeddings", None)
    if max_model_len and trained and max_model_len > trained:
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"{model} already scales RoPE ({rope.get('rope_type')}); --max-model-len "
                f"{max_model_len} exceeds its max_position_embeddings {trained}: "
                f"use at most {trained}"
            )
        rope.update(rope_type="yarn", factor=max_model_len / trained)
        rope["original_max_position_embeddings"] = trained
        config.rope_parameters = rope
        config.max_position_embeddings = max_model_len
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(device)
