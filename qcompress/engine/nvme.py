"""Optimizer state on NVMe (DeepSpeed's `offload_optimizer: {device: nvme, nvme_path, ...}`).

The per-element optimizer state (Adam's moments, SGD's momentum: every state tensor shaped like
its parameter) lives in files under `nvme_path`; only scalars (Adam's step counts) stay in memory.
`step()` walks the parameters in chunks of at most `sub_group_size` elements (DeepSpeed's tile
size; a larger parameter is a chunk of its own): it reads a chunk's state into one of
`buffer_count` host buffers, runs the optimizer's own update on that chunk's parameters, and writes
the state back. Two I/O threads read the next chunks while the current one updates
(`pipeline_read`) and write finished chunks while the next ones update (`pipeline_write`), so the
state's resident memory is at most buffer_count x the largest chunk, whatever the model size.

The update is the optimizer's own `step` restricted to the chunk's parameters, so the arithmetic
is the same as with the state in memory (bit for bit: CPU offload gives the same weights).
Checkpoints see the whole state through `full_state()`, which maps the files into memory (pages
come from and go to the file, not anonymous memory) for torch.distributed.checkpoint.

Files: <nvme_path>/qcompress-nvme-<host>-<pid>-<n>/chunk<i>.bin, one folder per process, owned
through an flock (qcompress.atomic.OwnerLock): it is removed at exit (or when the engine is
collected), and a later run removes the folders of processes that died (killed, crashed).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import socket
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from .. import atomic
from ..errors import ConfigError

KEY = "zero_optimization.offload_optimizer.nvme_path"
_ALIGN = 64  # bytes: every tensor in a chunk file starts on this boundary
_PREFIX = "qcompress-nvme-"
_counter = itertools.count()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _size(n: int) -> str:
    unit = next((u for u in ("GiB", "MiB", "KiB") if n >= 2 ** {"GiB": 30, "MiB": 20, "KiB": 10}[u]), "B")
    scaled = n / 2 ** {"GiB": 30, "MiB": 20, "KiB": 10, "B": 0}[unit]
    return f"{scaled:.1f} {unit} ({n} bytes)"


# --- the folder ------------------------------------------------------------------------------
def remove_stale_folders(nvme_path: str) -> List[str]:
    """Remove the swap folders under nvme_path whose owner process is gone; returns them."""
    removed = []
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(nvme_path, name)
        if not name.startswith(_PREFIX) or not os.path.isdir(folder):
            continue
        lock = atomic.OwnerLock.claim(os.path.join(folder, "owner.lock"))
        if lock is None:  # a live run's
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            lock.release(unlink=False)
    return removed


def make_swap_folder(nvme_path: str, need_bytes: int) -> Tuple[str, atomic.OwnerLock]:
    """This process's swap folder under nvme_path, checked before training starts: it can be
    created and written, and the disk has room for `need_bytes`. Errors are ConfigErrors on
    zero_optimization.offload_optimizer.nvme_path."""
    nvme_path = os.path.abspath(os.path.expanduser(nvme_path))
    if os.path.exists(nvme_path) and not os.path.isdir(nvme_path):
        raise ConfigError(KEY, f"{nvme_path!r} is not a folder")
    try:
        os.makedirs(nvme_path, exist_ok=True)
    except OSError as err:
        raise ConfigError(KEY, f"cannot create {nvme_path!r}: {err.strerror or err}") from None
    if not os.path.isdir(nvme_path):
        raise ConfigError(KEY, f"{nvme_path!r} is not a folder")
    remove_stale_folders(nvme_path)
    name = f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-{next(_counter)}"
    folder = os.path.join(nvme_path, name)
    # Set up under a hidden name and renamed once its lock is held: another rank's cleaner
    # (remove_stale_folders) takes a _PREFIX folder without a held lock for a dead run's, and
    # deleted a folder made an instant before its lock file.
    setup = os.path.join(nvme_path, f".setup-{name}")
    try:
        os.mkdir(setup)
        lock = atomic.OwnerLock.create(os.path.join(setup, "owner.lock"))
        probe = os.path.join(setup, "probe")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.remove(probe)
        os.rename(setup, folder)
        lock.path = os.path.join(folder, "owner.lock")  # the flock is on the file, held through the rename
    except OSError as err:
        shutil.rmtree(setup, ignore_errors=True)
        raise ConfigError(KEY, f"{nvme_path!r} is not writable: {err.strerror or err}") from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        lock.release(unlink=False)
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(
            KEY,
            f"{nvme_path!r} has {_size(free)} free; the optimizer state of this host's "
            f"ranks needs about {_size(need_bytes)}: free space or choose another disk",
        )
    return folder, lock


def state_bytes_per_element(optimizer) -> int:
    """Bytes of per-element state the optimizer will keep (estimate before its first step)."""
    d = getattr(optimizer, "defaults", {})
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if d.get("momentum", 0) else 0
    return 12 if d.get("amsgrad") else 8  # Adam family / LAMB: two fp32 moments


# --- layout ----------------------------------------------------------------------------------
class _Slot:
    __slots__ = ("param", "key", "dtype", "shape", "dtensor", "offset", "nbytes")

    def __init__(self, param, key, dtype, shape, dtensor, offset, nbytes):
        self.param, self.key, self.dtype, self.shape, self.dtensor, self.offset, self.nbytes = (
            param,
            key,
            dtype,
            shape,
            dtensor,
            offset,
            nbytes,
        )

    def spec(self) -> Tuple:
        return self.param, self.key, self.dtype, self.shape, self.dtensor

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


class _Chunk:
    def __init__(self, index: int, params: list, path: str):
        self.index, self.params, self.path = index, params, path
        self.slots: List[_Slot] = []
        self.nbytes = 0  # 0: nothing on disk yet (the chunk never stepped)

    def layout(self, state) -> List[Tuple]:
        """[(param, key, dtype, shape, is a DTensor)] of the swappable tensors now in `state`:
        those shaped like their parameter (its local shard), in order."""
        out = []
        for p in self.params:
            shape = _local(p).shape
            for k, v in state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and _local(v).shape == shape:
                    out.append((p, k, _local(v).dtype, tuple(shape), hasattr(v, "to_local")))
        return out

    def matches(self, state) -> bool:
        return [s.spec() for s in self.slots] == self.layout(state)


class _BufferPool:
    """At most `count` host buffers, each grown to the largest chunk it has held."""

    def __init__(self, count: int, pin: bool):
        self.count, self.pin = count, pin
        self.free: List[torch.Tensor] = []
        self.made = 0
        self.cv = threading.Condition()

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def acquire(self, nbytes: int, block: bool = True) -> Optional[torch.Tensor]:
        with self.cv:
            while not self.free and self.made >= self.count:
                if not block:
                    return None
                self.cv.wait()
            if self.free:
                buf = self.free.pop()
            else:
                self.made += 1
                buf = self._new(0)
        if buf.numel() < nbytes:
            buf = self._new(nbytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self.cv:
            self.free.append(buf)
            self.cv.notify()

    def resident_bytes(self) -> int:
        with self.cv:
            return sum(b.numel() for b in self.free)


def _read_into(path: str, buf: torch.Tensor, nbytes: int) -> None:
    view = memoryview(buf.numpy())[:nbytes]
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise OSError(errno.EIO, f"{path}: file ends after {done} of {nbytes} bytes")
            done += n
    finally:
        os.close(fd)


def _write_from(path: str, buf: torch.Tensor, nbytes: int) -> None:
    view = memoryview(buf.numpy())[:nbytes]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < nbytes:
            done += os.pwritev(fd, [view[done:]], done)
    except OSError as err:
        raise OSError(
            err.errno,
            f"writing optimizer state to {path}: {err.strerror} "
            f"({_size(shutil.disk_usage(os.path.dirname(path)).free)} free)",
        ) from None
    finally:
        os.close(fd)


def _reserve(path: str, nbytes: int) -> None:
    """Create the chunk file at its full size now, so a full disk fails here, clearly."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # pragma: no cover - not Linux
            os.ftruncate(fd, nbytes)
    except OSError as err:
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise OSError(
            err.errno,
            f"cannot reserve {_size(nbytes)} for optimizer state in {path}: "
            f"{err.strerror} ({_size(free)} free on {KEY})",
        ) from None
    finally:
        os.close(fd)


# --- the swapper -----------------------------------------------------------------------------
class NVMeOptimizerState:
    """Keeps `optimizer`'s per-element state in files and streams it through `step()`.

    The optimizer object stays what it was (LR schedulers, ZeroRedundancyOptimizer and checkpoint
    code keep working on it); its `step` is replaced by the chunked, streamed one."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        folder: str,
        lock: atomic.OwnerLock,
        *,
        chunk_elements: int,
        buffer_count: int = 4,
        pin_memory: bool = False,
        pipeline_read: bool = True,
        pipeline_write: bool = True,
    ):
        if getattr(optimizer, "_qc_nvme", None) is not None:
            raise ValueError("this optimizer's state is already on NVMe")
        self.optimizer, self.folder = optimizer, folder
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.pool = _BufferPool(buffer_count, pin_memory and torch.cuda.is_available())
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qc-nvme")
        self.chunks = self._make_chunks(optimizer, max(1, int(chunk_elements)))
        self.stats = {"steps": 0, "read_wait_s": 0.0, "write_wait_s": 0.0, "bytes_read": 0, "bytes_written": 0}
        self._inner_step = optimizer.step
        optimizer._qc_nvme = self
        optimizer.step = _swapped_step.__get__(optimizer, type(optimizer))
        # The folder goes when the engine does, or at interpreter exit (not after a kill: the
        # next run on this nvme_path removes it, see remove_stale_folders).
        self._finalizer = weakref.finalize(self, _cleanup, self.io, folder, lock)

    def _make_chunks(self, optimizer, limit: int) -> List[_Chunk]:
        chunks, current, size = [], [], 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                n = _local(p).numel()
                if current and size + n > limit:
                    chunks.append(current)
                    current, size = [], 0
                current.append(p)
                size += n
        if current:
            chunks.append(current)
        return [_Chunk(i, ps, os.path.join(self.folder, f"chunk{i:05d}.bin")) for i, ps in enumerate(chunks)]

    # --- sizes -------------------------------------------------------------------------------
    def disk_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def resident_bytes(self) -> int:
        """Host memory the state buffers hold now (between steps: all of them are free)."""
        return self.pool.resident_bytes()

    def close(self) -> None:
        """Remove the swap files (the optimizer's state is gone with them)."""
        self._finalizer()

    # --- one optimizer step ------------------------------------------------------------------
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [c for c in self.chunks if any(p.grad is not None for p in c.params)]
        reads: Dict[int, Tuple[torch.Tensor, Optional[Future]]] = {}
        writes: List[Future] = []
        nxt = 0  # next chunk of `todo` whose read is not issued
        current: Optional[torch.Tensor] = None

        def issue(i: int, block: bool) -> bool:
            c = todo[i]
            buf = self.pool.acquire(c.nbytes, block=block)
            if buf is None:
                return False
            fut = self.io.submit(self._read, c, buf) if c.nbytes else None
            reads[i] = (buf, fut)
            return True

        try:
            for i, chunk in enumerate(todo):
                if nxt <= i:
                    issue(i, block=True)
                    nxt = i + 1
                if self.pipeline_read:  # read ahead while buffers are free
                    while nxt < len(todo) and issue(nxt, block=False):
                        nxt += 1
                buf, fut = reads.pop(i)
                current = buf  # ours until a write takes it over
                if fut is not None:
                    self._wait(fut, "read_wait_s")
                    self.stats["bytes_read"] += chunk.nbytes
                self._update(chunk, buf)
                buf = current = self._store(chunk, buf)
                wfut = self.io.submit(self._write, chunk, buf)
                current = None
                self.stats["bytes_written"] += chunk.nbytes
                if self.pipeline_write:
                    writes.append(wfut)
                else:
                    self._wait(wfut, "write_wait_s")
        finally:
            if current is not None:  # an error mid-way: give every buffer back
                self.pool.release(current)
            for buf, fut in reads.values():  # (issued reads finish first)
                if fut is not None:
                    fut.exception()
                self.pool.release(buf)
            for w in writes:
                self._wait(w, "write_wait_s")
        self.stats["steps"] += 1
        return loss

    def _wait(self, fut: Future, counter: str) -> None:
        t0 = time.perf_counter()
        fut.result()
        self.stats[counter] += time.perf_counter() - t0

    def _read(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        _read_into(chunk.path, buf, chunk.nbytes)

    def _write(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        try:
            _write_from(chunk.path, buf, chunk.nbytes)
        finally:
            self.pool.release(buf)

    def _update(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        """Put the chunk's state (views of buf) into the optimizer, step its parameters only."""
        state = self.optimizer.state
        for slot in chunk.slots:
            state[slot.param][slot.key] = self._as_state(slot, buf)
        groups = self.optimizer.param_groups
        mine = set(map(id, chunk.params))
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in mine]
            self._inner_step()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps

    @staticmethod
    def _as_state(slot: _Slot, buf: torch.Tensor) -> torch.Tensor:
        """The state tensor as the optimizer made it: on the parameter's device, and a DTensor
        sharded like the parameter when it was one (torch's optimizers under FSDP2)."""
        view, p = slot.view(buf), slot.param
        local = _local(p)
        if local.device != view.device:
            view = view.to(local.device, non_blocking=True)
        if slot.dtensor:
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return view

    def _store(self, chunk: _Chunk, buf: torch.Tensor) -> torch.Tensor:
        """Move the chunk's swappable state out of the optimizer into buf (laid out anew when the
        optimizer created or dropped state tensors); returns the buffer to write."""
        state = self.optimizer.state
        layout = chunk.layout(state)
        if [s.spec() for s in chunk.slots] != layout:
            buf = self._relayout(chunk, layout, buf)
        else:
            for slot in chunk.slots:
                t = _local(state[slot.param][slot.key])
                dst = slot.view(buf)
                if t.data_ptr() != dst.data_ptr():  # replaced, or on another device
                    dst.copy_(t)
        for slot in chunk.slots:
            del state[slot.param][slot.key]
        return buf

    def _relayout(self, chunk: _Chunk, layout, buf: torch.Tensor) -> torch.Tensor:
        state = self.optimizer.state
        slots, offset = [], 0
        for p, k, dtype, shape, dtensor in layout:
            nbytes = _local(state[p][k]).numel() * torch.empty((), dtype=dtype).element_size()
            slots.append(_Slot(p, k, dtype, shape, dtensor, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        staged = {(sl.param, sl.key): _local(state[sl.param][sl.key]).clone() for sl in slots}
        if offset > buf.numel():  # grown in place of buf (the pool's count stays)
            buf = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pool.pin)
        for sl in slots:  # staged first: old views may alias buf
            sl.view(buf).copy_(staged[(sl.param, sl.key)])
        _reserve(chunk.path, offset)
        chunk.slots, chunk.nbytes = slots, offset
        return buf

    # --- the whole state, for checkpoints ----------------------------------------------------
    @contextlib.contextmanager
    def full_state(self):
        """Within: every state tensor is in optimizer.state (memory-mapped from its file), as
        checkpoint code expects. On exit, tensors that were replaced (a checkpoint load) are
        written to the files, and the state leaves memory again."""
        state = self.optimizer.state
        if not state:
            # Before the first step, torch's state_dict helpers would run a zero-gradient step to
            # create the state; run it here (through the streamed step) so the files exist.
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self.optimizer)
        maps = {}
        for c in self.chunks:
            if c.nbytes:
                maps[c.index] = torch.from_file(c.path, shared=True, size=c.nbytes, dtype=torch.uint8)
                for slot in c.slots:
                    state[slot.param][slot.key] = self._as_state(slot, maps[c.index])
        try:
            yield self.optimizer
        finally:
            for c in self.chunks:
                mapped = maps.get(c.index)
                if mapped is not None and c.matches(state):
                    self._store(c, mapped)  # copies only what a load replaced
                    continue
                if not c.layout(state) and not c.slots:
                    continue
                buf = self._store(c, torch.empty(0, dtype=torch.uint8))
                _write_from(c.path, buf, c.nbytes)
            maps.clear()  # unmapped: the pages belong to the files


def _swapped_step(optimizer, closure=None):
    """The optimizer's step while its state is on NVMe (bound to the optimizer instance)."""
    return optimizer._qc_nvme.step(closure)


def _cleanup(io: ThreadPoolExecutor, folder: str, lock: atomic.OwnerLock) -> None:
    io.shutdown(wait=True)
    shutil.rmtree(folder, ignore_errors=True)
    lock.release(unlink=False)


def attach(optimizer, offload_cfg, sub_group_size: int, local_world_size: int = 1) -> NVMeOptimizerState:
    """Put `optimizer`'s state on NVMe per the offload_optimizer section (checks the path first).
    For a ZeroRedundancyOptimizer pass its local optimizer (`.optim`)."""
    elements = sum(_local(p).numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    need = elements * state_bytes_per_element(optimizer) * max(1, local_world_size)
    folder, lock = make_swap_folder(offload_cfg.nvme_path, need)
    return NVMeOptimizerState(
        optimizer,
        folder,
        lock,
        chunk_elements=sub_group_size,
        buffer_count=offload_cfg.buffer_count,
        pin_memory=offload_cfg.pin_memory,
        pipeline_read=offload_cfg.pipeline_read,
        pipeline_write=offload_cfg.pipeline_write,
    )
