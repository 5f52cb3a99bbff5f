"""The optimizers' view of compressed communication: one fixed parameter list, flat buckets.

The optimizers compress one float32 quantity per parameter (momentum, gradient or accumulated
update), always for the same parameter list in the same order: the tensors are laid end to end in
a persistent staging buffer and cut into buckets of `bucket_size` elements, each one
qcompress.comm.compressed_allreduce call with its own OneBitState (the layout of
qcompress.comm.BucketedCompressor, without its per-call allocations). With per_tensor (the
optimizers' scale_per_tensor) every tensor starts a bucket of its own, so it gets its own 1-bit
scales and errors; on the flat path all those buckets share the two collectives of one call
(qcompress.comm.allreduce.flat_compressed_allreduce_many). The layout depends only on the parameter
shapes, bucket_size and per_tensor, so it is identical on every rank and across resumes.

With one rank nothing is sent and nothing is compressed: the mean over one rank is exact.

The errors belong to a node layout (flat, or the hierarchical mode's nodes: leaders hold errors
for P = number of nodes, other ranks none). "auto" / "node" resolve it from hostnames only at the
first all-reduce, so errors restored from a checkpoint are checked against it there: made under
another layout, they are dropped with a warning. The layouts are global facts, identical on every
rank, so every rank drops or keeps its errors alike (no rank is left waiting in a collective).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from . import _dist

log = logging.getLogger("qcompress")
UNKNOWN_NODES = "unknown"  # errors from a checkpoint that does not record its node layout


def is_frozen(p: torch.Tensor) -> bool:
    """A parameter the user froze (requires_grad=False): like torch's optimizers (which see its
    gradient None), the compressed stages leave it and its state alone (no momentum decay, no
    weight decay); it sends zeros to keep the layout. requires_grad is the test, not a missing
    gradient: it is the same on every rank, while a gradient can be missing on one rank only (a
    branch unused there), which must still join the average."""
    return not p.requires_grad


def param_names(groups) -> List[str]:
    """'param_groups[i].params[j] (shape ...)' for each parameter, in layout order (error messages)."""
    return [
        f"param_groups[{i}].params[{j}] (shape {tuple(p.shape)})" for i, g in groups for j, p in enumerate(g["params"])
    ]


class Buckets:
    """skip_frozen: the layout covers only the parameters that require grad (a frozen one sends
    nothing), and is rebuilt, errors reset, when that set changes; every rank sees the same
    requires_grad flags, so every rank rebuilds alike. Off (ZeRO-1 sharding, whose owned slices
    follow the layout), frozen parameters keep their place and send zeros."""

    def __init__(
        self,
        params: List[torch.Tensor],
        bucket_size: int,
        group=None,
        compressor="onebit",
        comm_hierarchy=None,
        owner: str = "optimizer",
        per_tensor: bool = False,
        skip_frozen: bool = False,
        pending=None,
    ):
        self.params = list(params)
        self.skip_frozen = bool(skip_frozen)
        self.pending = pending  # p -> bool: a frozen tensor that still has an update to average
        self.bucket_size = int(bucket_size)
        self.group = group
        self.compressor = compressor
        self.hierarchy = "auto" if comm_hierarchy is None else comm_hierarchy
        self.per_tensor = bool(per_tensor)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.states = None  # one qcompress.comm.OneBitState per bucket, made on first use
        self.owner = owner  # names the optimizer in warnings
        self.nodes = None  # node layout the errors belong to: None = flat, else lists of ranks
        self._resolved = False
        self._hier = None
        self._build(self._active_now())

    def _active_now(self) -> tuple:
        return tuple(
            not (self.skip_frozen and is_frozen(p) and not (self.pending and self.pending(p))) for p in self.params
        )

    def _build(self, active: tuple) -> None:
        """The bucket layout over the parameters marked active."""
        self.active = active
        self.numels = [p.numel() for p, a in zip(self.params, active) if a]
        self.total = sum(self.numels)
        if self.per_tensor:
            # one bucket per parameter (split at bucket_size): every tensor gets its own 1-bit scales
            self.ranges, start = [], 0
            for n in self.numels:
                end = start + n
                self.ranges += [(s, min(s + self.bucket_size, end)) for s in range(start, end, self.bucket_size)]
                start += n
        else:
            self.ranges = [(s, min(s + self.bucket_size, self.total)) for s in range(0, self.total, self.bucket_size)]
        self._flat = None  # persistent float32 staging buffer: no 4N-byte allocation per step
        self._views = None  # one view of _flat per parameter in self.params, None where not active

    def _follow_freezing(self) -> None:
        active = self._active_now()
        if active == self.active:
            return
        if self.states is not None:
            log.warning(
                "%s: the set of parameters that require grad (or still have an update to average) "
                "changed; the compressed layout now covers %d of %d parameters and the compression "
                "errors restart from zero",
                self.owner,
                sum(active),
                len(active),
            )
        self.states = None
        self._build(active)

    def _new_states(self):
        from ..comm import OneBitState

        return [OneBitState() for _ in self.ranges]

    def allreduce_(self, tensors: List[torch.Tensor]) -> None:
        """Replace each float32 tensor by its compressed average over the group (in place); the
        tensors of parameters outside the layout (frozen, skip_frozen) are left as they are."""
        views = self.staging()
        if views is None or not tensors:
            return  # the mean over one rank is the tensor itself: nothing to send or compress
        for v, t in zip(views, tensors):
            if v is not None:
                v.copy_(t.reshape(-1))
        self.allreduce_staged_(tensors)

    def staging(self) -> Optional[List[Optional[torch.Tensor]]]:
        """Flat float32 views, one per parameter (None for one outside the layout: frozen under
        skip_frozen), of the persistent staging buffer that allreduce_staged_() averages; None at
        world size 1 (nothing is sent: compute in place). Filling them instead of the optimizer
        state keeps that state untouched until the collective has succeeded on every rank."""
        if _dist.world_size(self.group) == 1 or not self.params:
            return None
        self._follow_freezing()
        if self._flat is None:
            self._flat = torch.empty(self.total, dtype=torch.float32, device=self.device)
            it = iter(torch.split(self._flat, self.numels))
            self._views = [next(it) if a else None for a in self.active]
        return self._views

    @staticmethod
    def momentum_slot(
        stage: Optional[List[torch.Tensor]], k: int, m: torch.Tensor, frozen: bool
    ) -> Optional[torch.Tensor]:
        """Where parameter k's new momentum is built: its staging view holding a copy of m (the
        state changes only once the collective succeeds), or m itself at one rank (stage None).
        A frozen parameter's view is zeroed and None returned: every rank keeps the same layout."""
        view = None if stage is None else stage[k]
        if frozen:
            if view is not None:  # in the layout (skip_frozen off, or frozen since it was built)
                view.zero_()
            return None
        out = m if stage is None else view.view_as(m)
        if out is not m:
            out.copy_(m)
        return out

    def allreduce_staged_(self, targets: List[Optional[torch.Tensor]], names=None) -> None:
        """Compressed mean of the staging buffer (filled through staging()); then view i is copied
        into targets[i] (None: dropped). When any rank's data holds NaN / Inf, every rank raises
        NonFiniteError before writing any target, naming this rank's first non-finite tensor
        (names[i], else its index), and the error-feedback state is left unchanged."""
        from ..comm import compressed_allreduce
        from ..errors import NonFiniteError

        hier = self._resolve()
        if self.states is None:
            self.states = self._new_states()
        if not self.ranges:
            return  # every parameter is frozen: nothing to send
        flat = self._flat
        pieces = [flat[s:e] for s, e in self.ranges]
        if self.per_tensor and hier is None:
            # many small buffers: their rows share the two collectives of one call (latency)
            from ..comm.allreduce import flat_compressed_allreduce_many
            from ..comm.compressors import get_compressor

            outs, finite = flat_compressed_allreduce_many(
                pieces, self.states, self.group, get_compressor(self.compressor)
            )
        else:
            # a later bucket failing must not leave earlier buckets' errors advanced (errors are
            # replaced, not written into, by each call: keeping the references is the snapshot)
            saved = [(st.worker_error, st.server_error, st.compressor_name) for st in self.states]
            outs, finite = [], True
            for piece, state in zip(pieces, self.states):
                try:
                    outs.append(
                        compressed_allreduce(
                            piece,
                            state,
                            self.group,
                            compressor=self.compressor,
                            hierarchy="flat" if hier is None else hier,
                        )
                    )
                except NonFiniteError:  # raised on every rank alike: all leave the loop here
                    finite = False
                    for st, (we, se, name) in zip(self.states, saved):
                        st.worker_error, st.server_error, st.compressor_name = we, se, name
                    break
        if not finite:
            raise NonFiniteError(self._nonfinite_message(names))
        for piece, out in zip(pieces, outs):
            piece.copy_(out)
        for v, t in zip(self._views, targets):
            if t is not None and v is not None:
                t.copy_(v.view_as(t))

    def _nonfinite_message(self, names) -> str:
        where = "this rank's values are finite (another rank's are not)"
        for i, v in enumerate(self._views):
            if v is not None and not bool(torch.isfinite(v).all()):
                name = names[i] if names is not None else f"parameter {i} of the compressed layout"
                where = f"on this rank it is {name}"
                break
        return (
            f"{self.owner}: the compressed quantity holds NaN or Inf on at least one rank; {where}. Every "
            "rank raises this before changing the optimizer state or the error feedback, so the step can "
            "be skipped"
        )

    def _resolve(self):
        """The Hierarchy this run uses (None: flat); collective the first time (hostnames). Drops
        restored errors made under another node layout (on every rank alike, see the module doc)."""
        if not self._resolved:
            from ..comm.hierarchy import resolve_hierarchy

            self._hier = resolve_hierarchy(self.hierarchy, self.group, self.device)
            self._resolved = True
            nodes = None if self._hier is None else [list(n) for n in self._hier.nodes]
            if self.states is not None and self.nodes != nodes:
                log.warning(
                    "%s: compression errors reset at the first step after loading (they were made for "
                    "node layout %s, this run has %s); training continues with zero error feedback",
                    self.owner,
                    _describe(self.nodes),
                    _describe(nodes),
                )
                self.states = None
            self.nodes = nodes
        return self._hier

    def reset_errors(self) -> None:
        self.states = None

    # ----------------------------------------------------------------- checkpointing
    def layout(self) -> dict:
        name = lambda x: x if isinstance(x, str) else type(x).__name__  # noqa: E731
        out = {
            "bucket_size": self.bucket_size,
            "numels": list(self.numels),
            "compressor": name(self.compressor),
            "hierarchy": name(self.hierarchy),
        }
        if self.per_tensor:
            out["per_tensor"] = True
        if not all(self.active):
            out["skipped"] = [i for i, a in enumerate(self.active) if not a]
        return out

    def errors_state_dict(self) -> Optional[list]:
        """One {"worker_error", "server_error"} dict per bucket (empty for a bucket without errors)."""
        return None if self.states is None else [st.state_dict() for st in self.states]

    def load_errors(self, saved: Optional[list], nodes=UNKNOWN_NODES) -> None:
        """Restore per-bucket errors made under node layout `nodes` (checked at the next all-reduce)."""
        self.nodes = nodes
        self._resolved = False  # the layout of this run is checked against `nodes` at the next all-reduce
        if not saved:
            self.states = None
            return
        if len(saved) != len(self.ranges):
            raise ValueError(f"saved errors cover {len(saved)} buckets, this layout has {len(self.ranges)}")
        self.states = self._new_states()
        for st, entry in zip(self.states, saved):
            st.load_state_dict(entry)


def _describe(nodes) -> str:
    if nodes is None:
        return "flat"
    if nodes == UNKNOWN_NODES:
        return "unknown (the checkpoint does not record it)"
    return f"nodes {nodes}"
