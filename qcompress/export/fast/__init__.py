"""load_quantized(..., mode="fast"): integer-weight matmuls instead of a float weight per call.

Each loaded quantized module gets a plan, chosen once at load time and logged: the first row of
TABLE below that decides the layer. A plan is a class (core.Plan) that owns all it changes:
whether it takes a layer, how it re-lays the module's tensors at load, its forward, the float
`weight` it rebuilds, what it writes to a state dict, and its name, which is what reports show
(plans_of, convert's return value, the load log). A new plan is one class and one row of TABLE.

  lowbit, lowbit_a8         lowbit_plans.py: qcompress's own fused kernels, for every int/binary/
                            ternary Linear of up to 8 bits whenever the extension is built
  int_mm, int_mm24,         torch_plans.py: torch's own kernels where they fit, for a pure-torch
  int8pack, int4pack        install
  int4pack_cuda,            cuda_plans.py (fast_cuda.py): codes kept packed on a GPU for torch's
  int8pack_cuda             weight-only kernels
  gather, dequant           core.py: the exact path's float math (dequant: everything else, logged
                            as a fallback with the reason; its bit planes: planes.py)

Here are the modules' side: the fast classes, whose forward, `weight` and state dict go to the
plan named by the module's `qx_plan`, and the load step.
"""

from __future__ import annotations

import logging
import warnings
from typing import Dict, Tuple

import torch.nn as nn

from ...quant import lowbit
from .. import quantized
from ..quantized import _QHFConv1D, _QLinear, QuantizedMixin
from . import core, cuda_plans, lowbit_plans, torch_plans
from .core import DEQUANT, Plan, _needs_grad
from .lowbit_plans import _direct

# names that other modules, tests and benchmarks read from here (fast was one module before)
from .core import _exported_codes, dequantize_record  # noqa: F401
from .lowbit_plans import CUDA_LOWBIT_KERNELS, _lowbit_weight  # noqa: F401
from .planes import planes_codes, planes_dequantize, planes_ok  # noqa: F401
from .torch_plans import _D1, INT4_GROUPS, _digits  # noqa: F401

log = logging.getLogger("qcompress.export.fast")

# Walked in order; the first row whose choose() answers decides the layer, so the order carries
# meaning: dense first (the others read the weights' record); the CUDA rows before the CPU ones,
# which would take the same layers; gather, the first kernel row, is where what no kernel runs
# (float formats, classes with their own forward) is refused, as each later row would; with the
# extension the lowbit rows take or refuse every layer left; among torch's, int_mm takes the 8-bit
# layers with input codes and int8pack decides the half-precision ones before int_mm24; dequant
# takes whatever is left.
TABLE: Tuple[Plan, ...] = (
    core.Dense(),
    cuda_plans.Int4PackCuda(),
    cuda_plans.Int8PackCuda(),
    core.Gather(),
    lowbit_plans.LowbitA8(),
    lowbit_plans.Lowbit(),
    torch_plans.IntMM(),
    torch_plans.Int8Pack(),
    torch_plans.IntMM24(),
    torch_plans.Int4Pack(),
    DEQUANT,
)
BY_NAME: Dict[str, Plan] = {p.name: p for p in TABLE}


def _choose(mod: nn.Module, rec: dict, cuda_packed: bool) -> Tuple[Plan, str]:
    for row in TABLE:
        if row.packs_on_cuda and not cuda_packed:
            continue
        choice = row.choose(mod, rec)
        if choice is not None:
            return choice
    raise LookupError(f"no fast plan decided {rec.get('kind')!r}")  # unreachable: dequant takes all


def choose_plan(mod: nn.Module, rec: dict, cuda_packed: bool = False) -> Tuple[str, str]:
    """(plan, reason) for one loaded module; reason explains a 'dequant' fallback. cuda_packed: let
    the rows that keep codes packed on a CUDA device take it too (as convert does by default)."""
    plan, why = _choose(mod, rec, cuda_packed)
    return plan.name, why


# --- the fast module -----------------------------------------------------------------------------


class FastMixin:
    """Loaded quantized module running its plan; `weight` still returns the float weight."""

    def __setstate__(self, state):
        super().__setstate__(state)
        BY_NAME[self.qx_plan].ready(self)  # unpickled: what the pickle left out (the direct call)

    @property
    def weight(self):
        if self.qx_rec.get("weights") is None:
            return self._parameters["weight"]
        return BY_NAME[self.qx_plan].weight(self)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("qx_dense", None)  # a GPU copy of the weight is not moved: decoded again
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        plan = BY_NAME[self.qx_plan]
        plan.check_saveable(self)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        plan.saved(self, destination, prefix)

    def extra_repr(self):
        return super().extra_repr() + f", plan: {self.qx_plan}"


class _KernelForward(FastMixin):
    """The forward of the layers a plan may run a kernel for; the module's exact forward otherwise."""

    def forward(self, x):
        y = _direct(self, x)  # first: at one token every Python step before the kernel counts
        if y is not None:
            return y
        if not _needs_grad(self, x):  # the integer kernels have no backward
            y = BY_NAME[self.qx_plan].forward(self, x)
            if y is not None:
                return y
        return super().forward(x)


class FastLinearMixin(_KernelForward):
    """nn.Linear: y = x @ W^T + b."""


class FastConv1DMixin(_KernelForward):
    """transformers' Conv1D (GPT-2): y = x @ W + b with W [in, out], i.e. a Linear on W^T."""


_CACHE: Dict[type, type] = {}


def fast_class(base: type, mixin: type) -> type:
    """The fast class over a loaded-module class (one per class)."""
    if base not in _CACHE:
        _CACHE[base] = type("Fast" + base.__name__, (mixin, base), {"__module__": __name__})
    return _CACHE[base]


def _swap_fast(mod: nn.Module, plan: str):
    base = type(mod)
    mixin = (
        FastLinearMixin
        if issubclass(base, _QLinear)
        else FastConv1DMixin
        if issubclass(base, _QHFConv1D)
        else FastMixin
    )
    mod.__class__ = fast_class(base, mixin)
    mod.qx_plan = plan
    mod.qx_direct = None


def convert(root: nn.Module, modules: Dict[str, dict], cuda_packed: bool = True) -> Dict[str, Tuple[str, str]]:
    """Give every loaded quantized module of `root` its fast plan; returns name -> (plan, reason).
    cuda_packed: layers on a CUDA device keep packed codes where torch's kernels take them
    (fast_cuda.py); False (mode="dense") decodes them to a float weight as before."""
    unpacked = {}  # CUDA layers the packed kernels refuse: warned about once
    named = dict(root.named_modules())
    plans: Dict[str, Tuple[str, str]] = {}
    for name, rec in modules.items():
        mod = named[name]
        if not isinstance(mod, QuantizedMixin) or rec.get("weights") is None:
            continue
        plan, why = _choose(mod, rec, cuda_packed)
        if cuda_packed and not plan.packs_on_cuda:
            why_not = cuda_plans.cuda_choice(mod, rec)[1]
            if why_not:
                unpacked[name] = why_not
        plan.convert(mod, rec)
        _swap_fast(mod, plan.name)
        plan.ready(mod)
        plans[name] = (plan.name, why)
    if unpacked:
        warnings.warn(
            f"load_quantized(mode='fast'): {len(unpacked)} CUDA layers keep a dense float weight "
            "(torch's packed kernels do not take them): "
            + "; ".join(f"{n!r}: {why}" for n, why in list(unpacked.items())[:5])
            + (" ..." if len(unpacked) > 5 else ""),
            stacklevel=3,
        )
    fallbacks = {n: why for n, (p, why) in plans.items() if p == DEQUANT.name}
    counts: Dict[str, int] = {}
    for p, _ in plans.values():
        counts[p] = counts.get(p, 0) + 1
    log.info("load_quantized(mode='fast'): %s", ", ".join(f"{c} x {p}" for p, c in sorted(counts.items())))
    if any(isinstance(BY_NAME[p], lowbit_plans.LowbitPlan) for p in counts):
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
# the unquantized float Linears (lm_head) at a few tokens: qcompress's float GEMV kernel
from . import float_linear  # noqa: E402,F401
