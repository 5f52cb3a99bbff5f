"""The training engine behind qcompress.initialize (DeepSpeed's rhythm on torch.distributed).

Call `loss = f(engine(x)); engine.backward(loss); engine.step()` for every micro-batch. The
optimizer steps at accumulation boundaries; gradients are only communicated on the boundary
micro-step. How the model lives on the ranks (one process, DDP, ZeRO-1, FSDP2, a split over a
mesh, the 1-bit optimizers' local shards) is its placement's business (engine/placement/),
chosen once here; the engine keeps the rhythm: forward, backward, step, schedules, logging.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Dict, Optional

import torch
import torch.nn as nn

from ..config import as_config
from ..parallel import build_mesh
from ..parallel.train_batch import train_batch
from . import activation_checkpointing
from . import checkpoint as ckpt
from .batch import resolve_batch
from .comm_timeout import backward_collective, collective, forward_collective, guarded
from .compile import compile_model
from .lr_schedules import build_lr_scheduler
from .monitor import Monitor
from .placement import check_client_optimizer, local_optimizer, place
from .precision import LossScaler, autocast_dtype
from .process_group import resolve_device, start  # resolve_device: qcompress.train imports it from here
from .replicas import (
    RANKS_DIFFER,
    ReplicaSync,
    broadcast_compression_state,
    make_compression_scheduler,
    refuse_unsynced_eval,
    setup_pld,
)
from .save16 import save_16bit_model
from .seeding import seed_everything
from .timers import StepTimers
from .traffic import Traffic
from .zero import broadcast_module_state

log = logging.getLogger("qcompress.engine")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Engine:
    """Returned by `qcompress.initialize`; see the module docstring for the call rhythm."""

    group = None  # the default (world) group: checkpoints span all ranks

    def __init__(self, model: nn.Module, cfg, model_parameters=None, optimizer=None, device=None):
        asked = resolve_device(device)
        self.config = cfg = as_config(cfg)
        cfg.refuse_auto()
        check_client_optimizer(optimizer, cfg)
        self.rank, self.world_size, self.device = start(cfg, asked)
        self.traffic = Traffic(self.world_size)  # comm_bytes(): every byte this engine moves
        # DeepSpeed's 3D sizes: the (pp, dp, tp) mesh; batches and gradients count dp replicas
        self.parallel = build_mesh(cfg, self.world_size, model, self.device.type)
        self.placement = place(cfg, self.rank, self.world_size, self.device, self.parallel, self.traffic)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = resolve_batch(
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
            self.data_parallel_world_size,
        )
        self.precision = cfg.precision
        self._autocast = autocast_dtype(self.precision)
        self.loss_scaler = LossScaler.from_config(cfg.fp16) if self.precision == "fp16" else None
        self.gradient_clipping = float(cfg.gradient_clipping)
        self.timers = StepTimers(cfg, self.device, self.placement)

        model.to(self.device)
        self.module = model
        self.pld = setup_pld(model, cfg)  # before wrapping: it swaps the blocks' classes
        # before wrapping too: FSDP2's hooks then stay outside each block's recompute
        self.checkpointed_blocks = activation_checkpointing.from_config(model, cfg)
        # Before wrapping: the scheduler applies step 0 (it may write weights) on whole tensors.
        self.compression_scheduler = make_compression_scheduler(model, cfg)
        if self.world_size > 1:
            # Every rank starts from rank 0's model, including compression state that
            # init_compression derived from each rank's own initial weights.
            with collective("initialize: the broadcast of rank 0's model", cfg.comm_timeout_s, self.world_size):
                broadcast_module_state(model, traffic=self.traffic)
            broadcast_compression_state(self.compression_scheduler, self.device, self.rank, self.traffic)
        # split after the broadcast (every part is rank 0's), then wrap for data parallelism
        self.placement.split(model, self.compression_scheduler, self.gradient_accumulation_steps)
        self.wrapped = self.placement.wrap(model, skips_blocks=self.pld is not None)
        # after wrapping, so DDP / FSDP2 run inside the compiled graph (DeepSpeed's engine.compile)
        self.compiled = compile_model(self.wrapped, cfg.compile)
        self.optimizer = self.placement.build_optimizer(model_parameters, optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.scheduler)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._replicas = ReplicaSync(model, self.parallel, self.traffic, self.device)
        self._reset_counters()
        self._global_grad_norm: Optional[float] = None
        self.last_timings: Dict[str, Optional[float]] = {}
        # DeepSpeed's tensorboard / csv_monitor sections; writes on rank 0 at each optimizer step
        self.monitor = Monitor.from_config(cfg, self.rank)
        self._eval_guard = None  # forward pre-hook refusing eval on ranks with their own weights
        if cfg.seed is not None:  # last: what the caller draws next is the seed's stream, on every rank
            seed_everything(cfg.seed)

    def _reset_counters(self) -> None:
        self.global_steps = 0  # optimizer boundaries, skipped fp16 steps included (as DeepSpeed)
        self.micro_steps = 0
        self._accumulated = 0  # micro-batches since the last boundary
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_losses = []  # detached losses given to backward since the last boundary

    # --- what the placement decided, under the names callers read ----------------------------
    stage = property(lambda self: self.placement.stage, doc="zero_optimization.stage")
    onebit = property(lambda self: self.placement.onebit, doc="the optimizer is a 1-bit one")
    sharded = property(lambda self: self.placement.sharded, doc="parameters are FSDP2 shards")
    offload = property(lambda self: self.placement.offload, doc="FSDP2 CPUOffloadPolicy holds units")
    pipeline = property(lambda self: self.placement.pipeline, doc="this rank's pipeline stage, or None")
    tp_plan = property(lambda self: self.placement.tp_plan, doc="the tensor-parallel plan, or None")
    nvme = property(lambda self: self.placement.nvme, doc="the optimizer state in files (engine/nvme.py)")
    optimizer_offload = property(lambda self: self.placement.optimizer_offload, doc="stage 1: engine/offload.py")
    param_names = property(lambda self: self.placement.param_names, doc="{parameter: name in the model}")
    _offloaded_ids = property(lambda self: self.placement.offloaded_ids)

    # --- the training rhythm -----------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the current micro-batch is the last one before an optimizer step."""
        return self._accumulated + 1 >= self.gradient_accumulation_steps

    @property
    def _allreduce_gradients(self) -> bool:
        return bool(getattr(self.optimizer, "allreduce_gradients", True))

    @guarded(forward_collective)
    def forward(self, *args, **kwargs):
        self.placement.set_grad_sync(self.is_gradient_accumulation_boundary() and self._allreduce_gradients)
        t0 = time.perf_counter()
        ctx = (
            torch.autocast(self.device.type, dtype=self._autocast)
            if self._autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self.wrapped(*args, **kwargs)
        self.timers.seconds["forward"] += self.timers.elapsed(t0)
        return out

    __call__ = forward

    @guarded(backward_collective)
    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate loss / accumulation steps (× the fp16 loss scale); returns the loss."""
        scale = 1.0 / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        t0, comm_before = time.perf_counter(), self.timers.comm_seconds()
        if self.monitor.enabled:
            self._step_losses.append(loss.detach().float().mean())
        (loss.float() * scale if scale != 1.0 else loss).backward()
        self.timers.add_backward(t0, comm_before)
        return loss

    @guarded("engine.step: the all-reduce of the gradient norm / fp16 overflow flag and the optimizer's collectives")
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
        self.placement.before_step(self._trainable, self.optimizer)
        overflow = self._unscale_and_clip()
        if overflow:
            self.skipped_steps += 1
            self._log_overflow()
        else:
            self.optimizer.step()
            self.placement.after_optimizer_step(self.optimizer)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._replicas.sync()  # forwards moved buffers and ranges even on a skipped step
        if not overflow and self.compression_scheduler is not None:
            # after the sync: learned activation ranges start from the ranks' common static range
            self._compression_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._mark_ranks()
        self.optimizer.zero_grad(set_to_none=True)
        self.placement.after_zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size
        if self.pld is not None:
            self.pld.start_step(self.global_steps)  # theta for the next step, as DeepSpeed's update_state
        self.timers.seconds["step"] += self.timers.elapsed(t0)
        if self.rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            log.info("step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr())
        self.last_timings = self.timers.report(self.global_steps, self.rank, self.pld)
        if self.monitor.enabled:
            self._write_monitor_events()

    def _log_overflow(self) -> None:
        if self.rank != 0:
            return
        # a scale that cannot go down (static, or at min_loss_scale) overflows again: WARNING
        s = self.loss_scaler
        stuck = not s.dynamic or s.scale <= s.min_scale
        after = max(s.scale / 2.0, s.min_scale) if s.dynamic and s.hysteresis_left <= 1 else s.scale
        (log.warning if stuck else log.info)(
            "step %d: fp16 gradient overflow, step skipped; loss scale %g -> %g"
            + (
                " (it cannot go lower: lower fp16.loss_scale / min_loss_scale, or use 0 for dynamic scaling)"
                if stuck
                else ""
            ),
            self.global_steps + 1,
            s.scale,
            after,
        )

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

    def _unscale_and_clip(self) -> bool:
        """Global gradient norm across ranks and shards (the placement's), fp16 unscale and clipping
        in one multiply. Returns True when fp16 gradients overflowed on any rank."""
        fp16 = self.loss_scaler is not None
        if not fp16 and self.gradient_clipping <= 0:
            return False
        params = [p for p in self._trainable if p.grad is not None]
        sumsq, flag = self.placement.grad_sumsq(params, self._allreduce_gradients, fp16)
        if bool(flag.item() > 0) and fp16:
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
        grads = [_local(p.grad) for p in params]
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
        missing = self.placement.uncounted()
        if missing is not None:
            out["uncounted"] = missing
        return out

    def reset_comm_bytes(self) -> None:
        self.traffic.reset()

    # --- keeping ranks consistent ------------------------------------------------------------
    def _compression_step(self) -> None:
        self.with_full_weights(self.compression_scheduler.step)

    def with_full_weights(self, fn, *args):
        """Run fn (which reads or writes compress-aware modules' weights outside forward, e.g. the
        compression scheduler) with whole weights in place of FSDP2 shards."""
        with self.placement.whole_weights():
            return fn(*args)

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
        return local_optimizer(self.optimizer)

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
            self._eval_guard = self.module.register_forward_pre_hook(refuse_unsynced_eval)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def memory_report(self) -> Dict[str, int]:
        """Bytes on this rank: parameters, gradients, optimizer state (see engine.memory)."""
        return self.placement.memory_report(self.optimizer)

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's consolidated save (engine/save16.py). Collective: every rank calls it."""
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def counters(self) -> Dict[str, int]:
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
        }

    def set_counters(self, c: Dict[str, int]) -> None:
        self.global_steps = int(c["global_steps"])
        self.micro_steps = int(c["micro_steps"])
        self.global_samples = int(c["global_samples"])
        self.skipped_steps = int(c["skipped_steps"])
        self._accumulated = 0  # checkpoints hold no partial gradients: start a fresh step
        self._step_losses = []
        if self.pld is not None:  # PLD's theta and decisions follow from the step count alone
            self.pld.start_step(self.global_steps, resumed=True)

    # --- checkpoints -------------------------------------------------------------------------
    @guarded("save_checkpoint: a barrier or the distributed checkpoint write")
    def save_checkpoint(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
        """Collective: every rank calls it. Returns the checkpoint directory."""
        if self._accumulated and self.rank == 0:
            log.warning(
                "saving a checkpoint %d micro-batches into an accumulation step: the partial "
                "gradients are not saved; resume starts a fresh step",
                self._accumulated,
            )
        self.synchronize_ranks()  # one model on every rank, whatever the optimizer's rhythm
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
