"""Quantizer math: reference (pure torch) and dispatch to the fused kernels."""
from .api import dequantize, fake_quantize, fake_quantize_spec, kernels_available, quantize, quantize_spec
from .packing import pack_int32, unpack_int32
from .reference import EPS, Spec, make_spec

__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_spec", "quantize_spec",
           "kernels_available", "make_spec", "Spec", "EPS", "pack_int32", "unpack_int32"]
