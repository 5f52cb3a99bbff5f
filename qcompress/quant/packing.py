"""Integer packing in compressed-tensors' `pack-quantized` layout.

Signed b-bit values are offset by 2^(b-1) to unsigned, then element j of each run of 32/b
values goes to bits [j*b, (j+1)*b) of an int32 word (LSB first) along the packed dim.
Only b in {1, 2, 4, 8} divide 32, the widths whose layout is stable across versions.
"""

from __future__ import annotations

import math

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def _check_bits(bits):
    if bits not in PACKABLE_BITS:
        raise ValueError(f"int32 packing supports {PACKABLE_BITS} bits, got {bits}")


def pack_int32(q: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack signed integers q (any int dtype, values in [-2^(b-1), 2^(b-1)-1]) along `dim`."""
    _check_bits(bits)
    per = 32 // bits
    q = q.movedim(dim, -1)
    k = q.shape[-1]
    n_words = math.ceil(k / per)
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    if n_words * per != k:
        u = torch.nn.functional.pad(u, (0, n_words * per - k))
    u = u.reshape(*q.shape[:-1], n_words, per)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (u << shifts).sum(dim=-1)
    words = torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: `length` signed int8 values along `dim`."""
    _check_bits(bits)
    per = 32 // bits
    p = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    u = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    u = u.reshape(*p.shape[:-1], -1)[..., :length]
    return (u - (1 << (bits - 1))).to(torch.int8).movedim(-1, dim)
