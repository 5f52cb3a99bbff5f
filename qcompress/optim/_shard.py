"""ZeRO stage 1 for the 1-bit optimizers: which elements of the compressed parameters a rank owns.

The compressed parameters are laid end to end in the optimizer's flat buckets (_buckets.Buckets).
Bucket [s, e) is padded to Np = padded_length(e - s, P) and cut into P chunks of C = Np / P, exactly
as qcompress.comm.compressed_allreduce cuts it; rank r owns chunk r of every bucket (the chunk it
serves in phase 1 of the compressed all-reduce). A rank keeps the per-element optimizer state
(variance, cached denominator, fp32 master copy) only for the elements it owns, computes the
update only there, and `allgather_params` rebuilds every parameter with ONE all_gather_into_tensor
per step in the parameters' dtype. Everything here is elementwise on slices, so the owned
elements get the same bits as the unsharded optimizer gives them.

Cost: the all-gather moves (P-1)/P * N * bytes_per_param per rank each way per step (counted in
qcompress.comm.stats), more than the 1-bit momentum payload (about (P-1)/P * N/4 bytes): the price
of not holding the full variance on every rank. In hierarchical mode (comm_hierarchy) the owned
chunks are still the flat P-way chunks: ownership is a bookkeeping choice and does not have to
match who serves what for the results to be exact.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from . import _dist


class Shards:
    """The owned slices of a fixed parameter list over the optimizer's bucket layout, and the gather."""

    def __init__(self, params: List[torch.Tensor], buckets, group=None):
        from ..comm.allreduce import padded_length

        self.params = list(params)
        self.group = group
        self.world = _dist.world_size(group)
        self.rank = _dist.rank(group)
        self.total = sum(p.numel() for p in self.params)
        self.chunks: List[Tuple[int, int, int, int]] = []  # (start, end, chunk length, offset in own buffer)
        own = 0
        for start, end in buckets.ranges:
            c = padded_length(end - start, self.world, buckets.compressor) // self.world
            self.chunks.append((start, end, c, own))
            own += c
        self.own_len = own
        # Per parameter: [(lo, hi, offset in its state vector, offset in the own buffer)], owned count.
        self.segments: Dict[int, Tuple[list, int]] = {}
        offset = 0
        for p in self.params:
            n = p.numel()
            segs, so = [], 0
            for start, end, c, ob in self.chunks:
                mine = start + self.rank * c
                a, b = max(offset, mine), min(offset + n, mine + c, end)
                if a < b:
                    segs.append((a - offset, b - offset, so, ob + a - mine))
                    so += b - a
            self.segments[id(p)] = (segs, so)
            offset += n
        dtypes = {p.dtype for p in self.params}
        # One collective per step: in the parameters' dtype, or float32 (exact for bf16/fp16) if mixed.
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32

    def holds(self, p) -> bool:
        return id(p) in self.segments

    def owned_numel(self, p) -> int:
        return self.segments[id(p)][1]

    def owned(self, p, x: torch.Tensor) -> torch.Tensor:
        """A new 1-D tensor of the elements of `x` (shaped like p) that this rank owns."""
        segs = self.segments[id(p)][0]
        flat = x.reshape(-1)
        if not segs:
            return flat[:0].clone()
        if len(segs) == 1:
            lo, hi, _, _ = segs[0]
            return flat[lo:hi].clone()
        return torch.cat([flat[lo:hi] for lo, hi, _, _ in segs])

    def write(self, p, values: torch.Tensor) -> None:
        """Copy this rank's owned values (1-D, from `owned`) into p."""
        flat = p.view(-1)  # parameters are contiguous; view() raises otherwise instead of copying
        for lo, hi, so, _ in self.segments[id(p)][0]:
            flat[lo:hi].copy_(values[so : so + hi - lo])

    def gather(self, owned_of: Callable[[torch.Tensor], torch.Tensor], dtype) -> List[torch.Tensor]:
        """Every parameter's full flat vector, assembled from each rank's owned values
        (`owned_of(p)` gives this rank's 1-D owned values of p)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        own = torch.zeros(self.own_len, dtype=dtype, device=device)
        for p in self.params:
            values = owned_of(p)
            for lo, hi, so, ob in self.segments[id(p)][0]:
                own[ob : ob + hi - lo].copy_(values[so : so + hi - lo])
        if self.world > 1:
            from ..comm.stats import add as _count_bytes
            from ..comm.allreduce import _all_gather_flat

            out = torch.empty(self.world * self.own_len, dtype=dtype, device=device)
            _all_gather_flat(out, own, group=self.group)
            nbytes = (self.world - 1) * self.own_len * own.element_size()
            _count_bytes(nbytes, nbytes)
        else:
            out = own
        full = torch.empty(self.total, dtype=dtype, device=device)
        for start, end, c, ob in self.chunks:
            for q in range(self.world):
                a, b = start + q * c, min(start + (q + 1) * c, end)
                if a < b:
                    src = q * self.own_len + ob
                    full[a:b].copy_(out[src : src + b - a])
        pieces, offset = [], 0
        for p in self.params:
            pieces.append(full[offset : offset + p.numel()])
            offset += p.numel()
        return pieces

    @torch.no_grad()
    def allgather_params(self) -> None:
        """Rebuild every parameter from the owners' slices (the step's only extra collective)."""
        if self.world == 1 or not self.params:
            return
        full = self.gather(lambda p: self.owned(p, p.detach()).to(self.gather_dtype), self.gather_dtype)
        for p, flat in zip(self.params, full):
            p.copy_(flat.view_as(p))

    def gather_masks(self, owned_mask_of) -> List[torch.Tensor]:
        """Full boolean masks from each rank's owned boolean values (used once, at the freeze)."""
        full = self.gather(lambda p: owned_mask_of(p).to(torch.uint8), torch.uint8)
        return [f.bool() for f in full]
