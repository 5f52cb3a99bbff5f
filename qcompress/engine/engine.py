"""The training engine behind qcompress.initialize (DeepSpeed's rhythm on torch.distributed).

Call `loss = f(engine(x)); engine.backward(loss); engine.step()` for every micro-batch. The
optimizer steps at accumulation boundaries; gradients are only communicated on the boundary
micro-step (DDP's require_backward_grad_sync / FSDP2's set_requires_gradient_sync).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import as_config
from ..nn import kv_cache
from ..errors import ConfigError
from . import checkpoint as ckpt
from . import checkpointing
from .comm_timeout import (apply_to_existing_group, backward_collective, collective, forward_collective,
                           guarded, timeout_of)
from .batch import resolve_batch
from .compile import compile_model
from .lr_schedules import build_lr_scheduler
from .memory import memory_report
from .monitor import Monitor
from .optimizers import build_optimizer, is_onebit
from .offload import OptimizerOffload
from .precision import LossScaler, autocast_dtype
from .save16 import save_16bit_model
from .seeding import seed_everything
from .traffic import Traffic, count_fsdp, nbytes_of
from ..parallel import apply_tensor_parallel, build_mesh
from ..parallel.pipeline import build_pipeline
from ..parallel.data_parallel import LocalShards, dp_whole_weights, replicate_over, wrap_root
from ..parallel.grad_norm import share_of_sumsq
from ..parallel.train_batch import train_batch
from .zero import (TimedReduceScatter, broadcast_module_state, build_zero1, comm_dtype, full_weights,
                   time_reduce_scatter, wrap_ddp, wrap_fsdp)

log = logging.getLogger("qcompress.engine")


def _setup_distributed(stage: int, cfg=None, cuda: Optional[bool] = None):
    """(rank, world_size, backend): reuse a process group, else torchrun's env, else one process.
    A group created here uses nccl when the engine trains on CUDA (`cuda`; None: when a GPU is
    there), else gloo.

    FSDP2 needs a process group even alone, so stages 2/3 get a private 1-rank gloo group.
    Groups created here wait at most comm_timeout_s for a collective (comm_timeout.py)."""
    if dist.is_available() and dist.is_initialized():
        apply_to_existing_group(cfg)
        return dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if cuda is None:
        cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timeout_of(cfg))   # env:// from torchrun
        return dist.get_rank(), world, backend
    if stage >= 2:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout_of(cfg))
        return 0, 1, backend
    return 0, 1, None


def resolve_device(device) -> Optional[torch.device]:
    """initialize(device=...): None (automatic), "cpu", "cuda" (cuda:LOCAL_RANK) or "cuda:N"."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: qcompress trains on 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda or 'none'})")
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _pick_device(backend: Optional[str], asked: Optional[torch.device] = None) -> torch.device:
    """The asked device, else cuda:LOCAL_RANK when a GPU is there and the group allows it, else cpu."""
    if asked is not None:
        if asked.type == "cuda":
            torch.cuda.set_device(asked)
        return asked
    if torch.cuda.is_available() and backend in (None, "nccl"):
        idx = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


_INSTANCE_SHARDED = ("a ready optimizer instance holds the unsharded parameters, but stage {stage} shards them; "
                     "pass a factory instead, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)")


def _check_client_optimizer(optimizer, cfg) -> None:
    if optimizer is None:
        return
    if cfg.optimizer is not None:
        raise ConfigError("optimizer", f"the config has an optimizer section ({cfg.optimizer.type}) and "
                          "initialize() got optimizer=...; keep one of them (DeepSpeed refuses both too)")
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TypeError("initialize(optimizer=...) takes a torch.optim.Optimizer or a callable params -> "
                        f"Optimizer, got {type(optimizer).__name__}")
    stage = cfg.zero_optimization.stage
    if isinstance(optimizer, torch.optim.Optimizer) and stage >= 2:  # before any process group exists
        raise ConfigError("zero_optimization.stage", _INSTANCE_SHARDED.format(stage=stage))



def _has_scheduled_parameters(model) -> bool:
    """Compression Parameters that join the graph only once their technique starts (topk pruning
    scores, learned activation / weight ranges): before that DDP must expect unused parameters."""
    from ..nn.ranges import range_parameter_names
    for m in model.modules():
        if any(getattr(st, "scores_name", None) for st in getattr(m, "qc_pruning", {}).values()):
            return True
        if range_parameter_names(m):
            return True
    return False


RANKS_DIFFER = "_qc_ranks_differ"   # set on the model while ranks hold different weights


def _refuse_unsynced_eval(module, args):
    if not module.training and module.__dict__.get(RANKS_DIFFER):
        raise RuntimeError("the ranks hold different weights (0/1 Adam's local steps since its last "
                           "synchronization): call engine.eval() or engine.synchronize_ranks() on every "
                           "rank before evaluating")

class Engine:
    """Returned by `qcompress.initialize`; see the module docstring for the call rhythm."""

    def __init__(self, model: nn.Module, cfg, model_parameters=None, optimizer=None, device=None):
        asked = resolve_device(device)
        cfg = as_config(cfg)
        cfg.refuse_auto()
        self.config = cfg
        _check_client_optimizer(optimizer, cfg)
        zero = cfg.zero_optimization
        self.stage = zero.stage
        self.nvme_offload = zero.offload_optimizer.device == "nvme"
        # CPUOffloadPolicy (stages 2/3): parameters, gradients and the update on the CPU (with NVMe,
        # the optimizer state streams from disk into that CPU update); stage 1: engine/offload.py
        self.offload = zero.stage >= 2 and (zero.offload_optimizer.device == "cpu" or zero.offload_param.device
                                            == "cpu" or self.nvme_offload)
        self.onebit = is_onebit(cfg.optimizer)
        if self.onebit and self.nvme_offload:
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              f"{cfg.optimizer.type} keeps compression errors beside its moments and steps them "
                              "all at once; 'nvme' offload streams plain optimizers (Adam, AdamW, Lamb, SGD) only")
        if self.onebit and zero.offload_optimizer.device == "cpu":
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              f"{cfg.optimizer.type} runs its compressed all-reduce inside its step, on the "
                              "training device; 'cpu' offload steps plain optimizers (Adam, AdamW, Lamb, SGD) only")
        if self.onebit and self.stage >= 2:
            raise ConfigError("zero_optimization.stage",
                              f"{cfg.optimizer.type} needs the full local gradient and momentum on every rank "
                              f"for its compressed all-reduce; stage {self.stage} shards them (FSDP2). "
                              "Use stage 0 or 1")
        self.rank, self.world_size, backend = _setup_distributed(
            self.stage, cfg, None if asked is None else asked.type == "cuda")
        self.traffic = Traffic(self.world_size)             # comm_bytes(): every byte this engine moves
        self.group = None                                   # the default (world) group
        self.device = _pick_device(backend, asked)
        # DeepSpeed's 3D sizes: the (pp, dp, tp) mesh; batches and gradients count dp replicas
        self.parallel = build_mesh(cfg, self.world_size, model, self.device.type)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                          cfg.gradient_accumulation_steps, self.data_parallel_world_size)
        self.precision = cfg.precision
        self._autocast = autocast_dtype(self.precision)
        self.loss_scaler = LossScaler.from_config(cfg.fp16) if self.precision == "fp16" else None
        self.gradient_clipping = float(cfg.gradient_clipping)
        self.wall_clock_breakdown = bool(cfg.wall_clock_breakdown)
        if self.wall_clock_breakdown and not log.handlers and not logging.getLogger().handlers:
            # The user asked to see timings: print them even if logging was never configured.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[qcompress] %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)

        model.to(self.device)
        self.module = model
        self.pld = self._setup_pld(model, cfg)     # before wrapping: it swaps the blocks' classes
        # before wrapping too: FSDP2's hooks then stay outside each block's recompute
        self.checkpointed_blocks = checkpointing.from_config(model, cfg)
        # Before wrapping: the scheduler applies step 0 (it may write weights) on whole tensors.
        self.compression_scheduler = self._make_compression_scheduler(model, cfg)
        if self.world_size > 1:
            # Every rank starts from rank 0's model, including compression state that
            # init_compression derived from each rank's own initial weights.
            with collective("initialize: the broadcast of rank 0's model", cfg.comm_timeout_s, self.world_size):
                broadcast_module_state(model, traffic=self.traffic)
            self._broadcast_compression_state()
        self.tp_plan = self.pipeline = None
        if self.parallel.mesh is not None:   # split after the broadcast: every part is rank 0's
            if self.parallel.shape.pp > 1:   # this rank keeps its stage's blocks only
                self.pipeline = build_pipeline(model, self.parallel, cfg.pipeline,
                                               self.gradient_accumulation_steps, self.device)
                if self.compression_scheduler is not None:   # the other stages' blocks are theirs
                    self.compression_scheduler.keep_modules_of(model)
            if self.parallel.shape.tp > 1:
                self.tp_plan = apply_tensor_parallel(model, self.parallel.mesh["tp"], cfg.tensor_parallel)
            # self.group stays the world (checkpoints span all ranks); replicas reduce over parallel.dp_group
        names_before = {id(p): n for n, p in model.named_parameters()}
        offloaded = []

        self._hook = None
        # a split model's ZeRO-1 shards its optimizer state with FSDP2 on the dp sub-mesh, as stage 2:
        # ZeroRedundancyOptimizer broadcasts plain tensors, not DTensor parameters
        self.sharded = self.stage >= 2 or (self.stage == 1 and self.parallel.mesh is not None and not self.onebit)
        if self.parallel.mesh is not None and not self.sharded:
            # replicas of a split model average gradients over the mesh's dp dimension only; the 1-bit
            # optimizers exchange over it themselves (LocalShards below)
            self.wrapped = (model if self.onebit or self.data_parallel_world_size == 1 else
                            replicate_over(wrap_root(self, model), self.parallel.mesh["dp"],
                                           comm_dtype(cfg.communication_data_type)))
        elif self.sharded:
            partial = (zero.offload_optimizer.ratio if zero.offload_param.device == "none"
                       and zero.offload_optimizer.device == "cpu" else 1.0)
            self.wrapped, offloaded = wrap_fsdp(wrap_root(self, model), self.device, self.group, self.stage,
                                                self.offload, cfg.communication_data_type,
                                                pin_memory=self._pin(zero), offload_ratio=partial,
                                                mesh=self.parallel.dp_mesh)
            timer = TimedReduceScatter() if self.wall_clock_breakdown else None
            self._fsdp_counted = count_fsdp(model, self.traffic, timer)
            if self._fsdp_counted:
                self._hook = timer
            elif self.wall_clock_breakdown:
                self._hook = time_reduce_scatter(model)
        elif self.data_parallel_world_size > 1:
            self.wrapped, self._hook = wrap_ddp(model, self.device, self.group, self.world_size,
                                                zero.reduce_bucket_size, cfg.communication_data_type,
                                                self.wall_clock_breakdown,
                                                find_unused_parameters=(self.pld is not None or
                                                                        _has_scheduled_parameters(model)),
                                                traffic=self.traffic)
        else:
            self.wrapped = model
        # after wrapping, so DDP / FSDP2 run inside the compiled graph (DeepSpeed's engine.compile)
        self.compiled = compile_model(self.wrapped, cfg.compile)
        self.param_names = {p: n for n, p in model.named_parameters()}
        params = self._resolve_params(model, model_parameters, names_before)
        self.local_shards = None      # 1-bit optimizers on a split model: each rank's local tensors
        if self.onebit and self.parallel.mesh is not None:
            self.local_shards = LocalShards(params)
            params = self.local_shards.params
        self.optimizer = self._make_optimizer(params, cfg, optimizer, model)
        self.nvme = self._attach_nvme(zero) if self.nvme_offload else None
        self.optimizer_offload = None     # stage 1: engine/offload.py
        if zero.offload_optimizer.device == "cpu" and not self.sharded:
            self.optimizer_offload = OptimizerOffload(self._local_optimizer(), zero.offload_optimizer.ratio,
                                                      self._pin(zero))
        self._offloaded_ids = ({id(p) for p in offloaded} if self.sharded and self.offload else
                               self.optimizer_offload.ids if self.optimizer_offload is not None else set())
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.scheduler)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._observers = self._static_observers(model)
        self._has_buffers = any(True for _ in model.buffers())

        self.global_steps = 0        # optimizer boundaries, skipped fp16 steps included (as DeepSpeed)
        self.micro_steps = 0
        self._accumulated = 0        # micro-batches since the last boundary
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: Optional[float] = None
        self._timers: Dict[str, float] = {"forward": 0.0, "backward": 0.0, "allreduce": 0.0, "step": 0.0}
        self.last_timings: Dict[str, Optional[float]] = {}
        # DeepSpeed's tensorboard / csv_monitor sections; writes on rank 0 at each optimizer step
        self.monitor = Monitor.from_config(cfg, self.rank)
        self._step_losses = []       # detached losses given to backward since the last boundary
        self._eval_guard = None      # forward pre-hook refusing eval on ranks with their own weights
        if cfg.seed is not None:     # last: what the caller draws next is the seed's stream, on every rank
            seed_everything(cfg.seed)

    # --- construction helpers ----------------------------------------------------------------
    @staticmethod
    def _setup_pld(model, cfg):
        """The model's progressive-layer-drop schedule: applied here when the config enables it and
        init_compression did not (a DeepSpeed script calls initialize only)."""
        from ..nn.pld import apply_pld, pld_schedule
        sched = pld_schedule(model)
        if sched is None and cfg.progressive_layer_drop.enabled:
            sched = apply_pld(model, cfg.progressive_layer_drop)
        if sched is not None:
            sched.start_step(0, resumed=True)
        return sched

    def _pin(self, zero) -> bool:
        """offload_*.pin_memory: page-locked host memory for the copies to and from a GPU."""
        pin = zero.offload_optimizer.pin_memory or zero.offload_param.pin_memory
        if pin and self.device.type != "cuda" and self.rank == 0:
            log.warning("zero_optimization.offload_*.pin_memory: training on %s, so nothing is copied to or "
                        "from a GPU; host memory stays pageable", self.device)
        return pin and self.device.type == "cuda"

    @staticmethod
    def _make_compression_scheduler(model, cfg):
        try:
            from ..schedule import CompressionScheduler
        except ImportError:
            return None
        return CompressionScheduler(model, cfg)

    def _broadcast_compression_state(self) -> None:
        sched = self.compression_scheduler
        if sched is None:
            return
        from .serialize import flatten, unflatten
        tensors: Dict[str, torch.Tensor] = {}
        skel = flatten(sched.state_dict(), "c", tensors)
        synced = {}
        for key in sorted(tensors):
            t = tensors[key].to(self.device).contiguous()
            dist.broadcast(t, src=0, group=self.group)
            self.traffic.broadcast("broadcast", t.numel() * t.element_size(), self.rank == 0)
            synced[key] = t.to(tensors[key].device)
        sched.load_state_dict(unflatten(skel, synced))

    @staticmethod
    def _resolve_params(model, model_parameters, names_before):
        """The optimizer's params (or param groups), mapped onto the wrapped model's parameters
        (FSDP2 replaces them with sharded DTensors)."""
        now = dict(model.named_parameters())
        if model_parameters is None:
            return [p for p in now.values() if p.requires_grad]

        def remap(p):
            name = names_before.get(id(p))
            if name is None:
                if any(p is q for q in now.values()):
                    return p
                raise ValueError("model_parameters holds a tensor that is not a parameter of the model")
            return now[name]
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [dict(g, params=[remap(p) for p in g["params"]]) for g in items]
        return [remap(p) for p in items]

    def _make_optimizer(self, params, cfg, client, model):
        if client is not None:
            return self._client_optimizer(params, client, model)
        opt_cfg = cfg.optimizer
        if opt_cfg is None:
            raise ConfigError("optimizer", "initialize() needs an optimizer: an `optimizer` section (type and "
                              "params) in the config, or initialize(..., optimizer=...) as DeepSpeed takes one")
        if self.stage == 1 and self.world_size > 1 and not self.sharded:
            if self.onebit:
                # 1-bit optimizers shard their own state by the compressed all-reduce's chunks.
                return build_optimizer(params, opt_cfg, group=self.parallel.dp_group, shard_state=True)
            return build_zero1(params, lambda groups: build_optimizer(groups, opt_cfg), self.group)
        return build_optimizer(params, opt_cfg, group=self.parallel.dp_group)   # the world unless split

    def _attach_nvme(self, zero):
        """Optimizer state in files under nvme_path (engine/nvme.py); checked before training."""
        from .nvme import attach
        local = getattr(self.optimizer, "optim", self.optimizer)    # ZeroRedundancyOptimizer's shard
        return attach(local, zero.offload_optimizer, zero.sub_group_size,
                      int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def _client_optimizer(self, params, client, model):
        """A user's optimizer: built by its factory on the (wrapped) parameters, or used as given."""
        if isinstance(client, torch.optim.Optimizer):
            if self.stage == 1 and self.world_size > 1:  # stages 2/3: refused before wrapping
                raise ConfigError("zero_optimization.stage", _INSTANCE_SHARDED.format(stage=self.stage))
            own = {id(p) for p in model.parameters()}
            if any(id(p) not in own for g in client.param_groups for p in g["params"]):
                raise ValueError("initialize(optimizer=...): the optimizer holds tensors that are not parameters "
                                 "of this model (build it after init_compression, on model.parameters())")
            opt = client
        elif self.stage == 1 and self.world_size > 1 and not self.sharded:
            opt = build_zero1(params, client, self.group)
        else:
            opt = client(params)
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local one
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...) must build a torch.optim.Optimizer, got {type(inner).__name__}")
        if getattr(inner, "allreduce_gradients", None) is not None:
            raise ConfigError("optimizer", f"{type(inner).__name__} exchanges compressed gradients itself; declare "
                              "it in the config's optimizer section so the engine wires its communication")
        return opt

    @staticmethod
    def _static_observers(model):
        out = []
        for m in model.modules():
            aq = getattr(m, "qc_aq", None)
            if aq is not None and getattr(aq, "calibration", None) == "static":
                out.append(aq.observer)
        return out + kv_cache.observers(model)      # KV-cache ranges: per tensor or per head

    # --- the training rhythm -----------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last one before an optimizer step."""
        return self._accumulated + 1 >= self.gradient_accumulation_steps

    @property
    def _allreduce_gradients(self) -> bool:
        return bool(getattr(self.optimizer, "allreduce_gradients", True))

    def _set_grad_sync(self, sync: bool) -> None:
        if hasattr(self.wrapped, "set_requires_gradient_sync"):   # FSDP2: fully_shard or replicate
            self.wrapped.set_requires_gradient_sync(sync)
            if self.stage == 2:
                # ZeRO-2 keeps whole weights: between accumulation micro-steps they stay gathered,
                # so the next forward needs no all-gather; the boundary reshards for the step.
                self.wrapped.set_reshard_after_backward(sync)
        elif self.wrapped is not self.module:
            self.wrapped.require_backward_grad_sync = sync

    @guarded(forward_collective)
    def forward(self, *args, **kwargs):
        self._set_grad_sync(self.is_gradient_accumulation_boundary() and self._allreduce_gradients)
        t0 = time.perf_counter()
        ctx = (torch.autocast(self.device.type, dtype=self._autocast) if self._autocast is not None
               else contextlib.nullcontext())
        with ctx:
            out = self.wrapped(*args, **kwargs)
        self._timers["forward"] += self._elapsed(t0)
        return out

    __call__ = forward

    @guarded(backward_collective)
    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate loss / accumulation steps (× the fp16 loss scale); returns the loss."""
        scale = 1.0 / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        t0 = time.perf_counter()
        hook_before = self._hook.seconds if self._hook is not None else 0.0
        if self.monitor.enabled:
            self._step_losses.append(loss.detach().float().mean())
        (loss.float() * scale if scale != 1.0 else loss).backward()
        took = self._elapsed(t0)
        if self._hook is not None:
            comm = self._hook.seconds - hook_before
            self._timers["allreduce"] += comm
            took -= comm
        self._timers["backward"] += took
        return loss

    @guarded("engine.step: the all-reduce of the gradient norm / fp16 overflow flag and the optimizer's "
             "collectives")
    def step(self) -> None:
        """End of a micro-batch; at an accumulation boundary: unscale, clip, optimizer step,
        LR and compression schedules (skipped together on every rank on fp16 overflow)."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._accumulated += 1
        if not boundary:
            return
        self._accumulated = 0
        t0 = time.perf_counter()
        self._check_ddp_used_every_parameter()
        if self.local_shards is not None:
            self.local_shards.bind(self._local_optimizer())
        overflow = self._unscale_and_clip()
        if overflow:
            self.skipped_steps += 1
            if self.rank == 0:
                # a scale that cannot go down (static, or at min_loss_scale) overflows again: WARNING
                s = self.loss_scaler
                stuck = not s.dynamic or s.scale <= s.min_scale
                (log.warning if stuck else log.info)(
                    "step %d: fp16 gradient overflow, step skipped; loss scale %g -> %g"
                    + (" (it cannot go lower: lower fp16.loss_scale / min_loss_scale, or use 0 for "
                       "dynamic scaling)" if stuck else ""),
                    self.global_steps + 1, s.scale, self._peek_scale_after_overflow())
        else:
            self.optimizer.step()
            self._count_zero1()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._sync_state()            # forwards moved buffers and ranges even on a skipped step
        if not overflow and self.compression_scheduler is not None:
            # after the sync: learned activation ranges start from the ranks' common static range
            self._compression_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._mark_ranks()
        self.optimizer.zero_grad(set_to_none=True)
        if self.local_shards is not None:
            self.local_shards.clear()
        self.global_steps += 1
        self.global_samples += self.train_batch_size
        if self.pld is not None:
            self.pld.start_step(self.global_steps)   # theta for the next step, as DeepSpeed's update_state
        self._timers["step"] += self._elapsed(t0)
        if self.rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            log.info("step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr())
        self._report_timers()
        if self.monitor.enabled:
            self._write_monitor_events()

    def _check_ddp_used_every_parameter(self) -> None:
        """DDP (stages 0/1) all-reduces a bucket only once all its parameters got a gradient: a
        parameter the loss did not use leaves its bucket unreduced (those gradients stay this rank's
        own) and the next forward fails with DDP's advice to pass find_unused_parameters=True, which
        the engine's user cannot. Refuse the step before it applies unaveraged gradients."""
        ddp = self.wrapped
        if (ddp is self.module or self.sharded or getattr(ddp, "find_unused_parameters", True)
                or not ddp.require_backward_grad_sync):
            return
        unused = [self.param_names.get(p, "?") for p in self._trainable if p.grad is None]
        if unused:
            more = f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""
            raise RuntimeError(
                f"engine.step: {len(unused)} trainable parameter(s) got no gradient in this step: "
                f"{', '.join(unused[:5])}{more}. At ZeRO stage {self.stage} DistributedDataParallel averages "
                "gradients only when every trainable parameter takes part in the loss; freeze the unused "
                "ones (requires_grad_(False)) before initialize, or use stage 2/3")

    def _write_monitor_events(self) -> None:
        """DeepSpeed's names at global_samples: the mean loss of this step's micro-batches (on
        this rank), the learning rate and the fp16 loss scale the next step uses."""
        events = []
        if self._step_losses:
            loss = torch.stack(self._step_losses).double().mean().item()
            events.append(("Train/Samples/train_loss", loss, self.global_samples))
        self._step_losses = []
        events.append(("Train/Samples/lr", self.get_lr()[0], self.global_samples))
        if self.loss_scaler is not None:
            events.append(("Train/Samples/loss_scale", self.loss_scaler.scale, self.global_samples))
        self.monitor.write_events(events)

    def _peek_scale_after_overflow(self) -> float:
        s = self.loss_scaler
        if s.dynamic and s.hysteresis_left <= 1:
            return max(s.scale / 2.0, s.min_scale)
        return s.scale

    def _unscale_and_clip(self) -> bool:
        """Global gradient norm across ranks and shards, fp16 unscale and clipping in one multiply.

        Returns True when fp16 gradients overflowed on any rank."""
        fp16 = self.loss_scaler is not None
        if not fp16 and self.gradient_clipping <= 0:
            return False
        grads = [_local(p.grad) for p in self._trainable if p.grad is not None]
        sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        local_grads = not self.sharded and not self._allreduce_gradients and self.world_size > 1
        split = self.parallel.mesh is not None
        if split:   # stages, TP shards and dp copies: each rank's share of the whole (parallel/grad_norm.py)
            sumsq = share_of_sumsq([p.grad for p in self._trainable if p.grad is not None], self.parallel.shape,
                                   self.device, replicas_agree=not local_grads)
        elif grads:
            norms = torch._foreach_norm([g for g in grads if g.numel() > 0]) if grads else []
            if norms:
                sumsq = torch.stack([n.to(self.device, torch.float64) for n in norms]).square().sum()
        flag = torch.zeros((), dtype=torch.float64, device=self.device)
        flag += (~torch.isfinite(sumsq)).to(torch.float64)
        if self.world_size > 1 and (self.sharded or local_grads or fp16 or split):
            # Shards and local gradients add up their squares; replicated DDP grads already agree.
            contrib = sumsq if (self.sharded or local_grads or split) else torch.zeros_like(sumsq)
            buf = torch.stack([torch.nan_to_num(contrib, nan=0.0, posinf=0.0), flag])
            dist.all_reduce(buf, group=self.group)
            self.traffic.all_reduce("engine", buf.numel() * buf.element_size())
            flag = buf[1]
            if self.sharded or split:
                sumsq = buf[0]
            elif local_grads:
                sumsq = buf[0] / self.world_size        # RMS over ranks of the local norms
        overflow = bool(flag.item() > 0)
        if overflow and fp16:
            self._global_grad_norm = float("inf")
            return True
        inv_scale = 1.0 / self.loss_scaler.scale if fp16 else 1.0
        norm = float(sumsq.sqrt().item()) * inv_scale
        self._global_grad_norm = norm
        coef = inv_scale
        if self.gradient_clipping > 0 and norm > 0:
            clip = self.gradient_clipping / (norm + 1e-6)
            if clip < 1.0:
                coef *= clip
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return False

    def get_global_grad_norm(self) -> Optional[float]:
        """Norm of the (unscaled, unclipped) averaged gradient at the last boundary; computed only
        when gradient_clipping or fp16 is on."""
        return self._global_grad_norm

    # --- bytes on the wire -------------------------------------------------------------------
    def comm_bytes(self) -> Dict[str, object]:
        """This rank's bytes sent and received by everything the engine runs since it was built (or
        reset_comm_bytes()): {"bytes_sent", "bytes_received", "by_kind": {kind: {...}}} with kinds
        ddp, fsdp, broadcast, engine, optimizer, zero1 (rules: qcompress.engine.traffic).
        Unlike qcompress.comm.stats(), it includes DDP's / FSDP2's own gradient traffic."""
        out = self.traffic.snapshot()
        if self.sharded and not getattr(self, "_fsdp_counted", True):
            out["uncounted"] = "fsdp (this torch has no set_custom_reduce_scatter / set_custom_all_gather)"
        return out

    def reset_comm_bytes(self) -> None:
        self.traffic.reset()

    def _count_zero1(self) -> None:
        """ZeroRedundancyOptimizer broadcasts each rank's updated partition to the others."""
        opt = self.optimizer
        owner = getattr(opt, "_param_to_rank", None)
        if owner is None or self.world_size == 1:
            return
        mine = nbytes_of(p for p, r in owner.items() if r == self.rank)
        rest = nbytes_of(p for p, r in owner.items() if r != self.rank)
        self.traffic.add("zero1", (self.world_size - 1) * mine, rest)

    # --- keeping ranks consistent ------------------------------------------------------------
    def _compression_step(self) -> None:
        self.with_full_weights(self.compression_scheduler.step)

    def with_full_weights(self, fn, *args):
        """Run fn (which reads or writes compress-aware modules' weights outside forward, e.g. the
        compression scheduler) with whole weights in place of FSDP2 shards."""
        if self.parallel.mesh is not None:    # whole over dp; tensor-parallel shards stay DTensors
            with dp_whole_weights(self.module, self.parallel):
                return fn(*args)
        if not self.sharded:
            return fn(*args)
        with full_weights(self.module, self.rank, self.world_size, self.device):
            return fn(*args)

    @torch.no_grad()
    def _sync_state(self) -> None:
        """Ranks see different data, so buffers and static activation ranges drift apart. Like DDP's
        broadcast_buffers, rank 0's buffers win; static ranges are averaged. Once per optimizer step."""
        if self.data_parallel_world_size == 1:
            return
        if self._has_buffers:
            bufs = list(self.module.buffers())
            for dtype in dict.fromkeys(b.dtype for b in bufs):   # same order on every rank
                same = [b for b in bufs if b.dtype == dtype]
                flat = torch.cat([b.reshape(-1) for b in same])
                # over the replicas of this rank's part of the model (the world when nothing is split)
                dist.broadcast(flat, src=self.parallel.dp_src, group=self.parallel.dp_group)
                self.traffic.broadcast("broadcast", flat.numel() * flat.element_size(), self.parallel.dp_rank == 0)
                torch._foreach_copy_(same, [v.view_as(b) for v, b in
                                            zip(torch.split(flat, [b.numel() for b in same]), same)])
        live = [o for o in self._observers if o.initialized]
        if live:
            # (min, max) per Linear; (min, max, seen) per expert of fused experts (nn/expert_ranges.py)
            parts = [o.sync_tensor().to(self.device, torch.float32).reshape(-1) for o in live]
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=self.parallel.dp_group)
            self.traffic.all_reduce("engine", flat.numel() * flat.element_size())
            for o, t in zip(live, torch.split(flat, [p.numel() for p in parts])):
                o.sync_from(t, self.data_parallel_world_size)

    # --- timing ------------------------------------------------------------------------------
    def _elapsed(self, t0: float) -> float:
        if self.wall_clock_breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _report_timers(self) -> None:
        """last_timings["allreduce"] is the gradient communication (FSDP2's reduce-scatter at
        stages 2/3), taken out of "backward"; None when it could not be separated."""
        t = dict(self._timers)
        if self._hook is None:
            t["allreduce"] = None if self.world_size > 1 or self.sharded else 0.0
        self.last_timings = t
        for k in self._timers:
            self._timers[k] = 0.0
        if self.wall_clock_breakdown and self.rank == 0:
            comm = "reduce-scatter" if self.sharded else "allreduce"
            inside = " (incl. FSDP2 weight all-gathers)" if self.stage == 3 else ""

            def ms(v):
                return "n/a (counted in backward)" if v is None else f"{v * 1e3:.2f} ms"
            pld = "" if self.pld is None else f" | blocks run {100 * self.pld.last_share:.1f}%"
            log.info("step %d: forward %s | backward %s%s | %s %s | step %s%s", self.global_steps,
                     ms(t["forward"]), ms(t["backward"]), inside, comm, ms(t["allreduce"]), ms(t["step"]), pld)

    # --- modes and accessors -----------------------------------------------------------------
    @property
    def data_parallel_world_size(self) -> int:
        """Replicas reading their own data: world / (tensor x pipeline parallel sizes)."""
        return self.parallel.shape.dp

    @property
    def data_parallel_rank(self) -> int:
        """Which replica this rank belongs to (the ranks of one replica feed the same data)."""
        return self.parallel.dp_rank

    def train_batch(self, data_iter):
        """DeepSpeed's pipeline-engine call: one optimizer step over gradient_accumulation_steps
        micro-batches from data_iter; the mean loss, the same on every rank (parallel/train_batch.py)."""
        return train_batch(self, data_iter)

    def train(self, mode: bool = True):
        if not mode:
            self.synchronize_ranks()
        self.module.train(mode)
        return self

    def eval(self):
        """Evaluation mode, after synchronize_ranks() (collective: every rank calls it)."""
        return self.train(False)

    # --- ranks that hold their own weights (0/1 Adam's local steps) ---------------------------
    def _local_optimizer(self):
        return getattr(self.optimizer, "optim", self.optimizer)

    @property
    def ranks_in_sync(self) -> bool:
        """False while the optimizer's local steps (0/1 Adam between its sync steps) left each rank
        its own weights."""
        return bool(getattr(self._local_optimizer(), "ranks_in_sync", True))

    def synchronize_ranks(self) -> None:
        """Collective: give every rank the same weights now (0/1 Adam: its synchronization step run
        early). eval(), save_checkpoint() and the end of `qcompress train` call it; until then an
        eval-mode forward or export_quantized of such a model refuses to run."""
        opt = self._local_optimizer()
        if not self.ranks_in_sync and hasattr(opt, "synchronize"):
            opt.synchronize()
        self._mark_ranks()

    def _mark_ranks(self) -> None:
        differ = self.world_size > 1 and not self.ranks_in_sync
        self.module.__dict__[RANKS_DIFFER] = differ
        if differ and self._eval_guard is None:
            self._eval_guard = self.module.register_forward_pre_hook(_refuse_unsynced_eval)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def memory_report(self) -> Dict[str, int]:
        """Bytes on this rank: parameters, gradients, optimizer state (see engine.memory)."""
        return memory_report(self.module, self.optimizer, self.stage, self.offload, nvme=self.nvme,
                             offloaded_ids=self._offloaded_ids)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's consolidated save (engine/save16.py). Collective: every rank calls it."""
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def counters(self) -> Dict[str, int]:
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "global_samples": self.global_samples, "skipped_steps": self.skipped_steps}

    def set_counters(self, c: Dict[str, int]) -> None:
        self.global_steps = int(c["global_steps"])
        self.micro_steps = int(c["micro_steps"])
        self.global_samples = int(c["global_samples"])
        self.skipped_steps = int(c["skipped_steps"])
        self._accumulated = 0        # checkpoints hold no partial gradients: start a fresh step
        self._step_losses = []
        if self.pld is not None:     # PLD's theta and decisions follow from the step count alone
            self.pld.start_step(self.global_steps, resumed=True)

    # --- checkpoints -------------------------------------------------------------------------
    @guarded("save_checkpoint: a barrier or the distributed checkpoint write")
    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
        """Collective: every rank calls it. Returns the checkpoint directory."""
        if self._accumulated and self.rank == 0:
            log.warning("saving a checkpoint %d micro-batches into an accumulation step: the partial "
                        "gradients are not saved; resume starts a fresh step", self._accumulated)
        self.synchronize_ranks()      # one model on every rank, whatever the optimizer's rhythm
        with self._optimizer_state_in_memory():
            return ckpt.save_checkpoint(self, save_dir, tag, client_state)

    @guarded("load_checkpoint: the distributed checkpoint read")
    def load_checkpoint(self, load_dir, tag: Optional[str] = None, load_optimizer_states: bool = True):
        """Collective. Returns (path, client_state), as DeepSpeed does."""
        with self._optimizer_state_in_memory():
            return ckpt.load_checkpoint(self, load_dir, tag, load_optimizer_states)

    def _optimizer_state_in_memory(self):
        """Checkpoints read and write optimizer.state: NVMe-offloaded state is mapped in meanwhile."""
        return self.nvme.full_state() if self.nvme is not None else contextlib.nullcontext()
