"""Observer-chosen and learned quantization ranges of compress-aware modules.

- `observer: mse` without range learning: each group's shrink factor is searched at the first
  quantization and at every bit drop (`init_weight_ranges`) and kept in `WeightQuant.shrink`;
  every forward then quantizes with the factor times the group's current [min, max].
- `observer_kwargs: {weight_by: inputs}`: the mse search weighs each group's error by the
  module's input moments (`MasterState.input_moments`, recorded by
  qcompress.calibrate_weight_ranges; observers.input_weighting), and with `cross_groups` (at
  granularity group) the row's groups are chosen together against the whole E[u u^T]
  (`MasterState.input_cross`, quant/cross_groups.py); until calibration ran, the plain search.
- `range_learning: true`: the scales (and asymmetric zero points) are Parameters of the module,
  named as compressed-tensors names the tensors export writes: `weight_scale`,
  `weight_zero_point`, `input_scale`, `input_zero_point` (float32, one value per group). The
  observer initialises them at the first quantization and at every bit drop (weights) or at the
  first scheduler step after the static range saw a batch (activations); LSQ trains them
  (qcompress.quant.api.fake_quantize_learned). Being Parameters, optimizers, ZeRO sharding,
  state_dicts and checkpoints carry them.
- Float formats (quant/float_observers.py): `mse` keeps each scale's choice in `WeightQuant.shrink`
  the same way; learned FP8 scales are `weight_scale` in the weight's units, learned NVFP4 scales
  the per-block effective scales `weight_scale` under a learned global `weight_global_scale`.
- `observer: gptq`: the solver's scales (`WeightQuant.solved`, written by
  qcompress.calibrate_weight_ranges, qcompress/calibrate/gptq.py) are used as they are, at every
  step; with range learning they initialise the learned Parameters instead. A gptq module used
  before it was solved is an error naming it, not a silent round-to-nearest.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..quant import float_observers, floats, observers
from ..quant.api import learned_params
from ..quant.reference import int_params, make_spec, scale_shape

WEIGHT_PARAMS = ("weight_scale", "weight_zero_point", "weight_global_scale")
INPUT_PARAMS = ("input_scale", "input_zero_point")


def range_parameter_names(mod) -> Tuple[str, ...]:
    """Names of the learned-range Parameters registered on `mod` (for export, which writes its own)."""
    return tuple(n for n in WEIGHT_PARAMS + INPUT_PARAMS if mod._parameters.get(n) is not None)


def _claim(mod, name: str, path: str) -> None:
    if name in mod._parameters or name in mod._buffers or name in mod.__dict__ or name in mod._modules:
        raise ConfigError(
            path,
            f"module {mod.qc_name!r} already has an attribute {name!r}, where range "
            "learning keeps its learned scale; turn range_learning off for this module",
        )


def _weight_view(mod, source: Optional[torch.Tensor] = None) -> torch.Tensor:
    w = mod.quantizer_input() if source is None else source
    return mod.weight_matrix_view(w.detach())


def register_weight_ranges(mod, path: str) -> None:
    """Learned weight scale (and zero point) Parameters, set from the observer at the start bits."""
    wq = mod.qc_wq
    view = _weight_view(mod)
    spec = wq.spec() if wq.bits else _spec_at(wq, wq.start_bits)
    if floats.is_float(spec):
        _register_float_weight_ranges(mod, view, spec, path)
        return
    shape = scale_shape(view, spec)
    if view.is_meta:  # a model built on the meta device: values come with its weights (reinit_after_load)
        s = torch.empty(shape, dtype=torch.float32, device="meta")
        z = s if spec.kind == "int" and not spec.symmetric else None
    else:
        s, z = observers.weight_params(view, spec, "minmax")  # placeholders: set when quantization starts
    _claim(mod, "weight_scale", path)
    mod.register_parameter("weight_scale", nn.Parameter(s.reshape(shape).to(view.device)))
    if z is not None:
        _claim(mod, "weight_zero_point", path)
        mod.register_parameter("weight_zero_point", nn.Parameter(z.reshape(shape).to(view.device)))


def _register_float_weight_ranges(mod, view, spec, path) -> None:
    shape = floats.scale_grid_shape(view.shape, spec)
    if view.is_meta:
        s = torch.empty(shape, dtype=torch.float32, device="meta")
        g = torch.empty(1, dtype=torch.float32, device="meta")
    else:  # placeholders: set when quantization starts
        s, g = float_observers.learned_init(view, spec, *floats.qparams(view, spec))
    _claim(mod, "weight_scale", path)
    mod.register_parameter("weight_scale", nn.Parameter(s.reshape(shape).to(view.device)))
    if spec.scale_kind == "e4m3":
        _claim(mod, "weight_global_scale", path)
        mod.register_parameter("weight_global_scale", nn.Parameter(g.reshape(1).to(view.device)))


def _spec_at(wq, bits):
    old = wq.bits
    wq.bits = bits
    try:
        return wq.spec()
    finally:
        wq.bits = old


def register_input_ranges(mod, path: str) -> None:
    """Learned static input scale (and zero point) Parameters; set from the observer later."""
    aq = mod.qc_aq
    dev = mod.weight.device if getattr(mod, "weight", None) is not None else None
    _claim(mod, "input_scale", path)
    mod.register_parameter("input_scale", nn.Parameter(torch.ones(1, dtype=torch.float32, device=dev)))
    if not aq.symmetric:
        _claim(mod, "input_zero_point", path)
        mod.register_parameter("input_zero_point", nn.Parameter(torch.zeros(1, dtype=torch.float32, device=dev)))


def unsolved_error(mod) -> ConfigError:
    wq = mod.qc_wq
    return ConfigError(
        f"compression_training.weight_quantization.different_groups.{wq.group}.params.observer",
        f"module {mod.qc_name!r} uses observer gptq but its weights were never solved: call "
        "qcompress.calibrate_weight_ranges(model, batches) after init_compression (qcompress "
        "train does), or load an engine checkpoint saved after it (engine.load_checkpoint, "
        "qcompress export --checkpoint); a state_dict alone (qcompress export --weights) does "
        "not hold GPTQ's scales",
    )


def check_solved(mod) -> None:
    """Raise unsolved_error for a gptq module whose weights were never solved."""
    wq = mod.qc_wq
    if wq.solver is not None and wq.solved is None:
        raise unsolved_error(mod)


def chosen(wq):
    """What a fused forward's plan keys its weight ranges on: the solver's scales, else the mse
    observer's shrink factors (None: the weight's own minmax ranges)."""
    return wq.solved if wq.solved else wq.shrink


def loaded_with_scales(wq) -> None:
    """A state_dict brought learned scales with the weights: the next range initialisation keeps
    them, and a gptq module's solution is those scales."""
    wq.ranges_loaded = True
    if wq.solver is not None:
        wq.solved = ()


def weighs_by_inputs(wq) -> bool:
    """The group's mse search weights the error by the module's inputs (observer_kwargs.weight_by)."""
    return wq.range_observer == "mse" and observers.Search(*wq.range_search).weight_by == "inputs"


def input_moments(mod) -> Optional[torch.Tensor]:
    """The mse search's input moments (observers.input_weighting), or None (plain search): weight_by
    inputs and moments recorded (an Embedding has them only through a tied Linear)."""
    wq = mod.qc_wq
    if not weighs_by_inputs(wq):
        return None
    return wq.store.input_moments


def takes_cross(wq) -> bool:
    """The search chooses a row's groups together against the whole E[u u^T] (weight_by inputs with
    cross_groups, granularity group)."""
    return weighs_by_inputs(wq) and wq.granularity == "group" and observers.Search(*wq.range_search).cross_groups


def input_cross(mod) -> Optional[torch.Tensor]:
    """The whole E[u u^T] for observers.mse_shrink's cross, or None: takes_cross and recorded."""
    return mod.qc_wq.store.input_cross if takes_cross(mod.qc_wq) else None


@torch.no_grad()
def init_weight_ranges(mod, source: Optional[torch.Tensor] = None) -> None:
    """The observer's ranges at the bits now in force (first quantization, bit drops): the mse
    shrink factors, and the learned scales unless they were just loaded with trained weights."""
    wq = mod.qc_wq
    if wq.solver is not None:
        wq.shrink = None
        return  # the solver chose the scales (calibrate_weight_ranges), once
    spec = wq.spec()
    view = _weight_view(mod, source)
    if view.is_meta:
        return  # no values to observe yet: reinit_after_load runs when weights arrive
    search, moments, cross = observers.Search(*wq.range_search), input_moments(mod), input_cross(mod)
    if floats.is_float(spec):
        _init_float_weight_ranges(mod, view, spec, search)
        return
    if wq.range_observer == "mse" and spec.kind == "int" and not wq.range_learning:
        wq.shrink = observers.mse_shrink(view, spec, search=search, moments=moments, cross=cross)
    else:
        wq.shrink = None
    if not wq.range_learning:
        return
    if wq.ranges_loaded:
        wq.ranges_loaded = False
        return
    s, z = observers.weight_params(view, spec, wq.range_observer, search=search, moments=moments, cross=cross)
    mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
    zp = mod._parameters.get("weight_zero_point")
    if zp is not None:
        zp.copy_(z.reshape(zp.shape) if z is not None else torch.zeros_like(zp))


def _init_float_weight_ranges(mod, view, spec, search) -> None:
    wq = mod.qc_wq
    mse = wq.range_observer == "mse"
    wq.shrink = float_observers.mse_shrink(view, spec, search) if mse and not wq.range_learning else None
    if not wq.range_learning:
        return
    if wq.ranges_loaded:
        wq.ranges_loaded = False
        return
    chosen = (
        float_observers.scales_with_shrink(view, spec, float_observers.mse_shrink(view, spec, search))
        if mse
        else floats.qparams(view, spec)
    )
    s, g = float_observers.learned_init(view, spec, *chosen)
    mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
    if g is not None:
        mod.weight_global_scale.copy_(g.reshape(mod.weight_global_scale.shape))


def reinit_after_load(mod) -> None:
    """Weights loaded without their learned scales (a plain checkpoint loaded into a compressed
    model, or weights arriving after a meta-device init): choose the ranges again for them, as at
    the first quantization, instead of keeping those observed on the weights they replaced."""
    wq = mod.qc_wq
    if wq.solver is not None and not wq.baked:
        wq.solved = None  # solved for other weights; a checkpoint's compression state restores its own
        return
    if wq.baked or not wq.active or (wq.range_observer == "minmax" and not wq.range_learning):
        return  # minmax ranges follow the weight anyway; inactive: set when it turns on
    # optimizer-step mode too: the loaded weight is the next step's master (the store was reset),
    # and a CompressionScheduler.load_state_dict after this puts a resumed run's own ranges back
    init_weight_ranges(mod)


def weight_params(mod, view: torch.Tensor, spec):
    """(scale, zero point) the weight is quantized with now, or None for the spec's own (minmax)."""
    wq = mod.qc_wq
    check_solved(mod)
    if wq.range_learning:
        return learned_params(
            mod.weight_scale, mod._parameters.get("weight_zero_point") if spec.kind == "int" else None, spec
        )
    if wq.solved:
        s, z = wq.solved
        return s.to(view.device), None if z is None else z.to(view.device)
    if wq.shrink is not None and spec.kind == "int":
        return observers.weight_params(view, spec, "mse", shrink=wq.shrink)
    return None


def float_weight_params(mod, view: torch.Tensor, spec):
    """(scale, global scale or None) a float-format weight is quantized with now: the learned
    ones, the mse observer's choice applied to the weight's absmax, or floats.qparams' (minmax)."""
    wq = mod.qc_wq
    check_solved(mod)
    if wq.range_learning:
        return float_observers.learned_scales(view, spec, mod.weight_scale, mod._parameters.get("weight_global_scale"))
    if wq.solved:
        s, g = wq.solved
        return s.to(view.device), None if g is None else g.to(view.device)
    if wq.shrink is not None:
        return float_observers.scales_with_shrink(view, spec, wq.shrink)
    return floats.qparams(view, spec)


def input_spec(aq):
    return make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")


@torch.no_grad()
def init_input_ranges(mod) -> bool:
    """Learned static input range from the (synchronised) observer's EMA range; True when set."""
    aq = mod.qc_aq
    if aq.learned_ready or not aq.observer.initialized:
        return False
    lo, hi = aq.observer.min.reshape(1), aq.observer.max.reshape(1)
    s, z = int_params(lo.float(), hi.float(), input_spec(aq))
    mod.input_scale.copy_(s.reshape(mod.input_scale.shape).to(mod.input_scale.device))
    zp = mod._parameters.get("input_zero_point")
    if zp is not None:
        zp.copy_(z.reshape(zp.shape).to(zp.device))
    aq.learned_ready = True
    return True


class _Attach(torch.autograd.Function):
    """Returns x unchanged; the given Parameters get zero gradients. Learned ranges not in use yet
    (before the offset, before activation ranges are initialised) still take part in backward, so
    DistributedDataParallel finds a gradient for every Parameter."""

    @staticmethod
    def forward(ctx, x, *params):
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes)


def attach_unused(x: torch.Tensor, mod, names) -> torch.Tensor:
    params = [mod._parameters[n] for n in names if mod._parameters.get(n) is not None]
    if not params or not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
        return x
    return _Attach.apply(x, *params)
