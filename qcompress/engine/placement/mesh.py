"""A model split over the (pp, dp, tp) mesh (tensor-parallel shards, pipeline stages) and copied
over its dp dimension (parallel/): the replicas average gradients over their dp group only."""

from __future__ import annotations

from typing import List

import torch.nn as nn

from ...parallel import apply_tensor_parallel
from ...parallel.data_parallel import LocalShards, dp_whole_weights, replicate_over, wrap_root
from ...parallel.grad_norm import share_of_sumsq
from ...parallel.pipeline import build_pipeline
from ..zero import comm_dtype
from .base import Placement, local_optimizer, nonfinite
from .fsdp import FSDP2


class _Split:
    """What every placement of a split model shares (a mixin before its Placement base)."""

    def split(self, model: nn.Module, compression_scheduler, micro_batches: int) -> None:
        shape = self.parallel.shape
        if shape.pp > 1:  # this rank keeps its stage's blocks only
            self.pipeline = build_pipeline(model, self.parallel, self.cfg.pipeline, micro_batches, self.device)
            if compression_scheduler is not None:  # the other stages' blocks are theirs
                compression_scheduler.keep_modules_of(model)
        if shape.tp > 1:
            self.tp_plan = apply_tensor_parallel(model, self.parallel.mesh["tp"], self.cfg.tensor_parallel)

    def grad_sumsq(self, params, allreduce_gradients: bool, fp16: bool):
        """Stages, TP shards and dp copies: each rank's share of the whole (parallel/grad_norm.py)."""
        replicas_agree = self.sharded or allreduce_gradients
        sumsq = share_of_sumsq(
            [p.grad for p in params], self.parallel.shape, self.device, replicas_agree=replicas_agree
        )
        return self._sum_over_world(sumsq, nonfinite(sumsq))

    def whole_weights(self):
        """Whole over dp; tensor-parallel shards stay DTensors."""
        return dp_whole_weights(self.module, self.parallel)


class MeshReplicas(_Split, Placement):
    """ZeRO stage 0: whole copies of this rank's part on each replica, FSDP2's replicate averaging
    the gradients over the dp sub-mesh (nothing to do with one replica)."""

    def _wrap(self, model: nn.Module, skips_blocks: bool) -> nn.Module:
        if self.parallel.shape.dp == 1:
            return model
        return replicate_over(
            wrap_root(self, model), self.parallel.mesh["dp"], comm_dtype(self.cfg.communication_data_type)
        )

    def set_grad_sync(self, sync: bool) -> None:
        replicated = getattr(self.wrapped, "set_requires_gradient_sync", None)  # absent with one replica
        if replicated is not None:
            replicated(sync)


class MeshSharded(_Split, FSDP2):
    """ZeRO stages 1-3: FSDP2 shards over the dp sub-mesh. Stage 1 shards as stage 2 does:
    ZeroRedundancyOptimizer broadcasts plain tensors, not the DTensor parameters of a split."""


class OneBitLocalShards(_Split, Placement):
    """The 1-bit optimizers: they exchange (compressed) momentum over the dp group themselves, each
    rank stepping plain tensors on its local pieces (parallel/data_parallel.py LocalShards); no
    data-parallel wrapper runs."""

    local_shards = None

    def _optimizer_params(self, params):
        self.local_shards = LocalShards(params)
        return self.local_shards.params

    def before_step(self, trainable: List[nn.Parameter], optimizer) -> None:
        self.local_shards.bind(local_optimizer(optimizer))

    def after_zero_grad(self) -> None:
        self.local_shards.clear()
