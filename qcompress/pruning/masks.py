"""Mask math: top-k binarizer with a straight-through gradient, L1 scores, applying masks.

Masks are kept in the weight's matrix orientation ([out, in, ...]; HF Conv1D is transposed
on the way in and out), with these shapes:
  sparse  like the weight          row [out, 1]     head [num_heads, 1] on W^T blocks
  channel [out, 1, 1, 1] (conv2d; one trailing 1 per kernel dim)
"""

from __future__ import annotations

import math

import torch

ORDER = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


def keep_count(ratio: float, numel: int) -> int:
    """ceil(ratio * numel), robust to float noise (0.1 * 30 is 3.0000000000000004, not 4)."""
    return max(1, min(numel, math.ceil(round(ratio * numel, 6))))


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 on the ceil(ratio*numel) largest scores, 0 elsewhere (same shape and dtype as scores)."""
    flat = scores.detach().flatten()
    idx = torch.topk(flat.float(), keep_count(ratio, flat.numel())).indices
    mask = torch.zeros_like(flat)
    mask[idx] = 1
    return mask.view_as(scores)


class _TopKBinarizer(torch.autograd.Function):
    """Forward: top-k mask of the scores. Backward: the mask's gradient goes to the scores as is."""

    @staticmethod
    def forward(ctx, scores, ratio):
        return topk_mask(scores, ratio)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def topk_binarize(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    return _TopKBinarizer.apply(scores, ratio)


def l1_scores(technique: str, w: torch.Tensor) -> torch.Tensor:
    """Importance from the weight (matrix view): |W|, row L1 norms or per-channel L1 norms."""
    w = w.detach().float()
    if technique == "sparse_pruning":
        return w.abs()
    if technique == "row_pruning":
        return w.abs().sum(dim=1, keepdim=True)  # [out, 1]
    if technique == "channel_pruning":
        dims = tuple(range(1, w.dim()))
        return w.abs().sum(dim=dims, keepdim=True)  # [out, 1, 1, 1]
    raise ValueError(f"{technique} has no l1 method (head pruning is topk only)")


def head_blocks(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """W [out, in] -> W^T viewed [num_heads, in/num_heads * out]: row h = head h's input columns."""
    return w.t().reshape(num_heads, -1)


def _apply_one(technique, state, w, mask):
    if technique == "head_pruning":
        out, inp = w.shape
        blocks = head_blocks(w, state.num_heads) * mask.reshape(-1, 1)
        return blocks.reshape(inp, out).t()
    return w * mask


def apply_weight_masks(module, w: torch.Tensor) -> torch.Tensor:
    """The weight with every active pruning mask of `module` multiplied in (stored orientation)."""
    view = module.weight_matrix_view(w)
    changed = False
    for tech in ORDER:
        state = module.qc_pruning.get(tech)
        if state is None or not state.active:
            continue
        view = _apply_one(tech, state, view, state.mask(module).to(view.dtype))
        changed = True
    return module._from_matrix_view(view) if changed else w


def apply_bias_masks(module, b: torch.Tensor) -> torch.Tensor:
    """Row and channel pruning zero the bias of pruned outputs too."""
    for tech in ("row_pruning", "channel_pruning"):
        state = module.qc_pruning.get(tech)
        if state is not None and state.active:
            b = b * state.mask(module).reshape(-1).to(b.dtype)
    return b
