"""Post-training range learning: train only the learned scales (and zero points) of a quantized
model on a loss, every other parameter frozen.

The observers choose each group's range once, from the weights (mse) or their inputs (weight_by:
inputs); neither sees the loss. Range learning (`range_learning: true`) makes the ranges Parameters
with an LSQ gradient, and in QAT they train together with the weights. Here they train alone: a
PTQ refinement for a model that is not to be retrained (OmniQuant's learnable clipping and
AutoRound's scale tuning do the same). The weights stay bit-identical, so the export is the same
size and the same integers up to their scales. How much of the PTQ perplexity excess this removes,
against the input-weighted mse observer: benchmarks/experiments/README.md (`range_ceiling.py`).
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from ..nn.range_groups import range_parameter_ids
from ..unwrap import unwrap


def range_parameters(model: nn.Module) -> list:
    """The learned-range Parameters of the model's compress-aware modules (tied modules' once)."""
    model = unwrap(model)
    ids = range_parameter_ids(model)
    return [p for p in model.parameters() if id(p) in ids]


def _loss(model: nn.Module, batch, loss: Optional[Callable]) -> torch.Tensor:
    if loss is not None:
        return loss(model, batch)
    out = (
        model(**batch)
        if isinstance(batch, dict)
        else model(*batch)
        if isinstance(batch, (tuple, list))
        else model(batch)
    )
    value = getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")
    if value is None:
        raise ValueError(
            "learn_ranges: the model's output has no `loss` (give batches with labels, or pass "
            "loss=lambda model, batch: ...)"
        )
    return value


def _start_input_ranges(model: nn.Module) -> None:
    """Static activation ranges with range learning take their learned range from the observer at
    a scheduler step; a PTQ model (finish(), then calibration batches) has had none, so its learned
    input ranges would stay unused and untrained. Initialise them here from the calibrated observer;
    warn about those whose observer has seen no batch."""
    from ..nn.ranges import init_input_ranges

    unseen = []
    for name, mod in model.named_modules():
        aq = getattr(mod, "qc_aq", None)
        if aq is None or not aq.range_learning or not aq.active or aq.learned_ready:  # (learned: static)
            continue
        if hasattr(mod.input_scale, "full_tensor"):
            continue  # FSDP2-sharded (an engine): its scheduler initialises them at its first step
        if not init_input_ranges(mod):
            unseen.append(name)
    if unseen:
        warnings.warn(
            f"learn_ranges: the static activation ranges of {len(unseen)} module(s) "
            f"({', '.join(unseen[:3])}{' ...' if len(unseen) > 3 else ''}) have seen no batch, so their "
            "learned ranges stay untrained: run a few calibration batches in training mode first",
            stacklevel=3,
        )


def _average_over_ranks(params: list) -> None:
    """Replicated models on several ranks (each its own batches): one mean gradient, so every rank
    takes the same step and keeps the same ranges. Parameters sharded by FSDP2 (DTensors, ZeRO
    stages 2-3) are left out: FSDP2's backward has already reduce-scattered their mean gradient."""
    from ..optim._dist import average_, world_size  # optim loads on first use (see __init__)

    params = [p for p in params if not hasattr(p, "full_tensor")]
    if world_size() == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    average_([p.grad for p in params])


def learn_ranges(model: nn.Module, batches: Iterable, loss: Optional[Callable] = None, lr: float = 1e-5) -> dict:
    """One AdamW step (lr, no weight decay) on the learned ranges per batch, in eval mode (no
    dropout, no activation-range updates), every other parameter frozen for the while and
    unfrozen after. On several ranks (torch.distributed initialised) the gradients are averaged,
    so the ranks keep equal ranges, whether the model is replicated or sharded (an engine at any
    ZeRO stage, or its `module`); every rank must run the same number of batches. batches: dicts
    (model(**b)), tuples or tensors; the loss is the output's `loss` (Hugging Face models given
    labels) unless loss(model, batch) returns it. Call it after init_compression with
    `range_learning: true` and after the ranges were initialised (the observer's,
    calibrate_weight_ranges, the schedule at its target bits, static activation ranges calibrated
    by a few training-mode batches: their learned ranges start from that calibration here).
    Returns {"steps", "first_loss", "last_loss"}."""
    model = unwrap(model)  # an engine or DDP: their own forward would all-reduce the gradients again
    _start_input_ranges(model)
    params = range_parameters(model)
    if not params:
        raise ValueError(
            "learn_ranges: no module of this model has learned ranges; set `range_learning: true` "
            "in the weight (or static activation) quantization groups before init_compression"
        )
    ids = {id(p) for p in params}
    frozen = [(p, p.requires_grad) for p in model.parameters() if id(p) not in ids]
    range_flags = [(p, p.requires_grad) for p in params]
    was_training = model.training
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    first = last = None
    steps = 0
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        model.eval()
        if hasattr(model, "set_requires_gradient_sync"):
            # FSDP2 root: an engine stopped between accumulation micro-steps (or driving a 1-bit
            # optimizer) leaves gradient sync off, and each rank would step on its own gradient
            model.set_requires_gradient_sync(True)
        for batch in batches:
            value = _loss(model, batch, loss)
            if not torch.isfinite(value):
                raise ValueError(f"learn_ranges: the loss is {value.item()} at step {steps + 1}")
            opt.zero_grad(set_to_none=True)
            value.backward()
            _average_over_ranks(params)
            opt.step()
            steps += 1
            last = float(value.detach())
            first = last if first is None else first
    finally:
        for p, flag in frozen + range_flags:
            p.requires_grad_(flag)
        model.train(was_training)
    return {"steps": steps, "first_loss": first, "last_loss": last}
