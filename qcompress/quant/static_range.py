"""Activation range observers: dynamic (recomputed every call) and static (EMA of min/max)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


class StaticRange:
    """EMA of the whole-tensor min and max, initialised on the first batch, frozen in eval.

    stored = momentum * stored + (1 - momentum) * current, as DeepSpeed's QuantAct (whose
    momentum 0.95 was hard-coded; ours is `activation_quantization.shared_parameters.momentum`).
    """

    def __init__(self, momentum: float = 0.95):
        self.momentum = float(momentum)
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None

    @property
    def initialized(self) -> bool:
        return self.min is not None

    def observe(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fold x into the running range and return the range to quantize x with."""
        with torch.no_grad():
            return self.update(x.detach().amin(), x.detach().amax())

    def update(self, cur_min: torch.Tensor, cur_max: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fold a batch's range (chosen by an observer) into the running range; returns it."""
        with torch.no_grad():
            cur_min = cur_min.detach().to(torch.float32)
            cur_max = cur_max.detach().to(torch.float32)
            if self.min is None:
                self.min, self.max = cur_min.clone(), cur_max.clone()
            else:
                m = self.momentum
                lo, hi = self._held()
                self.min = m * lo.to(cur_min.device) + (1.0 - m) * cur_min
                self.max = m * hi.to(cur_max.device) + (1.0 - m) * cur_max
        return self._held()

    def _held(self) -> Tuple[torch.Tensor, torch.Tensor]:
        assert self.min is not None and self.max is not None  # set together, by update or a load
        return self.min, self.max

    def sync_tensor(self) -> torch.Tensor:
        """(min, max), for the engine's all-reduce across data-parallel ranks."""
        lo, hi = self._held()
        return torch.stack([lo.float().reshape(()), hi.float().reshape(())])

    def sync_from(self, summed: torch.Tensor, world: int) -> None:
        """The range averaged over the ranks (summed: the all-reduced sync_tensor)."""
        summed = summed / world
        self.min, self.max = summed[0].clone(), summed[1].clone()

    def state_dict(self) -> dict:
        if self.min is None:
            return {}
        lo, hi = self._held()
        return {"min": lo.detach().cpu().clone(), "max": hi.detach().cpu().clone()}

    def load_state_dict(self, sd: dict) -> None:
        if "min" in sd:
            self.min, self.max = sd["min"].clone(), sd["max"].clone()
        else:
            self.min = self.max = None
