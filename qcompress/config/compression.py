"""Typed schema of the `compression_training` section (DeepSpeed's layout, its code's defaults).

Where DeepSpeed's docs and code disagree we follow the code: activation `range_calibration`
defaults to `dynamic` and every technique but weight quantization has `schedule_offset: 1000`.
Our extensions are marked "ext" below and documented in README.md.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from ..errors import ConfigError
from .formats import check_act_group, check_weight_group, parse_format
from .group_settings import act_settings, weight_settings
from .rotation import Rotation, check_with as _check_rotation
from .kv_cache import KVCacheQuantization
from .lora import Lora
from .gptq import GPTQ, GptqKwargs, check_group as check_gptq_group, check_kwargs as check_gptq_kwargs
from .schema import field, join, parse

QUANT_TYPES = ("symmetric", "asymmetric")
OBSERVERS = ("minmax", "mse")  # compressed-tensors' observer names
WEIGHT_OBSERVERS = OBSERVERS + (GPTQ,)  # ext: gptq solves the weights on calibration data (config/gptq.py)
ALL_MODULES = None  # `modules` missing or "all": every compressible module


def _parse_patterns(value, path):
    """A `modules` list: regexes matched with re.search; "all"/"*"/missing mean every module."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list of regex strings, got {value!r}")
    out = []
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str):
            raise ConfigError(join(path, i), f"expected a regex string, got {pattern!r}")
        if pattern in ("all", "*"):
            return ALL_MODULES
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as err:  # too deep / huge repeat count
            raise ConfigError(join(path, i), f"{pattern!r} is not a valid regex ({err})") from None
        out.append(pattern)
    return tuple(out)


def _parse_excluded(value, path):
    """sparse_pruning excluded_modules: regexes (re.search) of modules never sparse-pruned."""
    patterns = _parse_patterns(value, path)
    if patterns is ALL_MODULES:
        raise ConfigError(path, "'all' would exclude every module; disable sparse pruning instead")
    return patterns


def _parse_related(value, path):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list of lists of regex strings, got {value!r}")
    out = []
    for i, inner in enumerate(value):
        patterns = _parse_patterns(inner, join(path, i))
        if patterns is ALL_MODULES:
            raise ConfigError(join(path, i), "related modules must be named, not 'all'")
        out.append(patterns)
    return tuple(out)


# --- range observers -------------------------------------------------------------------------


@dataclass(frozen=True)
class ObserverKwargs(GptqKwargs):
    """ext (compressed-tensors' `observer_kwargs`): the mse observer's search. Shrink factors
    p = 1 - k / grid for k below maxshrink * grid, the error sum |x^ - x|^norm (2: refined by
    least squares too). llm-compressor's: grid 100, maxshrink 0.2, norm 2.4. `weight_by: inputs`
    (weights only) weighs each group's error by the second moments of the module's input over the
    group's columns, recorded on calibration batches (qcompress.calibrate_weight_ranges); with
    `cross_groups` (the default) the groups of a row are then chosen together against the whole
    E[x x^T], so their errors may cancel in the output (quant/cross_groups.py). Observer gptq's
    keys (damp, block_size, act_order, sequential, scale_observer) come from config/gptq.py."""

    maxshrink: float = field(0.8, gt=0.0, le=1.0, doc="ext: how far the range may shrink (0.8: down to p = 0.21)")
    grid: int = field(100, ge=1, le=100000, doc="ext: candidate steps of 1 / grid")
    norm: float = field(2.0, gt=0.0, le=16.0, doc="ext: exponent of the reconstruction error")
    weight_by: str = field(
        "none",
        choices=("none", "inputs"),
        lower=True,
        doc="ext, weights only: 'inputs' weighs each group's error by E[x x^T] of the module's "
        "input over the group's columns (its diagonal where a group spans whole rows)",
    )
    cross_groups: bool = field(
        True,
        doc="ext, weight_by inputs at granularity group: choose the groups of each row "
        "together against the whole E[x x^T] (the output error's cross terms); "
        "false: each group alone against its own block (no cols x cols moments kept)",
    )

    def _validate(self, path):
        if int(round(self.maxshrink * self.grid)) < 1:
            raise ConfigError(
                join(path, "maxshrink"),
                f"{self.maxshrink} x grid {self.grid} leaves no shrink factor to try; raise maxshrink or grid",
            )
        if self.weight_by == "inputs" and self.norm != 2.0:
            raise ConfigError(
                join(path, "weight_by"),
                f"'inputs' weighs the output's squared error, but norm is {self.norm}; drop norm (2) or weight_by",
            )


# --- weight quantization ---------------------------------------------------------------------


@dataclass(frozen=True)
class FP16MixedQuantize:
    enabled: bool = field(False)
    quantize_change_ratio: float = field(0.001, gt=0.0, le=1.0)


@dataclass(frozen=True)
class WeightQuantShared:
    enabled: bool = field(False)
    quantizer_kernel: bool = field(False, doc="accepted for compatibility; kernels are used when built")
    schedule_offset: int = field(0, ge=0)
    quantize_groups: int = field(1, ge=1)
    quantize_verbose: bool = field(False)
    quantization_type: str = field("symmetric", choices=QUANT_TYPES, lower=True)
    rounding: str = field("nearest", choices=("nearest", "stochastic"), lower=True)
    quantize_weight_in_forward: bool = field(False)
    fp16_mixed_quantize: FP16MixedQuantize = field(FP16MixedQuantize())
    numerics: str = field("default", choices=("default", "deepspeed"), lower=True, doc="ext")
    ste: str = field(
        "identity", choices=("identity", "clip"), lower=True, doc="ext: 'clip' zeroes the gradient of clipped elements"
    )
    seed: int = field(0, ge=0, doc="ext: stochastic-rounding seed")
    observer: str = field(
        "minmax",
        choices=WEIGHT_OBSERVERS,
        lower=True,
        doc="ext: default range observer of the groups (see WeightQuantParams)",
    )
    observer_kwargs: ObserverKwargs = field(ObserverKwargs(), doc="ext: default of the groups' mse search")
    range_learning: bool = field(False, doc="ext: default of the groups' range_learning")
    format: Any = field(
        "int",
        parse=parse_format,
        doc="ext: default number format of the groups "
        "(int, fp8_e4m3, nvfp4, mxfp4, mxfp8, or {bits: format}; docs/formats.md)",
    )


@dataclass(frozen=True)
class WeightQuantParams:
    start_bits: int = field(ge=1, le=16)
    target_bits: int = field(ge=1, le=16)
    quantization_period: int = field(1, ge=0)
    period_growth: str = field(
        "exponential", choices=("exponential", "linear"), lower=True, doc="ext: 'linear' spaces the bit drops evenly"
    )
    granularity: Optional[str] = field(
        None,
        choices=("tensor", "channel", "group", "block"),
        lower=True,
        doc="ext; default: quantize_groups chunks (tensor if 1); block: 128 x 128 tiles (fp8_e4m3 only)",
    )
    group_size: Optional[int] = field(
        None, ge=1, doc="ext: elements per group along the input dim; alone it means granularity 'group'"
    )
    ternary: bool = field(True, doc="ext: 2 bits means ternary (DeepSpeed); false: 4-level grid")
    observer: Optional[str] = field(
        None,
        choices=WEIGHT_OBSERVERS,
        lower=True,
        doc="ext: 'minmax', 'mse' (searched shrink of the range) or 'gptq' "
        "(weights solved on calibration data); default: shared_parameters.observer",
    )
    observer_kwargs: Optional[ObserverKwargs] = field(
        None, doc="ext: the mse search (maxshrink, grid, norm); replaces shared_parameters.observer_kwargs whole"
    )
    range_learning: Optional[bool] = field(
        None, doc="ext: scales (and zero points) trained by LSQ; default: shared_parameters.range_learning"
    )
    format: Any = field(
        None,
        parse=parse_format,
        doc="ext: number format, one name or {bits: name} "
        "(a schedule steps between formats); default: shared_parameters.format",
    )

    def _validate(self, path):
        if self.target_bits > self.start_bits:
            raise ConfigError(
                join(path, "target_bits"),
                f"{self.target_bits} is above start_bits {self.start_bits}; bits only go down over the schedule",
            )
        if self.group_size is not None and self.granularity not in (None, "group"):
            raise ConfigError(
                join(path, "group_size"),
                f"{self.group_size} asks for groups of that size, but granularity is "
                f"{self.granularity!r}; drop one of them (group_size alone means "
                "granularity 'group')",
            )
        if self.group_size is not None and self.granularity is None:
            # group_size alone overrides quantize_groups for this group: per-group granularity
            object.__setattr__(self, "granularity", "group")
        if self.granularity == "group" and self.group_size is None:
            raise ConfigError(join(path, "group_size"), "is required when granularity is 'group'")


# --- activation quantization -----------------------------------------------------------------


@dataclass(frozen=True)
class ActQuantShared:
    enabled: bool = field(False)
    quantization_type: str = field("symmetric", choices=QUANT_TYPES, lower=True)
    range_calibration: str = field("dynamic", choices=("dynamic", "static"), lower=True)
    schedule_offset: int = field(1000, ge=0)
    momentum: float = field(0.95, ge=0.0, lt=1.0, doc="ext: EMA momentum of static ranges")
    observer: str = field("minmax", choices=OBSERVERS, lower=True, doc="ext: default of the groups")
    observer_kwargs: ObserverKwargs = field(ObserverKwargs(), doc="ext: default of the groups' mse search")
    range_learning: bool = field(False, doc="ext: default of the groups")
    fused_backward: bool = field(
        True,
        doc="ext: Linear/Conv keep the input's int8 codes for backward "
        "instead of a float copy (qcompress.nn.fused); false: the unfused path",
    )
    share_input: bool = field(
        True, doc="ext: modules fed one tensor with the same dynamic settings (Q/K/V, gate/up) quantize it once"
    )
    int8_forward: Union[bool, str] = field(
        False,
        choices=(False, True, "auto"),
        lower=True,
        doc="ext: fused Linear/Conv1D forwards multiply the integer codes (int8 kernel, exact sums; "
        "what the fast export computes) instead of the dequantized float copies; CPU; needs "
        "fused_backward. 'auto': training-mode forwards only, where the CPU has int8 dot "
        "products (VNNI / AMX), below which the fp32 GEMM is faster",
    )
    format: str = field("int", parse=parse_format, doc="ext: default number format of the groups")


@dataclass(frozen=True)
class ActQuantParams:
    bits: int = field(ge=2, le=8)
    observer: Optional[str] = field(
        None,
        choices=OBSERVERS,
        lower=True,
        doc="ext: static ranges only: 'mse' searches a shrink of each "
        "batch's range; default: shared_parameters.observer",
    )
    observer_kwargs: Optional[ObserverKwargs] = field(
        None, doc="ext: the mse search (maxshrink, grid, norm); replaces shared_parameters.observer_kwargs whole"
    )
    range_learning: Optional[bool] = field(
        None, doc="ext: the static range's scale (and zero point) trained by LSQ; default: shared_parameters"
    )
    format: Optional[str] = field(
        None,
        parse=parse_format,
        doc="ext: int, fp8_e4m3, nvfp4, mxfp4 or mxfp8 (bits must match); default: shared_parameters.format",
    )
    group_size: Optional[int] = field(
        None,
        ge=1,
        doc="ext, float formats, dynamic ranges: one scale "
        "per group_size inputs along the last dim (fp8_e4m3: e.g. 128)",
    )


def _check_kwargs(technique, where):
    """observer_kwargs set the mse search: refused on a group that uses minmax, and in
    shared_parameters when no group uses mse (a setting that would change nothing)."""
    groups = technique.groups if technique.enabled else ()
    uses_mse = uses_gptq = False
    for group in groups:
        s = group.settings
        observer, kw, kw_at = s.observer, s.observer_kwargs, s.at("observer_kwargs")
        if s.own_observer_kwargs or observer == GPTQ:
            check_gptq_kwargs(observer, kw, join(where, kw_at))
        uses_mse = uses_mse or observer in ("mse", GPTQ)
        uses_gptq = uses_gptq or observer == GPTQ
        if observer == "minmax" and s.own_observer_kwargs:
            raise ConfigError(
                join(where, f"different_groups.{group.name}.params.observer_kwargs"),
                f"sets the mse observer's search, but group {group.name!r} uses observer "
                "'minmax'; set observer: mse, or drop observer_kwargs",
            )
    if groups and not uses_mse and technique.shared.observer_kwargs != ObserverKwargs():
        raise ConfigError(
            join(where, "shared_parameters.observer_kwargs"),
            "sets the mse observer's search, but no group uses observer 'mse' (or 'gptq')",
        )
    if groups and not uses_gptq:
        check_gptq_kwargs(None, technique.shared.observer_kwargs, join(where, "shared_parameters.observer_kwargs"))


# --- pruning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparsePruningShared:
    enabled: bool = field(False)
    method: str = field("l1", choices=("l1", "topk", "snip_momentum"), lower=True)
    schedule_offset: int = field(1000, ge=0)
    schedule_offset_end: Optional[int] = field(None, ge=0)
    schedule_offset_stride: int = field(1, ge=1, doc="steps between updates of the ramped ratio")
    block_pattern: Optional[str] = field(None, doc="snip_momentum only; l1/topk prune 1x1")
    dense_ratio: Optional[float] = field(None, gt=0.0, lt=1.0, doc="snip_momentum only")
    excluded_modules: Tuple[str, ...] = field((), parse=_parse_excluded)

    def _validate(self, path):
        end = self.schedule_offset_end
        if end is not None and end < self.schedule_offset:
            raise ConfigError(
                join(path, "schedule_offset_end"), f"{end} is before schedule_offset {self.schedule_offset}"
            )
        pattern = self.block_pattern
        if pattern is not None and not (isinstance(pattern, str) and re.fullmatch(r"\d+x\d+|\d+:\d+", pattern)):
            raise ConfigError(join(path, "block_pattern"), f"{pattern!r} must look like 'NxM' or 'N:M'")
        if self.enabled and self.method == "snip_momentum":
            raise ConfigError(
                join(path, "method"),
                "'snip_momentum' is delegated to Intel Neural Compressor in DeepSpeed and "
                "is not supported by qcompress; use 'l1' or 'topk'",
            )
        # keys DeepSpeed reads for snip_momentum only: l1/topk would ignore them, so refuse them
        if pattern is not None and pattern not in ("1x1", "1:1"):
            raise ConfigError(
                join(path, "block_pattern"),
                f"{pattern!r}: l1 and topk sparse pruning keep or drop single weights "
                "(1x1); block patterns belong to 'snip_momentum', which qcompress does "
                "not support. Remove the key",
            )
        if self.dense_ratio is not None:
            raise ConfigError(
                join(path, "dense_ratio"),
                "applies to 'snip_momentum' only; for l1/topk set different_groups.<group>.params.dense_ratio",
            )


@dataclass(frozen=True)
class RowPruningShared:
    enabled: bool = field(False)
    method: str = field("l1", choices=("l1", "topk"), lower=True)
    schedule_offset: int = field(1000, ge=0)


@dataclass(frozen=True)
class HeadPruningShared:
    enabled: bool = field(False)
    method: str = field("topk", choices=("topk",), lower=True)
    schedule_offset: int = field(1000, ge=0)
    num_heads: Optional[int] = field(None, ge=1)

    def _validate(self, path):
        if self.enabled and self.num_heads is None:
            raise ConfigError(join(path, "num_heads"), "is required when head pruning is enabled")


@dataclass(frozen=True)
class ChannelPruningShared:
    enabled: bool = field(False)
    method: str = field("l1", choices=("l1", "topk"), lower=True)
    schedule_offset: int = field(1000, ge=0)


@dataclass(frozen=True)
class PruningParams:
    dense_ratio: float = field(gt=0.0, le=1.0, doc="fraction of weights KEPT")


# --- groups and techniques -------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    name: str
    params: Any
    modules: Optional[Tuple[str, ...]]  # None: every compressible module
    related_modules: Optional[Tuple[Tuple[str, ...], ...]] = None
    # weight / activation quantization: every effective value, resolved at load (group_settings.py)
    settings: Any = dataclasses.field(default=None, repr=False, metadata=dict(internal=True))


@dataclass(frozen=True)
class Technique:
    shared: Any
    groups: Tuple[Group, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.shared.enabled)


def _parse_group(name, raw, params_cls, path, shared, resolve):
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping with 'params' and 'modules', got {raw!r}")
    allowed = ("params", "modules", "related_modules")
    for key in raw:
        if key not in allowed:
            from .schema import did_you_mean

            raise ConfigError(
                join(path, key), f"unknown key{did_you_mean(key, allowed)}; allowed keys: {list(allowed)}"
            )
    params = parse(params_cls, raw.get("params"), join(path, "params"))
    modules = _parse_patterns(raw["modules"], join(path, "modules")) if "modules" in raw else None
    related = _parse_related(raw.get("related_modules"), join(path, "related_modules"))
    if related is not None:
        n_mod = len(modules) if modules is not None else None
        if n_mod is not None and len(related) != n_mod:
            raise ConfigError(
                join(path, "related_modules"),
                f"has {len(related)} entries but modules has {n_mod}; they pair by position, so the lengths must match",
            )
    return Group(
        name=name,
        params=params,
        modules=modules,
        related_modules=related,
        settings=resolve(shared, params, name) if resolve is not None else None,
    )


def _technique_parser(shared_cls, params_cls, groups_optional=False, resolve=None):
    def parse_technique(raw, path):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(path, f"expected a mapping, got {raw!r}")
        allowed = ("shared_parameters", "different_groups")
        for key in raw:
            if key not in allowed:
                from .schema import did_you_mean

                raise ConfigError(
                    join(path, key), f"unknown key{did_you_mean(key, allowed)}; allowed keys: {list(allowed)}"
                )
        shared = parse(shared_cls, raw.get("shared_parameters"), join(path, "shared_parameters"))
        groups_raw = raw.get("different_groups")
        gpath = join(path, "different_groups")
        if groups_raw is None:
            if shared.enabled and not (groups_optional and getattr(shared, "method", "") == "snip_momentum"):
                raise ConfigError(gpath, "is required when the technique is enabled")
            groups_raw = {}
        if not isinstance(groups_raw, dict):
            raise ConfigError(gpath, f"expected a mapping of group name to group, got {groups_raw!r}")
        groups = tuple(
            _parse_group(name, g, params_cls, join(gpath, name), shared, resolve) for name, g in groups_raw.items()
        )
        return Technique(shared=shared, groups=groups)

    return parse_technique


@dataclass(frozen=True)
class LayerReduction:
    enabled: bool = field(False)
    keep_number_layer: Optional[int] = field(None, ge=1)
    module_name_prefix: Optional[str] = field(None)
    teacher_layer: Tuple[int, ...] = field(())
    other_module_name: Tuple[str, ...] = field(())

    def _validate(self, path):
        if not self.enabled:
            return
        if not self.module_name_prefix:
            raise ConfigError(join(path, "module_name_prefix"), "is required when enabled")
        if not self.teacher_layer:
            raise ConfigError(join(path, "teacher_layer"), "is required when enabled")
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ConfigError(
                join(path, "keep_number_layer"),
                f"{self.keep_number_layer} differs from len(teacher_layer) = {len(self.teacher_layer)}",
            )


def _parse_teacher(value, path):
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"expected 'self' or the path of a model folder, got {value!r}")
    return value


def _parse_layer_list(value, path):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list of teacher layer indices, got {value!r}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(join(path, i), f"expected a layer index >= 0, got {v!r}")
    return tuple(value)


@dataclass(frozen=True)
class Distillation:
    """ext: knowledge distillation from a teacher while the student trains compressed (QAD).
    Read by qcompress.train.distill and qcompress.hf; the rewrite and the schedules ignore it."""

    enabled: bool = field(False)
    teacher: str = field(
        "self", parse=_parse_teacher, doc="'self': a frozen copy of the model before compression; or a model folder"
    )
    temperature: float = field(1.0, gt=0.0)
    alpha: float = field(0.5, ge=0.0, le=1.0, doc="weight of the distillation loss; task gets 1 - alpha")
    hidden_mse: float = field(0.0, ge=0.0, doc="weight of the hidden-state MSE (0 = off)")
    teacher_layer: Optional[Tuple[int, ...]] = field(
        None, parse=_parse_layer_list, doc="student layer i <-> teacher layer teacher_layer[i]"
    )


_EMPTY = dict(shared=None)


@dataclass(frozen=True)
class CompressionConfig:
    weight_quantization: Technique = field(
        Technique(WeightQuantShared()),
        parse=_technique_parser(WeightQuantShared, WeightQuantParams, resolve=weight_settings),
    )
    activation_quantization: Technique = field(
        Technique(ActQuantShared()), parse=_technique_parser(ActQuantShared, ActQuantParams, resolve=act_settings)
    )
    sparse_pruning: Technique = field(
        Technique(SparsePruningShared()),
        parse=_technique_parser(SparsePruningShared, PruningParams, groups_optional=True),
    )
    row_pruning: Technique = field(
        Technique(RowPruningShared()), parse=_technique_parser(RowPruningShared, PruningParams)
    )
    head_pruning: Technique = field(
        Technique(HeadPruningShared()), parse=_technique_parser(HeadPruningShared, PruningParams)
    )
    channel_pruning: Technique = field(
        Technique(ChannelPruningShared()), parse=_technique_parser(ChannelPruningShared, PruningParams)
    )
    layer_reduction: LayerReduction = field(LayerReduction())
    distillation: Distillation = field(Distillation())
    rotation: Rotation = field(Rotation(), doc="ext: Hadamard rotations (config/rotation.py)")
    kv_cache_quantization: KVCacheQuantization = field(KVCacheQuantization())
    lora: Lora = field(Lora(), doc="ext: low-rank adapters (config/lora.py)")

    def _validate(self, path):
        self._validate_ranges(path)
        self._validate_formats(path)
        _check_rotation(self, path)
        kd, lr = self.distillation, self.layer_reduction
        if kd.teacher_layer is not None and lr.enabled and len(kd.teacher_layer) != len(lr.teacher_layer):
            raise ConfigError(
                join(path, "distillation.teacher_layer"),
                f"maps {len(kd.teacher_layer)} student layers, but layer_reduction keeps "
                f"{len(lr.teacher_layer)} (layer_reduction.teacher_layer); drop it to "
                "use layer_reduction's mapping",
            )

    def _validate_ranges(self, path):
        """Observers and range learning need what they act on (checked where the value was set)."""
        wq = self.weight_quantization
        for group in wq.groups if wq.enabled else ():
            s = group.settings
            rl, rl_at, obs, obs_at = s.range_learning, s.at("range_learning"), s.observer, s.at("observer")
            where = join(path, "weight_quantization")
            if rl and not s.in_forward:
                raise ConfigError(
                    join(where, rl_at),
                    "range learning trains the scales through the forward "
                    "pass: it needs shared_parameters.quantize_weight_in_forward: true",
                )
            if rl and s.mix_enabled:
                raise ConfigError(
                    join(where, rl_at),
                    "range learning and fp16_mixed_quantize do not combine "
                    "(the blend hides the learned grid); turn one off",
                )
            if (rl or obs in ("mse", GPTQ)) and s.numerics == "deepspeed":
                raise ConfigError(
                    join(where, rl_at if rl else obs_at),
                    f"{'range learning' if rl else f'the {obs} observer'} works on the default "
                    "numerics (what export writes); shared_parameters.numerics is 'deepspeed'",
                )
            if obs == GPTQ:
                check_gptq_group(s, where)
        _check_kwargs(wq, join(path, "weight_quantization"))
        aq = self.activation_quantization
        _check_kwargs(aq, join(path, "activation_quantization"))
        for kw, at in [(aq.shared.observer_kwargs, "shared_parameters.observer_kwargs")] + [
            (g.settings.observer_kwargs, g.settings.at("observer_kwargs"))
            for g in (aq.groups if aq.enabled else ())
            if g.settings.own_observer_kwargs
        ]:
            if kw.weight_by != "none":
                raise ConfigError(
                    join(join(join(path, "activation_quantization"), at), "weight_by"),
                    f"{kw.weight_by!r} weights a weight's error by the inputs it multiplies; "
                    "an activation range has no such weights: drop weight_by here",
                )
        for group in aq.groups if aq.enabled else ():
            where = join(path, "activation_quantization")
            for key in ("range_learning", "observer"):
                value, at = getattr(group.settings, key), group.settings.at(key)
                if value not in (False, "minmax") and group.settings.calibration != "static":
                    raise ConfigError(
                        join(where, at),
                        f"{value!r} acts on stored (static) ranges; "
                        "shared_parameters.range_calibration is 'dynamic' (recomputed on "
                        "every call); set range_calibration: static",
                    )

    def _validate_formats(self, path):
        """Float formats: widths, granularities and settings they define (config/formats.py)."""
        for tech, check in (
            ("weight_quantization", _check_weight_formats),
            ("activation_quantization", _check_act_formats),
        ):
            technique = getattr(self, tech)
            for group in technique.groups if technique.enabled else ():
                check(technique, group, join(path, f"{tech}.different_groups.{group.name}"), join(path, tech))

    def techniques(self):
        """(name, Technique) for the six group-based techniques, in DeepSpeed's clean order."""
        names = (
            "weight_quantization",
            "sparse_pruning",
            "row_pruning",
            "head_pruning",
            "channel_pruning",
            "activation_quantization",
        )
        return [(n, getattr(self, n)) for n in names]


def _check_weight_formats(technique, group, where, tech_path):
    s = group.settings
    check_weight_group(s.format, group.params, technique.shared, where, join(tech_path, s.at("format")))
    used = s.listed_formats
    floats = sorted(used - {"int"})
    if not floats:
        return
    kw, kw_at = s.observer_kwargs, s.at("observer_kwargs")
    if s.observer == "mse" and kw is not None and kw.weight_by != "none":
        raise ConfigError(
            join(tech_path, join(kw_at, "weight_by")),
            f"{kw.weight_by!r} is for integer "
            f"formats; the mse search of {floats} weighs the weight's own error: drop weight_by",
        )
    rl, rl_at = s.range_learning, s.at("range_learning")
    if not rl:
        return
    if len(used) > 1:
        raise ConfigError(
            join(tech_path, rl_at),
            f"range learning keeps one scale tensor, but this group "
            f"steps between formats {sorted(used)} whose scales differ in shape and units; "
            "learn the ranges of a group with one format",
        )
    if floats[0] not in ("fp8_e4m3", "nvfp4"):
        raise ConfigError(
            join(tech_path, rl_at),
            f"{floats[0]} scales are E8M0 powers of two: a "
            "straight-through step never moves one to the next power; use observer: mse "
            "(it chooses between the two nearest exponents) instead of range learning",
        )


def _check_act_formats(technique, group, where, tech_path):
    s = group.settings
    fmt, fmt_at = s.format, join(tech_path, s.at("format"))
    if not isinstance(fmt, str):
        raise ConfigError(fmt_at, "activations have one width: give one format name, not a mapping")
    check_act_group(fmt, group.params, technique.shared, where, fmt_at)
    rl, rl_at = s.range_learning, s.at("range_learning")
    if fmt != "int" and rl:
        raise ConfigError(
            join(tech_path, rl_at),
            f"{fmt} activations are exported with the calibrated "
            "range (input_scale / input_global_scale), not a learned one; use observer: mse "
            "to shrink that range, or drop range_learning",
        )


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)
