"""Precision: autocast dtype per mode and fp16's loss scaler (DeepSpeed's dynamic scaling rules).

Parameters, gradients and optimizer state stay fp32 in every mode; bf16/fp16 run the forward under
torch.autocast. That keeps one code path for DDP and FSDP2 and fp32 master weights for free.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class LossScaler:
    """Loss scale for fp16. Static when `loss_scale` > 0, otherwise dynamic:

    an overflowing step halves the scale once `hysteresis` overflows have been tolerated (never
    below `min_loss_scale`); `loss_scale_window` clean steps since the last overflow double it.
    With `consecutive_hysteresis` a clean step refills the hysteresis budget.
    """

    def __init__(
        self,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
    ):
        self.dynamic = loss_scale == 0
        self.scale = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = int(loss_scale_window)
        self.hysteresis = int(hysteresis)
        self.hysteresis_left = int(hysteresis)
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.iteration = 0
        self.last_overflow_iteration = -1

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        return cls(
            fp16.loss_scale,
            fp16.initial_scale_power,
            fp16.loss_scale_window,
            fp16.hysteresis,
            fp16.min_loss_scale,
            fp16.consecutive_hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Advance one optimizer boundary; the caller skips the step when `overflow` is True."""
        if self.dynamic:
            if overflow:
                if self.hysteresis_left <= 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis_left = self.hysteresis
                    self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self.hysteresis_left = int(sd["hysteresis_left"])
        self.iteration = int(sd["iteration"])
        self.last_overflow_iteration = int(sd["last_overflow_iteration"])
