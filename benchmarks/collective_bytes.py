"""Bytes each process group sends, counted at torch's dispatcher (a TorchDispatchMode in the rank).

The engine's Traffic counters see its data-parallel reducers only; DTensor's tensor-parallel
all-reduces (functional collectives), torch.distributed.pipelining's send / recv and the
quantizers' range reductions all pass through the dispatcher as c10d / _c10d_functional ops,
so this mode sees every one of them, whichever library issued it.

    count = CollectiveBytes({pg.group_name: "tp", ...})
    with count:
        engine.train_batch(it)
    count.sent      # {"tp": bytes this rank sent, ...}; count.unknown: ops it could not size

Counting rules (those of qcompress.engine.traffic): payload bytes; an all-reduce of B bytes over
P ranks sends 2(P-1)B/P (ring), a reduce-scatter of an input of B bytes (P-1)B/P, an all-gather of
a chunk of b bytes (P-1)b, a broadcast's root (P-1)B and the others nothing, a send its B.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(ts) -> int:
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(_nbytes(t) for t in ts)


def _ring_all_reduce(b, p):
    return 2 * (p - 1) * b // p


def _reduce_scatter(b, p):
    return (p - 1) * b // p


def _all_gather(b, p):
    return (p - 1) * b


# op name -> (index of the payload, index of the group, bytes sent from (payload bytes, group size))
_C10D = {
    "allreduce_": (0, 1, _ring_all_reduce),
    "allreduce_coalesced_": (0, 1, _ring_all_reduce),
    "_reduce_scatter_base_": (1, 2, _reduce_scatter),
    "reduce_scatter_tensor_coalesced_": (1, 2, _reduce_scatter),
    "_allgather_base_": (1, 2, _all_gather),
    "allgather_into_tensor_coalesced_": (1, 2, _all_gather),
    "allgather_": (1, 2, _all_gather),
    "send": (0, 1, lambda b, p: b),
    "recv_": (0, 1, lambda b, p: 0),
}
_FUNCTIONAL = {  # group_name is the last positional argument
    "all_reduce": (0, _ring_all_reduce),
    "all_reduce_": (0, _ring_all_reduce),
    "all_reduce_coalesced": (0, _ring_all_reduce),
    "all_reduce_coalesced_": (0, _ring_all_reduce),
    "reduce_scatter_tensor": (0, _reduce_scatter),
    "reduce_scatter_tensor_coalesced": (0, _reduce_scatter),
    "all_gather_into_tensor": (0, _all_gather),
    "all_gather_into_tensor_coalesced": (0, _all_gather),
}
_NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd"}


def _group(ref):
    """The ProcessGroup a functional collective names: by group_name, or the group itself."""
    if isinstance(ref, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(ref)
    return dist.ProcessGroup.unbox(ref) if isinstance(ref, torch.ScriptObject) else ref


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends per group label; `labels` maps group_name -> label (a group
    not named there is counted under its own name)."""

    def __init__(self, labels: dict):
        super().__init__()
        self.labels = dict(labels)
        self.sent = defaultdict(int)
        self.unknown = Counter()

    def _add(self, group_name: str, nbytes: int) -> None:
        self.sent[self.labels.get(group_name, f"group {group_name}")] += int(nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._opname
        if ns == "c10d":
            self._count_c10d(name, args)
        elif ns == "_c10d_functional" and name not in _NOT_COMMUNICATION:
            self._count_functional(name, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def _count_c10d(self, name, args):
        if name == "broadcast_":
            pg = dist.ProcessGroup.unbox(args[1])
            root = args[2]
            if pg.rank() == root:
                self._add(pg.group_name, (pg.size() - 1) * _nbytes(args[0]))
            return
        rule = _C10D.get(name)
        if rule is None:
            self.unknown[f"c10d.{name}"] += 1
            return
        payload, gi, size = rule
        pg = dist.ProcessGroup.unbox(args[gi])
        self._add(pg.group_name, size(_nbytes(args[payload]), pg.size()))

    def _count_functional(self, name, args, kwargs):
        rule = _FUNCTIONAL.get(name)
        if rule is None:
            self.unknown[f"_c10d_functional.{name}"] += 1
            return
        payload, size = rule
        pg = _group(kwargs.get("group_name", args[-1]))
        self._add(pg.group_name, size(_nbytes(args[payload]), pg.size()))


def mesh_labels(engine) -> dict:
    """group_name -> "tp" / "pp" / "dp" / "world" for a qcompress engine's mesh; without a mesh the
    whole world is the data-parallel group; a single process has no groups."""
    if not dist.is_initialized():
        return {}
    world = dist.group.WORLD.group_name
    mesh = engine.parallel.mesh
    if mesh is None:
        return {world: "dp"}
    labels = {world: "world"}
    for dim in ("pp", "dp", "tp"):
        labels[mesh[dim].get_group().group_name] = dim
    return labels
