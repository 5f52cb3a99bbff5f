"""Schema of `compression_training.lora`: low-rank adapters trained while the base is quantized.

    lora: {enabled: true, r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, v_proj],
           mode: qat, merge: false}

`mode: qat` fake-quantizes the merged weight W + (alpha / r) B A in each targeted layer's forward
(the base W frozen); the export writes the quantized merged weights. `mode: qlora` stores the base
quantized (the export's codes) and frozen, the adapters beside it in full precision; the export
writes the quantized base plus the adapter in peft's format, and with `merge: true` also the merged,
re-quantized model. The checks that need the model (targets, formats, schedules) are in
qcompress/lora_rewrite.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError
from .schema import field, join

MODES = ("qat", "qlora")


def _parse_targets(value, path):
    """Regexes matched with re.search on dotted module names, as a group's `modules`; missing, "all"
    or "*": every Linear (and transformers Conv1D) layer but the output head (None)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list of regex strings, got {value!r}")
    if not value:
        raise ConfigError(path, "is empty: name the layers to adapt (regexes), or drop the key for every Linear layer")
    out = []
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str):
            raise ConfigError(join(path, i), f"expected a regex string, got {pattern!r}")
        if pattern in ("all", "*"):
            return None
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as err:
            raise ConfigError(join(path, i), f"{pattern!r} is not a valid regex ({err})") from None
        out.append(pattern)
    return tuple(out)


@dataclass(frozen=True)
class Lora:
    enabled: bool = field(False)
    r: int = field(8, doc="rank of each adapter (B is [out, r], A is [r, in])")
    alpha: Optional[float] = field(
        None, gt=0.0, doc="the adapter's update is scaled by alpha / r (peft's lora_alpha); default: r (scaling 1)"
    )
    dropout: float = field(
        0.0,
        ge=0.0,
        lt=1.0,
        doc="qlora: dropout on the adapter's input, as peft (mode qat merges the "
        "adapter into the weight, where it has no place: 0 only)",
    )
    target_modules: Optional[Tuple[str, ...]] = field(
        None, parse=_parse_targets, doc="regexes (re.search) of the layers to adapt; default: every Linear layer"
    )
    mode: str = field(
        "qat",
        choices=MODES,
        lower=True,
        doc="qat: fake-quantize W + (alpha/r) B A; qlora: base stored quantized, adapters beside it",
    )
    merge: bool = field(False, doc="qlora: the export also writes the merged, re-quantized model (merged/)")

    def _validate(self, path):
        # r has no upper bound we can know here (it must stay below the layer's width, checked
        # against the model); below 1 there is no adapter at all
        if self.r < 1:
            raise ConfigError(
                join(path, "r"),
                f"{self.r} is out of range; an adapter has rank >= 1 "
                "(16 is common); to train without adapters set enabled: false",
            )
        if self.dropout > 0.0 and self.mode == "qat":
            raise ConfigError(
                join(path, "dropout"),
                f"{self.dropout}, but mode qat merges the adapter into one "
                "weight, where dropout on the adapter's input has no place: "
                "set dropout 0, or use mode qlora",
            )
        if self.merge and self.mode != "qlora":
            raise ConfigError(
                join(path, "merge"),
                "applies to mode 'qlora' (its export holds the base and "
                "the adapter apart); mode 'qat' always exports the merged "
                "weights: drop merge",
            )
