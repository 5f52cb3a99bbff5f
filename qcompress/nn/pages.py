"""Giving the kernel back the pages of a weight that lives in a mapped checkpoint file.

transformers loads safetensors checkpoints by mmap and, where the dtype matches, keeps the bytes
there: every Parameter's storage lies in one private mapping of the file. Dropping such a
Parameter frees nothing: the mapping stays while any other tensor of the file (the embedding, a
norm) is alive, and the pages already read keep counting in the process's resident memory (clean
page-cache pages, which the kernel may reclaim under pressure, but which RSS, peak RSS and the
tools that read them count). Mode qlora drops every adapted layer's float weight once it is stored
as codes; without this the float base stays resident beside its codes: 405 MiB of SmolLM2-135M's
513 (benchmarks/lora_memory.py).

`drop(holder, key)` removes a tensor from a dict (a module's `_parameters`) and, where nothing else
references it (neither the Python object nor its storage) and its bytes lie in a file-backed
mapping, tells the kernel its whole pages are not needed (madvise MADV_DONTNEED): a file page is
read again from the file if ever touched, so nothing outside those bytes can see a difference. A
tensor in anonymous memory is simply let go (the allocator returns it), and on other systems, or
when the tensor is referenced elsewhere, dropping it is all that happens.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from typing import Optional, Tuple

import torch

log = logging.getLogger("qcompress")

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_PAGE = mmap.PAGESIZE


def _file_mapping(start: int, end: int) -> Optional[str]:
    """The file whose mapping holds the bytes [start, end) (one mapping), or None."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                if lo <= start and end <= hi:
                    inode = int(parts[4]) if len(parts) > 4 else 0
                    path = parts[5].strip() if len(parts) > 5 else ""
                    return path if inode != 0 and path.startswith("/") else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pages(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(first whole page, length) of the storage's bytes, or None if it holds no whole page."""
    st = t.untyped_storage()
    ptr, n = st.data_ptr(), st.nbytes()
    lo = -(-ptr // _PAGE) * _PAGE
    hi = (ptr + n) // _PAGE * _PAGE
    return (lo, hi - lo) if hi > lo else None


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_users(t: torch.Tensor) -> int:
    """Tensors (and storage objects) holding t's storage, the one made here included."""
    assert _use_count is not None
    return int(_use_count(t.untyped_storage()._cdata))


def drop(holder: dict, key: str) -> int:
    """Remove holder[key] (a tensor) and give back its pages where they lie in a mapped file and
    nothing else uses them; returns the bytes given back (0 if none)."""
    t = holder.pop(key)
    if (
        _MADV_DONTNEED is None
        or not sys.platform.startswith("linux")
        or not isinstance(t, torch.Tensor)
        or t.device.type != "cpu"
        or t.is_meta
        or _use_count is None
    ):
        return 0
    # nothing else may use it: no other name for the tensor, no other tensor on its storage (a
    # view, an alias); both counts are compared with a tensor held by one local name only
    probe = torch.empty(1)
    if sys.getrefcount(t) > sys.getrefcount(probe) or _storage_users(t) > _storage_users(probe):
        return 0
    del probe
    span = _pages(t)
    if span is None or _file_mapping(span[0], span[0] + span[1]) is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(span[0], span[1], _MADV_DONTNEED) != 0:
        log.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())
        return 0
    return span[1]
