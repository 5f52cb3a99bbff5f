"""ZeRO stages 2 and 3 on FSDP2: fully_shard every module that owns parameters (stage 3 also
reshards the weights after forward), with CPUOffloadPolicy for offload (engine/zero.py)."""

from __future__ import annotations

import torch.nn as nn

from ...parallel.data_parallel import wrap_root
from ..traffic import count_fsdp
from ..zero import TimedReduceScatter, full_weights, time_reduce_scatter, wrap_fsdp
from .base import Placement


class FSDP2(Placement):
    """Parameters, gradients and optimizer state sharded over the ranks (a split model's: over
    its dp sub-mesh, placement/mesh.py)."""

    sharded = True
    comm_label = "reduce-scatter"

    def __init__(self, ranks):
        super().__init__(ranks)
        zero = self.cfg.zero_optimization
        # CPUOffloadPolicy (stages 2/3): parameters, gradients and the update on the CPU (with NVMe,
        # the optimizer state streams from disk into that CPU update); stage 1: engine/offload.py
        self.offload = self.stage >= 2 and (
            zero.offload_optimizer.device in ("cpu", "nvme") or zero.offload_param.device == "cpu"
        )
        self.fsdp_counted = True
        self._offloaded = []

    @property
    def backward_note(self) -> str:
        return " (incl. FSDP2 weight all-gathers)" if self.stage == 3 else ""

    def _wrap(self, model: nn.Module, skips_blocks: bool) -> nn.Module:
        zero = self.cfg.zero_optimization
        partial = (
            zero.offload_optimizer.ratio
            if zero.offload_param.device == "none" and zero.offload_optimizer.device == "cpu"
            else 1.0
        )
        wrapped, self._offloaded = wrap_fsdp(
            wrap_root(self, model),
            self.device,
            self.group,
            self.stage,
            self.offload,
            self.cfg.communication_data_type,
            pin_memory=self.pin_memory(),
            offload_ratio=partial,
            mesh=self.parallel.dp_mesh,
        )
        timed = bool(self.cfg.wall_clock_breakdown)
        timer = TimedReduceScatter() if timed else None
        self.fsdp_counted = count_fsdp(model, self.traffic, timer)
        if self.fsdp_counted:
            self.timer = timer
        elif timed:
            self.timer = time_reduce_scatter(model)
        return wrapped

    def _attach_offload(self, opt) -> None:
        """CPUOffloadPolicy moved the optimizer state with its units (at wrap time)."""
        self.offloaded_ids = {id(p) for p in self._offloaded} if self.offload else set()

    def set_grad_sync(self, sync: bool) -> None:
        self.wrapped.set_requires_gradient_sync(sync)
        if self.stage == 2:
            # ZeRO-2 keeps whole weights: between accumulation micro-steps they stay gathered,
            # so the next forward needs no all-gather; the boundary reshards for the step.
            self.wrapped.set_reshard_after_backward(sync)

    def grad_sumsq(self, params, allreduce_gradients: bool, fp16: bool):
        """Shards add up their squares."""
        sumsq, flag = super().grad_sumsq(params, allreduce_gradients, fp16)
        if self.world_size == 1:
            return sumsq, flag
        return self._sum_over_world(sumsq, flag)

    def whole_weights(self):
        return full_weights(self.module, self.rank, self.world_size, self.device)

    def untimed_comm(self):
        return None

    def uncounted(self):
        if self.fsdp_counted:
            return None
        return "fsdp (this torch has no set_custom_reduce_scatter / set_custom_all_gather)"
