"""Compress-aware mixture-of-experts modules.

transformers 5 keeps a MoE block's experts in one module whose fused Parameters have a leading
expert dimension (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; gpt-oss transposed,
[E, in, out], with biases). Each such Parameter gets an `ExpertMatrix`: a compress-aware module
(CompressMixin, like a Linear) whose `weight` is the owner's 3-D Parameter and whose matrix view
stacks the experts' [out, in] matrices into [E * out, in] rows. Channel and group granularity
then act along each expert's input dimension, per expert, with the quantizers, observers, range
learning and schedules a Linear uses; per-tensor granularity becomes one scale per expert
(view [E, out * in], per row).

The ExpertMatrix is registered in the owner's `_modules` under the Parameter's own name, so its
module name is the Parameter's dotted name (`...mlp.experts.gate_up_proj`) and the owner's
state_dict keys do not change (nn.Module resolves `owner.gate_up_proj` to the Parameter first).
The owner's forward is the model's own, run with the effective (fake-quantized) 3-D weights in
`_parameters` for the call (as torch.func.functional_call does), so every family's routing code
and every experts implementation (eager loop, batched_mm, grouped_mm) is reused.

Detection is by structure and forward: floating Parameters of 3 dimensions sharing their leading
(expert) dimension; which axis is each matrix's input is read from a one-token probe forward
(F.linear(x, W[e]) is [out, in]; x @ W[e] is [in, out]), or from transformers' `is_transposed`
flag when the probe cannot run (meta tensors, another signature).
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError
from ..quant import floats
from ..quant.api import fake_quantize_spec
from ..unwrap import unwrap
from . import ranges
from .expert_ranges import ExpertRanges
from .layers import CompressMixin, _rebind_saved_forward

OUT_IN, IN_OUT = "out_in", "in_out"  # each expert's matrix as nn.Linear stores it, or transposed
_LAYOUT = "_qc_expert_layout"  # owner.__dict__: {param name: layout}, or {} when not experts
_PARTS = "_qc_expert_parts"  # owner.__dict__: {param name: ExpertMatrix} before attaching


class ExpertMatrix(CompressMixin, nn.Module):
    """One fused expert Parameter of an experts module, seen as E stacked 2-D weights."""

    qc_kind = "experts"

    def __init__(self, owner: nn.Module, pname: str, layout: str, name: str):
        nn.Module.__init__(self)
        self.__dict__["_qc_owner"] = owner  # not a child module: the owner holds this one
        self.qc_param = pname
        self.qc_layout = layout
        self.qc_per_expert_tensor = False  # granularity tensor: one scale per expert
        self.qc_fast = None  # load_quantized(mode="fast"): per-expert low-bit kernels
        self.qc_expert = None  # the expert whose routed tokens are being multiplied
        self.qc_static_inputs = None  # a loaded export's per-expert (input_scale, zero point)
        self.qc_capture = None  # calibration: capture(x, expert) sees each routed input
        self._qc_setup(name)

    @property
    def weight(self) -> torch.Tensor:
        return self.__dict__["_qc_owner"]._parameters[self.qc_param]

    @property
    def owner(self) -> nn.Module:
        return self.__dict__["_qc_owner"]

    def matrix_shape(self) -> Tuple[int, int, int]:
        """(experts, out, in) of the stacked matrices."""
        e, a, b = self.weight.shape
        return (e, a, b) if self.qc_layout == OUT_IN else (e, b, a)

    def weight_matrix_view(self, w: torch.Tensor) -> torch.Tensor:
        m = w if self.qc_layout == OUT_IN else w.transpose(-1, -2)
        return m.reshape(m.shape[0], -1) if self.qc_per_expert_tensor else m.reshape(-1, m.shape[-1])

    def _from_matrix_view(self, v: torch.Tensor) -> torch.Tensor:
        e, out, inp = self.matrix_shape()
        m = v.reshape(e, out, inp)
        # contiguous in the stored layout, so in-forward and baked weights run the same kernels
        return m if self.qc_layout == OUT_IN else m.transpose(-1, -2).contiguous()

    def expert_matrix(self, w: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's [out, in] matrix of a tensor in the stored 3-D layout."""
        return w[e] if self.qc_layout == OUT_IN else w[e].t()

    def expert_linear(self, x, w, e: Optional[int], bias, transposed: bool = False):
        """x times expert e's matrix w (w: [out, in], or [in, out] when transposed), the input
        quantized per token; on the low-bit kernel when loaded in fast mode."""
        if self.qc_capture is not None:
            self.qc_capture(x, e)
        if self.qc_static_inputs is not None and e is not None:
            s, z = self.qc_static_inputs
            x = fake_quantize_spec(
                x, self.input_spec(), scale=s[e].reshape(1), zero_point=None if z is None else z[e].reshape(1)
            )
        else:
            self.qc_expert = e
            try:
                x = self.quantize_input(x)
            finally:
                self.qc_expert = None
        if self.qc_fast is not None and e is not None and self.qc_fast.runs_on(x):
            y = self.qc_fast(x, e)
            return y if bias is None else y + bias
        return x @ w if transposed else F.linear(x, w, bias)

    # float formats: each expert's matrix quantized as its own Linear (NVFP4: one global scale per
    # expert matrix, as compressed-tensors gives each per-expert Linear; channel and group scales
    # are per row either way)
    def _fake_quantize_weight_of(self, w, wq, spec, learned):
        spec = wq.spec() if spec is None else spec
        if not floats.is_float(spec):
            return super()._fake_quantize_weight_of(w, wq, spec, learned)
        view = self.weight_matrix_view(w)
        return torch.cat(
            [
                floats.fake_quantize_float(v, spec, scale=s, gscale=g, clip_grad=wq.clip_grad)
                for v, (s, g) in zip(view.chunk(self.matrix_shape()[0]), self.expert_float_params(view, spec))
            ]
        )

    def expert_float_params(self, view, spec):
        """Each expert's (scale, global scale or None): the GPTQ solution's when solved (the
        experts' scales concatenated, global scales stacked), else each matrix's own (minmax)."""
        e = self.matrix_shape()[0]
        solved = self.qc_wq.solved
        if solved:
            s, g = solved
            gs = [None] * e if g is None else list(g.to(view.device).reshape(e, 1))
            return list(zip(s.to(view.device).chunk(e), gs))
        return [floats.qparams(v.detach(), spec) for v in view.chunk(e)]

    def quantized_weight(self, weight: Optional[torch.Tensor] = None):
        """As CompressMixin's; float formats give (codes, scales, [E] global scales or None, spec)."""
        wq = self.qc_wq
        spec = wq.spec() if wq is not None and wq.active else None
        if spec is None or not floats.is_float(spec) or (wq.codes is not None and weight is None):
            return super().quantized_weight(weight)
        ranges.check_solved(self)
        view = self.weight_matrix_view((self.weight if weight is None else weight).detach())
        qs, ss, gs = [], [], []
        for v, (s, g) in zip(view.chunk(self.matrix_shape()[0]), self.expert_float_params(view, spec)):
            qs.append(floats.quantize_codes(v, spec, s, g))
            ss.append(s)
            gs.append(g)
        g = None if gs[0] is None else torch.stack([t.reshape(()) for t in gs])
        return torch.cat(qs), torch.cat(ss), g, spec

    def input_observer(self):
        """Static ranges: the StaticRange of the expert whose routed tokens x are."""
        obs = self.qc_aq.observer
        if not isinstance(obs, ExpertRanges):
            return obs
        if self.qc_expert is None:
            raise RuntimeError(
                f"{self.qc_name}: a static input range is kept per expert, and this product of "
                "tokens with the fused matrix does not say which expert it is (a batched "
                "experts implementation?); set the model's experts_implementation to 'eager'"
            )
        return obs[self.qc_expert]

    def _apply(self, fn, recurse=True):
        return nn.Module._apply(self, fn, recurse)  # the owner moves the weight, then the state

    def _load_from_state_dict(self, *args, **kwargs):
        return nn.Module._load_from_state_dict(self, *args, **kwargs)  # the owner resets the state

    def __reduce_ex__(self, protocol):
        return nn.Module.__reduce_ex__(self, protocol)

    def extra_repr(self) -> str:
        e, out, inp = self.matrix_shape()
        return f"{e} experts x [{out}, {inp}] ({self.qc_param}, {self.qc_layout})" + CompressMixin.extra_repr(self)


class ExpertsForward:
    """Mixed in before an experts class: its own forward with the effective weights in place."""

    def expert_parts(self) -> List[ExpertMatrix]:
        return [m for m in self._modules.values() if isinstance(m, ExpertMatrix)]

    def forward(self, *args, **kwargs):
        params = self._parameters
        parts = self.expert_parts()
        effective = {}
        for part in parts:
            eff = part.effective_weight()
            if eff is not params[part.qc_param]:
                effective[part.qc_param] = eff
        saved = {n: params[n] for n in effective}
        params.update(effective)
        try:
            calls = self._input_calls()
            if not calls:
                return super().forward(*args, **kwargs)
            rowwise = self._rowwise_inputs(calls)
            if rowwise is not None:
                # compiled: no per-expert loop (its trip count is data); per-token quantization of
                # the hidden states commutes with the implementation's row gather, the down input
                # is quantized in _apply_gate
                gu = rowwise.get("gate_up_proj")
                if gu is not None and args:
                    args = (gu.quantize_input(args[0]),) + tuple(args[1:])
                elif gu is not None:
                    kwargs = dict(kwargs, hidden_states=gu.quantize_input(kwargs["hidden_states"]))
                return super().forward(*args, **kwargs)
            with _ExpertCalls({id(params[p.qc_param]): p for p in calls}) as watch:
                # the eager loop (transformers' experts implementations wrap it): each expert's
                # product is a call the mode sees, on that expert's routed tokens only
                out = eager_forward(experts_base(type(self)))(self, *args, **kwargs)
            watch.check_seen(calls)
            return out
        finally:
            params.update(saved)

    def _input_calls(self) -> List[ExpertMatrix]:
        """The matrices whose products must be intercepted: quantized inputs or low-bit kernels."""
        return [
            p
            for p in self.expert_parts()
            if (p.qc_aq is not None and p.qc_aq.active) or p.qc_fast is not None or p.qc_capture is not None
        ]

    def _rowwise_inputs(self, calls) -> Optional[Dict[str, ExpertMatrix]]:
        """{param name: part} when compiling and every quantized input is dynamic per token (a
        function of each row alone) under transformers' batched_mm / grouped_mm forward, whose
        matrices multiply rows of (token, expert) pairs and whose gate is `_apply_gate`; else None
        (eager mode keeps the per-expert loop, bit for bit; static per-expert ranges and low-bit
        kernels need to know the expert)."""
        if not torch.compiler.is_compiling() or not getattr(self, "has_gate", False):
            return None
        impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if impl not in ("batched_mm", "grouped_mm"):
            return None
        for p in calls:
            if (
                p.qc_param not in ("gate_up_proj", "down_proj")
                or p.qc_fast is not None
                or p.qc_capture is not None
                or p.qc_static_inputs is not None
                or p.qc_aq.calibration != "dynamic"
            ):
                return None
            spec = p.input_spec()
            if floats.is_float(spec) or spec.granularity != "token":
                return None
        return {p.qc_param: p for p in calls}

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        h = super()._apply_gate(gate_up)
        parts = self._rowwise_inputs(self._input_calls()) if torch.compiler.is_compiling() else None
        if parts is not None and "down_proj" in parts:
            return parts["down_proj"].quantize_input(h)
        return h

    def __setattr__(self, name, value):
        # an assigned Parameter (load_state_dict(assign=True), FSDP) replaces the tensor only: the
        # ExpertMatrix registered under the same name stays
        part = self.__dict__.get("_modules", {}).get(name)
        if isinstance(part, ExpertMatrix) and isinstance(value, torch.Tensor):
            self._parameters[name] = value
            return
        super().__setattr__(name, value)

    def __reduce_ex__(self, protocol):
        """Pickle by the model's experts class: the compress-aware class is made at run time, so
        pickle cannot find it by name (torch.save(model) of a whole model)."""
        rv = super().__reduce_ex__(protocol)
        base = experts_base(type(self))
        if not isinstance(rv, tuple) or _CLASS_CACHE.get(base) is not type(self):
            return rv  # a further subclass (e.g. FSDP's): leave it to its own rules
        return (_new_experts, (base,)) + tuple(rv[2:])

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for part in self.expert_parts():
            wq = part.qc_wq
            if wq is not None:
                wq.follow(part.weight)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        n_errors = len(error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for part in self.expert_parts():
            wq = part.qc_wq
            if wq is None or prefix + part.qc_param not in state_dict or len(error_msgs) != n_errors:
                continue
            wq.store.reset()  # a loaded weight is a new starting point (as CompressMixin's)
            if wq.range_learning and f"{prefix}{part.qc_param}.weight_scale" in state_dict:
                ranges.loaded_with_scales(wq)
            else:
                ranges.reinit_after_load(part)


# --- detection ---------------------------------------------------------------------------------
def _fused_params(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Floating 3-D Parameters sharing one leading (expert) dimension, or [] if not an experts module."""
    params = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_floating_point() and p.dim() >= 3]
    if not params or any(p.dim() != 3 for _, p in params):
        return []
    if len({p.shape[0] for _, p in params}) != 1:
        return []
    return params


class _Watch(TorchFunctionMode):
    """Records how a forward multiplies slices of the watched Parameters."""

    _DERIVE = {
        torch.Tensor.__getitem__,
        torch.index_select,
        torch.Tensor.index_select,
        torch.Tensor.contiguous,
        torch.Tensor.to,
    }
    _MATMUL = {torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm}

    def __init__(self, params):
        super().__init__()
        self.src = {id(p): n for n, p in params}
        self.keep = []  # derived tensors stay alive so their ids are not reused
        self.layout: Dict[str, str] = {}

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ids = [id(a) for a in args[:2]]
        if func in self._DERIVE and ids and ids[0] in self.src and isinstance(out, torch.Tensor):
            self.src[id(out)] = self.src[ids[0]]
            self.keep.append(out)
        elif func is F.linear and len(ids) > 1 and ids[1] in self.src:
            self.layout.setdefault(self.src[ids[1]], OUT_IN)
        elif func in self._MATMUL and len(ids) > 1:
            if ids[1] in self.src:
                self.layout.setdefault(self.src[ids[1]], IN_OUT)
            elif ids[0] in self.src:
                self.layout.setdefault(self.src[ids[0]], OUT_IN)
        return out


def _expert_index(idx) -> Optional[int]:
    if isinstance(idx, int):
        return idx
    if isinstance(idx, torch.Tensor) and idx.dim() == 0 and not idx.is_floating_point():
        return int(idx)
    return None


class _ExpertCalls(TorchFunctionMode):
    """Inside an experts forward: each product of a token batch with an expert matrix (F.linear(x,
    W[e]), x @ W[e], and the batched implementation's bmm over W[expert_ids]) gets its input
    quantized per token, and in fast mode runs on that expert's low-bit kernel. The model's own
    routing code runs unchanged: each expert sees only its routed tokens."""

    _MATMUL = (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul)
    _BMM = (torch.bmm, torch.Tensor.bmm)
    _HOT = frozenset((torch.Tensor.__getitem__, F.linear) + _MATMUL + _BMM)

    def __init__(self, parts: Dict[int, "ExpertMatrix"]):
        super().__init__()
        self.src = {i: (p, None) for i, p in parts.items()}
        self.keep = []  # derived tensors stay alive so their ids are not reused
        self.seen = set()

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # the mode is off while this runs: the quantizers' own ops are not watched; most ops of
        # the loop (routing, activation, index_add) pass straight through (batch-1 decode cost)
        if func not in self._HOT:
            return func(*args, **(kwargs or {}))
        return self._call(func, args, kwargs or {})

    def _call(self, func, args, kwargs):
        if func is torch.Tensor.__getitem__ and id(args[0]) in self.src:
            out = func(*args, **kwargs)
            part, _ = self.src[id(args[0])]
            self.src[id(out)] = (part, _expert_index(args[1]))
            self.keep.append(out)
            return out
        if func is F.linear and len(args) > 1 and id(args[1]) in self.src:
            part, e = self.src[id(args[1])]
            self.seen.add(id(part))
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return part.expert_linear(args[0], args[1], e, bias)
        if func in self._MATMUL and len(args) > 1 and id(args[1]) in self.src:
            part, e = self.src[id(args[1])]  # x @ W[e], W[e] stored [in, out]
            self.seen.add(id(part))
            return part.expert_linear(args[0], args[1], e, None, transposed=True)
        if func in self._BMM and len(args) > 1 and (id(args[0]) in self.src or id(args[1]) in self.src):
            if id(args[1]) in self.src:  # x [S, 1, in] @ W [S, in, out]
                part = self.src[id(args[1])][0]
                self.seen.add(id(part))
                return func(part.quantize_input(args[0]), args[1])
            part = self.src[id(args[0])][0]  # W [S, out, in] @ x [S, in, 1]: tokens in columns
            self.seen.add(id(part))
            return func(args[0], part.quantize_input(args[1].transpose(-1, -2)).transpose(-1, -2))
        return func(*args, **kwargs)

    def check_seen(self, parts) -> None:
        for part in parts:
            if id(part) not in self.seen:
                raise RuntimeError(
                    f"{part.qc_name}: the experts forward multiplied no token batch by this "
                    "matrix through F.linear, matmul or bmm (another experts implementation, "
                    "e.g. grouped_mm?), so its input quantization / low-bit kernels cannot act; "
                    "set the model's experts_implementation to 'eager' or 'batched_mm'"
                )


def experts_base(cls: type) -> type:
    """The model's experts class under the compress-aware (and FSDP) subclasses."""
    return [c for c in cls.__mro__ if not issubclass(c, ExpertsForward)][0]


def eager_forward(cls: type):
    """The class's forward before transformers' experts-implementation dispatch (functools.wraps
    keeps it as __wrapped__): the per-expert loop."""
    fwd = cls.forward
    return getattr(fwd, "__wrapped__", fwd)


def _probe(module: nn.Module, params) -> Dict[str, str]:
    """Run the forward on one token routed to expert 0 and watch which axis each matrix contracts."""
    p0 = params[0][1]
    if p0.is_meta:
        return {}  # no values to run on: transformers' is_transposed flag decides
    for hidden in dict.fromkeys((p0.shape[2], p0.shape[1])):
        x = torch.zeros(1, hidden, dtype=p0.dtype, device=p0.device)
        idx = torch.zeros(1, 1, dtype=torch.long, device=p0.device)
        w = torch.ones(1, 1, dtype=p0.dtype, device=p0.device)
        watch = _Watch(params)
        try:
            with torch.no_grad(), watch:
                eager_forward(type(module))(module, x, idx, w)
        except Exception:  # another signature or this hidden size is wrong: try the next
            continue
        if all(n in watch.layout for n, _ in params):
            return watch.layout
    return {}


def expert_layout(module: nn.Module) -> Dict[str, str]:
    """{Parameter name: OUT_IN | IN_OUT} of an experts module's fused matrices; {} for other modules."""
    d = module.__dict__
    if _LAYOUT not in d:
        params = _fused_params(module) if not isinstance(module, (CompressMixin, ExpertsForward)) else []
        layout = _probe(module, params) if params else {}
        if params and not layout and isinstance(getattr(module, "is_transposed", None), bool):
            flag = IN_OUT if module.is_transposed else OUT_IN  # transformers' declared layout
            layout = {n: flag for n, _ in params}
        d[_LAYOUT] = layout
    return d[_LAYOUT]


def pending_parts(root: nn.Module) -> List[Tuple[str, ExpertMatrix]]:
    """(module name, ExpertMatrix) for each fused matrix of experts modules not yet rewritten; made
    once per module and kept unattached until `attach`, so planning does not change the model."""
    out = []
    for name, mod in root.named_modules():
        if not name or isinstance(mod, (ExpertsForward, CompressMixin)):
            continue
        layout = expert_layout(mod)
        if not layout:
            continue
        parts = mod.__dict__.setdefault(_PARTS, {})
        for pname, lay in layout.items():
            if pname not in parts:
                parts[pname] = ExpertMatrix(mod, pname, lay, f"{name}.{pname}")
            out.append((f"{name}.{pname}", parts[pname]))
    return out


def owner_name(name: str) -> str:
    return name.rsplit(".", 1)[0]


_CLASS_CACHE: Dict[type, type] = {}


def experts_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Compress{cls.__name__}", (ExpertsForward, cls), {"__module__": __name__})
    return _CLASS_CACHE[cls]


def _new_experts(base: type):
    """Unpickling: an empty instance of the compress-aware subclass of `base`."""
    cls = experts_class(base)
    return cls.__new__(cls)


def attach(parts, always: bool = False) -> None:
    """Register the configured ExpertMatrix modules (every one with `always`: a loaded export's
    low-bit kernels) in their owners; swap the owners' classes."""
    for part in parts:
        if part.qc_wq is None and part.qc_aq is None and not always:
            continue
        owner = part.owner
        if not isinstance(owner, ExpertsForward):
            base = type(owner)
            owner.__class__ = experts_class(base)
            _rebind_saved_forward(owner, base, type(owner), part.qc_name)
        owner._modules[part.qc_param] = part
        owner.__dict__.pop(_PARTS, None)


def detach(modules) -> None:
    """Undo `attach` (a failed init_compression)."""
    for mod in list(modules):
        if isinstance(mod, ExpertsForward):
            for part in mod.expert_parts():
                del mod._modules[part.qc_param]
            cls = type(mod)
            mod.__class__ = experts_base(cls)
            _rebind_saved_forward(mod, cls, type(mod), None)
        mod.__dict__.pop(_PARTS, None)


def check_weight(part: ExpertMatrix, path: str) -> None:
    """Refuse, before training, what cannot be quantized per expert or exported; per-tensor
    granularity becomes one scale per expert (a channel of the [E, out * in] view)."""
    wq = part.qc_wq
    e, out, inp = part.matrix_shape()
    where = (
        f"module {part.qc_name!r} ({type(part.owner).__name__}.{part.qc_param}, Parameter of shape "
        f"{list(part.weight.shape)}: {e} experts of [out {out}, in {inp}])"
    )
    if wq.granularity == "groups":
        raise ConfigError(
            f"{path}.params.granularity",
            f"quantize_groups cuts the flattened tensor into chunks across experts' "
            f"matrices, which export cannot write per expert: {where}; set granularity "
            "(tensor, channel or group) for this group",
        )
    if wq.granularity == "group" and inp % wq.group_size:
        raise ConfigError(
            f"{path}.params.group_size",
            f"{wq.group_size} does not divide the input dimension {inp} of each expert's "
            f"matrix in {where}; pick a divisor of {inp}",
        )
    fmts = {f for _, f in wq.format} if isinstance(wq.format, tuple) else {wq.format or "int"}
    if fmts - {"int"} and (wq.range_learning or wq.range_observer != "minmax"):
        raise ConfigError(
            f"{path}.params.{'range_learning' if wq.range_learning else 'observer'}",
            f"float formats on fused experts take minmax scales per expert matrix: {where}; "
            "drop range_learning / observer: mse here, or leave the experts out",
        )
    if wq.granularity == "tensor":
        wq.granularity, wq.per_expert = "channel", True
        part.qc_per_expert_tensor = True


def refuse_unsupported(technique: str, patterns, names, kinds, path: str) -> None:
    """A regex of a technique that does not act on fused experts (pruning) selecting an experts
    module or matrix is a ConfigError naming it; without `modules` the experts are left out."""
    if patterns is None or "experts" in kinds:
        return
    for i, p in enumerate(patterns):
        for n, k in names:
            if k == "experts" and (re.search(p, n) or re.search(p, owner_name(n))):
                raise ConfigError(
                    f"{path}[{i}]",
                    f"{p!r} selects {n!r}, a fused mixture-of-experts "
                    f"Parameter, which {technique} does not act on (it is defined for Linear "
                    "and Conv weights); narrow the regex (e.g. exclude 'experts')",
                )


def check_act(part: ExpertMatrix, path: str, named: bool) -> bool:
    """Whether the expert inputs take the group's activation quantization: per token (dynamic), or
    with one static EMA range per expert over the tokens routed to it (ExpertRanges). Learned
    static ranges and float-format static inputs of experts are not implemented: refused by name
    when the group's regex names the experts, left out with a warning when it takes every module."""
    aq = part.qc_aq
    why = None
    if aq.calibration == "static" and aq.range_learning:
        why = "range_learning (a learned static input range per expert)"
    elif aq.calibration == "static" and aq.format != "int":
        why = f"static {aq.format} inputs (a float-format static range per expert)"
    if why is not None and not named:
        warnings.warn(
            f"{path}: module {part.qc_name!r} (fused experts) is left out: {why} is not implemented for experts",
            stacklevel=4,
        )
        return False
    if why is not None:
        raise ConfigError(
            f"{path}.modules",
            f"module {part.qc_name!r} (fused experts, {part.matrix_shape()[0]} "
            f"experts): {why} is not implemented for experts; use an integer static range "
            "without range_learning, range_calibration: dynamic, or leave the experts out",
        )
    if aq.calibration == "static":
        aq.observer = ExpertRanges(part.matrix_shape()[0], aq.observer.momentum)
    if aq.int8_forward is True:
        warnings.warn(
            f"compression_training.activation_quantization.shared_parameters.int8_forward: module "
            f"{part.qc_name!r} (fused experts) runs its fake-quantized forward; int8_forward acts on "
            "Linear layers only",
            stacklevel=4,
        )
    return True


def router_aux_kwargs(model: nn.Module) -> Dict[str, bool]:
    """{"output_router_logits": True} for a transformers MoE model with a router auxiliary
    (load-balancing) loss, so its `loss` includes it in training; {} for other models."""
    root = unwrap(model)
    coef = getattr(getattr(root, "config", None), "router_aux_loss_coef", 0) or 0
    try:
        takes = "output_router_logits" in inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"output_router_logits": True} if coef > 0 and takes else {}


def describe(part: ExpertMatrix) -> str:
    """The summary's type column: `Qwen3MoeExperts[8]` (the experts class and how many)."""
    return f"{experts_base(type(part.owner)).__name__}[{part.matrix_shape()[0]}]"
