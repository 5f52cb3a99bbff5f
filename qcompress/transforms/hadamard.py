"""Hadamard matrices and block-diagonal rotations of one tensor dimension.

Every rotation here is block-diagonal: one b x b block repeated along a dimension of width n
(b divides n). A Sylvester Hadamard block has entries +-1 (H H^T = b I); divided by sqrt(b) it is
orthogonal. `random-hadamard` multiplies its rows by random signs, which keeps it orthogonal.
compressed-tensors stores such blocks unnormalized (its `head_dim` is the block size) and divides
by sqrt(b) when it applies them; so do we (transforms/online.py).
"""

from __future__ import annotations

from typing import Optional

import torch


def sylvester(b: int, dtype=torch.float64) -> torch.Tensor:
    """The b x b Sylvester Hadamard matrix (entries +-1, symmetric); b a power of two. Built by
    doubling, H_2n = [[H, H], [H, -H]]: row i, column j is (-1)^popcount(i & j), the order the
    fast Walsh-Hadamard transform uses."""
    if b < 1 or b & (b - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has 2^k rows, not {b}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def largest_power_of_two_block(n: int) -> int:
    """The largest power of two dividing n (576 = 9 x 64 -> 64)."""
    return n & -n


def block_for(width: int, block_size: Optional[int]) -> Optional[int]:
    """The block of a rotation of `width`: `block_size` when given (None when it does not divide
    the width), else the largest power of two that divides it."""
    if block_size is None:
        return largest_power_of_two_block(width)
    return block_size if width % block_size == 0 else None


def unnormalized_block(b: int, kind: str, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A b x b block with entries +-1 (float64): Sylvester's, or ('random-hadamard') with each row
    multiplied by a random sign drawn from `generator`."""
    h = sylvester(b)
    if kind == "hadamard":
        return h
    if kind != "random-hadamard":
        raise ValueError(f"unknown rotation type {kind!r}")
    signs = torch.randint(0, 2, (b,), generator=generator).to(torch.float64) * 2 - 1
    return signs[:, None] * h


def rotate_dim(t: torch.Tensor, dim: int, block: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """t with dimension `dim` multiplied by the block-diagonal matrix diag(block, ..., block):
    out[.., i, ..] = sum_j t[.., j, ..] * M[j, i] (t's rows as vectors times M). `scale` (a vector
    of that dimension's width) multiplies the dimension first (a folded norm's weight). Computed
    in the block's dtype; returns that dtype."""
    x = t.movedim(dim, -1).to(block.dtype)
    if scale is not None:
        x = x * scale.to(block.dtype)
    b = block.shape[0]
    shape = x.shape
    if shape[-1] % b:
        raise ValueError(f"a block of {b} does not divide the width {shape[-1]}")
    # one GEMM over every block of every row (a batched product of strided blocks is far slower)
    x = (x.contiguous().view(-1, b) @ block).view(shape)
    return x.movedim(-1, dim)
