"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) by name and parameters.

Convention: the k-th optimizer step (k = 0, 1, ...) runs with the rate the schedule gives for
iteration k; the constructor sets iteration 0's rate, `step()` moves to the next iteration (as
torch.optim.lr_scheduler does). DeepSpeed instead runs its very first step with rate 0; we do
not copy that quirk.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List

from ..errors import ConfigError

log = logging.getLogger("qcompress.engine")

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer, value, path: str) -> List[float]:
    """A scalar applies to every param group; a list must give one value per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(path, f"got {len(value)} values for {n} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * n


def _check_params(name: str, params: Dict[str, Any], allowed) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(
            f"scheduler.params.{unknown[0]}", f"unknown parameter for {name}; allowed: {', '.join(sorted(allowed))}"
        )


# Value checks by parameter name (one meaning per name across the four schedules).
_RATES = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr")  # number or one per group
_STEPS = (
    "warmup_num_steps",
    "total_num_steps",
    "cycle_first_step_size",
    "cycle_second_step_size",
    "cycle_first_stair_count",
    "cycle_second_stair_count",
    "decay_step_size",
)
_NON_NEGATIVE = (
    "warmup_min_ratio",
    "cos_min_ratio",
    "decay_lr_rate",
    "decay_mom_rate",
    "cycle_min_mom",
    "cycle_max_mom",
)


def _check_values(params: Dict[str, Any]) -> None:
    """Types and signs, named by key: float('abc') raised a bare ValueError, and a negative
    warmup_min_lr trained with negative learning rates (gradient ascent) without a word."""

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key, v in params.items():
        path = f"scheduler.params.{key}"
        if key in _RATES:
            values = v if isinstance(v, (list, tuple)) else [v]
            if not values or not all(number(x) and x >= 0 for x in values):
                raise ConfigError(path, f"expected a learning rate >= 0 (or one per parameter group), got {v!r}")
        elif key in _STEPS:
            if v is None and key in ("cycle_second_step_size", "cycle_second_stair_count"):
                continue  # None: same as the first
            if not (number(v) and float(v).is_integer() and v >= 0):
                raise ConfigError(path, f"expected a whole number of steps >= 0, got {v!r}")
        elif key in _NON_NEGATIVE:
            if not (number(v) and v >= 0):
                raise ConfigError(path, f"expected a number >= 0, got {v!r}")
        elif key == "last_batch_iteration":
            if not (number(v) and float(v).is_integer()):
                raise ConfigError(path, f"expected a whole number, got {v!r}")
        elif key == "cycle_momentum" and not isinstance(v, bool):
            raise ConfigError(path, f"expected true or false, got {v!r}")


class _Schedule:
    """Base: holds the iteration counter and writes rates into the optimizer's param groups."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.last_batch_iteration = 0

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> List[float]:
        return list(self._last_lr)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        self._apply()


def _warmup_gamma(it: int, num_steps: int, kind: str) -> float:
    """Fraction of the warmup done at iteration `it` (1.0 once warmup is over)."""
    if it >= num_steps:
        return 1.0
    if kind == "log":
        return math.log(it + 1) / math.log(num_steps)
    return it / num_steps


class WarmupLR(_Schedule):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then stays."""

    PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer)
        if warmup_type not in _WARMUP_TYPES:
            raise ConfigError("scheduler.params.warmup_type", f"{warmup_type!r}; choose 'log' or 'linear'")
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "scheduler.params.warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "scheduler.params.warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # log warmup divides by log(n)
        self.warmup_type = warmup_type
        self.last_batch_iteration = max(0, int(last_batch_iteration))
        self._apply()

    def _gamma(self) -> float:
        return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self):
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    PARAMS = WarmupLR.PARAMS + ("total_num_steps",)

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.total_num_steps = int(total_num_steps)
        if self.total_num_steps < warmup_num_steps:
            raise ConfigError(
                "scheduler.params.total_num_steps",
                f"{total_num_steps} is smaller than warmup_num_steps={warmup_num_steps}",
            )
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return super()._gamma()
        left = self.total_num_steps - it
        return max(0.0, left / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ratio of the optimizer's own lr: warmup from warmup_min_ratio to 1, then cosine to cos_min_ratio."""

    PARAMS = (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    )

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer)
        if warmup_type not in _WARMUP_TYPES:
            raise ConfigError("scheduler.params.warmup_type", f"{warmup_type!r}; choose 'log' or 'linear'")
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        if self.total_num_steps <= self.warmup_num_steps:
            raise ConfigError(
                "scheduler.params.total_num_steps",
                f"{total_num_steps} must exceed warmup_num_steps={self.warmup_num_steps}",
            )
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_batch_iteration = max(0, int(last_batch_iteration))
        self._apply()

    def ratio(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            g = _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        done = it - self.warmup_num_steps + 1
        span = self.total_num_steps - self.warmup_num_steps
        cos = (1.0 + math.cos(math.pi * min(done, span) / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos)

    def get_lr(self):
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, sd):
        self.org_lrs = [float(v) for v in sd["org_lrs"]]
        super().load_state_dict(sd)


def _uses_momentum(group) -> bool:
    """Adam-style betas[0], or SGD-style momentum > 0."""
    return "betas" in group or float(group.get("momentum", 0.0)) > 0.0


class OneCycle(_Schedule):
    """1cycle: lr min->max->min over the two step sizes (momentum the other way), then optional decay."""

    PARAMS = (
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
        "last_batch_iteration",
    )

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer)
        # Stair counts are accepted for config compatibility; DeepSpeed does not use them either.
        first = int(cycle_first_step_size)
        second = first if cycle_second_step_size is None else int(cycle_second_step_size)
        if first < 1 or second < 1:
            raise ConfigError("scheduler.params.cycle_first_step_size", "step sizes must be >= 1")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "scheduler.params.cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "scheduler.params.cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_step_size = int(decay_step_size)
        self.min_mom, self.max_mom = float(cycle_min_mom), float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        # As DeepSpeed: cycling is skipped for an optimizer without momentum (it would switch
        # plain SGD's momentum on); per group, since SGD groups may differ.
        self._mom_groups = [g for g in optimizer.param_groups if _uses_momentum(g)] if cycle_momentum else []
        self.cycle_momentum = bool(self._mom_groups)
        if cycle_momentum and not self.cycle_momentum:
            log.info("OneCycle: the optimizer uses no momentum (no betas, SGD momentum 0); cycle_momentum is off")
        self.last_batch_iteration = max(0, int(last_batch_iteration))
        self._apply()

    def _set_momentum(self, mom: float) -> None:
        for g in self._mom_groups:
            if "betas" in g:
                g["betas"] = (mom, g["betas"][1])
            else:
                g["momentum"] = mom

    def get_lr(self):
        it = self.last_batch_iteration
        if it < self.total_size:
            pos = it / self.total_size  # within the single cycle
            scale = pos / self.step_ratio if pos <= self.step_ratio else (pos - 1) / (self.step_ratio - 1)
            if self.cycle_momentum:
                self._set_momentum(self.max_mom - (self.max_mom - self.min_mom) * scale)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        # After the cycle: lr decays from cycle_min_lr, momentum grows from cycle_max_mom.
        interval = (it - self.total_size + 1) / self.decay_step_size if self.decay_step_size > 0 else 0.0
        if self.cycle_momentum:
            self._set_momentum(self.max_mom * (1 + self.decay_mom_rate * interval))
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]


SCHEDULES = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "warmupcosinelr": WarmupCosineLR,
    "onecycle": OneCycle,
}


def build_lr_scheduler(optimizer, sched_cfg):
    """Build the schedule named by `scheduler.type` with DeepSpeed's parameter names, or None."""
    if sched_cfg is None:
        return None
    cls = SCHEDULES[sched_cfg.type.lower()]
    params = dict(sched_cfg.params)
    _check_params(sched_cfg.type, params, cls.PARAMS)
    _check_values(params)
    try:
        return cls(optimizer, **params)
    except TypeError as err:  # a required parameter is missing
        raise ConfigError("scheduler.params", f"{sched_cfg.type}: {err}") from None
