"""The global gradient norm of a model split over the (pp, dp, tp) mesh, for clipping and fp16.

Each rank holds pieces of the gradient: its pipeline stage's parameters, its tensor-parallel
shard of a split weight (a DTensor), whole copies of replicated ones (norms, embeddings), and,
under FSDP2 on the dp dimension, its dp shard or (replicate) a copy. A piece held by n ranks
enters this rank's share of the squared norm divided by n, so one all-reduce (sum) over the
world counts every element exactly once.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch

from ..nn.sharded import is_dtensor


def _split(placement) -> bool:
    """Whether each rank holds its own piece: Shard, or the _StridedShard FSDP2 places on the dp
    dim of a tensor-parallel weight (not a Shard subclass)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def holders(grad, shape, replicas_agree: bool = True) -> int:
    """How many ranks hold this rank's piece of `grad`. A plain tensor is whole on every dp and
    tp rank of its stage; a DTensor is replicated over the mesh dims it is placed Replicate on
    and over the dp / tp dims its mesh lacks. replicas_agree=False (each replica's own gradient,
    as the 1-bit optimizers keep them) counts no dp copies."""
    names = tuple(grad.device_mesh.mesh_dim_names or ()) if is_dtensor(grad) else ()
    if is_dtensor(grad) and len(names) != grad.device_mesh.ndim:
        raise NotImplementedError(
            f"the norm of a gradient on an unnamed {grad.device_mesh.ndim}-D mesh: "
            "expected dims of the engine's (pp, dp, tp) mesh"
        )
    n = 1
    for dim, size in (("dp", shape.dp), ("tp", shape.tp)):
        if dim in names:
            placement = grad.placements[names.index(dim)]
            if placement.is_replicate():
                n *= size if (dim != "dp" or replicas_agree) else 1
            elif not _split(placement):
                raise NotImplementedError(f"the norm of a gradient placed {placement} on mesh dim {dim!r}")
        elif dim != "dp" or replicas_agree:
            n *= size
    return n


def share_of_sumsq(grads: Iterable[torch.Tensor], shape, device, replicas_agree: bool = True) -> torch.Tensor:
    """This rank's share (float64) of the squared global norm; all-reduced (sum) over the world it
    is the squared norm of the whole gradient (averaged over replicas when they do not agree)."""
    by_holders: Dict[int, list] = {}
    for g in grads:
        local = g.to_local() if is_dtensor(g) else g
        if local.numel():
            by_holders.setdefault(holders(g, shape, replicas_agree), []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for n, pieces in by_holders.items():
        norms = torch._foreach_norm(pieces)
        total += torch.stack([x.to(device, torch.float64) for x in norms]).square().sum() / n
    if not replicas_agree:
        total /= shape.dp  # the mean over replicas of their squared norms
    return total
