"""Running a model's repeated blocks one at a time on calibration batches (GPTQ's sequential
calibration, qcompress/calibrate/gptq.py).

The blocks are found by structure: the nn.ModuleList of two or more children of one class that
holds the most of the modules to calibrate (a decoder's `model.layers`, GPT-2's `transformer.h`).
One forward of the whole model per batch records what each block is called with: the hidden state
going into the first block, and every block's own other arguments (attention masks, rotary
position embeddings, cache positions: per block, so families whose layers take different masks,
sliding or full, get their own). Caches are dropped from those arguments (a cache object, and
`use_cache`), so running a block again does not attend to keys it stored the first time.
Then block i runs on the outputs block i - 1 gave, with its own arguments. That each block's input
is the previous block's output (a decoder's residual stream) is checked on that first forward:
a model that changes the hidden state between blocks is reported, not run wrongly.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def run_batch(model: nn.Module, batch, forward: Optional[Callable] = None):
    """model(**batch) for a dict, model(*batch) for a tuple / list, model(batch) otherwise; or
    forward(model, batch)."""
    if forward is not None:
        return forward(model, batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def repeated_blocks(model: nn.Module, wanted) -> Optional[Tuple[str, List[nn.Module]]]:
    """(name, blocks) of the ModuleList of >= 2 same-class children holding the most modules of
    `wanted` (a set of module ids), or None."""
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or len({type(c) for c in mod}) != 1:
            continue
        n = sum(id(m) in wanted for m in mod.modules())
        if n and (best is None or n > best[0]):
            best = (n, name, list(mod))
    return None if best is None else (best[1], best[2])


def _is_cache(v) -> bool:
    return callable(getattr(v, "update", None)) and callable(getattr(v, "get_seq_length", None))


def _without_caches(args: tuple, kwargs: dict):
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: (None if (k in _CACHE_KWARGS or _is_cache(v)) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


class BlockCalls:
    """What each block was called with on each batch (the hidden state for the first block only)."""

    def __init__(self, blocks: List[nn.Module], where: str):
        self.blocks, self.where = blocks, where
        self.calls: List[List[Tuple[tuple, dict, bool]]] = [[] for _ in blocks]  # (args, kwargs, hidden in args)
        self.first_inputs: List[torch.Tensor] = []
        self._out = None  # (block index, its output hidden state) of the block that ran last
        self.unchained: List[int] = []  # blocks whose input was not the previous block's output

    def hooks(self):
        handles = []
        for i, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(self._hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(self._out_hook(i)))
        return handles

    def _out_hook(self, i: int):
        def hook(module, args, out):
            self._out = (i, _hidden_of(out))

        return hook

    def _chained(self, i: int, hidden: torch.Tensor) -> bool:
        if i == 0:
            return True
        if self._out is None or self._out[0] != i - 1 or self._out[1] is None:
            return False
        prev = self._out[1]
        return hidden is prev or (hidden.shape == prev.shape and torch.equal(hidden, prev))

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            args, kwargs = _without_caches(tuple(args), dict(kwargs))
            if args and isinstance(args[0], torch.Tensor):
                hidden, rest, positional = args[0], (None,) + args[1:], True
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                hidden, rest, positional = kwargs["hidden_states"], args, False
            else:
                raise RuntimeError(
                    f"{self.where}[{i}] ({type(module).__name__}) was called without a hidden "
                    "state tensor as its first argument or `hidden_states`, so its blocks cannot "
                    "be run one at a time: set observer_kwargs.sequential: false"
                )
            if i == 0:
                self.first_inputs.append(hidden)
            elif not self._chained(i, hidden) and i not in self.unchained:
                self.unchained.append(i)
            self._out = None
            kept = {k: v for k, v in kwargs.items() if k != "hidden_states" or positional}
            self.calls[i].append((rest, kept, positional))
            return args, kwargs

        return hook

    def run(self, i: int, b: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block i on batch b's arguments with `hidden` as its input; its output hidden state."""
        rest, kwargs, positional = self.calls[i][b]
        if positional:
            out = self.blocks[i](hidden, *rest[1:], **kwargs)
        else:
            out = self.blocks[i](*rest, hidden_states=hidden, **kwargs)
        out = _hidden_of(out)
        if out is None:
            raise RuntimeError(
                f"{self.where}[{i}] ({type(self.blocks[i]).__name__}) returned a "
                f"{type(out).__name__}, not a hidden state tensor (or a tuple starting with one): "
                "set observer_kwargs.sequential: false"
            )
        return out


def _hidden_of(out) -> Optional[torch.Tensor]:
    """A block's output hidden state: the tensor, or the first element of a tuple / list."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None
