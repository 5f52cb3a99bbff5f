"""Schema of `compression_training.kv_cache_quantization` (ext; not a DeepSpeed key).

The keys and values a serving engine's KV cache is described by in compressed-tensors'
`kv_cache_scheme`: the keys (after RoPE) and values every attention layer hands to its cache are
fake-quantized to `format` with one scale per tensor or per key/value head, from static ranges
calibrated as the static activation ranges are (an EMA of min / max with `momentum`, averaged over
data-parallel ranks), and optionally trained (`range_learning`, LSQ). See docs/kv-cache.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError
from .schema import field, join

KV_FORMATS = ("fp8_e4m3", "int8")
KV_STRATEGIES = ("tensor", "head")


def _parse_modules(value, path):
    """Regexes (re.search on the dotted name) selecting attention modules; None: all of them."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(path, f"expected a non-empty list of regexes, got {value!r}")
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str):
            raise ConfigError(join(path, i), f"expected a regex string, got {pattern!r}")
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as err:
            raise ConfigError(join(path, i), f"{pattern!r} is not a valid regex ({err})") from None
    return tuple(value)


@dataclass(frozen=True)
class KVCacheQuantization:
    enabled: bool = field(False)
    format: str = field(
        "fp8_e4m3",
        choices=KV_FORMATS,
        lower=True,
        doc="number format the cache stores: fp8_e4m3 (what vLLM serves) or int8",
    )
    strategy: str = field(
        "tensor",
        choices=KV_STRATEGIES,
        lower=True,
        doc="one scale per layer's K (and V) tensor, or one per key/value head (compressed-tensors' attn_head)",
    )
    range_calibration: str = field(
        "static",
        choices=("static",),
        lower=True,
        doc="static: scales from an EMA of the ranges seen in training, frozen in eval and exported",
    )
    momentum: float = field(0.95, ge=0.0, lt=1.0, doc="EMA momentum of the static ranges")
    observer: str = field(
        "minmax",
        choices=("minmax", "mse"),
        lower=True,
        doc="each batch's range folded into the EMA: its min / max, or (mse) that range "
        "shrunk by the factor whose quantization error on the batch is least",
    )
    range_learning: bool = field(
        False,
        doc="the scales become Parameters (k_scale / v_scale of each "
        "attention module) trained by LSQ, starting from the "
        "calibrated range",
    )
    schedule_offset: int = field(0, ge=0, doc="training step at which the cache quantization turns on")
    modules: Optional[Tuple[str, ...]] = field(
        None, parse=_parse_modules, doc="regexes naming the attention modules; default: all"
    )
