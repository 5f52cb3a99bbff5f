"""Schema of DeepSpeed's top-level `progressive_layer_drop` section (plus our block selection)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError
from .schema import field, join


def _patterns(value, path):
    """A regex or a list of regexes (matched with re.search on dotted module names)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(path, f"expected a non-empty list of regexes, got {value!r}")
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str):
            raise ConfigError(join(path, i), f"expected a regex string, got {pattern!r}")
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as err:  # too deep / huge repeat count
            raise ConfigError(join(path, i), f"{pattern!r} is not a valid regex: {err}") from None
    return tuple(value)


@dataclass(frozen=True)
class ProgressiveLayerDrop:
    """DeepSpeed's keys and defaults (enabled false, theta 1.0, gamma 0.001): the keep probability
    theta(t) = (1 - theta) * exp(-gamma * t) + theta falls from 1 towards `theta` over global steps,
    and across depth as in the PLD paper. `modules`, `rescale` and `seed` are ours."""

    enabled: bool = field(False)
    theta: float = field(1.0, gt=0.0, le=1.0, doc="the keep probability the schedule tends to (theta-bar)")
    gamma: float = field(0.001, ge=0.0, doc="how fast theta(t) falls per global step")
    modules: Optional[Tuple[str, ...]] = field(
        None, parse=_patterns, doc="regexes naming the blocks; default: found automatically"
    )
    rescale: bool = field(True, doc="a kept block's change to its input is divided by its keep probability")
    seed: int = field(0, ge=0, doc="seed of the drop decisions (the same on every rank)")
