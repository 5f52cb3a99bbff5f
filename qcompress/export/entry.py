"""WeightEntry: what one quantized weight becomes on disk. Its own module, so that codes.py
(integer formats) and floats.py (float formats) both build entries without importing each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ..quant.observers import Search


@dataclass
class WeightEntry:
    """What one quantized weight becomes on disk (orientation [out, ...])."""

    bits: int  # bits stored (binary/ternary: 2)
    qtype: str  # int | binary | ternary
    symmetric: bool
    strategy: str  # tensor | channel | group
    group_size: Optional[int]
    fmt: str  # pack-quantized | int-quantized
    shape: list  # weight shape, [out, ...] orientation
    dtype: str  # torch dtype name of the float weight
    transposed: bool  # HF Conv1D: the state_dict weight is the transpose
    target_bits: int
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    observer: str = "minmax"  # how the range was chosen (compressed-tensors' observer name)
    observer_kwargs: Dict[str, object] = field(default_factory=dict)  # the mse search's settings


def observer_kwargs(q) -> Dict[str, object]:
    """compressed-tensors' observer_kwargs of a weight / activation quantizer: the mse search
    (without weight_by and cross_groups, qcompress's own: other tools hand these to their observers)."""
    if q.range_observer != "mse":
        return {}
    out = dataclasses.asdict(Search(*q.range_search))
    out.pop("weight_by")
    out.pop("cross_groups")
    return out
