"""The module-rewriting pass: init_compression, redundancy_clean, summary."""
from __future__ import annotations

import logging
import re
import warnings
import zlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .config import as_config
from .config.compression import CompressionConfig, Group
from .errors import ConfigError
from .nn.layers import CompressMixin, kind_of, make_compress_aware
from .nn.state import ActQuant, WeightQuant
from .schedule import CompressionScheduler, compress_modules

log = logging.getLogger("qcompress")

# Which module kinds each technique applies to.
SUPPORTS = {
    "weight_quantization": ("linear", "conv", "embedding", "hf_conv1d"),
    "activation_quantization": ("linear", "conv", "hf_conv1d"),
    "sparse_pruning": ("linear", "conv", "hf_conv1d"),
    "row_pruning": ("linear", "hf_conv1d"),
    "head_pruning": ("linear", "hf_conv1d"),
    "channel_pruning": ("conv",),
}


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def compressible_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in _unwrap(model).named_modules() if n and kind_of(m) is not None]


def match_group(names: List[Tuple[str, str]], group: Group, technique: str) -> List[str]:
    """Names (of modules this technique supports) that any of the group's regexes re.search."""
    kinds = SUPPORTS[technique]
    pool = [n for n, k in names if k in kinds]
    if group.modules is None:
        return pool
    return [n for n in pool if any(re.search(p, n) for p in group.modules)]


def plan(model: nn.Module, cfg) -> Dict[str, Dict[str, List[str]]]:
    """{technique: {group: [module names]}} for every enabled technique; checks the claims."""
    cc: CompressionConfig = as_config(cfg).compression
    names = [(n, kind_of(m)) for n, m in compressible_modules(model)]
    result = {}
    for tech, technique in cc.techniques():
        if not technique.enabled:
            continue
        claimed: Dict[str, str] = {}
        result[tech] = {}
        for group in technique.groups:
            matched = match_group(names, group, tech)
            path = f"compression_training.{tech}.different_groups.{group.name}.modules"
            for n in matched:
                if n in claimed:
                    raise ConfigError(path, f"module {n!r} is already claimed by group "
                                            f"{claimed[n]!r} of {tech}; a technique may apply to a "
                                            "module only once (narrow one of the regexes)")
                claimed[n] = group.name
            if not matched:
                msg = (f"{path}: group {group.name!r} matches no compressible module "
                       f"(patterns {list(group.modules) if group.modules else 'all'})")
                warnings.warn(msg, stacklevel=3)
                log.warning(msg)
            result[tech][group.name] = matched
    return result


def _weight_quant(cfg, group: Group, module, name: str) -> WeightQuant:
    shared = cfg.compression.weight_quantization.shared
    p = group.params
    kind = module.qc_kind
    gran, gsize, ngroups = p.granularity, p.group_size, None
    if gran is None:
        if kind == "embedding":
            gran = "channel"          # DeepSpeed: one group per vocabulary row
        elif shared.quantize_groups > 1:
            gran, ngroups = "groups", shared.quantize_groups
        else:
            gran = "tensor"
    path = f"compression_training.weight_quantization.different_groups.{group.name}"
    if gran == "groups" and module.weight.numel() % ngroups:
        raise ConfigError("compression_training.weight_quantization.shared_parameters.quantize_groups",
                          f"{ngroups} does not divide the {module.weight.numel()} weights of module "
                          f"{name!r} (shape {tuple(module.weight.shape)}); pick a divisor or set "
                          f"{path}.params.granularity")
    bits = (p.start_bits, p.target_bits)
    if min(bits) <= 2 and shared.quantization_type == "asymmetric" and (min(bits) == 1 or p.ternary):
        raise ConfigError(f"{path}.params.target_bits",
                          f"{min(bits)}-bit weights are binary/ternary, which are symmetric only; "
                          "quantization_type is 'asymmetric'")
    return WeightQuant(
        group=group.name, start_bits=p.start_bits, target_bits=p.target_bits,
        period=p.quantization_period, growth=p.period_growth, offset=shared.schedule_offset,
        symmetric=shared.quantization_type == "symmetric", granularity=gran, group_size=gsize,
        num_groups=ngroups, rounding=shared.rounding, numerics=shared.numerics, ternary=p.ternary,
        clip_grad=shared.ste == "clip", in_forward=shared.quantize_weight_in_forward,
        mix_enabled=shared.fp16_mixed_quantize.enabled,
        change_ratio=shared.fp16_mixed_quantize.quantize_change_ratio,
        seed=(shared.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF if shared.rounding == "stochastic" else 0)


def _act_quant(cfg, group: Group, module) -> ActQuant:
    shared = cfg.compression.activation_quantization.shared
    aq = ActQuant(group=group.name, bits=group.params.bits,
                  symmetric=shared.quantization_type == "symmetric",
                  calibration=shared.range_calibration, offset=shared.schedule_offset,
                  per="sample" if module.qc_kind == "conv" else "token")
    aq.observer.momentum = shared.momentum
    return aq


def init_compression(model: nn.Module, cfg, teacher_model: Optional[nn.Module] = None) -> nn.Module:
    """Rewrite `model` in place so the config's techniques apply; returns the same model.

    Compressible modules become compress-aware subclasses of their own class (parameters keep
    identity, device, dtype and state_dict keys). Each technique's groups claim modules by
    `re.search` on the dotted name; a module claimed twice by one technique is a ConfigError,
    a group that matches nothing is reported with a warning.
    """
    cfg = as_config(cfg)
    cc = cfg.compression
    if cc.layer_reduction.enabled:
        from .pruning.layer_reduction import student_initialization
        if teacher_model is None:
            raise ConfigError("compression_training.layer_reduction.enabled",
                              "layer reduction initialises the student from a teacher: pass "
                              "init_compression(model, cfg, teacher_model=...)")
        student_initialization(model, teacher_model, cc.layer_reduction)
    assignments = plan(model, cfg)
    root = _unwrap(model)
    modules = dict(root.named_modules())
    for tech, groups in assignments.items():
        technique = getattr(cc, tech)
        for group in technique.groups:
            for name in groups.get(group.name, ()):
                mod = make_compress_aware(modules[name], name)
                if tech == "weight_quantization":
                    mod.qc_wq = _weight_quant(cfg, group, mod, name)
                elif tech == "activation_quantization":
                    mod.qc_aq = _act_quant(cfg, group, mod)
                else:
                    from .pruning.setup import enable_pruning
                    enable_pruning(mod, tech, technique.shared, group, name, modules)
    CompressionScheduler(root)  # apply step-0 state so offset-0 techniques act at once
    return model


@torch.no_grad()
def redundancy_clean(model: nn.Module, cfg=None) -> nn.Module:
    """Bake compression into the weights so eval forward is unchanged and no weight fake-quant runs.

    Quantized weights are written in (their integer codes stay on the module for export);
    pruning masks are applied (and pruned structures sliced when the pruning support provides
    it). Activation quantization stays: it is part of the compressed model's numerics.
    """
    root = _unwrap(model)
    for name, mod in compress_modules(root):
        wq = mod.qc_wq
        if wq is not None and wq.active and not wq.baked:
            codes = mod.quantized_weight()
            eff = mod.effective_weight().detach()
            mod.weight.data.copy_(eff)
            wq.baked = True
            mix_done = not (wq.mix_enabled and wq.mix_ratio > 0)
            wq.codes, wq.codes_spec = ((codes[0], codes[1], codes[2]), codes[3]) if mix_done else (None, None)
            wq.master = wq.applied = None
    if cfg is not None and any(m.qc_pruning for _, m in compress_modules(root)):
        from .pruning.clean import clean_pruning
        clean_pruning(root, as_config(cfg))
    return model


def summary(model: nn.Module) -> str:
    """A table of compress-aware modules: techniques, bits in force, granularity."""
    rows = [("module", "type", "weights", "activations", "pruning")]
    for name, mod in compress_modules(_unwrap(model)):
        wq, aq = mod.qc_wq, mod.qc_aq
        if wq is None:
            w = "-"
        else:
            now = f"{wq.bits}" if wq.active else "off"
            if wq.baked:
                now += " (baked)"
            w = f"W{now} →{wq.target_bits} {'sym' if wq.symmetric else 'asym'} {wq.describe()}"
        a = "-" if aq is None else (aq.describe() + ("" if aq.active else " (off)"))
        p = ", ".join(f"{t}:{s.describe()}" for t, s in mod.qc_pruning.items()) or "-"
        base = [c for c in type(mod).__mro__[1:] if not issubclass(c, CompressMixin)][0]
        rows.append((name, base.__name__, w, a, p))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
