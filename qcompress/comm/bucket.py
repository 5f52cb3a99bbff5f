"""BucketedCompressor: compressed all-reduce of many tensors through flat buckets.

The tensors passed to one call are laid end to end (in list order) as one float32 vector, which is
cut into consecutive buckets of at most `bucket_size` elements (a tensor may straddle two buckets).
Each bucket is one compressed_allreduce with its own OneBitState, so a model with thousands of small
parameters costs ceil(total / bucket_size) calls, not one per tensor. The layout is fixed by the
first call (the list of element counts); later calls must pass tensors of the same sizes.
A NaN/Inf anywhere raises qcompress.NonFiniteError on every rank after all buckets ran, with every
bucket's errors left as before the call.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .allreduce import OneBitState, compressed_allreduce

DEFAULT_BUCKET_SIZE = 2**24  # 16M elements: 64 MB of fp32, 2 MB on the wire at 1 bit


class BucketedCompressor:
    """Error-compensated compressed averaging of a fixed list of tensors in flat buckets.

    bucket_size: elements per bucket (the last bucket holds the remainder). compressor, group,
    hierarchy: as in compressed_allreduce. state_dict() holds only tensors:
    {"bucket.<i>.worker_error", "bucket.<i>.server_error"} for each initialised bucket.
    """

    def __init__(self, bucket_size: int = DEFAULT_BUCKET_SIZE, *, compressor="onebit", group=None, hierarchy="auto"):
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive int (elements), got {bucket_size!r}")
        self.bucket_size = bucket_size
        self.compressor = compressor
        self.group = group
        self.hierarchy = hierarchy
        self.layout: list[int] | None = None
        self.states: list[OneBitState] = []

    def _check_layout(self, tensors) -> int:
        sizes = [t.numel() for t in tensors]
        if self.layout is None:
            total = sum(sizes)
            count = max(1, -(-total // self.bucket_size))
            if not self.states:
                self.states = [OneBitState() for _ in range(count)]
            elif len(self.states) != count:  # errors restored by load_state_dict
                raise ValueError(
                    f"the loaded state has {len(self.states)} buckets but these tensors need "
                    f"{count} buckets of {self.bucket_size} elements"
                )
            self.layout = sizes
        elif sizes != self.layout:
            raise ValueError(
                f"BucketedCompressor was set up for tensors of sizes {self.layout[:8]}"
                f"{'...' if len(self.layout) > 8 else ''} ({len(self.layout)} tensors) but got "
                f"{sizes[:8]}{'...' if len(sizes) > 8 else ''} ({len(sizes)} tensors); "
                f"use one BucketedCompressor per tensor list, or reset()"
            )
        return sum(sizes)

    def allreduce(self, tensors) -> list:
        """New tensors (each with its input's shape and dtype): the compressed average over ranks."""
        tensors = list(tensors)
        if not tensors:
            return []
        total = self._check_layout(tensors)
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        # Calls replace the state tensors (never write into them), so keeping references is a snapshot.
        before = [(st.worker_error, st.server_error, st.compressor_name) for st in self.states]
        pieces, failure = [], None
        for i, start in enumerate(range(0, max(total, 1), self.bucket_size)):
            bucket = flat[start : start + self.bucket_size]
            try:
                pieces.append(
                    compressed_allreduce(
                        bucket, self.states[i], self.group, compressor=self.compressor, hierarchy=self.hierarchy
                    )
                )
            except NonFiniteError as exc:  # every rank gets it for the same bucket; finish the others
                failure = exc
        if failure is not None:
            # All or nothing: a skipped step must not leave some buckets' errors advanced.
            for st, (we, se, name) in zip(self.states, before):
                st.worker_error, st.server_error, st.compressor_name = we, se, name
            raise failure
        out_flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        outs, offset = [], 0
        for i, t in enumerate(tensors):
            out = out_flat[offset : offset + t.numel()].reshape(t.shape).to(t.dtype)
            if t.dtype != torch.float32 and not bool(torch.isfinite(out).all()):
                # finite float32 averages that overflow the tensor's dtype (fp16 near 65504); the
                # results are the same on every rank, so all raise alike
                for st, (we, se, name) in zip(self.states, before):
                    st.worker_error, st.server_error, st.compressor_name = we, se, name
                raise NonFiniteError(
                    f"BucketedCompressor: the average of tensor {i} ({t.dtype}, shape "
                    f"{tuple(t.shape)}) overflows {t.dtype}; pass it in float32 or scale it "
                    "down (every rank raises this; the error-feedback state was left unchanged)"
                )
            outs.append(out)
            offset += t.numel()
        return outs

    def allreduce_(self, tensors) -> None:
        """In place: overwrite each tensor with its compressed average."""
        tensors = list(tensors)
        for t, r in zip(tensors, self.allreduce(tensors)):
            t.copy_(r)

    def reset(self) -> None:
        """Forget errors and layout."""
        self.layout = None
        self.states = []

    def state_dict(self) -> dict:
        sd = {}
        for i, st in enumerate(self.states):
            for k, v in st.state_dict().items():
                sd[f"bucket.{i}.{k}"] = v
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore bucket errors; the layout is taken from the next allreduce call."""
        indices = sorted({int(k.split(".")[1]) for k in sd if k.startswith("bucket.")})
        bad = [k for k in sd if not k.startswith("bucket.")]
        if bad:
            raise KeyError(f"BucketedCompressor.load_state_dict: unexpected keys {bad[:5]}")
        self.layout = None
        count = indices[-1] + 1 if indices else 0
        self.states = [OneBitState() for _ in range(count)]
        for i in indices:
            self.states[i].load_state_dict(
                {"worker_error": sd[f"bucket.{i}.worker_error"], "server_error": sd[f"bucket.{i}.server_error"]}
            )

    def __repr__(self):
        return (
            f"BucketedCompressor(bucket_size={self.bucket_size}, compressor={self.compressor!r}, "
            f"buckets={len(self.states)})"
        )
