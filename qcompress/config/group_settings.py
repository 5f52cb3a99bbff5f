"""Each weight / activation group's effective settings, resolved once when its config loads.

A group's value of a key its `params` may set over `shared_parameters` (observer, observer_kwargs,
range_learning, format) is its own, else shared_parameters' (whose schema holds the default): that
rule is applied here and nowhere else. `Group.settings` keeps the result, frozen, with every value
a group quantizes with (bits schedule, format, granularity, group size, symmetry, observer and its
kwargs, rounding, offsets, range learning ...). Validation, the rewrite (which copies it into each
module's WeightQuant / ActQuant, nn/state.py), LoRA's checks and the command line read it, never
the two sections; `at(key)` names the key path where a value was set, for error messages.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .formats import GROUP_SIZE, Format, float_granularity, format_at
from .gptq import GPTQ

# the keys a group's params may set over shared_parameters'
OVERRIDABLE = ("observer", "observer_kwargs", "range_learning", "format")


def _pick(shared, params, group: str, key: str) -> Tuple[Any, str]:
    """(value, key path under the technique's section where it was set)."""
    own = getattr(params, key)
    if own is not None:
        return own, f"different_groups.{group}.params.{key}"
    return getattr(shared, key), f"shared_parameters.{key}"


@dataclass(frozen=True)
class _Resolved:
    name: str
    observer: str
    observer_kwargs: Any  # config.compression.ObserverKwargs
    range_learning: bool
    set_at: Tuple[Tuple[str, str], ...]  # (key, path under the technique) of OVERRIDABLE

    def at(self, key: str) -> str:
        """Where `key` was set, under the technique's section (e.g. 'shared_parameters.observer')."""
        return dict(self.set_at)[key]

    @property
    def own_observer_kwargs(self) -> bool:
        """Whether the group set observer_kwargs itself (which then replaces shared_parameters' whole)."""
        return self.at("observer_kwargs").startswith("different_groups.")


@dataclass(frozen=True)
class WeightGroupSettings(_Resolved):
    format: Format
    start_bits: int
    target_bits: int
    period: int  # quantization_period
    growth: str  # period_growth
    offset: int  # schedule_offset
    symmetric: bool
    granularity: Optional[str]  # None: each module's default (granularity_at)
    group_size: Optional[int]
    chunks: Optional[int]  # quantize_groups where the group sets no granularity (and it is > 1)
    ternary: bool
    rounding: str
    numerics: str
    clip_grad: bool  # ste: clip
    in_forward: bool  # quantize_weight_in_forward
    mix_enabled: bool  # fp16_mixed_quantize
    change_ratio: float
    seed: int

    @property
    def quantization_type(self) -> str:
        return "symmetric" if self.symmetric else "asymmetric"

    @property
    def listed_formats(self) -> set:
        """Every format the group's `format` names (a mapping's values)."""
        fmt = self.format
        return {f for _, f in fmt} if isinstance(fmt, tuple) else {fmt or "int"}

    @property
    def solver(self) -> Optional[str]:
        """ "gptq" when the weights are solved on calibration data."""
        return GPTQ if self.observer == GPTQ else None

    @property
    def range_observer(self) -> str:
        """The observer that chooses the ranges: gptq's solve uses its own scale observer."""
        return self.observer_kwargs.scale_observer if self.observer == GPTQ else self.observer

    @property
    def solver_kwargs(self) -> tuple:
        """gptq: quant.gptq.Settings' damp, block_size, act_order, and `sequential`."""
        if self.observer != GPTQ:
            return ()
        kw = self.observer_kwargs
        return (kw.damp, kw.block_size, kw.act_order, kw.sequential)

    def granularity_at(self, vocab_table: bool) -> Tuple[str, Optional[int], Optional[int]]:
        """(granularity, group size, quantize_groups chunks or None) on one module. Unset on an
        integer group: DeepSpeed's, one group per vocabulary row for an Embedding (and a head tied
        to one, which quantizes the same table), else quantize_groups chunks of the flattened
        weight, else the whole tensor. A float format that fixes its group size needs no
        granularity; the chunk count still comes back there, for the checks on chunks (the
        format's spec does not use it)."""
        chunks = None if vocab_table else self.chunks
        if self.granularity is not None:
            return self.granularity, self.group_size, chunks
        if vocab_table:
            return "channel", None, None
        if chunks:
            return "groups", None, chunks
        return "tensor", None, None

    def seed_of(self, module: str) -> int:
        """A module's stochastic-rounding seed: shared_parameters.seed mixed with its name."""
        if self.rounding != "stochastic":
            return 0
        return (self.seed * 1_000_003 + zlib.crc32(module.encode())) & 0x7FFFFFFF


@dataclass(frozen=True)
class ActGroupSettings(_Resolved):
    format: str
    bits: int
    symmetric: bool
    calibration: str  # range_calibration: dynamic | static
    offset: int  # schedule_offset
    momentum: float
    fused: bool  # fused_backward
    share_input: bool
    int8_forward: Any  # True | False | "auto"
    group_size: Optional[int]  # as the group set it (float formats fix their own)

    @property
    def quantization_type(self) -> str:
        return "symmetric" if self.symmetric else "asymmetric"

    @property
    def float_group_size(self) -> Optional[int]:
        """Inputs per scale of a float format: the group's, else the one the format fixes."""
        return self.group_size or GROUP_SIZE.get(self.format)


def _overridden(shared, params, group: str) -> dict:
    picked = {key: _pick(shared, params, group, key) for key in OVERRIDABLE}
    return dict(
        name=group,
        set_at=tuple((k, at) for k, (_, at) in picked.items()),
        **{k: value for k, (value, _) in picked.items()},
    )


def weight_settings(shared, params, group: str) -> WeightGroupSettings:
    """A weight group's settings (shared: WeightQuantShared, params: WeightQuantParams)."""
    values = _overridden(shared, params, group)
    values["range_learning"] = bool(values["range_learning"])
    fmt = values["format"]
    gran, gsize = params.granularity, params.group_size
    if format_at(fmt, params.target_bits) != "int" or format_at(fmt, params.start_bits) != "int":
        gran, gsize = float_granularity(fmt, params)
    return WeightGroupSettings(
        **values,
        start_bits=params.start_bits,
        target_bits=params.target_bits,
        period=params.quantization_period,
        growth=params.period_growth,
        offset=shared.schedule_offset,
        symmetric=shared.quantization_type == "symmetric",
        granularity=gran,
        group_size=gsize,
        chunks=shared.quantize_groups if params.granularity is None and shared.quantize_groups > 1 else None,
        ternary=params.ternary,
        rounding=shared.rounding,
        numerics=shared.numerics,
        clip_grad=shared.ste == "clip",
        in_forward=shared.quantize_weight_in_forward,
        mix_enabled=shared.fp16_mixed_quantize.enabled,
        change_ratio=shared.fp16_mixed_quantize.quantize_change_ratio,
        seed=shared.seed,
    )


def act_settings(shared, params, group: str) -> ActGroupSettings:
    """An activation group's settings (shared: ActQuantShared, params: ActQuantParams)."""
    values = _overridden(shared, params, group)
    values["range_learning"] = bool(values["range_learning"])
    return ActGroupSettings(
        **values,
        bits=params.bits,
        symmetric=shared.quantization_type == "symmetric",
        calibration=shared.range_calibration,
        offset=shared.schedule_offset,
        momentum=shared.momentum,
        fused=shared.fused_backward,
        share_input=shared.share_input,
        int8_forward=shared.int8_forward,
        group_size=params.group_size,
    )
