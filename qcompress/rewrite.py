"""The module-rewriting pass: init_compression, redundancy_clean, summary."""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import lora_rewrite
from .config import as_config
from .quant import floats
from .config.gptq import GPTQ
from .quant.observers import Search
from .config.loader import source_of
from .config.compression import CompressionConfig, Group
from .config.formats import format_at
from .errors import ConfigError
from .unwrap import unwrap
from .nn.layers import CompressMixin, base_class, kind_of, make_compress_aware, restore_class, unsupported_reason
from .nn import experts, kv_cache, ranges
from .nn.lora import peft_adapter_modules
from .nn.state import ActQuant, WeightQuant
from .schedule import CONFIG, REWRITTEN, CompressionScheduler, compress_modules
from .transforms import bake_learned, describe as describe_rotation, prepare_rotations, record_of

log = logging.getLogger("qcompress")

# Which module kinds each technique applies to.
SUPPORTS = {
    "weight_quantization": ("linear", "conv", "embedding", "hf_conv1d", "experts"),
    "activation_quantization": ("linear", "conv", "hf_conv1d", "experts"),
    "sparse_pruning": ("linear", "conv", "hf_conv1d"),
    "row_pruning": ("linear", "hf_conv1d"),
    "head_pruning": ("linear", "hf_conv1d"),
    "channel_pruning": ("conv",),
}


def attention_internals(model: nn.Module) -> List[str]:
    """Names of Linear children of nn.MultiheadAttention: MHA reads their weight directly
    (F.multi_head_attention_forward) and never calls their forward, so they cannot be compressed."""
    return [
        f"{n}.{c}" if n else c
        for n, m in unwrap(model).named_modules()
        if isinstance(m, nn.MultiheadAttention)
        for c, child in m.named_children()
        if kind_of(child) is not None
    ]


def compressible_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    # peft's adapter matrices (lora_A.default, ...) are adapters, not weights to compress (nn/lora.py)
    skip = set(attention_internals(model)) | peft_adapter_modules(unwrap(model))
    found = [
        (n, m)
        for n, m in unwrap(model).named_modules()
        if n and n not in skip and kind_of(m) is not None and not unsupported_reason(m)
    ]
    return found + experts.pending_parts(unwrap(model))  # fused expert matrices (nn/experts.py)


def unsupported_modules(model: nn.Module) -> List[Tuple[str, str, str]]:
    """(name, kind it would have, reason) of weight layers that cannot be compressed (transposed
    convolutions, parametrized or computed weights)."""
    out = []
    for n, m in unwrap(model).named_modules():
        reason = unsupported_reason(m) if n else None
        if reason:
            out.append((n, kind_of(m) or "conv", f"{type(m).__name__}: {reason}"))
    return out


def _check_unsupported(tech: str, group: Group, unsupported, path: str) -> None:
    """A regex that selects a module we cannot compress is refused, naming it; without `modules`
    (every compressible module) such modules are skipped with a warning."""
    hits = [(n, why) for n, kind, why in unsupported if kind in SUPPORTS[tech]]
    if not hits:
        return
    if group.modules is None:
        msg = f"{path}: skipping {len(hits)} module(s) that cannot be compressed: " + "; ".join(
            f"{n!r} ({why})" for n, why in hits
        )
        warnings.warn(msg, stacklevel=4)
        log.warning(msg)
        return
    for i, pattern in enumerate(group.modules):
        for n, why in hits:
            if re.search(pattern, n):
                raise ConfigError(
                    f"{path}[{i}]",
                    f"{pattern!r} selects module {n!r}, which cannot be compressed ({why}); narrow the regex",
                )


def _check_grouped_channel_slicing(group: Group, matched: List[str], modules, path: str) -> None:
    """Channel pruning with related_modules drops the related convs' input channels; a grouped
    (depthwise) conv's groups tie its inputs to its outputs, so refuse it before training rather
    than at redundancy_clean (grouped pruned convs themselves are refused by pruning/setup.py)."""
    if not group.related_modules:
        return
    from .pruning.setup import related_of

    for name in matched:
        for n in related_of("channel_pruning", group, name, modules):
            m = modules[n]
            if kind_of(m) == "conv" and m.groups != 1:
                raise ConfigError(
                    f"{path.rsplit('.', 1)[0]}.related_modules",
                    f"module {n!r} (related to {name!r}) is a grouped convolution "
                    f"(groups={m.groups}): channel pruning cannot slice its input "
                    "channels alone; leave it out of related_modules",
                )


def match_group(names: List[Tuple[str, str]], group: Group, technique: str) -> List[str]:
    """Names (of modules this technique supports) that any of the group's regexes re.search."""
    kinds = SUPPORTS[technique]
    pool = [(n, k) for n, k in names if k in kinds]
    if group.modules is None:
        return [n for n, _ in pool]
    # an expert matrix is selected by its own name or by its experts module's
    return [
        n
        for n, k in pool
        if any(re.search(p, n) or (k == "experts" and re.search(p, experts.owner_name(n))) for p in group.modules)
    ]


_KIND_NAMES = {
    "linear": "Linear",
    "conv": "Conv",
    "embedding": "Embedding",
    "hf_conv1d": "transformers Conv1D",
    "experts": "fused experts",
}


def _other_kinds(names: List[Tuple[str, str]], group: Group, technique: str) -> str:
    """Why a group matched nothing when its regexes do select modules: of kinds the technique
    does not act on (an Embedding named for activation quantization)."""
    if group.modules is None:
        return ""
    hits = [(n, k) for n, k in names if k not in SUPPORTS[technique] and any(re.search(p, n) for p in group.modules)]
    if not hits:
        return ""
    kinds = ", ".join(_KIND_NAMES[k] for k in SUPPORTS[technique])
    shown = ", ".join(f"{n!r} ({_KIND_NAMES.get(k, k)})" for n, k in hits[:5])
    return f"; it selects {shown}{' ...' if len(hits) > 5 else ''}, but {technique} acts on {kinds} only"


def _check_attention_patterns(group: Group, matched: List[str], internals: List[str], path: str):
    """A regex that selects only MHA projections asks for what cannot be done: refuse. A broader
    regex just skips them (reported)."""
    if group.modules is None or not internals:
        return
    for i, pattern in enumerate(group.modules):
        hits = [n for n in internals if re.search(pattern, n)]
        if hits and not any(re.search(pattern, n) for n in matched):
            raise ConfigError(
                f"{path}[{i}]",
                f"{pattern!r} selects {hits}, the projection(s) of an "
                "nn.MultiheadAttention, which reads their weights directly and never "
                "calls their forward, so they cannot be compressed; name other modules",
            )
    skipped = [n for n in internals if any(re.search(p, n) for p in group.modules)]
    if skipped:
        msg = (
            f"{path}: skipping {skipped}: nn.MultiheadAttention never calls their forward, so they cannot be compressed"
        )
        warnings.warn(msg, stacklevel=4)
        log.warning(msg)


def plan(model: nn.Module, cfg) -> Dict[str, Dict[str, List[str]]]:
    """{technique: {group: [module names]}} for every enabled technique; checks the claims."""
    cfg = as_config(cfg)
    cc: CompressionConfig = cfg.compression
    compressible = compressible_modules(model)
    names = [(n, kind_of(m)) for n, m in compressible]
    internals = attention_internals(model)
    unsupported = unsupported_modules(model)
    all_modules = dict(unwrap(model).named_modules())
    result = {}
    for tech, technique in cc.techniques():
        if not technique.enabled:
            continue
        claimed: Dict[str, str] = {}
        result[tech] = {}
        for group in technique.groups:
            matched = match_group(names, group, tech)
            if tech == "sparse_pruning":  # shared_parameters.excluded_modules
                from .pruning.setup import drop_excluded

                matched = drop_excluded(technique, matched)
            path = f"compression_training.{tech}.different_groups.{group.name}.modules"
            _check_attention_patterns(group, matched, internals, path)
            _check_unsupported(tech, group, unsupported, path)
            experts.refuse_unsupported(tech, group.modules, names, SUPPORTS[tech], path)
            if tech == "channel_pruning":
                _check_grouped_channel_slicing(group, matched, all_modules, path)
            for n in matched:
                if n in claimed:
                    raise ConfigError(
                        path,
                        f"module {n!r} is already claimed by group "
                        f"{claimed[n]!r} of {tech}; a technique may apply to a "
                        "module only once (narrow one of the regexes)",
                    )
                claimed[n] = group.name
            if not matched:
                msg = (
                    f"{path}: group {group.name!r} matches no compressible module "
                    f"(patterns {'all' if group.modules is None else list(group.modules)})"
                    f"{_other_kinds(names, group, tech)}{source_of(cfg, path)}"
                )
                warnings.warn(msg, stacklevel=3)
                log.warning(msg)
            result[tech][group.name] = matched
    wq = cc.weight_quantization
    if wq.enabled and any(g.modules is None for g in wq.groups):
        _report_uncompressible(all_modules, compressible, cfg)
    return result


def _report_uncompressible(modules: Dict[str, nn.Module], compressible: List[Tuple[str, nn.Module]], cfg) -> None:
    """'Every compressible module' can leave much of a model in full precision without a word:
    weights that are Parameters of other modules (3-D expert tensors of mixture-of-experts blocks,
    routers, nn.MultiheadAttention's in_proj_weight). Report them when they hold a noticeable share
    (5 %) of the model's matrix parameters, largest first."""
    covered = {id(m.weight) for _, m in compressible}
    seen, others, total = set(), [], 0
    for name, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen or p.dim() < 2 or not p.is_floating_point():
                continue
            seen.add(id(p))
            total += p.numel()
            if id(p) not in covered:
                others.append((p.numel(), f"{name}.{pname}" if name else pname, type(mod).__name__, tuple(p.shape)))
    left = sum(n for n, *_ in others)
    if not total or left < 0.05 * total:
        return
    others.sort(key=lambda o: -o[0])
    shown = "; ".join(f"{n!r} ({cls}, {list(shape)})" for _, n, cls, shape in others[:6])
    path = "compression_training.weight_quantization.different_groups"
    msg = (
        f"{path}: {left / total:.0%} of the model's weight matrices ({left:,} values) are Parameters "
        f"no group can compress (of modules other than Linear / Conv / Embedding / transformers Conv1D, "
        f"or read directly by nn.MultiheadAttention) and stay full precision: "
        f"{shown}{' ...' if len(others) > 6 else ''}{source_of(cfg, path)}"
    )
    warnings.warn(msg, stacklevel=4)
    log.warning(msg)


def _weight_quant(group: Group, module, name: str, vocab_tables=frozenset()) -> WeightQuant:
    """The module's WeightQuant: its group's settings (resolved at load, config/group_settings.py)
    on this module, after the checks that need the module."""
    s = group.settings
    # a head tied to an Embedding (GPT-2's lm_head) quantizes the same table, with the same groups
    gran, gsize, ngroups = s.granularity_at(module.qc_kind == "embedding" or id(module.weight) in vocab_tables)
    path = f"compression_training.weight_quantization.different_groups.{group.name}"
    if ngroups and module.weight.numel() % ngroups:
        raise ConfigError(
            "compression_training.weight_quantization.shared_parameters.quantize_groups",
            f"{ngroups} does not divide the {module.weight.numel()} weights of module "
            f"{name!r} (shape {tuple(module.weight.shape)}); pick a divisor or set "
            f"{path}.params.granularity",
        )
    search = _search(s.observer_kwargs)
    if s.solver == GPTQ:  # the solve's own scale observer chooses the ranges (config/gptq.py)
        _check_gptq_module(module, name, path, ngroups, vocab_tables)
    if ngroups and s.range_observer == "mse" and Search(*search).weight_by == "inputs":
        raise ConfigError(
            f"{path}.params.observer_kwargs.weight_by",
            f"'inputs' weighs each group's error by the inputs of its columns, but module "
            f"{name!r} is quantized in {ngroups} chunks of the flattened weight "
            "(quantize_groups); set granularity (tensor, channel or group) for this group",
        )
    if format_at(s.format, s.target_bits) != "int" or format_at(s.format, s.start_bits) != "int":
        _check_float_module(s, module, name, path)
    bits = (s.start_bits, s.target_bits)
    if min(bits) <= 2 and not s.symmetric and (min(bits) == 1 or s.ternary):
        raise ConfigError(
            f"{path}.params.target_bits",
            f"{min(bits)}-bit weights are binary/ternary, which are symmetric only; quantization_type is 'asymmetric'",
        )
    return WeightQuant(
        group=group.name,
        start_bits=s.start_bits,
        target_bits=s.target_bits,
        period=s.period,
        growth=s.growth,
        offset=s.offset,
        symmetric=s.symmetric,
        granularity=gran,
        group_size=gsize,
        num_groups=ngroups,
        rounding=s.rounding,
        numerics=s.numerics,
        ternary=s.ternary,
        clip_grad=s.clip_grad,
        in_forward=s.in_forward,
        mix_enabled=s.mix_enabled,
        change_ratio=s.change_ratio,
        seed=s.seed_of(name),
        range_observer=s.range_observer,
        range_search=search,
        range_learning=s.range_learning,
        format=s.format,
        solver=s.solver,
        solver_kwargs=s.solver_kwargs,
    )


def _check_gptq_module(module, name: str, path: str, ngroups, vocab_tables) -> None:
    """GPTQ solves a layer against the inputs it multiplies: refuse, naming the module, what has
    no such inputs or cannot keep one solution."""
    kind = module.qc_kind
    if kind not in ("linear", "hf_conv1d", "experts"):
        what = {"embedding": "an Embedding", "conv": "a convolution"}.get(kind, f"a {kind}")
        raise ConfigError(
            f"{path}.modules",
            f"module {name!r} is {what}; observer gptq solves a layer "
            "against the inputs it multiplies (Linear, transformers' Conv1D, fused experts): "
            "leave it out of the group, or give it a minmax / mse group",
        )
    if ngroups:
        raise ConfigError(
            f"{path}.params.granularity",
            f"module {name!r} is quantized in {ngroups} chunks of the "
            "flattened weight (quantize_groups), which cut across GPTQ's columns; set granularity "
            "(tensor, channel or group) for this group",
        )
    if id(module.weight) in vocab_tables:
        raise ConfigError(
            f"{path}.modules",
            f"module {name!r} shares its weight with an embedding (tied "
            "weights); GPTQ would change the embedding too: leave it out of the gptq group "
            "(or untie the weights first)",
        )


def _check_float_module(s, module, name, path) -> None:
    """A ConfigError naming the module where its kind or shape cannot take the float formats of
    its group (s: the group's settings)."""
    if module.qc_kind not in ("linear", "hf_conv1d", "embedding", "experts"):
        raise ConfigError(
            f"{path}.modules",
            f"module {name!r} is a {module.qc_kind}; float formats "
            "quantize matrices (Linear, transformers' Conv1D, Embedding, fused experts), and "
            "compressed-tensors defines no float layout for a conv kernel [out, in, *k] "
            "(its groups would run along the kernel's last dim): leave it out",
        )
    shape = tuple(module.weight_matrix_view(module.weight).shape)
    for bits in range(s.target_bits, s.start_bits + 1):
        f = format_at(s.format, bits)
        reason = f != "int" and floats.check_shape(shape, floats.float_spec(f, s.granularity, s.group_size))
        if reason:
            raise ConfigError(
                f"{path}.params.format",
                f"module {name!r} cannot take {f}: {reason}; leave it out of the group's modules",
            )


def _search(kw) -> tuple:
    """A group's mse search (its observer_kwargs): observers.Search's fields as a tuple."""
    return dataclasses.astuple(
        Search(grid=kw.grid, maxshrink=kw.maxshrink, norm=kw.norm, weight_by=kw.weight_by, cross_groups=kw.cross_groups)
    )


def _act_quant(group: Group, module) -> ActQuant:
    """The module's ActQuant: its group's settings (resolved at load) on this module."""
    s = group.settings
    aq = ActQuant(
        group=group.name,
        bits=s.bits,
        symmetric=s.symmetric,
        calibration=s.calibration,
        offset=s.offset,
        per="sample" if module.qc_kind == "conv" else "token",
        range_observer=s.observer,
        range_search=_search(s.observer_kwargs),
        range_learning=s.range_learning,
        fused=s.fused,
        share_input=s.share_input,
        int8_forward=s.int8_forward,
        format=s.format,
        group_size=s.group_size,
    )
    if aq.format != "int" and module.qc_kind == "conv":
        raise ConfigError(
            f"compression_training.activation_quantization.different_groups.{group.name}.modules",
            f"module {module.qc_name!r} is a convolution; float-format activations are "
            "per token or group of a Linear's input: leave it out",
        )
    width = module.weight_matrix_view(module.weight).shape[-1] if module.qc_kind != "embedding" else None
    gsize = s.float_group_size
    if aq.format != "int" and gsize and width and width % gsize:
        raise ConfigError(
            f"compression_training.activation_quantization.different_groups.{group.name}.modules",
            f"module {module.qc_name!r} takes {width} inputs, not a multiple of the "
            f"{aq.format} activation groups of {gsize}; leave it out of the group's modules",
        )
    aq.observer.momentum = s.momentum
    return aq


def init_compression(model: nn.Module, cfg, teacher_model: Optional[nn.Module] = None) -> nn.Module:
    """Rewrite `model` in place so the config's techniques apply; returns the same model.

    An enabled `rotation` section rotates the model first (qcompress.transforms: the function is
    unchanged in full precision), so the quantizers see the rotated weights.
    Compressible modules become compress-aware subclasses of their own class (parameters keep
    identity, device, dtype and state_dict keys); with `progressive_layer_drop` enabled, the
    repeated transformer blocks become droppable the same way (qcompress.nn.pld). Each technique's
    groups claim modules by `re.search` on the dotted name; a module claimed twice by one technique is a ConfigError,
    a group that matches nothing is reported with a warning.
    """
    cfg = as_config(cfg)
    try:
        return _init_compression(model, cfg, teacher_model)
    except ConfigError as err:
        where = source_of(cfg, err.path)
        if not where or str(err).endswith(where):
            raise
        raise ConfigError(err.path, f"{str(err)[len(err.path) + 2 :] if err.path else err}{where}") from None


def _init_compression(model: nn.Module, cfg, teacher_model: Optional[nn.Module]) -> nn.Module:
    cc = cfg.compression
    done = [n for n, _ in compress_modules(unwrap(model))]
    if done:
        # A second rewrite would keep the first config's settings on modules the second does not
        # claim, and in optimizer-step mode take the already quantized weights as new masters.
        raise ValueError(
            f"init_compression: the model was already rewritten by init_compression "
            f"({len(done)} compress-aware modules, e.g. {done[0]!r}); a second call would "
            "mix both configs and, with quantize_weight_in_forward: false, take the "
            "quantized weights as the full-precision masters. Apply the config to a "
            "freshly built model instead"
        )
    if cc.layer_reduction.enabled and teacher_model is None:
        raise ConfigError(
            "compression_training.layer_reduction.enabled",
            "layer reduction initialises the student from a teacher: pass "
            "init_compression(model, cfg, teacher_model=...)",
        )
    assignments = plan(model, cfg)  # checks the claims before anything is written
    assignments["kv_cache_quantization"] = kv_cache.plan(model, cc.kv_cache_quantization)
    rotation = prepare_rotations(model, cfg)  # and the rotations' (transforms/), None when off
    root = unwrap(model)
    lora_plan = lora_rewrite.check(root, cfg, compressible_modules(model), assignments)
    # the student's tensors before layer reduction overwrites some with the teacher's (a later
    # error puts them back)
    students = (
        [(t, t.detach().clone()) for t in root.state_dict(keep_vars=True).values()]
        if cc.layer_reduction.enabled
        else []
    )
    rotated = None
    try:
        if cc.layer_reduction.enabled:
            from .pruning.layer_reduction import student_initialization

            student_initialization(model, teacher_model, cc.layer_reduction)
        # rotations first: the module rewrite (quantizers, observers) then sees the rotated weights
        rotated = rotation.apply() if rotation is not None else None
        out = _rewrite_all(model, root, cfg, assignments, lora_plan)
        if rotated is not None:
            rotated.release()
        return out
    except BaseException:
        if rotated is not None:
            rotated.undo()
        with torch.no_grad():
            for t, saved in students:
                t.copy_(saved)
        raise


def _rewrite_all(model: nn.Module, root: nn.Module, cfg, assignments, lora_plan=None) -> nn.Module:
    modules = dict(root.named_modules())
    modules.update(experts.pending_parts(root))  # attached to their experts modules by _rewrite
    # what each module holds now, so a config error found while rewriting leaves the model as it was
    before = {
        id(m): (set(m._parameters), set(m._buffers), set(m._forward_hooks), set(m._forward_pre_hooks))
        for m in modules.values()
    }
    from .nn.pld import apply_pld, pld_schedule, remove_pld

    had_pld = pld_schedule(root) is not None
    kv_names = assignments.pop("kv_cache_quantization", [])
    try:
        _rewrite(root, cfg, assignments, modules)
        kv_cache.install(root, cfg.compression.kv_cache_quantization, kv_names)
        if lora_plan is not None:
            lora_rewrite.attach(root, cfg, lora_plan, modules)
        CompressionScheduler(root)  # apply step-0 state so offset-0 techniques act at once
        if lora_plan is not None:  # qlora stores its bases at step 0's bits; then all but adapters freeze
            lora_rewrite.finish(root, lora_plan, modules)
        if cfg.progressive_layer_drop.enabled and not had_pld:
            apply_pld(root, cfg.progressive_layer_drop)  # a second init_compression leaves the blocks
    except BaseException:
        if not had_pld:
            remove_pld(root)
        kv_cache.uninstall(root)
        _undo_rewrite(modules, before)
        lora_rewrite.undo(root)
        raise
    root.__dict__[REWRITTEN] = True  # lets CompressionScheduler(model, cfg) tell a forgotten rewrite
    root.__dict__[CONFIG] = cfg.raw  # a plain dict: the model still pickles with few globals
    return model


def _rewrite(root: nn.Module, cfg, assignments, modules) -> None:
    cc = cfg.compression
    vocab_tables = {id(m.weight) for m in modules.values() if isinstance(m, nn.Embedding)}
    learned = set()
    for tech, groups in assignments.items():
        technique = getattr(cc, tech)
        for group in technique.groups:
            for name in groups.get(group.name, ()):
                mod = make_compress_aware(modules[name], name)
                gpath = f"compression_training.{tech}.different_groups.{group.name}.params.range_learning"
                if tech == "weight_quantization":
                    mod.qc_wq = _weight_quant(group, mod, name, vocab_tables)
                    if mod.qc_kind == "experts":
                        experts.check_weight(mod, gpath.rsplit(".", 2)[0])
                    if mod.qc_wq.range_learning and id(mod.weight) not in learned:
                        learned.add(id(mod.weight))  # tied weights share the first one's scales
                        ranges.register_weight_ranges(mod, gpath)
                elif tech == "activation_quantization":
                    mod.qc_aq = _act_quant(group, mod)
                    if mod.qc_kind == "experts" and not experts.check_act(
                        mod, gpath.rsplit(".", 2)[0], group.modules is not None
                    ):
                        mod.qc_aq = None
                    if mod.qc_aq is not None and mod.qc_aq.range_learning:
                        ranges.register_input_ranges(mod, gpath)
                else:
                    from .pruning.setup import enable_pruning

                    enable_pruning(mod, tech, technique.shared, group, name, modules)
    experts.attach(m for m in modules.values() if isinstance(m, experts.ExpertMatrix))
    _share_tied_weights(root)
    _warn_tied_unselected(root)
    _keep_python_forward(root)


@torch.no_grad()
def _undo_rewrite(modules: Dict[str, nn.Module], before) -> None:
    """Put back what a failed init_compression changed: full-precision weights written over by
    the optimizer-step mode, registered scale / score Parameters, the modules' classes."""
    experts.detach(modules.values())
    for mod in modules.values():
        params, buffers, hooks, pre_hooks = before[id(mod)]
        # hooks the rewrite added, here or on related modules (a channel-pruned conv's BatchNorm)
        for key in [k for k in mod._forward_hooks if k not in hooks]:
            del mod._forward_hooks[key]
        for key in [k for k in mod._forward_pre_hooks if k not in pre_hooks]:
            del mod._forward_pre_hooks[key]
        if not isinstance(mod, CompressMixin):
            continue
        wq = mod.__dict__.get("qc_wq")
        if wq is not None and wq.master is not None:
            mod.weight.data.copy_(wq.master.to(mod.weight.dtype))
            wq.store.reset()
        for key in [k for k in mod._parameters if k not in params]:
            del mod._parameters[key]
        for key in [k for k in mod._buffers if k not in buffers]:
            del mod._buffers[key]
        restore_class(mod)


def _share_tied_weights(root: nn.Module) -> None:
    """Modules that use one weight Parameter (tied embeddings) share one master copy, so the
    weight has one full-precision history; they must quantize it the same way."""
    owner: Dict[int, Tuple[str, CompressMixin]] = {}
    for name, mod in compress_modules(root):
        if mod.qc_wq is None:
            continue
        first_name, first = owner.setdefault(id(mod.weight), (name, mod))
        if first is mod:
            continue
        _check_same_quantization(first_name, first, name, mod)
        if mod.qc_wq.solver is not None:
            raise ConfigError(
                f"compression_training.weight_quantization.different_groups.{mod.qc_wq.group}.modules",
                f"modules {first_name!r} and {name!r} share one weight Parameter (tied weights); "
                f"observer {mod.qc_wq.solver} solves one layer's weights against its own inputs: "
                "quantize only one of them with it, or untie the weights",
            )
        mod.qc_wq.store = first.qc_wq.store
        mod.qc_wq.seed = first.qc_wq.seed  # same stochastic rounding of the same tensor
        for pname in ranges.WEIGHT_PARAMS:  # one learned scale for one weight
            # registered on the tied module whose group the config lists first, which need not
            # be the first in the model (lm_head's group before wte's)
            shared = first._parameters.get(pname)
            if shared is None:
                shared = mod._parameters.get(pname)
            if shared is not None:
                first._parameters[pname] = mod._parameters[pname] = shared


def _warn_tied_unselected(root: nn.Module) -> None:
    """Optimizer-step mode writes the quantized weight into the Parameter itself, so a module tied
    to it (GPT-2's wte under lm_head) uses it too, although no group selected that module."""
    written = {id(m.weight): n for n, m in compress_modules(root) if m.qc_wq is not None and not m.qc_wq.in_forward}
    if not written:
        return
    for name, mod in root.named_modules():
        w = mod._parameters.get("weight") if name else None
        if w is None or id(w) not in written or getattr(mod, "qc_wq", None) is not None:
            continue
        msg = (
            f"compression_training.weight_quantization: module {name!r} shares its weight Parameter "
            f"with {written[id(w)]!r} (tied weights), which is quantized with "
            "quantize_weight_in_forward: false, i.e. written into that Parameter at each step: "
            f"{name!r} uses the quantized weight too, although no group selects it"
        )
        warnings.warn(msg, stacklevel=3)
        log.warning(msg)


def _check_same_quantization(name_a: str, a: CompressMixin, name_b: str, b: CompressMixin) -> None:
    sa, sb = a.qc_wq.settings(), b.qc_wq.settings()
    diff = [f"{k} {sa[k]!r} vs {sb[k]!r}" for k in sa if sa[k] != sb[k]]
    transposed = (a.qc_kind == "hf_conv1d") != (b.qc_kind == "hf_conv1d")
    if transposed and sa["granularity"] != "tensor":
        diff.append(f"{sa['granularity']} groups over transposed layouts ({a.qc_kind} vs {b.qc_kind})")
    if diff:
        raise ConfigError(
            f"compression_training.weight_quantization.different_groups.{b.qc_wq.group}",
            f"modules {name_a!r} (group {a.qc_wq.group!r}) and {name_b!r} (group "
            f"{b.qc_wq.group!r}) share one weight Parameter (tied weights) but would "
            f"quantize it differently: {'; '.join(diff)}. Give both the same bits, "
            "schedule and granularity, or quantize only one of them",
        )


def _fast_path_guard(module, args):
    """Forward pre-hook that does nothing: its presence keeps TransformerEncoderLayer off its fused
    inference path, which reads the Linear weights directly and would skip compression."""
    return None


def _keep_python_forward(root: nn.Module) -> None:
    for layer in root.modules():
        if isinstance(layer, nn.TransformerEncoderLayer):
            for mod in layer.modules():
                if _acts_in_forward(mod) and _fast_path_guard not in mod._forward_pre_hooks.values():
                    mod.register_forward_pre_hook(_fast_path_guard)


def _acts_in_forward(mod) -> bool:
    """Whether the module's forward does the compression (not only the optimizer-step rewrite)."""
    if not isinstance(mod, CompressMixin):
        return False
    return bool((mod.qc_wq is not None and mod.qc_wq.in_forward) or mod.qc_aq is not None or mod.qc_pruning)


@torch.no_grad()
def redundancy_clean(model: nn.Module, cfg=None) -> nn.Module:
    """Bake compression into the weights so eval forward is unchanged and no weight fake-quant runs.

    Quantized weights are written in (their integer codes stay on the module for export);
    pruning masks are applied (and pruned structures sliced when the pruning support provides
    it). Activation quantization stays: it is part of the compressed model's numerics.
    """
    root = unwrap(model)
    bake_learned(root)  # learned rotations into the weights first: the codes are those of the rotated weights
    baked = set()  # tied weights: bake the shared Parameter once (re-quantizing may move it)
    for name, mod in compress_modules(root):
        wq = mod.qc_wq
        if wq is not None and wq.active and not wq.baked and id(mod.weight) in baked:
            wq.baked = True  # the shared MasterState already holds the codes
            continue
        if wq is not None and wq.active and not wq.baked:
            baked.add(id(mod.weight))
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
    for name, mod in compress_modules(unwrap(model)):
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
        base = base_class(type(mod))
        cls = base.__name__ if mod.qc_kind != "experts" else experts.describe(mod)
        rows.append((name, cls, w, a, p))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    kv = kv_cache.quantized_modules(model)
    if kv:
        state = kv[0][1].__dict__[kv_cache.ATTR]
        lines.append(f"KV cache: {state.describe()}, {len(kv)} attention modules" + ("" if state.active else " (off)"))
    rotation = describe_rotation(record_of(unwrap(model)))
    return "\n".join(lines + ([rotation] if rotation else []))
