"""The loaded quantized module classes, and the registry that export/fast and fuse.py add theirs to.

load_quantized swaps a subclass into each quantized module (so isinstance checks hold): its float
`weight` parameter is replaced by buffers with the exported names (weight_packed / weight,
weight_scale, ...), and `weight` becomes a property that dequantizes them on every access. Static
activation quantization uses the stored input_scale.

The registry holds what the reader must know of classes defined elsewhere, so that no module here
imports the modules that build on it: the forward mixin of each module kind, the class families
(fast, fused) that pickles rebuild, and the load modes beyond "exact". export/fast and fuse.py register
theirs when imported; qcompress/export/__init__.py imports both, so every entry is in place before
any of its modules is used.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from ..quant.api import fake_quantize_spec
from ..quant.packing import unpack_int32
from ..quant.reference import Spec, make_spec
from . import layout
from .codes import dequantize_2d, static_act_fake_quant
from .floats import FLOAT_FORMATS, dequantize as dequantize_floats, fake_quantize_input as fake_quantize_floats
from .floats import gather_rows as gather_float_rows


def _local(suffix: str) -> str:
    # int8 codes are the file's `weight`; in memory they are `qweight`, so that `weight` can
    # stay a property returning the dequantized float weight
    return "qweight" if suffix == "weight" else suffix


class QuantizedMixin:
    """Shared part of every loaded quantized module."""

    qx_kind = "linear"

    def _qx_setup(self, name: str, rec: dict):
        self.qx_name = name
        self.qx_rec = rec
        w = rec.get("weights")
        self.qx_dtype = getattr(torch, rec.get("dtype") or "float32")
        if w is not None:
            self.__dict__.pop("weight", None)
            del self._parameters["weight"]
        for suffix, (dt, shape) in layout.expected_tensors(rec).items():
            self.register_buffer(_local(suffix), torch.zeros(shape, dtype=getattr(torch, dt)))

    def __reduce_ex__(self, protocol):
        # the class was made at load time (mixins over the model's own class), so pickle cannot
        # name it: it names the model's class and the mixins instead (torch.save(model), spawn)
        state = dict(self.__getstate__())
        state.pop("qx_direct", None)  # an operator handle: fast.FastMixin.__setstate__ remakes it
        # the state goes to _rebuild, not to pickle's BUILD: torch.load(weights_only=True) then needs
        # only _rebuild and the named classes allowlisted, not the load-time class itself
        return _rebuild, (*class_parts(type(self)), state)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "qweight" in destination:  # back to the file's name
            destination[prefix + "weight"] = destination.pop(prefix + "qweight")

    @property
    def weight(self):
        rec = self.qx_rec
        if rec.get("weights") is None:
            return self._parameters["weight"]
        return dequantize_record(rec, self._buffers)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half(): the scales (this module's float buffers) keep their dtype,
        # since casting them would change the exported weights; the dequantized weight follows the
        # model's new dtype instead, as when the export is loaded into a model of that dtype
        floats = {k: b for k, b in self._buffers.items() if b is not None and b.is_floating_point()}
        out = super()._apply(fn, recurse)
        for k, old in floats.items():
            new = self._buffers.get(k)
            if new is not None and new.dtype != old.dtype:
                self._buffers[k] = old.to(new.device)
        if self.qx_rec.get("weights") is not None:
            probe = fn(torch.empty(0, dtype=self.qx_dtype))
            if probe.is_floating_point() and probe.dtype != self.qx_dtype:
                self.qx_dtype = probe.dtype
                self.qx_rec = dict(self.qx_rec, dtype=str(probe.dtype).replace("torch.", ""))
        return out

    def _qx_input(self, x):
        act = self.qx_rec.get("input_activations")
        if act is None or not torch.is_floating_point(x):
            return x
        if act.get("type") == "float":
            return fake_quantize_floats(self, x, act)
        if not act["dynamic"]:
            return static_act_fake_quant(x, act["num_bits"], self.input_scale, getattr(self, "input_zero_point", None))
        gran = "channel" if act["strategy"] == "sample" else "token"
        return fake_quantize_spec(x, make_spec(act["num_bits"], symmetric=act["symmetric"], granularity=gran))

    def extra_repr(self):
        w = self.qx_rec.get("weights")
        desc = (
            "dense"
            if w is None
            else (
                f"{self.qx_rec['qtype']} {w['num_bits']}b {w['strategy']}"
                + (f"{w['group_size']}" if w["group_size"] else "")
            )
        )
        return super().extra_repr() + f", qx: {self.qx_rec['format']} {desc}"


def _unpack_rows(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Signed codes [rows, k] from int32 words packed along dim 1 (int32 math: runs every forward)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask
    return u.reshape(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))


def dequantize_record(rec: dict, buf) -> torch.Tensor:
    """The float weight (state_dict orientation and dtype) of one exported module."""
    if rec["format"] in FLOAT_FORMATS:
        out = dequantize_floats(rec, buf, getattr(torch, rec["dtype"]))
        return out.t().contiguous() if rec.get("transposed") else out
    w = rec["weights"]
    shape = rec["weight_shape"]
    rows = shape[0]
    k = math.prod(shape[1:]) if len(shape) > 1 else 1
    bits = w["num_bits"]
    if rec["format"] == "pack-quantized":
        q = _unpack_rows(buf["weight_packed"], bits, k)
    else:
        q = buf["qweight"].reshape(rows, k)
    zp = buf.get("weight_zero_point")
    if zp is not None and rec["format"] == "pack-quantized" and w["strategy"] != "tensor":
        zp = unpack_int32(zp, bits, rows, dim=0)
    gs = w["group_size"] if w["strategy"] == "group" else None
    out = dequantize_2d(q, buf["weight_scale"], zp, gs, getattr(torch, rec["dtype"]))
    out = out.reshape(shape)
    # transformers' Conv1D layout, contiguous as training and baking leave it (bf16 GEMMs differ by layout)
    return out.t().contiguous() if rec.get("transposed") else out


class _QLinear(QuantizedMixin):
    def forward(self, x):
        return F.linear(self._qx_input(x), self.weight, self.bias)


class _QConv(QuantizedMixin):
    def forward(self, x):
        return self._conv_forward(self._qx_input(x), self.weight, self.bias)


def gather_refusal(rec: dict) -> str:
    """Why gather_rows cannot serve this embedding ("" when it can)."""
    w = rec["weights"]
    if rec.get("transposed") or len(rec["weight_shape"]) != 2:
        return "embedding stored transposed or not 2-D"
    if rec["format"] == "pack-quantized" and w["strategy"] != "tensor" and not w["symmetric"]:
        return "asymmetric packed zero points (packed across rows: no per-row gather)"
    return ""


def gather_rows(rec: dict, buf, ids: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, dequantize_record(rec, buf)) from the looked-up rows' codes only: the same
    ops per row, so the same values bit for bit. Dequantizing the whole table per call costs time
    in proportion to the vocabulary (30522 x 384 for all-MiniLM-L6-v2) on every forward."""
    if rec["format"] in FLOAT_FORMATS:  # E2M1 / e4m3 codes under float, e4m3 or E8M0 scales
        return gather_float_rows(rec, buf, ids, getattr(torch, rec["dtype"]))
    w = rec["weights"]
    k = rec["weight_shape"][1]
    idx = ids.reshape(-1)
    if rec["format"] == "pack-quantized":
        q = _unpack_rows(buf["weight_packed"].index_select(0, idx), w["num_bits"], k)
    else:
        q = buf["qweight"].reshape(-1, k).index_select(0, idx)
    scale, zp = buf["weight_scale"], buf.get("weight_zero_point")
    if w["strategy"] != "tensor":
        scale = scale.index_select(0, idx)
        zp = None if zp is None else zp.index_select(0, idx)
    gs = w["group_size"] if w["strategy"] == "group" else None
    return dequantize_2d(q, scale, zp, gs, getattr(torch, rec["dtype"])).reshape(*ids.shape, k)


class _QEmbedding(QuantizedMixin):
    def forward(self, x):
        rec = self.qx_rec
        if (
            rec.get("weights") is not None
            and self.max_norm is None
            and not x.is_floating_point()
            and not gather_refusal(rec)
        ):
            return gather_rows(rec, self._buffers, x)
        # max_norm renormalizes looked-up rows of the table in place: the whole table then
        return F.embedding(
            x, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


class _QHFConv1D(QuantizedMixin):
    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = self._qx_input(x)
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(size_out)


class _QComposed(QuantizedMixin):
    """A class with its own forward (see nn/layers.py): it runs as written on the dequantized
    `weight`, after the input quantization, as in training."""

    def forward(self, *args, **kwargs):
        from ..nn.layers import forward_input_name

        if args and isinstance(args[0], torch.Tensor):
            args = (self._qx_input(args[0]),) + args[1:]
        elif not args:
            own = next(c for c in type(self).__mro__ if not issubclass(c, QuantizedMixin))
            key = forward_input_name(own)
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs = {**kwargs, key: self._qx_input(kwargs[key])}
        return super().forward(*args, **kwargs)


_CACHE: Dict[type, type] = {}


def quantized_class(cls: type, mixin: type) -> type:
    """The loaded-module class of `cls` with its forward `mixin` (one per model class)."""
    if cls not in _CACHE:
        _CACHE[cls] = type(f"Quantized{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CACHE[cls]


def swap(module, kind: str, name: str, rec: dict):
    """Make `module` the loaded module of manifest record `rec` (its buffers still zeros)."""
    from ..nn.layers import own_forward

    cls = type(module)
    mixin = FORWARDS[kind] if own_forward(cls) is None else _QComposed
    module.__class__ = quantized_class(cls, mixin)
    module._qx_setup(name, rec)


def class_parts(cls: type) -> tuple:
    """(the model's own class, the mixins over it, innermost first) of a loaded-module class."""
    mixins = []
    while (cls.__module__ == __name__ or cls.__module__ in _FAMILIES) and len(cls.__bases__) == 2:
        mixin, cls = cls.__bases__
        mixins.append(mixin)
    return cls, tuple(reversed(mixins))


def pickle_globals() -> list:
    """What a pickled load_quantized model names from qcompress, for torch.load(weights_only=True):
    `with torch.serialization.safe_globals(pickle_globals() + [the model's own classes]): ...`."""
    return [_rebuild, _QComposed, *_PICKLED, Spec]


def _rebuild(cls: type, mixins: tuple, state: dict):
    """The instance of the class class_parts described, with `state`."""
    for mixin in mixins:
        cls = _FAMILIES.get(mixin.__module__, quantized_class)(cls, mixin)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


# --- the registry ---------------------------------------------------------------------------------

FORWARDS: Dict[str, type] = {}  # manifest kind -> the forward mixin of its modules
_FAMILIES: Dict[str, Callable[[type, type], type]] = {}  # a mixin's module -> its class factory
_PICKLED: List[type] = []  # mixins a pickled model may name
_LOAD_STEPS: Dict[str, List[Callable]] = {"exact": []}


def register_kind(kind: str, mixin: type) -> None:
    """Modules of manifest kind `kind` load as `mixin` over their own class (mixin: a QuantizedMixin)."""
    FORWARDS[kind] = mixin
    _PICKLED.append(mixin)


def register_family(module_name: str, factory: Callable[[type, type], type], mixins) -> None:
    """Classes made by `factory(base, mixin)` for the mixins defined in module `module_name`
    (fast.fast_class, fuse.fused_class): pickles name the base and the mixin, and are rebuilt here."""
    _FAMILIES[module_name] = factory
    _PICKLED.extend(mixins)


def register_load_step(mode: str, step: Callable) -> None:
    """load_quantized(mode=`mode`) runs `step(root, modules, options)` after the exact load, in
    registration order (options: load_quantized's keyword options, e.g. fuse_activations)."""
    _LOAD_STEPS.setdefault(mode, []).append(step)


def load_steps(mode: str) -> List[Callable]:
    if mode not in _LOAD_STEPS:
        raise ValueError(f"load_quantized: mode must be one of {sorted(_LOAD_STEPS)}, got {mode!r}")
    return _LOAD_STEPS[mode]


for _kind, _mixin in (("linear", _QLinear), ("conv", _QConv), ("embedding", _QEmbedding), ("hf_conv1d", _QHFConv1D)):
    register_kind(_kind, _mixin)
del _kind, _mixin
