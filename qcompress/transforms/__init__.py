"""Rotations of a decoder's weights and activations (QuaRot / SpinQuant): a model-level rewrite
step that init_compression runs before its module rewrite, so quantizers see rotated weights.

    qc.apply_rotations(model, cfg)     # alone (e.g. before GPTQ); init_compression then skips it

hadamard.py (the matrices), families.py (where each family's stream, heads and MLPs are),
fuse.py (norm folding, R1 / R2 fused, R4's weight half), online.py (R4 in the forward),
learned.py (Cayley factors trained with the model). The config is config/rotation.py; export
writes R4 as compressed-tensors' transform_config (export/rotations.py).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..config import as_config
from ..errors import ConfigError
from ..unwrap import unwrap
from . import fuse
from .families import PATH
from .fuse import describe, record_of
from .learned import bake as bake_learned, materialized

__all__ = ["apply_rotations", "prepare_rotations", "describe", "record_of", "bake_learned", "materialized", "Pending"]


class Pending:
    """A checked rotation plan: apply() changes the model (returns what undo() needs)."""

    def __init__(self, root: nn.Module, plan: fuse.Plan):
        self.root, self.plan = root, plan

    def apply(self) -> fuse.Applied:
        return fuse.execute(self.root, self.plan)


def prepare_rotations(model: nn.Module, cfg) -> Optional[Pending]:
    """The checked plan of `compression_training.rotation`, or None when rotations are off or
    the model was already rotated with these settings. ConfigError (naming the module and the
    reason) before anything is changed."""
    rot = as_config(cfg).compression.rotation
    if not rot.enabled:
        return None
    root = unwrap(model)
    done = record_of(root)
    if done is not None:
        want = {
            "rotations": list(rot.rotations),
            "type": rot.type,
            "block_size": rot.block_size,
            "learned": rot.learned,
            "seed": rot.seed,
        }
        have = {k: done[k] for k in want}
        if have != want:
            raise ConfigError(
                PATH,
                f"the model was already rotated with {have}; the config asks for {want}. "
                "Rotate a freshly built model instead",
            )
        return None
    return Pending(root, fuse.plan(root, rot))


def apply_rotations(model: nn.Module, cfg) -> nn.Module:
    """Rotate `model` in place as `compression_training.rotation` says; returns the model.

    The function the model computes does not change (in full precision); init_compression runs
    this first when the section is enabled, and skips it for a model already rotated so."""
    pending = prepare_rotations(model, cfg)
    if pending is not None:
        pending.apply().release()
    return model
