"""load_quantized(mode="fast") on a CUDA device: W4 / W8 weights stay packed on the GPU.

A Linear whose exported tensors sit on a CUDA device at load time (the model was moved to the GPU
before load_quantized) keeps its integer codes there and multiplies with torch's weight-only
kernels, so GPU memory holds about the export's bytes instead of the dense weights:

  int4pack_cuda  4-bit int weights, groups of 32/64/128/256 (or per channel with K one of those),
                 symmetric or not, bfloat16 model, N % 8 == 0, K % 32 == 0, sm_80+:
                 aten._weight_int4pack_mm on aten._convert_weight_to_int4pack's tile layout.
  int8pack_cuda  8-bit symmetric channel/tensor int weights, bfloat16 model:
                 aten._weight_int8pack_mm (int8 codes [N, K], one scale per row).

The kernels' math (ATen/native/cuda/int4mm.cu, torch 2.13):
  * _convert_weight_to_int4pack takes uint8 [N, K/2]; byte j of a row holds column 2j in its high
    nibble and column 2j+1 in its low nibble (the "v[0]H" = first value convention).
  * each nibble u in [0, 15] is dequantized as bf16(u - 8) * scale + zero (one bf16 fma), with
    (scale, zero) read from scales_and_zeros[k // group, n] ([K/group, N, 2], bfloat16).
  qcompress's codes are signed q in [-8, 7] with w = (q - zp) * s, so u = q + 8, scale = s and
  zero = -zp * s (0 when symmetric).

Anything else (2/3-bit, 8-bit groups or asymmetric 8-bit, float32/float16 models, other group
sizes, odd shapes, pre-Ampere GPUs) keeps the fast package's plan, which on a GPU decodes a dense weight
once; load_quantized warns once per load naming those layers and why. mode="dense" asks for that
dense decode for every layer. The layout functions below are pure tensor code so that the CPU tests
can check them against the exact reload.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from .errors import CheckpointError

PLANS = ("int4pack_cuda", "int8pack_cuda")
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes int4mm.cu instantiates
_BUFFERS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "qweight")


def choose(rec: dict, is_linear: bool, capability: Tuple[int, int]) -> Tuple[str, str]:
    """(plan, "") for a layer the CUDA kernels take, else ("", why not); capability: the GPU's
    (major, minor) compute capability."""
    w = rec["weights"]
    bits, strat, dtype = w["num_bits"], w["strategy"], rec["dtype"]
    if not is_linear or rec["kind"] != "linear" or rec.get("transposed"):
        return "", f"{rec['kind']} layer (the CUDA weight-only kernels cover nn.Linear)"
    if rec.get("qtype", "int") != "int":
        return "", f"{rec.get('qtype')} weights (no CUDA weight-only kernel)"
    if dtype != "bfloat16":
        return "", f"{dtype} layer (torch's CUDA weight-only kernels take bfloat16 activations)"
    n, k = rec["weight_shape"]
    if bits == 4 and strat in ("group", "channel"):
        gs = w["group_size"] if strat == "group" else k
        if gs not in INT4_GROUPS or k % gs or k % 32 or n % 8:
            return "", f"4-bit {n}x{k} / group {gs} outside _weight_int4pack_mm's limits"
        if tuple(capability) < (8, 0):
            return "", "_weight_int4pack_mm needs compute capability 8.0 or newer"
        return "int4pack_cuda", ""
    if bits == 8 and strat in ("channel", "tensor"):
        if not w["symmetric"]:
            return "", "asymmetric 8-bit weights (_weight_int8pack_mm has no zero point)"
        return "int8pack_cuda", ""
    return "", f"{bits}-bit {strat} weights (no CUDA weight-only kernel)"


# --- layouts (pure tensor code, testable on the CPU) -----------------------------------------


def inner_k_tiles(k: int) -> int:
    """The widest inner k-tiling K allows (8 k-tiles of 16 = 16-byte loads)."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def int4_layout(
    q: torch.Tensor, scale: torch.Tensor, zp: Optional[torch.Tensor], dtype=torch.bfloat16
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(nibbles uint8 [N, K/2], scales_and_zeros [K/group, N, 2]) from signed codes q [N, K] in
    [-8, 7], scales [N, groups] and zero points [N, groups] (or None): the inputs of
    _convert_weight_to_int4pack and _weight_int4pack_mm."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    nibbles = ((u[:, 0::2] << 4) | u[:, 1::2]).contiguous()
    s = scale.to(torch.float32)
    zero = torch.zeros_like(s) if zp is None else -(zp.to(torch.float32) * s)
    return nibbles, torch.stack([s.t(), zero.t()], dim=-1).to(dtype).contiguous()


def int4_dequantize(nibbles: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] the int4 kernel multiplies by, written from its math: bf16(u - 8) * scale
    + zero, per group of K / sz.shape[0] columns (fp32 product and sum, one rounding to sz's
    dtype, as the bf16 fma)."""
    n, half = nibbles.shape
    u = torch.stack([nibbles >> 4, nibbles & 15], dim=-1).reshape(n, 2 * half).to(torch.float32)
    gs = 2 * half // sz.shape[0]
    s = sz[..., 0].t().to(torch.float32).repeat_interleave(gs, dim=1)
    z = sz[..., 1].t().to(torch.float32).repeat_interleave(gs, dim=1)
    return ((u - 8) * s + z).to(sz.dtype)


def int8_layout(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scales [N] in the activation dtype) for _weight_int8pack_mm."""
    n = q.shape[0]
    return q.to(torch.int8).contiguous(), scale.to(torch.float32).reshape(-1).expand(n).to(dtype).contiguous()


# --- the module ------------------------------------------------------------------------------


def to_packed(mod: nn.Module, rec: dict, plan: str, q: torch.Tensor, s: torch.Tensor, z):
    """Replace the exported buffers by the kernel's tensors on the module's device (once, at load)."""
    device = mod._buffers["weight_scale"].device
    n, k = rec["weight_shape"]
    if plan == "int4pack_cuda":
        nibbles, sz = int4_layout(q, s, z)
        tiles = inner_k_tiles(k)
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), tiles)
        new = {"cuda_int4": packed, "cuda_scales_zeros": sz.to(device)}
        mod.qx_cuda = (n, k, k // s.shape[1])
    else:
        codes, scales = int8_layout(q, s)
        new = {"cuda_int8": codes.to(device), "cuda_scales": scales.to(device)}
        mod.qx_cuda = (n, k, k)
    for name in _BUFFERS:
        mod._buffers.pop(name, None)
    for name, t in new.items():
        mod.register_buffer(name, t)


def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n, k, gs = mod.qx_cuda
    b = mod._buffers
    w = b.get("cuda_int4", b.get("cuda_int8"))
    if x.device != w.device:
        raise RuntimeError(
            f"module {mod.qx_name!r} holds torch's CUDA {mod.qx_plan} layout on {w.device}, "
            f"the input is on {x.device}; load the checkpoint again for that device"
        )
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    if mod.qx_plan == "int4pack_cuda":
        y = torch.ops.aten._weight_int4pack_mm(x2, w, gs, b["cuda_scales_zeros"])
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, w, b["cuda_scales"])
    if mod.bias is not None:
        y = y + mod.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def weight(mod: nn.Module) -> torch.Tensor:
    """The float weight the kernel multiplies by (int4: the kernel applied to the identity)."""
    n, k, gs = mod.qx_cuda
    b = mod._buffers
    if mod.qx_plan == "int4pack_cuda":
        eye = torch.eye(k, dtype=torch.bfloat16, device=b["cuda_int4"].device)
        return torch.ops.aten._weight_int4pack_mm(eye, b["cuda_int4"], gs, b["cuda_scales_zeros"]).t().contiguous()
    return (b["cuda_int8"].to(torch.float32) * b["cuda_scales"].to(torch.float32).reshape(-1, 1)).to(torch.bfloat16)


def refuse_state_dict(mod: nn.Module):
    raise CheckpointError(
        f"module {mod.qx_name!r} was loaded with mode='fast' into torch's CUDA "
        f"{mod.qx_plan} layout, which cannot be saved back; load the checkpoint with "
        "mode='exact' to get its state_dict"
    )
