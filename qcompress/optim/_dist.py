"""torch.distributed helpers that also work when no process group exists (world size 1)."""

from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist

from ..comm.stats import add as _count_bytes  # not `import stats`: that name is stats()


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if initialized() else 0


def average_(tensors: List[torch.Tensor], group=None) -> None:
    """All-reduce (mean) a list of tensors in place, one collective per dtype (flattened), each
    counted in qcompress.comm.stats by the all_reduce rule (ring volume)."""
    size = world_size(group)
    if size == 1 or not tensors:
        return
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for items in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in items])
        dist.all_reduce(flat, group=group)
        volume = 2 * (size - 1) * flat.numel() * flat.element_size() // size
        _count_bytes(volume, volume)
        flat.div_(size)
        offset = 0
        for t in items:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def grads_of(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]
