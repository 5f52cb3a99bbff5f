"""Whole tensors from a tensor- or pipeline-parallel model, for writing one export (every rank
calls; rank 0 writes).

Each DTensor parameter is swapped for its full tensor (a collective) for the duration of the
write and put back after, so the export reads the same weights the unsplit model would hold and
its codes equal the single-process export's (nn/sharded.py keeps the scales those of the whole).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn as nn

from ..nn.sharded import is_dtensor
from .stage_export import whole_stages


def needs_gather(model) -> bool:
    """Whether `model` (an engine or a module) is split over ranks: pipeline stages or DTensors."""
    from ..unwrap import unwrap
    from .pipeline import Pipeline

    if isinstance(getattr(model, "pipeline", None), Pipeline):
        return True
    inner = unwrap(model)
    return isinstance(inner, nn.Module) and any(is_dtensor(p) for p in inner.parameters())


@contextlib.contextmanager
def whole_parameters(model: nn.Module):
    """Collective: every DTensor parameter of `model` replaced by its full tensor, then restored."""
    swapped = []
    try:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if is_dtensor(p):
                    mod._parameters[name] = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
                    swapped.append((mod, name, p))
        yield model
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def export_split(export, model: nn.Module, out_dir, engine=None, **kwargs) -> str:
    """`export(model, out_dir, **kwargs)` on rank 0 with whole parameters (and, for pipeline
    stages, every stage's parts: parallel/stage_export.py); every rank returns out_dir once it
    is written."""
    staged = engine is not None and getattr(engine, "pipeline", None) is not None
    with whole_parameters(model):
        error = None
        try:
            with whole_stages(engine) if staged else contextlib.nullcontext(model) as whole:
                if dist.get_rank() == 0:
                    export(whole, out_dir, **kwargs)
        except BaseException as err:  # the other ranks must not wait for a write that failed
            error = err
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
    if error is not None:
        raise error
    if failed[0]:
        raise RuntimeError(f"export_quantized: rank 0 failed to write {out_dir}")
    return out_dir
