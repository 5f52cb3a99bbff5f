"""Flat buckets over a fixed list of parameters, each with its own compression error state.

The optimizers compress one float32 quantity per parameter (momentum, gradient or accumulated
update). The quantities are laid end to end in parameter order and cut into buckets of
`bucket_size` elements; each bucket is one `qcompress.comm.compressed_allreduce` call with its
own error state, so the layout (and therefore which error belongs to which elements) only
depends on the parameter shapes and `bucket_size`: identical on every rank and across resumes.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import _dist


def _comm():
    # Imported lazily: qcompress.comm is only needed once ranks actually exchange compressed data.
    from .. import comm
    return comm


class Buckets:
    def __init__(self, params: List[torch.Tensor], bucket_size: int, group=None,
                 compressor: str = "onebit", comm_hierarchy: Optional[str] = None):
        self.numels = [p.numel() for p in params]
        self.total = sum(self.numels)
        self.bucket_size = int(bucket_size)
        self.group = group
        self.compressor = compressor
        self.comm_hierarchy = comm_hierarchy
        self.ranges = [(s, min(s + self.bucket_size, self.total)) for s in range(0, self.total, self.bucket_size)]
        self.device = params[0].device if params else torch.device("cpu")
        self.states = None  # created on first use, so world size 1 never touches qcompress.comm
        self._flat = None

    # ----------------------------------------------------------------- communication
    def _new_states(self):
        comm = _comm()
        return [comm.OneBitState() for _ in self.ranges]

    def allreduce_(self, tensors: List[torch.Tensor]) -> None:
        """Replace each float32 tensor by the compressed average over the group (in place)."""
        if _dist.world_size(self.group) == 1:
            return  # the mean over one rank is the tensor itself: nothing to send or compress
        if self.states is None:
            self.states = self._new_states()
        if self._flat is None:
            self._flat = torch.empty(self.total, dtype=torch.float32, device=self.device)
        flat = self._flat
        torch.cat([t.reshape(-1) for t in tensors], out=flat)
        comm = _comm()
        for (start, end), state in zip(self.ranges, self.states):
            out = comm.compressed_allreduce(flat[start:end], state, group=self.group,
                                            **self._comm_kwargs())
            if out is not None and out.data_ptr() != flat[start:end].data_ptr():
                flat[start:end].copy_(out.reshape(-1))
        offset = 0
        for t, n in zip(tensors, self.numels):
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def _comm_kwargs(self):
        kw = {"compressor": self.compressor}
        if self.comm_hierarchy is not None:
            kw["hierarchy"] = self.comm_hierarchy
        return kw

    def reset_errors(self) -> None:
        self.states = None

    # ----------------------------------------------------------------- checkpointing
    def layout(self) -> dict:
        return {"bucket_size": self.bucket_size, "numels": list(self.numels), "compressor": self.compressor,
                "comm_hierarchy": self.comm_hierarchy or ""}

    def errors_state_dict(self) -> Optional[list]:
        if self.states is None:
            return None
        return [_state_to_dict(s) for s in self.states]

    def load_errors(self, saved: Optional[list]) -> None:
        if saved is None:
            self.states = None
            return
        self.states = self._new_states()
        for state, entry in zip(self.states, saved):
            _state_from_dict(state, entry)


def _state_to_dict(state) -> dict:
    if hasattr(state, "state_dict"):
        return state.state_dict()
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(state).items()}


def _state_from_dict(state, entry: dict) -> None:
    if hasattr(state, "load_state_dict"):
        state.load_state_dict(entry)
        return
    for k, v in entry.items():
        setattr(state, k, v.clone() if torch.is_tensor(v) else v)
