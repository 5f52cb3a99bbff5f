"""Names of the full-precision tensors as the model's own `save_pretrained` writes them.

transformers 5 renames some modules in memory and back on save (Mixtral's
`block_sparse_moe.gate` is `mlp.gate` in memory); engines such as vLLM load the saved names. The
export writes each plain tensor (a norm, a router, an unquantized Linear) under the name
transformers' `revert_weight_conversion` gives it, where that is a pure rename, and lists the
renames in the manifest (`qcompress.saved_names`, saved -> in-memory) so that load_quantized puts
them back. Quantized modules keep their module names: the config's targets name them.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
import torch.nn as nn


def rename_plain(root: nn.Module, tensors: Dict[str, torch.Tensor], skip_modules: Iterable[str]) -> Dict[str, str]:
    """Rename, in `tensors`, the model's own parameters and buffers outside `skip_modules` to their
    saved names; returns {saved name: in-memory name} for those that changed."""
    if getattr(getattr(root, "config", None), "model_type", None) is None:
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {}
    skip = tuple(f"{m}." for m in skip_modules)
    own = set(root.state_dict().keys())
    renamed: Dict[str, str] = {}
    for name in [k for k in tensors if k in own and not k.startswith(skip)]:
        t = tensors[name]
        out = dict(revert_weight_conversion(root, {name: t}))
        if len(out) != 1:
            continue  # split or merged on save: not a rename, left as it is
        saved, value = next(iter(out.items()))
        if saved != name and value is t and saved not in tensors:
            renamed[saved] = name
    for saved, name in renamed.items():
        tensors[saved] = tensors.pop(name)
    return dict(sorted(renamed.items()))


def restore(tensors: Dict[str, torch.Tensor], renamed: Dict[str, str]) -> None:
    """Put the in-memory names back (load_quantized), for the tensors the export renamed."""
    for saved, name in renamed.items():
        if saved in tensors:
            tensors[name] = tensors.pop(saved)
