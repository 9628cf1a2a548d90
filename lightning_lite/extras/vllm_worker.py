"""Code that runs inside vLLM's worker processes, not the trainer's: the servers train.py starts get
``--worker-extension-cls lightning_lite.extras.vllm_worker.CountedReload`` (extras/vllm.py), and
vLLM adds this class's methods to each worker, callable through the server's /collective_rpc.

vLLM's own reload answers a 200 whatever it loaded: its model's ``load_weights`` skips the names
its loader ignores, and 0.32's reload keeps the old weights of every parameter it was not given.
``counted_reload`` is that reload, and it names the worker's parameters it left as they were in the
modules the sync sent weights for, so that the trainer can stop a sync that did not land on every
layer (extras/vllm.py). LoRA has the same gap: an adapter's module that matches none of the served
model's is left out at debug level, and the base model serves there;
``unmatched_adapter_modules`` names them. It imports only the standard library: vLLM's venv has none
of the trainer's dependencies."""

import glob
import json
import os


def sent_names(weights_path: str) -> list:
    """The tensor names in the safetensors files of ``weights_path``, read from their headers (8
    bytes of header length, then the JSON header)."""
    names = []
    for path in sorted(glob.glob(os.path.join(weights_path, "*.safetensors"))):
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        names += [name for name in header if name != "__metadata__"]
    return names


def left_out(params: set, loaded: set, sent: list) -> list:
    """The parameters of ``params`` not in ``loaded`` whose module's parent holds a ``sent`` name:
    those the sync meant to replace. The parent, not the module: vLLM fuses the checkpoint's
    q_proj, k_proj and v_proj into one qkv_proj. A vision tower the trainer does not train sends
    nothing and is not counted.

    left_out({"m.layers.0.attn.qkv_proj.weight", "vision.blocks.0.attn.qkv.weight"}, set(),
             ["m.layers.0.attn.q_proj.weight"]) == ["m.layers.0.attn.qkv_proj.weight"]"""
    modules = set()
    for name in sent:
        parts = name.split(".")
        for end in range(1, len(parts)):
            modules.add(".".join(parts[:end]))
    return sorted(p for p in params - loaded if p.rsplit(".", 2)[0] in modules)


class CountedReload:
    def counted_reload(self, weights_path: str) -> dict:
        """Reload the weights in ``weights_path`` in place (the worker's own ``reload_weights``)
        and return {"parameters": N, "left_out": [names] or None}: ``left_out``'s parameters,
        named as vLLM names them (a LoRA layer's ``.base_layer.`` dropped, the sent names through
        the model's checkpoint-name mapper); None when the model's ``load_weights`` does not say
        what it loaded. E.g. a sync that lacks layer 1's down_proj: {"parameters": 20,
        "left_out": ["model.layers.1.mlp.down_proj.weight"]}."""
        model = self.model_runner.get_model()
        loaded = []
        load = model.load_weights

        # The reload calls model.load_weights once; this wrapper keeps the names it returns.
        def counting(weights):
            names = load(weights)
            loaded.append(names)
            return names

        model.load_weights = counting
        try:
            self.model_runner.reload_weights(weights_path=weights_path)
        finally:
            del model.load_weights
        params = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}
        if not loaded or loaded[0] is None:
            return {"parameters": len(params), "left_out": None}
        sent = sent_names(weights_path)
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            sent = [mapped for mapped in map(mapper.map_name, sent) if mapped]
        return {"parameters": len(params), "left_out": left_out(params, set(loaded[0]), sent)}

    def unmatched_adapter_modules(self) -> dict:
        """{adapter id: [its modules that match no LoRA module of the served model]} for every
        adapter this worker holds (vLLM 0.32's LoRA manager: its modules by name, and each
        adapter's, q/k/v already merged as the model's qkv_proj); {} without LoRA. E.g. an adapter
        under the trainer's names on a composite checkpoint: {"1": ["model.layers.0.mlp.down_proj",
        ...]}, where the server's modules are "language_model.model.layers.0.mlp.down_proj"."""
        runner = self.model_runner
        if getattr(runner, "lora_manager", None) is None:
            return {}
        manager = runner.lora_manager._adapter_manager
        modules = set(manager.modules)
        adapters = manager._registered_adapters
        return {str(i): sorted(set(adapter.loras) - modules) for i, adapter in adapters.items()}
