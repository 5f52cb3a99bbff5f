"""Range observers: how the range of an integer grid is chosen from the values it quantizes.

minmax  the group's own [min, max] (the formulas of reference.py), qcompress's default.
mse     the group's [min, max] shrunk by the factor p that minimises the reconstruction error
        sum over the group of (x^(p) - x)^2 (norm 2, summed in float64), p searched over the grid
        p = 1 - k / GRID_STEPS for k = 0 .. MAX_SHRINK * GRID_STEPS - 1, i.e. 1.00, 0.99, ..., 0.21.
        Ties keep the larger p, and p = 1 is minmax itself, so mse is never worse than minmax on
        that error. Rounding is nearest during the search (a stochastic grid is chosen the same).

Binary and ternary kinds have no range (scale = mean |x| of the values or of the kept values):
both observers give their own scale there (shrink 1).

The search runs once per range update (the first quantization and each bit drop): on CPU in
the fused `mse_errors` kernel (every candidate's scales computed at once, then one pass over the
tensor per candidate that only accumulates errors), elsewhere vectorized in torch (one pass per
grid point, every group at once); never a Python loop over elements or groups.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference
from .reference import Spec, dequantize_view, group_minmax, group_view, int_params, quantize_view

OBSERVERS = ("minmax", "mse")
GRID_STEPS = 100
MAX_SHRINK = 0.80
ACT_SAMPLE = 16384   # activations: the error is measured on at most this many strided elements


def shrink_grid(device=None) -> torch.Tensor:
    """The candidate shrink factors, largest first, float32."""
    n = int(round(MAX_SHRINK * GRID_STEPS))
    return torch.tensor([(GRID_STEPS - k) / GRID_STEPS for k in range(n)], dtype=torch.float32,
                        device=device)


def _nearest(spec: Spec) -> Spec:
    if spec.rounding == "nearest":
        return spec
    return reference.make_spec(spec.bits, symmetric=spec.symmetric, granularity=spec.granularity,
                               group_size=spec.group_size, num_groups=spec.num_groups,
                               numerics=spec.numerics, ternary=spec.ternary)


def _search_kernel(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: Spec) -> Optional[torch.Tensor]:
    """The same search with the fused CPU kernel: every candidate's parameters at once, then one
    pass over the tensor per candidate computing only the errors."""
    from . import kernels
    if not kernels.available():
        return None
    grid = shrink_grid(lo.device)[:, None]
    s, zp = int_params(lo[None, :] * grid, hi[None, :] * grid, _nearest(spec))
    err = kernels.mse_errors(x, spec, s, zp)
    if err is None:
        return None
    return grid[:, 0][torch.argmin(err, dim=0)]      # argmin: the first (largest p) of equal errors


def _search(X: torch.Tensor, counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
            spec: Spec) -> torch.Tensor:
    """Per-group argmin over the grid of the squared error of X quantized with [p lo, p hi]
    (the reference: one vectorized pass per grid point)."""
    spec = _nearest(spec)
    best = torch.ones(X.shape[0], dtype=torch.float32, device=X.device)
    best_err = torch.full((X.shape[0],), float("inf"), dtype=torch.float64, device=X.device)
    for p in shrink_grid(X.device):
        s, zp = int_params(lo * p, hi * p, spec)
        q, _, _, _ = quantize_view(X, counts, spec, params=(s, zp))
        err = (dequantize_view(q, s, zp, spec) - X).double().square().sum(dim=1)
        better = err < best_err          # strict: on a tie the larger shrink factor stays
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, p, best)
    return best


def mse_shrink(x: torch.Tensor, spec: Spec, backend: Optional[str] = None) -> torch.Tensor:
    """The mse observer's shrink factor of each group of x (float32 [groups]; ones for binary and
    ternary kinds, which have no range). backend: None (the CPU kernel when built) or "reference"."""
    xf = x.detach().to(torch.float32)
    X, counts = group_view(xf, spec)
    if spec.kind != "int" or X.shape[1] == 0:
        return torch.ones(X.shape[0], dtype=torch.float32, device=X.device)
    lo, hi = group_minmax(X, counts)
    reference._check_finite(torch.stack([lo, hi]), "min/max")
    if backend != "reference":
        out = _search_kernel(xf, lo, hi, spec)
        if out is not None:
            return out
    return _search(X, counts, lo, hi, spec)


def weight_params(x: torch.Tensor, spec: Spec, observer: str,
                  shrink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, zero point or None) of each group of x, float32 [groups] (the zero point holds an
    integer), as the observer chooses them; `shrink` reuses factors chosen earlier."""
    if observer not in OBSERVERS:
        raise ValueError(f"observer must be one of {OBSERVERS}, got {observer!r}")
    xf = x.detach().to(torch.float32)
    X, counts = group_view(xf, spec)
    if observer == "mse" and shrink is None:
        shrink = mse_shrink(xf, spec)
    s, zp, _ = reference.qparams(X, counts, spec, shrink=shrink if spec.kind == "int" else None)
    return s, zp


def activation_range(x: torch.Tensor, spec: Spec, observer: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(min, max) float32 scalars of a whole activation tensor as the observer chooses them: its own
    range, or (mse) that range shrunk by the factor whose error is least on at most ACT_SAMPLE
    evenly strided elements of x."""
    flat = x.detach().reshape(-1).to(torch.float32)
    lo, hi = flat.amin(), flat.amax()
    if observer == "minmax" or spec.kind != "int" or flat.numel() == 0:
        return lo, hi
    stride = max(1, -(-flat.numel() // ACT_SAMPLE))
    sample = flat[::stride].reshape(1, -1)
    counts = torch.full((1,), sample.shape[1], dtype=torch.int64, device=sample.device)
    p = _search(sample, counts, lo.reshape(1), hi.reshape(1), spec)[0]
    return lo * p, hi * p
