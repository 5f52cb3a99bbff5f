"""LoRA in the export (nn/lora.py, nn/qlora.py): what export_quantized writes for adapted layers.

- mode qat: each adapted layer's weight is the merged W + (B A) * scaling, quantized as it was in
  training (weight_entry reads quantized_weight / effective_weight, which merge), or written dense
  where no weight quantization acts on it; the adapters themselves are left out.
- mode qlora: the base as its stored codes, and beside it, in the same folder and bound by the same
  config.json, the adapter in peft's format (`adapter_config.json`, `adapter_model.safetensors`,
  tensors `base_model.model.<layer>.lora_A.weight` / `lora_B.weight`), which
  `PeftModel.from_pretrained(base, folder)` loads onto the base export; with `merge: true` also the
  merged, re-quantized model in `merged/`.
- a peft-wrapped model is exported under its own model's names: peft's layers are swapped for
  their base layers while the export runs (plain_view).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from ..nn import lora, qlora
from ..unwrap import unwrap
from . import safetensors_io as sio
from .errors import ExportError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = sio.ADAPTER_FILES
MERGED = "merged"
_PEFT_CONFIG = "_qc_peft_config"  # on the inner model while plain_view runs


def replaced(mod) -> Dict[str, object]:
    """{name in the layer: True (left out of the export) or the tensor written instead}. Only layers
    qcompress adapted: a user's own layer with parameters called lora_A keeps them."""
    if lora.state(mod) is None:
        return {}
    out: Dict[str, object] = {
        k: True for k in lora.OWN_PARAMS + lora.STORED if k in mod._parameters or k in mod._buffers
    }
    if lora.merges(mod):
        wq = mod.qc_wq
        if wq is None or not wq.active:  # no quantizer: the merged weight, dense
            out["weight"] = lora.quantizer_input(mod).detach()
    return out


def _adapted(root: nn.Module, mode: str) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in root.named_modules() if lora.state(m) is not None and lora.state(m).mode == mode]


@contextlib.contextmanager
def plain_view(model):
    """The model inside a PeftModel with each adopted peft layer replaced by its base layer (the
    names the plain model exports under); None when `model` is no PeftModel."""
    root = unwrap(model)
    inner = lora.peft_root(root)
    if inner is None:
        yield None
        return
    layers = lora.peft_lora_layers(inner)
    foreign = [n for n, m in layers if not getattr(type(m), "qc_adopted", False)]
    if foreign:
        raise ExportError(
            f"peft LoRA layer {foreign[0]!r} was not adopted by init_compression (its lora "
            "section was off): its adapter is outside the quantized weights. Merge it with peft "
            "first (merge_and_unload) or rebuild with compression_training.lora.enabled: true"
        )
    from ..schedule import CONFIG

    swaps = []
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        swaps.append((inner.get_submodule(parent_name) if parent_name else inner, child, layer))
    adapter = next((lora.state(m.base_layer).adapter for _, m in layers), None)
    extra = {_PEFT_CONFIG: root.peft_config.get(adapter) if adapter is not None else None}
    if CONFIG in root.__dict__ and CONFIG not in inner.__dict__:
        extra[CONFIG] = root.__dict__[CONFIG]
    try:
        for parent, child, layer in swaps:
            parent._modules[child] = layer.base_layer
        inner.__dict__.update(extra)
        yield inner
    finally:
        for parent, child, layer in swaps:
            parent._modules[child] = layer
        for k in extra:
            inner.__dict__.pop(k, None)


def _task_type(root) -> object:
    name = type(root).__name__
    return "CAUSAL_LM" if name.endswith("ForCausalLM") else None


def adapter_config(root, layers) -> dict:
    """peft's LoraConfig as save_pretrained writes it: a peft model's own, else ours."""
    own = root.__dict__.get(_PEFT_CONFIG)
    if own is not None:
        doc = own.to_dict()
        doc["inference_mode"] = True
        return doc
    st = lora.state(layers[0][1])
    return {
        "peft_type": "LORA",
        "task_type": _task_type(root),
        "base_model_name_or_path": None,
        "r": st.r,
        "lora_alpha": st.alpha,
        "lora_dropout": st.dropout,
        "target_modules": [n for n, _ in layers],
        "bias": "none",
        "fan_in_fan_out": all(m.qc_kind == "hf_conv1d" for _, m in layers),
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def stage_adapter(writer, model) -> None:
    """Stage the qlora adapter files in the export's writer (bound by its config.json)."""
    root = unwrap(model)
    layers = _adapted(root, "qlora")
    if not layers:
        return
    tensors = {}
    for name, mod in layers:
        a, b = lora.adapter_weights(mod)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    doc = adapter_config(root, layers)
    writer.stage_safetensors(ADAPTER_WEIGHTS, tensors, {"format": "pt"})
    writer.stage_text(
        ADAPTER_CONFIG,
        json.dumps(doc, indent=2, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v)),
    )


def wants_merged(model) -> bool:
    return any(lora.state(m).merge for _, m in _adapted(unwrap(model), "qlora"))


def write_merged(export, model, out_dir: str, **kwargs) -> None:
    """qlora with merge: true: the merged, re-quantized model in out_dir/merged (a copy is merged;
    the model itself keeps its stored base and adapters)."""
    root = unwrap(model)
    twin = copy.deepcopy(root)
    for _, mod in _adapted(twin, "qlora"):
        qlora.merge_in(mod)
    with torch.no_grad():
        export(twin, os.path.join(out_dir, MERGED), **kwargs)


def with_adapter(model, folder):
    """`model` (the base export, loaded) with the export's qlora adapter loaded by peft, in eval
    mode; `model` itself when the export has no adapter."""
    if not os.path.isfile(os.path.join(os.fspath(folder), ADAPTER_CONFIG)):
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, os.fspath(folder)).eval()
