"""Data parallelism composed with a tensor / pipeline split: replicas reduce over the dp dimension.

A model split over the tp and pp dimensions of the engine's (pp, dp, tp) mesh is copied on the
dp dimension; only the ranks of one dp group (same stage, same TP shard) hold the same tensors,
so gradients are averaged over that group alone. Both wrappers are FSDP2's, which compose with
DTensor tensor parallelism (the 2-D recipe: a TP DTensor becomes a 2-D (dp, tp) DTensor) and
with torch.distributed.pipelining (PipelineStage runs an FSDPModule stage's gradient sync once
per schedule step): `replicate` at ZeRO stage 0, `fully_shard` at stages 2 / 3. A pipeline's
root is its stage module (the one PipelineStage runs), else the model.
"""
from __future__ import annotations

import torch.nn as nn


def replicate_over(root: nn.Module, dp_mesh, comm_dtype=None) -> nn.Module:
    """ZeRO stage 0 over the dp sub-mesh: whole parameters on every replica, gradients all-reduced
    (averaged) over it by FSDP2's replicate; returns root, changed in place."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return replicate(root, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=comm_dtype))


def wrap_root(engine, model: nn.Module) -> nn.Module:
    """What the engine's data-parallel wrapper wraps: the pipeline's stage module or the model."""
    pipe = engine.pipeline
    return pipe.module if pipe is not None else model
