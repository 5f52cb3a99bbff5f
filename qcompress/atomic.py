"""Crash-safe file writing shared by export and engine checkpoints.

- Files are created with mode 0o666 and O_EXCL, so the process umask (and a folder's default
  ACL) applies exactly as for a plain `open(..., "w")`; `tempfile.mkstemp` would make them 0600.
- A writer holds an exclusive `flock` on an owner-lock file for as long as it works. A later
  writer may delete temporaries whose lock it can take (the owner died: the kernel released its
  lock), never those of a live writer. Without `fcntl` (not POSIX) nothing is claimed.
- Every rename and removal of a commit goes through `fs_replace` / `fs_remove` / `fs_rmtree`,
  module-level functions that tests replace to inject a crash at any one of them.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no owner locks, nothing is ever cleaned
    fcntl = None


# --- the renames and removals of a commit (tests replace these to inject crashes) ---------------


def fs_replace(src: str, dst: str) -> None:
    os.replace(src, dst)


def fs_remove(path: str) -> None:
    os.remove(path)


def fs_rmtree(path: str) -> None:
    shutil.rmtree(path)


def remove_quietly(path: str) -> None:
    """fs_remove, where a file that is already gone is fine."""
    if not os.path.lexists(path):
        return
    try:
        fs_remove(path)
    except FileNotFoundError:
        pass


def rmtree_quietly(path: str) -> None:
    """fs_rmtree, where a folder that is already gone is fine."""
    if not os.path.lexists(path):
        return
    try:
        fs_rmtree(path)
    except FileNotFoundError:
        pass


# --- creating files ----------------------------------------------------------------------------


def create_exclusive(path: str) -> int:
    """A new file opened for writing (an fd); fails if `path` exists. Mode 0o666 & ~umask."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)


def write_text_new(path: str, text: str) -> None:
    """Write `text` to the new file `path` and fsync it."""
    fd = create_exclusive(path)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make renames in `path` durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- owner locks -------------------------------------------------------------------------------


def _unlink_private(path: str) -> None:
    """Remove a lock file's private name (not a commit step: plain unlink, no crash injection)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _lock_new(fd: int) -> None:
    """flock a file this process just created; a file system without locks goes on unlocked
    (cleaners there cannot take any lock either, so they never delete our temporaries)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise


class OwnerLock:
    """An exclusive flock on `path`, held by the writer that owns some temporaries."""

    def __init__(self, path: str, fd: Optional[int]):
        self.path = path
        self._fd = fd

    @classmethod
    def create(cls, path: str) -> "OwnerLock":
        """Create the new lock file `path` and lock it (the name must be unique to this writer;
        FileExistsError when it is there). The file is locked under a private name first and then
        hard-linked to `path`, so no cleaner can find it unlocked and take it as a dead owner's;
        where hard links are refused, it is created at `path` and locked right after."""
        if fcntl is None:
            return cls(path, create_exclusive(path))
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.new"
        fd = create_exclusive(tmp)
        try:
            _lock_new(fd)
            try:
                os.link(tmp, path)  # FileExistsError as create_exclusive(path) raises it
            except FileExistsError:
                raise
            except OSError:  # no hard links here: the short unlocked window is back
                os.close(fd)
                fd = None
                _unlink_private(tmp)
                fd = create_exclusive(path)
                _lock_new(fd)
                return cls(path, fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            _unlink_private(tmp)
            raise
        _unlink_private(tmp)
        return cls(path, fd)

    @classmethod
    def claim(cls, path: str) -> Optional["OwnerLock"]:
        """The lock of a dead owner (taken over), or None while its owner is alive.

        A missing lock file counts as dead (None is returned only for a live owner); a lock
        file that was replaced while we waited is left alone.
        """
        if fcntl is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return cls(path, None)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live owner (or no locks here): not ours to clean
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # another cleaner finished with it meanwhile
            os.close(fd)
            return None
        return cls(path, fd)

    def release(self, unlink: bool = True) -> None:
        """Remove the lock file (while still holding it), then let go of the lock."""
        try:
            if unlink:
                remove_quietly(self.path)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def claims_supported() -> bool:
    return fcntl is not None
