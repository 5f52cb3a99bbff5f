"""load_quantized(..., mode="fast"): integer-weight matmuls instead of a float weight per call.

Each loaded quantized module gets a plan, chosen once at load time and logged. With the compiled
extension, every int/binary/ternary nn.Linear of up to 8 bits runs qcompress's own fused kernels
(qcompress/quant/lowbit.py; csrc/cpu/lowbit_gemm.cpp, csrc/cuda/lowbit_gemm.cu), whatever its
dtype, strategy, symmetry or shape:

  lowbit     float activations (no input quantization, or one without integer codes: the input
             is fake-quantized first, as on the exact path): the codes are decoded in registers
             to the exact path's float weight and multiplied in; no float weight is formed.
             Also at many tokens: decoding the weight per call and running torch's dense
             F.linear was measured slower on every MiniLM shape at 256-2048 tokens: the decode
             alone costs more than the fused call (benchmarks/experiments/README.md,
             `lowbit_fp32.py`).
  lowbit_a8  input quantized to <= 8-bit codes (dynamic per token or static per tensor): integer
             dot products of activation and weight codes, exact int32 sums per group, scales
             applied once per group and token. W8A8, W4A8.

On a GPU, bfloat16 W4 / W8 Linear layers loaded into a model already there stay packed and run
torch's weight-only kernels (plans int4pack_cuda / int8pack_cuda, fast_cuda.py). The other lowbit
layers there, and all of them with mode="dense", decode each weight once to the exact path's float
values and multiply with cuBLAS (CUDA_LOWBIT_KERNELS below says why): the outputs are the exact
reload's bit for bit, at the dense model's speed and GPU memory.

Without the extension (pure-torch install), torch's own kernels are used where they fit:

  int_mm    8-bit channel/tensor weights whose input is int8-quantized (dynamic per-token or
            static per-tensor): the input is quantized to the codes training used and
            torch._int_mm sums codes x codes exactly in int32; the scales (and zero-point
            corrections) are applied once per output. W8A8.
  int_mm24  8-bit channel/tensor weights of a float32 model without activation codes: each
            token is rounded to a 24-bit integer grid (2^-24 of its largest entry, below fp32
            rounding of the sums) and split into three signed 8-bit digits; three torch._int_mm
            calls give exact integer products, combined in float64. No float weight is formed.
  int8pack  8-bit symmetric channel/tensor weights, bf16/fp16 inputs, no activation codes:
            torch._weight_int8pack_mm on the stored int8 codes.
  int4pack  4-bit int group (32/64/128/256) weights of a bf16/fp16 model on CPU:
            torch._weight_int4pack_mm_for_cpu on a layout converted once at load.
  dequant   everything else (4-bit float32 layers, 8-bit groups, 2-bit, binary/ternary, conv,
            embedding, HF Conv1D, odd shapes): the exact path, a float weight per call, with
            the same values bit for bit. Packed 2/4-bit codes are re-laid out once as bit
            planes that unpack ~4x faster than the exported int32 words. Logged as a fallback,
            with the reason.

Why float32 layers do not use int8pack/int4pack: in torch 2.13 on x86 those kernels are
vectorized only for bfloat16 (float32 runs a scalar loop, far slower than the fp32 GEMM), and
int4pack wants a (scale, zero) pair per group in the input dtype, which for float32 is twice the
bytes of the exported scales. 4-bit float32 layers therefore stay on the dequant plan.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant import kernels as _kernels
from ..quant.api import quantize_spec
from ..quant.reference import make_spec
from ..quant import lowbit
from .codes import dequantize_2d
from .errors import CheckpointError
from . import fast_cuda, quantized
from .quantized import (_QEmbedding, _QHFConv1D, _QLinear, QuantizedMixin, _unpack_rows, dequantize_record,
                        gather_refusal)

log = logging.getLogger("qcompress.export.fast")

INT4_GROUPS = (32, 64, 128, 256)        # what _weight_int4pack_mm_for_cpu accepts
_HALF = ("bfloat16", "float16")
_EXACT_BUFFERS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


# --- packed 2/4-bit weights as bit planes (the dequant plan's layout) --------------------------
# The int32 words of `weight_packed` interleave neighbouring columns, so unpacking them costs a
# shift per lane over a [rows, words, lanes] tensor. At load we re-store the same bytes as uint8
# "planes": bits [j*b, (j+1)*b) of byte c hold column j * K/per + c. A plane then unpacks with one
# shift-and-mask straight into a contiguous column block of the float weight.

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
    return out.t().contiguous() if rec.get("transposed") else out    # as dequantize_record


# --- plan selection ------------------------------------------------------------------------------

def _act_codes(rec: dict) -> bool:
    """Whether the layer's input is quantized to <= 8-bit integer codes we can reproduce."""
    act = rec.get("input_activations")
    if act is None or act["num_bits"] > 8:
        return False
    return (not act["dynamic"]) or act["strategy"] == "token"


def choose_plan(mod: nn.Module, rec: dict) -> Tuple[str, str]:
    """(plan, reason) for one loaded module; reason explains a 'dequant' fallback."""
    w = rec.get("weights")
    if w is None:
        return "dense", "not quantized"
    if rec.get("qtype") == "float":
        return "dequant", f"{rec['format']} (dequantized per call)"
    if rec["kind"] in ("linear", "hf_conv1d") and not isinstance(mod, (_QLinear, _QHFConv1D)):
        return "dequant", f"{type(mod).__name__} has its own forward (run on the dequantized weight)"
    if rec["kind"] == "embedding" and isinstance(mod, _QEmbedding):
        return _embedding_plan(rec)
    bits, strat, dtype = w["num_bits"], w["strategy"], rec["dtype"]
    if rec["kind"] == "hf_conv1d" and lowbit.available():   # x @ W^T too, W stored [in, out]
        rec = dict(rec, kind="linear")
    if rec["kind"] != "linear":
        what = "nn.Linear and transformers' Conv1D" if lowbit.available() else "nn.Linear only"
        return "dequant", f"{rec['kind']} layer (integer kernels cover {what})"
    if lowbit.available():
        k = rec["weight_shape"][1]
        if lowbit.kernel_group(strat, w["group_size"], k) is None:
            return "dequant", f"group size {w['group_size']} above the kernels' {lowbit.MAX_GROUP}"
        return ("lowbit_a8" if _act_codes(rec) else "lowbit"), ""
    if rec.get("qtype", "int") != "int":
        return "dequant", f"{rec['qtype']} weights (no integer kernel)"
    if bits == 8 and strat in ("channel", "tensor"):
        if _act_codes(rec) and _has_op("_int_mm"):
            return "int_mm", ""
        if rec.get("input_activations") is not None and not _act_codes(rec):
            return "dequant", "input quantized to more than 8 bits or per-sample"
        if dtype in _HALF:
            if w["symmetric"] and _has_op("_weight_int8pack_mm"):
                return "int8pack", ""
            return "dequant", f"asymmetric 8-bit weights in a {dtype} layer"
        if _has_op("_int_mm"):
            return "int_mm24", ""
        return "dequant", "this torch has no _int_mm"
    if bits == 4 and strat in ("group", "channel"):
        n, k = rec["weight_shape"]
        gs = w["group_size"] if strat == "group" else k
        if dtype not in _HALF:
            return "dequant", ("4-bit float32 layer (torch's int4pack kernel is scalar for float32 "
                               "and its fp32 scale/zero pairs outweigh the exported scales)")
        if gs not in INT4_GROUPS or k % gs or n % 16 or k % 2:
            return "dequant", f"4-bit shape {n}x{k} / group {gs} outside int4pack's limits"
        if not _has_op("_weight_int4pack_mm_for_cpu"):
            return "dequant", "this torch has no _weight_int4pack_mm_for_cpu"
        return "int4pack", ""
    return "dequant", f"{bits}-bit {strat} weights (no integer kernel)"


def _embedding_plan(rec: dict) -> Tuple[str, str]:
    """gather: the embedding dequantizes only the rows its ids look up (quantized.gather_rows, in
    either mode), else the whole table per call."""
    why = gather_refusal(rec)
    return ("dequant", why) if why else ("gather", "")


# --- the fast module -----------------------------------------------------------------------------

class FastMixin:
    """Loaded quantized module running its plan; `weight` still returns the float weight."""

    def __setstate__(self, state):
        super().__setstate__(state)
        if "lowbit_packed" in self._buffers:      # unpickled: the direct call is not pickled
            _set_direct(self, self.qx_rec)

    @property
    def weight(self):
        rec = self.qx_rec
        if rec.get("weights") is None:
            return self._parameters["weight"]
        if self.qx_plan == "int4pack":
            return _int4pack_weight(self)
        if self.qx_plan in fast_cuda.PLANS:
            return fast_cuda.weight(self)
        if "lowbit_packed" in self._buffers:
            return _lowbit_weight(self) if self._buffers["lowbit_packed"].is_cpu else _dense_on_gpu(self)
        if "fast_planes" in self._buffers:
            return planes_dequantize(rec, self._buffers)
        return dequantize_record(rec, self._buffers)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("qx_dense", None)     # a GPU copy of the weight is not moved: decoded again
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.qx_plan in fast_cuda.PLANS:
            fast_cuda.refuse_state_dict(self)
        if self.qx_plan == "int4pack":
            raise CheckpointError(f"module {self.qx_name!r} was loaded with mode='fast' into torch's "
                                  "int4pack kernel layout, which cannot be saved back; load the "
                                  "checkpoint with mode='exact' to get its state_dict")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "lowbit_packed" in self._buffers:    # back to the exported tensors
            for name in _LOWBIT_BUFFERS:
                destination.pop(prefix + name, None)
            for suffix, t in _lowbit_exported(self).items():
                destination[prefix + suffix] = t
        planes = destination.pop(prefix + "fast_planes", None)
        if planes is not None:                  # back to the exported tensors
            from ..quant.packing import pack_int32
            rec = self.qx_rec
            bits = rec["weights"]["num_bits"]
            q = planes_codes(rec, planes).to(torch.int8) - (1 << (bits - 1))
            destination[prefix + "weight_packed"] = pack_int32(q, bits, dim=1)
            destination[prefix + "weight_shape"] = torch.tensor(rec["weight_shape"], dtype=torch.int64)

    def extra_repr(self):
        return super().extra_repr() + f", plan: {self.qx_plan}"


class FastConv1DMixin(FastMixin):
    """transformers' Conv1D (GPT-2): y = x @ W + b with W [in, out], i.e. a Linear on W^T."""

    def forward(self, x):
        y = _direct(self, x)
        if y is not None:
            return y
        if (self.qx_plan in _LOWBIT_PLANS and not _needs_grad(self, x)
                and x.is_floating_point() and _lowbit_here(self, x)):
            if self.qx_plan == "lowbit_a8":
                return _forward_lowbit_a8(self, x)
            return _forward_lowbit(self, self._qx_input(x))
        return super().forward(x)


class FastLinearMixin(FastMixin):
    def forward(self, x):
        y = _direct(self, x)
        if y is not None:
            return y
        plan = self.qx_plan
        if _needs_grad(self, x):     # the integer kernels have no backward
            return F.linear(self._qx_input(x), self.weight, self.bias)
        if plan in fast_cuda.PLANS:
            return fast_cuda.forward(self, self._qx_input(x))
        if plan in _LOWBIT_PLANS and x.is_floating_point() and _lowbit_here(self, x):
            if plan == "lowbit_a8":
                return _forward_lowbit_a8(self, x)
            return _forward_lowbit(self, self._qx_input(x))
        if plan == "int_mm" and x.is_floating_point() and _int_mm_ok(x, self.qweight):
            return _forward_int_mm(self, x)
        x = self._qx_input(x)
        if plan == "int_mm24" and x.is_floating_point() and _int_mm_ok(x, self.qweight):
            return _forward_int_mm24(self, x)
        if plan == "int8pack" and x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            return _forward_int8pack(self, x)
        if plan == "int4pack":
            return _forward_int4pack(self, x)
        return F.linear(x, self.weight, self.bias)


# --- qcompress's fused low-bit kernels (plans lowbit, lowbit_a8) ---------------------------------

_LOWBIT_PLANS = ("lowbit", "lowbit_a8")
_LOWBIT_BUFFERS = ("lowbit_packed", "lowbit_scales", "lowbit_offsets")


def _exported_codes(mod: nn.Module, rec: dict):
    """(q int8 [N, K], scale fp32 [N, s_cols], zero point [N, s_cols] or None) of the exported
    tensors (s_cols: 1 for tensor / channel strategies, the group count for group)."""
    w = rec["weights"]
    bits, strat = w["num_bits"], w["strategy"]
    n, k = rec["weight_shape"]
    buf = mod._buffers
    if rec["format"] == "pack-quantized":
        q = _unpack_rows(buf["weight_packed"], bits, k)
    else:
        q = buf["qweight"].reshape(n, k)
    scale = buf["weight_scale"].to(torch.float32)
    s = scale.reshape(1, 1).expand(n, 1) if strat == "tensor" else scale.reshape(n, -1)
    zp = buf.get("weight_zero_point")
    if zp is None:
        z = None
    elif strat == "tensor":
        z = zp.reshape(1, 1).expand(n, 1)
    elif rec["format"] == "pack-quantized":
        z = _unpack_rows_dim0(zp, bits, n).reshape(n, -1)
    else:
        z = zp.reshape(n, -1)
    return q.to(torch.int8), s, z


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
    b = mod._buffers           # read per call (plain lookups: at one token this is per-call overhead)
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
    w = w.t().contiguous() if rec.get("transposed") else w            # as dequantize_record
    return w.to(mod._buffers["lowbit_scales"].device)


def _lowbit_exported(mod: nn.Module) -> Dict[str, torch.Tensor]:
    """The exported tensors (names, dtypes, shapes, values) rebuilt from the kernel layout."""
    from ..quant.packing import pack_int32
    rec = mod.qx_rec
    w = rec["weights"]
    bits, strat = w["num_bits"], w["strategy"]
    q, s, z = _lowbit_codes(mod)
    if strat != "group":                       # scales were repeated per chunk: one per row
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


# On a GPU the lowbit plans multiply by a float weight decoded once (_dense_on_gpu) with cuBLAS:
# the CUDA low-bit kernels (csrc/cuda/lowbit_gemm.cu) are correctness kernels, slower than cuBLAS
# at every token count measured (benchmarks/results/gpu.md). True runs them.
CUDA_LOWBIT_KERNELS = False


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


def _set_direct(mod: nn.Module, rec: dict):
    """What _direct calls for this module (None: the general path only), fixed at load."""
    n, _, group, cbits = mod.qx_lowbit
    act = rec.get("input_activations")
    mod.qx_direct = None
    if not _kernels.available() or "bias" not in mod._parameters:     # a bias kept as a buffer: general path
        return
    if mod.qx_plan == "lowbit" and act is None:
        mod.qx_direct = (torch.ops.qcompress.lowbit_linear.default, (n, group, cbits), False)
    elif mod.qx_plan == "lowbit_a8" and _token_spec(mod) is not None:
        spec = _token_spec(mod)
        mod.qx_direct = (torch.ops.qcompress.lowbit_linear_dyn_a8.default,
                         (n, group, cbits, spec.bits, spec.symmetric, spec.seed), True)


def _needs_grad(mod: nn.Module, x: torch.Tensor, residual=None) -> bool:
    """Whether autograd records this call: then the kernels, which have no backward, must not run (a
    bias or residual that needs a gradient counts as much as the input)."""
    if not torch.is_grad_enabled():
        return False
    bias = mod._parameters.get("bias")
    return (x.requires_grad or (bias is not None and bias.requires_grad)
            or (residual is not None and residual.requires_grad))


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
    return _kernels._call(op, x, packed, b["lowbit_scales"], b["lowbit_offsets"], mod._parameters["bias"], *args, act,
                          residual)


def _forward_lowbit(self, x: torch.Tensor) -> torch.Tensor:
    n, _, group, cbits = self.qx_lowbit
    return lowbit.linear(x, _lowbit_packed(self), self.bias, n, group, cbits)


def _forward_lowbit_a8(self, x: torch.Tensor) -> torch.Tensor:
    n, k, group, cbits = self.qx_lowbit
    spec = _token_spec(self)
    if spec is not None and x.device.type == "cpu" and x.dtype != torch.float64 and _kernels.available():
        # the same codes as _input_codes, quantized and multiplied in one C++ call: at one token the
        # Python between two ops costs more than the matmul
        return _kernels._call(lowbit.linear_dyn_a8, x, _lowbit_packed(self), self.bias, n, group, cbits,
                              spec.bits, spec.symmetric, spec.seed)
    qx, sx, zx = _input_codes(self, _flat(x, k))
    y = lowbit.linear_a8(qx, sx, None if zx is None else zx.to(torch.int32), _lowbit_packed(self), self.bias,
                         n, group, cbits, x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).contiguous()


def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if self.bias is not None:
        y = y + self.bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _int_mm_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    if x.device != q.device:
        return False
    if x.device.type == "cuda":            # cuBLASLt int8 GEMM shape rules
        m = x.numel() // x.shape[-1]
        return m > 16 and q.shape[0] % 8 == 0 and q.shape[1] % 8 == 0
    return x.device.type == "cpu"


def _token_spec(self):
    """The dynamic per-token Spec of the module's input codes (built once), or None (static range)."""
    act = self.qx_rec["input_activations"]
    if not act["dynamic"]:
        return None
    spec = self.__dict__.get("qx_token_spec")
    if spec is None:                   # built once: a Spec per call costs more than the matmul at one token
        spec = self.qx_token_spec = make_spec(act["num_bits"], symmetric=act["symmetric"], granularity="token")
    return spec


def _input_codes(self, x2: torch.Tensor):
    """(codes int8 [M,K], scale [M,1] or [1,1] fp32, zero point int64 or None): the codes whose
    dequantization is exactly the fake-quantized input of the exact path."""
    act = self.qx_rec["input_activations"]
    bits = act["num_bits"]
    if act["dynamic"]:
        spec = _token_spec(self)
        if x2.dtype != torch.float64 and _kernels.available() and _kernels.on_kernel_device(x2):
            q, s, zp = _kernels.quantize(x2, spec)     # what quantize_spec dispatches to, minus its checks
        else:
            q, s, zp = quantize_spec(x2, spec)
        return q.to(torch.int8), s.to(torch.float32), None if zp is None else zp.to(torch.int64)
    # static range: same ops as codes.static_act_fake_quant
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    s = self.input_scale.to(torch.float32).reshape(1, 1)
    r = torch.round(x2.to(torch.float32) / s)
    zp = getattr(self, "input_zero_point", None)
    if zp is None:
        return r.clamp(qmin, qmax).to(torch.int8), s, None
    z = zp.to(torch.float32).reshape(1, 1)
    return (r + z).clamp(qmin, qmax).to(torch.int8), s, zp.to(torch.int64).reshape(1, 1)


def _forward_int_mm(self, x: torch.Tensor) -> torch.Tensor:
    q = self.qweight                                   # int8 [N, K]
    x2 = _flat(x, q.shape[1])
    qx, sx, zx = _input_codes(self, x2)
    acc = torch._int_mm(qx, q.t())                     # exact int32 sums of code products
    zw = getattr(self, "weight_zero_point", None)
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
    sw = self.weight_scale.to(torch.float32).reshape(1, -1)
    y = acc.to(torch.float32) * sx * sw
    return _finish(self, y.to(x.dtype), x)


_D1 = 127 * 65536 + 127 * 256 + 127     # largest integer three balanced int8 digits can hold


def _digits(x2: torch.Tensor):
    """x2 [M,K] ~ sx * (65536 a1 + 256 a2 + a3), digits int8, per-row scale sx [M,1] fp32.

    The only rounding is x / sx (in float64) to the integer grid: half a step, 2^-24 of the
    row's largest |x|; the digit split is exact float32 integer arithmetic (values < 2^24)."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / _D1, torch.ones_like(amax))
    big = torch.round(xf.double() / sx.double()).clamp_(-_D1, _D1).float()   # exact in fp32
    # 256 a2 + a3 spans [-32896, 32639], so a1 takes what lies outside that window
    a1 = torch.floor((big + 32896.0) / 65536.0)
    r = big - a1 * 65536.0                    # [-32896, 32639]
    a2 = torch.floor((r + 128.0) / 256.0)
    a3 = r - a2 * 256.0                       # [-128, 127]
    return (a1.to(torch.int8), a2.to(torch.int8), a3.to(torch.int8)), big, sx


def _forward_int_mm24(self, x: torch.Tensor) -> torch.Tensor:
    q = self.qweight
    x2 = _flat(x, q.shape[1])
    (a1, a2, a3), big, sx = _digits(x2)
    qt = q.t()
    acc = (torch._int_mm(a1, qt).to(torch.float64) * 65536.0
           + torch._int_mm(a2, qt).to(torch.float64) * 256.0
           + torch._int_mm(a3, qt).to(torch.float64))          # exact: |acc| < 2^53
    zw = getattr(self, "weight_zero_point", None)
    if zw is not None:                                          # sum_k X_k (q - zw)
        acc = acc - big.to(torch.float64).sum(dim=1, keepdim=True) * zw.to(torch.float64).reshape(1, -1)
    sw = self.weight_scale.to(torch.float64).reshape(1, -1)
    y = (acc * sx.to(torch.float64) * sw).to(x.dtype)
    return _finish(self, y, x)


def _forward_int8pack(self, x: torch.Tensor) -> torch.Tensor:
    q = self.qweight
    s = self.weight_scale.to(x.dtype).reshape(-1).expand(q.shape[0]).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(_flat(x, q.shape[1]), q, s)
    return _finish(self, y, x)


def _forward_int4pack(self, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise RuntimeError(f"module {self.qx_name!r} holds torch's CPU int4pack layout; load the "
                           "checkpoint with mode='exact' (or mode='fast' on CPU) for this device")
    k = self.in_features
    sz = self.fast_scales_zeros
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_flat(x.to(sz.dtype), k), self.fast_weight_int4,
                                                   self.fast_group_size, sz)
    return _finish(self, y.to(x.dtype), x)


def _int4pack_weight(self) -> torch.Tensor:
    """The float weight the int4pack kernel uses: the kernel applied to the identity."""
    k = self.in_features
    sz = self.fast_scales_zeros
    eye = torch.eye(k, dtype=sz.dtype, device=sz.device)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.fast_weight_int4,
                                                      self.fast_group_size, sz).t().contiguous()


def _to_int4pack(mod: nn.Module, rec: dict):
    """Replace the exported 4-bit buffers by torch's CPU int4pack layout (once, at load)."""
    w = rec["weights"]
    n, k = rec["weight_shape"]
    gs = w["group_size"] if w["strategy"] == "group" else k
    buf = mod._buffers
    q = _unpack_rows(buf["weight_packed"], 4, k)                 # signed codes [-8, 7]
    scale = buf["weight_scale"].to(torch.float32).reshape(n, -1)
    zp = buf.get("weight_zero_point")
    # kernel: w = (u - 8) * s + z with u = q + 8, so z = -zp * s (0 when symmetric)
    zero = torch.zeros_like(scale) if zp is None else -(_unpack_rows_dim0(zp, 4, n).to(torch.float32) * scale)
    dt = getattr(torch, rec["dtype"])
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dt).contiguous()          # [ng, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32).contiguous(), 1)
    for name in _EXACT_BUFFERS:
        buf.pop(name, None)
    mod.register_buffer("fast_weight_int4", packed)
    mod.register_buffer("fast_scales_zeros", sz)
    mod.fast_group_size = gs


def _unpack_rows_dim0(zp: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    from ..quant.packing import unpack_int32
    return unpack_int32(zp, bits, rows, dim=0)


_CACHE: Dict[type, type] = {}


def fast_class(base: type, mixin: type) -> type:
    """The fast class over a loaded-module class (one per class)."""
    if base not in _CACHE:
        _CACHE[base] = type("Fast" + base.__name__, (mixin, base), {"__module__": __name__})
    return _CACHE[base]


def _swap_fast(mod: nn.Module, plan: str):
    base = type(mod)
    mixin = (FastLinearMixin if issubclass(base, _QLinear) else
             FastConv1DMixin if issubclass(base, _QHFConv1D) else FastMixin)
    mod.__class__ = fast_class(base, mixin)
    mod.qx_plan = plan
    mod.qx_direct = None


def convert(root: nn.Module, modules: Dict[str, dict], cuda_packed: bool = True) -> Dict[str, Tuple[str, str]]:
    """Give every loaded quantized module of `root` its fast plan; returns name -> (plan, reason).
    cuda_packed: layers on a CUDA device keep packed codes where torch's kernels take them
    (fast_cuda.py); False (mode="dense") decodes them to a float weight as before."""
    unpacked = {}                 # CUDA layers the packed kernels refuse: warned about once
    named = dict(root.named_modules())
    plans: Dict[str, Tuple[str, str]] = {}
    for name, rec in modules.items():
        mod = named[name]
        if not isinstance(mod, QuantizedMixin) or rec.get("weights") is None:
            continue
        plan, why = choose_plan(mod, rec)
        ws = mod._buffers.get("weight_scale")
        if cuda_packed and rec["kind"] in ("linear", "hf_conv1d") and ws is not None and ws.is_cuda:
            cap = torch.cuda.get_device_capability(ws.device)
            cplan, cwhy = fast_cuda.choose(rec, isinstance(mod, _QLinear), cap)
            if cplan:
                fast_cuda.to_packed(mod, rec, cplan, *_exported_codes(mod, rec))
                plan, why = cplan, ""
            else:
                unpacked[name] = cwhy
        if plan in _LOWBIT_PLANS:
            _to_lowbit(mod, rec)
        elif plan in fast_cuda.PLANS:
            pass
        elif plan == "int4pack":
            _to_int4pack(mod, rec)
        elif plan == "dequant" and planes_ok(rec):
            _to_planes(mod, rec)
        _swap_fast(mod, plan)
        if plan in _LOWBIT_PLANS:
            _set_direct(mod, rec)
        plans[name] = (plan, why)
    if unpacked:
        warnings.warn(f"load_quantized(mode='fast'): {len(unpacked)} CUDA layers keep a dense float weight "
                      "(torch's packed kernels do not take them): "
                      + "; ".join(f"{n!r}: {why}" for n, why in list(unpacked.items())[:5])
                      + (" ..." if len(unpacked) > 5 else ""), stacklevel=3)
    fallbacks = {n: why for n, (p, why) in plans.items() if p == "dequant"}
    counts = {}
    for p, _ in plans.values():
        counts[p] = counts.get(p, 0) + 1
    log.info("load_quantized(mode='fast'): %s", ", ".join(f"{c} x {p}" for p, c in sorted(counts.items())))
    if any(p in _LOWBIT_PLANS for p in counts):
        log.info("load_quantized(mode='fast'): lowbit kernels use %s on the CPU", lowbit.isa())
    for n, why in fallbacks.items():
        log.info("load_quantized(mode='fast'): %r falls back to dequantize-per-call: %s", n, why)
    return plans


def plans_of(model: nn.Module) -> Dict[str, str]:
    """name -> plan for every fast-loaded module (for inspection and tests)."""
    return {n: m.qx_plan for n, m in model.named_modules() if isinstance(m, FastMixin)}


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (shared storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


quantized.register_family(__name__, fast_class, (FastMixin, FastLinearMixin, FastConv1DMixin))
quantized.register_load_step("fast", lambda root, modules, options: convert(root, modules))
# the fast plans with every CUDA weight decoded once to a float weight (cuBLAS), none kept packed
quantized.register_load_step("dense", lambda root, modules, options: convert(root, modules, cuda_packed=False))
