"""Packed 2/4-bit weights as bit planes: the dequant plan's layout.

The int32 words of `weight_packed` interleave neighbouring columns, so unpacking them costs a
shift per lane over a [rows, words, lanes] tensor. At load we re-store the same bytes as uint8
"planes": bits [j*b, (j+1)*b) of byte c hold column j * K/per + c. A plane then unpacks with one
shift-and-mask straight into a contiguous column block of the float weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ...quant.packing import unpack_int32
from ..quantized import _unpack_rows


def _unpack_rows_dim0(zp: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Zero points packed along dim 0 (the export's layout for them), one per row and group."""
    return unpack_int32(zp, bits, rows, dim=0)


def planes_ok(rec: dict) -> bool:
    w = rec["weights"]
    if rec["format"] != "pack-quantized" or w["num_bits"] not in (2, 4):
        return False
    shape = rec["weight_shape"]
    k = math.prod(shape[1:]) if len(shape) > 1 else 1
    per = 8 // w["num_bits"]
    return k % per == 0 and (w["strategy"] != "group" or k % w["group_size"] == 0)


def _to_planes(mod: nn.Module, rec: dict):
    bits = rec["weights"]["num_bits"]
    shape = rec["weight_shape"]
    rows, k = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    per = 8 // bits
    u = (_unpack_rows(mod._buffers["weight_packed"], bits, k) + (1 << (bits - 1))).to(torch.uint8)
    u = u.reshape(rows, per, k // per)
    planes = u[:, 0].clone()
    for j in range(1, per):
        planes |= u[:, j] << (j * bits)
    del mod._buffers["weight_packed"], mod._buffers["weight_shape"]
    mod.register_buffer("fast_planes", planes)


def planes_codes(rec: dict, planes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes [rows, K] (uint8, offset by 2^(b-1)) from the planes."""
    bits = rec["weights"]["num_bits"]
    per = 8 // bits
    return torch.cat([(planes >> (j * bits)) & ((1 << bits) - 1) for j in range(per)], dim=1)


def planes_dequantize(rec: dict, buf) -> torch.Tensor:
    """Same values as quantized.dequantize_record, bit for bit: (u - 2^(b-1) - zp) * s in fp32."""
    w = rec["weights"]
    bits, strat = w["num_bits"], w["strategy"]
    shape = rec["weight_shape"]
    rows, k = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    per, mask = 8 // bits, (1 << bits) - 1
    planes = buf["fast_planes"]
    out = torch.empty(rows, k, dtype=torch.float32, device=planes.device)
    blocks = out.view(rows, per, k // per)
    for j in range(per):
        p = planes if j == 0 else planes >> (j * bits)
        blocks[:, j].copy_(p & mask if j < per - 1 else p)
    off = float(1 << (bits - 1))
    zp = buf.get("weight_zero_point")
    if strat == "group":
        view, ng = out.view(rows, -1, w["group_size"]), k // w["group_size"]
        s = buf["weight_scale"].to(torch.float32).reshape(rows, ng, 1)
        z = None if zp is None else _unpack_rows_dim0(zp, bits, rows).to(torch.float32).reshape(rows, ng, 1)
    else:
        view = out
        s = buf["weight_scale"].to(torch.float32).reshape(-1, 1)
        if zp is None:
            z = None
        elif strat == "tensor":
            z = zp.to(torch.float32).reshape(1, 1)
        else:
            z = _unpack_rows_dim0(zp, bits, rows).to(torch.float32).reshape(rows, 1)
    # integers are exact in fp32, so u - (off + z) equals the exact path's q - z; then one rounding
    view.sub_(off if z is None else z + off).mul_(s)
    out = out.to(getattr(torch, rec["dtype"])).reshape(shape)
    return out.t().contiguous() if rec.get("transposed") else out  # as dequantize_record
