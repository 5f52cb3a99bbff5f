"""Hierarchical compressed all-reduce: uncompressed inside a node, compressed only across nodes.

For nodes N_1..N_K (lists of ranks; the first rank of each node is its leader) and W ranks in all:
  1. reduce (sum, uncompressed) the node's inputs to the leader;
  2. the leader scales the node sum by K / W, so that the plain average over the K leaders is the
     average over all W ranks (exact for any node sizes);
  3. the leaders run the flat compressed all-reduce among themselves (P = K, errors live only in the
     leaders' OneBitState);
  4. the leader broadcasts the result inside its node, so every rank ends with the same bits.
With a single node (hierarchy="node" on one host, or Hierarchy([[0, ..., W-1]])) nothing crosses
nodes, so nothing is compressed: the leader divides the sum by W and broadcasts the exact average;
no error is kept.
Built from hostnames (one all-gather of a 32-byte hostname digest per rank) with hierarchy="node",
automatically with "auto" when ranks span several hosts, or from explicit node lists:
Hierarchy([[0, 1], [2, 3]]).
"""

from __future__ import annotations

import hashlib
import socket

import torch
import torch.distributed as dist

from . import stats as _stats
from .flat import _all_gather_flat, flat_compressed_allreduce


class Hierarchy:
    """Node layout of a process group and the subgroups it needs.

    nodes: lists of ranks *in `group`* (default: the world), a partition of the group. Constructing
    one is collective: every rank of the group must build the same Hierarchy, in the same order,
    because it creates process groups.
    """

    def __init__(self, nodes, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Hierarchy needs an initialised torch.distributed process group")
        world = dist.get_world_size(group)
        nodes = [sorted(int(r) for r in node) for node in nodes]
        flat = sorted(r for node in nodes for r in node)
        if flat != list(range(world)) or any(not node for node in nodes):
            raise ValueError(
                f"Hierarchy nodes must partition the group's ranks 0..{world - 1} into non-empty lists, got {nodes}"
            )
        self.nodes = nodes
        self.group = group
        self.world_size = world
        rank = dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.node_index = next(i for i, node in enumerate(nodes) if rank in node)
        my_node = nodes[self.node_index]
        self.leader = my_node[0]
        self.leader_global = to_global(self.leader)
        self.is_leader = rank == self.leader
        self.node_size = len(my_node)
        # Every rank must take part in creating every subgroup, in the same order.
        self.intra_group = None
        for i, node in enumerate(nodes):
            g = dist.new_group([to_global(r) for r in node]) if len(node) > 1 else None
            if i == self.node_index:
                self.intra_group = g
        self.leader_group = dist.new_group([to_global(node[0]) for node in nodes])
        self.num_nodes = len(nodes)

    def __repr__(self):
        return f"Hierarchy(nodes={self.nodes})"

    def allreduce(self, flat: torch.Tensor, state, comp):
        """Average flat float32 `flat` over the group (steps 1-4 of the module docstring)
        -> (result, finite) as flat_compressed_allreduce."""
        nbytes = flat.numel() * flat.element_size()
        buf = flat.clone()
        if self.intra_group is not None:
            dist.reduce(buf, dst=self.leader_global, op=dist.ReduceOp.SUM, group=self.intra_group)
            if self.is_leader:
                _stats.add(0, (self.node_size - 1) * nbytes)
            else:
                _stats.add(nbytes, 0)
        if self.is_leader and self.num_nodes == 1:
            # Nothing crosses nodes: the exact average, and no error to keep.
            out = buf / self.world_size
            finite = bool(torch.isfinite(out).all())
        elif self.is_leader:
            buf = buf * (self.num_nodes / self.world_size)
            out, finite = flat_compressed_allreduce(buf, state, self.leader_group, comp)
        else:
            out = torch.empty_like(buf)
        if self.intra_group is not None:
            # Broadcast even a non-finite result, so the whole node reports it together.
            out = out.contiguous()
            dist.broadcast(out, src=self.leader_global, group=self.intra_group)
            if self.is_leader:
                _stats.add((self.node_size - 1) * nbytes, 0)
            else:
                _stats.add(0, nbytes)
                finite = bool(torch.isfinite(out).all())
        return out, finite


_HOST_KEY_BYTES = 32  # a sha256 of the hostname: fixed size, so one plain (counted) all-gather does


def _collective_device(group):
    """Where a small tensor must live for a collective on `group` (NCCL needs the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nodes_from_hostnames(group=None, device=None) -> list[list[int]]:
    """Ranks of `group` grouped by hostname, in order of first appearance (collective call: one
    all-gather of 32 bytes per rank, counted in qcompress.comm.stats). device: where the gathered
    tensor lives (default: CPU, or the current GPU under NCCL)."""
    world = dist.get_world_size(group)
    digest = hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).digest()
    device = _collective_device(group) if device is None else torch.device(device)
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    keys = torch.empty(world * _HOST_KEY_BYTES, dtype=torch.uint8, device=device)
    if world > 1:
        _all_gather_flat(keys, mine, group=group)
        _stats.add((world - 1) * _HOST_KEY_BYTES, (world - 1) * _HOST_KEY_BYTES)
    else:
        keys.copy_(mine)
    nodes: dict[bytes, list[int]] = {}
    for r, key in enumerate(keys.cpu().reshape(world, _HOST_KEY_BYTES)):
        nodes.setdefault(bytes(key.tolist()), []).append(r)
    return list(nodes.values())


_AUTO_CACHE: dict = {}


def _group_key(group):
    return "world" if group is None or group is dist.group.WORLD else id(group)


def resolve_hierarchy(hierarchy, group, device=None):
    """None for the flat algorithm, else the Hierarchy to use (built and cached per group). The first
    "auto" / "node" resolution for a group is collective (hostnames); device: see nodes_from_hostnames."""
    if isinstance(hierarchy, Hierarchy):
        if _group_key(hierarchy.group) != _group_key(group):
            raise ValueError("the Hierarchy was built for a different process group than the one passed")
        return hierarchy
    if hierarchy is None or hierarchy == "flat":
        return None
    if hierarchy not in ("auto", "node"):
        raise ValueError(f"hierarchy must be 'auto', 'flat', 'node' or a Hierarchy, got {hierarchy!r}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    key = (_group_key(group), dist.get_world_size(group), hierarchy)
    if key not in _AUTO_CACHE:
        nodes = nodes_from_hostnames(group, device)
        if hierarchy == "auto" and len(nodes) == 1:
            _AUTO_CACHE[key] = None
        else:
            _AUTO_CACHE[key] = Hierarchy(nodes, group)
    return _AUTO_CACHE[key]
