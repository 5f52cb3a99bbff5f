"""The --out folder of a job: refusing to mix runs, the lock a live job holds, and the finished
stages --resume skips (checkpoints/progress.json)."""

from __future__ import annotations

import json
import os
import shutil

from .errors import JobError
from .report import atomic_write


def check_out(opts) -> bool:
    """Refuse to mix runs: an out folder holding a run needs --resume (continue) or --overwrite.
    Returns whether it holds one."""
    if os.path.exists(opts.out) and not os.path.isdir(opts.out):
        raise JobError(f"--out {opts.out} exists and is not a folder")
    taken = os.path.isdir(opts.out) and any(
        os.path.exists(os.path.join(opts.out, n)) for n in ("report.json", "metrics.csv", "checkpoints", "export")
    )
    if taken and not (opts.resume or opts.overwrite):
        raise JobError(
            f"--out {opts.out} already holds a run; pass --resume to continue it or --overwrite to start again"
        )
    return taken


LOCK_NAME = ".qcompress-train.lock"


def lock_out(out: str):
    """An exclusive flock on out/.qcompress-train.lock, held while the job runs (the kernel drops it
    when the process dies, kill -9 included): a second job on the same --out, --resume or
    --overwrite alike, would interleave metrics rows and delete checkpoints under a live run."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no guard
        return None
    fh = open(os.path.join(out, LOCK_NAME), "a+", encoding="utf-8")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if not isinstance(err, BlockingIOError):  # a file system without flock: no guard, not "in use"
            fh.close()
            return None
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        raise JobError(
            f"--out {out} is in use by another qcompress train that is still running"
            f"{f' (pid {holder})' if holder else ''}; wait for it to end or pick another --out"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def prepare_out(opts, rank: int):
    """Rank 0: lock --out, then (with --overwrite) delete the run there. Returns the lock's file."""
    if rank != 0:
        return None
    taken = check_out(opts)
    os.makedirs(opts.out, exist_ok=True)
    lock = lock_out(opts.out)
    try:
        if taken and opts.overwrite and not opts.resume:
            for name in (
                "report.json",
                "report.md",
                "metrics.csv",
                "metrics_fp32.csv",
                "checkpoints",
                "export",
                "plots",
                "tensorboard",
            ):
                path = os.path.join(opts.out, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(os.path.join(opts.out, "checkpoints"), exist_ok=True)
        os.makedirs(os.path.join(opts.out, "plots"), exist_ok=True)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


class Progress:
    """Finished stages' results in checkpoints/progress.json, so --resume skips them."""

    def __init__(self, out: str, fingerprint: str, resume: bool, rank: int, world: int = 1):
        self.path = os.path.join(out, "checkpoints", "progress.json")
        self.rank = rank
        self.data = {"fingerprint": fingerprint, "stages": {}, "wall_time_s": {}, "world_size": world}
        self.world_note = None
        if resume and os.path.isfile(self.path):
            with open(self.path, encoding="utf-8") as fh:
                saved = json.load(fh)
            if saved.get("fingerprint") != fingerprint:
                raise JobError(
                    f"--resume: the run in --out {out} was started with other options, data or "
                    "configs; resume with the same command, or start again with --overwrite"
                )
            before = saved.get("world_size")
            if before is not None and before != world and "qat_train" not in saved.get("stages", {}):
                # the same samples per step, but each rank's dropout stream and the gradient sums
                # change: not the bit-identical continuation --resume otherwise gives
                self.world_note = (
                    f"resumed with {world} process(es); the interrupted run had {before}: the same "
                    "data order, but dropout and gradient sums differ from an uninterrupted run"
                )
            saved["world_size"] = world
            if self.world_note:  # kept for the report, whatever later resumes use
                saved["notes"] = saved.get("notes", []) + [self.world_note]
            self.data = saved

    def done(self, stage: str) -> bool:
        return stage in self.data["stages"]

    def record(self, stage: str, result, seconds: float) -> None:
        self.data["stages"][stage] = result
        self.data["wall_time_s"][stage] = round(seconds, 3)
        if self.rank == 0:
            atomic_write(self.path, json.dumps(self.data, indent=2))
