"""Compress-aware modules (Linear, Conv1d/2d, Embedding, BatchNorm2d, HF Conv1D)."""
from .layers import CompressMixin, kind_of, make_compress_aware, restore_class
from .state import ActQuant, WeightQuant

__all__ = ["CompressMixin", "kind_of", "make_compress_aware", "restore_class", "WeightQuant", "ActQuant"]
