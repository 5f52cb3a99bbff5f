"""Bit and offset schedules, and the CompressionScheduler that applies them every step.

Weight groups go from start_bits to target_bits one bit per drop. With period P the drops come
P, 2P, 4P, 8P ... steps after schedule_offset (DeepSpeed's doubling rule; start 12, target 8,
P 50: 11 bits at 50, 10 at 100, 9 at 200, 8 at 400) or at P, 2P, 3P ... with
`period_growth: linear`. Period 0 means target bits from the offset on. Unlike DeepSpeed, the
schedule applies in every mode (fake quantization in forward, or once per optimizer step).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from .nn.layers import CompressMixin
from .quant.api import quantize_spec


def drops_at(t: int, start: int, target: int, period: int, growth: str = "exponential") -> int:
    """How many bits have been dropped t steps after the offset (t < 0: not started)."""
    if t < 0:
        return 0
    total = start - target
    if total <= 0:
        return 0
    if period <= 0:
        return total
    k = 0
    while k < total:
        due = period * (2 ** k) if growth == "exponential" else period * (k + 1)
        if t < due:
            break
        k += 1
    return k


def bits_at(step: int, *, start: int, target: int, period: int, offset: int = 0,
            growth: str = "exponential") -> int:
    """Bits in force at training step `step` (the step counter after that many optimizer steps)."""
    return start - drops_at(step - offset, start, target, period, growth)


def change_points(start: int, target: int, period: int, offset: int = 0,
                  growth: str = "exponential") -> List[Tuple[int, int]]:
    """[(step, bits)] at the offset and at every drop."""
    points = [(offset, bits_at(offset, start=start, target=target, period=period, offset=offset,
                               growth=growth))]
    total = start - target
    for k in range(total if period > 0 else 0):
        due = period * (2 ** k) if growth == "exponential" else period * (k + 1)
        points.append((offset + due, start - k - 1))
    return points


def compress_modules(model: nn.Module) -> Iterator[Tuple[str, CompressMixin]]:
    for name, mod in model.named_modules():
        if isinstance(mod, CompressMixin):
            yield name, mod


class CompressionScheduler:
    """Turns techniques on at their offsets, sets each group's bits, anneals fp16_mixed_quantize
    and, in optimizer-step mode, quantizes weights from their full-precision master copy.

    Call `step()` after every optimizer step that was applied (not after skipped fp16-overflow
    steps). Construction applies the state of step 0, so offset-0 techniques are on at once.
    """

    def __init__(self, model: nn.Module, cfg=None):
        self.model = model
        self.training_steps = 0
        self._modules = dict(compress_modules(model))
        self._last_bits: Dict[str, int] = {}
        self._apply(first=True)

    # --- the schedule ---------------------------------------------------------------------------
    def step(self) -> None:
        self.training_steps += 1
        self._apply()

    def _apply(self, first: bool = False) -> None:
        t = self.training_steps
        dropped_groups = set()
        advanced = set()   # groups whose step moved: re-applying the same step must not anneal again
        for name, mod in self._modules.items():
            wq = mod.qc_wq
            if wq is not None and not wq.baked:
                was_active, old_bits = wq.active, wq.bits
                if wq.step != t:
                    advanced.add(wq.group)
                wq.active = t >= wq.offset
                wq.step = t
                if wq.active:
                    wq.bits = bits_at(t, start=wq.start_bits, target=wq.target_bits,
                                      period=wq.period, offset=wq.offset, growth=wq.growth)
                    if not was_active or wq.bits != old_bits:
                        dropped_groups.add(wq.group)
            aq = mod.qc_aq
            if aq is not None:
                aq.active = t >= aq.offset
            for state in mod.qc_pruning.values():
                state.update(t)
        for name, mod in self._modules.items():
            wq = mod.qc_wq
            if wq is None or wq.baked or not wq.active:
                continue
            if wq.mix_enabled:
                if wq.group in dropped_groups:
                    wq.mix_ratio = 1.0          # each precision drop restarts the anneal
                elif wq.group in advanced:
                    wq.mix_ratio = max(0.0, wq.mix_ratio - wq.change_ratio)
            if not wq.in_forward:
                self._quantize_from_master(mod)

    @torch.no_grad()
    def _quantize_from_master(self, mod: CompressMixin) -> None:
        """Optimizer-step mode: fold the optimizer's update into the master copy, requantize."""
        wq = mod.qc_wq
        w = mod.weight
        if wq.master is None:
            wq.master = w.detach().to(torch.float32).clone()
        else:
            wq.master += w.detach().to(torch.float32) - wq.applied.to(torch.float32)
        spec = wq.spec()
        view = mod.weight_matrix_view(wq.master)
        q, s, z = quantize_spec(view, spec)
        from .quant.api import dequantize
        deq = dequantize(q, s, z, group_size=spec.group_size if spec.granularity == "group" else None,
                         num_groups=spec.num_groups)
        deq = mod._from_matrix_view(deq)
        r = wq.mix_ratio if wq.mix_enabled else 0.0
        new = deq if r <= 0.0 else r * wq.master + (1.0 - r) * deq
        w.copy_(new.to(w.dtype))
        wq.applied = w.detach().clone()
        wq.codes, wq.codes_spec = ((q, s, z), spec) if r <= 0.0 else (None, None)

    # --- introspection --------------------------------------------------------------------------
    def current_bits(self) -> Dict[str, int]:
        """{module name: weight bits in force (0 = not yet quantized)}."""
        return {n: (m.qc_wq.bits if m.qc_wq.active else 0)
                for n, m in self._modules.items() if m.qc_wq is not None}

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        mods = {}
        for name, mod in self._modules.items():
            entry = {}
            if mod.qc_wq is not None:
                wq = mod.qc_wq
                entry["wq"] = {"mix_ratio": wq.mix_ratio, "baked": wq.baked}
                if wq.master is not None:
                    entry["wq"]["master"] = wq.master.detach().cpu().clone()
                    entry["wq"]["applied"] = wq.applied.detach().cpu().clone()
            if mod.qc_aq is not None:
                entry["aq"] = mod.qc_aq.observer.state_dict()
            for tech, state in mod.qc_pruning.items():
                entry[f"prune.{tech}"] = state.state_dict()
            mods[name] = entry
        return {"training_steps": self.training_steps, "modules": mods}

    def load_state_dict(self, sd: dict) -> None:
        self.training_steps = int(sd["training_steps"])
        for name, entry in sd.get("modules", {}).items():
            mod = self._modules.get(name)
            if mod is None:
                raise KeyError(f"compression state names module {name!r}, which this model does not have")
            if "wq" in entry and mod.qc_wq is not None:
                wq = mod.qc_wq
                wq.mix_ratio = float(entry["wq"]["mix_ratio"])
                wq.baked = bool(entry["wq"].get("baked", False))
                dev = mod.weight.device
                wq.master = entry["wq"]["master"].to(dev) if "master" in entry["wq"] else None
                wq.applied = entry["wq"]["applied"].to(dev) if "applied" in entry["wq"] else None
                if wq.applied is not None:
                    # the weight held `applied` at save time; a scheduler built after the model
                    # state was loaded may have requantized it from a stale master, so put it back
                    with torch.no_grad():
                        mod.weight.copy_(wq.applied.to(mod.weight.dtype))
            if "aq" in entry and mod.qc_aq is not None:
                mod.qc_aq.observer.load_state_dict(entry["aq"])
            for tech, state in mod.qc_pruning.items():
                if f"prune.{tech}" in entry:
                    state.load_state_dict(entry[f"prune.{tech}"])
        # Re-derive bits and flags for the loaded step without touching weights or ratios.
        t = self.training_steps
        for mod in self._modules.values():
            wq = mod.qc_wq
            if wq is not None and not wq.baked:
                wq.active, wq.step = t >= wq.offset, t
                if wq.active:
                    wq.bits = bits_at(t, start=wq.start_bits, target=wq.target_bits,
                                      period=wq.period, offset=wq.offset, growth=wq.growth)
            if mod.qc_aq is not None:
                mod.qc_aq.active = t >= mod.qc_aq.offset
            for state in mod.qc_pruning.values():
                state.update(t)
