"""The model inside a wrapper: one rule for every part of qcompress that looks through one."""

from __future__ import annotations


def unwrap(model):
    """The model inside a wrapper (DistributedDataParallel, DataParallel, an engine) that holds
    nothing but it as `module`. A model that merely has a child named `module` beside others (a
    backbone and a head) is the model itself: looking through it would leave the rest out (of the
    rewrite, the export, the load)."""
    import torch.nn as nn

    inner = getattr(model, "module", None)
    if not isinstance(inner, nn.Module):
        return model
    if isinstance(model, nn.Module) and any(c is not inner for _, c in model.named_children()):
        return model
    return inner
