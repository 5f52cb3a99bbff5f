"""compressed_allreduce: the error-compensated compressed average, flat or hierarchical.

The flat two-phase algorithm is in flat.py, the hierarchical one (uncompressed inside a node,
compressed across nodes) in hierarchy.py, which builds on flat.py; this module picks one per call.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .compressors import get_compressor

# the flat algorithm's names stay importable from here
from .flat import (
    OneBitState,
    _all_gather_flat,
    flat_compressed_allreduce,
    flat_compressed_allreduce_many,
    group_size_rank,
    padded_length,
)
from .hierarchy import resolve_hierarchy

__all__ = [
    "compressed_allreduce",
    "OneBitState",
    "flat_compressed_allreduce",
    "flat_compressed_allreduce_many",
    "group_size_rank",
    "padded_length",
    "_all_gather_flat",
]


def compressed_allreduce(
    tensor: torch.Tensor, state: OneBitState, group=None, *, compressor="onebit", hierarchy="auto"
) -> torch.Tensor:
    """Error-compensated compressed average of `tensor` over `group` (default: the world).

    Returns a new tensor with the input's shape and dtype, bit-identical on every rank. `state`
    (a OneBitState per buffer) carries this rank's errors between calls. compressor: a registered
    name ("onebit", "int8", ...) or a Compressor instance. hierarchy: "auto" (hierarchical when the
    group's ranks span several hosts, detected once per group), "flat", "node" (hierarchical by
    hostname; a single node gives the exact average, uncompressed, and keeps no error), or a
    Hierarchy object (explicit node groups, e.g. simulated nodes in tests).

    Raises qcompress.NonFiniteError on every rank (after the collectives, so none hangs) when any
    rank's input holds NaN or Inf; the errors in `state` are then left as they were, so a caller
    that skips the step (fp16 overflow) loses nothing.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compressed_allreduce needs a tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"compressed_allreduce needs a floating-point tensor, got {tensor.dtype}")
    if not isinstance(state, OneBitState):
        raise TypeError(f"state must be a qcompress.comm.OneBitState, got {type(state).__name__}")
    comp = get_compressor(compressor)
    flat = tensor.detach().reshape(-1).to(torch.float32)

    hier = resolve_hierarchy(hierarchy, group, flat.device)
    # calls replace the error tensors (never write into them): these references are a snapshot
    before = (state.worker_error, state.server_error, state.compressor_name)
    if hier is None:
        out, finite = flat_compressed_allreduce(flat, state, group, comp)
    else:
        out, finite = hier.allreduce(flat, state, comp)
    if not finite:
        here = "" if bool(torch.isfinite(flat).all()) else " (this rank's does)"
        raise NonFiniteError(
            f"compressed_allreduce: the input holds NaN or Inf on at least one rank{here}, or "
            "its values plus the error feedback overflow float32 (every rank raises this; the "
            "error-feedback state was left unchanged)"
        )
    result = out.reshape(tensor.shape).to(tensor.dtype)
    if tensor.dtype != torch.float32 and not bool(torch.isfinite(result).all()):
        # The result is the same on every rank, so every rank raises here alike. Casting it back
        # to float16 overflowed: an inf would have been returned silently from finite inputs.
        state.worker_error, state.server_error, state.compressor_name = before
        raise NonFiniteError(
            f"compressed_allreduce: the average of this {tensor.dtype} tensor overflows "
            f"{tensor.dtype} (largest value {float(out.abs().max()):.6g}); pass it in float32 "
            "or scale it down (every rank raises this; the error-feedback state was left "
            "unchanged)"
        )
    return result
