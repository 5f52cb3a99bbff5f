"""Which samples each optimizer step and micro-batch takes: a seeded order per epoch, the same on
every rank, so a run is reproducible and a resumed run picks up at the exact sample."""

from __future__ import annotations

import math
from typing import Dict, Iterator, List

import torch

from .data import collate


def steps_per_epoch(n: int, train_batch_size: int) -> int:
    """Every sample is seen once per epoch; the last step is filled from the epoch's start."""
    return max(1, math.ceil(n / train_batch_size))


def epoch_order(n: int, seed: int, epoch: int) -> List[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def step_indices(n: int, train_batch_size: int, seed: int, step: int) -> List[int]:
    """The train_batch_size sample indices of global optimizer step `step` (0-based)."""
    per_epoch = steps_per_epoch(n, train_batch_size)
    epoch, k = divmod(step, per_epoch)
    order = epoch_order(n, seed, epoch)
    start = k * train_batch_size
    idx = [order[(start + i) % n] for i in range(train_batch_size)]
    return idx


def micro_batches(
    dataset,
    step: int,
    *,
    seed: int,
    train_batch_size: int,
    micro: int,
    accumulation: int,
    rank: int,
    world: int,
    pad_id: int,
) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's `accumulation` micro-batches of step `step`: the step's samples are cut into
    world × accumulation chunks of `micro`; micro-step j of rank r takes chunk j·world + r."""
    idx = step_indices(len(dataset), train_batch_size, seed, step)
    for j in range(accumulation):
        c = j * world + rank
        yield collate([dataset[i] for i in idx[c * micro : (c + 1) * micro]], pad_id)


def eval_batches(dataset, batch_size: int, pad_id: int) -> Iterator[Dict[str, torch.Tensor]]:
    for start in range(0, len(dataset), batch_size):
        yield collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))], pad_id)


def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """The batch's tensors on `device` (collate builds them on the CPU)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def device_of(model) -> torch.device:
    """Where the model's parameters live (the CPU for a model without any)."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")
