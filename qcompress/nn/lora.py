"""LoRA adapters on compress-aware Linear / transformers Conv1D layers.

Each adapted layer holds a `LoraState` (`module.qc_lora`) and two matrices, A [r, in] and
B [out, r], with the update B A scaled by alpha / r (peft's layout and scaling):

- our own adapters are Parameters of the layer itself, `lora_A` and `lora_B` (A as nn.Linear
  initialises its weight, B zero, as peft does), so state_dicts and checkpoints carry them;
- a model wrapped by peft keeps its adapters where peft put them (`lora_A[name].weight`, ...): the
  peft layer's forward is reduced to calling its base layer, which is the compress-aware layer and
  applies the adapter itself, so nothing is applied twice.

Two modes:
- qat: the layer's weight is W + (B A) * scaling (in W's dtype, the formula and order of peft's
  merge), and that merged weight is what the weight quantizer sees, in forward and at export;
  the fused path (nn/fused.py) recomputes it in backward instead of keeping a copy;
- qlora: the base is stored as the export's integer codes, frozen, and forward is peft's:
  base(x) + B(A(dropout(x))) * scaling (nn/qlora.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..quant.reference import Spec

OWN_PARAMS = ("lora_A", "lora_B")
STORED = ("qlora_codes", "qlora_scale", "qlora_zero_point")  # qlora's stored base (nn/qlora.py)


@dataclass
class LoraState:
    """One adapted layer's settings; the matrices are looked up where they live at each use (FSDP2
    replaces Parameters with sharded ones, so no reference to a Parameter is kept here)."""

    mode: str  # qat | qlora
    r: int
    alpha: float
    scaling: float
    dropout: float
    holder: Optional[nn.Module] = None  # peft's layer holding the adapter; None: the layer itself
    adapter: Optional[str] = None  # peft's adapter name
    merge: bool = False  # qlora: the export also writes the merged model
    spec: Optional[Spec] = None  # qlora: the stored codes' Spec
    dtype: Optional[torch.dtype] = None  # qlora: the weight's dtype

    @property
    def peft(self) -> bool:
        return self.adapter is not None


def state(mod) -> Optional[LoraState]:
    return mod.__dict__.get("qc_lora")


def adapter_weights(mod) -> Tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) of an adapted layer, as they are now."""
    st = mod.__dict__["qc_lora"]
    if st.holder is None:
        return mod.lora_A, mod.lora_B
    return st.holder.lora_A[st.adapter].weight, st.holder.lora_B[st.adapter].weight


def adapter_parameters(mod):
    """The adapter's Parameters (what trains)."""
    st = mod.__dict__["qc_lora"]
    if st.holder is None:
        return [mod._parameters["lora_A"], mod._parameters["lora_B"]]
    return [st.holder.lora_A[st.adapter].weight, st.holder.lora_B[st.adapter].weight]


def merges(mod) -> bool:
    """Whether the layer's weight is W + (B A) * scaling now (mode qat, not yet baked in)."""
    st = mod.__dict__.get("qc_lora")
    if st is None or st.mode != "qat":
        return False
    wq = mod.__dict__.get("qc_wq")
    return wq is None or not wq.baked


def merge(mod, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W + (B A) * scaling in W's dtype and layout: peft's get_delta_weight and merge, so a merged
    peft model and this layer hold the same numbers."""
    delta = b @ a
    if mod.qc_kind == "hf_conv1d":  # weight stored [in, out] (peft's fan_in_fan_out)
        delta = delta.t()
    scaling = mod.__dict__["qc_lora"].scaling
    if delta.requires_grad:
        return (w + delta * scaling).to(w.dtype)
    # no graph (the fused path, export): scaled in place, the same values with one weight-size
    # tensor fewer alive
    return (w + delta.mul_(scaling)).to(w.dtype)


def merge_grads(
    mod,
    grad: torch.Tensor,
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    need_w: bool = False,
    need_a: bool = True,
    need_b: bool = True,
    own_grad: bool = False,
):
    """(gradient of w, of a, of b) for the gradient `grad` of merge(mod, w, a, b): the tensors
    torch's autograd makes through merge's ops (to, add, mul by the scaling, the Conv1D transpose,
    mm), bit for bit, without a recorded graph keeping weight-size intermediates alive. The fused
    backward (nn/fused.py) calls it; tests/nn/test_lora.py checks it against autograd.
    `own_grad`: nothing else holds `grad`, which is then scaled in place (one weight-size tensor
    fewer)."""
    scaling = mod.__dict__["qc_lora"].scaling
    summed = torch.promote_types(w.dtype, a.dtype)  # w + delta * scaling, before .to(w.dtype)
    g = grad if grad.dtype == summed else grad.to(summed)  # ToCopyBackward
    gw = None
    if need_w:  # AddBackward, cast to w's dtype by the engine
        gw = g if g.dtype == w.dtype else g.to(w.dtype)
    if not (need_a or need_b):
        return gw, None, None
    g = g if g.dtype == a.dtype else g.to(a.dtype)  # the engine's cast to delta's dtype
    if own_grad and g is grad and not need_w:
        g = g.mul_(scaling)  # MulBackward, in place: the same values
    else:
        g = g * scaling  # MulBackward
    if mod.qc_kind == "hf_conv1d":  # TBackward
        g = g.t()
    ga = gb = None
    if need_b:  # mm_mat1_backward(g, a, b's sizes and strides)
        gb = a.mm(g.t()).t() if b.stride(0) == 1 and b.stride(1) == b.size(0) else g.mm(a.t())
    if need_a:  # mm_mat2_backward(g, b, a's sizes and strides)
        ga = g.t().mm(b).t() if a.stride(0) == 1 and a.stride(1) == a.size(0) else b.t().mm(g)
    return gw, ga, gb


def quantizer_input(mod) -> torch.Tensor:
    """The weight the quantizer sees: the Parameter, or the merged weight of a qat adapter."""
    w = mod.weight
    if merges(mod):
        a, b = adapter_weights(mod)
        return merge(mod, w, a, b)
    return w


def init_adapter(a: torch.Tensor, b: torch.Tensor) -> None:
    """A as nn.Linear initialises a weight (kaiming uniform, a = sqrt(5)), B zero: peft's default,
    so the adapted model starts as the base model."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b.zero_()


def add_adapter(mod, *, mode: str, r: int, alpha: float, dropout: float) -> None:
    """Register our own adapter on a compress-aware Linear / Conv1D (A, B float32 on its device)."""
    w = mod.weight
    out_f, in_f = mod.weight_matrix_view(w).shape
    dev = w.device
    a = nn.Parameter(torch.empty(r, in_f, dtype=torch.float32, device=dev))
    b = nn.Parameter(torch.empty(out_f, r, dtype=torch.float32, device=dev))
    if not w.is_meta:
        init_adapter(a, b)
    mod.register_parameter("lora_A", a)
    mod.register_parameter("lora_B", b)
    mod.__dict__["qc_lora"] = LoraState(
        mode=mode, r=r, alpha=float(alpha), scaling=float(alpha) / r, dropout=float(dropout)
    )


# --- peft-wrapped models ---------------------------------------------------------------------


def is_peft_lora_layer(module) -> bool:
    """A peft LoraLayer (found by class, so peft is imported only where a model uses it)."""
    return any(c.__name__ == "LoraLayer" and c.__module__.startswith("peft.") for c in type(module).__mro__)


def peft_lora_layers(root: nn.Module):
    """[(name, peft LoraLayer)] of a model (wrapped by peft's get_peft_model or not)."""
    return [(n, m) for n, m in root.named_modules() if is_peft_lora_layer(m)]


def peft_adapter_modules(root: nn.Module) -> set:
    """Names of the modules peft added inside its LoRA layers (lora_A.default, ...): adapters, not
    weights to compress. The base layer and what lies under it are left in."""
    out = set()
    for name, layer in peft_lora_layers(root):
        for child_name, child in layer.named_children():
            if child_name == "base_layer":
                continue
            for sub, _ in child.named_modules():
                out.add(".".join(p for p in (name, child_name, sub) if p))
    return out


def _base_only_forward(self, x, *args, **kwargs):
    # the base layer is compress-aware and applies the adapter itself (qcompress.nn.lora)
    kwargs.pop("adapter_names", None)
    return self.base_layer(x, *args, **kwargs)


_PEFT_CLASSES: Dict[type, type] = {}


def _adopted_class(cls: type) -> type:
    if cls not in _PEFT_CLASSES:
        _PEFT_CLASSES[cls] = type(
            f"Adopted{cls.__name__}",
            (cls,),
            {"forward": _base_only_forward, "__module__": __name__, "qc_adopted": True},
        )
    return _PEFT_CLASSES[cls]


def adopt_peft(layer, base, mode: str) -> None:
    """Make peft's adapter the compress-aware base layer's: peft's layer forwards to its base only."""
    adapter = next(iter(layer.lora_A.keys()))
    drop = layer.lora_dropout[adapter]
    p = float(getattr(drop, "p", 0.0))
    base.__dict__["qc_lora"] = LoraState(
        mode=mode,
        r=int(layer.r[adapter]),
        alpha=float(layer.lora_alpha[adapter]),
        scaling=float(layer.scaling[adapter]),
        dropout=p,
        holder=layer,
        adapter=adapter,
    )
    if not getattr(type(layer), "qc_adopted", False):
        layer.__class__ = _adopted_class(type(layer))


def peft_root(model: nn.Module) -> Optional[nn.Module]:
    """The PeftModel's wrapped model (PeftModel.base_model.model), or None if `model` is not one."""
    tuner = getattr(model, "base_model", None)
    inner = getattr(tuner, "model", None)
    if isinstance(tuner, nn.Module) and isinstance(inner, nn.Module) and hasattr(model, "peft_config"):
        return inner
    return None
