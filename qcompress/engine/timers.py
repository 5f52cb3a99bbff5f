"""wall_clock_breakdown: forward, backward, gradient communication and optimizer-step times of
each optimizer step (engine.last_timings), logged on rank 0 when the config asks."""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import torch

log = logging.getLogger("qcompress.engine")


class StepTimers:
    """Seconds summed over the micro-batches of one optimizer step. The placement's timer (when
    it has one) measures the gradient communication, which is taken out of backward."""

    def __init__(self, cfg, device, placement):
        self.enabled = bool(cfg.wall_clock_breakdown)
        self.device, self.placement = device, placement
        self.seconds: Dict[str, float] = {"forward": 0.0, "backward": 0.0, "allreduce": 0.0, "step": 0.0}
        if self.enabled and not log.handlers and not logging.getLogger().handlers:
            # The user asked to see timings: print them even if logging was never configured.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[qcompress] %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)

    def elapsed(self, t0: float) -> float:
        if self.enabled and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def comm_seconds(self) -> float:
        timer = self.placement.timer
        return timer.seconds if timer is not None else 0.0

    def add_backward(self, t0: float, comm_before: float) -> None:
        took = self.elapsed(t0)
        if self.placement.timer is not None:
            comm = self.comm_seconds() - comm_before
            self.seconds["allreduce"] += comm
            took -= comm
        self.seconds["backward"] += took

    def report(self, step: int, rank: int, pld=None) -> Dict[str, Optional[float]]:
        """This step's times (reset for the next); "allreduce" is the gradient communication
        (FSDP2's reduce-scatter), None when it could not be separated from backward."""
        t: Dict[str, Optional[float]] = dict(self.seconds)
        if self.placement.timer is None:
            t["allreduce"] = self.placement.untimed_comm()
        for k in self.seconds:
            self.seconds[k] = 0.0
        if self.enabled and rank == 0:

            def ms(v):
                return "n/a (counted in backward)" if v is None else f"{v * 1e3:.2f} ms"

            share = "" if pld is None else f" | blocks run {100 * pld.last_share:.1f}%"
            log.info(
                "step %d: forward %s | backward %s%s | %s %s | step %s%s",
                step,
                ms(t["forward"]),
                ms(t["backward"]),
                self.placement.backward_note,
                self.placement.comm_label,
                ms(t["allreduce"]),
                ms(t["step"]),
                share,
            )
        return t
