"""Bit and offset schedules, and the CompressionScheduler that applies them every step.

Weight groups go from start_bits to target_bits one bit per drop. With period P the drops come
P, 2P, 4P, 8P ... steps after schedule_offset (DeepSpeed's doubling rule; start 12, target 8,
P 50: 11 bits at 50, 10 at 100, 9 at 200, 8 at 400) or at P, 2P, 3P ... with
`period_growth: linear`. Period 0 drops one bit at every step after the offset, as DeepSpeed
(its `qsteps >= q_period` test always holds). Unlike DeepSpeed, the schedule applies in every
mode (fake quantization in forward, or once per optimizer step).
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from .config import as_config
from .nn import kv_cache, ranges
from .errors import NonFiniteError
from .calibrate.input_moments import missing_moments, weighted_modules
from .nn.layers import CompressMixin, located
from .quant import kernels
from .quant.api import dequantize, quantize_spec
from .unwrap import unwrap

REWRITTEN = "_qc_rewritten"  # set on the root module by init_compression
CONFIG = "_qc_config"  # the config document init_compression applied (export metadata default)


def drops_at(t: int, start: int, target: int, period: int, growth: str = "exponential") -> int:
    """How many bits have been dropped t steps after the offset (t < 0: not started)."""
    if t < 0:
        return 0
    total = start - target
    if total <= 0:
        return 0
    k = 0
    while k < total:
        if t < _due(k, period, growth):
            break
        k += 1
    return k


def _due(k: int, period: int, growth: str) -> int:
    """Steps after the offset at which drop k (0-based) happens."""
    if period <= 0:
        return k + 1  # DeepSpeed with q_period 0: one bit per quantize call
    return period * (2**k) if growth == "exponential" else period * (k + 1)


def bits_at(step: int, *, start: int, target: int, period: int, offset: int = 0, growth: str = "exponential") -> int:
    """Bits in force at training step `step` (the step counter after that many optimizer steps)."""
    return start - drops_at(step - offset, start, target, period, growth)


def change_points(
    start: int, target: int, period: int, offset: int = 0, growth: str = "exponential"
) -> List[Tuple[int, int]]:
    """[(step, bits)] at the offset and at every drop."""
    points = [(offset, bits_at(offset, start=start, target=target, period=period, offset=offset, growth=growth))]
    for k in range(max(0, start - target)):
        points.append((offset + _due(k, period, growth), start - k - 1))
    return points


def compress_modules(model: nn.Module) -> Iterator[Tuple[str, CompressMixin]]:
    for name, mod in model.named_modules():
        if isinstance(mod, CompressMixin):
            yield name, mod


def _master_codes(mod: CompressMixin):
    """((q, scale, zero_point), spec) of the master copy at the bits now in force (with the mse
    observer's shrink factors when it chose them)."""
    spec = mod.qc_wq.spec()
    view = mod.weight_matrix_view(mod.qc_wq.master)
    params = ranges.weight_params(mod, view, spec)
    if params is not None:
        return quantize_spec(view, spec, scale=params[0], zero_point=params[1]), spec
    return quantize_spec(view, spec), spec


def _check_rewritten(model: nn.Module, cfg, modules) -> None:
    """A config that compresses something needs a model rewritten by init_compression (DeepSpeed
    silently did nothing here)."""
    on = [name for name, tech in cfg.compression.techniques() if tech.enabled]
    root = unwrap(model)
    if on and not modules and not getattr(root, REWRITTEN, False):
        raise ValueError(
            f"the config enables {', '.join(on)}, but the model has no compress-aware "
            "modules: call qcompress.init_compression(model, cfg) before building the "
            "CompressionScheduler"
        )


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
        if cfg is not None:
            _check_rewritten(model, as_config(cfg), self._modules)
        self._last_bits: Dict[str, int] = {}
        # observer_kwargs.weight_by: inputs without calibrate_weight_ranges: said once, at a step
        self._unweighted_pending = weighted_modules(model)
        self._apply(first=True)

    # --- the schedule ---------------------------------------------------------------------------
    def step(self) -> None:
        kernels.check_nonfinite()  # the CUDA quantizers' NaN/Inf count of the step just taken
        self.training_steps += 1
        self._apply(strict=True)
        if self._unweighted_pending:
            self._warn_unweighted()

    def _warn_unweighted(self) -> None:
        names = missing_moments(self._unweighted_pending)
        if not names:
            return
        self._unweighted_pending = []
        group = self._modules[names[0]].qc_wq.group
        warnings.warn(
            f"compression_training.weight_quantization.different_groups.{group}: observer_kwargs."
            f"weight_by is 'inputs', but no input statistics were recorded for {len(names)} "
            f"module(s) ({names[0]!r} ...): their ranges come from the unweighted mse search. Call "
            "qcompress.calibrate_weight_ranges(model, batches) after init_compression "
            "(qcompress train does)",
            stacklevel=3,
        )

    def finish(self) -> None:
        """Jump past the end of every schedule: every technique on, weights at target_bits with no
        fp16_mixed_quantize blend left (optimizer-step mode requantizes from the master copy).
        What `qcompress export` applies to a model rebuilt from its trained weights."""
        end = self.training_steps
        for mod in self._modules.values():
            wq, aq = mod.qc_wq, mod.qc_aq
            if wq is not None and not wq.baked:
                end = max(
                    end, *(t for t, _ in change_points(wq.start_bits, wq.target_bits, wq.period, wq.offset, wq.growth))
                )
            if aq is not None:
                end = max(end, aq.offset)
            for state in mod.qc_pruning.values():
                end = max(end, state.offset, state.offset_end or 0)
        self.training_steps = end
        self._apply()
        written = set()
        for mod in self._modules.values():
            wq = mod.qc_wq
            if wq is None or wq.baked or not wq.mix_enabled or wq.mix_ratio == 0.0:
                continue
            wq.mix_ratio = 0.0
            if not wq.in_forward and id(wq.store) not in written:
                written.add(id(wq.store))
                self._quantize_from_master(mod)

    def _apply(self, first: bool = False, strict: bool = False) -> None:
        t = self.training_steps
        dropped_groups = set()
        advanced = set()  # groups whose step moved: re-applying the same step must not anneal again
        rerange = set()  # modules whose ranges the observer (re)initialises at this step
        for name, mod in self._modules.items():
            wq = mod.qc_wq
            if wq is not None and not wq.baked:
                was_active, old_bits = wq.active, wq.bits
                if wq.step != t:
                    advanced.add(wq.group)
                wq.active = t >= wq.offset
                wq.step = t
                if wq.active:
                    wq.bits = bits_at(
                        t,
                        start=wq.start_bits,
                        target=wq.target_bits,
                        period=wq.period,
                        offset=wq.offset,
                        growth=wq.growth,
                    )
                    if not was_active or wq.bits != old_bits:
                        dropped_groups.add(wq.group)
                        if wq.range_observer != "minmax" or wq.range_learning:
                            rerange.add(name)
            aq = mod.qc_aq
            if aq is not None:
                aq.active = t >= aq.offset
                if aq.active and aq.range_learning:
                    ranges.init_input_ranges(mod)  # once the static range has seen a batch
            for state in mod.qc_pruning.values():
                state.update(t)
        kv_cache.schedule(self.model, t)
        written = set()  # tied weights: one MasterState, quantized once per step
        for name, mod in self._modules.items():
            wq = mod.qc_wq
            if wq is None or wq.baked or not wq.active:
                continue
            if name in rerange:
                if wq.in_forward or wq.master is None:
                    ranges.init_weight_ranges(mod)
                else:
                    wq.shrink = None  # re-searched on the updated master (_quantize_from_master)
                    wq.pending_ranges = True
            if wq.mix_enabled:
                if wq.group in dropped_groups:
                    wq.mix_ratio = 1.0  # each precision drop restarts the anneal
                elif wq.group in advanced:
                    wq.mix_ratio = max(0.0, wq.mix_ratio - wq.change_ratio)
            if not wq.in_forward and id(wq.store) not in written:
                if wq.solver is not None and wq.solved is None:
                    if not strict:
                        continue  # solved later (calibrate_weight_ranges) or restored from a checkpoint
                    raise ranges.unsolved_error(mod)  # a training step: never a silent round-to-nearest
                written.add(id(wq.store))
                self._quantize_from_master(mod)

    @torch.no_grad()
    def _quantize_from_master(self, mod: CompressMixin) -> None:
        """Optimizer-step mode: fold the optimizer's update into the master copy, requantize."""
        wq = mod.qc_wq
        w = mod.weight
        if w.is_meta:
            return  # no values to quantize; the state moved along (to("meta"))
        if wq.master is None:
            wq.master = w.detach().to(torch.float32).clone()
        else:
            wq.master += w.detach().to(torch.float32) - wq.applied.to(torch.float32)
        try:
            if wq.pending_ranges:
                wq.pending_ranges = False
                ranges.init_weight_ranges(mod, source=wq.master)
            (q, s, z), spec = _master_codes(mod)
        except NonFiniteError as err:  # a diverged update reached the master: say where
            raise located(mod, "weight's full-precision master", err) from None
        deq = mod._from_matrix_view(
            dequantize(
                q, s, z, group_size=spec.group_size if spec.granularity == "group" else None, num_groups=spec.num_groups
            )
        )
        r = wq.mix_ratio if wq.mix_enabled else 0.0
        new = deq if r <= 0.0 else r * wq.master + (1.0 - r) * deq
        w.copy_(new.to(w.dtype))
        wq.applied = w.detach().clone()
        wq.codes, wq.codes_spec = ((q, s, z), spec) if r <= 0.0 else (None, None)

    @staticmethod
    @torch.no_grad()
    def _load_weight_state(mod: CompressMixin, entry: dict) -> None:
        wq = mod.qc_wq
        wq.mix_ratio = float(entry["mix_ratio"])
        wq.baked = bool(entry.get("baked", False))
        wq.ranges_loaded = False  # the schedule's own state: bits and ranges are known
        wq.shrink = entry["shrink"].to(mod.weight.device) if "shrink" in entry else None
        if "input_moments" in entry:
            wq.store.input_moments = entry["input_moments"].to("cpu", torch.float64)
        if "input_cross" in entry:
            wq.store.input_cross = entry["input_cross"].to("cpu", torch.float32)
        if "solved" in entry:  # observer gptq: the scales its solve chose
            wq.solved = tuple(None if t is None else t.to(mod.weight.device) for t in entry["solved"])
        if "master_of" in entry:
            return  # tied weight: restored with the module that saved it
        dev = mod.weight.device
        wq.master = entry["master"].to(dev) if "master" in entry else None
        wq.applied = entry["applied"].to(dev) if "applied" in entry else None
        if wq.master is not None:
            wq.codes = wq.codes_spec = None  # re-derived from the master at the loaded step
        if wq.applied is not None:
            # the weight held `applied` at save time; a scheduler built after the model state
            # was loaded may have requantized it from a stale master, so put it back
            mod.weight.copy_(wq.applied.to(mod.weight.dtype))

    def keep_modules_of(self, model: nn.Module) -> None:
        """Schedule only the modules still in `model`: a pipeline stage dropped the others' blocks,
        whose stale state must neither be stepped nor saved (nor kept alive) by this rank."""
        here = {id(m) for m in model.modules()}
        self._modules = {n: m for n, m in self._modules.items() if id(m) in here}
        self._unweighted_pending = [(n, m) for n, m in self._unweighted_pending if id(m) in here]

    # --- introspection --------------------------------------------------------------------------
    def current_bits(self) -> Dict[str, int]:
        """{module name: weight bits in force (0 = not yet quantized)}."""
        return {n: (m.qc_wq.bits if m.qc_wq.active else 0) for n, m in self._modules.items() if m.qc_wq is not None}

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        mods = {}
        saved: Dict[int, str] = {}  # id(MasterState) -> module that saved it (tied weights)
        crossed = set()  # id(MasterState) whose whole input moments are saved
        for name, mod in self._modules.items():
            entry = {}
            if mod.qc_wq is not None:
                wq = mod.qc_wq
                entry["wq"] = {"mix_ratio": wq.mix_ratio, "baked": wq.baked}
                if wq.master is not None and id(wq.store) in saved:
                    entry["wq"]["master_of"] = saved[id(wq.store)]
                elif wq.master is not None:
                    saved[id(wq.store)] = name
                    entry["wq"]["master"] = wq.master.detach().cpu().clone()
                    entry["wq"]["applied"] = wq.applied.detach().cpu().clone()
                if wq.shrink is not None:
                    entry["wq"]["shrink"] = wq.shrink.detach().cpu().clone()
                if wq.solved is not None:
                    entry["wq"]["solved"] = tuple(None if t is None else t.detach().cpu().clone() for t in wq.solved)
                if wq.store.input_moments is not None:  # weight_by inputs: later bit drops use them
                    entry["wq"]["input_moments"] = wq.store.input_moments.clone()
                if wq.store.input_cross is not None and id(wq.store) not in crossed:  # once per tensor
                    crossed.add(id(wq.store))
                    entry["wq"]["input_cross"] = wq.store.input_cross.clone()
            if mod.qc_aq is not None:
                entry["aq"] = mod.qc_aq.observer.state_dict()
                if mod.qc_aq.range_learning:
                    entry["aq"]["learned_ready"] = mod.qc_aq.learned_ready
            for tech, state in mod.qc_pruning.items():
                entry[f"prune.{tech}"] = state.state_dict()
            mods[name] = entry
        out = {"training_steps": self.training_steps, "modules": mods}
        kv = kv_cache.state_dict(self.model)
        if kv:
            out["kv_cache"] = kv
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.training_steps = int(sd["training_steps"])
        for name, entry in sd.get("modules", {}).items():
            mod = self._modules.get(name)
            if mod is None:
                raise KeyError(f"compression state names module {name!r}, which this model does not have")
            if "wq" in entry and mod.qc_wq is not None:
                self._load_weight_state(mod, entry["wq"])
            if "aq" in entry and mod.qc_aq is not None:
                mod.qc_aq.observer.load_state_dict(entry["aq"])
                mod.qc_aq.learned_ready = bool(entry["aq"].get("learned_ready", False))
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
                    wq.bits = bits_at(
                        t,
                        start=wq.start_bits,
                        target=wq.target_bits,
                        period=wq.period,
                        offset=wq.offset,
                        growth=wq.growth,
                    )
                blended = wq.mix_enabled and wq.mix_ratio > 0.0
                if wq.active and wq.master is not None and not blended and wq.codes is None:
                    with torch.no_grad():
                        wq.codes, wq.codes_spec = _master_codes(mod)
            if mod.qc_aq is not None:
                mod.qc_aq.active = t >= mod.qc_aq.offset
            for state in mod.qc_pruning.values():
                state.update(t)
        kv_cache.load_state_dict(self.model, sd.get("kv_cache"), t)
