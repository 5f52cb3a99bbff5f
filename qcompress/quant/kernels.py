"""Bridge to the fused csrc/ kernels (filled in by the kernels work).

Exposes the same functions as :mod:`qcompress.quant.reference`:
`fake_quantize_with_mask(x, spec, min_val, max_val)`, `quantize(x, spec, min_val, max_val)`,
`dequantize(q, scale, zero_point, group_size=, num_groups=, dtype=)`.
"""
from __future__ import annotations

_error = "the csrc extension is not part of this build yet"


def available() -> bool:
    return False


def load_error() -> str:
    return _error
