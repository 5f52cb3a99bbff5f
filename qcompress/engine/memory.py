"""Memory per rank: the estimate a user reads before training, the report an engine measures.

Model (ZeRO paper, fp32 weights as this engine keeps them; P = number of parameters, W = ranks):
  stage 0: params 4P, grads 4P,   optimizer kP        (k = 8 for Adam: two fp32 moments)
  stage 1: params 4P, grads 4P,   optimizer kP/W
  stage 2: params 4P, grads 4P/W, optimizer kP/W      (FSDP2 keeps the full weights from forward
                                                       through backward: reshard_after_forward=False)
  stage 3: params 4P/W, grads 4P/W, optimizer kP/W
  offload (stage 2/3): the sharded params, grads and optimizer state live in CPU memory.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

from ..errors import ConfigError


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def _local_bytes(t: torch.Tensor) -> int:
    return _local_numel(t) * t.element_size()


def estimate_memory(num_params: int, world_size: int = 1, stage: int = 0, offload: bool = False, *,
                    param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8) -> Dict[str, int]:
    """Bytes per rank for parameters, gradients and optimizer state (Adam: optimizer_bytes=8).

    Returns {"parameters", "gradients", "optimizer_state", "total"} held on the training device
    and "offloaded" held in CPU memory by the offload policy.
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"{stage!r}; choose 0, 1, 2 or 3")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    if offload and stage < 2:
        raise ConfigError("zero_optimization.offload_optimizer.device", "offload needs stage 2 or 3")
    shard = math.ceil(num_params / world_size)
    params = (shard if stage == 3 else num_params) * param_bytes
    grads = (shard if stage >= 2 else num_params) * grad_bytes
    optim = (shard if stage >= 1 else num_params) * optimizer_bytes
    offloaded = 0
    if offload:
        # The CPU holds the parameter shard, its gradient and the optimizer state; the device only
        # holds the unsharded working copy (all of it through backward in stage 2).
        offloaded = shard * param_bytes + shard * grad_bytes + optim
        params = num_params * param_bytes if stage == 2 else 0
        grads = optim = 0
    return {"parameters": params, "gradients": grads, "optimizer_state": optim,
            "total": params + grads + optim, "offloaded": offloaded}


def _optimizer_state_bytes(optimizer) -> int:
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    total = 0
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local_bytes(value)
    return total


def memory_report(module, optimizer, stage: int, offload: bool) -> Dict[str, int]:
    """Measured bytes on this rank, in estimate_memory's categories.

    Parameters and optimizer state are measured from the live tensors (the local shard of a
    DTensor); gradients are what the stage keeps between backward and step (DDP: a full-size
    bucket per parameter; FSDP2: the reduce-scattered shard), since they are freed after step.
    """
    params = list(module.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum(_local_bytes(p) for p in params)
    trainable_local = sum(_local_bytes(p) for p in params if p.requires_grad)
    trainable_full = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    p_bytes = local if stage == 3 else full
    g_bytes = trainable_local if stage >= 2 else trainable_full
    o_bytes = _optimizer_state_bytes(optimizer)
    offloaded = 0
    if offload:
        offloaded = local + trainable_local + o_bytes
        p_bytes = full if stage == 2 else 0
        g_bytes = o_bytes = 0
    return {"parameters": p_bytes, "gradients": g_bytes, "optimizer_state": o_bytes,
            "total": p_bytes + g_bytes + o_bytes, "offloaded": offloaded}
