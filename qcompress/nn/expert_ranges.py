"""Static input ranges of fused experts: one EMA range per expert, over the tokens routed to it.

An ExpertMatrix with `range_calibration: static` keeps an ExpertRanges as its ActQuant.observer.
Each expert's range is a StaticRange of its own (the one a Linear keeps), updated only by the
batches that route tokens to that expert; an expert that has not seen a token yet has no range.
The scheduler saves it (state_dict), the engine averages it across data-parallel ranks
(sync_tensor / sync_from: each expert over the ranks whose expert saw tokens), export writes one
input_scale per expert.
"""

from __future__ import annotations

from typing import List

import torch

from ..quant.static_range import StaticRange


class ExpertRanges:
    """E StaticRanges; `initialized` once any expert has seen a token."""

    def __init__(self, experts: int, momentum: float = 0.95):
        self.experts: List[StaticRange] = [StaticRange(momentum) for _ in range(experts)]

    @property
    def momentum(self) -> float:
        return self.experts[0].momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        for r in self.experts:
            r.momentum = float(value)

    @property
    def initialized(self) -> bool:
        return any(r.initialized for r in self.experts)

    def __getitem__(self, e: int) -> StaticRange:
        return self.experts[e]

    def state_dict(self) -> dict:
        return {"experts": [r.state_dict() for r in self.experts]}

    def load_state_dict(self, sd: dict) -> None:
        if not sd:
            for r in self.experts:
                r.load_state_dict({})
            return
        got = sd.get("experts")
        if got is None or len(got) != len(self.experts):
            raise ValueError(
                f"static input ranges of fused experts: the saved state holds "
                f"{'one range' if got is None else f'{len(got)} expert ranges'}, this module "
                f"has {len(self.experts)} experts"
            )
        for r, s in zip(self.experts, got):
            r.load_state_dict(s)

    def sync_tensor(self) -> torch.Tensor:
        """[E, 3]: (min, max, 1) of each expert that saw tokens, zeros for the others."""
        rows = []
        for r in self.experts:
            if r.initialized:
                rows.append(
                    torch.stack([r.min.float().reshape(()), r.max.float().reshape(()), torch.ones(()).to(r.min.device)])
                )
            else:
                rows.append(None)
        dev = next((t.device for t in rows if t is not None), torch.device("cpu"))
        return torch.stack([torch.zeros(3, device=dev) if t is None else t.to(dev) for t in rows])

    def sync_from(self, summed: torch.Tensor, world: int) -> None:
        """Each expert's range averaged over the ranks where it saw tokens (summed: all-reduced
        sync_tensor); experts no rank routed tokens to stay without a range."""
        summed = summed.reshape(len(self.experts), 3)
        for r, (lo, hi, n) in zip(self.experts, summed):
            if n > 0:
                r.min, r.max = (lo / n).clone(), (hi / n).clone()
