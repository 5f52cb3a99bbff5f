"""Per-module compression state: what a compress-aware module applies and at which bits.

The scheduler writes these fields; the module's forward reads them. None of it is in the
module's state_dict (keys stay those of the original model); the CompressionScheduler saves it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..calibration import StaticRange
from ..quant import rng
from ..quant.reference import Spec, make_spec


@dataclass
class WeightQuant:
    """One module's weight-quantization settings (from its group) and live schedule state."""
    group: str
    start_bits: int
    target_bits: int
    period: int
    growth: str                    # "exponential" (DeepSpeed's doubling) or "linear"
    offset: int                    # schedule_offset
    symmetric: bool
    granularity: str               # tensor | channel | group | groups (DeepSpeed quantize_groups)
    group_size: Optional[int]
    num_groups: Optional[int]
    rounding: str
    numerics: str
    ternary: bool
    clip_grad: bool
    in_forward: bool               # quantize_weight_in_forward
    mix_enabled: bool              # fp16_mixed_quantize
    change_ratio: float
    seed: int
    # live state
    active: bool = False
    bits: int = 0
    mix_ratio: float = 0.0         # share of the full-precision weight in the blend
    step: int = 0                  # training step the current bits/seed belong to
    master: Optional[torch.Tensor] = None   # optimizer-step mode: full-precision weights
    applied: Optional[torch.Tensor] = None  # optimizer-step mode: what was last written
    baked: bool = False            # redundancy_clean wrote the quantized weight in
    codes: Optional[tuple] = None  # (q, scale, zero_point) last written into the weight
    codes_spec: Optional[Spec] = None

    def spec(self) -> Spec:
        seed = rng.mix_seed(self.seed, self.step) if self.rounding == "stochastic" else 0
        return make_spec(self.bits, symmetric=self.symmetric,
                         granularity="tensor" if self.granularity == "groups" else self.granularity,
                         group_size=self.group_size,
                         num_groups=self.num_groups if self.granularity == "groups" else None,
                         rounding=self.rounding, seed=seed, numerics=self.numerics,
                         ternary=self.ternary)

    def describe(self) -> str:
        if self.granularity == "group":
            return f"group{self.group_size}"
        if self.granularity == "groups":
            return f"{self.num_groups} chunks"
        return self.granularity


@dataclass
class ActQuant:
    """One module's input-activation quantization."""
    group: str
    bits: int
    symmetric: bool
    calibration: str               # dynamic | static
    offset: int
    per: str                       # token (Linear) | sample (Conv)
    active: bool = False
    observer: StaticRange = field(default_factory=StaticRange)

    def describe(self) -> str:
        return f"A{self.bits} {'static' if self.calibration == 'static' else 'per ' + self.per}"
