"""R4: a rotation of a Linear's input applied online, in the forward, as compressed-tensors does.

The rotation is a child module `{scheme}_input` of the Linear (`down_proj.R4_input`) holding the
unnormalized block (`weight`, b x b, float32), and a forward pre-hook on the Linear that replaces
its input x by x @ diag(weight, ..., weight) / sqrt(b): the names, the tensor and the arithmetic of
compressed-tensors' `input` transform location (HadamardTransform: the block-wise product in the
scheme's float32 precision, divided by sqrt(b), cast back to the input's dtype), so an export read
by compressed-tensors computes what load_quantized computes. The Linear's weight holds W @ T (its
input columns rotated the same way), so the layer's output does not change.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

SCHEME = "R4"
LOCATION = "input"
CHILD = f"{SCHEME}_{LOCATION}"


class OnlineRotation(nn.Module):
    """x -> x @ blockdiag(weight) / sqrt(b). With a learned rotation (transforms/learned.py) the
    block in use is weight @ C, C the learned orthogonal factor."""

    def __init__(self, weight: torch.Tensor, kind: str = "hadamard"):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.float32).contiguous())
        self.kind = kind  # exported scheme type (learned: random-hadamard)

    def block(self) -> torch.Tensor:
        """The unnormalized block in use now (what export writes), in float32 (compressed-tensors'
        precision for online transforms; a model cast to bf16 keeps it) or float64."""
        dt = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        cayley = self.__dict__.get("_qc_cayley")
        if cayley is None:
            return self.weight.to(dt)
        return (self.weight.to(torch.float64) @ cayley.matrix()).to(dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_block(x, self.block())

    def extra_repr(self) -> str:
        return f"block={self.weight.shape[0]}, type={self.kind}"


def apply_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' online product: (x in w's dtype) @ blockdiag(w), / sqrt(b), in x's dtype."""
    b = w.shape[0]
    v = x.to(w.dtype)
    if v.shape[-1] == b:
        y = v @ w
    else:
        y = (v.unflatten(-1, (v.shape[-1] // b, b)) @ w).flatten(-2)
    return (y / torch.tensor(b, dtype=torch.float64).sqrt()).to(x.dtype)


def _rotate_input(module: nn.Module, args):
    # module-level (not a closure): a deep-copied or pickled model finds its own child
    rot = module._modules.get(CHILD)
    if rot is None or not args:
        return None
    return (rot(args[0]),) + tuple(args[1:])


def attach(linear: nn.Module, weight: torch.Tensor, kind: str) -> OnlineRotation:
    """Give `linear` the online rotation of its input (its weight is rotated by the caller)."""
    rot = OnlineRotation(weight.to(device=_device_of(linear)), kind)
    linear.add_module(CHILD, rot)
    linear.register_forward_pre_hook(_rotate_input, prepend=True)
    return rot


def detach(linear: nn.Module) -> None:
    """Remove the online rotation (undo of a failed init_compression)."""
    linear._modules.pop(CHILD, None)
    for key in [k for k, fn in linear._forward_pre_hooks.items() if fn is _rotate_input]:
        del linear._forward_pre_hooks[key]


def online_rotations(root: nn.Module):
    """(Linear name, OnlineRotation) of every online rotation under root."""
    for name, mod in root.named_modules():
        rot = mod._modules.get(CHILD) if name else None
        if isinstance(rot, OnlineRotation):
            yield name, rot


def _device_of(mod: nn.Module) -> Optional[torch.device]:
    w = getattr(mod, "weight", None)
    return w.device if isinstance(w, torch.Tensor) else None
