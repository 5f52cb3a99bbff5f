"""Counter-based uniform numbers for stochastic rounding, identical on every device.

u(seed, i) = (hash32(lo32(i) ^ hash32(seed ^ hash32(hi32(i)))) >> 8) * 2^-24, in [0, 1).
hash32 is a 32-bit integer mixer (xorshift-multiply, "lowbias32"). The C/CUDA kernels in
csrc/include/qcompress/math.h compute the same function with uint32 arithmetic; here it is
written with int64 tensors, splitting products so nothing overflows.
"""

from __future__ import annotations

from typing import Union

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for a in [0, 2^32), computed in int64 without overflow."""
    lo = (a * (c & 0xFFFF)) & _M32
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    x = x ^ (x >> 16)
    return x


def mix_seed(seed: int, step: int) -> int:
    """Fold a training step into a seed so each step draws fresh, reproducible noise."""
    return int(mix_seed_tensor(seed, torch.tensor(step, dtype=torch.int64)).item())


def mix_seed_tensor(seed: int, step: torch.Tensor) -> torch.Tensor:
    """mix_seed with the step as an int64 tensor (0-d or any shape), on its device, with no host
    read-back: a compiled graph takes the step as an input instead of a constant that changes
    every step (which would compile one graph per step)."""
    return hash32((seed & _M32) ^ _mul32(step.to(torch.int64) & _M32, 0x9E3779B1))


def uniform(seed: Union[int, torch.Tensor], numel: int, device=None) -> torch.Tensor:
    """u(seed, i) for i in [0, numel) as float32 in [0, 1)."""
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    inner = hash32((idx >> 32) ^ 0)  # hi word of the index (zero below 2^32 elements)
    inner = hash32(inner ^ (seed & _M32))
    h = hash32((idx & _M32) ^ inner)
    return (h >> 8).to(torch.float32) * (2.0**-24)
