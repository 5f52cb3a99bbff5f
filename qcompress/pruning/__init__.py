"""Sparse / row / head / channel pruning, redundancy-clean slicing, layer reduction, KD losses.

Semantics (DeepSpeed's, with its defects fixed) are described in README.md, "Pruning".
"""

from .masks import apply_bias_masks, apply_weight_masks, topk_mask
from .state import PruningState

__all__ = ["PruningState", "apply_weight_masks", "apply_bias_masks", "topk_mask"]
