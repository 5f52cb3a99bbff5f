"""Whole replicas on every rank: DistributedDataParallel (ZeRO stage 0) and, at stage 1, torch's
ZeroRedundancyOptimizer sharding the optimizer state over the ranks (engine/zero.py)."""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from ..optimizers import build_optimizer
from ..traffic import nbytes_of
from ..zero import build_zero1, wrap_ddp
from .base import Placement


def has_scheduled_parameters(model: nn.Module) -> bool:
    """Compression Parameters that join the graph only once their technique starts (topk pruning
    scores, learned activation / weight ranges): before that DDP must expect unused parameters."""
    from ...nn.ranges import range_parameter_names

    for m in model.modules():
        if any(getattr(st, "scores_name", None) for st in getattr(m, "qc_pruning", {}).values()):
            return True
        if range_parameter_names(m):
            return True
    return False


class DDP(Placement):
    """ZeRO stage 0 on several ranks: DDP averages each gradient bucket over the world."""

    def _wrap(self, model: nn.Module, skips_blocks: bool) -> nn.Module:
        zero = self.cfg.zero_optimization
        ddp, self.timer = wrap_ddp(
            model,
            self.device,
            self.group,
            self.world_size,
            zero.reduce_bucket_size,
            self.cfg.communication_data_type,
            bool(self.cfg.wall_clock_breakdown),
            find_unused_parameters=skips_blocks or has_scheduled_parameters(model),
            traffic=self.traffic,
        )
        return ddp

    def set_grad_sync(self, sync: bool) -> None:
        self.wrapped.require_backward_grad_sync = sync

    def before_step(self, trainable: List[nn.Parameter], optimizer) -> None:
        """DDP all-reduces a bucket only once all its parameters got a gradient: a parameter the
        loss did not use leaves its bucket unreduced (those gradients stay this rank's own) and the
        next forward fails with DDP's advice to pass find_unused_parameters=True, which the
        engine's user cannot. Refuse the step before it applies unaveraged gradients."""
        ddp = self.wrapped
        if getattr(ddp, "find_unused_parameters", True) or not ddp.require_backward_grad_sync:
            return
        unused = [self.param_names.get(p, "?") for p in trainable if p.grad is None]
        if unused:
            more = f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""
            raise RuntimeError(
                f"engine.step: {len(unused)} trainable parameter(s) got no gradient in this step: "
                f"{', '.join(unused[:5])}{more}. At ZeRO stage {self.stage} DistributedDataParallel averages "
                "gradients only when every trainable parameter takes part in the loss; freeze the unused "
                "ones (requires_grad_(False)) before initialize, or use stage 2/3"
            )

    def grad_sumsq(self, params, allreduce_gradients: bool, fp16: bool):
        """Replicated gradients agree after DDP's all-reduce; a 1-bit optimizer's local ones (between
        its exchanges) give the RMS over ranks of their norms."""
        local = not allreduce_gradients
        sumsq, flag = super().grad_sumsq(params, allreduce_gradients, fp16)
        if not (local or fp16):
            return sumsq, flag
        total, flag = self._sum_over_world(sumsq if local else torch.zeros_like(sumsq), flag)
        return (total / self.world_size if local else sumsq), flag


class ZeRO1(DDP):
    """ZeRO stage 1 on several ranks: DDP for the gradients, ZeroRedundancyOptimizer for the state
    (the 1-bit optimizers shard theirs themselves, placement/base.py)."""

    def _config_optimizer(self, params):
        opt_cfg = self.cfg.optimizer
        if self.onebit or opt_cfg is None:  # 1-bit: they shard their own state; None: the base's error
            return super()._config_optimizer(params)
        return build_zero1(params, lambda groups: build_optimizer(groups, opt_cfg), self.group)

    def _from_factory(self, params, factory):
        return build_zero1(params, factory, self.group)

    @property
    def optimizer_layout(self) -> str:
        """ "zero1": each rank writes the state of the parameters it owns (engine/checkpoint.py)."""
        return "per_rank" if self.onebit else "zero1"

    def after_optimizer_step(self, optimizer) -> None:
        """ZeroRedundancyOptimizer broadcasts each rank's updated partition to the others."""
        owner = getattr(optimizer, "_param_to_rank", None)
        if owner is None or self.world_size == 1:
            return
        mine = nbytes_of(p for p, r in owner.items() if r == self.rank)
        rest = nbytes_of(p for p, r in owner.items() if r != self.rank)
        self.traffic.add("zero1", (self.world_size - 1) * mine, rest)
