"""load_quantized: rebuild a model from an export, holding the integers and dequantizing in forward.

The loaded module classes live in quantized.py, the checks of config.json and the tensors in
manifest.py; this module puts the model together. mode="fast" and the fused activations are load
steps that fast/ and fuse.py register (quantized.register_load_step).
"""

from __future__ import annotations

import os

import torch.nn as nn

from . import safetensors_io as sio
from . import saved_names
from .kv_cache import load_kv_cache
from .errors import CheckpointError
from .manifest import (
    check_expert_groups,
    check_manifest,
    check_quant_config,
    check_tensors,
    check_unlisted,
    read_config,
    resolve_ties,
)
from .quantized import (
    QuantizedMixin,
    _rebuild,
    class_parts,
    dequantize_record,
    gather_refusal,
    gather_rows,
    load_steps,
    pickle_globals,
    quantized_class,
    swap,
)
from .rotations import prepare_load
from ..unwrap import unwrap

# names importable from here before the split (_rebuild: what pickles saved then name)
__all__ = [
    "load_quantized",
    "pickle_globals",
    "read_config",
    "resolve_ties",
    "check_manifest",
    "check_tensors",
    "QuantizedMixin",
    "dequantize_record",
    "gather_rows",
    "gather_refusal",
    "class_parts",
    "quantized_class",
    "_rebuild",
]


def _check_kind(module, kind, name, cfg_path):
    from ..nn.layers import kind_of

    if kind_of(module) != kind:
        raise CheckpointError(
            f"{cfg_path}: module {name!r} is a {kind} in the checkpoint but a "
            f"{type(module).__name__} in the given model"
        )


def load_quantized(folder, model: nn.Module, *, mode: str = "exact", fuse_activations: bool = True) -> nn.Module:
    """Load an export into `model` (a fresh, uncompressed instance of the architecture), in place.

    mode="exact" dequantizes each weight in every forward (bit-exact outputs); mode="fast" runs
    integer-weight kernels where torch has them and a fused dequantization elsewhere (see
    qcompress/export/fast/; outputs equal "exact" up to float summation order). With
    fuse_activations (mode="fast" only), a GELU / ReLU or a skip-connection add that provably only
    follows a low-bit layer (BERT's feed-forward and block outputs, GPT-2's MLP, nn.Sequential
    neighbours) runs in that layer's kernel call; only the parent module's forward changes
    (qcompress/export/fuse.py).
    Returns `model` in eval mode (dropout off), as transformers' from_pretrained does; call
    `.train()` to fine-tune it further.
    Raises CheckpointError (naming file and tensor) for truncated, corrupted or inconsistent
    checkpoints and for a model whose modules do not match the checkpoint.
    """
    steps = load_steps(mode)
    folder = os.fspath(folder)
    cfg_path, config, qc, modules = read_config(folder)
    check_quant_config(qc, modules, cfg_path)
    check_expert_groups(qc, config["qcompress"].get("experts"), cfg_path)
    unbound = []  # files config.json does not bind: reported after content checks
    tensors, where, _ = sio.read_checkpoint(folder, problems=unbound)
    saved_names.restore(tensors, config["qcompress"].get("saved_names", {}))
    resolve_ties(tensors, where, modules)
    for later, first in config["qcompress"].get("tied_tensors", {}).items():
        if later not in tensors and first in tensors:  # a tied full-precision tensor, written once
            tensors[later] = tensors[first]
    check_tensors(tensors, where, modules, cfg_path)
    if unbound:
        raise CheckpointError(unbound[0])
    root = unwrap(model)
    if config["qcompress"].get("experts"):  # fused expert Parameters, dequantized (export/experts.py)
        from .experts import load_experts

        load_experts(root, config["qcompress"]["experts"], tensors, cfg_path)
    prepare_load(root, config, cfg_path)  # a rotated export: its untied head, R4's online modules
    named = dict(root.named_modules())
    for name, rec in modules.items():
        if name not in named:
            arch = config.get("architectures")
            hint = ""
            if isinstance(arch, list) and arch and type(root).__name__ not in arch:
                hint = f" (the export is a {arch[0]}, the given model a {type(root).__name__})"
            raise CheckpointError(f"{cfg_path}: module {name!r} does not exist in the given model{hint}")
        mod = named[name]
        if isinstance(mod, QuantizedMixin):
            raise CheckpointError(
                f"{cfg_path}: module {name!r} of the given model already holds a loaded "
                f"export ({type(mod).__name__}); pass a fresh model"
            )
        _check_kind(mod, rec["kind"], name, cfg_path)
        if rec.get("weights") is not None:
            if mod.weight.is_floating_point() and str(mod.weight.dtype) != f"torch.{rec['dtype']}":
                # a float32 export loaded into a bfloat16 model: its weights are the exported
                # float weights rounded to the model's dtype (as transformers casts a checkpoint),
                # not float32 weights that the bf16 activations cannot be multiplied with
                rec["dtype"] = str(mod.weight.dtype).replace("torch.", "")
            want = list(rec["weight_shape"])
            have = list(mod.weight.shape)
            if rec.get("transposed"):
                have = have[::-1]
            if want != have:
                raise CheckpointError(
                    f"{cfg_path}: module {name!r} weight is {want} in the checkpoint but {have} in the given model"
                )
        swap(mod, rec["kind"], name, rec)
    load_kv_cache(root, config, tensors, where, cfg_path)  # k_scale / v_scale buffers, loaded below
    for name, rec in modules.items():
        if rec["format"] in ("int-quantized", "float-quantized", "mxfp8-quantized"):
            tensors[f"{name}.qweight"] = tensors.pop(f"{name}.weight")
    missing, unexpected = [], []
    try:
        result = root.load_state_dict(tensors, strict=False)
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    except RuntimeError as e:
        raise CheckpointError(f"{folder}: tensors do not fit the model: {e}") from None
    check_unlisted(unexpected, modules, cfg_path)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
        raise CheckpointError(f"{folder}: checkpoint tensors and model disagree: " + "; ".join(parts))
    for step in steps:
        step(root, modules, {"fuse_activations": fuse_activations})
    model.eval()  # an inference checkpoint, as transformers' from_pretrained returns it
    return model
