"""The LoRA step of init_compression: which layers take adapters, the checks, attaching, freezing.

Called by rewrite.py in three parts: `check` before anything is changed (every refusal is a
ConfigError naming the key and what to do), `attach` after the technique rewrite (adapters
registered, or a peft model's adopted), `finish` after the schedule's step 0 (qlora bases stored
as codes, everything but the adapters and qcompress's own trained tensors frozen).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.nn as nn

from .errors import ConfigError
from .nn import experts, lora, qlora
from .nn.layers import CompressMixin, kind_of, make_compress_aware, own_forward

log = logging.getLogger("qcompress")

PATH = "compression_training.lora"
WQ = "compression_training.weight_quantization"
KINDS = ("linear", "hf_conv1d")
PRUNING = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


@dataclass
class LoraPlan:
    mode: str
    targets: List[str]  # names of the layers that take adapters
    peft: Dict[str, nn.Module] = field(default_factory=dict)  # target (base layer) -> peft layer
    quantized: Dict[str, str] = field(default_factory=dict)  # target -> its weight group


def _warn(msg: str) -> None:
    warnings.warn(msg, stacklevel=5)
    log.warning(msg)


def check(root: nn.Module, cfg, compressible, assignments) -> Optional[LoraPlan]:
    """The layers the `lora` section adapts (None when it is off), or a ConfigError."""
    lc = cfg.compression.lora
    layers = lora.peft_lora_layers(root)
    weight_groups = assignments.get("weight_quantization", {})
    quantized = {n: g for g, names in weight_groups.items() for n in names}
    if not lc.enabled:
        hit = next((f"{n}.base_layer" for n, _ in layers if f"{n}.base_layer" in quantized), None)
        if hit is not None:
            raise ConfigError(
                f"{PATH}.enabled",
                f"the model holds peft LoRA layers and weight quantization "
                f"selects their base layers ({hit!r} ...), but the lora section is off: the "
                "adapters would add a full-precision update outside the quantized weight, which "
                "no export can hold. Set enabled: true (mode qat merges them into what the "
                "quantizer sees; qlora keeps them beside the quantized base)",
            )
        return None
    modules = dict(root.named_modules())
    if layers:
        plan = _peft_targets(root, cfg, layers, modules)
    else:
        plan = LoraPlan(mode=lc.mode, targets=_match(root, lc.target_modules, compressible))
    plan.quantized = {n: quantized[n] for n in plan.targets if n in quantized}
    tied = _tied_names(root)
    for name in plan.targets:
        _check_target(name, modules[name], tied)
    _check_groups(cfg, plan, assignments)
    return plan


def _peft_targets(root, cfg, layers, modules) -> LoraPlan:
    """A peft-wrapped model: its LoRA layers are the adapters; the section gives the mode only."""
    lc = cfg.compression.lora
    raw = ((getattr(cfg, "raw", None) or {}).get("compression_training") or {}).get("lora") or {}
    for key in ("r", "alpha", "dropout", "target_modules"):
        if key in raw:
            raise ConfigError(
                f"{PATH}.{key}",
                "the model is already wrapped by peft, whose LoraConfig sets "
                "the adapters' rank, scaling, dropout and targets; drop this key (the section's "
                "enabled, mode and merge still apply)",
            )
    plan = LoraPlan(mode=lc.mode, targets=[])
    for name, layer in layers:
        where = f"peft LoRA layer {name!r}"
        base = getattr(layer, "base_layer", None)
        if kind_of(base) not in KINDS:
            raise ConfigError(
                f"{PATH}.enabled",
                f"{where} adapts a {type(base).__name__}; qcompress merges "
                "adapters of Linear (and transformers Conv1D) layers only: leave it out of peft's "
                "target_modules",
            )
        adapters = list(layer.lora_A.keys())
        if len(adapters) != 1:
            raise ConfigError(
                f"{PATH}.enabled",
                f"{where} holds {len(adapters)} adapters {adapters}; one "
                "adapter per layer is trained and exported: delete the others (delete_adapter)",
            )
        a = adapters[0]
        variants = [v for v in ("use_dora", "lora_bias") if getattr(layer, v, {}).get(a)]
        variants += ["a variant"] if getattr(layer, "lora_variant", {}).get(a) is not None and not variants else []
        if variants:
            raise ConfigError(
                f"{PATH}.enabled",
                f"{where} uses {', '.join(variants)}; qcompress merges plain "
                "LoRA (W + (B A) * scaling) only: build the peft model without it",
            )
        if getattr(layer, "merged_adapters", None):
            raise ConfigError(
                f"{PATH}.enabled",
                f"{where} has its adapter merged into the base weight "
                "already; unmerge it (model.unmerge_adapter()) before init_compression",
            )
        if lc.mode == "qat" and float(getattr(layer.lora_dropout[a], "p", 0.0)) > 0.0:
            raise ConfigError(
                f"{PATH}.mode",
                f"{where} has lora_dropout "
                f"{float(layer.lora_dropout[a].p)}, but mode qat merges the adapter into one "
                "weight, where dropout on the adapter's input has no place: build the peft model "
                "with lora_dropout=0, or use mode qlora",
            )
        target = f"{name}.base_layer"
        plan.targets.append(target)
        plan.peft[target] = layer
    return plan


def _match(root, patterns, compressible) -> List[str]:
    """Layers the regexes select (every Linear / Conv1D but the output head when they are 'all');
    each regex must select one, and never a fused experts module."""
    names = [(n, kind_of(m), m) for n, m in compressible]
    if patterns is None:
        head = getattr(root, "get_output_embeddings", None)
        head = head() if callable(head) else None
        out = []
        for n, k, m in names:
            if k not in KINDS or m is head:
                continue
            if own_forward(type(m)) is not None:
                _warn(
                    f"{PATH}.target_modules: skipping {n!r}: {type(m).__name__} defines its own forward, "
                    "where no adapter can be merged"
                )
                continue
            out.append(n)
        if not out:
            raise ConfigError(f"{PATH}.target_modules", "the model has no Linear layer to adapt")
        return out
    out = []
    for i, p in enumerate(patterns):
        where = f"{PATH}.target_modules[{i}]"
        for n, k, _ in names:
            if k == "experts" and (re.search(p, n) or re.search(p, experts.owner_name(n))):
                raise ConfigError(
                    where,
                    f"{p!r} selects {n!r}, a fused mixture-of-experts Parameter (all "
                    "experts in one 3-D tensor); LoRA adapts Linear layers: narrow the regex to "
                    "the attention / dense layers (models whose experts are nn.Linear modules "
                    "take one adapter per expert)",
                )
        hits = [n for n, k, _ in names if k in KINDS and re.search(p, n)]
        if not hits:
            others = [f"{n!r} ({type(m).__name__})" for n, k, m in names if re.search(p, n)][:3]
            why = f"; it selects {', '.join(others)}, but adapters go on Linear layers only" if others else ""
            raise ConfigError(
                where,
                f"{p!r} matches no Linear layer of the model{why}; patterns are regexes "
                "searched in dotted module names (e.g. 'q_proj', 'self_attn\\.(q|v)_proj')",
            )
        out.extend(n for n in hits if n not in out)
    return out


def _tied_names(root) -> Dict[int, List[str]]:
    users: Dict[int, List[str]] = {}
    for n, m in root.named_modules(remove_duplicate=False):
        w = m._parameters.get("weight") if n else None
        if w is not None and n not in users.setdefault(id(w), []):
            users[id(w)].append(n)
    return users


def _check_target(name, mod, tied) -> None:
    where = f"{PATH}.target_modules"
    if kind_of(mod) not in KINDS:
        raise ConfigError(where, f"module {name!r} is a {type(mod).__name__}; adapters go on Linear layers")
    if own_forward(type(mod)) is not None:
        raise ConfigError(
            where,
            f"module {name!r} ({type(mod).__name__}) defines its own forward, where no "
            "adapter can be merged; leave it out",
        )
    users = tied.get(id(mod._parameters.get("weight")), [])
    others = [n for n in users if n != name]
    if others:
        raise ConfigError(
            where,
            f"module {name!r} shares its weight with {others[0]!r} (tied weights): an "
            "adapter merged into it would change both; leave it out",
        )


def _check_groups(cfg, plan: LoraPlan, assignments) -> None:
    """What each mode needs of the weight quantization of the adapted layers."""
    wq = cfg.compression.weight_quantization
    groups = {g.name: g for g in wq.groups}
    if not plan.quantized:
        return
    first = next(iter(plan.quantized))
    technique_wide = groups[plan.quantized[first]].settings  # shared_parameters' keys, as resolved
    if plan.mode == "qat":
        if not technique_wide.in_forward:
            raise ConfigError(
                f"{WQ}.shared_parameters.quantize_weight_in_forward",
                f"is false, but LoRA layers ({first!r} ...) are quantized as W + (B A) * scaling, "
                "which changes with every adapter step and is made in forward: set it to true",
            )
        return
    # qlora: the base is quantized once, at step 0, into codes that never change
    pruned = [(t, n) for t in PRUNING for g in assignments.get(t, {}).values() for n in g if n in plan.quantized]
    if pruned:
        raise ConfigError(
            f"compression_training.{pruned[0][0]}",
            f"selects {pruned[0][1]!r}, whose base mode "
            "qlora stores as fixed codes: pruning masks cannot act on it; leave it out or use mode qat",
        )
    if technique_wide.offset != 0:
        raise ConfigError(
            f"{WQ}.shared_parameters.schedule_offset",
            f"is {technique_wide.offset}, but mode qlora "
            "stores the adapted layers' base quantized at step 0: set it to 0",
        )
    if technique_wide.mix_enabled:
        raise ConfigError(
            f"{WQ}.shared_parameters.fp16_mixed_quantize.enabled",
            "mode qlora stores the base "
            "quantized once; a blend with the full-precision weight has nothing to blend: turn it off",
        )
    for name, gname in plan.quantized.items():
        group = groups[gname]
        gpath = f"{WQ}.different_groups.{gname}"
        st = group.settings
        used = st.listed_formats
        if used != {"int"}:
            raise ConfigError(
                f"{WQ}.{st.at('format')}",
                f"{sorted(used - {'int'})} for {name!r}: mode qlora "
                "stores the base as integer codes, and these float formats have no stored-quantized "
                "path here; use an int format, or mode qat (which trains every format)",
            )
        if st.start_bits != st.target_bits:
            raise ConfigError(
                f"{gpath}.params.start_bits",
                f"{st.start_bits} differs from target_bits "
                f"{st.target_bits}, but mode qlora stores {name!r} once, at its final "
                "bits: set start_bits to target_bits",
            )
        if st.range_learning:
            raise ConfigError(
                f"{WQ}.{st.at('range_learning')}",
                f"mode qlora keeps the base of {name!r} as "
                "fixed codes and scales; learned ranges would move them: turn range_learning off, "
                "or use mode qat",
            )


def attach(root: nn.Module, cfg, plan: LoraPlan, modules) -> None:
    """Adapters onto the targets (made compress-aware where no technique claimed them)."""
    lc = cfg.compression.lora
    for name in plan.targets:
        mod = make_compress_aware(modules[name], name)
        if name in plan.peft:
            lora.adopt_peft(plan.peft[name], mod, plan.mode)
        else:
            lora.add_adapter(
                mod, mode=plan.mode, r=lc.r, alpha=lc.r if lc.alpha is None else lc.alpha, dropout=lc.dropout
            )
        lora.state(mod).merge = bool(lc.merge)
        if plan.mode == "qlora" and name not in plan.quantized:
            qlora.use_qlora_forward(mod)


def finish(root: nn.Module, plan: LoraPlan, modules) -> None:
    """qlora: store the quantized bases as codes. Then freeze all but the adapters and the tensors
    qcompress's techniques train (learned ranges, pruning scores)."""
    if plan.mode == "qlora":
        codes = {}
        for name in plan.quantized:
            got = qlora.stored_codes(modules[name])
            if isinstance(got, str):
                raise ConfigError(
                    f"{WQ}.different_groups.{plan.quantized[name]}",
                    f"mode qlora cannot store the base of {name!r}: {got}",
                )
            codes[name] = got
        for name, got in codes.items():
            qlora.store_base(modules[name], got)
    keep = set()
    for name, mod in root.named_modules():
        if isinstance(mod, CompressMixin):
            keep.update(id(p) for k, p in mod._parameters.items() if k not in ("weight", "bias") and p is not None)
            if lora.state(mod) is not None:
                keep.update(id(p) for p in lora.adapter_parameters(mod))
    for p in root.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def undo(root: nn.Module) -> None:
    """Put peft's layers back (their own forward) after a failed init_compression."""
    for mod in root.modules():
        if getattr(type(mod), "qc_adopted", False):
            mod.__class__ = type(mod).__mro__[1]
        mod.__dict__.pop("qc_lora", None)
