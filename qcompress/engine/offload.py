"""CPU offload of the optimizer state: `offload_optimizer: {device: cpu, ratio, pin_memory}`.

At stages 2/3 FSDP2's CPUOffloadPolicy moves whole modules (parameters, gradients and, with them,
the optimizer state and the update) to CPU memory; with `ratio` < 1 only the first modules, in
module order, whose parameters make up at most that share of the bytes. At stage 1 (where
DeepSpeed also offloads, and FSDP2 does not apply) OptimizerOffload keeps the chosen share of
the state in CPU memory and runs its update there: before the optimizer steps, the chosen
parameters' data and gradients move to the CPU (the same Parameter objects, so checkpoints and
ZeroRedundancyOptimizer see nothing new); after, the updated values are copied back. The update
is the optimizer's own arithmetic, so the weights equal those of a run without offload.
"""

from __future__ import annotations

from typing import Iterable, List

import torch

CPU = torch.device("cpu")


def _nbytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def choose_share(items: Iterable, ratio: float, size=_nbytes) -> List:
    """The leading items, in order, whose sizes add up to at most `ratio` of the total (all at 1.0)."""
    items = list(items)
    if ratio >= 1.0:
        return items
    budget = ratio * sum(size(x) for x in items)
    chosen, taken = [], 0
    for x in items:
        if taken + size(x) > budget:
            break
        chosen.append(x)
        taken += size(x)
    return chosen


class OptimizerOffload:
    """The stage-1 offload of one (local) optimizer; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, ratio: float, pin_memory: bool = False):
        self.optimizer = optimizer
        params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        self.params = choose_share(params, ratio)
        self.ids = {id(p) for p in self.params}
        self.pin = pin_memory and torch.cuda.is_available()
        self._moved = []
        self._handles = (
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        )

    def _to_cpu(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == CPU:
            return t
        return t.to(CPU, non_blocking=False).pin_memory() if self.pin else t.to(CPU)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._moved = []
        for p in self.params:
            if p.grad is None:
                continue
            on_device = p.data
            grad = self._to_cpu(p.grad)
            p.grad = None
            p.data = self._to_cpu(on_device)
            p.grad = grad
            state = optimizer.state.get(p)
            if state:  # a state loaded from a checkpoint lands on the parameter's device
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.device != CPU:
                        state[k] = v.to(CPU)
            self._moved.append((p, on_device))

    def _after_step(self, optimizer, args, kwargs) -> None:
        for p, on_device in self._moved:
            p.grad = None  # consumed by the step (the engine zeroes gradients next)
            if p.data is not on_device:
                on_device.copy_(p.data)
                p.data = on_device
        self._moved = []

    def state_bytes(self) -> int:
        """Bytes of optimizer state held for the offloaded parameters."""
        total = 0
        for p in self.params:
            for v in self.optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    total += _nbytes(v)
        return total
