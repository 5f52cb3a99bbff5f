"""Per-module pruning state: method, kept ratio, schedule, and the mask or the name of its scores.

l1: the importance scores come from the weights once, at init_compression; the mask (or, with a
    gradual window, the scores) lives here, not in the module's state_dict, so the model's keys
    are unchanged. The CompressionScheduler saves it.
topk: the scores are an nn.Parameter registered on the module as `<technique>_scores` (the
    optimizer must train them), so they are in the module's state_dict; the mask is recomputed
    from them at every forward, with a straight-through gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .masks import keep_count, topk_binarize, topk_mask


@dataclass
class PruningState:
    technique: str  # sparse_pruning | row_pruning | head_pruning | channel_pruning
    group: str
    method: str  # l1 | topk
    dense_ratio: float  # fraction KEPT at the end of the schedule
    offset: int  # schedule_offset: masks apply from this step on
    offset_end: Optional[int] = None  # sparse only: kept ratio ramps 1 -> dense_ratio until here
    stride: int = 1  # sparse only: the ramped ratio changes every `stride` steps
    num_heads: Optional[int] = None  # head pruning
    scores_name: Optional[str] = None  # topk: attribute name of the score Parameter
    l1_scores: Optional[torch.Tensor] = None  # l1 with a ramp: init-time scores
    l1_mask: Optional[torch.Tensor] = None  # l1 without a ramp: the fixed mask
    # live state
    active: bool = False
    ratio: float = 1.0
    step: int = 0
    # l1 with a ramp: (ratio, mask) of the last ratio asked for. A top-k over every weight at
    # each forward cost 1.3 s for a 4096x4096 layer on CPU, and the ratio changes rarely.
    _ramp_mask: Optional[tuple] = field(default=None, repr=False, compare=False)

    # --- schedule ---------------------------------------------------------------------------
    def ratio_at(self, t: int) -> float:
        end = self.offset_end
        if t < self.offset:
            return 1.0
        if end is None or end <= self.offset or t >= end:
            return self.dense_ratio
        t = self.offset + (t - self.offset) // self.stride * self.stride  # schedule_offset_stride
        frac = (t - self.offset) / (end - self.offset)
        return 1.0 - (1.0 - self.dense_ratio) * frac

    def update(self, t: int) -> None:
        self.step = t
        self.active = t >= self.offset
        self.ratio = self.ratio_at(t)

    # --- masks ------------------------------------------------------------------------------
    def mask(self, module, ratio: Optional[float] = None) -> torch.Tensor:
        """The mask at the current (or given) kept ratio; differentiable w.r.t. topk scores."""
        r = self.ratio if ratio is None else ratio
        if self.method == "topk":
            return topk_binarize(getattr(module, self.scores_name), r)
        dev = module.weight.device
        if self.l1_mask is not None and r == self.dense_ratio:
            if self.l1_mask.device != dev:  # the model moved after init_compression
                self.l1_mask = self.l1_mask.to(dev)
            return self.l1_mask
        if self.l1_scores.device != dev:
            self.l1_scores = self.l1_scores.to(dev)
            self._ramp_mask = None
        if self._ramp_mask is None or self._ramp_mask[0] != r:
            self._ramp_mask = (r, topk_mask(self.l1_scores, r))
        return self._ramp_mask[1]

    def kept_fraction(self, module) -> float:
        """The share of scored units (weights, rows, heads, channels) the mask keeps now: the ratio
        rounded to whole units, ceil(ratio * n) / n (4 of 12 heads at 0.3 is 0.333)."""
        if not self.active:
            return 1.0
        ref = (
            getattr(module, self.scores_name)
            if self.method == "topk"
            else self.l1_mask
            if self.l1_mask is not None
            else self.l1_scores
        )
        n = ref.numel()
        return keep_count(self.ratio, n) / n

    def final_mask(self, module) -> torch.Tensor:
        """Boolean mask at the configured dense_ratio (what redundancy_clean makes permanent)."""
        with torch.no_grad():
            return self.mask(module, self.dense_ratio).detach() > 0.5

    def remove(self, module) -> None:
        """Forget this technique on `module` (after clean): drop the scores Parameter."""
        if self.scores_name is not None and self.scores_name in module._parameters:
            del module._parameters[self.scores_name]
        module.qc_pruning.pop(self.technique, None)

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {"method": self.method}
        if self.l1_mask is not None:
            sd["mask"] = self.l1_mask.detach().cpu().clone()
        if self.l1_scores is not None:
            sd["scores"] = self.l1_scores.detach().cpu().clone()
        return sd

    def _path(self, key: str) -> str:
        if key in ("method", "schedule_offset_end"):
            return f"compression_training.{self.technique}.shared_parameters.{key}"
        return f"compression_training.{self.technique}.different_groups.{self.group}.params.{key}"

    def load_state_dict(self, sd: dict) -> None:
        from ..errors import ConfigError

        if sd.get("method", self.method) != self.method:
            raise ConfigError(
                self._path("method"),
                f"the checkpoint was saved with method {sd['method']!r}, the config now says {self.method!r}",
            )
        cur = self.l1_mask if self.l1_mask is not None else self.l1_scores  # masks are shaped like scores
        for key in ("mask", "scores"):
            if key in sd and cur is not None and tuple(cur.shape) != tuple(sd[key].shape):
                raise ValueError(
                    f"{self.technique}: saved {key} has shape {tuple(sd[key].shape)}, "
                    f"this module needs {tuple(cur.shape)}"
                )
        ramped = self.l1_scores is not None and self.l1_mask is None
        dev = cur.device if cur is not None else None
        if "scores" in sd:
            # the init-time importance: any kept ratio (the config's now) follows from it
            scores = sd["scores"].to(dev) if dev is not None else sd["scores"].clone()
            self.l1_scores, self._ramp_mask = scores, None
            if not ramped:
                self.l1_mask = topk_mask(scores, self.dense_ratio)
        elif "mask" in sd:
            # only the final mask was saved: it can neither ramp nor keep another count
            mask = sd["mask"]
            if ramped:
                raise ConfigError(
                    self._path("schedule_offset_end"),
                    "the checkpoint was saved without a ramp and holds only the final "
                    "l1 mask, so the kept ratio cannot ramp; resume with the config it "
                    "was saved with",
                )
            kept, want = int((mask > 0.5).sum()), keep_count(self.dense_ratio, mask.numel())
            if kept != want:
                raise ConfigError(
                    self._path("dense_ratio"),
                    f"{self.dense_ratio} keeps {want} of {mask.numel()}, but the "
                    f"checkpoint's l1 mask keeps {kept} (saved with another dense_ratio); "
                    "resume with the config it was saved with",
                )
            self.l1_mask = mask.to(dev) if dev is not None else mask.clone()

    def describe(self) -> str:
        short = self.technique.replace("_pruning", "")
        heads = f" of {self.num_heads} heads" if self.num_heads else ""
        window = f" from {self.offset}" + (f" to {self.offset_end}" if self.offset_end else "")
        on = "" if self.active else " (off)"
        return f"{short} {self.method} keep {self.ratio:.3g}{heads}{window}{on}"
