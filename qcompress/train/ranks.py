"""Which rank this process is, and the collective helpers the job needs around its phases."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def full_state_dict(model: torch.nn.Module) -> dict:
    """The model's state_dict as whole CPU tensors; a sharded (FSDP2 DTensor) entry is gathered,
    collectively, so every rank must call this in the same order."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().cpu().contiguous()
    return out


def drop_shared(sd: dict) -> None:
    """safetensors refuses tensors sharing storage (tied embeddings): keep the first of each."""
    seen = set()
    for k in list(sd):
        ptr = (sd[k].data_ptr(), sd[k].numel())
        if ptr in seen and sd[k].numel():
            del sd[k]
        seen.add(ptr)
