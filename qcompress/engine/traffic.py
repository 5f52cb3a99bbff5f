"""Engine-level byte counter: every byte this rank's engine moves, by kind (Engine.comm_bytes()).

qcompress.comm.stats() counts only the compressed path (and the optimizers' own uncompressed
all-reduces); the engine's DDP / FSDP2 traffic goes through torch's reducer and never reaches it.
This counter adds, with the counting rules of qcompress.comm.stats (payload bytes, ring volume
for all-reduce and reduce-scatter):

  "ddp"          DDP's gradient buckets, counted in the engine's comm hook (zero.GradReduceHook)
                 in the dtype they travel in; all-reduce of B bytes: 2(P-1)B//P each way
  "fsdp"         FSDP2's reduce-scatter of gradients (input B bytes: (P-1)B//P each way) and
                 all-gathers of weights (input chunk b: (P-1)b each way), through counting
                 set_custom_reduce_scatter / set_custom_all_gather comms
  "broadcast"    the engine's broadcasts of rank 0's model (initialize), DDP's own start-up
                 broadcast of the module state, and buffers after each step: the root sends
                 (P-1)B, every other rank receives B
  "engine"       the engine's small all-reduces (gradient norm / fp16 overflow flag, static
                 activation ranges), ring volume
  "optimizer"    what qcompress.comm.stats counted on this rank since the engine was built
                 (compressed all-reduces, 1-bit optimizers' uncompressed all-reduces, the
                 sharded 1-bit Adam's all-gather), read from a running total that
                 qcompress.comm.reset_stats() does not clear
  "zero1"        ZeroRedundancyOptimizer's parameter broadcast after each step (stage 1 with a
                 plain optimizer): this rank sends its partition to P-1 ranks and receives the rest

Not counted: DDP's start-up shape check and the find_unused_parameters bitmap (metadata of a few
bytes per parameter), checkpoint I/O collectives, barriers.
"""

from __future__ import annotations

import threading
from typing import Dict

import torch
import torch.distributed as dist

from ..comm.stats import running_totals as _running_totals  # the module, not comm.stats()


def reduce_scatter(*args, **kwargs):
    """dist.reduce_scatter_single, or its old name reduce_scatter_tensor (it warns in recent torch);
    looked up per call, so whatever wraps torch.distributed's functions sees it."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def all_gather(*args, **kwargs):
    """dist.all_gather_single, or its old name all_gather_into_tensor; looked up per call."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


KINDS = ("ddp", "fsdp", "broadcast", "engine", "optimizer", "zero1")


class Traffic:
    def __init__(self, world: int):
        self.world = int(world)
        self._lock = threading.Lock()
        self._kinds = {k: [0, 0] for k in KINDS if k != "optimizer"}
        self._optimizer_base = _running_totals()

    # --- recording ----------------------------------------------------------------------------
    def add(self, kind: str, sent: int, received: int) -> None:
        with self._lock:
            rec = self._kinds[kind]
            rec[0] += int(sent)
            rec[1] += int(received)

    def all_reduce(self, kind: str, nbytes: int) -> None:
        v = 2 * (self.world - 1) * int(nbytes) // self.world if self.world > 1 else 0
        self.add(kind, v, v)

    def broadcast(self, kind: str, nbytes: int, root: bool) -> None:
        if self.world > 1:
            self.add(kind, (self.world - 1) * nbytes if root else 0, 0 if root else nbytes)

    # --- reading ------------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, object]:
        with self._lock:
            kinds = {k: {"bytes_sent": s, "bytes_received": r} for k, (s, r) in self._kinds.items()}
        now = _running_totals()
        kinds["optimizer"] = {k: now[k] - self._optimizer_base[k] for k in ("bytes_sent", "bytes_received")}
        return {
            "bytes_sent": sum(v["bytes_sent"] for v in kinds.values()),
            "bytes_received": sum(v["bytes_received"] for v in kinds.values()),
            "by_kind": {k: kinds[k] for k in KINDS},
        }

    def reset(self) -> None:
        with self._lock:
            for rec in self._kinds.values():
                rec[0] = rec[1] = 0
        self._optimizer_base = _running_totals()


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CustomComm:
    """Base of the FSDP2 custom comms (set_custom_reduce_scatter / set_custom_all_gather): plain
    buffers."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)


class CountingReduceScatter(CustomComm):
    """FSDP2 custom reduce-scatter that counts its bytes (and, when `timer` is given, is timed)."""

    def __init__(self, traffic: Traffic, timer=None):
        self.traffic, self.timer = traffic, timer

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = dist.get_world_size(group)
        v = (world - 1) * input_tensor.numel() * input_tensor.element_size() // world
        self.traffic.add("fsdp", v, v)
        if self.timer is not None:
            return self.timer(output_tensor, input_tensor, group, op, async_op)
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class CountingAllGather(CustomComm):
    """FSDP2 custom all-gather that counts its bytes."""

    def __init__(self, traffic: Traffic):
        self.traffic = traffic

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        world = dist.get_world_size(group)
        v = (world - 1) * input_tensor.numel() * input_tensor.element_size()
        self.traffic.add("fsdp", v, v)
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def count_fsdp(model, traffic: Traffic, timer=None) -> bool:
    """Route every FSDP2 module's reduce-scatter and all-gather through counting comms; False when
    this torch lacks the hooks (FSDP2 bytes then go uncounted, and say so in comm_bytes())."""
    mods = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    if not mods or not all(hasattr(m, "set_custom_all_gather") for m in mods):
        return False
    rs, ag = CountingReduceScatter(traffic, timer), CountingAllGather(traffic)
    try:
        for m in mods:
            m.set_custom_reduce_scatter(rs)
            m.set_custom_all_gather(ag)
    except ValueError:  # several FSDP param groups in one module: torch refuses custom comms
        return False
    return True
