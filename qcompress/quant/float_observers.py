"""The mse observer and learned scales of the float formats (quant/floats.py).

mse: each scale is searched over candidates below the absmax it is computed from, minimising the
summed error sum |x^ - x|^norm of its elements (float64), each candidate rounded exactly as minmax's
scale is, so the first candidate is minmax itself and the choice is never worse than it on that
error (ties keep the larger scale):

  fp8_e4m3  s = (p * amax) / 448 in the weight's dtype, p on the Search grid (1.00, 0.99, ... 0.21)
  nvfp4     first the FP32 global scale g = 448 * 6 / (p_g * amax(tensor)) for the grid's p_g > 1/2,
            each with its own minmax block scales (below 1/2 the e4m3 grid of the block scales
            repeats, only with more of them saturated at 448); then, at that g, each block scale
            over the e4m3 values from minmax's e4m3(g * amax / 6) down to e4m3(g * p * amax / 6)
            at the grid's smallest p: the distinct values the grid rounds to, one pass each
  mxfp4/8   the E8M0 exponent: minmax's (p = 1) or one below it (p = 0.5); a finer grid has no
            power of two to round to

The choice is kept (`shrink`, float32 [scales]: the factor p, for nvfp4 the number of e4m3 steps
below minmax's block scale, then one more element, the global p_g) and applied to the current absmax
at every forward, as the integer mse observer's factors are.

Range learning: the scales are Parameters, in the units the integer path learns (the weight's): FP8's
scale s, and for NVFP4 each block's effective scale sigma together with the global scale g. Forward
uses what export stores: FP8 s rounded to the weight's dtype; NVFP4 the block scale e4m3(sigma * g)
(clamped to e4m3's [2^-9, 448]) and g as FP32. Gradients are LSQ's with the roundings passed straight
through: dx^/ds = cast(x/s) - x/s inside the range, +-qmax where clamped; dx^/dx = 1 inside, 0
outside. For NVFP4 s = e4m3(sigma g) / g, so d s / d sigma = 1 and d s / d g = sigma / g - s / g (the
block scale's rounding residual) where sigma g is inside e4m3's range, -s / g where it saturates:
the global scale learns mainly from the blocks it saturates; where nothing saturates its value only
decides how the block scales round, which a straight-through gradient does not see (the mse
observer searches that). MX scales are powers of two: no straight-through step moves one, so they
are not learned (refused in the config).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import floats
from .floats import FloatSpec
from .observers import ACT_SAMPLE, DEFAULT_SEARCH, Search, shrink_grid

E4M3_MIN = 2.0**-9  # the smallest e4m3 subnormal: a learned NVFP4 block scale's floor
LEARNABLE = ("fp8_e4m3", "nvfp4")


# --- scales from (shrunk) absmax --------------------------------------------------------------


def _absmax(x: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """Each scale's absmax, in x's dtype: [1] tensor, [rows] channel/token, [r, g] group, [R, C] block."""
    t = floats._tiles(x.detach(), spec)
    a = torch.amax(torch.abs(t), dim=floats._reduce_dims(t, spec))
    floats._check_finite(a, a, f"{spec.format} {spec.granularity}")
    return a


def _shrunk(a: torch.Tensor, p) -> torch.Tensor:
    """p * a computed in float32 and rounded to a's dtype (p = 1: a itself)."""
    return (a.to(torch.float32) * p).to(a.dtype)


def _shaped(s: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """The scale in the shape floats.qparams gives it."""
    if spec.granularity in ("channel", "token"):
        return s.reshape(-1, 1)
    return s.reshape(1) if spec.granularity == "tensor" else s


def global_at(x: torch.Tensor, pg) -> torch.Tensor:
    """NVFP4's global scale from the tensor's absmax shrunk by pg (pg = 1: floats.tensor_global_scale)."""
    a = torch.amax(torch.abs(x.detach()))
    floats._check_finite(a, a, "global range")
    a = _shrunk(a, pg)
    return floats.global_scale(-a, a)


def _e4m3_bits(s: torch.Tensor) -> torch.Tensor:
    """e4m3 values (float32, already representable) -> their bit patterns as int32 (ordered as the
    positive values are)."""
    return s.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)


def block_scales(a: torch.Tensor, spec: FloatSpec, p, gscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each scale from its absmax a and its choice p (a scalar or a's shape; module docstring),
    rounded as minmax's: p = 1 (nvfp4: 0 steps) is minmax."""
    if spec.scale_kind == "float":
        return _shaped(floats.scales_from_absmax(_shrunk(a, p), spec), spec)
    s = floats.scales_from_absmax(a, spec, gscale)
    p = torch.as_tensor(p, device=a.device)
    if spec.scale_kind == "e4m3":  # p e4m3 steps below, never down to 0
        raw = floats.scales_from_absmax(a, spec, gscale, zero_floor=False)
        b = (_e4m3_bits(raw) - p.to(torch.int32)).clamp(min=1)
        return torch.where(raw > 0, b.to(torch.uint8).view(torch.float8_e4m3fn).to(s.dtype), s)
    half = s * 0.5  # one exponent below; only where E8M0 can hold it
    ok = (half > 0) & (half.to(torch.float32) >= 2.0**-127)
    return torch.where((p < 1) & ok, half, s)


def scales_with_shrink(
    x: torch.Tensor, spec: FloatSpec, shrink: torch.Tensor
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, global scale or None) of x with the kept shrink factors (mse_shrink's layout)."""
    a = _absmax(x, spec)
    n = a.numel()
    shrink = shrink.to(a.device)
    g = global_at(x, shrink[n]) if spec.scale_kind == "e4m3" else None
    return block_scales(a, spec, shrink[:n].reshape(a.shape), g), g


# --- the mse search ---------------------------------------------------------------------------


def group_errors(
    x: torch.Tensor,
    spec: FloatSpec,
    scale: torch.Tensor,
    gscale: Optional[torch.Tensor],
    norm: float = 2.0,
    x64: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per scale: sum over its elements of |x^ - x|^norm (float64, the scale's absmax shape);
    x64: x.double(), when the caller computes it once for many candidates."""
    y = floats.fake_quantize_float(x.detach(), spec, scale=scale, gscale=gscale)
    x64 = x.detach().double() if x64 is None else x64
    d = y.double().sub_(x64)
    e = floats._tiles(d.mul_(d) if norm == 2.0 else d.abs_().pow_(norm), spec)  # block padding adds 0
    return e.sum(dim=floats._reduce_dims(e, spec))


def candidates(spec: FloatSpec, search: Search = DEFAULT_SEARCH, device=None) -> torch.Tensor:
    """The per-scale choices searched, minmax's first: shrink factors (fp8), MX's two exponents."""
    if spec.scale_kind == "e8m0":
        return torch.tensor([1.0, 0.5], device=device)
    return shrink_grid(device, search)


def _steps(a, spec, grid, g) -> torch.Tensor:
    """NVFP4: how many e4m3 steps separate each minmax block scale from the smallest the grid gives."""
    top = floats.scales_from_absmax(a, spec, g, zero_floor=False)
    lo = floats.scales_from_absmax(_shrunk(a, grid[-1]), spec, g, zero_floor=False)
    # a block scale that rounds to 0 takes the format's floor (0.125), as compressed-tensors does:
    # that floor is so large against such a block that all of it rounds to 0 (error sum x^2),
    # and no nonzero candidate errs more (nearest rounding with 0 on the grid errs at most |x|),
    # so the steps stop at the smallest nonzero value
    return torch.where(top > 0, _e4m3_bits(top) - _e4m3_bits(lo).clamp(min=1), 0)


def _argmin(x, spec, a, grid, g, norm):
    """Per scale the first of the choices with the least error (float32, a's shape)."""
    if spec.scale_kind == "e4m3":
        steps = _steps(a, spec, grid, g)
        choices = [torch.tensor(float(k)) for k in range(int(steps.max().clamp(min=0)) + 1)]
    else:
        choices = list(grid)
    best = torch.zeros_like(a, dtype=torch.float32) + choices[0]
    best_err = torch.full(a.shape, float("inf"), dtype=torch.float64, device=a.device)
    x64 = x.double()
    for p in choices:
        err = group_errors(x, spec, block_scales(a, spec, p, g), g, norm, x64)
        better = err < best_err  # strict: on a tie the larger scale stays
        if spec.scale_kind == "e4m3":
            better &= p <= steps
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, p, best)
    return best


def mse_shrink(x: torch.Tensor, spec: FloatSpec, search: Search = DEFAULT_SEARCH) -> torch.Tensor:
    """The mse observer's choices for x (float32 [scales], nvfp4: + [1] global; module docstring).
    One fake-quantization pass over x per candidate, every scale at once."""
    if search.weight_by != "none":
        raise ValueError(f"{spec.format}: the mse search weighs the weight's own error (weight_by none)")
    x = x.detach()
    a = _absmax(x, spec)
    grid = candidates(spec, search, a.device)
    tail = []
    g = None
    if spec.scale_kind == "e4m3":
        zero = torch.zeros_like(a, dtype=torch.float32)
        tot = []
        pgs = grid[grid > 0.5]
        x64 = x.double()
        for pg in pgs:
            gp = global_at(x, pg)
            tot.append(group_errors(x, spec, block_scales(a, spec, zero, gp), gp, search.norm, x64).sum())
        pg = pgs[int(torch.argmin(torch.stack(tot)))]  # argmin: the first (largest) of equal errors
        g, tail = global_at(x, pg), [pg.reshape(1)]
    best = _argmin(x, spec, a, grid, g, search.norm)
    return torch.cat([best.reshape(-1)] + tail).to(torch.float32)


def activation_range(
    x: torch.Tensor, spec: FloatSpec, observer: str, search: Search = DEFAULT_SEARCH
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(min, max) float32 scalars of a whole activation tensor for a static float range: its own
    range, or (mse) that range times activation_shrink's factor."""
    flat = x.detach().reshape(-1).to(torch.float32)
    lo, hi = flat.amin(), flat.amax()
    if observer == "minmax" or flat.numel() == 0:
        return lo, hi
    p = activation_shrink(x, spec, lo, hi, search)
    return lo * p, hi * p


def activation_shrink(
    x: torch.Tensor, spec: FloatSpec, lo: torch.Tensor, hi: torch.Tensor, search: Search = DEFAULT_SEARCH
) -> torch.Tensor:
    """The factor p (float32 scalar) of a static range [lo, hi] whose error on x is least: the
    range sets FP8's per-tensor scale and NVFP4's global scale (its block scales stay dynamic).
    The error is measured on evenly strided rows of x (whole rows keep NVFP4's groups), at most
    about ACT_SAMPLE elements, as the integer search samples."""
    rows = x.detach().reshape(-1, x.shape[-1])
    sample = rows[:: max(1, -(-rows.numel() // ACT_SAMPLE))]
    best, best_err = torch.ones((), dtype=torch.float32), float("inf")
    for p in shrink_grid(None, search):
        y = floats.fake_quantize_float(sample, spec, static_range=(lo * p, hi * p))
        d = y.double() - sample.double()
        err = float((d.square() if search.norm == 2.0 else d.abs().pow(search.norm)).sum())
        if err < best_err:
            best, best_err = p, err
    return best


# --- learned scales ---------------------------------------------------------------------------


def _gvalue(gscale: torch.Tensor) -> torch.Tensor:
    return gscale.detach().to(torch.float32).reshape(1).clamp(min=torch.finfo(torch.float32).tiny)


def learned_scales(
    x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor, gscale: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, global scale) forward quantizes with, as export stores them: FP8 the learned scale
    in x's dtype (floored at its smallest normal); NVFP4 the e4m3 block scale of sigma * g and g."""
    if spec.format not in LEARNABLE:
        raise ValueError(f"{spec.format} scales are not learned (powers of two)")
    if spec.scale_kind == "e4m3":
        assert gscale is not None  # e4m3 block scales come with their global scale
        g = _gvalue(gscale)
        u = scale.detach().to(torch.float32) * g
        code = torch.clamp(u, E4M3_MIN, floats.E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        return code, g
    s = scale.detach().to(torch.float32).clamp(min=torch.finfo(x.dtype).tiny).to(x.dtype)
    return s, None


def learned_init(
    x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor, gscale: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The Parameters' values that make learned_scales give (scale, gscale) back (an observer's
    choice): FP8 the scale, NVFP4 sigma = block scale / g (e4m3(sigma * g) is the block scale again)."""
    if spec.scale_kind == "e4m3":
        assert gscale is not None  # e4m3 block scales come with their global scale
        g = gscale.to(torch.float32).reshape(1)
        return scale.to(torch.float32) / g, g.clone()
    return scale.to(torch.float32), None


class _LearnedFloat(torch.autograd.Function):
    """x^ with learned scales; the LSQ gradient (module docstring) to x, the scale and NVFP4's g."""

    @staticmethod
    def forward(ctx, x, scale, gscale, spec, grad_scale):
        s, g = learned_scales(x, spec, scale, gscale)
        y = floats._fake(x.detach(), spec, s, g, False)[0]
        ctx.save_for_backward(x, scale, *(() if gscale is None else (gscale,)))
        ctx.spec, ctx.grad_scale = spec, grad_scale
        return y

    @staticmethod
    def backward(ctx, grad):
        x, scale, *rest = ctx.saved_tensors
        gparam = rest[0] if rest else None
        spec = ctx.spec
        s, g = learned_scales(x, spec, scale, gparam)
        t, sb, v = floats._scaled(x.detach(), spec, s, g)
        inside = v.abs() <= spec.qmax  # x / s as forward rounded it (bf16 FP8: in bf16)
        q = floats._codes(v, spec).to(torch.float32)
        v = t.to(torch.float32) / sb.to(torch.float32)  # that rounding passed straight through
        ds = torch.where(inside, q - v, torch.sign(v) * spec.qmax)
        G = floats._tiles(grad.detach().to(torch.float32), spec)
        gx = floats._untile(G * inside, x, spec).to(grad.dtype)
        gs = (G.double() * ds.double()).sum(dim=floats._reduce_dims(t, spec))  # dL / d(effective scale)
        gs = gs.reshape(scale.shape)
        g_scale = g_g = None
        if spec.scale_kind == "e4m3":
            sig = scale.detach().double()
            gd = g.double()
            u = sig * gd
            ok = (u >= E4M3_MIN) & (u <= floats.E4M3_MAX)
            eff = s.double().reshape(scale.shape) / gd
            if ctx.needs_input_grad[1]:
                g_scale = (gs * ok) * ctx.grad_scale
            if ctx.needs_input_grad[2]:
                dg = torch.where(ok, sig / gd - eff / gd, -eff / gd)
                g_g = ((gs * dg).sum() * ctx.grad_scale).reshape(gparam.shape)
        elif ctx.needs_input_grad[1]:
            g_scale = gs * ctx.grad_scale
        g_scale = None if g_scale is None else g_scale.to(scale.dtype)
        g_g = None if g_g is None else g_g.to(gparam.dtype)
        return gx, g_scale, g_g, None, None


def fake_quantize_learned(
    x: torch.Tensor,
    spec: FloatSpec,
    scale: torch.Tensor,
    gscale: Optional[torch.Tensor] = None,
    grad_scale: Optional[float] = None,
) -> torch.Tensor:
    """x fake-quantized with learned scales (`scale` in the shape floats.qparams gives; NVFP4 also
    the global `gscale` [1]), LSQ gradients; grad_scale defaults to 1 / sqrt(n * qmax)."""
    if (gscale is None) != (spec.scale_kind != "e4m3"):
        raise ValueError(f"{spec.format}: a learned global scale is {'needed' if gscale is None else 'not used'}")
    if grad_scale is None:
        grad_scale = lsq_grad_scale(x.numel() // max(1, scale.numel()), spec)
    return _LearnedFloat.apply(x, scale, gscale, spec, float(grad_scale))


def lsq_grad_scale(elements_per_scale: int, spec: FloatSpec) -> float:
    """LSQ's 1 / sqrt(n * Qp), Qp the format's largest value (448 or 6)."""
    return 1.0 / float(max(1, int(elements_per_scale)) * spec.qmax) ** 0.5
