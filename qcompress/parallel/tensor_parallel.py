"""Tensor-parallel plans applied with DTensor's parallelize_module, checked against compression.

A plan maps module names to colwise / rowwise: the config's tensor_parallel.tp_plan (regexes,
re.search on the dotted name, as compression groups match modules) or else the model's own
transformers base_model_tp_plan (globs relative to the base model). Every planned module is an
nn.Linear; its quantizers are checked (nn/sharded.py check_split) before anything is split.
"""

from __future__ import annotations

import re
from typing import Dict

import torch.nn as nn

from ..errors import ConfigError
from ..nn.sharded import check_split

_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}


def _glob_regex(pattern: str) -> str:
    # transformers' plans write layers.*.mlp.up_proj: * stands for one name component
    return r"(^|\.)" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + r"$"


def resolve_plan(model: nn.Module, tp_cfg) -> Dict[str, str]:
    """{module name: colwise | rowwise}; ConfigError when there is no plan or one matches nothing."""
    names = [n for n, _ in model.named_modules() if n]
    if tp_cfg.tp_plan is not None:
        rules, source = [(re.compile(p), s) for p, s in tp_cfg.tp_plan.items()], "tensor_parallel.tp_plan"
    else:
        hf = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if not hf:
            raise ConfigError(
                "tensor_parallel.tp_plan",
                f"{type(model).__name__} has no base_model_tp_plan "
                "(transformers' tensor-parallel plan); give one: module regex -> colwise | rowwise",
            )
        rules, source = [], "the model's base_model_tp_plan"
        for pattern, style in hf.items():
            if style not in _HF_STYLES:
                raise ConfigError(
                    "tensor_parallel.tp_plan",
                    f"the model's base_model_tp_plan asks {style!r} for "
                    f"{pattern!r}, which qcompress does not apply; give a plan of colwise / rowwise",
                )
            rules.append((re.compile(_glob_regex(pattern)), _HF_STYLES[style]))
    plan = {}
    for name in names:
        for rx, style in rules:
            if rx.search(name):
                plan[name] = style
                break
    if not plan:
        raise ConfigError("tensor_parallel.tp_plan", f"{source} matches no module of {type(model).__name__}")
    return plan


def _check_module(name: str, mod: nn.Module, style: str, tp: int) -> None:
    if not isinstance(mod, nn.Linear):
        raise ConfigError(
            "tensor_parallel.tp_plan",
            f"module {name!r} ({type(mod).__name__}) is planned {style}, but only nn.Linear layers are split",
        )
    size, what = (mod.out_features, "output") if style == "colwise" else (mod.in_features, "input")
    if size % tp:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"{tp} does not divide the {size} {what} features of {style}-parallel module {name!r}",
        )
    if getattr(mod, "qc_pruning", None):
        raise ConfigError(
            "compression_training",
            f"module {name!r} is {style}-parallel: pruning masks of a sharded weight are not supported",
        )
    wq, aq = getattr(mod, "qc_wq", None), getattr(mod, "qc_aq", None)
    path = (
        "compression_training.weight_quantization.different_groups." + wq.group + ".params"
        if wq is not None
        else "compression_training"
    )
    check_split(name, wq, aq, style, mod.in_features, tp, path)


def apply_tensor_parallel(model: nn.Module, tp_mesh, tp_cfg) -> Dict[str, str]:
    """Split the planned Linear layers over the 1-D `tp_mesh`; returns the plan applied."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    plan = resolve_plan(model, tp_cfg)
    modules = dict(model.named_modules())
    for name, style in plan.items():
        _check_module(name, modules[name], style, tp)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in plan.items()})
    return plan
