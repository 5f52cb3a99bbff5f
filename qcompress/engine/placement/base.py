"""How the model lives on the ranks: the base every placement extends (one process, no wrapper).

A placement is chosen once (placement/__init__.py's table) from the config and the world, and
owns what differs from one way of spreading the model to another: splitting it over a mesh, the
data-parallel wrapper, the tensors the optimizer steps and how it is built (with its NVMe or CPU
offload), the global gradient norm, whole weights for the compression scheduler, the optimizer
layout of checkpoints, and what the memory and timing reports say. The engine keeps the training
rhythm and asks its placement; a new placement is one subclass and one row of the table.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ...config.onebit import is_onebit
from ...errors import ConfigError
from ..memory import memory_report
from ..offload import OptimizerOffload
from ..optimizers import build_optimizer

log = logging.getLogger("qcompress.engine")

_INSTANCE_SHARDED = (
    "a ready optimizer instance holds the unsharded parameters, but stage {stage} shards them; "
    "pass a factory instead, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)"
)


def check_client_optimizer(optimizer, cfg) -> None:
    """initialize(optimizer=...) against the config, before any process group exists."""
    if optimizer is None:
        return
    if cfg.optimizer is not None:
        raise ConfigError(
            "optimizer",
            f"the config has an optimizer section ({cfg.optimizer.type}) and "
            "initialize() got optimizer=...; keep one of them (DeepSpeed refuses both too)",
        )
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TypeError(
            "initialize(optimizer=...) takes a torch.optim.Optimizer or a callable params -> "
            f"Optimizer, got {type(optimizer).__name__}"
        )
    stage = cfg.zero_optimization.stage
    if isinstance(optimizer, torch.optim.Optimizer) and stage >= 2:
        raise ConfigError("zero_optimization.stage", _INSTANCE_SHARDED.format(stage=stage))


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state (ZeroRedundancyOptimizer keeps it in .optim)."""
    return getattr(optimizer, "optim", optimizer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_sumsq(grads: List[torch.Tensor], device) -> torch.Tensor:
    """The squared norm (float64) of the tensors this rank holds."""
    sumsq = torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([g for g in grads if g.numel() > 0]) if grads else []
    if norms:
        sumsq = torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()
    return sumsq


def nonfinite(sumsq: torch.Tensor) -> torch.Tensor:
    """1.0 (float64) when the squared norm is inf or NaN: the fp16 overflow flag."""
    flag = torch.zeros((), dtype=torch.float64, device=sumsq.device)
    flag += (~torch.isfinite(sumsq)).to(torch.float64)
    return flag


@dataclass(frozen=True)
class Ranks:
    """Where the engine runs, as every placement reads it."""

    cfg: Any  # the loaded Config
    rank: int
    world_size: int
    device: torch.device
    parallel: Any  # parallel.mesh.ParallelMesh: the (pp, dp, tp) sizes, the mesh when split
    traffic: Any  # engine.traffic.Traffic: counts what the placement sends


class Placement:
    """One process: the model itself, the optimizer on its parameters, nothing to reduce."""

    sharded = False  # parameters are FSDP2 shards between steps
    offload = False  # FSDP2's CPUOffloadPolicy holds (some) units on the CPU
    comm_label = "allreduce"  # wall_clock_breakdown's name for the gradient communication
    backward_note = ""  # what wall_clock_breakdown's backward time includes besides compute

    def __init__(self, ranks: Ranks):
        self.cfg = ranks.cfg
        self.rank, self.world_size, self.device = ranks.rank, ranks.world_size, ranks.device
        self.parallel, self.traffic = ranks.parallel, ranks.traffic
        self.stage = ranks.cfg.zero_optimization.stage
        self.onebit = is_onebit(ranks.cfg.optimizer)
        self.group = None  # the world: checkpoints and the gradient norm span all ranks
        self.pipeline = self.tp_plan = None
        self.module: Optional[nn.Module] = None
        self.wrapped: Optional[nn.Module] = None
        self.timer = None  # .seconds: the gradient communication, taken out of backward
        self.nvme = None  # engine/nvme.py: the optimizer state in files
        self.optimizer_offload: Optional[OptimizerOffload] = None  # stage 1: engine/offload.py
        self.offloaded_ids: Set[int] = set()
        self.param_names: Dict[nn.Parameter, str] = {}
        self._names_before: Dict[int, str] = {}

    # --- the model on the ranks ------------------------------------------------------------
    def split(self, model: nn.Module, compression_scheduler, micro_batches: int) -> None:
        """Keep this rank's part of the model (after rank 0's model reached every rank)."""

    def wrap(self, model: nn.Module, skips_blocks: bool = False) -> nn.Module:
        """The module the engine runs forward through. skips_blocks: progressive layer drop leaves
        whole blocks without a gradient in some steps."""
        self.module = model
        self._names_before = {id(p): n for n, p in model.named_parameters()}
        self.wrapped = self._wrap(model, skips_blocks)
        self.param_names = {p: n for n, p in model.named_parameters()}
        return self.wrapped

    def _wrap(self, model: nn.Module, skips_blocks: bool) -> nn.Module:
        return model

    @property
    def checkpoint_root(self) -> nn.Module:
        """The module whose names a checkpoint uses: the whole model's (a pipeline's data-parallel
        wrapper wraps the stage module, whose names would differ from one mesh to another)."""
        return self.module if self.pipeline is not None else self.wrapped

    def whole_weights(self):
        """Context: compress-aware modules hold whole weights (see Engine.with_full_weights)."""
        return contextlib.nullcontext()

    # --- the optimizer's view --------------------------------------------------------------
    def build_optimizer(self, model_parameters=None, client=None):
        """The optimizer (from the config, or initialize's optimizer=...) over the wrapped model's
        parameters, with the config's NVMe or CPU offload of its state attached."""
        params = self._optimizer_params(self._resolve_params(model_parameters))
        opt = self._client_optimizer(params, client) if client is not None else self._config_optimizer(params)
        zero = self.cfg.zero_optimization
        if zero.offload_optimizer.device == "nvme":  # checked before training
            from ..nvme import attach

            self.nvme = attach(
                local_optimizer(opt),
                zero.offload_optimizer,
                zero.sub_group_size,
                int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            )
        self._attach_offload(opt)
        return opt

    def _attach_offload(self, opt) -> None:
        off = self.cfg.zero_optimization.offload_optimizer
        if off.device == "cpu":
            self.optimizer_offload = OptimizerOffload(local_optimizer(opt), off.ratio, self.pin_memory())
            self.offloaded_ids = self.optimizer_offload.ids

    def pin_memory(self) -> bool:
        """offload_*.pin_memory: page-locked host memory for the copies to and from a GPU."""
        zero = self.cfg.zero_optimization
        pin = zero.offload_optimizer.pin_memory or zero.offload_param.pin_memory
        if pin and self.device.type != "cuda" and self.rank == 0:
            log.warning(
                "zero_optimization.offload_*.pin_memory: training on %s, so nothing is copied to or "
                "from a GPU; host memory stays pageable",
                self.device,
            )
        return pin and self.device.type == "cuda"

    def _resolve_params(self, model_parameters):
        """The optimizer's params (or param groups), mapped onto the wrapped model's parameters
        (FSDP2 replaces them with sharded DTensors)."""
        now = dict(self.module.named_parameters())
        if model_parameters is None:
            return [p for p in now.values() if p.requires_grad]

        def remap(p):
            name = self._names_before.get(id(p))
            if name is None:
                if any(p is q for q in now.values()):
                    return p
                raise ValueError("model_parameters holds a tensor that is not a parameter of the model")
            return now[name]

        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [dict(g, params=[remap(p) for p in g["params"]]) for g in items]
        return [remap(p) for p in items]

    def _optimizer_params(self, params):
        """The tensors the optimizer steps: the parameters themselves, unless a placement says."""
        return params

    def _config_optimizer(self, params):
        opt_cfg = self.cfg.optimizer
        if opt_cfg is None:
            raise ConfigError(
                "optimizer",
                "initialize() needs an optimizer: an `optimizer` section (type and "
                "params) in the config, or initialize(..., optimizer=...) as DeepSpeed takes one",
            )
        if self.onebit and self.stage == 1 and self.world_size > 1:
            # 1-bit optimizers shard their own state by the compressed all-reduce's chunks.
            return build_optimizer(params, opt_cfg, group=self.parallel.dp_group, shard_state=True)
        return build_optimizer(params, opt_cfg, group=self.parallel.dp_group)  # the world unless split

    def _client_optimizer(self, params, client):
        """A user's optimizer: built by its factory on the (wrapped) parameters, or used as given."""
        if isinstance(client, torch.optim.Optimizer):
            if self.stage == 1 and self.world_size > 1:  # stages 2/3: refused before wrapping
                raise ConfigError("zero_optimization.stage", _INSTANCE_SHARDED.format(stage=self.stage))
            own = {id(p) for p in self.module.parameters()}
            if any(id(p) not in own for g in client.param_groups for p in g["params"]):
                raise ValueError(
                    "initialize(optimizer=...): the optimizer holds tensors that are not parameters "
                    "of this model (build it after init_compression, on model.parameters())"
                )
            opt = client
        else:
            opt = self._from_factory(params, client)
        inner = local_optimizer(opt)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...) must build a torch.optim.Optimizer, got {type(inner).__name__}")
        if getattr(inner, "allreduce_gradients", None) is not None:
            raise ConfigError(
                "optimizer",
                f"{type(inner).__name__} exchanges compressed gradients itself; declare "
                "it in the config's optimizer section so the engine wires its communication",
            )
        return opt

    def _from_factory(self, params, factory):
        return factory(params)

    @property
    def optimizer_layout(self) -> str:
        """How checkpoints store the optimizer state (engine/checkpoint.py): "per_rank" for the
        1-bit optimizers (their compression errors differ per rank), else "dcp"."""
        return "per_rank" if self.onebit else "dcp"

    # --- at each optimizer step ------------------------------------------------------------
    def set_grad_sync(self, sync: bool) -> None:
        """Whether the coming backward communicates gradients (the boundary micro-step only)."""

    def before_step(self, trainable: List[nn.Parameter], optimizer) -> None:
        """At an accumulation boundary, before the gradient norm."""

    def after_optimizer_step(self, optimizer) -> None:
        """Right after optimizer.step() (not on a skipped fp16 step)."""

    def after_zero_grad(self) -> None:
        """After optimizer.zero_grad at the end of a boundary."""

    def grad_sumsq(
        self, params: List[nn.Parameter], allreduce_gradients: bool, fp16: bool
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(squared global gradient norm, fp16 overflow flag on any rank), float64 tensors, of
        the gradients of `params`. allreduce_gradients False: each rank holds its own gradients
        (a 1-bit optimizer between its exchanges)."""
        sumsq = local_sumsq([_local(p.grad) for p in params], self.device)
        return sumsq, nonfinite(sumsq)

    def _sum_over_world(self, contrib: torch.Tensor, flag: torch.Tensor):
        """One all-reduce of (this rank's share of the squared norm, its overflow flag)."""
        buf = torch.stack([torch.nan_to_num(contrib, nan=0.0, posinf=0.0), flag])
        dist.all_reduce(buf, group=self.group)
        self.traffic.all_reduce("engine", buf.numel() * buf.element_size())
        return buf[0], buf[1]

    # --- reports ---------------------------------------------------------------------------
    def untimed_comm(self) -> Optional[float]:
        """The gradient communication time reported when no timer measures it: 0 with nothing to
        communicate, None (counted inside backward) otherwise."""
        return None if self.world_size > 1 else 0.0

    def uncounted(self) -> Optional[str]:
        """What engine.comm_bytes() cannot count on this torch, or None."""
        return None

    def memory_report(self, optimizer) -> Dict[str, int]:
        return memory_report(
            self.module, optimizer, self.stage, self.offload, nvme=self.nvme, offloaded_ids=self.offloaded_ids
        )
