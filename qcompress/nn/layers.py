"""Compress-aware modules.

`make_compress_aware(module)` swaps a module's class for a subclass of its own class (so
`isinstance` checks, parameters, their identity, device, dtype and state_dict keys are all
kept) that applies weight quantization, pruning masks and input-activation quantization in
forward. Supported: nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.BatchNorm2d and
transformers' Conv1D (GPT-2, weight stored [in, out]).
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant.api import fake_quantize_spec
from ..quant.reference import make_spec
from .state import ActQuant, WeightQuant

_CLASS_CACHE: Dict[type, type] = {}


def _is_hf_conv1d(module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and "transformers" in cls.__module__ and hasattr(module, "nf")


def kind_of(module) -> Optional[str]:
    """linear | conv | embedding | batchnorm | hf_conv1d, or None if not compressible."""
    if isinstance(module, CompressMixin):
        return module.qc_kind
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.BatchNorm2d):
        return "batchnorm"
    if _is_hf_conv1d(module):
        return "hf_conv1d"
    return None


class CompressMixin:
    """Shared behaviour of every compress-aware module (mixed in before the torch class)."""

    qc_kind = "linear"

    def _qc_setup(self, name: str):
        self.qc_name = name
        self.qc_wq: Optional[WeightQuant] = None
        self.qc_aq: Optional[ActQuant] = None
        self.qc_pruning = {}          # technique -> pruning state (qcompress.pruning)

    # --- module plumbing ----------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """.to() / .cuda() / .half() ...: the master copy and codes follow the weight."""
        out = super()._apply(fn, recurse)
        wq = self.__dict__.get("qc_wq")
        if wq is not None:
            wq.store.follow(self.weight)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """A loaded weight is a new starting point, not an optimizer update: drop the master copy
        and codes so the next scheduler step takes the loaded weight as the master."""
        n_errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        wq = self.__dict__.get("qc_wq")
        if wq is not None and prefix + "weight" in state_dict and len(error_msgs) == n_errors:
            wq.store.reset()

    def __reduce_ex__(self, protocol):
        """Pickle by (base class, kind): the compress-aware class is made at run time, so pickle
        cannot find it by name (torch.save(model) of a whole model)."""
        rv = super().__reduce_ex__(protocol)
        base = base_class(type(self))
        if not isinstance(rv, tuple) or _CLASS_CACHE.get(base) is not type(self):
            return rv       # a further subclass (e.g. FSDP's): leave it to its own rules
        return (_new_compress_aware, (base, self.qc_kind)) + tuple(rv[2:])

    # --- weights ------------------------------------------------------------------------------
    def weight_matrix_view(self, w: torch.Tensor) -> torch.Tensor:
        """The weight as [out, ...] (HF Conv1D stores [in, out])."""
        return w.t() if self.qc_kind == "hf_conv1d" else w

    def _from_matrix_view(self, w: torch.Tensor) -> torch.Tensor:
        return w.t() if self.qc_kind == "hf_conv1d" else w

    def quantized_weight(self, weight: Optional[torch.Tensor] = None):
        """(q, scale, zero_point, spec) of the weight forward uses now, in [out, ...] orientation.

        Dequantizing (q - zero_point) * scale gives effective_weight() bit for bit (default
        numerics, no fp16_mixed blend in progress). None when weight quantization is inactive.
        """
        from ..quant.api import quantize_spec
        wq = self.qc_wq
        if wq is None or not wq.active:
            return None
        if wq.codes is not None and weight is None:  # written by optimizer-step mode or clean
            return (*wq.codes, wq.codes_spec)
        w = self.weight if weight is None else weight
        spec = wq.spec()
        q, s, z = quantize_spec(self.weight_matrix_view(w.detach()), spec)
        return q, s, z, spec

    def effective_weight(self) -> torch.Tensor:
        """The weight this module's forward uses at this step (quantized, blended, masked)."""
        w = self.weight
        wq = self.qc_wq
        if wq is not None and wq.active and wq.in_forward and not wq.baked:
            q = self._from_matrix_view(fake_quantize_spec(self.weight_matrix_view(w), wq.spec(),
                                                          clip_grad=wq.clip_grad))
            r = wq.mix_ratio if wq.mix_enabled else 0.0
            w = q if r <= 0.0 else r * w + (1.0 - r) * q
        if self.qc_pruning:
            from ..pruning.masks import apply_weight_masks
            w = apply_weight_masks(self, w)
        return w

    def effective_bias(self):
        b = getattr(self, "bias", None)
        if b is not None and self.qc_pruning:
            from ..pruning.masks import apply_bias_masks
            b = apply_bias_masks(self, b)
        return b

    # --- activations --------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        aq = self.qc_aq
        if aq is None or not aq.active or not torch.is_floating_point(x):
            return x
        if aq.calibration == "static":
            if self.training:
                lo, hi = aq.observer.observe(x)
            elif aq.observer.initialized:
                lo, hi = aq.observer.min, aq.observer.max
            else:
                _warn_uncalibrated(self.qc_name)
                lo, hi = x.detach().amin().float(), x.detach().amax().float()
            spec = make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")
            return fake_quantize_spec(x, spec, min_val=lo, max_val=hi)
        if aq.per == "sample":
            spec = make_spec(aq.bits, symmetric=aq.symmetric, granularity="channel")
        else:
            spec = make_spec(aq.bits, symmetric=aq.symmetric, granularity="token")
        return fake_quantize_spec(x, spec)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        parts = []
        if self.qc_wq is not None:
            wq = self.qc_wq
            parts.append(f"W{wq.bits if wq.active else '-'}→{wq.target_bits} {wq.describe()}")
        if self.qc_aq is not None:
            parts.append(self.qc_aq.describe() + ("" if self.qc_aq.active else " (off)"))
        return base + (", qc: " + "; ".join(parts) if parts else "")


_warned_uncalibrated = set()


def _warn_uncalibrated(name):
    if name not in _warned_uncalibrated:
        _warned_uncalibrated.add(name)
        warnings.warn(f"{name}: static activation range used in eval before any training batch "
                      "calibrated it; falling back to this batch's own range", stacklevel=3)


class _LinearForward(CompressMixin):
    qc_kind = "linear"

    def forward(self, x):
        return F.linear(self.quantize_input(x), self.effective_weight(), self.effective_bias())


class _ConvForward(CompressMixin):
    qc_kind = "conv"

    def forward(self, x):
        return self._conv_forward(self.quantize_input(x), self.effective_weight(), self.effective_bias())


class _EmbeddingForward(CompressMixin):
    qc_kind = "embedding"

    def forward(self, x):
        return F.embedding(x, self.effective_weight(), self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)


class _BatchNormForward(CompressMixin):
    qc_kind = "batchnorm"   # passive side of channel pruning only

    def forward(self, x):
        return super().forward(x)


class _HFConv1DForward(CompressMixin):
    qc_kind = "hf_conv1d"

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = self.quantize_input(x)
        x = torch.addmm(self.effective_bias(), x.reshape(-1, x.size(-1)), self.effective_weight())
        return x.view(size_out)


_FORWARDS: Dict[str, Type[CompressMixin]] = {
    "linear": _LinearForward, "conv": _ConvForward, "embedding": _EmbeddingForward,
    "batchnorm": _BatchNormForward, "hf_conv1d": _HFConv1DForward,
}


def compress_class(cls: type, kind: str) -> type:
    """The compress-aware subclass of `cls` (created once per class)."""
    if cls not in _CLASS_CACHE:
        mixin = _FORWARDS[kind]
        _CLASS_CACHE[cls] = type(f"Compress{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASS_CACHE[cls]


def base_class(cls: type) -> type:
    """The original torch class under a compress-aware class."""
    return [c for c in cls.__mro__[1:] if not issubclass(c, CompressMixin)][0]


def _new_compress_aware(base: type, kind: str):
    """Unpickling: an empty instance of the compress-aware subclass of `base`."""
    cls = compress_class(base, kind)
    return cls.__new__(cls)


def make_compress_aware(module: nn.Module, name: str) -> nn.Module:
    """Swap module's class in place; idempotent. Returns the same object."""
    if isinstance(module, CompressMixin):
        return module
    kind = kind_of(module)
    if kind is None:
        raise TypeError(f"{name}: {type(module).__name__} is not a compressible module")
    module.__class__ = compress_class(type(module), kind)
    module._qc_setup(name)
    return module


def restore_class(module: nn.Module) -> nn.Module:
    """Undo make_compress_aware (used after redundancy_clean when nothing is left to apply)."""
    if isinstance(module, CompressMixin):
        base = base_class(type(module))
        for attr in ("qc_name", "qc_wq", "qc_aq", "qc_pruning"):
            module.__dict__.pop(attr, None)
        module.__class__ = base
    return module
