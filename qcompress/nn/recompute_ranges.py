"""Static activation ranges under activation checkpointing: a recompute quantizes with the range
its own forward used.

A checkpointed block runs its forward again inside the backward. A static range is an EMA that
every training forward moves, so when several micro-batches run forward before their backwards
(pipeline schedules: GPipe, 1F1B's warm-up) the EMA at recompute time is a later micro-batch's,
not the one the forward quantized with. torch's non-reentrant checkpoint takes a `context_fn`
giving one context for the forward and one for its recompute, per checkpointed call: the forward
context records each module's range in call order, the recompute context replays them.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

Range = Tuple[torch.Tensor, torch.Tensor]
_local = threading.local()  # autograd runs a CUDA backward (and its recomputes) on a thread of its own


class RangeLog:
    """The ranges one checkpointed call's modules used, per module in call order."""

    def __init__(self):
        self.used: Dict[int, List[Range]] = {}
        self.next: Dict[int, int] = {}


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class _Entered:
    """Pushes (mode, log) while entered; entered again by each recompute of a retained graph."""

    def __init__(self, mode: str, log: RangeLog):
        self.mode, self.log = mode, log

    def __enter__(self):
        if self.mode == "replay":
            self.log.next = {}  # a second backward through a retained graph replays from the start
        _stack().append((self.mode, self.log))

    def __exit__(self, *exc):
        _stack().pop()
        return False


def context_fn():
    """torch.utils.checkpoint's context_fn: (forward context, recompute context) sharing one log."""
    log = RangeLog()
    return _Entered("record", log), _Entered("replay", log)


def record(mod, rng: Range) -> Range:
    """Keep the range `mod` quantizes with in this checkpointed forward (if any); returns it."""
    stack = _stack()
    if stack and stack[-1][0] == "record":
        stack[-1][1].used.setdefault(id(mod), []).append(rng)
    return rng


def replay(mod) -> Optional[Range]:
    """In a recompute: the range `mod`'s forward used at this call, or None when not recorded (a
    checkpoint called without this context_fn)."""
    stack = _stack()
    if not stack or stack[-1][0] != "replay":
        return None
    log = stack[-1][1]
    used = log.used.get(id(mod))
    k = log.next.get(id(mod), 0)
    if used is None or k >= len(used):
        return None
    log.next[id(mod)] = k + 1
    return used[k]
