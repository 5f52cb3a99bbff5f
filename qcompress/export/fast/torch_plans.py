"""Plans on torch's own integer kernels, for installs without qcompress's extension (pure torch):
int_mm, int_mm24, int8pack, int4pack.

Why float32 layers do not use int8pack/int4pack: in torch 2.13 on x86 those kernels are
vectorized only for bfloat16 (float32 runs a scalar loop, far slower than the fp32 GEMM), and
int4pack wants a (scale, zero) pair per group in the input dtype, which for float32 is twice the
bytes of the exported scales. 4-bit float32 layers therefore stay on the dequant plan.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...quant import lowbit
from ..errors import CheckpointError
from ..quantized import _unpack_rows
from .core import (
    _EXACT_BUFFERS,
    DEQUANT,
    Choice,
    Plan,
    _act_codes,
    _flat,
    _has_op,
    _input_codes,
    _kernel_refusal,
    _unpack_rows_dim0,
)

INT4_GROUPS = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
_HALF = ("bfloat16", "float16")


def _torch_refusal(mod: nn.Module, rec: dict) -> Optional[str]:
    """Why torch's integer kernels cannot run this layer (None: a row below may take it)."""
    why = _kernel_refusal(mod, rec)
    if why is not None:
        return why
    if rec["kind"] != "linear":
        return f"{rec['kind']} layer (integer kernels cover nn.Linear only)"
    if rec.get("qtype", "int") != "int":
        return f"{rec['qtype']} weights (no integer kernel)"
    return None


def _eight_bit(rec: dict) -> bool:
    w = rec["weights"]
    return w["num_bits"] == 8 and w["strategy"] in ("channel", "tensor")


def _float_input_refusal(rec: dict) -> Optional[str]:
    """int8pack and int_mm24 multiply the (fake-quantized) float input: one quantized to codes
    int_mm could take but not to codes we reproduce stays on the exact path."""
    if rec.get("input_activations") is not None and not _act_codes(rec):
        return "input quantized to more than 8 bits or per-sample"
    return None


class TorchPlan(Plan):
    """A row that looks only where qcompress's kernels are not built (they take every layer these do)."""

    def choose(self, mod, rec):
        if lowbit.available():
            return None
        why = _torch_refusal(mod, rec)
        return (DEQUANT, why) if why is not None else self.decide(rec)

    def decide(self, rec: dict) -> Optional[Choice]:
        return None


class IntMM(TorchPlan):
    """8-bit channel/tensor weights whose input is int8-quantized (dynamic per-token or static
    per-tensor): the input is quantized to the codes training used and torch._int_mm sums codes x
    codes exactly in int32; the scales (and zero-point corrections) are applied once per output.
    W8A8."""

    name = "int_mm"

    def decide(self, rec):
        return (self, "") if _eight_bit(rec) and _act_codes(rec) and _has_op("_int_mm") else None

    def forward(self, mod, x):
        if x.is_floating_point() and _int_mm_ok(x, mod.qweight):
            return _forward_int_mm(mod, x)
        return None


class Int8Pack(TorchPlan):
    """8-bit symmetric channel/tensor weights, bf16/fp16 inputs, no activation codes:
    torch._weight_int8pack_mm on the stored int8 codes."""

    name = "int8pack"

    def decide(self, rec):
        if not _eight_bit(rec):
            return None
        why = _float_input_refusal(rec)
        if why is not None:
            return DEQUANT, why
        if rec["dtype"] not in _HALF:
            return None
        if rec["weights"]["symmetric"] and _has_op("_weight_int8pack_mm"):
            return self, ""
        return DEQUANT, f"asymmetric 8-bit weights in a {rec['dtype']} layer"

    def forward(self, mod, x):
        x = mod._qx_input(x)
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            return _forward_int8pack(mod, x)
        return F.linear(x, mod.weight, mod.bias)  # the exact forward, on the input quantized once


class IntMM24(TorchPlan):
    """8-bit channel/tensor weights of a float32 model without activation codes: each token is
    rounded to a 24-bit integer grid (2^-24 of its largest entry, below fp32 rounding of the sums)
    and split into three signed 8-bit digits; three torch._int_mm calls give exact integer products,
    combined in float64. No float weight is formed."""

    name = "int_mm24"

    def decide(self, rec):
        if not _eight_bit(rec) or rec["dtype"] in _HALF:
            return None
        why = _float_input_refusal(rec)
        if why is not None:
            return DEQUANT, why
        return (self, "") if _has_op("_int_mm") else (DEQUANT, "this torch has no _int_mm")

    def forward(self, mod, x):
        x = mod._qx_input(x)
        if x.is_floating_point() and _int_mm_ok(x, mod.qweight):
            return _forward_int_mm24(mod, x)
        return F.linear(x, mod.weight, mod.bias)  # the exact forward, on the input quantized once


class Int4Pack(TorchPlan):
    """4-bit int group (32/64/128/256) weights of a bf16/fp16 model on CPU:
    torch._weight_int4pack_mm_for_cpu on a layout converted once at load."""

    name = "int4pack"

    def decide(self, rec):
        w = rec["weights"]
        if w["num_bits"] != 4 or w["strategy"] not in ("group", "channel"):
            return None
        n, k = rec["weight_shape"]
        gs = w["group_size"] if w["strategy"] == "group" else k
        if rec["dtype"] not in _HALF:
            return DEQUANT, (
                "4-bit float32 layer (torch's int4pack kernel is scalar for float32 "
                "and its fp32 scale/zero pairs outweigh the exported scales)"
            )
        if gs not in INT4_GROUPS or k % gs or n % 16 or k % 2:
            return DEQUANT, f"4-bit shape {n}x{k} / group {gs} outside int4pack's limits"
        if not _has_op("_weight_int4pack_mm_for_cpu"):
            return DEQUANT, "this torch has no _weight_int4pack_mm_for_cpu"
        return self, ""

    def convert(self, mod, rec):
        _to_int4pack(mod, rec)

    def forward(self, mod, x):
        return _forward_int4pack(mod, mod._qx_input(x))

    def weight(self, mod):
        return _int4pack_weight(mod)

    def check_saveable(self, mod):
        raise CheckpointError(
            f"module {mod.qx_name!r} was loaded with mode='fast' into torch's "
            "int4pack kernel layout, which cannot be saved back; load the "
            "checkpoint with mode='exact' to get its state_dict"
        )


# --- the calls -------------------------------------------------------------------------------------


def _finish(mod: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if mod.bias is not None:
        y = y + mod.bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _int_mm_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    if x.device != q.device:
        return False
    if x.device.type == "cuda":  # cuBLASLt int8 GEMM shape rules
        m = x.numel() // x.shape[-1]
        return m > 16 and q.shape[0] % 8 == 0 and q.shape[1] % 8 == 0
    return x.device.type == "cpu"


def _forward_int_mm(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q = mod.qweight  # int8 [N, K]
    x2 = _flat(x, q.shape[1])
    qx, sx, zx = _input_codes(mod, x2)
    acc = torch._int_mm(qx, q.t())  # exact int32 sums of code products
    zw = getattr(mod, "weight_zero_point", None)
    if zx is not None or zw is not None:
        # sum (qx - zx)(qw - zw) = acc - zw*sum(qx) - zx*sum(qw) + K*zx*zw, in int64
        acc = acc.to(torch.int64)
        if zw is not None:
            zw = zw.to(torch.int64).reshape(1, -1)
            acc = acc - zw * qx.sum(dim=1, dtype=torch.int64).reshape(-1, 1)
        if zx is not None:
            acc = acc - zx * q.sum(dim=1, dtype=torch.int64).reshape(1, -1)
            if zw is not None:
                acc = acc + q.shape[1] * zx * zw
    sw = mod.weight_scale.to(torch.float32).reshape(1, -1)
    y = acc.to(torch.float32) * sx * sw
    return _finish(mod, y.to(x.dtype), x)


_D1 = 127 * 65536 + 127 * 256 + 127  # largest integer three balanced int8 digits can hold


def _digits(x2: torch.Tensor):
    """x2 [M,K] ~ sx * (65536 a1 + 256 a2 + a3), digits int8, per-row scale sx [M,1] fp32.

    The only rounding is x / sx (in float64) to the integer grid: half a step, 2^-24 of the
    row's largest |x|; the digit split is exact float32 integer arithmetic (values < 2^24)."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / _D1, torch.ones_like(amax))
    big = torch.round(xf.double() / sx.double()).clamp_(-_D1, _D1).float()  # exact in fp32
    # 256 a2 + a3 spans [-32896, 32639], so a1 takes what lies outside that window
    a1 = torch.floor((big + 32896.0) / 65536.0)
    r = big - a1 * 65536.0  # [-32896, 32639]
    a2 = torch.floor((r + 128.0) / 256.0)
    a3 = r - a2 * 256.0  # [-128, 127]
    return (a1.to(torch.int8), a2.to(torch.int8), a3.to(torch.int8)), big, sx


def _forward_int_mm24(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q = mod.qweight
    x2 = _flat(x, q.shape[1])
    (a1, a2, a3), big, sx = _digits(x2)
    qt = q.t()
    acc = (
        torch._int_mm(a1, qt).to(torch.float64) * 65536.0
        + torch._int_mm(a2, qt).to(torch.float64) * 256.0
        + torch._int_mm(a3, qt).to(torch.float64)
    )  # exact: |acc| < 2^53
    zw = getattr(mod, "weight_zero_point", None)
    if zw is not None:  # sum_k X_k (q - zw)
        acc = acc - big.to(torch.float64).sum(dim=1, keepdim=True) * zw.to(torch.float64).reshape(1, -1)
    sw = mod.weight_scale.to(torch.float64).reshape(1, -1)
    y = (acc * sx.to(torch.float64) * sw).to(x.dtype)
    return _finish(mod, y, x)


def _forward_int8pack(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q = mod.qweight
    s = mod.weight_scale.to(x.dtype).reshape(-1).expand(q.shape[0]).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(_flat(x, q.shape[1]), q, s)
    return _finish(mod, y, x)


# --- torch's CPU int4pack layout -------------------------------------------------------------------


def _forward_int4pack(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise RuntimeError(
            f"module {mod.qx_name!r} holds torch's CPU int4pack layout; load the "
            "checkpoint with mode='exact' (or mode='fast' on CPU) for this device"
        )
    k = mod.in_features
    sz = mod.fast_scales_zeros
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        _flat(x.to(sz.dtype), k), mod.fast_weight_int4, mod.fast_group_size, sz
    )
    return _finish(mod, y.to(x.dtype), x)


def _int4pack_weight(mod: nn.Module) -> torch.Tensor:
    """The float weight the int4pack kernel uses: the kernel applied to the identity."""
    k = mod.in_features
    sz = mod.fast_scales_zeros
    eye = torch.eye(k, dtype=sz.dtype, device=sz.device)
    return (
        torch.ops.aten._weight_int4pack_mm_for_cpu(eye, mod.fast_weight_int4, mod.fast_group_size, sz).t().contiguous()
    )


def _to_int4pack(mod: nn.Module, rec: dict):
    """Replace the exported 4-bit buffers by torch's CPU int4pack layout (once, at load)."""
    w = rec["weights"]
    n, k = rec["weight_shape"]
    gs = w["group_size"] if w["strategy"] == "group" else k
    buf = mod._buffers
    q = _unpack_rows(buf["weight_packed"], 4, k)  # signed codes [-8, 7]
    scale = buf["weight_scale"].to(torch.float32).reshape(n, -1)
    zp = buf.get("weight_zero_point")
    # kernel: w = (u - 8) * s + z with u = q + 8, so z = -zp * s (0 when symmetric)
    zero = torch.zeros_like(scale) if zp is None else -(_unpack_rows_dim0(zp, 4, n).to(torch.float32) * scale)
    dt = getattr(torch, rec["dtype"])
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dt).contiguous()  # [ng, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32).contiguous(), 1)
    for name in _EXACT_BUFFERS:
        buf.pop(name, None)
    mod.register_buffer("fast_weight_int4", packed)
    mod.register_buffer("fast_scales_zeros", sz)
    mod.fast_group_size = gs
