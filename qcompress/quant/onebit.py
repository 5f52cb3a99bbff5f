"""The 1-bit compressor of compressed communication (reference math).

compress:  y = x + error;  scale = ||y||_2 / sqrt(n);  bit = (y >= 0)  (zero counts as positive);
           new_error = y - scale * (2 bit - 1);  bits packed 8 per byte, most significant first.
decode_average of P packed chunks with scales s_j:  out = sum_j (2 bit_j - 1) * (s_j / P),
           accumulated in float32 in order j = 0 .. P-1.
The sum of squares accumulates in float64 and the scale rounds once to float32.
"""

from __future__ import annotations

import torch

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """bool [n] (n a multiple of 8) -> uint8 [n / 8], element 0 in the most significant bit."""
    if bits.numel() % 8:
        raise ValueError(f"packbits needs a multiple of 8 elements, got {bits.numel()}")
    b = bits.reshape(-1, 8).to(torch.uint8)
    return (b * _WEIGHTS.to(b.device)).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpackbits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> bool [..., 8 m] (inverse of packbits)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(*packed.shape[:-1], -1)


def compress(x: torch.Tensor, error: torch.Tensor):
    """(packed uint8 [n/8], scale float32 0-d, new_error float32 [n]) for flat x, error (n % 8 == 0)."""
    y = x.reshape(-1).to(torch.float32) + error.reshape(-1).to(torch.float32)
    n = y.numel()
    scale = torch.sqrt(y.to(torch.float64).square().sum() / max(n, 1)).to(torch.float32)
    bits = y >= 0
    signs = torch.where(bits, 1.0, -1.0)
    new_error = y - scale * signs
    return packbits(bits), scale, new_error


def decode_average(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [P, m], scales float32 [P] -> float32 [8 m], the average of the P chunks."""
    p = packed.shape[0]
    signs = torch.where(unpackbits(packed), 1.0, -1.0)
    weights = scales.to(torch.float32) / float(p)
    out = torch.zeros(signs.shape[1], dtype=torch.float32, device=packed.device)
    for j in range(p):
        out = out + signs[j] * weights[j]
    return out


def decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One packed chunk back to float32 values scale * (+-1)."""
    return torch.where(unpackbits(packed), 1.0, -1.0) * scale.to(torch.float32)
