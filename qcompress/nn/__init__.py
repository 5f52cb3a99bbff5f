"""Compress-aware modules (Linear, Conv1d/2d/3d, Embedding, BatchNorm2d, HF Conv1D, their subclasses)."""

from .layers import CompressMixin, kind_of, make_compress_aware, own_forward, restore_class, unsupported_reason
from .state import ActQuant, WeightQuant

__all__ = [
    "CompressMixin",
    "kind_of",
    "make_compress_aware",
    "own_forward",
    "restore_class",
    "unsupported_reason",
    "WeightQuant",
    "ActQuant",
]
