"""Activation checkpointing: DeepSpeed's `activation_checkpointing` section and `qcompress train
--gradient-checkpointing`. The model's transformer blocks keep only their inputs in the forward
and run again in the backward (non-reentrant torch.utils.checkpoint), trading compute for memory.

Hugging Face models use their own switch (activation_checkpointing_enable; it also turns the KV
cache off in training, which a recompute would otherwise extend twice). Other models: the
repeated blocks of each stack (nn/pld.py's auto_blocks: ModuleLists of same-class blocks) get a
checkpointed `forward`, so their hooks and progressive layer drop's decision (drawn in __call__)
stay outside the recompute. `number_checkpoints` checkpoints the first N blocks only;
`cpu_checkpointing` keeps the saved block inputs in CPU memory (torch.autograd.graph.save_on_cpu).

What a forward updates must not update twice: static activation ranges fold a batch into their
EMA only outside a recompute (nn/layers.py), and the recompute replays the range its forward used
(nn/recompute_ranges.py, through checkpoint's context_fn), PLD replays its decision, dropout replays its random
state (checkpoint's preserve_rng_state), so gradients equal those without checkpointing.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..nn import recompute_ranges

KEY = "activation_checkpointing"


def _checkpoint_fn(cpu: bool):
    """checkpoint(fn, *args, **kwargs), non-reentrant; with `cpu`, its saved inputs in CPU memory."""

    def run(function, *args, **kwargs):
        kwargs.setdefault("use_reentrant", False)
        # each recompute quantizes with the static ranges its own forward used (nn/recompute_ranges.py)
        kwargs.setdefault("context_fn", recompute_ranges.context_fn)
        if not cpu:
            return checkpoint(function, *args, **kwargs)
        pin = torch.cuda.is_available()
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return checkpoint(function, *args, **kwargs)

    return run


def _hf_layers(model: nn.Module) -> List[nn.Module]:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    if not getattr(model, "supports_gradient_checkpointing", False):
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _enable_hf(model: nn.Module, layers: List[nn.Module], count: int, cpu: bool) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fn = _checkpoint_fn(cpu)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < count
        layer._gradient_checkpointing_func = fn


class _CheckpointedForward:
    """A block's forward that recomputes in the backward (only while training with grad on)."""

    def __init__(self, block: nn.Module, forward, run):
        self.block, self.forward, self.run = block, forward, run

    def __call__(self, *args, **kwargs):
        if not (self.block.training and torch.is_grad_enabled()):
            return self.forward(*args, **kwargs)
        return self.run(self.forward, *args, **kwargs)


def _generic_blocks(model: nn.Module) -> List[nn.Module]:
    from ..nn.pld import auto_blocks

    return [m for stack in auto_blocks(model) for _, m in stack]


def enable_checkpointing(model: nn.Module, number_checkpoints=None, cpu_checkpointing: bool = False) -> int:
    """Checkpoint the model's blocks (the first `number_checkpoints`, default all). Returns how many."""
    hf = _hf_layers(model)
    blocks = hf or _generic_blocks(model)
    if not blocks:
        raise ConfigError(
            KEY,
            f"found no transformer blocks to checkpoint in {type(model).__name__} (a "
            "Hugging Face model's decoder layers, or a ModuleList of two or more blocks of one class)",
        )
    count = len(blocks) if number_checkpoints is None else min(int(number_checkpoints), len(blocks))
    if hf:
        _enable_hf(model, hf, count, cpu_checkpointing)
        return count
    run = _checkpoint_fn(cpu_checkpointing)
    for block in blocks[:count]:
        if isinstance(block.__dict__.get("forward"), _CheckpointedForward):
            continue  # enabled twice (initialize on a model that already has it)
        block.forward = _CheckpointedForward(block, block.forward, run)
    return count


def from_config(model: nn.Module, cfg) -> int:
    """The engine's call: the section's settings, or nothing when it is absent or disabled."""
    section = cfg.activation_checkpointing
    if section is None or not section.enabled:
        return 0
    return enable_checkpointing(model, section.number_checkpoints, section.cpu_checkpointing)
