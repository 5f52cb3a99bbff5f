"""Compress-aware modules.

`make_compress_aware(module)` swaps a module's class for a subclass of its own class (so
`isinstance` checks, parameters, their identity, device, dtype and state_dict keys are all
kept) that applies weight quantization, pruning masks and input-activation quantization in
forward. Supported: nn.Linear, nn.Conv1d/2d/3d, nn.Embedding, nn.BatchNorm2d, transformers'
Conv1D (GPT-2, weight stored [in, out]) and their subclasses.

Two forwards:
- fast path: the library class's forward (and, for convs, `_conv_forward`) is inherited
  unchanged, so the mixin calls the functional op itself with the effective tensors;
- composed path: the class defines its own forward (TF-"same" padding, weight standardization,
  scaled weights, ...). The mixin quantizes the first input, puts the effective weight and bias
  into `_parameters` for the duration of the call (as torch.func.functional_call does), runs the
  class's own forward, and puts the Parameters back. Whatever the forward does with
  `self.weight` then acts on the compressed weight.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Dict, Optional, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ..quant.api import fake_quantize_learned, fake_quantize_spec, lsq_grad_scale
from ..quant import float_observers, floats
from ..errors import NonFiniteError
from ..quant.reference import make_spec
from . import fused, lora, ranges, recompute_ranges, sharded
from .state import ActQuant, WeightQuant

_CLASS_CACHE: Dict[type, type] = {}


def _is_hf_conv1d(module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and "transformers" in cls.__module__ and hasattr(module, "nf")


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def kind_of(module) -> Optional[str]:
    """linear | conv | embedding | batchnorm | hf_conv1d, or None if not compressible."""
    if isinstance(module, CompressMixin):
        return module.qc_kind
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _CONVS):
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
        self.qc_pruning = {}  # technique -> pruning state (qcompress.pruning)

    def qc_located(self, what: str, err: NonFiniteError) -> NonFiniteError:
        """`err` naming this module and its tensor `what` (a method, so that nn/fused.py, which
        this module imports, can name them without importing it)."""
        return NonFiniteError(f"module {self.qc_name!r} ({base_class(type(self)).__name__}), its {what}: {err}")

    # --- module plumbing ----------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """.to() / .cuda() / .half() ...: the master copy and codes follow the weight."""
        out = super()._apply(fn, recurse)
        wq = self.__dict__.get("qc_wq")
        if wq is not None:
            wq.follow(self.weight)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """A loaded weight is a new starting point, not an optimizer update: drop the master copy
        and codes so the next scheduler step takes the loaded weight as the master."""
        n_errors = len(error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        wq = self.__dict__.get("qc_wq")
        loaded = wq is not None and prefix + "weight" in state_dict and len(error_msgs) == n_errors
        if loaded:
            wq.store.reset()
        if wq is not None and wq.range_learning and prefix + "weight_scale" in state_dict:
            ranges.loaded_with_scales(wq)  # trained scales: the next range initialisation keeps them
        elif loaded:
            ranges.reinit_after_load(self)  # no scales with them: observe the new weights

    def __reduce_ex__(self, protocol):
        """Pickle by (base class, kind): the compress-aware class is made at run time, so pickle
        cannot find it by name (torch.save(model) of a whole model)."""
        rv = super().__reduce_ex__(protocol)
        base = base_class(type(self))
        if not isinstance(rv, tuple) or _CLASS_CACHE.get(base) is not type(self):
            return rv  # a further subclass (e.g. FSDP's): leave it to its own rules
        return (_new_compress_aware, (base, self.qc_kind)) + tuple(rv[2:])

    # --- weights ------------------------------------------------------------------------------
    def weight_matrix_view(self, w: torch.Tensor) -> torch.Tensor:
        """The weight as [out, ...] (HF Conv1D stores [in, out])."""
        return w.t() if self.qc_kind == "hf_conv1d" else w

    def _from_matrix_view(self, w: torch.Tensor) -> torch.Tensor:
        # contiguous [in, out], the layout transformers' Conv1D stores: a transposed view runs
        # another GEMM kernel, whose bf16 results differ from the baked / reloaded weight's
        return w.t().contiguous() if self.qc_kind == "hf_conv1d" else w

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
        w = self.quantizer_input() if weight is None else weight
        spec = wq.spec()
        view = self.weight_matrix_view(w.detach())
        if floats.is_float(spec):  # (codes, scale, global scale or None, spec): export/floats.py
            s, g = ranges.float_weight_params(self, view, spec)
            return floats.quantize_codes(view, spec, s, g), s, g, spec
        params = ranges.weight_params(self, view, spec)
        if params is not None:
            q, s, z = quantize_spec(view, spec, scale=params[0], zero_point=params[1])
            return q, s, z, spec
        q, s, z = quantize_spec(view, spec)
        return q, s, z, spec

    def quantizer_input(self) -> torch.Tensor:
        """The weight the quantizer sees: the Parameter, or with a LoRA adapter in mode qat the
        merged W + (B A) * scaling (nn/lora.py)."""
        if "qc_lora" in self.__dict__:
            return lora.quantizer_input(self)
        return self.weight

    def effective_weight(self) -> torch.Tensor:
        """The weight this module's forward uses at this step (quantized, blended, masked)."""
        w = self.quantizer_input()
        wq = self.qc_wq
        if wq is not None and wq.active and wq.in_forward and not wq.baked:
            q = self._from_matrix_view(self._fake_quantize_weight(w, wq))
            r = wq.mix_ratio if wq.mix_enabled else 0.0
            w = q if r <= 0.0 else r * w + (1.0 - r) * q
        elif wq is not None and wq.range_learning and not wq.baked:
            w = ranges.attach_unused(w, self, ranges.WEIGHT_PARAMS)
        if self.qc_pruning:
            from ..pruning.masks import apply_weight_masks

            w = apply_weight_masks(self, w)
        return w

    def _fake_quantize_weight(self, w, wq, spec=None, learned=None):
        """w^ in [out, ...] orientation. `spec` and `learned` (scale, zero point) stand in for
        wq.spec() and the module's learned-range Parameters (the fused backward's recompute)."""
        ranges.check_solved(self)
        try:
            return self._fake_quantize_weight_of(w, wq, spec, learned)
        except NonFiniteError as err:
            raise located(self, "weight", err) from None

    def _fake_quantize_weight_of(self, w, wq, spec, learned):
        spec = wq.spec() if spec is None else spec
        if sharded.is_dtensor(w):  # tensor parallel: the shard, with the whole weight's scales
            return sharded.fake_quantize_weight(self, self.weight_matrix_view(w), spec, wq.clip_grad)
        view = self.weight_matrix_view(w)
        if floats.is_float(spec):
            if wq.range_learning:
                return float_observers.fake_quantize_learned(
                    view, spec, self.weight_scale, self._parameters.get("weight_global_scale")
                )
            s, g = ranges.float_weight_params(self, view.detach(), spec)
            return floats.fake_quantize_float(view, spec, scale=s, gscale=g, clip_grad=wq.clip_grad)
        if wq.range_learning:
            scale, zp = (
                learned if learned is not None else (self.weight_scale, self._parameters.get("weight_zero_point"))
            )
            zp = zp if spec.kind == "int" else None
            n = view.numel() // max(1, scale.numel())
            return fake_quantize_learned(view, spec, scale, zp, grad_scale=lsq_grad_scale(n, spec))
        params = ranges.weight_params(self, view.detach(), spec)
        if params is not None:
            return fake_quantize_spec(view, spec, clip_grad=wq.clip_grad, scale=params[0], zero_point=params[1])
        return fake_quantize_spec(view, spec, clip_grad=wq.clip_grad)

    def effective_bias(self):
        b = getattr(self, "bias", None)
        if b is not None and self.qc_pruning:
            from ..pruning.masks import apply_bias_masks

            b = apply_bias_masks(self, b)
        return b

    # --- activations --------------------------------------------------------------------------
    def input_spec(self):
        """The activation quantizer's Spec: per tensor (static), per sample (convs) or per token."""
        aq = self.qc_aq
        if aq.format != "int":  # quant/floats.py
            gran = (
                "group"
                if aq.group_size or aq.format != "fp8_e4m3"
                else ("tensor" if aq.calibration == "static" else "token")
            )
            return floats.float_spec(aq.format, gran, aq.group_size)
        if aq.calibration == "static":
            return make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")
        return make_spec(aq.bits, symmetric=aq.symmetric, granularity="channel" if aq.per == "sample" else "token")

    def input_observer(self):
        """The StaticRange x's static range lives in (fused experts: the routed expert's)."""
        return self.qc_aq.observer

    def static_input_range(self, x: torch.Tensor, spec):
        """(lo, hi) a static activation range quantizes x with now; training updates the observer."""
        aq = self.qc_aq
        obs = self.input_observer()
        if self.training and obs.initialized and _recomputing():
            # activation checkpointing re-runs forward inside backward: quantize with the range
            # the original forward used (recorded per checkpointed call: later micro-batches may
            # have moved the EMA since), and fold the batch into the EMA only once
            return recompute_ranges.replay(self) or (obs.min, obs.max)
        if self.training:
            if aq.range_observer == "minmax":
                return recompute_ranges.record(self, obs.observe(x))
            from ..quant.observers import Search, activation_range

            choose = float_observers.activation_range if floats.is_float(spec) else activation_range
            return recompute_ranges.record(
                self, obs.update(*choose(x, spec, aq.range_observer, Search(*aq.range_search)))
            )
        if obs.initialized:
            return obs.min, obs.max
        _warn_uncalibrated(self.qc_name)
        return x.detach().amin().float(), x.detach().amax().float()

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        aq = self.qc_aq
        if aq is None or not aq.active or not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            return x
        try:
            return self._quantize_input_of(x)
        except NonFiniteError as err:
            raise located(self, "input", err) from None

    def _quantize_input_of(self, x: torch.Tensor) -> torch.Tensor:
        aq = self.qc_aq
        spec = self.input_spec()
        if sharded.is_dtensor(x):  # tensor parallel: ranges of the whole input
            return sharded.quantize_input(self, x, spec, aq, self.training, _recomputing())
        if floats.is_float(spec):  # static: the range sets FP8's scale, NVFP4's global scale
            rng = self.static_input_range(x, spec) if aq.calibration == "static" else None
            return floats.fake_quantize_float(x, spec, static_range=rng)
        if aq.calibration == "static":
            if aq.range_learning and aq.learned_ready:
                per_sample = x.numel() // max(1, x.shape[0]) if x.dim() > 1 else x.numel()
                return fake_quantize_learned(
                    x,
                    spec,
                    self.input_scale,
                    self._parameters.get("input_zero_point"),
                    grad_scale=lsq_grad_scale(per_sample, spec),
                )
            lo, hi = self.static_input_range(x, spec)
            y = fake_quantize_spec(x, spec, min_val=lo, max_val=hi)
            return ranges.attach_unused(y, self, ranges.INPUT_PARAMS) if aq.range_learning else y
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


def located(mod, what: str, err: NonFiniteError) -> NonFiniteError:
    """The quantizer's NonFiniteError naming the module and tensor it came from (a diverged
    training run says where the NaN or Inf first reached a quantizer)."""
    return mod.qc_located(what, err)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpoint recompute
    (reentrant or not; torch's checkpoint asks the same question this way)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


_warned_uncalibrated = set()


def _warn_uncalibrated(name):
    if name not in _warned_uncalibrated:
        _warned_uncalibrated.add(name)
        warnings.warn(
            f"{name}: static activation range used in eval before any training batch "
            "calibrated it; falling back to this batch's own range",
            stacklevel=4,
        )


# The fast forwards keep the library classes' argument names (`input`; transformers' Conv1D `x`),
# so a call by keyword (`linear(input=x)`) works as it did before the rewrite.
class _LinearForward(CompressMixin):
    qc_kind = "linear"

    def forward(self, input):
        plan = fused.plan(self, input, "linear")
        if plan is not None:
            return fused.run(plan, input)
        return F.linear(self.quantize_input(input), self.effective_weight(), self.effective_bias())


class _ConvForward(CompressMixin):
    qc_kind = "conv"

    def forward(self, input):
        plan = fused.plan(self, input, "conv")
        if plan is not None:
            return fused.run(plan, input)
        return self._conv_forward(self.quantize_input(input), self.effective_weight(), self.effective_bias())


class _EmbeddingForward(CompressMixin):
    qc_kind = "embedding"

    def forward(self, input):
        if self.max_norm is not None:
            # F.embedding renormalizes the looked-up rows of the weight it is given in place: do
            # that to the Parameter, as the library class does (the fake-quantized copy is an
            # autograd view that cannot be changed in place), then quantize the renormed weight
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, input.contiguous(), self.max_norm, self.norm_type)
        return F.embedding(
            input, self.effective_weight(), self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


class _BatchNormForward(CompressMixin):
    qc_kind = "batchnorm"  # passive side of channel pruning only

    def forward(self, input):
        return super().forward(input)


class _HFConv1DForward(CompressMixin):
    qc_kind = "hf_conv1d"

    def forward(self, x):
        plan = fused.plan(self, x, "hf_conv1d")
        if plan is not None:
            return fused.run(plan, x)
        size_out = x.size()[:-1] + (self.nf,)
        x = self.quantize_input(x)
        x = torch.addmm(self.effective_bias(), x.reshape(-1, x.size(-1)), self.effective_weight())
        return x.view(size_out)


_FORWARDS: Dict[str, Type[CompressMixin]] = {
    "linear": _LinearForward,
    "conv": _ConvForward,
    "embedding": _EmbeddingForward,
    "batchnorm": _BatchNormForward,
    "hf_conv1d": _HFConv1DForward,
}


class _ComposedForward(CompressMixin):
    """For classes with their own forward: run it as written, with the effective tensors in place.

    The effective weight and bias are put into `_parameters` for the call only, the way
    torch.func.functional_call swaps tensors in, so every `self.weight` / `self.bias` the forward
    (or a method it calls, e.g. `super().forward`) reads is the compressed one; the Parameters are
    back before the call returns, so parameter identity and state_dict are untouched.
    """

    def forward(self, *args, **kwargs):
        if args:
            args = (self.quantize_input(args[0]),) + args[1:]
        elif kwargs and self.qc_aq is not None:
            key = forward_input_name(base_class(type(self)))
            if key in kwargs:
                kwargs = {**kwargs, key: self.quantize_input(kwargs[key])}
        params = self._parameters
        w, b = params["weight"], params.get("bias")
        ew, eb = self.effective_weight(), self.effective_bias()
        wq = self.qc_wq
        # the weight is compressed now (in forward, or written in by the optimizer-step mode)
        watch = ew is not w or (wq is not None and wq.active)
        if not watch and eb is b:  # nothing acts on the tensors (e.g. before the offset)
            return super().forward(*args, **kwargs)
        seen = self.__dict__
        seen["_qc_weight_read"] = False
        params["weight"] = ew
        if b is not None:
            params["bias"] = eb
        try:
            out = super().forward(*args, **kwargs)
        finally:
            params["weight"] = w
            if b is not None:
                params["bias"] = b
        if watch and not seen["_qc_weight_read"]:
            _warn_unread(self)
        return out

    def __getattr__(self, name):
        # nn.Module resolves parameters here: note that forward asked for the weight
        if name == "weight":
            self.__dict__["_qc_weight_read"] = True
        return super().__getattr__(name)


_INPUT_NAMES: Dict[type, Optional[str]] = {}


def forward_input_name(cls: type) -> Optional[str]:
    """Name of the first argument of `cls.forward` (for an input passed by keyword)."""
    if cls not in _INPUT_NAMES:
        try:
            names = list(inspect.signature(cls.forward).parameters)[1:2]
        except (TypeError, ValueError):
            names = []
        _INPUT_NAMES[cls] = names[0] if names else None
    return _INPUT_NAMES[cls]


_warned_unread = set()


def _warn_unread(mod) -> None:
    cls = base_class(type(mod))
    if cls not in _warned_unread:
        _warned_unread.add(cls)
        warnings.warn(
            f"{mod.qc_name}: {cls.__module__}.{cls.__qualname__}.forward ran without reading "
            "self.weight, so the compressed weight was not used (does it read a copy of the "
            "weight, or does another module use it?); its outputs are not those of the "
            "compressed model",
            stacklevel=3,
        )


def library_class(cls: type) -> Optional[type]:
    """The torch (or transformers Conv1D) class whose forward the fast path reproduces."""
    for c in cls.__mro__:
        if c in (nn.Linear, nn.Embedding, nn.BatchNorm2d) + _CONVS:
            return c
        if c.__name__ == "Conv1D" and "transformers" in c.__module__:
            return c
    return None


def own_forward(cls: type) -> Optional[str]:
    """The forward method `cls` defines over its library class ('forward', '_conv_forward'), or
    None when it inherits them unchanged (and the fast path computes the same thing)."""
    lib = library_class(cls)
    for meth in ("forward", "_conv_forward"):
        mine, theirs = getattr(cls, meth, None), getattr(lib, meth, None)
        if theirs is not None and mine is not theirs:
            return meth
    return None


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """Why this weight layer cannot be made compress-aware; None when it can (or is no weight layer)."""
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return (
            "transposed convolutions are not supported (their weight is [in, out/groups, ...]: "
            "per-channel scales and channel pruning would act on input channels)"
        )
    if isinstance(module, CompressMixin) or kind_of(module) in (None, "batchnorm"):
        return None
    if parametrize.is_parametrized(module):
        return (
            "its tensors are computed by torch.nn.utils.parametrize (weight_norm, spectral_norm, "
            "...), so no Parameter named weight exists to compress; remove the parametrization "
            "(parametrize.remove_parametrizations) first"
        )
    if inspect.getattr_static(type(module), "weight", None) is not None:
        return "its class defines `weight` itself (a property or class attribute), which hides the Parameter"
    w = module._parameters.get("weight")
    if not isinstance(w, nn.Parameter):
        return (
            "its weight is not a registered Parameter (computed outside the parameters, e.g. by "
            "the deprecated torch.nn.utils.weight_norm's forward pre-hook)"
        )
    if isinstance(w, nn.parameter.UninitializedParameter):
        return "it is a lazy module whose weight is not materialized yet (run one forward first)"
    return None


def compress_class(cls: type, kind: str) -> type:
    """The compress-aware subclass of `cls` (created once per class): the fast forward when `cls`
    inherits its library class's forward, the composed one when it has its own."""
    if cls not in _CLASS_CACHE:
        fast = kind == "batchnorm" or own_forward(cls) is None  # BatchNorm's already defers to super()
        mixin = _FORWARDS[kind] if fast else _ComposedForward
        _CLASS_CACHE[cls] = type(f"Compress{cls.__name__}", (mixin, cls), {"__module__": __name__, "qc_kind": kind})
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
    reason = unsupported_reason(module)
    if reason:
        raise TypeError(f"{name}: {type(module).__name__} cannot be compressed: {reason}")
    base = type(module)
    module.__class__ = compress_class(base, kind)
    module._qc_setup(name)
    _rebind_saved_forward(module, base, type(module), name)
    return module


def _rebind_saved_forward(module: nn.Module, old_cls: type, new_cls: type, name: Optional[str]) -> None:
    """A forward set on the instance outlives the class swap and would run the old class's forward
    (no compression). accelerate's hooks (device_map, offloading) keep that forward bound in
    `_old_forward` and call it from the instance's `forward`: re-bind it to the new class. Any
    other instance forward is reported (warned once per module), as it may bypass compression."""
    d = module.__dict__
    if "forward" not in d and "_old_forward" not in d:
        return
    saved = d.get("_old_forward")
    if isinstance(saved, types.MethodType) and saved.__self__ is module and saved.__func__ is old_cls.forward:
        d["_old_forward"] = types.MethodType(new_cls.forward, module)
        return
    if name is not None:
        warnings.warn(
            f"{name}: its forward was replaced on the instance (module.forward = ...); that "
            "function runs instead of the compress-aware forward, so this module's outputs "
            "are not compressed unless it calls type(module).forward. Set such hooks after "
            "init_compression, or use register_forward_hook / register_forward_pre_hook",
            stacklevel=4,
        )


def restore_class(module: nn.Module) -> nn.Module:
    """Undo make_compress_aware (used after redundancy_clean when nothing is left to apply)."""
    if isinstance(module, CompressMixin):
        base = base_class(type(module))
        for attr in ("qc_name", "qc_wq", "qc_aq", "qc_pruning", "qc_lora", "_qc_weight_read"):
            module.__dict__.pop(attr, None)
        cls = type(module)
        module.__class__ = base
        _rebind_saved_forward(module, cls, base, None)
    return module
