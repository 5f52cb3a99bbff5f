"""Optimizer groups for learned ranges: their own lr and no weight decay.

AdamW moves each parameter by about lr per step whatever its gradient; at the weights' lr that is
a sizeable share of a 4-bit scale per step, so learned scales in the weights' group random-walk
instead of following their gradient, and QAD recovers less of the PTQ gap
(benchmarks/results/quality.md). Weight decay would pull every scale towards 0.
`qcompress train` and qcompress.hf.CompressionTrainer build their default optimizer with these groups.
"""

from __future__ import annotations

from typing import List, Optional

import torch

RANGE_LR_FACTOR = 0.1  # learned ranges' lr relative to the weights' (see the docstring)


def range_parameter_ids(model: Optional[torch.nn.Module]) -> set:
    """ids of the model's learned-range Parameters, read when the optimizer is built (after any
    FSDP2 wrapping replaced the Parameters)."""
    if model is None:
        return set()
    from .kv_cache import learned_parameter_ids
    from .layers import CompressMixin
    from .ranges import range_parameter_names

    return {
        id(m._parameters[n]) for m in model.modules() if isinstance(m, CompressMixin) for n in range_parameter_names(m)
    } | learned_parameter_ids(model)


def split_range_groups(groups: List[dict], ids: set, lr: Optional[float] = None) -> List[dict]:
    """The groups with the parameters in `ids` moved into groups of their own (one per source
    group, its other settings kept): lr x RANGE_LR_FACTOR (the group's lr, else `lr`), no weight
    decay. Groups left empty are dropped."""
    out = []
    for g in groups:
        ps = list(g["params"])
        rest = [p for p in ps if id(p) not in ids]
        rng = [p for p in ps if id(p) in ids]
        out += [dict(g, params=rest)] if rest else []
        if rng:
            base = g.get("lr", lr)
            if base is None:
                raise ValueError("split_range_groups: a group without 'lr' and no default lr given")
            out.append(dict(g, params=rng, lr=base * RANGE_LR_FACTOR, weight_decay=0.0))
    return out


def split_range_groups_(optimizer: torch.optim.Optimizer, ids: set) -> int:
    """The same on a freshly built optimizer, in place (before any step or LR scheduler: both
    would record the old groups). Returns the number of range parameters moved."""
    if not ids or any(optimizer.state.values()):
        return 0
    moved = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) in ids)
    if moved:
        groups = split_range_groups(optimizer.param_groups, ids)
        optimizer.param_groups.clear()
        for g in groups:
            optimizer.add_param_group(g)
    return moved
