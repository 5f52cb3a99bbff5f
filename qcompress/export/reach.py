"""Which weight-quantized modules a serving loader can read, known before any training.

compressed-tensors' loaders (transformers, vLLM) quantize nn.Linear layers with whole groups only
(layout.portable); an export whose groups also quantize embeddings, Conv or transformers' Conv1D
is refused by transformers and loads only with qcompress.load_quantized. `qcompress train` asks
this on its throwaway compressed copy of the model, so the user hears it before the FP32 stages,
not after the export. Fused experts are left to the export's own message (export/experts.py).
"""

from __future__ import annotations

import warnings
from typing import List, Sequence, Tuple

from torch import nn

from . import layout

SKIPPED_KINDS = ("experts", "batchnorm")  # experts: export/experts.py; batchnorm: never exported


def _record(kind: str, wq, weight) -> dict:
    """The part of a manifest record layout.portable reads, from the module's settings."""
    strategy = "group" if wq.granularity == "group" else wq.granularity
    shape = list(weight.shape[:2]) if weight.dim() >= 2 else list(weight.shape)
    return {
        "kind": kind,
        "input_activations": None,
        "weight_shape": shape,
        "weights": {"strategy": strategy, "group_size": wq.group_size},
    }


def unreadable(model: nn.Module) -> List[Tuple[str, str]]:
    """(module name, why) for each weight-quantized module of a model that init_compression
    prepared which compressed-tensors' loaders cannot read, in module order."""
    from ..nn.layers import CompressMixin

    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, CompressMixin) or mod.qc_kind in SKIPPED_KINDS or mod.qc_wq is None:
            continue
        rec = _record(mod.qc_kind, mod.qc_wq, mod.weight)
        if not layout.portable(rec):
            out.append((name, layout.unportable_reason(rec)))
    return out


# what to do, by the reason a module is unreadable (layout.unportable_reason): only embeddings are
# something the schedules/ recipes leave out; Conv1D and convolutions are the model's own layers
_ADVICE = {
    "embedding": "leave embeddings out of the weight groups' `modules` (the schedules/ recipes do; "
    "schedules/with_embeddings.yaml opts them in for qcompress.load_quantized)",
    "transformers Conv1D": "transformers' Conv1D projections (GPT-2 and its family) are quantized by every "
    "recipe that takes the transformer blocks, and only qcompress.load_quantized "
    "reads them; for an export transformers and vLLM load, train a model whose "
    "projections are nn.Linear (Llama, Qwen, Mistral, BERT)",
    "convolution": "convolutions are read by qcompress.load_quantized only",
}


def message(found: Sequence[Tuple[str, str]], where: str) -> str:
    shown = ", ".join(f"{n} ({why})" for n, why in found[:6]) + (
        f" and {len(found) - 6} more" if len(found) > 6 else ""
    )
    reasons = list(dict.fromkeys(why for _, why in found))
    advice = [_ADVICE[r] for r in reasons if r in _ADVICE]
    if any(r.startswith("in_features") for r in reasons):
        advice.append("choose a group_size that divides every quantized layer's in_features")
    if any(r.startswith("input activations") for r in reasons):
        advice.append("quantize inputs per token (dynamic) or with a static range")
    return (
        f"{where} quantize {len(found)} modules that no serving loader reads: {shown}. "
        "compressed-tensors' loaders (transformers, vLLM) quantize nn.Linear layers with whole "
        "groups only, so transformers will refuse this export; qcompress.load_quantized still "
        "reads all of it. " + "; ".join(a[0].upper() + a[1:] for a in advice) + "."
    )


def warn(found: Sequence[Tuple[str, str]], where: str) -> None:
    """One warning naming the modules unreadable() found (nothing if none)."""
    if found:
        warnings.warn(message(found, where), stacklevel=2)
