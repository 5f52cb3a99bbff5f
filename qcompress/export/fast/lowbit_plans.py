"""qcompress's own fused low-bit kernels (plans lowbit, lowbit_a8): with the compiled extension,
every int/binary/ternary nn.Linear or transformers' Conv1D of up to 8 bits, whatever its dtype,
strategy, symmetry or shape (qcompress/quant/lowbit.py; csrc/cpu/lowbit_gemm.cpp,
csrc/cuda/lowbit_gemm.cu).

On a GPU the lowbit layers decode each weight once to the exact path's float values and multiply
with cuBLAS (CUDA_LOWBIT_KERNELS says why): the outputs are the exact reload's bit for bit, at the
dense model's speed and GPU memory.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from ...quant import kernels as _kernels
from ...quant import lowbit
from ...quant.packing import pack_int32
from ..codes import dequantize_2d
from .core import (
    _EXACT_BUFFERS,
    DEQUANT,
    Plan,
    _act_codes,
    _exported_codes,
    _flat,
    _input_codes,
    _kernel_refusal,
    _needs_grad,
    _token_spec,
)

_LOWBIT_BUFFERS = ("lowbit_packed", "lowbit_scales", "lowbit_offsets")

# On a GPU the lowbit plans multiply by a float weight decoded once (_dense_on_gpu) with cuBLAS:
# the CUDA low-bit kernels (csrc/cuda/lowbit_gemm.cu) are correctness kernels, slower than cuBLAS
# at every token count measured (benchmarks/results/gpu.md). True runs them.
CUDA_LOWBIT_KERNELS = False


def _lowbit_refusal(mod: nn.Module, rec: dict) -> Optional[str]:
    """Why the lowbit kernels cannot run this layer (None: they can)."""
    why = _kernel_refusal(mod, rec)
    if why is not None:
        return why
    if rec["kind"] not in ("linear", "hf_conv1d"):  # Conv1D is x @ W^T too, W exported [out, in]
        return f"{rec['kind']} layer (integer kernels cover nn.Linear and transformers' Conv1D)"
    w = rec["weights"]
    if lowbit.kernel_group(w["strategy"], w["group_size"], rec["weight_shape"][1]) is None:
        return f"group size {w['group_size']} above the kernels' {lowbit.MAX_GROUP}"
    return None


class LowbitPlan(Plan):
    """What both lowbit plans share: the kernels' blocked layout, the float weight and the exported
    tensors rebuilt from it, and the one-op direct call (_direct)."""

    def choose(self, mod, rec):
        if not lowbit.available():
            return None
        why = _lowbit_refusal(mod, rec)
        if why is not None:
            return DEQUANT, why
        return (self, "") if self.takes(rec) else None

    def takes(self, rec: dict) -> bool:
        return True

    def convert(self, mod, rec):
        _to_lowbit(mod, rec)

    def ready(self, mod):
        mod.qx_direct = None
        if _kernels.available() and "bias" in mod._parameters:  # a bias kept as a buffer: general path
            mod.qx_direct = self.direct_call(mod)

    def direct_call(self, mod: nn.Module):
        """(op, its arguments after the bias, whether it quantizes the input) for _direct, or None."""
        return None

    def weight(self, mod):
        return _lowbit_weight(mod) if mod._buffers["lowbit_packed"].is_cpu else _dense_on_gpu(mod)

    def saved(self, mod, destination, prefix):
        for name in _LOWBIT_BUFFERS:  # back to the exported tensors
            destination.pop(prefix + name, None)
        for suffix, t in _lowbit_exported(mod).items():
            destination[prefix + suffix] = t


class Lowbit(LowbitPlan):
    """Float activations (no input quantization, or one without integer codes: the input is
    fake-quantized first, as on the exact path): the codes are decoded in registers to the exact
    path's float weight and multiplied in; no float weight is formed. Also at many tokens: decoding
    the weight per call and running torch's dense F.linear was measured slower on every MiniLM
    shape at 256-2048 tokens: the decode alone costs more than the fused call
    (benchmarks/experiments/README.md, `lowbit_fp32.py`)."""

    name = "lowbit"

    def direct_call(self, mod):
        if mod.qx_rec.get("input_activations") is not None:
            return None
        n, _, group, cbits = mod.qx_lowbit
        return torch.ops.qcompress.lowbit_linear.default, (n, group, cbits), False

    def forward(self, mod, x):
        if x.is_floating_point() and _lowbit_here(mod, x):
            return _forward_lowbit(mod, mod._qx_input(x))
        return None


class LowbitA8(LowbitPlan):
    """Input quantized to <= 8-bit codes (dynamic per token or static per tensor): integer dot
    products of activation and weight codes, exact int32 sums per group, scales applied once per
    group and token. W8A8, W4A8."""

    name = "lowbit_a8"

    def takes(self, rec):
        return _act_codes(rec)

    def direct_call(self, mod):
        spec = _token_spec(mod)
        if spec is None:
            return None
        n, _, group, cbits = mod.qx_lowbit
        return (
            torch.ops.qcompress.lowbit_linear_dyn_a8.default,
            (n, group, cbits, spec.bits, spec.symmetric, spec.seed),
            True,
        )

    def forward(self, mod, x):
        if x.is_floating_point() and _lowbit_here(mod, x):
            return _forward_lowbit_a8(mod, x)
        return None


# --- the kernels' layout ---------------------------------------------------------------------------


def _to_lowbit(mod: nn.Module, rec: dict):
    """Replace the exported weight tensors by the kernels' blocked layout (once, at load)."""
    w = rec["weights"]
    n, k = rec["weight_shape"]
    group = lowbit.kernel_group(w["strategy"], w["group_size"], k)
    q, s, z = _exported_codes(mod, rec)
    cbits = lowbit.container_bits(w["num_bits"])
    device = mod._buffers["weight_scale"].device
    packed = lowbit.prepack_rows(q.cpu(), s.cpu(), None if z is None else z.cpu(), group, cbits)
    for name in _EXACT_BUFFERS + ("qweight",):
        mod._buffers.pop(name, None)
    for name, t in zip(_LOWBIT_BUFFERS, packed):
        mod.register_buffer(name, t.to(device))
    mod.qx_lowbit = (n, k, group, cbits)


def _lowbit_packed(mod: nn.Module, device=None) -> "lowbit.Packed":
    b = mod._buffers  # read per call (plain lookups: at one token this is per-call overhead)
    p = lowbit.Packed(b["lowbit_packed"], b["lowbit_scales"], b["lowbit_offsets"])
    return p if device is None else lowbit.Packed(*(t.to(device) for t in p))


def _lowbit_codes(mod: nn.Module):
    n, k, group, cbits = mod.qx_lowbit
    return lowbit.unpack(_lowbit_packed(mod, "cpu"), n, k, group, cbits)


def _lowbit_weight(mod: nn.Module) -> torch.Tensor:
    """The exact path's float weight, from the kernel layout (same values bit for bit)."""
    rec = mod.qx_rec
    q, s, z = _lowbit_codes(mod)
    w = dequantize_2d(q, s, z, mod.qx_lowbit[2], getattr(torch, rec["dtype"])).reshape(rec["weight_shape"])
    w = w.t().contiguous() if rec.get("transposed") else w  # as dequantize_record
    return w.to(mod._buffers["lowbit_scales"].device)


def _lowbit_exported(mod: nn.Module) -> Dict[str, torch.Tensor]:
    """The exported tensors (names, dtypes, shapes, values) rebuilt from the kernel layout."""
    rec = mod.qx_rec
    w = rec["weights"]
    bits, strat = w["num_bits"], w["strategy"]
    q, s, z = _lowbit_codes(mod)
    if strat != "group":  # scales were repeated per chunk: one per row
        s, z = s[:, :1], None if z is None else z[:, :1]
        if strat == "tensor":
            s, z = s[:1].reshape(1), None if z is None else z[:1].reshape(1)
    out = {"weight_scale": s.contiguous()}
    packed = rec["format"] == "pack-quantized"
    if packed:
        out["weight_packed"] = pack_int32(q, bits, dim=1)
        out["weight_shape"] = torch.tensor(rec["weight_shape"], dtype=torch.int64)
    else:
        out["weight"] = q.reshape(rec["weight_shape"]).contiguous()
    if z is not None:
        zi = z.to(torch.int8)
        out["weight_zero_point"] = pack_int32(zi, bits, dim=0) if packed and strat != "tensor" else zi.contiguous()
    device = mod._buffers["lowbit_scales"].device
    return {k: v.to(device) for k, v in out.items()}


def _lowbit_here(mod: nn.Module, x: torch.Tensor) -> bool:
    if x.device.type == "cuda" and not CUDA_LOWBIT_KERNELS:
        return False
    return x.device == mod._buffers["lowbit_packed"].device and lowbit.runs_on(x.device)


def _dense_on_gpu(mod: nn.Module) -> torch.Tensor:
    """The exact path's float weight of a module whose codes are on a GPU, decoded at the first call
    and kept until the module moves (the export stays small on disk; GPU memory holds the float
    weight, as after mode="exact")."""
    b = mod._buffers
    key = (b["lowbit_packed"], b["lowbit_scales"])
    cached = mod.__dict__.get("qx_dense")
    if cached is None or cached[0][0] is not key[0] or cached[0][1] is not key[1]:
        cached = mod.__dict__["qx_dense"] = (key, _lowbit_weight(mod))
    return cached[1]


# --- the calls -------------------------------------------------------------------------------------


def _direct(mod: nn.Module, x: torch.Tensor, act: str = "none", residual=None):
    """The lowbit plans' kernel on a CPU tensor with nothing in between, or None where the call needs
    the general path (autograd, another device, a float64 input, an input fake-quantized first).
    Same op and arguments as _forward_lowbit / _forward_lowbit_a8: at one token the Python around
    the kernel (plan checks, tuple and Packed building, wrappers) cost as much as the kernel.
    act, residual: an activation the kernel applies and a tensor it adds before its store (fuse.py)."""
    d = mod.__dict__.get("qx_direct")
    if d is None or not x.is_cpu or not x.is_floating_point() or _needs_grad(mod, x, residual):
        return None
    b = mod._buffers
    packed = b["lowbit_packed"]
    if not packed.is_cpu:
        return None
    op, args, a8 = d
    if not a8:
        return op(x, packed, b["lowbit_scales"], b["lowbit_offsets"], mod._parameters["bias"], *args, act, residual)
    if x.dtype == torch.float64:
        return None
    return _kernels._call(
        op, x, packed, b["lowbit_scales"], b["lowbit_offsets"], mod._parameters["bias"], *args, act, residual
    )


def _forward_lowbit(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n, _, group, cbits = mod.qx_lowbit
    return lowbit.linear(x, _lowbit_packed(mod), mod.bias, n, group, cbits)


def _forward_lowbit_a8(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    n, k, group, cbits = mod.qx_lowbit
    spec = _token_spec(mod)
    if spec is not None and x.device.type == "cpu" and x.dtype != torch.float64 and _kernels.available():
        # the same codes as _input_codes, quantized and multiplied in one C++ call: at one token the
        # Python between two ops costs more than the matmul
        return _kernels._call(
            lowbit.linear_dyn_a8,
            x,
            _lowbit_packed(mod),
            mod.bias,
            n,
            group,
            cbits,
            spec.bits,
            spec.symmetric,
            spec.seed,
        )
    qx, sx, zx = _input_codes(mod, _flat(x, k))
    y = lowbit.linear_a8(
        qx, sx, None if zx is None else zx.to(torch.int32), _lowbit_packed(mod), mod.bias, n, group, cbits, x.dtype
    )
    return y.reshape(*x.shape[:-1], n)
