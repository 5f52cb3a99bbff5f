"""Safetensors files: size-based sharding, writes, and validated reads.

Writes create new files (hidden temporaries: export/commit.py renames them in). Reads parse the
header ourselves first, so truncation and header damage give errors naming the file and
tensor, and every tensor's CRC32 (kept in the metadata) is checked, so flipped bytes are caught
too. config.json binds each file to the export by a digest (see `resolve`): files of another
export, or of an interrupted overwrite, never load as part of this one. Index entries must be
plain file names in the export folder. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import atomic
from .errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TEMP_PREFIX = ".qcompress-"  # + generation id: a writer's lock and temporaries (hidden)
CRC_KEY = "qcompress_crc32"
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# a qlora export's adapter in peft's format, beside the base and bound by the same config.json
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size) -> int:
    """'2GB' (10^9, as transformers), '500MiB', or an int number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size must be bytes or like '2GB' / '500MiB', got {size!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[List[str]]:
    """Greedy in order: a shard closes when the next tensor would push it past max_bytes."""
    shards, cur, size = [], [], 0
    for name, t in tensors.items():
        b = nbytes(t)
        if cur and size + b > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += b
    if cur or not shards:
        shards.append(cur)
    return shards


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def staged_name(generation: str, final: str) -> str:
    """Where export generation `generation` stages `final` until its commit has renamed it in.

    config.json is renamed in first (the commit); a loader that finds a file of the committed
    generation not yet renamed reads it from here (see qcompress/export/commit.py)."""
    return f"{TEMP_PREFIX}{generation}.{final}.tmp"


def write_safetensors_new(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> str:
    """Write one safetensors file to the new path `path` (mode as for a plain write), fsynced;
    returns the digest that binds it to its export (see header_digest)."""
    meta = dict(metadata)
    meta[CRC_KEY] = json.dumps({k: crc32(v) for k, v in tensors.items()}, sort_keys=True)
    fd = atomic.create_exclusive(path)  # the mode a plain write gets (umask, default ACL)
    mode = os.fstat(fd).st_mode & 0o7777
    os.close(fd)
    try:
        save_file(tensors, path, metadata=meta)
    except Exception as e:  # a full disk comes back as safetensors' own error type
        raise OSError(f"{path}: cannot write the export file ({e})") from None
    os.chmod(path, mode)  # safetensors replaces the file with a 0600 one
    atomic.fsync_file(path)
    return header_digest(path)


def write_text_new(path: str, text: str) -> str:
    """Write a text file to the new path `path`, fsynced; returns its digest (file_digest)."""
    atomic.write_text_new(path, text)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- reading -------------------------------------------------------------------------------------


def check_plain_name(name, where: str, what: str) -> str:
    """A file an index or manifest names must be a plain file name inside the export folder:
    no directory part, not absolute, not '.'/'..', not hidden (temporaries are hidden)."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
        or os.path.basename(name) != name
    ):
        raise CheckpointError(
            f"{where}: {what} names {name!r}, which is not a plain file name inside "
            "the export folder (refused: no directories, absolute or hidden paths)"
        )
    return name


def _header_bounds(path: str) -> Tuple[int, int]:
    """(file size, header length) after checking the length field against the file size."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if not os.path.isfile(path):  # a folder (or a device) where the file should be
        raise CheckpointError(f"{path}: not a regular file")
    if size < 8:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)"
        )
    try:
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if hlen > size - 8:
        raise CheckpointError(
            f"{path}: truncated or corrupted header (header says {hlen} bytes, "
            f"file has {size - 8} after the length field)"
        )
    return size, hlen


def header_digest(path: str) -> str:
    """sha256 of a safetensors file's length field and header. The header holds every tensor's
    name, dtype, shape, offsets and CRC32, so it binds the whole file's content (the CRCs are
    checked on load) at the cost of reading a few KB."""
    _, hlen = _header_bounds(path)
    with open(path, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read(8 + hlen)).hexdigest()


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _digest(path: str, final: str) -> Optional[str]:
    """The binding digest of `path` (as the file `final`), None when unreadable."""
    try:
        return file_digest(path) if final == INDEX else header_digest(path)
    except (OSError, CheckpointError):
        return None


def read_header(path: str) -> Tuple[dict, dict, int]:
    """(tensor entries, metadata, data start) after checking the header against the file size."""
    name = os.path.basename(path)
    size, hlen = _header_bounds(path)
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupted header (not valid JSON: {e})") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupted header (__metadata__ must map names to strings)")
    data_len = size - 8 - hlen
    for tname, info in header.items():
        try:
            start, end = info["data_offsets"]
            want = _DTYPE_BYTES[info["dtype"]]
            for d in info["shape"]:
                want *= int(d)
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupted header entry for tensor {tname!r}: {info!r}") from None
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated: tensor {tname!r} ends at byte {end} of the data "
                f"section, but {name} holds only {data_len} data bytes"
            )
        if end - start != want or start < 0:
            raise CheckpointError(
                f"{path}: corrupted header: tensor {tname!r} "
                f"({info['dtype']} {info['shape']}) spans {end - start} bytes, "
                f"expected {want}"
            )
    return header, metadata, 8 + hlen


def _crc_table(path: str, header: dict, metadata: dict) -> Optional[dict]:
    """The file's CRC32 table, None for files written without one. Its names must be the
    header's tensor names: a damaged name (a flipped bit) is this file's fault, reported here."""
    if CRC_KEY not in metadata:
        return None
    try:
        crcs = json.loads(metadata[CRC_KEY])
        if not isinstance(crcs, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):
        raise CheckpointError(f"{path}: corrupted metadata {CRC_KEY!r}") from None
    for tname in header:
        if tname not in crcs:
            raise CheckpointError(
                f"{path}: corrupted header: tensor {tname!r} has no CRC32 record "
                "(a damaged tensor name in this file's header?)"
            )
    for tname in crcs:
        if tname not in header:
            raise CheckpointError(
                f"{path}: corrupted header: the CRC32 table lists tensor {tname!r}, "
                "which the header does not hold (a damaged tensor name?)"
            )
    return crcs


def read_safetensors(
    path: str, verify: bool = True, shown: Optional[str] = None
) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """All tensors of one file and its metadata, validated (see module docstring).
    `shown` is the path errors name when `path` is a staged copy of it."""
    shown = shown or path
    try:
        header, metadata, _ = read_header(path)
        crcs = _crc_table(path, header, metadata)
    except CheckpointError as e:
        raise CheckpointError(str(e).replace(path, shown, 1)) from None
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{shown}: unreadable safetensors file ({e})") from None
    if verify and crcs is not None:
        for k, t in tensors.items():
            if crc32(t) != crcs[k]:
                raise CheckpointError(f"{shown}: corrupted: tensor {k!r} fails its CRC32 check")
    return tensors, metadata


def _read_weight_map(path: str, shown: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map must map tensor names to shard file names")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{shown}: corrupted index ({e})") from None
    for tname, fn in weight_map.items():
        check_plain_name(fn, shown, f"weight_map entry {tname!r}")
    return weight_map


def read_manifest(folder: str) -> Optional[dict]:
    """{"generation": str, "files": {name: digest}} from config.json, or None for an export
    written before files were bound to their config.json (or when config.json is unreadable:
    manifest.read_config reports that)."""
    cfg_path = os.path.join(folder, CONFIG)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            section = json.load(f).get("qcompress")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(section, dict) or "files" not in section:
        return None
    files, gen = section.get("files"), section.get("generation")
    if (
        not isinstance(files, dict)
        or not files
        or not isinstance(gen, str)
        or not re.fullmatch(r"[0-9a-f]{16}", gen)
        or not all(isinstance(v, str) for v in files.values())
    ):
        raise CheckpointError(
            f"{cfg_path}: qcompress.files / qcompress.generation are malformed "
            "(expected a generation id and a map of file name to digest)"
        )
    for fn in files:
        check_plain_name(fn, cfg_path, "qcompress.files")
    return {"generation": gen, "files": files}


class Resolved:
    """Which files make up an export and where to read each (a committed export whose files
    are still staged under a temporary name is read from there)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.shards: List[Tuple[str, str]] = []  # (path errors name, path to read)
        self.index: Optional[Tuple[str, str]] = None
        self.weight_map: Optional[dict] = None
        self.problems: List[str] = []  # files that do not belong to config.json


def _pick(folder: str, manifest: dict, final: str, res: Resolved) -> Tuple[str, str]:
    shown = os.path.join(folder, final)
    want = manifest["files"][final]
    if _digest(shown, final) == want:
        return shown, shown
    staged = os.path.join(folder, staged_name(manifest["generation"], final))
    if os.path.exists(staged) and _digest(staged, final) == want:
        return shown, staged
    if not os.path.exists(shown):
        raise CheckpointError(f"{os.path.join(folder, CONFIG)}: lists {final!r}, which does not exist")
    res.problems.append(
        f"{shown}: does not belong to this export: its "
        f"{'content' if final == INDEX else 'header'} differs from the digest "
        f"{CONFIG} records for it (a damaged file, or one left from another export)"
    )
    return shown, shown


def resolve(folder: str) -> Resolved:
    res = Resolved(folder)
    manifest = read_manifest(folder)
    index_path = os.path.join(folder, INDEX)
    if manifest is None:  # older exports: layout from the files
        if os.path.exists(index_path):
            res.index = (index_path, index_path)
        else:
            single = os.path.join(folder, SINGLE)
            if not os.path.exists(single):
                raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX}")
            res.shards = [(single, single)]
            return res
    else:
        files = manifest["files"]
        if INDEX in files:
            res.index = _pick(folder, manifest, INDEX, res)
        else:
            res.shards = [_pick(folder, manifest, fn, res) for fn in sorted(files) if fn not in ADAPTER_FILES]
            return res
    res.weight_map = _read_weight_map(res.index[1], res.index[0])
    for fn in sorted(set(res.weight_map.values())):
        shown = os.path.join(folder, fn)
        if manifest is not None:
            if fn not in manifest["files"]:
                raise CheckpointError(
                    f"{res.index[0]}: names shard {fn!r}, which {CONFIG} does not list among the export's files"
                )
            res.shards.append(_pick(folder, manifest, fn, res))
        elif not os.path.exists(shown):
            raise CheckpointError(f"{res.index[0]}: names shard {fn!r}, which does not exist")
        else:
            res.shards.append((shown, shown))
    return res


def read_index(folder: str):
    """The index's weight_map {tensor: shard file}, or None for a single-file checkpoint."""
    return resolve(folder).weight_map


def checkpoint_files(folder: str) -> List[str]:
    """The safetensors files of a checkpoint folder to read (from the index when sharded)."""
    return [path for _, path in resolve(folder).shards]


def _check_index(folder: str, weight_map: dict, where: Dict[str, str]):
    """Every tensor must sit in the shard the index names: loaders that trust the index
    (transformers) open only that shard."""
    index = os.path.join(folder, INDEX)
    for k, fn in weight_map.items():
        if k not in where:
            raise CheckpointError(f"{os.path.join(folder, fn)}: missing tensor {k!r} listed in {INDEX}")
        if os.path.normpath(os.path.join(folder, fn)) != os.path.normpath(where[k]):
            raise CheckpointError(
                f"{index}: maps tensor {k!r} to {fn!r}, but it is stored in {os.path.basename(where[k])}"
            )
    for k in where:
        if k not in weight_map:
            raise CheckpointError(f"{index}: does not list tensor {k!r}, which {os.path.basename(where[k])} holds")


def read_checkpoint(folder: str, verify: bool = True, problems: Optional[list] = None):
    """({name: tensor}, {name: file}, metadata of the first file).

    A file that config.json does not bind to this export is a CheckpointError, raised after
    every other check of the files; pass a list as `problems` to collect those instead."""
    res = resolve(folder)
    tensors, where, first_meta = {}, {}, None
    for shown, path in res.shards:
        t, meta = read_safetensors(path, verify, shown)
        if first_meta is None:
            first_meta = meta
        for k, v in t.items():
            if k in tensors:
                raise CheckpointError(f"{shown}: tensor {k!r} also appears in {where[k]}")
            tensors[k], where[k] = v, shown
    if res.weight_map is not None:
        _check_index(folder, res.weight_map, where)
    if problems is not None:
        problems.extend(res.problems)
    elif res.problems:
        raise CheckpointError(res.problems[0])
    return tensors, where, first_meta or {}


def existing_outputs(folder: str) -> List[str]:
    """The export files (final names) in `folder`."""
    if not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f in (SINGLE, INDEX, CONFIG) + ADAPTER_FILES or SHARD_RE.match(f))
