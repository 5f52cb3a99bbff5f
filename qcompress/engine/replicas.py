"""What keeps the ranks' copies of a model consistent besides the gradients: the compression and
progressive-layer-drop schedules set up before wrapping, rank 0's compression state sent to every
rank, buffers and static activation ranges synchronized at each optimizer step, and the guard
against evaluating while a 1-bit optimizer's local steps left each rank its own weights."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..nn import kv_cache
from ..serialize import flatten, unflatten

RANKS_DIFFER = "_qc_ranks_differ"  # set on the model while ranks hold different weights


def refuse_unsynced_eval(module, args):
    """Forward pre-hook: no eval-mode forward while the ranks hold different weights."""
    if not module.training and module.__dict__.get(RANKS_DIFFER):
        raise RuntimeError(
            "the ranks hold different weights (0/1 Adam's local steps since its last "
            "synchronization): call engine.eval() or engine.synchronize_ranks() on every "
            "rank before evaluating"
        )


def setup_pld(model, cfg):
    """The model's progressive-layer-drop schedule: applied here when the config enables it and
    init_compression did not (a DeepSpeed script calls initialize only)."""
    from ..nn.pld import apply_pld, pld_schedule

    sched = pld_schedule(model)
    if sched is None and cfg.progressive_layer_drop.enabled:
        sched = apply_pld(model, cfg.progressive_layer_drop)
    if sched is not None:
        sched.start_step(0, resumed=True)
    return sched


def make_compression_scheduler(model, cfg):
    try:
        from ..schedule import CompressionScheduler
    except ImportError:
        return None
    return CompressionScheduler(model, cfg)


def broadcast_compression_state(sched, device, rank: int, traffic, group=None) -> None:
    """Rank 0's compression state on every rank (init_compression derived it from each rank's own
    initial weights)."""
    if sched is None:
        return
    tensors: Dict[str, torch.Tensor] = {}
    skel = flatten(sched.state_dict(), "c", tensors)
    synced = {}
    for key in sorted(tensors):
        t = tensors[key].to(device).contiguous()
        dist.broadcast(t, src=0, group=group)
        traffic.broadcast("broadcast", t.numel() * t.element_size(), rank == 0)
        synced[key] = t.to(tensors[key].device)
    sched.load_state_dict(unflatten(skel, synced))


class ReplicaSync:
    """Ranks see different data, so buffers and static activation ranges drift apart. Like DDP's
    broadcast_buffers, the first replica's buffers win; static ranges are averaged. Once per
    optimizer step, over the replicas of this rank's part of the model (the world when nothing is
    split)."""

    def __init__(self, module, parallel, traffic, device):
        self.module, self.parallel, self.traffic, self.device = module, parallel, traffic, device
        self.observers = [
            m.qc_aq.observer
            for m in module.modules()
            if getattr(m, "qc_aq", None) is not None and getattr(m.qc_aq, "calibration", None) == "static"
        ]
        self.observers += kv_cache.observers(module)  # KV-cache ranges: per tensor or per head
        self.has_buffers = any(True for _ in module.buffers())

    @torch.no_grad()
    def sync(self) -> None:
        pm = self.parallel
        if pm.shape.dp == 1:
            return
        if self.has_buffers:
            bufs = list(self.module.buffers())
            for dtype in dict.fromkeys(b.dtype for b in bufs):  # same order on every rank
                same = [b for b in bufs if b.dtype == dtype]
                flat = torch.cat([b.reshape(-1) for b in same])
                dist.broadcast(flat, src=pm.dp_src, group=pm.dp_group)
                self.traffic.broadcast("broadcast", flat.numel() * flat.element_size(), pm.dp_rank == 0)
                torch._foreach_copy_(
                    same, [v.view_as(b) for v, b in zip(torch.split(flat, [b.numel() for b in same]), same)]
                )
        live = [o for o in self.observers if o.initialized]
        if live:
            # (min, max) per Linear; (min, max, seen) per expert of fused experts (nn/expert_ranges.py)
            parts = [o.sync_tensor().to(self.device, torch.float32).reshape(-1) for o in live]
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=pm.dp_group)
            self.traffic.all_reduce("engine", flat.numel() * flat.element_size())
            for o, t in zip(live, torch.split(flat, [p.numel() for p in parts])):
                o.sync_from(t, pm.shape.dp)
