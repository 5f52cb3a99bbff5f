"""Public quantizer functions; dispatch between the fused kernels and the reference.

backend=None uses the kernels when the csrc extension loaded, else the reference (with a
one-time warning); "kernel" insists on the kernels, "reference" forces the pure-torch path.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import kernels as _kernels, reference
from .reference import Spec, make_spec

_warned = False


def kernels_available() -> bool:
    return _kernels.available()


def _backend(backend: Optional[str]):
    global _warned
    if backend is None and _kernels.available():  # the common call: no checks beyond this one
        return _kernels
    if backend not in (None, "kernel", "reference"):
        raise ValueError(f"backend must be None, 'kernel' or 'reference', got {backend!r}")
    if backend == "reference":
        return reference
    if _kernels.available():
        return _kernels
    if backend == "kernel":
        raise RuntimeError(
            f"backend='kernel' asked for, but the qcompress C++ extension is not loaded: {_kernels.load_error()}"
        )
    if not _warned:
        _warned = True
        warnings.warn(
            "qcompress kernels are not built; using the pure-torch reference quantizer "
            f"(slower). Reason: {_kernels.load_error()}",
            stacklevel=3,
        )
    return reference


class _FakeQuantize(torch.autograd.Function):
    """Straight-through estimator; with clip_grad the gradient of clipped elements is zero."""

    @staticmethod
    def forward(ctx, x, spec, impl, clip_grad, min_val, max_val, params=None):
        if clip_grad:
            y, inside = _with_mask(impl, x, spec, min_val, max_val, params)
            ctx.save_for_backward(inside)
        else:
            y = _values_only(impl, x, spec, min_val, max_val, params)
        ctx.clip_grad = clip_grad
        ctx.impl = impl
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.clip_grad:
            (inside,) = ctx.saved_tensors
            fused = getattr(ctx.impl, "ste_backward", None)  # kernels: one pass
            grad = fused(grad, inside) if fused else grad * inside.to(grad.dtype)
        return grad, None, None, None, None, None, None


def _with_mask(impl, x, spec, min_val, max_val, params=None):
    if params is None:
        return impl.fake_quantize_with_mask(x, spec, min_val, max_val)
    return impl.fake_quantize_with_mask(x, spec, min_val, max_val, params=params)


def _values_only(impl, x, spec, min_val, max_val, params=None):
    """x^ without the clip mask (the kernels then skip writing it)."""
    only = getattr(impl, "fake_quantize", None)
    if only is not None:
        if params is None:
            return only(x, spec, min_val, max_val)
        return only(x, spec, min_val, max_val, params=params)
    return _with_mask(impl, x, spec, min_val, max_val, params)[0]


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric=True,
    granularity="tensor",
    group_size=None,
    num_groups=None,
    rounding="nearest",
    seed=0,
    numerics="default",
    ternary=False,
    clip_grad=False,
    min_val=None,
    max_val=None,
    backend=None,
) -> torch.Tensor:
    """Quantize then dequantize x (same shape and dtype) with a straight-through gradient.

    `clip_grad=True` zeroes the gradient where a value was clipped to the integer range.
    `min_val`/`max_val` give a static range (tensor granularity) instead of the tensor's own.
    """
    spec = make_spec(
        bits,
        symmetric=symmetric,
        granularity=granularity,
        group_size=group_size,
        num_groups=num_groups,
        rounding=rounding,
        seed=seed,
        numerics=numerics,
        ternary=ternary,
    )
    return fake_quantize_spec(x, spec, clip_grad=clip_grad, min_val=min_val, max_val=max_val, backend=backend)


def fake_quantize_spec(
    x, spec: Spec, *, clip_grad=False, min_val=None, max_val=None, backend=None, scale=None, zero_point=None
):
    """As fake_quantize with a Spec. `scale` (and `zero_point`, asymmetric) give each group's
    parameters instead of computing them from x (observer-chosen ranges); x's gradient is still
    straight-through, nothing flows to the given parameters (see fake_quantize_learned)."""
    _check_range_args(spec, min_val, max_val)
    reference.check_float32_range(x)
    impl = _backend(backend)
    params = None
    if scale is not None:
        if min_val is not None:
            raise ValueError("give a static range (min_val/max_val) or per-group scales, not both")
        params = (scale, zero_point)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuantize.apply(x, spec, impl, clip_grad, min_val, max_val, params)
    return _values_only(impl, x, spec, min_val, max_val, params)


# --- learned step sizes (LSQ) ---------------------------------------------------------------------


def learned_params(scale: torch.Tensor, zero_point, spec: Spec):
    """The (scale, zero point) a learned range quantizes with: float32 [groups], the scale floored
    at EPS, the zero point rounded (half to even) and clamped to the integer range. Export writes
    exactly these."""
    s = scale.detach().to(torch.float32).reshape(-1).clamp(min=reference.EPS)
    z = None
    if zero_point is not None:
        z = torch.round(zero_point.detach().to(torch.float32).reshape(-1)).clamp(spec.qmin, spec.qmax)
    return s, z


def lsq_grad_scale(elements_per_scale: int, spec: Spec) -> float:
    """LSQ's gradient scale g = 1 / sqrt(n * Qp): n elements share a scale, Qp is the largest
    positive code (1 for binary and ternary)."""
    qp = spec.qmax if spec.kind == "int" else 1
    return 1.0 / float(max(1, int(elements_per_scale)) * max(1, qp)) ** 0.5


class _LearnedFakeQuantize(torch.autograd.Function):
    """LSQ: x^ = (clamp(round(x / s) + z) - z) * s with the gradients of reference.lsq_backward;
    the scale's and zero point's are multiplied by grad_scale, and pass the EPS floor and the
    zero point's rounding and clamp straight through."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, spec, impl, grad_scale):
        s, z = learned_params(scale, zero_point, spec)
        y = _values_only(impl, x, spec, None, None, (s, z))
        ctx.save_for_backward(x, s, *(() if z is None else (z,)))
        ctx.spec, ctx.impl, ctx.grad_scale = spec, impl, grad_scale
        ctx.shapes = (scale.shape, scale.dtype, None if zero_point is None else (zero_point.shape, zero_point.dtype))
        return y

    @staticmethod
    def backward(ctx, grad):
        x, s, *rest = ctx.saved_tensors
        z = rest[0] if rest else None
        gx, gs, gz = ctx.impl.lsq_backward(grad.contiguous(), x, ctx.spec, s, z)
        (s_shape, s_dtype, z_meta) = ctx.shapes
        g_s = (gs * ctx.grad_scale).reshape(s_shape).to(s_dtype) if ctx.needs_input_grad[1] else None
        g_z = None
        if z_meta is not None and ctx.needs_input_grad[2] and gz is not None:
            g_z = (gz * ctx.grad_scale).reshape(z_meta[0]).to(z_meta[1])
        return (gx if ctx.needs_input_grad[0] else None), g_s, g_z, None, None, None


def fake_quantize_learned(
    x: torch.Tensor,
    spec: Spec,
    scale: torch.Tensor,
    zero_point=None,
    *,
    grad_scale: Optional[float] = None,
    backend=None,
) -> torch.Tensor:
    """Fake-quantize x with learnable per-group `scale` (and `zero_point` when spec is asymmetric;
    any shapes holding one value per group) and LSQ gradients to x, scale and zero point.
    grad_scale defaults to lsq_grad_scale(elements per group)."""
    if (zero_point is None) != spec.symmetric and spec.kind == "int":
        raise ValueError("an asymmetric spec needs a zero point, a symmetric one none")
    if spec.numerics != "default":
        raise ValueError("learned ranges use the default numerics")
    groups = reference.num_groups(x, spec)
    if grad_scale is None:
        grad_scale = lsq_grad_scale(x.numel() // max(1, groups), spec)
    return _LearnedFakeQuantize.apply(
        x, scale, zero_point if spec.kind == "int" else None, spec, _backend(backend), float(grad_scale)
    )


def quantize(
    x: torch.Tensor,
    bits: int,
    *,
    symmetric=True,
    granularity="tensor",
    group_size=None,
    num_groups=None,
    rounding="nearest",
    seed=0,
    numerics="default",
    ternary=False,
    min_val=None,
    max_val=None,
    backend=None,
):
    """Quantize x to integers: returns (q, scale, zero_point).

    q has x's shape (int8 up to 8 bits, int32 above); scale is float32, shaped to broadcast
    against x for tensor/channel/token granularity, [rows, n_groups] for `group` and
    [num_groups, 1] for `num_groups`; zero_point is int32 like scale, or None when symmetric.
    """
    spec = make_spec(
        bits,
        symmetric=symmetric,
        granularity=granularity,
        group_size=group_size,
        num_groups=num_groups,
        rounding=rounding,
        seed=seed,
        numerics=numerics,
        ternary=ternary,
    )
    return quantize_spec(x, spec, min_val=min_val, max_val=max_val, backend=backend)


def quantize_spec(x, spec: Spec, *, min_val=None, max_val=None, backend=None, scale=None, zero_point=None):
    """(q, scale, zero_point); given `scale` (and `zero_point`), the codes for those parameters."""
    _check_range_args(spec, min_val, max_val)
    reference.check_float32_range(x)
    if scale is not None:
        return _backend(backend).quantize(x, spec, None, None, params=(scale, zero_point))
    return _backend(backend).quantize(x, spec, min_val, max_val)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point=None,
    *,
    group_size=None,
    num_groups=None,
    dtype=torch.float32,
    backend=None,
) -> torch.Tensor:
    """x^ = (q - zero_point) * scale (see :func:`quantize` for the scale shapes)."""
    return _backend(backend).dequantize(q, scale, zero_point, group_size=group_size, num_groups=num_groups, dtype=dtype)


def _check_range_args(spec, min_val, max_val):
    if (min_val is None) != (max_val is None):
        raise ValueError("give both min_val and max_val for a static range, or neither")
    if min_val is not None and spec.granularity != "tensor":
        raise ValueError(f"a static range (min_val/max_val) needs granularity 'tensor', not {spec.granularity!r}")
