"""load_quantized: rebuild a model from an export, holding the integers and dequantizing in forward.

Each quantized module keeps its class (a subclass is swapped in, as for training, so isinstance
checks hold); its float `weight` parameter is replaced by buffers with the exported names
(weight_packed / weight, weight_scale, ...), and `weight` becomes a property that dequantizes
them on every access. Static activation quantization uses the stored input_scale.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant.api import fake_quantize_spec
from ..quant.packing import unpack_int32
from ..quant.reference import make_spec
from . import layout
from . import safetensors_io as sio
from .codes import dequantize_2d, static_act_fake_quant
from .errors import CheckpointError
from ..unwrap import unwrap



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
        state.pop("qx_direct", None)          # an operator handle: fast.FastMixin.__setstate__ remakes it
        # the state goes to _rebuild, not to pickle's BUILD: torch.load(weights_only=True) then needs
        # only _rebuild and the named classes allowlisted, not the load-time class itself
        return _rebuild, (*class_parts(type(self)), state)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "qweight" in destination:     # back to the file's name
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
        if not act["dynamic"]:
            return static_act_fake_quant(x, act["num_bits"], self.input_scale,
                                         getattr(self, "input_zero_point", None))
        gran = "channel" if act["strategy"] == "sample" else "token"
        return fake_quantize_spec(x, make_spec(act["num_bits"], symmetric=act["symmetric"],
                                               granularity=gran))

    def extra_repr(self):
        w = self.qx_rec.get("weights")
        desc = "dense" if w is None else (f"{self.qx_rec['qtype']} {w['num_bits']}b {w['strategy']}"
                                          + (f"{w['group_size']}" if w["group_size"] else ""))
        return super().extra_repr() + f", qx: {self.qx_rec['format']} {desc}"


def _unpack_rows(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Signed codes [rows, k] from int32 words packed along dim 1 (int32 math: runs every forward)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # arithmetic shift, then mask
    return u.reshape(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))


def dequantize_record(rec: dict, buf) -> torch.Tensor:
    """The float weight (state_dict orientation and dtype) of one exported module."""
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
    ops per row, so the same values bit for bit. Dequantizing the whole table per call cost
    all-MiniLM-L6-v2's W4 word embedding (30522 x 384) 17.7 ms per forward (benchmarks/RESULTS.md)."""
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
        if (rec.get("weights") is not None and self.max_norm is None and not x.is_floating_point()
                and not gather_refusal(rec)):
            return gather_rows(rec, self._buffers, x)
        # max_norm renormalizes looked-up rows of the table in place: the whole table then
        return F.embedding(x, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


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


_FORWARDS = {"linear": _QLinear, "conv": _QConv, "embedding": _QEmbedding, "hf_conv1d": _QHFConv1D}
_CACHE: Dict[type, type] = {}


def quantized_class(cls: type, mixin: type) -> type:
    """The loaded-module class of `cls` with its forward `mixin` (one per model class)."""
    if cls not in _CACHE:
        _CACHE[cls] = type(f"Quantized{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CACHE[cls]


def _swap(module: nn.Module, kind: str, name: str, rec: dict):
    from ..nn.layers import own_forward
    cls = type(module)
    mixin = _FORWARDS[kind] if own_forward(cls) is None else _QComposed
    module.__class__ = quantized_class(cls, mixin)
    module._qx_setup(name, rec)


def class_parts(cls: type) -> tuple:
    """(the model's own class, the mixins over it, innermost first) of a loaded-module class."""
    mixins = []
    here = __name__.rsplit(".", 1)[0]
    while cls.__module__ in (__name__, here + ".fast", here + ".fuse") and len(cls.__bases__) == 2:
        mixin, cls = cls.__bases__
        mixins.append(mixin)
    return cls, tuple(reversed(mixins))


def pickle_globals() -> list:
    """What a pickled load_quantized model names from qcompress, for torch.load(weights_only=True):
    `with torch.serialization.safe_globals(pickle_globals() + [the model's own classes]): ...`."""
    from . import fast, fuse
    from ..quant.reference import Spec
    return [_rebuild, _QComposed, *_FORWARDS.values(), fast.FastMixin, fast.FastLinearMixin,
            fast.FastConv1DMixin, fuse.FusedActMixin, fuse.FusedResidualMixin, fuse.FusedSequentialMixin, Spec]


def _rebuild(cls: type, mixins: tuple, state: dict):
    """The instance of the class class_parts described, with `state`."""
    from . import fast, fuse
    for mixin in mixins:
        if mixin.__module__ == fast.__name__:
            cls = fast.fast_class(cls, mixin)
        elif mixin.__module__ == fuse.__name__:
            cls = fuse.fused_class(cls, mixin)
        else:
            cls = quantized_class(cls, mixin)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _check_kind(module, kind, name, cfg_path):
    from ..nn.layers import kind_of
    if kind_of(module) != kind:
        raise CheckpointError(f"{cfg_path}: module {name!r} is a {kind} in the checkpoint but a "
                              f"{type(module).__name__} in the given model")


_FORMATS = ("dense", "pack-quantized", "int-quantized")
_ACT_STRATEGIES = ("tensor", "token", "sample")
_W_STRATEGIES = ("tensor", "channel", "group")
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                   "input_scale", "input_zero_point")


def _int_in(x, lo, hi=None) -> bool:
    return type(x) is int and x >= lo and (hi is None or x <= hi)


def _act_problem(a) -> str:
    if not isinstance(a, dict):
        return f"input_activations is {a!r}, not an object or null"
    if not _int_in(a.get("num_bits"), 1, 8):
        return f"input_activations.num_bits={a.get('num_bits')!r} (expected an integer 1-8)"
    for key in ("symmetric", "dynamic"):
        if not isinstance(a.get(key), bool):
            return f"input_activations.{key}={a.get(key)!r} (expected true or false)"
    if a.get("strategy") not in _ACT_STRATEGIES or (not a["dynamic"] and a["strategy"] != "tensor"):
        return (f"input_activations.strategy={a.get('strategy')!r} (expected 'tensor' when static, "
                "'token' or 'sample' when dynamic)")
    return ""


def _weights_problem(rec) -> str:
    w = rec["weights"]
    if not isinstance(w, dict):
        return f"weights is {w!r}, not an object or null"
    bits = w.get("num_bits")
    packed = rec["format"] == "pack-quantized"
    if not _int_in(bits, 1, 8) or (packed and 32 % bits):
        return (f"weights.num_bits={bits!r} (expected an integer "
                + ("1, 2, 4 or 8 for pack-quantized)" if packed else "1-8)"))
    if not isinstance(w.get("symmetric"), bool):
        return f"weights.symmetric={w.get('symmetric')!r} (expected true or false)"
    if w.get("strategy") not in _W_STRATEGIES:
        return f"weights.strategy={w.get('strategy')!r} (expected one of {list(_W_STRATEGIES)})"
    if w["strategy"] == "group" and not _int_in(w.get("group_size"), 1):
        return f"weights.group_size={w.get('group_size')!r} (strategy 'group' needs a positive integer)"
    shape = rec.get("weight_shape")
    if not isinstance(shape, list) or not shape or not all(_int_in(d, 0) for d in shape):
        return f"weight_shape={shape!r} (expected a list of non-negative integers)"
    dt = getattr(torch, str(rec.get("dtype")), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return f"dtype={rec.get('dtype')!r} (expected a torch float dtype name, e.g. 'float32')"
    if rec.get("qtype") not in ("int", "binary", "ternary"):
        return f"qtype={rec.get('qtype')!r} (expected 'int', 'binary' or 'ternary')"
    # a square Conv1D would pass every shape check with the flag wrong, and load transposed weights
    if rec.get("transposed", False) is not (rec["kind"] == "hf_conv1d"):
        return (f"transposed={rec.get('transposed')!r} does not fit kind {rec['kind']!r} (exactly the "
                "transformers Conv1D weights are stored transposed)")
    return ""


def _record_problem(rec) -> str:
    """What is malformed in one manifest record ("" if nothing), checked before any math on it."""
    if not isinstance(rec, dict):
        return f"{rec!r} is not an object"
    for key in ("kind", "format", "weights", "input_activations"):
        if key not in rec:
            return f"no {key!r} key"
    if rec["kind"] not in _FORWARDS:
        return f"kind={rec['kind']!r} (expected one of {sorted(_FORWARDS)})"
    if rec["format"] not in _FORMATS:
        return f"format={rec['format']!r} (expected one of {list(_FORMATS)})"
    if (rec["weights"] is None) != (rec["format"] == "dense"):
        return f"format {rec['format']!r} does not fit weights={rec['weights']!r}"
    act = rec["input_activations"]
    if act is not None and (problem := _act_problem(act)):
        return problem
    if rec["weights"] is None:
        return "" if act is not None else "quantizes neither weights nor inputs"
    return _weights_problem(rec)


def check_manifest(modules, cfg_path: str):
    """The qcompress manifest must be well formed: CheckpointError naming config.json and module."""
    if not isinstance(modules, dict):
        raise CheckpointError(f"{cfg_path}: qcompress.modules is {type(modules).__name__}, not an object")
    for name, rec in modules.items():
        problem = _record_problem(rec) or _tie_problem(name, rec, modules)
        if problem:
            raise CheckpointError(f"{cfg_path}: qcompress manifest entry of module {name!r}: {problem}")


def _tie_problem(name, rec, modules) -> str:
    """A `tied_to` record (tied weights stored once) must name another stored module whose weight
    record is the same."""
    to = rec.get("tied_to")
    if to is None:
        return ""
    src = modules.get(to) if isinstance(to, str) and to != name else None
    if not isinstance(src, dict) or src.get("tied_to") is not None or rec["weights"] is None:
        return f"tied_to={to!r} does not name another module of this export that stores its weight"
    if (rec["format"], rec["weights"], rec.get("weight_shape")) != (src.get("format"), src.get("weights"),
                                                                     src.get("weight_shape")):
        return f"tied_to={to!r}, but the two modules' weight records differ"
    return ""


def resolve_ties(tensors, where, modules) -> None:
    """Modules stored `tied_to` another read its weight tensors (the same codes and scales)."""
    for name, rec in modules.items():
        to = rec.get("tied_to")
        if to is None:
            continue
        for suffix in layout.expected_tensors({**rec, "input_activations": None}):
            key, src = f"{name}.{suffix}", f"{to}.{suffix}"
            if key in tensors:
                raise CheckpointError(f"{where[key]}: tensor {key!r} is stored although config.json says "
                                      f"{name!r} is tied_to {to!r}")
            if src in tensors:
                tensors[key], where[key] = tensors[src], where[src]


def _targeted(patterns, name: str, cfg_path: str) -> bool:
    """compressed-tensors' matching of `targets` / `ignore` entries against a module name."""
    try:
        return any(isinstance(t, str) and (t.startswith("re:") and re.match(t[3:], name) or t == name)
                   for t in patterns or ())
    except re.error as e:
        raise CheckpointError(f"{cfg_path}: quantization_config has an invalid regex ({e})") from None


def _describe(args) -> str:
    if not isinstance(args, dict):
        return repr(args) if args is not None else "null"
    how = "dynamic" if args.get("dynamic") else "static"
    return f"{args.get('num_bits')}-bit {args.get('strategy')} {how}"


def _check_args(got, want: dict, keys, what: str, gname: str, name: str, cfg_path: str):
    if want is None or not isinstance(got, dict):
        if got != want:
            raise CheckpointError(f"{cfg_path}: config group {gname!r} says {what}="
                                  f"{_describe(got)} for {name!r}, the qcompress manifest (and the "
                                  f"tensors) say {_describe(want)}")
        return
    for key in keys:
        if got.get(key) != want.get(key):
            raise CheckpointError(f"{cfg_path}: config group {gname!r} says {what}.{key}="
                                  f"{got.get(key)!r} for {name!r}, the qcompress manifest says "
                                  f"{want.get(key)!r}")


def _check_against_quant_config(qc: dict, modules: dict, cfg_path: str):
    """quantization_config (what transformers / vLLM follow) must say what the manifest says.

    The manifest is what the tensors are checked against, so any disagreement means other
    loaders would read the same integers differently: status, ignore, format and the weight and
    input-activation args of every portable module's config group are compared.
    """
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config is {type(qc).__name__}, not an object")
    status = qc.get("quantization_status")
    if status != "compressed":
        raise CheckpointError(f"{cfg_path}: quantization_config.quantization_status is {status!r}, "
                              "but the tensors are compressed integers (expected 'compressed')")
    groups = qc.get("config_groups") or {}
    groups = groups if isinstance(groups, dict) else {}
    for name, rec in modules.items():
        if not layout.portable(rec):
            continue
        if _targeted(qc.get("ignore"), name, cfg_path):
            raise CheckpointError(f"{cfg_path}: quantization_config.ignore lists {name!r}, but the "
                                  f"checkpoint stores it quantized ({rec['format']})")
        hits = [g for g, s in groups.items()
                if isinstance(s, dict) and _targeted(s.get("targets"), name, cfg_path)]
        if len(hits) != 1:
            raise CheckpointError(f"{cfg_path}: quantized Linear {name!r} is matched by "
                                  f"{len(hits)} quantization_config.config_groups (expected 1)")
        gname, scheme = hits[0], groups[hits[0]]
        # the group's format is what compressed-tensors uses; loaders older than its per-group
        # key read the top-level one, so that must agree too unless it says mixed-precision
        top = qc.get("format")
        fmt = scheme.get("format") or top
        if fmt == rec["format"] and top not in (None, "mixed-precision"):
            fmt = top
        if fmt != rec["format"]:
            raise CheckpointError(f"{cfg_path}: quantization_config gives {name!r} format {fmt!r} "
                                  f"(config group {gname!r}), but its tensors are {rec['format']}")
        _check_args(scheme.get("weights"), rec["weights"],
                    ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"),
                    "weights", gname, name, cfg_path)
        act = rec["input_activations"]
        _check_args(scheme.get("input_activations"), act and dict(act, type="int"),
                    ("num_bits", "type", "symmetric", "strategy", "dynamic"),
                    "input_activations", gname, name, cfg_path)


def read_config(folder: str):
    if os.path.exists(folder) and not os.path.isdir(folder):   # e.g. the path of model.safetensors
        raise CheckpointError(f"{folder}: not a folder; an export is the folder that holds config.json "
                              "and the safetensors files")
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
        qc = config["quantization_config"]
        modules = config["qcompress"]["modules"]
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: not a qcompress export config ({type(e).__name__}: {e})") from None
    check_manifest(modules, cfg_path)
    return cfg_path, config, qc, modules


def check_tensors(tensors, where, modules, cfg_path):
    for name, rec in modules.items():
        expected = layout.expected_tensors(rec)
        for suffix in _QUANT_SUFFIXES:        # e.g. an input_scale the record does not quantize with
            key = f"{name}.{suffix}"
            if key in tensors and suffix not in expected:
                raise CheckpointError(f"{cfg_path}: module {name!r} ({rec['format']}, input "
                                      f"{_describe(rec['input_activations'])}) has no use for "
                                      f"tensor {key!r} in {os.path.basename(where[key])}")
        for suffix, (dt, shape) in expected.items():
            key = f"{name}.{suffix}"
            if key not in tensors:
                raise CheckpointError(f"{cfg_path}: module {name!r} ({rec['format']}) needs tensor "
                                      f"{key!r}, which no checkpoint file holds")
            t = tensors[key]
            if str(t.dtype).replace("torch.", "") != dt or list(t.shape) != list(shape):
                raise CheckpointError(f"{where[key]}: tensor {key!r} is {t.dtype} {list(t.shape)}, "
                                      f"but config.json implies {dt} {shape}")
        w = rec.get("weights")
        if w is not None and rec["format"] == "int-quantized":
            q = tensors[f"{name}.weight"]
            lo, hi = -(1 << (w["num_bits"] - 1)), (1 << (w["num_bits"] - 1)) - 1
            if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
                raise CheckpointError(f"{where[f'{name}.weight']}: tensor {name + '.weight'!r} holds "
                                      f"values outside the {w['num_bits']}-bit range [{lo}, {hi}]")
        if w is not None and rec["format"] == "pack-quantized":
            ws = tensors[f"{name}.weight_shape"].tolist()
            if ws != list(rec["weight_shape"]):
                raise CheckpointError(f"{where[f'{name}.weight_shape']}: tensor {name + '.weight_shape'!r}"
                                      f" is {ws}, config.json says {rec['weight_shape']}")


def _check_unlisted(unexpected, modules, cfg_path):
    """Quantized tensors the model cannot take: their module is missing from the manifest."""
    for key in unexpected:
        mod, _, suffix = key.rpartition(".")
        if suffix in _QUANT_SUFFIXES and mod not in modules:
            raise CheckpointError(f"{cfg_path}: the qcompress manifest does not list module {mod!r}, "
                                  f"whose quantized tensor {key!r} the checkpoint holds")


def load_quantized(folder, model: nn.Module, *, mode: str = "exact", fuse_activations: bool = True) -> nn.Module:
    """Load an export into `model` (a fresh, uncompressed instance of the architecture), in place.

    mode="exact" dequantizes each weight in every forward (bit-exact outputs); mode="fast" runs
    integer-weight kernels where torch has them and a fused dequantization elsewhere (see
    qcompress/export/fast.py; outputs equal "exact" up to float summation order). With
    fuse_activations (mode="fast" only), a GELU / ReLU or a skip-connection add that provably only
    follows a low-bit layer (BERT's feed-forward and block outputs, GPT-2's MLP, nn.Sequential
    neighbours) runs in that layer's kernel call; only the parent module's forward changes
    (qcompress/export/fuse.py).
    Returns `model` in eval mode (dropout off), as transformers' from_pretrained does; call
    `.train()` to fine-tune it further.
    Raises CheckpointError (naming file and tensor) for truncated, corrupted or inconsistent
    checkpoints and for a model whose modules do not match the checkpoint.
    """
    if mode not in ("exact", "fast"):
        raise ValueError(f"load_quantized: mode must be 'exact' or 'fast', got {mode!r}")
    folder = os.fspath(folder)
    cfg_path, config, qc, modules = read_config(folder)
    _check_against_quant_config(qc, modules, cfg_path)
    unbound = []                  # files config.json does not bind: reported after content checks
    tensors, where, _ = sio.read_checkpoint(folder, problems=unbound)
    resolve_ties(tensors, where, modules)
    check_tensors(tensors, where, modules, cfg_path)
    if unbound:
        raise CheckpointError(unbound[0])
    root = unwrap(model)
    named = dict(root.named_modules())
    for name, rec in modules.items():
        if name not in named:
            arch = config.get("architectures")
            hint = ""
            if isinstance(arch, list) and arch and type(root).__name__ not in arch:
                hint = f" (the export is a {arch[0]}, the given model a {type(root).__name__})"
            raise CheckpointError(f"{cfg_path}: module {name!r} does not exist in the given model{hint}")
        mod = named[name]
        if isinstance(mod, QuantizedMixin):
            raise CheckpointError(f"{cfg_path}: module {name!r} of the given model already holds a loaded "
                                  f"export ({type(mod).__name__}); pass a fresh model")
        _check_kind(mod, rec["kind"], name, cfg_path)
        if rec.get("weights") is not None:
            if mod.weight.is_floating_point() and str(mod.weight.dtype) != f"torch.{rec['dtype']}":
                # a float32 export loaded into a bfloat16 model: its weights are the exported
                # float weights rounded to the model's dtype (as transformers casts a checkpoint),
                # not float32 weights that the bf16 activations cannot be multiplied with
                rec["dtype"] = str(mod.weight.dtype).replace("torch.", "")
            want = list(rec["weight_shape"])
            have = list(mod.weight.shape)
            if rec.get("transposed"):
                have = have[::-1]
            if want != have:
                raise CheckpointError(f"{cfg_path}: module {name!r} weight is {want} in the "
                                      f"checkpoint but {have} in the given model")
        _swap(mod, rec["kind"], name, rec)
    for name, rec in modules.items():
        if rec["format"] == "int-quantized":
            tensors[f"{name}.qweight"] = tensors.pop(f"{name}.weight")
    missing, unexpected = [], []
    try:
        result = root.load_state_dict(tensors, strict=False)
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    except RuntimeError as e:
        raise CheckpointError(f"{folder}: tensors do not fit the model: {e}") from None
    _check_unlisted(unexpected, modules, cfg_path)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
        raise CheckpointError(f"{folder}: checkpoint tensors and model disagree: " + "; ".join(parts))
    if mode == "fast":
        from .fast import convert
        convert(root, modules)
        if fuse_activations:
            from .fuse import fuse_activations as fuse
            fuse(root)
    model.eval()      # an inference checkpoint, as transformers' from_pretrained returns it
    return model
