"""Learned rotations: orthogonal factors trained with the model (SpinQuant's idea, Cayley form).

Each learned rotation is C = (I + A)^-1 (I - A) with A = P - P^T skew-symmetric, P a Parameter
initialised to zero (C = I: training starts from the fixed Hadamard rotation already fused into
the weights). C is orthogonal for every P, so the parametrization keeps it orthogonal however the
optimizer moves P; it is computed in float64, once per forward of the model.

The factors live in `model.qc_rotations` (R1: one of the residual width; R2: one per layer, of the
head dim, repeated over the heads; R4: one block, shared by every down_proj, as compressed-tensors
shares one transform weight per scheme), so `model.parameters()` and the engine's optimizer take
them with the model's own parameters, and checkpoints hold them.

In the forward, each module whose tensors the rotation touches gets the rotated tensors for the
duration of its call (a pre-hook puts `rotate(W, C)` into `_parameters`, a hook puts the Parameter
back, as torch.func.functional_call swaps tensors), so quantizers, observers and range learning
see the rotated weights and gradients reach both W and P. An embedding or head that nothing
quantizes is rotated on its activations instead (the same function, without multiplying a
vocabulary-sized matrix at every step). `materialized()` gives export the rotated tensors;
`bake()` writes them into the Parameters for good (redundancy_clean).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from ..nn.layers import CompressMixin
from .hadamard import rotate_dim
from .online import online_rotations

ROOT_CHILD = "qc_rotations"
_SITES = "_qc_rot_sites"  # module.__dict__: {param name: [(dim, Cayley)]}
_SAVED = "_qc_rot_saved"  # module.__dict__: the Parameters swapped out for this call


class Cayley(nn.Module):
    """C = (I + A)^-1 (I - A), A = P - P^T; `skew` (P) starts at zero."""

    def __init__(self, n: int, dtype=torch.float32, device=None):
        super().__init__()
        self.skew = nn.Parameter(torch.zeros(n, n, dtype=dtype, device=device))
        self.__dict__["_cache"] = None

    def matrix(self) -> torch.Tensor:
        """C in float64; computed once per model forward (and again after P changes)."""
        cache = self.__dict__.get("_cache")
        key = (self.skew._version, torch.is_grad_enabled(), self.skew.data_ptr())
        if cache is not None and cache[0] == key:
            return cache[1]
        a = (self.skew - self.skew.t()).to(torch.float64)
        eye = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
        c = torch.linalg.solve(eye + a, eye - a)
        self.__dict__["_cache"] = (key, c)
        return c

    def clear(self) -> None:
        self.__dict__["_cache"] = None

    def __getstate__(self):
        # deepcopy / pickle: the cached C may hold an autograd graph, which neither can copy
        state = self.__dict__.copy()
        state["_cache"] = None
        return state

    def extra_repr(self) -> str:
        return f"n={self.skew.shape[0]}"


class LearnedRotations(nn.Module):
    """model.qc_rotations: R1 (Cayley), R2 (ModuleList of Cayley, one per layer), R4 (Cayley)."""

    def forget(self) -> None:
        for m in self.modules():
            if isinstance(m, Cayley):
                m.clear()


def _new_forward(root: nn.Module, args):
    # each forward of the model builds its own graph through C (two micro-batches must not share
    # one that the first backward has freed)
    rots = root._modules.get(ROOT_CHILD)
    if isinstance(rots, LearnedRotations):
        rots.forget()


def _on_weights(module: nn.Module) -> bool:
    """Rotate this module's weights (not its activations): it quantizes something, so its
    quantizers must see the rotated weight and input."""
    return isinstance(module, CompressMixin) and (module.qc_wq is not None or module.qc_aq is not None)


def _activation_side(module: nn.Module) -> bool:
    sites = module.__dict__.get(_SITES) or {}
    return (
        isinstance(module, (nn.Embedding, nn.Linear))
        and list(sites) == ["weight"]
        and len(sites["weight"]) == 1
        and not _on_weights(module)
    )


def _rotated(module: nn.Module, pname: str, t: torch.Tensor) -> torch.Tensor:
    for dim, cay in module.__dict__[_SITES][pname]:
        t = rotate_dim(t, dim, cay.matrix().to(t.dtype))
    return t


def _pre(module: nn.Module, args):
    if _activation_side(module):
        if isinstance(module, nn.Linear) and args:  # x (W C)^T = (x C^T) W^T
            ((dim, cay),) = module.__dict__[_SITES]["weight"]
            return (args[0] @ cay.matrix().to(args[0].dtype).t(),) + tuple(args[1:])
        return None
    saved = {}
    for pname in module.__dict__[_SITES]:
        p = module._parameters[pname]
        saved[pname] = p
        module._parameters[pname] = _rotated(module, pname, p)
    module.__dict__[_SAVED] = saved
    return None


def _post(module: nn.Module, args, output):
    saved = module.__dict__.pop(_SAVED, None)
    if saved:
        for pname, p in saved.items():
            module._parameters[pname] = p
        return None
    if _activation_side(module) and isinstance(module, nn.Embedding) and isinstance(output, torch.Tensor):
        ((dim, cay),) = module.__dict__[_SITES]["weight"]
        return output @ cay.matrix().to(output.dtype)
    return None


def wire(
    root: nn.Module,
    sites: Dict[str, List[Tuple[str, int, str]]],
    factors: LearnedRotations,
    online: Dict[str, nn.Module],
) -> None:
    """Attach the learned factors: `sites` maps a module name to (param, dim, factor key) with
    factor keys 'R1', 'R2.<layer>', 'R4'; `online` maps down_proj names to their OnlineRotation."""
    root.add_module(ROOT_CHILD, factors)
    modules = dict(root.named_modules())
    for name, entries in sites.items():
        mod = modules[name]
        table: Dict[str, list] = {}
        for pname, dim, key in entries:
            table.setdefault(pname, []).append((dim, factors.get_submodule(key)))
        mod.__dict__[_SITES] = table
        mod.register_forward_pre_hook(_pre)
        mod.register_forward_hook(_post, always_call=True)
    for rot in online.values():
        rot.__dict__["_qc_cayley"] = factors.get_submodule("R4")
        rot.kind = "random-hadamard"  # a dense orthogonal block once trained (see export)
    root.register_forward_pre_hook(_new_forward)


def unwire(root: nn.Module) -> None:
    """Remove the learned factors and their hooks (the weights keep what they hold)."""
    for mod in root.modules():
        if mod.__dict__.pop(_SITES, None) is not None:
            mod.__dict__.pop(_SAVED, None)
            for hooks, fn in ((mod._forward_pre_hooks, _pre), (mod._forward_hooks, _post)):
                for key in [k for k, f in hooks.items() if f is fn]:
                    del hooks[key]
                    getattr(mod, "_forward_hooks_always_called", {}).pop(key, None)
    for _, rot in online_rotations(root):
        rot.__dict__.pop("_qc_cayley", None)
    for key in [k for k, f in root._forward_pre_hooks.items() if f is _new_forward]:
        del root._forward_pre_hooks[key]
    root._modules.pop(ROOT_CHILD, None)


def has_learned(root: nn.Module) -> bool:
    return isinstance(root._modules.get(ROOT_CHILD), LearnedRotations)


def _targets(root: nn.Module):
    """{id(param): (module, pname, rotated tensor)}: each Parameter once (tied ones share it)."""
    out = {}
    for mod in root.modules():
        table = mod.__dict__.get(_SITES)
        if not table:
            continue
        for pname in table:
            p = mod._parameters[pname]
            if id(p) not in out:
                out[id(p)] = (p, _rotated(mod, pname, p.detach()).to(p.dtype))
    return out


@contextlib.contextmanager
def materialized(root: nn.Module):
    """The learned rotations written into the tensors for the duration (export reads them): each
    rotated module's Parameters replaced by their rotated values, each online rotation's block by
    the block in use, and model.qc_rotations hidden; everything is put back afterwards."""
    if not has_learned(root):
        yield
        return
    with torch.no_grad():
        factors = root._modules[ROOT_CHILD]
        factors.forget()
        values = _targets(root)
        swapped = []
        for mod in root.modules():
            for pname in mod.__dict__.get(_SITES) or {}:
                p = mod._parameters[pname]
                swapped.append((mod._parameters, pname, p))
                mod._parameters[pname] = values[id(p)][1]
        for _, rot in online_rotations(root):
            swapped.append((rot._buffers, "weight", rot.weight))
            rot._buffers["weight"] = rot.block().detach()
        hidden = root._modules.pop(ROOT_CHILD)
        cayleys = {}
        for _, rot in online_rotations(root):  # block() must not apply C a second time
            cayleys[id(rot)] = (rot, rot.__dict__.pop("_qc_cayley", None))
    try:
        yield
    finally:
        for store, key, value in reversed(swapped):
            store[key] = value
        root._modules[ROOT_CHILD] = hidden
        for rot, cay in cayleys.values():
            if cay is not None:
                rot.__dict__["_qc_cayley"] = cay


@torch.no_grad()
def bake(root: nn.Module) -> bool:
    """Write the learned rotations into the weights and online blocks for good, then remove the
    factors (the model computes the same function). Returns whether there was anything to bake."""
    if not has_learned(root):
        return False
    root._modules[ROOT_CHILD].forget()
    for p, value in _targets(root).values():
        p.copy_(value)
    for _, rot in online_rotations(root):
        rot.weight.copy_(rot.block())
    unwire(root)
    return True
