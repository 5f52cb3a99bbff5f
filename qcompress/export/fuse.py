"""Activations and skip connections fused into the fast low-bit layer before them
(load_quantized(mode="fast")).

BERT's feed-forward is dense -> GELU. As two ops the GELU is a second pass over the [tokens, 1536]
output, a sizeable share of a small-batch W4 forward on a CPU (benchmarks/results/inference.md
measures the fused layers). Fused, the kernel applies it to each output before the store
(lowbit_linear's `act`). Likewise the block outputs' `dense(h) + input` (BertSelfOutput,
BertOutput): the kernel adds the skip connection in its store (lowbit_linear's `residual`), the
same float add, so those outputs do not change at all.

Only the parent's forward changes: its class gets FusedActMixin, FusedResidualMixin or
FusedSequentialMixin, whose forward makes the one fused call and then does what the original
forward did after it.
The layer and the activation module stay as they are, so calling either directly, or hooking it,
behaves as before: a hook on either (or a global module hook) at call time turns the fused call
back into the two modules' own calls. A pair is fused only where the layer's output provably goes
to the activation and nowhere else: the parent's forward is, byte code for byte code, one of the
known forwards below (a subclass that changes it is left alone), or the parent is a plain
nn.Sequential and the two are neighbours. The layer must be on a plan whose kernel is called in one
go (`lowbit`; `lowbit_a8` with dynamic per-token codes), the activation exactly torch's GELU (erf or
tanh form), ReLU or SiLU (transformers' GELUActivation, NewGELUActivation, GELUTanh and SiLUActivation
included). Llama-style gated MLPs (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) run the gate
projection and its SiLU as one call.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Dict, Optional, Tuple

import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

from . import quantized
from .fast import FastMixin, _direct

log = logging.getLogger("qcompress.export.fuse")


def _same(self, h, x):
    return h


def _gpt2_mlp_tail(self, h, x):
    return self.dropout(self.c_proj(h))


def _gated_mlp_tail(self, h, x):
    return self.down_proj(h * self.up_proj(x))


# what a known forward does after the activation (h: the activation's output, x: the forward's input)
_TAILS: Dict[str, Callable] = {"none": _same, "gpt2_mlp": _gpt2_mlp_tail, "gated_mlp": _gated_mlp_tail}

# (module, class, layer attribute, activation attribute, _TAILS key); forwards with the same byte
# code match too (Mistral's and Qwen2's MLPs are Llama's)
_KNOWN: Tuple[Tuple[str, str, str, str, str], ...] = (
    ("transformers.models.bert.modeling_bert", "BertIntermediate", "dense", "intermediate_act_fn", "none"),
    ("transformers.models.gpt2.modeling_gpt2", "GPT2MLP", "c_fc", "act", "gpt2_mlp"),
    ("transformers.models.llama.modeling_llama", "LlamaMLP", "gate_proj", "act_fn", "gated_mlp"),
)


def act_kind(mod: nn.Module) -> Optional[str]:
    """ "gelu" / "gelu_tanh" / "relu" / "silu" for exactly torch's GELU (erf or tanh form), ReLU and SiLU
    modules and transformers' GELUActivation, NewGELUActivation (gelu_new), GELUTanh and
    SiLUActivation, else None."""
    if type(mod) is nn.GELU:
        return "gelu" if mod.approximate == "none" else "gelu_tanh"
    if type(mod) is nn.ReLU:
        return "relu"
    if type(mod) is nn.SiLU:
        return "silu"
    if type(mod).__module__ != "transformers.activations":
        return None
    name, fn = type(mod).__name__, getattr(mod, "act", None)
    if name == "SiLUActivation":
        return "silu"
    if name == "GELUActivation" and fn is F.gelu:
        return "gelu"
    if name == "NewGELUActivation":
        return "gelu_tanh"
    if (
        name == "GELUTanh"
        and isinstance(fn, functools.partial)
        and fn.func is F.gelu
        and not fn.args
        and fn.keywords == {"approximate": "tanh"}
    ):
        return "gelu_tanh"
    return None


def _hook_free(mod: nn.Module) -> bool:
    return not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks)


def _no_global_hooks() -> bool:
    return not any(
        getattr(_module, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


def fused_call(layer: nn.Module, act: nn.Module, x):
    """act(layer(x)) as one kernel call where it can run, else the two modules' own calls. Checked
    at every call, so a module swapped or hooked after loading is run as it is."""
    kind = _fusable(layer, act)
    if kind and _hook_free(layer) and _hook_free(act) and _no_global_hooks():
        y = _direct(layer, x, kind)
        if y is not None:
            return y
    return act(layer(x))


class FusedActMixin:
    """A known parent (_KNOWN) whose layer -> activation runs as one call (qx_fuse: layer and
    activation attributes, the _TAILS key of the rest of its forward)."""

    def forward(self, hidden_states):  # BERT's and GPT-2's argument name (LlamaMLP's is x)
        layer, act, tail = self.qx_fuse
        return _TAILS[tail](self, fused_call(self._modules[layer], self._modules[act], hidden_states), hidden_states)

    def extra_repr(self):
        layer, act, _ = self.qx_fuse
        return f"fused: {layer} + {act} ({_fusable(self._modules[layer], self._modules[act])})"


# (module, class, layer, dropout and norm attributes): forwards that are
# norm(dropout(layer(hidden_states)) + input_tensor), a transformer block's output and skip connection
_KNOWN_RESIDUAL: Tuple[Tuple[str, str, str, str, str], ...] = (
    ("transformers.models.bert.modeling_bert", "BertSelfOutput", "dense", "dropout", "LayerNorm"),
    ("transformers.models.bert.modeling_bert", "BertOutput", "dense", "dropout", "LayerNorm"),
)


def _residual_ok(layer: nn.Module, dropout: nn.Module, x, res) -> bool:
    return (
        type(dropout) is nn.Dropout
        and (not dropout.training or dropout.p == 0)
        and _lowbit_layer(layer)
        and _hook_free(layer)
        and _hook_free(dropout)
        and _no_global_hooks()
        and res.dtype == x.dtype
        and res.shape == (*x.shape[:-1], layer.qx_lowbit[0])
    )


class FusedResidualMixin:
    """A known parent (_KNOWN_RESIDUAL) whose layer adds the skip connection in its kernel's store
    (qx_fuse: layer, dropout and norm attributes); the sum is the same float add as before, so
    outputs are unchanged bit for bit."""

    def forward(self, hidden_states, input_tensor):
        layer, drop, norm = self.qx_fuse
        dense = self._modules[layer]
        if _residual_ok(dense, self._modules[drop], hidden_states, input_tensor):
            y = _direct(dense, hidden_states, "none", input_tensor)
            if y is not None:
                return self._modules[norm](y)
        return super().forward(hidden_states, input_tensor)

    def extra_repr(self):
        return f"fused: {self.qx_fuse[0]} + the skip connection"


class FusedSequentialMixin:
    """nn.Sequential whose (low-bit layer, activation) neighbours each run as one call; the pairs are
    found at every call, so edits to the container after loading stay safe."""

    def forward(self, x):
        mods = list(self._modules.values())
        i = 0
        while i < len(mods):
            if i + 1 < len(mods) and _fusable(mods[i], mods[i + 1]):
                x = fused_call(mods[i], mods[i + 1], x)
                i += 2
            else:
                x = mods[i](x)
                i += 1
        return x


_CACHE: Dict[Tuple[type, type], type] = {}


def fused_class(cls: type, mixin: type) -> type:
    """The fused class over a parent class (one per class); pickles through quantized._rebuild."""
    if (cls, mixin) not in _CACHE:
        _CACHE[cls, mixin] = type(
            "Fused" + cls.__name__,
            (mixin, cls),
            {"__module__": __name__, "__reduce_ex__": quantized.QuantizedMixin.__reduce_ex__},
        )
    return _CACHE[cls, mixin]


def _code_key(fn) -> tuple:
    c = fn.__code__
    return c.co_code, c.co_names, c.co_consts


def _known_forwards(known) -> Dict[tuple, tuple]:
    """code key of each importable known forward -> its attribute names (and tail)."""
    out = {}
    for module, cls, *attrs in known:
        try:
            ref = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        out[_code_key(ref.forward)] = tuple(attrs)
    return out


def _lowbit_layer(layer: Optional[nn.Module]) -> bool:
    """A fast layer whose one-call kernel (lowbit, lowbit_a8) takes act and residual."""
    return (
        isinstance(layer, FastMixin)
        and layer.qx_plan in ("lowbit", "lowbit_a8")
        and bool(layer.__dict__.get("qx_direct"))
    )


def _fusable(layer: Optional[nn.Module], act: nn.Module) -> Optional[str]:
    return act_kind(act) if _lowbit_layer(layer) else None


def fuse_activations(root: nn.Module) -> Dict[str, str]:
    """Fuse every eligible pair of a fast-loaded model in place; returns the fused layers' names ->
    what they fused ("gelu", "gelu_tanh", "relu", "silu", "residual")."""
    known, known_res = _known_forwards(_KNOWN), _known_forwards(_KNOWN_RESIDUAL)
    fused = {}
    for pname, parent in list(root.named_modules()):
        prefix = pname + "." if pname else ""
        if type(parent) is nn.Sequential:
            names = list(parent._modules)
            pairs = {prefix + a: _fusable(parent._modules[a], parent._modules[b]) for a, b in zip(names, names[1:])}
            pairs = {name: kind for name, kind in pairs.items() if kind}
            if pairs:
                parent.__class__ = fused_class(nn.Sequential, FusedSequentialMixin)
                fused.update(pairs)
            continue
        fwd = getattr(type(parent), "forward", None)
        key = _code_key(fwd) if hasattr(fwd, "__code__") else None
        res = known_res.get(key)
        if res is not None and _lowbit_layer(parent._modules.get(res[0])):
            parent.__class__ = fused_class(type(parent), FusedResidualMixin)
            parent.qx_fuse = res
            fused[prefix + res[0]] = "residual"
            continue
        attrs = known.get(key)
        if attrs is None:
            continue
        layer, act = (parent._modules.get(a) for a in attrs[:2])
        kind = _fusable(layer, act) if layer is not None and act is not None else None
        if kind:
            parent.__class__ = fused_class(type(parent), FusedActMixin)
            parent.qx_fuse = attrs
            fused[prefix + attrs[0]] = kind
    if fused:
        log.info(
            "load_quantized(mode='fast'): %d layers run what follows them in their kernel (%s)",
            len(fused),
            ", ".join(sorted(set(fused.values()))),
        )
    return fused


def _fuse_step(root: nn.Module, modules, options) -> None:
    if options.get("fuse_activations", True):
        fuse_activations(root)


quantized.register_family(__name__, fused_class, (FusedActMixin, FusedResidualMixin, FusedSequentialMixin))
quantized.register_load_step("fast", _fuse_step)  # after fast's convert: fuse imports fast
