"""Per-module compression state: what a compress-aware module applies and at which bits.

The scheduler writes these fields; the module's forward reads them. None of it is in the
module's state_dict (keys stay those of the original model); the CompressionScheduler saves it.
Tensors held here follow the module on .to()/.cuda()/.half() (CompressMixin._apply calls
MasterState.follow) and are dropped when a state_dict is loaded into the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ..quant.static_range import StaticRange
from ..config.formats import format_at
from ..quant import rng
from ..quant.observers import DEFAULT_SEARCH_FIELDS
from ..quant.floats import float_spec
from ..quant.reference import Spec, make_spec


class MasterState:
    """Optimizer-step state of one weight Parameter: the full-precision master, the tensor last
    written into the weight, and its integer codes. Modules that share one Parameter (tied
    embeddings) share one MasterState, so the weight has one master and cannot drift."""

    def __init__(self):
        self.master: Optional[torch.Tensor] = None  # float32, on the weight's device
        self.applied: Optional[torch.Tensor] = None  # weight's dtype and device
        self.codes: Optional[tuple] = None  # (q, scale, zero_point) behind `applied`
        self.codes_spec: Optional[Spec] = None
        # observer_kwargs.weight_by: inputs: the diagonal blocks of E[x x^T] of the input the weight
        # multiplies (float64 [blocks, b, b], CPU; observers.input_weighting), recorded by
        # calibrate_weight_ranges; kept across reset() (it describes the data, not the weight) and
        # shared by tied modules, so they choose one shrink for one tensor
        self.input_moments: Optional[torch.Tensor] = None
        # with observer_kwargs.cross_groups at granularity group: the whole E[x x^T] (float32
        # [cols, cols], CPU; quant/cross_groups.py), the same way recorded, kept and shared
        self.input_cross: Optional[torch.Tensor] = None

    def reset(self) -> None:
        """Forget everything: the next scheduler step takes the weight as it is as the master."""
        self.master = self.applied = self.codes = self.codes_spec = None

    def follow(self, weight: torch.Tensor) -> None:
        """Move the state to where the weight now lives (after Module.to / cuda / half ...).

        The master stays float32 (it is the full-precision copy); `applied` takes the weight's
        dtype, as the weight itself was converted from it; codes keep their integer dtypes.
        """
        dev = weight.device
        held = [t for t in (self.master, self.applied, *(self.codes or ())) if t is not None]
        if not weight.is_meta and any(t.is_meta for t in held):
            self.reset()  # to_empty(): the values are gone; re-read the weight next step
            return
        if self.master is not None:
            self.master = self.master.to(dev)
        if self.applied is not None:
            self.applied = self.applied.to(dev, weight.dtype)
        if self.codes is not None:
            self.codes = tuple(None if t is None else t.to(dev) for t in self.codes)


_WEIGHT_SETTINGS = (
    "start_bits",
    "target_bits",
    "period",
    "growth",
    "offset",
    "symmetric",
    "granularity",
    "group_size",
    "num_groups",
    "rounding",
    "numerics",
    "ternary",
    "in_forward",
    "mix_enabled",
    "change_ratio",
    "range_observer",
    "range_search",
    "range_learning",
    "format",
    "solver",
    "solver_kwargs",
)


def _delegate(attr):
    return property(lambda self: getattr(self.store, attr), lambda self, value: setattr(self.store, attr, value))


@dataclass
class WeightQuant:
    """One module's weight-quantization settings (from its group) and live schedule state."""

    group: str
    start_bits: int
    target_bits: int
    period: int
    growth: str  # "exponential" (DeepSpeed's doubling) or "linear"
    offset: int  # schedule_offset
    symmetric: bool
    granularity: str  # tensor | channel | group | groups (DeepSpeed quantize_groups)
    group_size: Optional[int]
    num_groups: Optional[int]
    rounding: str
    numerics: str
    ternary: bool
    clip_grad: bool
    in_forward: bool  # quantize_weight_in_forward
    mix_enabled: bool  # fp16_mixed_quantize
    change_ratio: float
    seed: int
    range_observer: str = "minmax"  # minmax | mse (qcompress.quant.observers)
    range_search: tuple = DEFAULT_SEARCH_FIELDS  # mse: observers.Search's fields, a plain tuple
    #                                              (a pickled model loads with weights_only)
    range_learning: bool = False  # scales (zero points) are the module's weight_scale (_zero_point) Parameters
    format: object = "int"  # a format name or ((bits, name), ...): config/formats.py
    # live state
    active: bool = False
    bits: int = 0
    mix_ratio: float = 0.0  # share of the full-precision weight in the blend
    step: int = 0  # training step the current bits/seed belong to
    baked: bool = False  # redundancy_clean wrote the quantized weight in
    shrink: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    # ^ mse observer, no range learning: each group's shrink factor, chosen at the first
    #   quantization and at each bit drop, applied to the group's current range in every forward
    ranges_loaded: bool = False  # learned scales came with a loaded state_dict: the next range
    #                                (re)initialisation keeps them (a model rebuilt from trained weights)
    pending_ranges: bool = False  # optimizer-step mode: re-run the observer on the updated master
    per_expert: bool = False  # fused experts at granularity tensor: a channel of [E, out * in] each
    solver: Optional[str] = None  # "gptq": the weights are solved on calibration data (calibrate/gptq.py)
    solver_kwargs: tuple = ()  # quant.gptq.Settings' damp, block_size, act_order, and `sequential`
    solved: Optional[tuple] = field(default=None, repr=False, compare=False)
    # ^ the solver's scales, fixed from then on: integers (scale [groups], zero point or None),
    #   float formats (scale as floats.qparams shapes it, global scale or None); () when they were
    #   written into the learned-range Parameters instead; None: not solved yet
    store: MasterState = field(default_factory=MasterState, repr=False, compare=False)
    # `step` as a 0-d int64 CPU tensor, filled in place whenever step is set: compiled graphs take
    # it as an input (stochastic rounding), so a new step does not compile a new graph
    step_tensor: torch.Tensor = field(
        default_factory=lambda: torch.zeros((), dtype=torch.int64), repr=False, compare=False
    )

    def __post_init__(self):
        self.step_tensor.fill_(self.step)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "step" and "step_tensor" in self.__dict__:
            self.step_tensor.fill_(value)

    # optimizer-step mode: full-precision weights, what was last written, its codes (shared
    # between modules tied to one Parameter, see MasterState)
    master = _delegate("master")
    applied = _delegate("applied")
    codes = _delegate("codes")
    codes_spec = _delegate("codes_spec")

    def settings(self) -> Dict[str, object]:
        """The settings that decide the quantized weight at every step (not group, seed, state)."""
        return {k: getattr(self, k) for k in _WEIGHT_SETTINGS}

    def follow(self, weight: torch.Tensor) -> None:
        """After .to() / .cuda() / .half(): the master copy, codes and observer shrink factors
        follow the module's weight."""
        self.store.follow(weight)
        if self.shrink is not None and not weight.is_meta:
            self.shrink = self.shrink.to(weight.device)
        if self.solved and not weight.is_meta:
            self.solved = tuple(None if t is None else t.to(weight.device) for t in self.solved)

    def step_as_input(self) -> bool:
        """Whether a compiled graph takes the stochastic-rounding step as a tensor input (the
        fake_quant op, min/max ranges); learned or observer-chosen ranges reach ops whose seed is
        an int constant, so there each step compiles a graph."""
        return self.rounding == "stochastic" and not self.range_learning and self.range_observer == "minmax"

    def spec(self) -> Spec:
        fmt = format_at(self.format, self.bits)
        if fmt != "int":  # a float format (quant/floats.py) at the bits in force
            return float_spec(fmt, self.granularity, self.group_size)
        step = None
        if self.rounding != "stochastic":
            seed = 0
        elif torch.compiler.is_compiling() and self.step_as_input():
            seed, step = self.seed, self.step_tensor  # mixed inside the op: one graph for all steps
        else:
            seed = rng.mix_seed(self.seed, self.step)
        return make_spec(
            self.bits,
            symmetric=self.symmetric,
            granularity="tensor" if self.granularity == "groups" else self.granularity,
            group_size=self.group_size,
            num_groups=self.num_groups if self.granularity == "groups" else None,
            rounding=self.rounding,
            seed=seed,
            numerics=self.numerics,
            ternary=self.ternary,
            step=step,
        )

    def describe(self) -> str:
        if self.granularity == "group":
            out = f"group{self.group_size}"
        elif self.granularity == "groups":
            out = f"{self.num_groups} chunks"
        elif self.per_expert:
            out = "tensor per expert"
        else:
            out = self.granularity
        if self.range_observer != "minmax":
            out += f" {self.range_observer}"
        if self.solver is not None:
            out += f" {self.solver}" + ("" if self.solved is not None else " (not calibrated)")
        if self.format != "int":
            fmt = self.format if isinstance(self.format, str) else "→".join(f for _, f in self.format)
            out = f"{fmt} {out}"
        return out + (" learned" if self.range_learning else "")


@dataclass
class ActQuant:
    """One module's input-activation quantization."""

    group: str
    bits: int
    symmetric: bool
    calibration: str  # dynamic | static
    offset: int
    per: str  # token (Linear) | sample (Conv)
    active: bool = False
    observer: StaticRange = field(default_factory=StaticRange)
    range_observer: str = "minmax"  # static ranges: minmax | mse (each batch's range shrunk)
    range_search: tuple = DEFAULT_SEARCH_FIELDS  # mse: observers.Search's fields
    range_learning: bool = False  # static range learned: the module's input_scale (_zero_point)
    learned_ready: bool = False  # the learned range was initialised from the observer
    fused: bool = True  # fused forward/backward keeping int8 codes (qcompress.nn.fused)
    share_input: bool = True  # siblings fed the same tensor quantize it once (dynamic ranges)
    int8_forward: object = False  # True | False | "auto": forward multiplies the integer codes (nn.int8_forward)
    format: str = "int"  # int | fp8_e4m3 | nvfp4 | mxfp4 | mxfp8 (quant/floats.py)
    group_size: Optional[int] = None  # float formats, dynamic: one scale per group_size inputs

    def describe(self) -> str:
        out = f"A{self.bits} {'static' if self.calibration == 'static' else 'per ' + self.per}"
        if self.format != "int":
            out = f"A{self.bits} {self.format} {self.calibration}"
        if self.range_observer != "minmax":
            out += f" {self.range_observer}"
        return out + (" learned" if self.range_learning else "")
