"""Shared plumbing of the communication-compressed optimizers.

Holds what OneBitAdam, ZeroOneAdam and OneBitLamb have in common: argument checks, the
process group, the flat compression buckets, fp32 master copies for low-precision parameters,
the `allreduce_gradients` contract with the engine / DDP hook, and checkpointing of the stage,
the schedule counters and this rank's compression errors.

A tensor without a gradient this step (p.grad is None: a block progressive layer drop skipped,
a branch the forward did not take) is left as it is in every stage, the parameter and its
state, as torch's AdamW leaves it. The compressed stages still fill its slot of the fixed layout
(zeros) and drop what comes back. Like the warmup's gradient averaging, they take it that every
rank agrees on which tensors have a gradient (progressive layer drop decides alike on every
rank).
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional

import torch

from . import _dist
from ._buckets import UNKNOWN_NODES, Buckets

log = logging.getLogger("qcompress")

DEFAULT_BUCKET_SIZE = 1 << 24  # elements per compressed all-reduce call (64 MiB of float32)
_STATE_VERSION = 2  # 2: records the node layout the compression errors were made for


def check_common(lr, betas, eps, weight_decay, amsgrad, compressor, bucket_size, comm_hierarchy):
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if amsgrad:
        raise ValueError("amsgrad is not supported by the 1-bit optimizers (nor by DeepSpeed's)")
    if not (isinstance(compressor, str) and compressor) and not hasattr(compressor, "compress"):
        raise ValueError(f"compressor must be a compressor name such as 'onebit' or 'int8', got {compressor!r}")
    if isinstance(compressor, str):
        # checked now: it is first used at freeze_step, possibly hours into the run
        from ..comm.compressors import available_compressors

        if compressor.lower() not in available_compressors():
            raise ValueError(
                f"unknown compressor {compressor!r}; known: "
                f"{', '.join(available_compressors())} (qcompress.comm.register_compressor adds one)"
            )
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
    if isinstance(comm_hierarchy, str) or comm_hierarchy is None:
        if comm_hierarchy not in (None, "auto", "flat", "node"):
            raise ValueError(
                f"comm_hierarchy must be None ('auto': hierarchical when ranks span hosts), "
                f"'flat', 'node' or a qcompress.comm.Hierarchy, got {comm_hierarchy!r}"
            )
    elif not hasattr(comm_hierarchy, "allreduce"):
        raise ValueError(
            f"comm_hierarchy must be None, 'flat', 'node' or a qcompress.comm.Hierarchy, "
            f"got {type(comm_hierarchy).__name__}"
        )


def check_positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class; subclasses implement `_step()` and the `allreduce_gradients` property."""

    _COUNTERS: Dict[str, object] = {}

    def __init__(
        self,
        params,
        defaults,
        *,
        group=None,
        compressor="onebit",
        bucket_size=DEFAULT_BUCKET_SIZE,
        comm_hierarchy=None,
        ddp_hook_state=None,
        scale_per_tensor=False,
    ):
        if not isinstance(scale_per_tensor, bool):
            raise ValueError(f"scale_per_tensor must be true or false, got {scale_per_tensor!r}")
        super().__init__(params, defaults)
        # True: every parameter tensor is compressed on its own, with its own 1-bit scales and errors
        # (their rows share two collectives, _buckets.py); False: tensors end to end share a bucket's scale.
        self.scale_per_tensor = scale_per_tensor
        self.comm_group = group
        self.compressor = compressor
        self.bucket_size = bucket_size
        self.comm_hierarchy = comm_hierarchy
        self.counters = dict(self._COUNTERS)
        self._buckets: Optional[Buckets] = None
        self._masks: Optional[Dict[int, torch.Tensor]] = None
        self._dead = {}
        self._denoms = {}
        self._hook_states: List[object] = []
        for i, g in enumerate(self.param_groups):
            self._check_group(g, i)
        if ddp_hook_state is not None:
            self._hook_states.append(ddp_hook_state)
            self._notify_hooks()

    def _check_group(self, g, index):
        g.setdefault("non_freeze", False)
        if not isinstance(g["non_freeze"], bool):
            raise ValueError(f"param_groups[{index}].non_freeze must be a bool, got {g['non_freeze']!r}")
        mask = g.get("exp_avg_mask")
        if mask is not None:
            if not torch.is_tensor(mask):
                raise ValueError(f"param_groups[{index}].exp_avg_mask must be a tensor")
            total = sum(p.numel() for p in g["params"])
            if mask.numel() != total:
                raise ValueError(
                    f"param_groups[{index}].exp_avg_mask has {mask.numel()} elements; it must cover "
                    f"the group's parameters flattened in order ({total} elements)"
                )

    def add_param_group(self, param_group):
        if getattr(self, "_buckets", None) is not None:
            raise RuntimeError("cannot add a parameter group after the first step (the compression layout is fixed)")
        super().add_param_group(param_group)
        if hasattr(self, "counters"):
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)

    # ------------------------------------------------------------------ engine contract
    @property
    def allreduce_gradients(self) -> bool:  # pragma: no cover - subclasses override
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return _dist.world_size(self.comm_group)

    def sync_gradients(self) -> None:
        """Average every gradient over the group if the next step expects averaged gradients.

        For loops without DDP or the qcompress engine: call it between backward and step().
        """
        if self.allreduce_gradients:
            _dist.average_(_dist.grads_of(p for g in self.param_groups for p in g["params"]), self.comm_group)

    def attach_ddp(self, ddp_model) -> object:
        """Register qcompress.comm.onebit_ddp_hook on `ddp_model` (call once, before the first backward);
        after every step the optimizer switches the hook between all-reducing (warmup, 0/1 Adam variance
        steps) and sending nothing (compression stage). Returns the hook state."""
        from .. import comm

        state = comm.OneBitDDPHookState(process_group=self.comm_group)
        ddp_model.register_comm_hook(state, comm.onebit_ddp_hook)
        self._hook_states.append(state)
        self._notify_hooks()
        return state

    def _notify_hooks(self) -> None:
        for state in self._hook_states:
            state.compression_stage = not self.allreduce_gradients

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        self._notify_hooks()
        return loss

    def _step(self):  # pragma: no cover - subclasses override
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def _compressed_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups if not g["non_freeze"] for p in g["params"]]

    def _get_buckets(self) -> Buckets:
        if self._buckets is None:
            self._buckets = Buckets(
                self._compressed_params(),
                self.bucket_size,
                self.comm_group,
                self.compressor,
                self.comm_hierarchy,
                owner=type(self).__name__,
                per_tensor=self.scale_per_tensor,
                skip_frozen=not getattr(self, "shard_state", False),
                pending=self._pending_update,
            )
        return self._buckets

    def _pending_update(self, p) -> bool:
        """Whether frozen `p` still has a local update the next all-reduce must average (0/1 Adam)."""
        return False

    def _mask(self, p) -> Optional[torch.Tensor]:
        """This parameter's slice of its group's exp_avg_mask (float32, parameter shape), or None."""
        if self._masks is None:
            self._masks = {}
            for g in self.param_groups:
                mask = g.get("exp_avg_mask")
                if mask is None:
                    continue
                flat = mask.reshape(-1)
                offset = 0
                for q in g["params"]:
                    n = q.numel()
                    self._masks[id(q)] = flat[offset : offset + n].to(device=q.device, dtype=torch.float32).view_as(q)
                    offset += n
        return self._masks.get(id(p))

    def _zero_unseen_(self, p, x, exp_avg_sq, frozen=True) -> None:
        """Zero x where the variance is exactly 0 (no gradient ever reached that coordinate).

        A sign cannot encode 0, so such coordinates would receive +-scale noise and an update of
        noise / eps; the uncompressed algorithm moves them by exactly 0. The pattern is cached while
        the variance is frozen."""
        dead = self._dead.get(p) if frozen else None
        if dead is None:
            found = exp_avg_sq == 0
            dead = found if bool(found.any()) else False
            if frozen:
                self._dead[p] = dead
        if dead is not False:
            x.masked_fill_(dead, 0.0)

    def _average_group_grads(self, g) -> None:
        _dist.average_(_dist.grads_of(g["params"]), self.comm_group)

    @staticmethod
    def _grad32(p) -> Optional[torch.Tensor]:
        if p.grad is None:
            return None
        if p.grad.is_sparse:
            raise RuntimeError("the 1-bit optimizers do not support sparse gradients")
        return p.grad if p.grad.dtype == torch.float32 else p.grad.float()

    def _param32(self, p) -> torch.Tensor:
        """The float32 tensor the update is applied to: p itself, or a master copy for bf16/fp16 p."""
        if p.dtype == torch.float32:
            return p
        state = self.state[p]
        if "master" not in state:
            state["master"] = p.detach().float().clone()
        return state["master"]

    @staticmethod
    def _write_back(p, p32) -> None:
        if p32 is not p:
            p.copy_(p32)

    @staticmethod
    def bias_corrections(group, steps_m: int, steps_v: int):
        """(bc1, sqrt(bc2)) for `steps_m` momentum and `steps_v` variance updates (1, 1 when disabled)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1 - b1**steps_m, (1 - b2**steps_v) ** 0.5

    def frozen_denom(self, p, exp_avg_sq, bc2_sqrt, eps) -> torch.Tensor:
        """sqrt(v)/sqrt(bc2) + eps for a frozen variance, computed once (it is the costliest part of
        a step on large models) and cached outside the state dict."""
        denom = self._denoms.get(p)
        if denom is None:
            denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
            self._denoms[p] = denom
        return denom

    @staticmethod
    def adam_update_(p32, exp_avg, exp_avg_sq, lr, wd, eps, bc1, bc2_sqrt, denom=None) -> torch.Tensor:
        """Decoupled weight decay then p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps), torch.optim.AdamW's order.
        Returns the denominator."""
        if wd != 0:
            p32.mul_(1 - lr * wd)
        if denom is None:
            denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
        p32.addcdiv_(exp_avg, denom, value=-(lr / bc1))
        return denom

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self):
        sd = super().state_dict()
        buckets = self._buckets
        sd["qcompress"] = {
            "version": _STATE_VERSION,
            "optimizer": type(self).__name__,
            "world_size": self.world_size,
            "rank": _dist.rank(self.comm_group),
            "counters": _copy_counters(self.counters),
            "layout": buckets.layout() if buckets is not None else None,
            "errors": buckets.errors_state_dict() if buckets is not None else None,
            "nodes": buckets.nodes if buckets is not None else None,
        }
        return sd

    def check_state_dict(self, state_dict) -> None:
        """Raise ValueError when `state_dict` cannot load here, reading only its non-tensor entries
        (the engine asks before it reads any checkpoint tensor into the model)."""
        extra = state_dict.get("qcompress")
        if extra is None or extra.get("optimizer") != type(self).__name__:
            found = "a plain torch optimizer" if extra is None else extra.get("optimizer")
            raise ValueError(
                f"this state dict was not saved by qcompress.optim.{type(self).__name__} (it comes from {found})"
            )

    def load_state_dict(self, state_dict):
        CompressedOptimizer.check_state_dict(self, state_dict)
        extra = state_dict["qcompress"]
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        # torch would cast the float32 moments to the parameter dtype (bf16); we restore state ourselves.
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        for g, mask in zip(self.param_groups, masks):
            # exp_avg_mask is configuration, never taken from the checkpoint (DeepSpeed does the same).
            g.pop("exp_avg_mask", None)
            if mask is not None:
                g["exp_avg_mask"] = mask
        self._masks = None
        self._dead = {}
        self._denoms = {}
        for sg, g in zip(saved_groups, self.param_groups):
            for pid, p in zip(sg["params"], g["params"]):
                if pid in saved_state:
                    self.state[p] = {
                        k: (v.detach().clone().to(p.device) if torch.is_tensor(v) else v)
                        for k, v in saved_state[pid].items()
                    }
        self.counters = _copy_counters(extra["counters"])
        self._buckets = None
        buckets = self._get_buckets()
        errors = extra.get("errors")
        if errors is not None:
            same_ws = extra["world_size"] == self.world_size and extra["rank"] == _dist.rank(self.comm_group)
            same_layout = extra.get("layout") == buckets.layout()
            if same_ws and same_layout:
                # Same world size and rank, but maybe other hosts: the node layout is checked at the
                # first step (resolving it may need a collective, which load_state_dict must not issue).
                buckets.load_errors(errors, _saved_nodes(extra))
            else:
                why = (
                    f"world size/rank {extra['world_size']}/{extra['rank']} -> "
                    f"{self.world_size}/{_dist.rank(self.comm_group)}"
                    if not same_ws
                    else "the compression bucket layout changed"
                )
                log.warning(
                    "%s: compression errors reset on load (%s); training continues with zero error feedback",
                    type(self).__name__,
                    why,
                )
        self._after_load()
        self._notify_hooks()

    def _after_load(self):
        pass


def _saved_nodes(extra):
    """The node layout a checkpoint's errors were made for (see _buckets); version 1 did not record
    it, but its "flat" runs were flat whatever the hosts."""
    if "nodes" in extra:
        return extra["nodes"]
    return None if (extra.get("layout") or {}).get("hierarchy") == "flat" else UNKNOWN_NODES


def _copy_counters(counters):
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in counters.items()}


def rms(t: torch.Tensor) -> float:
    return float(t.norm()) / math.sqrt(max(t.numel(), 1))
