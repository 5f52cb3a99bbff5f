"""Quantizers of tensors split across a tensor-parallel group (DTensor weights and inputs).

A compress-aware Linear that `parallelize_module` made column- or row-parallel holds a shard of
its weight and, row-parallel, gets a shard of its input's last dimension. Each rank quantizes its
own shard with the scales of the whole tensor: a group's range lies on one rank (column-parallel
channels and groups, row-parallel groups that do not cross a shard boundary) or is reduced with
an all-reduce of per-group min / max over the group (row-parallel channels, whole tensors,
per-token ranges of a sharded activation). The codes then equal the unsharded model's exactly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without DTensor: nothing can be sharded
    DTensor = Replicate = Shard = None

from ..errors import ConfigError
from ..quant import floats
from ..quant.api import fake_quantize_spec
from ..quant.reference import group_minmax, group_view, int_params, make_spec
from . import recompute_ranges


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _shard_dim(t) -> Optional[int]:
    """The tensor dimension t is split along over its (1-D) mesh; None when replicated."""
    if t.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"quantizing a DTensor on a {t.device_mesh.ndim}-D mesh: tensor parallelism shards over one mesh dimension"
        )
    p = t.placements[0]
    if isinstance(p, Shard):
        return p.dim % t.dim()
    if isinstance(p, Replicate):
        return None
    raise NotImplementedError(f"quantizing a DTensor placed {p}")


def _reduced_params(X: torch.Tensor, counts: torch.Tensor, spec, group) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, zero point) of each group of the view X, its min / max reduced over `group`."""
    lo, hi = group_minmax(X, counts)
    lo, hi = lo.contiguous(), hi.contiguous()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return int_params(lo, hi, spec)


def reducible(spec) -> Optional[str]:
    """Why a shard cannot be quantized with the whole tensor's scales, or None when it can."""
    if floats.is_float(spec):
        return "float formats under tensor parallelism are not supported; use format: int"
    if spec.kind != "int":
        return f"{spec.bits}-bit {spec.kind} scales are means over the whole tensor; use 3 bits or more"
    if spec.rounding != "nearest":
        return "stochastic rounding draws its noise by element index in the whole tensor; use rounding: nearest"
    return None


def weight_needs_reduction(spec, split: Optional[int]) -> bool:
    """Whether a weight split along `split` ([out, in] view) has groups spread over ranks."""
    if split is None:
        return False
    if spec.granularity == "tensor" or spec.granularity == "groups":
        return True
    return split == 1 and spec.granularity == "channel"


def _weight_params(mod, w, spec):
    """(scale, zero point) of this rank's shard of DTensor w ([out, in] view) reduced over the
    group, or None when its groups lie whole on this rank."""
    if mod.qc_wq.solver is not None:
        raise ValueError(
            f"module {mod.qc_name!r}: observer {mod.qc_wq.solver} keeps the scales it solved for "
            "the whole weight, which tensor parallelism does not shard; leave the module out of "
            "tensor parallelism, or use observer minmax / mse"
        )
    split = _shard_dim(w)
    if not weight_needs_reduction(spec, split):
        return None
    why = reducible(spec)
    if why is not None:
        raise ValueError(f"module {mod.qc_name!r}: {why}")
    if spec.granularity == "groups":
        raise ValueError(
            f"module {mod.qc_name!r}: quantize_groups chunks of a sharded weight are not "
            "supported; use granularity channel or group"
        )
    X, counts = group_view(w.to_local().detach().float(), spec)
    return _reduced_params(X, counts, spec, w.device_mesh.get_group())


def weight_codes(mod, spec=None):
    """(q, scale, zero point) of this rank's shard of mod's DTensor weight, with the whole
    weight's scales: what export and the tests gather."""
    from ..quant.api import quantize_spec

    spec = mod.qc_wq.spec() if spec is None else spec
    w = mod.weight_matrix_view(mod.weight)
    params = _weight_params(mod, w, spec)
    local = w.to_local().detach()
    if params is None:
        return quantize_spec(local, spec)
    return quantize_spec(local, spec, scale=params[0], zero_point=params[1])


def fake_quantize_weight(mod, w, spec, clip_grad: bool):
    """The fake-quantized DTensor weight of `mod`, scales of the whole weight ([out, in] view)."""
    local = w.to_local()
    params = _weight_params(mod, w, spec)
    if params is not None:
        q = fake_quantize_spec(local, spec, clip_grad=clip_grad, scale=params[0], zero_point=params[1])
    elif floats.is_float(spec):
        q = floats.fake_quantize_float(local, spec, clip_grad=clip_grad)
    else:
        q = fake_quantize_spec(local, spec, clip_grad=clip_grad)
    return DTensor.from_local(q, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def quantize_input(mod, x, spec, aq, training: bool, recomputing: bool):
    """The fake-quantized DTensor input of `mod`; a shard of the last dimension takes the
    per-token (dynamic) or whole-tensor (static) range reduced over the group."""
    split = _shard_dim(x)
    local = x.to_local()
    if split is None or (split != x.dim() - 1 and spec.granularity == "token"):
        q = _whole(mod, local, spec, aq, training, recomputing, None)
    else:
        why = reducible(spec)
        if why is not None or aq.range_learning or aq.range_observer != "minmax":
            raise ValueError(
                f"module {mod.qc_name!r}: its input is split over the tensor-parallel group; "
                f"{why or 'learned ranges and the mse observer need the whole input; use minmax'}"
            )
        q = _whole(mod, local, spec, aq, training, recomputing, x.device_mesh.get_group())
    return DTensor.from_local(q, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def _whole(mod, local, spec, aq, training, recomputing, group):
    """Quantize `local` (the whole tensor when group is None, else a shard) with the whole tensor's
    ranges: per token, or the static range."""
    if aq.calibration != "static":
        if group is None:
            return fake_quantize_spec(local, spec)
        X, counts = group_view(local.detach().float(), spec)
        s, z = _reduced_params(X, counts, spec, group)
        return fake_quantize_spec(local, spec, scale=s, zero_point=z)
    if group is None:
        lo, hi = mod.static_input_range(local, spec)
        return fake_quantize_spec(local, spec, min_val=lo, max_val=hi)
    if training and not (recomputing and aq.observer.initialized):
        d = local.detach().float()
        lo, hi = d.amin().reshape(1), d.amax().reshape(1)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        lo, hi = recompute_ranges.record(mod, aq.observer.update(lo[0], hi[0]))
    elif training:  # a recompute (activation checkpointing): the range its own forward used
        lo, hi = recompute_ranges.replay(mod) or (aq.observer.min, aq.observer.max)
    elif aq.observer.initialized:
        lo, hi = aq.observer.min, aq.observer.max
    else:
        raise RuntimeError(
            f"module {mod.qc_name!r}: a static activation range used in eval before any "
            "training batch calibrated it, with a tensor-parallel input"
        )
    return fake_quantize_spec(local, spec, min_val=lo, max_val=hi)


def check_split(name: str, wq, aq, style: str, in_features: int, tp: int, path: str) -> None:
    """ConfigError before training for a quantizer a `style` (colwise | rowwise) split cannot keep
    exact: a group crossing a shard boundary, optimizer-step weight quantization, kinds whose
    scales need more than a min / max reduction. `path` names the group's config keys."""
    if wq is not None:
        if not wq.in_forward:
            raise ConfigError(
                "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward",
                f"module {name!r} is {style}-parallel: its "
                "sharded weight is quantized inside forward only; set it to true",
            )
        if wq.range_learning or wq.range_observer != "minmax" or wq.mix_enabled:
            raise ConfigError(
                path,
                f"module {name!r} is {style}-parallel: learned ranges, the mse observer "
                "and fp16_mixed_quantize are not supported on a sharded weight",
            )
        for bits in sorted({wq.start_bits, wq.target_bits}):
            spec = make_spec(
                bits,
                symmetric=wq.symmetric,
                rounding=wq.rounding,
                ternary=wq.ternary,
                granularity="tensor" if wq.granularity == "groups" else wq.granularity,
                group_size=wq.group_size,
            )
            split = 0 if style == "colwise" else 1
            if wq.granularity == "groups":
                raise ConfigError(
                    "compression_training.weight_quantization.shared_parameters.quantize_groups",
                    f"module {name!r} is {style}-parallel: "
                    "quantize_groups chunks of a sharded weight are not supported",
                )
            if wq.format != "int":  # NVFP4's global scale spans the shards, and so on: not kept
                raise ConfigError(
                    path,
                    f"module {name!r} is {style}-parallel: float formats under tensor "
                    "parallelism are not supported; use format: int",
                )
            if weight_needs_reduction(spec, split) or wq.rounding != "nearest":
                why = reducible(spec)
                if why is not None:
                    raise ConfigError(path, f"module {name!r} is {style}-parallel: {why}")
            if style == "rowwise" and wq.granularity == "group" and (in_features // tp) % wq.group_size:
                raise ConfigError(
                    path + ".group_size",
                    f"{wq.group_size}: module {name!r} is row-parallel over "
                    f"{tp} ranks, {in_features // tp} input columns each; a group would "
                    "cross a shard boundary (choose a group_size dividing it)",
                )
    if aq is not None and style == "rowwise":
        if aq.format != "int" or aq.range_learning or aq.range_observer != "minmax":
            raise ConfigError(
                "compression_training.activation_quantization",
                f"module {name!r} is row-parallel: its sharded input takes int formats with minmax ranges only",
            )
