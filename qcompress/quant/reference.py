"""Quantizer math in plain torch: the test oracle and the fallback when kernels are not built.

Every element goes through the same few formulas (all in float32):

default numerics (what export writes, what compressed-tensors / vLLM dequantize)
  symmetric   s = absmax / qmax                     q = clamp(round(x / s), qmin, qmax)
  asymmetric  lo = min(min, 0), hi = max(max, 0)     s = (hi - lo) / (qmax - qmin)
              zp = clamp(qmin - round(lo / s), qmin, qmax)   q = clamp(round(x / s) + zp, qmin, qmax)
  dequantize  x^ = (q - zp) * s
deepspeed numerics (DeepSpeed's compression formulas, for users comparing runs)
  symmetric   s = 2 absmax / 2^b                     q = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1)
  asymmetric  s = (max - min) / 2^b,  z = round(min / s) * s
              q = clamp(round((x - z) / s), 0, 2^b - 1),     x^ = q * s + z
binary (1 bit)   s = mean|x|,  q = +1 if x >= 0 else -1 (deepspeed: sign(x), sign(0) = 0)
ternary (2 bits, when asked)  t = 0.7 mean|x|, keep = |x| > t, s = mean of |x| over kept,
                 q = sign(x) * keep

with qmin = -2^(b-1), qmax = 2^(b-1) - 1, integer ranges signed, round() half to even, and
every scale floored at EPS so a zero-range group never gives NaN. Stochastic rounding replaces
round(v) by floor(v + u) with u from :mod:`qcompress.quant.rng` (deepspeed: round(v + u - 0.5)).
Sums (mean|x|) accumulate in float64 and round once to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ..errors import NonFiniteError
from . import rng

EPS = 2.0**-100  # scale floor: finite 1/EPS in float32, far below any real weight range
GRANULARITIES = ("tensor", "channel", "group", "token")


@dataclass(frozen=True)
class Spec:
    """Everything that decides how a tensor is quantized, validated once."""

    bits: int
    symmetric: bool = True
    granularity: str = "tensor"
    group_size: Optional[int] = None
    num_groups: Optional[int] = None
    rounding: str = "nearest"
    seed: int = 0
    numerics: str = "default"
    ternary: bool = False
    # compiled stochastic rounding: the training step as a 0-d int64 CPU tensor (a graph input);
    # the rounding seed is then rng.mix_seed_tensor(seed, step), `seed` holding the unmixed one
    step: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def kind(self) -> str:
        if self.bits == 1:
            return "binary"
        if self.bits == 2 and self.ternary:
            return "ternary"
        return "int"

    @property
    def qmin(self) -> int:
        if self.numerics == "deepspeed" and not self.symmetric:
            return 0
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        if self.numerics == "deepspeed" and not self.symmetric:
            return (1 << self.bits) - 1
        return (1 << (self.bits - 1)) - 1


def make_spec(
    bits,
    *,
    symmetric=True,
    granularity="tensor",
    group_size=None,
    num_groups=None,
    rounding="nearest",
    seed=0,
    numerics="default",
    ternary=False,
    step=None,
) -> Spec:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an integer in 1..16, got {bits!r}")
    if num_groups is not None:
        if int(num_groups) < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups!r}")
        granularity = "groups"
    elif granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "group" and (group_size is None or int(group_size) < 1):
        raise ValueError(f"granularity 'group' needs group_size >= 1, got {group_size!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if numerics not in ("default", "deepspeed"):
        raise ValueError(f"numerics must be 'default' or 'deepspeed', got {numerics!r}")
    spec = Spec(
        bits, bool(symmetric), granularity, group_size, num_groups, rounding, int(seed), numerics, bool(ternary), step
    )
    if spec.kind != "int" and not spec.symmetric:
        raise ValueError(f"{spec.kind} quantization ({bits} bit) is symmetric only")
    return spec


# --- grouping: every granularity becomes a 2-D view [groups, elements] ---------------------------


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() >= 2 else 1


def _row_len(x: torch.Tensor) -> int:
    """Elements per row of the [rows, -1] view (defined even when there are zero rows)."""
    return math.prod(x.shape[1:]) if x.dim() >= 2 else x.numel()


def group_view(x: torch.Tensor, spec: Spec) -> Tuple[torch.Tensor, torch.Tensor]:
    """(X, counts): X[g] holds group g's elements (zero padded), counts[g] the real ones."""
    n = x.numel()
    g = spec.granularity
    if g == "tensor":
        view = x.reshape(1, n)
    elif g == "channel":
        view = x.reshape(_rows(x), -1) if n else x.reshape(_rows(x), 0)
    elif g == "token":
        last = x.shape[-1] if x.dim() else 1
        view = x.reshape(n // last if last else math.prod(x.shape[:-1]), last)
    elif g == "groups":
        groups = spec.num_groups
        assert groups is not None  # make_spec sets it with granularity "groups"
        if n % groups:
            raise ValueError(f"num_groups={groups} does not divide the tensor's {n} elements (shape {tuple(x.shape)})")
        view = x.reshape(groups, n // groups)
    else:  # group: contiguous runs of group_size along the input (last flattened) dim
        rows = _rows(x)
        k = _row_len(x)
        gs = spec.group_size
        assert gs is not None  # make_spec sets it with granularity "group"
        ng = max(1, math.ceil(k / gs))
        x2 = x.reshape(rows, k)
        if ng * gs != k:
            x2 = torch.nn.functional.pad(x2, (0, ng * gs - k))
        view = x2.reshape(rows * ng, gs)
        counts = torch.full((rows, ng), gs, dtype=torch.int64)
        if ng * gs != k:
            counts[:, -1] = k - (ng - 1) * gs
        return view, counts.reshape(-1).to(x.device)
    counts = torch.full((view.shape[0],), view.shape[1], dtype=torch.int64, device=x.device)
    return view, counts


def scale_shape(x: torch.Tensor, spec: Spec) -> Tuple[int, ...]:
    """Shape of the returned scale / zero point: broadcastable to x, or [rows, n_groups]."""
    g = spec.granularity
    if g == "tensor":
        return (1,) * max(x.dim(), 1)
    if g == "channel":
        return (_rows(x),) + (1,) * max(x.dim() - 1, 1)
    if g == "token":
        return tuple(x.shape[:-1]) + (1,) if x.dim() else (1,)
    groups, gs = spec.num_groups, spec.group_size
    if g == "groups":
        assert groups is not None  # make_spec sets it with granularity "groups"
        return (groups, 1)
    assert gs is not None  # granularity "group"
    return (_rows(x), max(1, math.ceil(_row_len(x) / gs)))


def ungroup(view: torch.Tensor, x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Inverse of group_view for an elementwise result (drops the padding)."""
    if spec.granularity == "group":
        rows = _rows(x)
        k = _row_len(x)
        view = view.reshape(rows, view.numel() // rows if rows else 0)[:, :k]
    return view.reshape(x.shape)


# --- statistics ----------------------------------------------------------------------------------

_F32_MAX = torch.finfo(torch.float32).max


def check_float32_range(x: torch.Tensor) -> None:
    """A float64 tensor whose finite values lie beyond float32's range cannot be quantized (the
    math is float32, where they become inf): say so, instead of the NaN/Inf report they would
    otherwise trigger."""
    if x.dtype != torch.float64 or not x.numel():
        return
    a = x.detach().abs()
    big = (a > _F32_MAX) & torch.isfinite(a)
    if bool(big.any()):
        raise NonFiniteError(
            f"{int(big.sum())} finite float64 values exceed float32's range (largest "
            f"|x| = {float(a[big].max()):.4g} > {_F32_MAX:.4g}); the quantizer computes "
            "in float32, where they would be inf: scale the tensor down first"
        )


def _check_finite(stat: torch.Tensor, what: str):
    bad = ~torch.isfinite(stat)
    if bool(bad.any()):
        raise NonFiniteError(
            f"{int(bad.sum())} of {stat.numel()} quantization groups contain NaN or "
            f"Inf values ({what}); fix the input before quantizing"
        )


def _mean_abs(X: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    total = X.abs().sum(dim=1, dtype=torch.float64)
    return (total / counts.clamp(min=1).to(torch.float64)).to(torch.float32)


def _range_over(hi: torch.Tensor, lo: torch.Tensor, d: float) -> torch.Tensor:
    """(hi - lo) / d; where hi - lo overflows float32 (finite values near FLT_MAX), the halves'
    difference over d / 2 instead, so the scale stays finite (other groups keep the plain formula's
    bits). math.h range_over is the same."""
    diff = hi - lo
    out = diff / d
    big = torch.isinf(diff)
    if bool(big.any()):
        out = torch.where(big, (hi * 0.5 - lo * 0.5) / (d * 0.5), out)
    return out


def qparams(X: torch.Tensor, counts: torch.Tensor, spec: Spec, min_val=None, max_val=None, shrink=None):
    """Per-group (scale, zero_point-or-None, extra) from the float32 group view X.

    `shrink` (float32 [groups], integer kinds): each group's range [lo, hi] becomes
    [lo * shrink, hi * shrink] before the formulas (what the mse observer chose).
    """
    kind = spec.kind
    if X.shape[1] == 0:
        zeros = torch.zeros(X.shape[0], dtype=torch.float32, device=X.device)
        zp = None if spec.symmetric else torch.zeros_like(zeros)
        return zeros.clamp(min=EPS), zp, None
    if kind == "binary":
        s = _mean_abs(X, counts)
        _check_finite(s, "mean |x|")
        return s.clamp(min=EPS), None, None
    if kind == "ternary":
        thr = 0.7 * _mean_abs(X, counts)
        _check_finite(thr, "mean |x|")
        keep = X.abs() > thr[:, None]
        kept = keep.sum(dim=1)
        total = (X.abs() * keep).sum(dim=1, dtype=torch.float64)
        s = (total / kept.clamp(min=1).to(torch.float64)).to(torch.float32)
        return s.clamp(min=EPS), None, thr
    if min_val is not None:
        lo = torch.as_tensor(min_val, dtype=torch.float32, device=X.device).reshape(1).expand(X.shape[0])
        hi = torch.as_tensor(max_val, dtype=torch.float32, device=X.device).reshape(1).expand(X.shape[0])
    else:
        lo, hi = group_minmax(X, counts)
    _check_finite(torch.stack([lo, hi]), "min/max")
    if shrink is not None:
        shrink = shrink.to(device=X.device, dtype=torch.float32).reshape(-1)
        lo, hi = lo * shrink, hi * shrink
    s, zp = int_params(lo, hi, spec)
    return s, zp, None


def group_minmax(X: torch.Tensor, counts: torch.Tensor):
    """(lo, hi) of each group's real elements (a ragged last group's zero padding excluded)."""
    if bool((counts < X.shape[1]).any()):
        # ragged last group: its zero padding must not widen the range (matters for asym)
        real = torch.arange(X.shape[1], device=X.device)[None, :] < counts[:, None]
        lo = torch.where(real, X, float("inf")).amin(dim=1)
        hi = torch.where(real, X, -float("inf")).amax(dim=1)
        empty = counts == 0  # a group with no real element has range [0, 0]
        return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    return X.amin(dim=1), X.amax(dim=1)


def int_params(lo: torch.Tensor, hi: torch.Tensor, spec: Spec):
    """(scale, zero point or None) of the integer grid for per-group ranges [lo, hi]."""
    ds = spec.numerics == "deepspeed"
    if spec.symmetric:
        amax = torch.maximum(lo.abs(), hi.abs())
        # deepspeed's 2 amax / 2^b, as amax / 2^(b-1): the same bits (power-of-two scaling is exact)
        # without overflowing at amax > FLT_MAX / 2
        s = (amax / float(1 << (spec.bits - 1))) if ds else amax / float(spec.qmax)
        return s.clamp(min=EPS), None
    if ds:
        lo = lo + 0.0  # -0 -> +0: an all-zero group's offset round(lo / s) * s is +0 (math.h too)
        # Floor the step at the float32 resolution of the group's values: a (near-)constant group
        # otherwise gets s ~ EPS and a zero point round(min / s) far outside int32 (DeepSpeed: NaN).
        floor = torch.maximum(lo.abs(), hi.abs()) * 2.0**-23
        s = torch.maximum(_range_over(hi, lo, float(1 << spec.bits)), floor).clamp(min=EPS)
        zq = torch.round(lo / s)
        return s, -zq
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    s = _range_over(hi, lo, float(spec.qmax - spec.qmin)).clamp(min=EPS)
    zp = (spec.qmin - torch.round(lo / s)).clamp(spec.qmin, spec.qmax)
    return s, zp


# --- elementwise ---------------------------------------------------------------------------------


def _round(v: torch.Tensor, spec: Spec, u: Optional[torch.Tensor]) -> torch.Tensor:
    if spec.rounding == "nearest":
        return torch.round(v)
    assert u is not None  # stochastic rounding: _noise drew it
    if spec.numerics == "deepspeed":
        return torch.round(v + (u - 0.5))
    return torch.floor(v + u)


def _noise(x: torch.Tensor, spec: Spec):
    if spec.rounding != "stochastic":
        return None
    seed = spec.seed if spec.step is None else rng.mix_seed_tensor(spec.seed, spec.step)
    u = rng.uniform(seed, x.numel(), device=x.device).reshape(x.shape)
    return u


def quantize_view(X, counts, spec: Spec, min_val=None, max_val=None, U=None, params=None):
    """Integer codes (float32 holding integers), scale, zero point, and clip mask for group view X.

    `params` = (scale [groups], zero_point [groups] or None), float32: use these instead of
    computing them from the groups (learned or observer-chosen ranges; binary and ternary codes
    still come from the values and their threshold).
    """
    if params is None:
        s, zp, thr = qparams(X, counts, spec, min_val, max_val)
    else:
        s, zp = params
        thr = 0.7 * _mean_abs(X, counts) if spec.kind == "ternary" and X.shape[1] else None
    kind = spec.kind
    if kind == "binary":
        if spec.numerics == "deepspeed":
            q = torch.sign(X)
        else:
            q = torch.where(X >= 0, 1.0, -1.0)
        return q, s, None, torch.ones_like(X, dtype=torch.bool)
    if kind == "ternary":
        if thr is None:  # zero-width groups: nothing to quantize
            return torch.zeros_like(X), s, None, torch.ones_like(X, dtype=torch.bool)
        q = torch.where(X > thr[:, None], 1.0, torch.where(X < -thr[:, None], -1.0, 0.0))
        return q, s, None, torch.ones_like(X, dtype=torch.bool)
    if spec.numerics == "deepspeed" and not spec.symmetric:
        z = (-zp[:, None]) * s[:, None]  # DeepSpeed's grid-snapped zero point, as a float
        v = (X - z) / s[:, None]
    else:
        v = X / s[:, None]
    r = _round(v, spec, U)
    if zp is not None and spec.numerics != "deepspeed":
        r = r + zp[:, None]
    inside = (r >= spec.qmin) & (r <= spec.qmax)
    q = r.clamp(spec.qmin, spec.qmax)
    return q, s, zp, inside


def dequantize_view(q, s, zp, spec: Spec):
    if spec.numerics == "deepspeed" and not spec.symmetric:
        return q * s[:, None] + (-zp[:, None]) * s[:, None]
    if zp is not None:
        return (q - zp[:, None]) * s[:, None]
    return q * s[:, None]


def shrunk_deviation(X: torch.Tensor, counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, p, spec: Spec):
    """(x^ - x float64, codes, scales) of group view X quantized with each group's range [p lo, p hi]
    (p: a factor or one per group): what the mse observer's searches compare."""
    s, zp = int_params(lo * p, hi * p, spec)
    q, _, _, _ = quantize_view(X, counts, spec, params=(s, zp))
    return (dequantize_view(q, s, zp, spec) - X).double(), q, s


def _int_dtype(spec: Spec):
    # deepspeed-asym codes are unsigned ([0, 2^b - 1]): 8 of them do not fit int8
    return torch.int8 if spec.qmin >= -128 and spec.qmax <= 127 else torch.int32


def _codes(xf: torch.Tensor, spec: Spec, min_val, max_val, params=None):
    """quantize_view over the grouped float32 tensor, with its stochastic-rounding noise."""
    X, counts = group_view(xf, spec)
    U = _noise(xf, spec)
    if U is not None:
        U, _ = group_view(U, spec)
    if params is not None:
        params = flat_params(params[0], params[1], X.shape[0], X.device)
    return quantize_view(X, counts, spec, min_val, max_val, U, params)


def num_groups(x: torch.Tensor, spec: Spec) -> int:
    """How many scales quantizing x with spec has (groups of the group view)."""
    return math.prod(scale_shape(x, spec))


def flat_params(scale: torch.Tensor, zero_point, groups: int, device):
    """(scale, zero point) as float32 [groups] vectors; the zero point an integer in float, None
    when symmetric. Raises when the counts do not match the groups."""
    s = scale.detach().to(device=device, dtype=torch.float32).reshape(-1)
    if s.numel() != groups:
        raise ValueError(f"expected {groups} scales for this tensor and granularity, got {s.numel()}")
    z = None
    if zero_point is not None:
        z = zero_point.detach().to(device=device, dtype=torch.float32).reshape(-1)
        if z.numel() != groups:
            raise ValueError(f"expected {groups} zero points, got {z.numel()}")
    return s, z


def quantize(x: torch.Tensor, spec: Spec, min_val=None, max_val=None, params=None):
    """(q, scale, zero_point) with q an integer tensor shaped like x; `params` as quantize_view's
    (scale and zero point given, e.g. learned ones: they come back reshaped, the zero point int32)."""
    check_float32_range(x)
    xf = x.detach().to(torch.float32)
    q, s, zp, _ = _codes(xf, spec, min_val, max_val, params)
    shape = scale_shape(x, spec)
    q = ungroup(q, xf, spec).to(_int_dtype(spec))
    zp = None if zp is None else zp.reshape(shape).to(torch.int32)
    return q, s.reshape(shape), zp


def fake_quantize_with_mask(x: torch.Tensor, spec: Spec, min_val=None, max_val=None, params=None):
    """(x^ in x's dtype, bool mask of elements that were not clipped)."""
    check_float32_range(x)
    xf = x.detach().to(torch.float32)
    q, s, zp, inside = _codes(xf, spec, min_val, max_val, params)
    y = saturate(dequantize_view(q, s, zp, spec), x.dtype)
    return ungroup(y, xf, spec).to(x.dtype), ungroup(inside, xf, spec)


def saturate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x^ clamped to the largest finite value of the output dtype (float32's for float64), so a
    finite input gives a finite output where (q - zp) s or q s + z overshoots it (the grid reaches
    half a step past the range; s * qmax can round above FLT_MAX). Other values keep their bits.
    math.h saturate / store_sat do the same."""
    if not dtype.is_floating_point:
        return y
    m = torch.finfo(dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32).max
    return y.clamp(-m, m)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point=None, *, group_size=None, num_groups=None, dtype=torch.float32
) -> torch.Tensor:
    """x^ = (q - zero_point) * scale, expanding per-group scales when group_size / num_groups is given."""
    qf = q.to(torch.float32)
    s = scale.to(torch.float32)
    z = None if zero_point is None else zero_point.to(torch.float32)
    if num_groups is not None:
        view = qf.reshape(num_groups, -1)
        out = (view - z.reshape(-1, 1)) * s.reshape(-1, 1) if z is not None else view * s.reshape(-1, 1)
        return out.reshape(q.shape).to(dtype)
    if group_size is not None:
        rows = _rows(q)
        k = _row_len(q)
        ng = max(1, math.ceil(k / group_size))
        s2 = s.reshape(rows, ng).repeat_interleave(group_size, dim=1)[:, :k]
        q2 = qf.reshape(rows, k)
        if z is not None:
            q2 = q2 - z.reshape(rows, ng).repeat_interleave(group_size, dim=1)[:, :k]
        return (q2 * s2).reshape(q.shape).to(dtype)
    if z is not None:
        qf = qf - z
    out = qf * s
    if out.shape != q.shape and out.numel() == q.numel():
        # a 1-D tensor's channel scale is [1, 1] and a 0-d tensor's is [1]: broadcasting would
        # add leading dims; x^ has q's shape
        out = out.reshape(q.shape)
    return out.to(dtype)


# --- learned step sizes (LSQ) ---------------------------------------------------------------------


def lsq_backward(grad: torch.Tensor, x: torch.Tensor, spec: Spec, scale: torch.Tensor, zero_point=None):
    """Gradients of x^ = (clamp(round(x / s) + z, qmin, qmax) - z) * s, with round() passed straight
    through (LSQ, Esser et al. 2020; the zero point as in LSQ+):

      inside the grid    dx^/dx = 1   dx^/ds = round(x / s) - x / s   dx^/dz = 0
      clipped below      dx^/dx = 0   dx^/ds = qmin - z               dx^/dz = -s
      clipped above      dx^/dx = 0   dx^/ds = qmax - z               dx^/dz = -s

    binary / ternary (x^ = q * s, codes from the values): dx^/dx = 1, dx^/ds = q.
    Returns (grad_x in grad's dtype, sum over each group of grad * dx^/ds, the same for z or None),
    the sums float32 [groups] accumulated in float64 and not yet multiplied by any gradient scale.
    """
    xf = x.detach().to(torch.float32)
    X, counts = group_view(xf, spec)
    G, _ = group_view(grad.detach().to(torch.float32), spec)
    s, zp = flat_params(scale, zero_point, X.shape[0], X.device)
    if spec.kind != "int":
        q, _, _, _ = quantize_view(X, counts, spec, params=(s, zp))
        gs = (G.double() * q.double()).sum(dim=1).to(torch.float32)
        return grad.clone(), gs, None
    U = _noise(xf, spec)
    if U is not None:
        U, _ = group_view(U, spec)
    v = X / s[:, None]
    r = _round(v, spec, U)
    rz = r + zp[:, None] if zp is not None else r
    below, above = rz < spec.qmin, rz > spec.qmax
    inside = ~(below | above)
    z = zp[:, None] if zp is not None else torch.zeros_like(s)[:, None]
    ds = torch.where(inside, r - v, torch.where(below, spec.qmin - z, spec.qmax - z))
    gs = (G.double() * ds.double()).sum(dim=1).to(torch.float32)
    gz = None
    if zp is not None:
        dz = torch.where(inside, torch.zeros_like(v), -s[:, None].expand_as(v))
        gz = (G.double() * dz.double()).sum(dim=1).to(torch.float32)
    grad_x = grad * ungroup(inside, xf, spec).to(grad.dtype)
    return grad_x, gs, gz
