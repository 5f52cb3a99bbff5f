"""Memory per rank: the estimate a user reads before training, the report an engine measures.

Model (ZeRO paper, fp32 weights as this engine keeps them; P = number of parameters, W = ranks):
  stage 0: params 4P, grads 4P,   optimizer kP        (k = 8 for Adam: two fp32 moments)
  stage 1: params 4P, grads 4P,   optimizer kP/W
  stage 2: params 4P, grads 4P/W, optimizer kP/W      (FSDP2 keeps the full weights from forward
                                                       through backward: reshard_after_forward=False)
  stage 3: params 4P/W, grads 4P/W, optimizer kP/W
  offload (stage 2/3): the sharded params, grads and optimizer state live in CPU memory;
      (stage 1): the optimizer state (kP/W) lives in CPU memory.
  nvme (offload_optimizer.device: nvme, stages 1-3): the optimizer state lives in files ("nvme");
      memory holds buffer_count host buffers of at most sub_group_size elements' state each, in
      CPU memory ("offloaded"), beside what the stage keeps (stages 2/3 offload like "cpu").
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


def estimate_memory(
    num_params: int,
    world_size: int = 1,
    stage: int = 0,
    offload=False,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
    sub_group_size: int = 1_000_000_000,
    buffer_count: int = 4,
) -> Dict[str, int]:
    """Bytes per rank for parameters, gradients and optimizer state (Adam: optimizer_bytes=8).

    offload: False / "none", True / "cpu" (CPUOffloadPolicy), or "nvme" (optimizer state in
    files; sub_group_size and buffer_count bound its host buffers, as in the config).
    Returns {"parameters", "gradients", "optimizer_state", "total"} held on the training device
    and "offloaded" held in CPU memory by the offload policy; with "nvme" also "nvme", the bytes
    in files under nvme_path.
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"{stage!r}; choose 0, 1, 2 or 3")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    placement = {False: "none", True: "cpu"}.get(offload, offload) if isinstance(offload, bool) else offload
    if placement not in ("none", "cpu", "nvme"):
        raise ConfigError("zero_optimization.offload_optimizer.device", f"{offload!r}; choose none, cpu or nvme")
    if placement == "nvme":
        return _estimate_nvme(
            num_params, world_size, stage, param_bytes, grad_bytes, optimizer_bytes, sub_group_size, buffer_count
        )
    offload = placement == "cpu"
    if offload and stage < 1:
        raise ConfigError("zero_optimization.offload_optimizer.device", "offload needs stage 1, 2 or 3")
    shard = math.ceil(num_params / world_size)
    params = (shard if stage == 3 else num_params) * param_bytes
    grads = (shard if stage >= 2 else num_params) * grad_bytes
    optim = (shard if stage >= 1 else num_params) * optimizer_bytes
    offloaded = 0
    if offload and stage == 1:
        # engine/offload.py: the optimizer state (this rank's partition) and its update on the CPU
        offloaded, optim = optim, 0
    elif offload:
        # The CPU holds the parameter shard, its gradient and the optimizer state; the device only
        # holds the unsharded working copy (all of it through backward in stage 2).
        offloaded = shard * param_bytes + shard * grad_bytes + optim
        params = num_params * param_bytes if stage == 2 else 0
        grads = optim = 0
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_state": optim,
        "total": params + grads + optim,
        "offloaded": offloaded,
    }


def _estimate_nvme(
    num_params, world_size, stage, param_bytes, grad_bytes, optimizer_bytes, sub_group_size, buffer_count
) -> Dict[str, int]:
    if stage < 1:
        raise ConfigError("zero_optimization.stage", "offload_optimizer.device: nvme needs stage 1, 2 or 3")
    out = estimate_memory(
        num_params,
        world_size,
        stage,
        stage >= 2,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
    )
    shard = math.ceil(num_params / world_size)
    chunk = min(shard, sub_group_size)
    buffers = min(buffer_count, math.ceil(shard / chunk) if chunk else 0) * chunk * optimizer_bytes
    state = shard * optimizer_bytes
    if stage >= 2:
        out["offloaded"] += buffers - state  # the CPU update reads its state from disk
    else:
        out["optimizer_state"] = 0
        out["total"] = out["parameters"] + out["gradients"]
        out["offloaded"] = buffers
    out["nvme"] = state
    return out


def _optimizer_state_bytes(optimizer, only=None) -> int:
    """Bytes of the state tensors (of the parameters whose ids are in `only`, when given)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    total = 0
    for p, state in local.state.items():
        if only is not None and id(p) not in only:
            continue
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local_bytes(value)
    return total


def memory_report(module, optimizer, stage: int, offload: bool, nvme=None, offloaded_ids=None) -> Dict[str, int]:
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
    if nvme is not None:  # the state in memory: scalars and the host buffers
        o_bytes += nvme.resident_bytes()
    if offloaded_ids and not (offload and all(id(p) in offloaded_ids for p in params)):
        moved = [p for p in params if id(p) in offloaded_ids]
        state = _optimizer_state_bytes(optimizer, offloaded_ids)
        offloaded = state
        o_bytes -= state
        if offload:  # stages 2/3: those units' parameter shards and gradients live there too
            p_local = sum(_local_bytes(p) for p in moved)
            g_local = sum(_local_bytes(p) for p in moved if p.requires_grad)
            offloaded += p_local + g_local
            p_bytes -= p_local if stage == 3 else 0
            g_bytes -= g_local
    elif offload:
        offloaded = local + trainable_local + o_bytes
        p_bytes = full if stage == 2 else 0
        g_bytes = o_bytes = 0
    elif nvme is not None:
        offloaded, o_bytes = o_bytes, 0
    out = {
        "parameters": p_bytes,
        "gradients": g_bytes,
        "optimizer_state": o_bytes,
        "total": p_bytes + g_bytes + o_bytes,
        "offloaded": offloaded,
    }
    if nvme is not None:
        out["nvme"] = nvme.disk_bytes()
    return out
