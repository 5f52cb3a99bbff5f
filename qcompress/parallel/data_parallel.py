"""Data parallelism composed with a tensor / pipeline split: replicas reduce over the dp dimension.

A model split over the tp and pp dimensions of the engine's (pp, dp, tp) mesh is copied on the
dp dimension; only the ranks of one dp group (same stage, same TP shard) hold the same tensors,
so gradients are averaged over that group alone. Both wrappers are FSDP2's, which compose with
DTensor tensor parallelism (the 2-D recipe: a TP DTensor becomes a 2-D (dp, tp) DTensor) and
with torch.distributed.pipelining (PipelineStage runs an FSDPModule stage's gradient sync once
per schedule step): `replicate` at ZeRO stage 0, `fully_shard` (engine/zero.py wrap_fsdp on the
dp sub-mesh) at stages 1-3. A pipeline's root is its stage module (the one PipelineStage runs),
else the model. The 1-bit optimizers exchange over the dp group themselves and run without a
wrapper (LocalShards); dp_whole_weights gives the compression scheduler whole weights over dp.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..nn.sharded import is_dtensor


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


def _dp_index(p) -> int:
    names = p.device_mesh.mesh_dim_names or ()
    return names.index("dp") if "dp" in names else -1


@contextlib.contextmanager
def dp_whole_weights(model: nn.Module, pmesh):
    """Compress-aware modules' weights whole over the dp dimension while the compression
    scheduler reads or rewrites them outside forward: an FSDP2 dp shard is gathered, and a
    tensor-parallel weight stays a DTensor on the tp mesh (as in forward, nn/sharded.py). Each
    rank's dp shard of the result is copied back after."""
    from torch.distributed.tensor import DTensor, Replicate

    swapped = []
    for m in model.modules():
        if not hasattr(m, "qc_wq"):
            continue
        for pname, p in list(m._parameters.items()):
            if not is_dtensor(p) or _dp_index(p) < 0:
                continue
            i = _dp_index(p)
            rest = [(d, pl) for k, (d, pl) in enumerate(zip(p.device_mesh.mesh_dim_names, p.placements)) if k != i]
            local = p.redistribute(
                placements=[Replicate() if k == i else pl for k, pl in enumerate(p.placements)]
            ).to_local()
            if rest:  # a tensor-parallel shard: a DTensor on the tp mesh, as forward sees it
                ((dim, placement),) = rest
                whole = DTensor.from_local(
                    local, pmesh.mesh[dim], [placement], run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                whole = local
            m._parameters[pname] = nn.Parameter(whole, requires_grad=p.requires_grad)
            swapped.append((m, pname, p, i))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, pname, p, i in swapped:
                new = m._parameters[pname].detach()
                new = new.to_local() if is_dtensor(new) else new
                m._parameters[pname] = p
                if p.placements[i].is_replicate():
                    p.to_local().copy_(new)
                else:  # FSDP2 shards the tp-local tensor along dim 0 like torch.chunk
                    pieces = torch.chunk(new, pmesh.shape.dp, dim=0)
                    rank = pmesh.dp_rank
                    p.to_local().copy_(pieces[rank] if rank < len(pieces) else new[:0])


class LocalShards:
    """The 1-bit optimizers on a split model: they exchange (compressed) momentum over the dp
    group themselves, each rank its own local tensors, so each gets this rank's pieces (a TP
    shard's local tensor, a stage's parameters) as plain tensors sharing the parameters' storage.
    No data-parallel wrapper runs: at each optimizer boundary `bind` hands the optimizer the local
    gradients and, while it expects averaged ones (warmup), averages them over the dp group."""

    def __init__(self, params):
        self.pairs = []  # (model parameter, the plain tensor the optimizer steps)
        self._views = {}

        def view(p):
            if id(p) not in self._views:
                # requires_grad as the parameter's: the 1-bit optimizers skip frozen tensors by it
                self._views[id(p)] = p.to_local().detach().requires_grad_(p.requires_grad) if is_dtensor(p) else p
                self.pairs.append((p, self._views[id(p)]))
            return self._views[id(p)]

        items = list(params)
        if items and isinstance(items[0], dict):
            self.params = [dict(g, params=[view(p) for p in g["params"]]) for g in items]
        else:
            self.params = [view(p) for p in items]

    def bind(self, optimizer) -> None:
        """Before the gradient norm and the step: local gradients on the optimizer's tensors,
        averaged over the dp group unless the optimizer is in its compressed stage."""
        for p, v in self.pairs:
            if v is not p:
                v.grad = None if p.grad is None else (p.grad.to_local() if is_dtensor(p.grad) else p.grad)
        optimizer.sync_gradients()

    def clear(self) -> None:
        """After the step: the parameters' own gradients go too (zero_grad cleared the views')."""
        for p, _ in self.pairs:
            p.grad = None
