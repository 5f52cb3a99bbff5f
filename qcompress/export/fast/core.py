"""What every fast plan is (the Plan interface), the plans that run the exact path's float math
(dense, gather, dequant), and the helpers several plans share."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ...quant import kernels as _kernels
from ...quant.api import quantize_spec
from ...quant.packing import pack_int32
from ...quant.reference import make_spec
from ..quantized import _QEmbedding, _QHFConv1D, _QLinear, _unpack_rows, dequantize_record, gather_refusal
from .planes import _to_planes, _unpack_rows_dim0, planes_codes, planes_dequantize, planes_ok

Choice = Tuple["Plan", str]
_EXACT_BUFFERS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class Plan:
    """One way a loaded quantized module runs under mode="fast": a stateless row of fast.TABLE.

    A module records only its plan's name (`qx_plan`): reports, logs and pickles see that string,
    and the mixins look the plan up by it on each call."""

    name = ""
    packs_on_cuda = False  # a row for codes kept on a CUDA device (skipped by mode="dense")

    def choose(self, mod: nn.Module, rec: dict) -> Optional[Choice]:
        """(plan, reason) where this row decides the layer, either itself or the dequant fallback
        with why; None passes the layer to the next row."""
        return None

    def convert(self, mod: nn.Module, rec: dict) -> None:
        """Re-lay the module's exported tensors for the plan (once, at load)."""

    def ready(self, mod: nn.Module) -> None:
        """Set up per-call state that pickles leave out (after the load's swap and after unpickling)."""

    def forward(self, mod: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output from the plan's kernel, or None where the module's exact forward runs (x: the
        input before its fake quantization)."""
        return None

    def weight(self, mod: nn.Module) -> torch.Tensor:
        """The float weight, as the exact path computes it (`mod.weight`)."""
        return dequantize_record(mod.qx_rec, mod._buffers)

    def check_saveable(self, mod: nn.Module) -> None:
        """Raise where the plan's tensors cannot be written back as the exported ones."""

    def saved(self, mod: nn.Module, destination: Dict[str, Any], prefix: str) -> None:
        """Turn the plan's tensors, as nn.Module wrote them to a state dict, into the exported ones."""


class Dense(Plan):
    """Not quantized: the layer's own float weight (no fast module is made for it)."""

    name = "dense"

    def choose(self, mod, rec):
        return (self, "not quantized") if rec.get("weights") is None else None


class Gather(Plan):
    """Embeddings dequantize only the rows their ids look up (quantized.gather_rows, in either
    mode): the loaded module's own forward."""

    name = "gather"

    def choose(self, mod, rec):
        why = _kernel_refusal(mod, rec)
        if why is not None:
            return DEQUANT, why
        if rec["kind"] != "embedding" or not isinstance(mod, _QEmbedding):
            return None
        why = gather_refusal(rec)
        return (DEQUANT, why) if why else (self, "")


class Dequant(Plan):
    """Everything no kernel row takes (without the extension: 4-bit float32 layers, 8-bit groups,
    2-bit, binary/ternary, HF Conv1D, odd shapes; in any build: conv, embeddings gather refuses,
    float formats, classes with their own forward): the exact path, a float weight per call, the
    same values bit for bit. Packed 2/4-bit
    codes are re-laid out once as bit planes (planes.py) that unpack ~4x faster than the exported
    int32 words. Logged as a fallback, with the reason. The table's last row: it takes whatever
    reaches it."""

    name = "dequant"

    def choose(self, mod, rec):
        w = rec["weights"]
        return self, f"{w['num_bits']}-bit {w['strategy']} weights (no integer kernel)"

    def convert(self, mod, rec):
        if planes_ok(rec):
            _to_planes(mod, rec)

    def weight(self, mod):
        if "fast_planes" in mod._buffers:
            return planes_dequantize(mod.qx_rec, mod._buffers)
        return dequantize_record(mod.qx_rec, mod._buffers)

    def saved(self, mod, destination, prefix):
        planes = destination.pop(prefix + "fast_planes", None)
        if planes is not None:  # back to the exported tensors
            rec = mod.qx_rec
            bits = rec["weights"]["num_bits"]
            q = planes_codes(rec, planes).to(torch.int8) - (1 << (bits - 1))
            destination[prefix + "weight_packed"] = pack_int32(q, bits, dim=1)
            destination[prefix + "weight_shape"] = torch.tensor(rec["weight_shape"], dtype=torch.int64)


DEQUANT = Dequant()


# --- what the rows ask of a layer -----------------------------------------------------------------


def _kernel_refusal(mod: nn.Module, rec: dict) -> Optional[str]:
    """Why no integer kernel runs this layer, whatever the plan (None: the rows may look further)."""
    if rec.get("qtype") == "float":
        return f"{rec['format']} (dequantized per call)"
    if rec["kind"] in ("linear", "hf_conv1d") and not isinstance(mod, (_QLinear, _QHFConv1D)):
        return f"{type(mod).__name__} has its own forward (run on the dequantized weight)"
    return None


def _act_codes(rec: dict) -> bool:
    """Whether the layer's input is quantized to <= 8-bit integer codes we can reproduce."""
    act = rec.get("input_activations")
    if act is None or act["num_bits"] > 8:
        return False
    return (not act["dynamic"]) or act["strategy"] == "token"


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _needs_grad(mod: nn.Module, x: torch.Tensor, residual=None) -> bool:
    """Whether autograd records this call: then the kernels, which have no backward, must not run (a
    bias or residual that needs a gradient counts as much as the input)."""
    if not torch.is_grad_enabled():
        return False
    bias = mod._parameters.get("bias")
    return (
        x.requires_grad
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )


# --- tensors several plans read -------------------------------------------------------------------


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


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).contiguous()


def _token_spec(mod: nn.Module):
    """The dynamic per-token Spec of the module's input codes (built once), or None (static range)."""
    act = mod.qx_rec["input_activations"]
    if not act["dynamic"]:
        return None
    spec = mod.__dict__.get("qx_token_spec")
    if spec is None:  # built once: a Spec per call costs more than the matmul at one token
        spec = mod.qx_token_spec = make_spec(act["num_bits"], symmetric=act["symmetric"], granularity="token")
    return spec


def _input_codes(mod: nn.Module, x2: torch.Tensor):
    """(codes int8 [M,K], scale [M,1] or [1,1] fp32, zero point int64 or None): the codes whose
    dequantization is exactly the fake-quantized input of the exact path."""
    act = mod.qx_rec["input_activations"]
    bits = act["num_bits"]
    if act["dynamic"]:
        spec = _token_spec(mod)
        if x2.dtype != torch.float64 and _kernels.available() and _kernels.on_kernel_device(x2):
            q, s, zp = _kernels.quantize(x2, spec)  # what quantize_spec dispatches to, minus its checks
        else:
            q, s, zp = quantize_spec(x2, spec)
        return q.to(torch.int8), s.to(torch.float32), None if zp is None else zp.to(torch.int64)
    # static range: same ops as codes.static_act_fake_quant
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    s = mod.input_scale.to(torch.float32).reshape(1, 1)
    r = torch.round(x2.to(torch.float32) / s)
    zp = getattr(mod, "input_zero_point", None)
    if zp is None:
        return r.clamp(qmin, qmax).to(torch.int8), s, None
    z = zp.to(torch.float32).reshape(1, 1)
    return (r + z).clamp(qmin, qmax).to(torch.int8), s, zp.to(torch.int64).reshape(1, 1)
