"""The two-phase error-compensated compressed all-reduce (1-bit by default).

With P ranks, x the flat input zero-padded to Np (a multiple of elem_multiple * P; 8 * P for
1 bit) and C = Np / P:
  phase 1  every rank compresses y = x + e_w (its worker error) into P payload rows, one per
           chunk of C elements, keeps e_w <- y - decoded(y), and ONE all_to_all_single sends row r
           to rank r;
  server   rank r averages the P rows it received (the P ranks' versions of chunk r), adds its
           server error e_s (length C), compresses the chunk again into one row and keeps e_s;
  phase 2  ONE all_gather_into_tensor gives every rank all P server rows; every rank decodes them
           in order, so the result is bit-identical on all ranks.
Scales travel inside the payload rows, so there are exactly two collectives per call. A 1-bit
row is [C/8 bytes of signs, MSB first, 1 = (y >= 0)] + [the float32 scale's 4 bytes, native order];
the worker scale is ||y||_2 / sqrt(Np) over the whole buffer (copied into each of its P rows), the
server scale ||z||_2 / sqrt(C) of its chunk. Bytes per rank per call: 2 (P-1) (C/8 + 4) sent and as
many received, i.e. (P-1)/P * Np/4 + 8 (P-1).

World size 1 (or torch.distributed not initialised) runs the same math with P = 1 (worker
compression, then server compression of that single chunk) and moves no bytes: single-rank
results follow the multi-rank formula exactly.

This module is the flat algorithm among all the group's ranks; hierarchy.py runs it among node
leaders, and allreduce.compressed_allreduce chooses between the two.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import stats as _stats
from .compressors import Compressor, get_compressor


class OneBitState:
    """One buffer's error-feedback state: worker error (float32, padded length Np) and server error
    (float32, Np / P). Both are created at the first call and then fixed to that (Np, P); a call with
    a different padded size or world size raises (call reset() to start over).

    Despite the name it serves every compressor; the compressor used first is remembered so that
    errors of one compressor are never fed to another.
    """

    def __init__(self):
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.compressor_name: str | None = None

    def reset(self) -> None:
        """Forget both errors (the next call starts from zero errors)."""
        self.worker_error = None
        self.server_error = None
        self.compressor_name = None

    @property
    def initialized(self) -> bool:
        return self.worker_error is not None

    def matches(self, numel: int, world_size: int, compressor="onebit") -> bool:
        """True when the held errors fit a buffer of `numel` elements at `world_size` (or none are held).

        For resuming: errors saved at another world size do not fit; reset() them (with a warning).
        In hierarchical mode the sizes follow the number of nodes, not the world size (non-leaders
        hold none): compare against that layout (the optimizers record it, see optim._buckets).
        """
        if self.worker_error is None:
            return True
        padded = padded_length(numel, world_size, compressor)
        return self.worker_error.numel() == padded and self.server_error.numel() == padded // world_size

    def state_dict(self) -> dict:
        """{"worker_error": tensor, "server_error": tensor} (empty when not yet initialised)."""
        if self.worker_error is None:
            return {}
        return {"worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, sd: dict) -> None:
        if not sd:
            self.reset()
            return
        missing = {"worker_error", "server_error"} - set(sd)
        if missing:
            raise KeyError(f"OneBitState.load_state_dict: missing {sorted(missing)}")
        we, se = sd["worker_error"], sd["server_error"]
        if not (isinstance(we, torch.Tensor) and isinstance(se, torch.Tensor)):
            raise TypeError("OneBitState.load_state_dict: worker_error and server_error must be tensors")
        if se.numel() == 0 or we.numel() % se.numel():
            raise ValueError(
                f"OneBitState.load_state_dict: server error length {se.numel()} does not divide "
                f"worker error length {we.numel()}"
            )
        self.worker_error = we.detach().to(torch.float32).reshape(-1).clone()
        self.server_error = se.detach().to(torch.float32).reshape(-1).clone()
        self.compressor_name = None

    def _prepare(self, padded: int, world: int, device, compressor_name: str) -> None:
        if self.worker_error is None:
            self.worker_error = torch.zeros(padded, dtype=torch.float32, device=device)
            self.server_error = torch.zeros(padded // world, dtype=torch.float32, device=device)
            self.compressor_name = compressor_name
            return
        if self.compressor_name is None:
            self.compressor_name = compressor_name
        elif self.compressor_name != compressor_name:
            raise ValueError(
                f"OneBitState was used with compressor {self.compressor_name!r}, now "
                f"{compressor_name!r}; reset() it before switching compressors"
            )
        if self.worker_error.numel() != padded or self.server_error.numel() != padded // world:
            raise ValueError(
                f"OneBitState holds errors for padded length {self.worker_error.numel()} and world size "
                f"{self.worker_error.numel() // max(self.server_error.numel(), 1)}, but this call needs "
                f"padded length {padded} at world size {world}; use one state per buffer, or reset() it"
            )
        if self.worker_error.device != torch.device(device):
            self.worker_error = self.worker_error.to(device)
            self.server_error = self.server_error.to(device)


def group_size_rank(group) -> tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given process group")
    return dist.get_world_size(group), rank


def padded_length(numel: int, world: int, compressor="onebit") -> int:
    """Np: numel rounded up to a multiple of elem_multiple * world (8 * world for 1 bit)."""
    m = get_compressor(compressor).elem_multiple * world
    return -(-numel // m) * m if numel else m


# all_gather_into_tensor was renamed all_gather_single (the old name warns); same collective.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _exchange(rows: torch.Tensor, row_bytes: int, world: int, group) -> torch.Tensor:
    """all_to_all of the compressed rows (row r goes to rank r), counted in comm.stats()."""
    if world <= 1:
        return rows
    recv = torch.empty_like(rows)
    dist.all_to_all_single(recv, rows, group=group)
    _stats.add((world - 1) * row_bytes, (world - 1) * row_bytes)
    return recv


def _average(comp, payload, numel):
    fn = getattr(comp, "decompress_average", None)
    return fn(payload, numel) if fn is not None else Compressor.decompress_average(comp, payload, numel)


def flat_compressed_allreduce(flat: torch.Tensor, state: OneBitState, group, comp):
    """The two-phase algorithm on a flat float32 tensor -> (float32 result of the same length, finite).

    The new errors are kept only when the decoded result is finite. A NaN/Inf input on any rank
    reaches every rank's result through the scales, so every rank sees finite == False after the
    same collectives (no rank leaves early, nothing hangs) and every state keeps its old errors.
    """
    world, _ = group_size_rank(group)
    n = flat.numel()
    padded = padded_length(n, world, comp)
    chunk = padded // world
    state._prepare(padded, world, flat.device, comp.name)
    x = flat if padded == n else torch.cat([flat, flat.new_zeros(padded - n)])

    rows, worker_error = comp.compress(x, state.worker_error, world)
    row_bytes = rows.shape[1]
    recv = _exchange(rows, row_bytes, world, group)

    mean_chunk = _average(comp, recv, chunk)
    server_row, server_error = comp.compress(mean_chunk, state.server_error, 1)

    if world > 1:
        gathered = torch.empty(world * row_bytes, dtype=torch.uint8, device=flat.device)
        _all_gather_flat(gathered, server_row.reshape(-1).contiguous(), group=group)
        _stats.add((world - 1) * row_bytes, (world - 1) * row_bytes)
        gathered = gathered.reshape(world, row_bytes)
    else:
        gathered = server_row
    out = comp.decompress(gathered, chunk).reshape(-1)
    finite = getattr(comp, "payload_finite", lambda _: None)(gathered)
    if finite is None:
        finite = bool(torch.isfinite(out).all())
    if finite:
        state.worker_error, state.server_error = worker_error, server_error
    return out[:n], finite


def flat_compressed_allreduce_many(flats, states, group, comp):
    """flat_compressed_allreduce of several buffers at once, each with its own state and scales, in
    the same two collectives: every buffer's P payload rows are laid side by side, so rank r receives
    its row of every buffer in one all_to_all_single, and one all-gather returns all server rows.
    Bytes are those of one call per buffer; results equal them bit for bit (the same math per buffer).
    -> (list of float32 results, finite); errors are kept for every buffer or for none."""
    world, _ = group_size_rank(group)
    sizes, rows, new_worker = [], [], []
    for flat, state in zip(flats, states):
        n = flat.numel()
        padded = padded_length(n, world, comp)
        state._prepare(padded, world, flat.device, comp.name)
        x = flat if padded == n else torch.cat([flat, flat.new_zeros(padded - n)])
        r, we = comp.compress(x, state.worker_error, world)
        sizes.append((n, padded // world, r.shape[1]))
        rows.append(r)
        new_worker.append(we)
    widths = [b for _, _, b in sizes]
    total = sum(widths)
    send = torch.cat(rows, dim=1)
    recv = _exchange(send, total, world, group)
    server_rows, new_server = [], []
    for part, state, (_, chunk, _) in zip(torch.split(recv, widths, dim=1), states, sizes):
        mean_chunk = _average(comp, part.contiguous(), chunk)
        row, se = comp.compress(mean_chunk, state.server_error, 1)
        server_rows.append(row.reshape(-1))
        new_server.append(se)
    mine = torch.cat(server_rows)
    if world > 1:
        gathered = torch.empty(world * total, dtype=torch.uint8, device=mine.device)
        _all_gather_flat(gathered, mine, group=group)
        _stats.add((world - 1) * total, (world - 1) * total)
        gathered = gathered.reshape(world, total)
    else:
        gathered = mine.reshape(1, total)
    outs, finite = [], True
    check = getattr(comp, "payload_finite", None)
    for part, (n, chunk, _) in zip(torch.split(gathered, widths, dim=1), sizes):
        part = part.contiguous()
        out = comp.decompress(part, chunk).reshape(-1)
        ok = check(part) if check is not None else None
        finite = finite and bool(torch.isfinite(out).all() if ok is None else ok)
        outs.append(out[:n])
    if finite:
        for state, we, se in zip(states, new_worker, new_server):
            state.worker_error, state.server_error = we, se
    return outs, finite
