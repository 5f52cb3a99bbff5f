"""qlora layers: the frozen base stored as the export's integer codes, peft's forward over it.

The codes are buffers (`qlora_codes`, `qlora_scale`, `qlora_zero_point`: state_dicts, checkpoints
and .to() carry them) and `weight` dequantizes them on access, by the fake quantizer's formula, so
the layer computes with exactly the weight the export writes. Forward is peft's LoRA forward,
base(x) + B(A(dropout(x))) * scaling; the base's input gradient is computed from the codes again in
backward rather than from a float copy of the weight kept by autograd.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant.api import dequantize
from ..quant.reference import Spec, saturate
from . import pages, ranges
from .layers import CompressMixin, base_class, compress_class
from .lora import OWN_PARAMS, STORED, adapter_weights, merge


def _dequantize(mod, q, s, z, spec: Spec, dtype) -> torch.Tensor:
    """Codes as a float weight (the layer's layout and dtype), by the fake quantizer's own formula."""
    w = dequantize(
        q, s, z, group_size=spec.group_size if spec.granularity == "group" else None, num_groups=spec.num_groups
    )
    return mod._from_matrix_view(saturate(w, dtype).to(dtype).reshape(q.shape))


def _dequantize_stored(mod) -> torch.Tensor:
    """The stored base as a float weight: the fake quantizer's output bit for bit (checked when
    stored)."""
    st = mod.__dict__["qc_lora"]
    buf = mod._buffers
    return _dequantize(mod, buf["qlora_codes"], buf["qlora_scale"], buf.get("qlora_zero_point"), st.spec, st.dtype)


class QLoraForwardMixin(CompressMixin):
    """A qlora layer's forward: peft's, over the (stored or float) frozen base."""

    def forward(self, x):
        return stored_forward(self, x)

    def __reduce_ex__(self, protocol):
        rv = nn.Module.__reduce_ex__(self, protocol)
        return (_new_qlora, (base_class(type(self)), self.qc_kind, self._qc_stored)) + tuple(rv[2:])


class StoredBaseMixin(QLoraForwardMixin):
    """A qlora layer whose base is stored as codes: `weight` dequantizes them (no float Parameter)."""

    @property
    def weight(self):
        return _dequantize_stored(self)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        _point_codes(self)  # the buffers are new tensors after .to(): the codes follow
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        nn.Module._load_from_state_dict(self, *args, **kwargs)  # codes load in place, nothing to reset


_QLORA_CLASSES: Dict[tuple, type] = {}


def qlora_class(base: type, kind: str, stored: bool) -> type:
    """The qlora subclass of `base`'s compress-aware class (its base stored as codes or float)."""
    key = (base, stored)
    if key not in _QLORA_CLASSES:
        mixin = StoredBaseMixin if stored else QLoraForwardMixin
        _QLORA_CLASSES[key] = type(
            f"QLora{base.__name__}",
            (mixin, compress_class(base, kind)),
            {"__module__": __name__, "qc_kind": kind, "_qc_stored": stored},
        )
    return _QLORA_CLASSES[key]


def _new_qlora(base: type, kind: str, stored: bool):
    cls = qlora_class(base, kind, stored)
    return cls.__new__(cls)


def use_qlora_forward(mod) -> None:
    """A qlora layer whose base stays float (no weight quantization on it): peft's forward."""
    mod.__class__ = qlora_class(base_class(type(mod)), mod.qc_kind, False)


def _point_codes(mod) -> None:
    wq = mod.__dict__.get("qc_wq")
    if wq is not None and "qlora_codes" in mod._buffers:
        buf = mod._buffers
        wq.codes = (buf["qlora_codes"], buf["qlora_scale"], buf.get("qlora_zero_point"))


def stored_codes(mod):
    """(q, scale, zero point, spec, weight dtype) the layer's base is stored as, or the reason it
    cannot be (no integer codes; codes that do not give back the weight the model computes)."""
    got = mod.quantized_weight()
    if got is None:
        return "its weight quantization is not active at step 0"
    q, s, z, spec = got
    if getattr(spec, "kind", None) not in ("int", "binary", "ternary"):
        return f"its format ({spec}) has no integer codes"
    ew = mod.effective_weight().detach()
    back = _dequantize(mod, q, s, z, spec, ew.dtype)
    if not torch.equal(back, ew):
        return f"its codes do not give back the quantized weight ({int((back != ew).sum())} elements differ)"
    return q, s, z, spec, ew.dtype


@torch.no_grad()
def store_base(mod, codes) -> None:
    """Replace the layer's float weight by its codes (the export's own, from stored_codes, which
    checked them) and make `weight` dequantize them; the schedule leaves it, export reads them."""
    q, s, z, spec, dtype = codes
    st = mod.qc_lora
    st.spec, st.dtype = spec, dtype
    wq = mod.qc_wq
    old_cls = type(mod)
    wq.master = wq.applied = None
    # a weight mapped from the checkpoint file (transformers loads safetensors by mmap) gives its
    # pages back: otherwise the float base stays resident beside its codes (nn/pages.py)
    pages.drop(mod._parameters, "weight")
    mod.register_buffer("qlora_codes", q.detach().clone())
    mod.register_buffer("qlora_scale", s.detach().clone())
    if z is not None:
        mod.register_buffer("qlora_zero_point", z.detach().clone())
    mod.__class__ = qlora_class(base_class(old_cls), mod.qc_kind, True)
    wq.baked = True
    wq.codes_spec = spec
    _point_codes(mod)


class _StoredMatmul(torch.autograd.Function):
    """base(x) with the weight dequantized from its codes in forward and again in backward, so
    autograd keeps no float copy of a frozen weight."""

    @staticmethod
    def forward(ctx, x, bias, mod):
        ctx.mod = mod
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        return _base_op(mod, x, mod.weight, bias)

    @staticmethod
    def backward(ctx, grad):
        mod = ctx.mod
        w = mod.weight
        g2 = grad.reshape(-1, grad.size(-1))
        mat = w if mod.qc_kind == "linear" else w.t()  # y = x W^T (Linear), x W (Conv1D)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = g2.to(mat.dtype).mm(mat).reshape(*grad.shape[:-1], mat.size(1))
        gb = None
        if ctx.needs_input_grad[1]:
            gb = g2.sum(0).to(ctx.bias_meta[1])
        return gx, gb, None


def _base_op(mod, x, w, bias):
    if mod.qc_kind == "linear":
        return F.linear(x, w, bias)
    size_out = x.size()[:-1] + (mod.nf,)  # transformers Conv1D, as its forward
    return torch.addmm(bias, x.reshape(-1, x.size(-1)), w).view(size_out)


def stored_forward(mod, x):
    """peft's LoRA forward over the stored base: base(x) + B(A(dropout(x))) * scaling."""
    xq = mod.quantize_input(x)
    if torch.is_grad_enabled() and (xq.requires_grad or (mod.bias is not None and mod.bias.requires_grad)):
        result = _StoredMatmul.apply(xq, mod.bias, mod)
    else:
        result = _base_op(mod, xq, mod.weight, mod.bias)
    return add_adapter_output(mod, x, result)


def add_adapter_output(mod, x, result):
    """result + B(A(dropout(x))) * scaling, in peft's order and casts."""
    st = mod.qc_lora
    a, b = adapter_weights(mod)
    dtype = result.dtype
    if x.dtype != a.dtype:
        x = x.to(a.dtype)
    if st.dropout > 0.0:
        x = F.dropout(x, st.dropout, mod.training)
    result = result + F.linear(F.linear(x, a), b) * st.scaling
    return result.to(dtype)


@torch.no_grad()
def merge_in(mod) -> None:
    """Turn a qlora layer into a plain compress-aware one whose float weight is the merged
    W + (B A) * scaling (W the stored base dequantized), adapter and codes dropped: what the merged
    export re-quantizes with the layer's own quantizer. Used on a copy of the model."""
    a, b = adapter_weights(mod)
    w = mod.weight
    merged = merge(mod, w.detach(), a.detach(), b.detach())
    stored = isinstance(mod, StoredBaseMixin)
    for k in STORED:
        mod._buffers.pop(k, None)
    for k in OWN_PARAMS:
        mod._parameters.pop(k, None)
    mod.__class__ = compress_class(base_class(type(mod)), mod.qc_kind)
    del mod.__dict__["qc_lora"]
    mod._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
    wq = mod.qc_wq
    if wq is not None and stored:
        wq.baked = False
        wq.codes = wq.codes_spec = None
        if wq.range_observer != "minmax":
            ranges.init_weight_ranges(mod)  # the search runs on the merged weight
