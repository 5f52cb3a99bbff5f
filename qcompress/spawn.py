"""Run a function on local ranks: `run_ranks(fn, world_size, *args, timeout=...)` (the tests' and
the benchmarks' multi-process runs; gloo works on any CPU).

Each rank is a fresh spawned process that joins a process group (gloo by default) on a free
local port, runs `fn(rank, world_size, *args)` and sends its return value back. The parent
returns the list of per-rank results (index = rank) or re-raises the first failing rank's
exception with the remote traceback attached as a note. A run that exceeds `timeout` seconds
is killed and reported as TimeoutError, so a hung collective fails a test instead of blocking CI.

`fn` must be importable by the children (a module-level function, not a lambda or closure),
and its return value must be picklable; tensors are cloned on arrival.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _detach(obj):
    """Copy tensors out of shared memory so they outlive the child that sent them."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(v) for v in obj)
    return obj


def _worker(rank, world_size, port, backend, threads, fn, args, results, release):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out, None))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        tb = traceback.format_exc()
        try:
            import pickle

            pickle.dumps(exc)
            sendable = exc
        except Exception:  # an exception that cannot travel becomes a RuntimeError
            sendable = RuntimeError(f"{type(exc).__name__}: {exc}")
        results.put((rank, "error", sendable, tb))
    # Keep the process (and the shared memory behind sent tensors) alive until the parent has read.
    release.wait(timeout=60)


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo", threads: int = 1):
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return [result of rank 0, ...].

    threads: torch intra-op threads per rank (1 keeps oversubscribed CI machines predictable;
    0 leaves torch's default).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    release = ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, daemon=True, args=(r, world_size, port, backend, threads, fn, args, results, release)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run_ranks({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                    f"did not finish within {timeout} s; ranks done: {sorted(got)}"
                )
            try:
                rank, status, payload, tb = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    failure = (
                        dead[0],
                        RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"),
                        "",
                    )
                continue
            if status == "ok":
                got[rank] = _detach(payload)
            else:
                failure = (rank, payload, tb)
    finally:
        release.set()
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failure is not None:
        rank, exc, tb = failure
        if tb:
            exc.add_note(f"--- raised on rank {rank} of {world_size}; remote traceback:\n{tb}")
        raise exc
    return [got[r] for r in range(world_size)]
