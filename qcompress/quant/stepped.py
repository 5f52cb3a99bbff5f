"""Stochastic rounding with the step as a tensor, for compiled graphs.

The C++ quantizer ops take the rounding seed as an int, a constant of a compiled graph: folding
each training step into it compiled a new graph per step. Here the step is a 0-d int64 CPU tensor
(a graph input, filled in place by the schedule) and this op mixes it into the seed when it runs,
then calls the same C++ op: the bits equal the eager path's (rng.mix_seed). The step stays on the
CPU so reading it never synchronises a GPU stream.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import rng

_M32 = 0xFFFFFFFF


@torch.library.custom_op("qcompress_stepped::fake_quant", mutates_args=())
def fake_quant(
    x: torch.Tensor,
    range: Optional[torch.Tensor],
    step: torch.Tensor,
    rows: int,
    cols: int,
    group: int,
    bits: int,
    kind: int,
    symmetric: bool,
    deepspeed: bool,
    seed: int,
    with_mask: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    mixed = int(rng.mix_seed_tensor(seed, step))  # a CPU tensor: no device synchronisation
    return torch.ops.qcompress.fake_quant(
        x, range, rows, cols, group, bits, kind, symmetric, deepspeed, 1, mixed & _M32, with_mask
    )


@fake_quant.register_fake
def _(x, range, step, rows, cols, group, bits, kind, symmetric, deepspeed, seed, with_mask):
    # the C++ op's own fake kernel gives the shapes (quant/kernels.py)
    return torch.ops.qcompress.fake_quant(
        x, range, rows, cols, group, bits, kind, symmetric, deepspeed, 1, 0, with_mask
    )
