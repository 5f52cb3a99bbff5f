"""Public quantizer functions; dispatch between the fused kernels and the reference.

backend=None uses the kernels when the csrc extension loaded, else the reference (with a
one-time warning); "kernel" insists on the kernels, "reference" forces the pure-torch path.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import reference
from .reference import Spec, make_spec

_warned = False


def kernels_available() -> bool:
    from . import kernels
    return kernels.available()


def _backend(backend: Optional[str]):
    global _warned
    if backend not in (None, "kernel", "reference"):
        raise ValueError(f"backend must be None, 'kernel' or 'reference', got {backend!r}")
    if backend == "reference":
        return reference
    from . import kernels
    if kernels.available():
        return kernels
    if backend == "kernel":
        raise RuntimeError(f"backend='kernel' asked for, but the qcompress C++ extension is not "
                           f"loaded: {kernels.load_error()}")
    if not _warned:
        _warned = True
        warnings.warn("qcompress kernels are not built; using the pure-torch reference quantizer "
                      f"(slower). Reason: {kernels.load_error()}", stacklevel=3)
    return reference


class _FakeQuantize(torch.autograd.Function):
    """Straight-through estimator; with clip_grad the gradient of clipped elements is zero."""

    @staticmethod
    def forward(ctx, x, spec, impl, clip_grad, min_val, max_val):
        if clip_grad:
            y, inside = impl.fake_quantize_with_mask(x, spec, min_val, max_val)
            ctx.save_for_backward(inside)
        else:
            y = _values_only(impl, x, spec, min_val, max_val)
        ctx.clip_grad = clip_grad
        ctx.impl = impl
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.clip_grad:
            (inside,) = ctx.saved_tensors
            fused = getattr(ctx.impl, "ste_backward", None)  # kernels: one pass
            grad = fused(grad, inside) if fused else grad * inside.to(grad.dtype)
        return grad, None, None, None, None, None


def _values_only(impl, x, spec, min_val, max_val):
    """x^ without the clip mask (the kernels then skip writing it)."""
    only = getattr(impl, "fake_quantize", None)
    if only is not None:
        return only(x, spec, min_val, max_val)
    return impl.fake_quantize_with_mask(x, spec, min_val, max_val)[0]


def fake_quantize(x: torch.Tensor, bits: int, *, symmetric=True, granularity="tensor",
                  group_size=None, num_groups=None, rounding="nearest", seed=0,
                  numerics="default", ternary=False, clip_grad=False, min_val=None, max_val=None,
                  backend=None) -> torch.Tensor:
    """Quantize then dequantize x (same shape and dtype) with a straight-through gradient.

    `clip_grad=True` zeroes the gradient where a value was clipped to the integer range.
    `min_val`/`max_val` give a static range (tensor granularity) instead of the tensor's own.
    """
    spec = make_spec(bits, symmetric=symmetric, granularity=granularity, group_size=group_size,
                     num_groups=num_groups, rounding=rounding, seed=seed, numerics=numerics,
                     ternary=ternary)
    return fake_quantize_spec(x, spec, clip_grad=clip_grad, min_val=min_val, max_val=max_val,
                              backend=backend)


def fake_quantize_spec(x, spec: Spec, *, clip_grad=False, min_val=None, max_val=None, backend=None):
    _check_range_args(spec, min_val, max_val)
    impl = _backend(backend)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuantize.apply(x, spec, impl, clip_grad, min_val, max_val)
    return _values_only(impl, x, spec, min_val, max_val)


def quantize(x: torch.Tensor, bits: int, *, symmetric=True, granularity="tensor", group_size=None,
             num_groups=None, rounding="nearest", seed=0, numerics="default", ternary=False,
             min_val=None, max_val=None, backend=None):
    """Quantize x to integers: returns (q, scale, zero_point).

    q has x's shape (int8 up to 8 bits, int32 above); scale is float32, shaped to broadcast
    against x for tensor/channel/token granularity, [rows, n_groups] for `group` and
    [num_groups, 1] for `num_groups`; zero_point is int32 like scale, or None when symmetric.
    """
    spec = make_spec(bits, symmetric=symmetric, granularity=granularity, group_size=group_size,
                     num_groups=num_groups, rounding=rounding, seed=seed, numerics=numerics,
                     ternary=ternary)
    return quantize_spec(x, spec, min_val=min_val, max_val=max_val, backend=backend)


def quantize_spec(x, spec: Spec, *, min_val=None, max_val=None, backend=None):
    _check_range_args(spec, min_val, max_val)
    return _backend(backend).quantize(x, spec, min_val, max_val)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point=None, *, group_size=None,
               num_groups=None, dtype=torch.float32, backend=None) -> torch.Tensor:
    """x^ = (q - zero_point) * scale (see :func:`quantize` for the scale shapes)."""
    return _backend(backend).dequantize(q, scale, zero_point, group_size=group_size,
                                        num_groups=num_groups, dtype=dtype)


def _check_range_args(spec, min_val, max_val):
    if (min_val is None) != (max_val is None):
        raise ValueError("give both min_val and max_val for a static range, or neither")
    if min_val is not None and spec.granularity != "tensor":
        raise ValueError(f"a static range (min_val/max_val) needs granularity 'tensor', "
                         f"not {spec.granularity!r}")
