"""One export written into a folder as a whole: after a crash at any point the folder loads as
exactly the previous export or exactly the new one.

Every writer has a random generation id g and holds an owner lock `.qcompress-g.lock` while it
works. It writes each file of the new export to a hidden temporary `.qcompress-g.<name>.tmp`
(mode as for a plain write), then commits:

1. config.json is renamed in. It names g and a digest of every file of the new export
   (safetensors_io.resolve), so from this rename on the folder IS the new export: a file whose
   digest does not match yet is read from its temporary.
2. The temporaries are renamed over the old files; files of the old layout that the new one
   does not have (shards, index, single file) are removed.

Before step 1 the old config.json binds the old files, which are untouched. The next writer
first finishes a committed generation whose writer died in step 2, then deletes the
temporaries of dead writers (those whose lock it can take), never a live writer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import Dict, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: commits are not serialized
    fcntl = None

from .. import atomic
from . import safetensors_io as sio

_TEMP_RE = re.compile(r"^" + re.escape(sio.TEMP_PREFIX) + r"([0-9a-f]{16})\.(.+)$")


def _lock_name(gen: str) -> str:
    return f"{sio.TEMP_PREFIX}{gen}.lock"


@contextlib.contextmanager
def commit_lock(folder: str):
    """Writers into one folder commit (and recover) one at a time: two interleaved commits (every
    rank exporting, say) could leave one writer's config.json over the other's files, a folder
    that loads as neither. An flock on the folder itself (no file to leave behind); blocking,
    as a commit is a few renames."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: commit unserialized, as before
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


class ExportWriter:
    """Use as a context manager: stage files, then commit(config); an exception before the
    commit removes every temporary, the old export stays as it was."""

    def __init__(self, folder: str):
        self.folder = folder
        self.generation = secrets.token_hex(8)
        self.digests: Dict[str, str] = {}
        self._staged: Dict[str, str] = {}  # final name -> temporary path
        self._lock: Optional[atomic.OwnerLock] = None
        self.committed = False

    def __enter__(self) -> "ExportWriter":
        self._lock = atomic.OwnerLock.create(os.path.join(self.folder, _lock_name(self.generation)))
        try:
            recover(self.folder, own=self.generation)
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if not self.committed:  # the old export is untouched: drop the new files
                for path in self._staged.values():
                    atomic.remove_quietly(path)
            # committed: config.json binds the staged files, which a loader reads until they
            # are renamed in; the next writer finishes that (recover)
        finally:
            self._lock.release()
        return False

    def _temp(self, final: str) -> str:
        path = os.path.join(self.folder, sio.staged_name(self.generation, final))
        self._staged[final] = path
        return path

    def stage_safetensors(self, final: str, tensors, metadata) -> None:
        self.digests[final] = sio.write_safetensors_new(self._temp(final), tensors, metadata)

    def stage_text(self, final: str, text: str) -> None:
        self.digests[final] = sio.write_text_new(self._temp(final), text)

    def manifest(self) -> dict:
        """What config.json's "qcompress" section records to bind the staged files."""
        return {"generation": self.generation, "files": dict(sorted(self.digests.items()))}

    def commit(self, config_text: str) -> None:
        """Rename config.json in (the commit point), then the staged files; drop old ones."""
        folder = self.folder
        cfg_tmp = self._temp(sio.CONFIG)
        atomic.write_text_new(cfg_tmp, config_text)
        atomic.fsync_dir(folder)  # the staged files exist before config.json
        with commit_lock(folder):
            self._commit(cfg_tmp)

    def _commit(self, cfg_tmp: str) -> None:
        folder = self.folder
        atomic.fs_replace(cfg_tmp, os.path.join(folder, sio.CONFIG))
        self.committed = True
        del self._staged[sio.CONFIG]
        atomic.fsync_dir(folder)
        _roll_forward(folder, self.generation, self.digests)
        keep = set(self.digests) | {sio.CONFIG}
        for stale in sio.existing_outputs(folder):
            if stale not in keep:
                atomic.remove_quietly(os.path.join(folder, stale))
        atomic.fsync_dir(folder)


def _roll_forward(folder: str, gen: str, digests: Dict[str, str]) -> None:
    """Rename generation `gen`'s staged files over the final names (index last, so a loader
    that trusts the index, as transformers does, sees its shards first)."""
    for final in sorted(digests, key=lambda f: f == sio.INDEX):
        staged = os.path.join(folder, sio.staged_name(gen, final))
        if os.path.exists(staged):
            atomic.fs_replace(staged, os.path.join(folder, final))


def _committed(folder: str) -> Optional[dict]:
    try:
        return sio.read_manifest(folder)
    except sio.CheckpointError:
        return None


def recover(folder: str, own: str) -> None:
    """Finish the roll-forward of a committed generation whose writer died, then delete the
    temporaries and lock files of every dead writer except `own`."""
    gens: Dict[str, list] = {}
    for name in os.listdir(folder):
        m = _TEMP_RE.match(name)
        if m and m.group(1) != own:
            gens.setdefault(m.group(1), []).append(name)
    if not gens:
        return
    with commit_lock(folder):  # not while a live writer commits
        _recover(folder, gens)


def _recover(folder: str, gens: Dict[str, list]) -> None:
    current = _committed(folder)
    for gen in sorted(gens):
        lock = atomic.OwnerLock.claim(os.path.join(folder, _lock_name(gen)))
        if lock is None:  # a live writer's: not ours to touch
            continue
        try:
            if current is not None and current["generation"] == gen:
                files = current["files"]
                # only staged files that are the committed ones move; anything else of that
                # writer is an unfinished temporary
                ready = {f: d for f, d in files.items() if _staged_digest(folder, gen, f) == d}
                _roll_forward(folder, gen, ready)
            for name in gens[gen]:
                if name != _lock_name(gen):
                    atomic.remove_quietly(os.path.join(folder, name))
        finally:
            lock.release()


def _staged_digest(folder: str, gen: str, final: str) -> Optional[str]:
    return sio._digest(os.path.join(folder, sio.staged_name(gen, final)), final)


def dumps_config(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str)
