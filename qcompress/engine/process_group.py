"""Where an engine runs: its process group (reused, from torchrun's environment, or none) and
its device."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .comm_timeout import apply_to_existing_group, timeout_of


def setup_distributed(stage: int, cfg=None, cuda: Optional[bool] = None):
    """(rank, world_size, backend): reuse a process group, else torchrun's env, else one process.
    A group created here uses nccl when the engine trains on CUDA (`cuda`; None: when a GPU is
    there), else gloo.

    FSDP2 needs a process group even alone, so stages 2/3 get a private 1-rank gloo group.
    Groups created here wait at most comm_timeout_s for a collective (comm_timeout.py)."""
    if dist.is_available() and dist.is_initialized():
        apply_to_existing_group(cfg)
        return dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if cuda is None:
        cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timeout_of(cfg))  # env:// from torchrun
        return dist.get_rank(), world, backend
    if stage >= 2:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout_of(cfg))
        return 0, 1, backend
    return 0, 1, None


def resolve_device(device) -> Optional[torch.device]:
    """initialize(device=...): None (automatic), "cpu", "cuda" (cuda:LOCAL_RANK) or "cuda:N"."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: qcompress trains on 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: torch sees no CUDA device (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'})"
            )
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def pick_device(backend: Optional[str], asked: Optional[torch.device] = None) -> torch.device:
    """The asked device, else cuda:LOCAL_RANK when a GPU is there and the group allows it, else cpu."""
    if asked is not None:
        if asked.type == "cuda":
            torch.cuda.set_device(asked)
        return asked
    if torch.cuda.is_available() and backend in (None, "nccl"):
        idx = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def start(cfg, asked: Optional[torch.device] = None) -> Tuple[int, int, torch.device]:
    """(rank, world_size, device) for an engine asked to train on `asked` (resolve_device's)."""
    rank, world, backend = setup_distributed(
        cfg.zero_optimization.stage, cfg, None if asked is None else asked.type == "cuda"
    )
    return rank, world, pick_device(backend, asked)
