"""Quantizer math: reference (pure torch) and dispatch to the fused kernels."""

from .api import (
    dequantize,
    fake_quantize,
    fake_quantize_learned,
    fake_quantize_spec,
    kernels_available,
    learned_params,
    lsq_grad_scale,
    quantize,
    quantize_spec,
)
from .observers import mse_shrink, weight_params as observer_params
from .packing import pack_int32, unpack_int32
from .reference import EPS, Spec, make_spec

__all__ = [
    "quantize",
    "dequantize",
    "fake_quantize",
    "fake_quantize_spec",
    "quantize_spec",
    "fake_quantize_learned",
    "learned_params",
    "lsq_grad_scale",
    "mse_shrink",
    "observer_params",
    "kernels_available",
    "make_spec",
    "Spec",
    "EPS",
    "pack_int32",
    "unpack_int32",
]
