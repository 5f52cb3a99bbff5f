"""Safetensors files: size-based sharding, atomic writes, and validated reads.

Writes go to a hidden temporary file in the target folder and are renamed into place only
after every file of the checkpoint is complete, so an interrupted export leaves nothing
under a final name. Reads parse the header ourselves first, so truncation and header damage
give errors naming the file and tensor, and every tensor's CRC32 (kept in the metadata) is
checked, so flipped bytes are caught too. No pickle anywhere.
"""
from __future__ import annotations

import json
import os
import re
import struct
import tempfile
import zlib
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CRC_KEY = "qcompress_crc32"
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


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


def _tmp_path(folder: str, final: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f".{final}.", suffix=".tmp", dir=folder)
    os.close(fd)
    return path


def _fsync(path: str):
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_safetensors_tmp(folder: str, final: str, tensors: Dict[str, torch.Tensor],
                          metadata: Dict[str, str]) -> str:
    """Write one safetensors file under a temporary name in `folder`; returns that path."""
    meta = dict(metadata)
    meta[CRC_KEY] = json.dumps({k: crc32(v) for k, v in tensors.items()}, sort_keys=True)
    path = _tmp_path(folder, final)
    try:
        save_file(tensors, path, metadata=meta)
        _fsync(path)
    except BaseException:
        _remove(path)
        raise
    return path


def write_text_tmp(folder: str, final: str, text: str) -> str:
    path = _tmp_path(folder, final)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove(path)
        raise
    return path


def _remove(path: str):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def commit(folder: str, staged: List[Tuple[str, str]]):
    """Rename staged (tmp, final) pairs into place, in order (config.json last)."""
    for tmp, final in staged:
        os.replace(tmp, os.path.join(folder, final))


def discard(staged: List[Tuple[str, str]]):
    for tmp, _ in staged:
        _remove(tmp)


# --- reading -------------------------------------------------------------------------------------

def read_header(path: str) -> Tuple[dict, dict, int]:
    """(tensor entries, metadata, data start) after checking the header against the file size."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if size < 8:
        raise CheckpointError(f"{path}: truncated ({size} bytes; a safetensors file starts with an "
                              "8-byte header length)")
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > size - 8:
            raise CheckpointError(f"{path}: truncated or corrupted header (header says {hlen} bytes, "
                                  f"file has {size - 8} after the length field)")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupted header (not valid JSON: {e})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_len = size - 8 - hlen
    for tname, info in header.items():
        try:
            start, end = info["data_offsets"]
            want = _DTYPE_BYTES[info["dtype"]]
            for d in info["shape"]:
                want *= int(d)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupted header entry for tensor {tname!r}: {info!r}") from None
        if end > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {tname!r} ends at byte {end} of the data "
                                  f"section, but {name} holds only {data_len} data bytes")
        if end - start != want or start < 0:
            raise CheckpointError(f"{path}: corrupted header: tensor {tname!r} "
                                  f"({info['dtype']} {info['shape']}) spans {end - start} bytes, "
                                  f"expected {want}")
    return header, metadata, 8 + hlen


def read_safetensors(path: str, verify: bool = True) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """All tensors of one file and its metadata, validated (see module docstring)."""
    header, metadata, _ = read_header(path)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    if verify and CRC_KEY in metadata:
        try:
            crcs = json.loads(metadata[CRC_KEY])
        except ValueError:
            raise CheckpointError(f"{path}: corrupted metadata {CRC_KEY!r}") from None
        for k, t in tensors.items():
            if k in crcs and crc32(t) != crcs[k]:
                raise CheckpointError(f"{path}: corrupted: tensor {k!r} fails its CRC32 check")
    return tensors, metadata


def read_index(folder: str):
    """The index's weight_map {tensor: shard file}, or None for a single-file checkpoint."""
    index = os.path.join(folder, INDEX)
    if not os.path.exists(index):
        return None
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map must map tensor names to shard file names")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: corrupted index ({e})") from None
    return weight_map


def checkpoint_files(folder: str) -> List[str]:
    """The safetensors files of a checkpoint folder (from the index when sharded)."""
    weight_map = read_index(folder)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.exists(os.path.join(folder, fn)):
                raise CheckpointError(f"{os.path.join(folder, INDEX)}: names shard {fn!r}, which "
                                      "does not exist")
        return [os.path.join(folder, fn) for fn in files]
    single = os.path.join(folder, SINGLE)
    if not os.path.exists(single):
        raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX}")
    return [single]


def _check_index(folder: str, weight_map: dict, where: Dict[str, str]):
    """Every tensor must sit in the shard the index names: loaders that trust the index
    (transformers) open only that shard."""
    index = os.path.join(folder, INDEX)
    for k, fn in weight_map.items():
        if k not in where:
            raise CheckpointError(f"{os.path.join(folder, fn)}: missing tensor {k!r} listed in {INDEX}")
        if os.path.normpath(os.path.join(folder, fn)) != os.path.normpath(where[k]):
            raise CheckpointError(f"{index}: maps tensor {k!r} to {fn!r}, but it is stored in "
                                  f"{os.path.basename(where[k])}")
    for k in where:
        if k not in weight_map:
            raise CheckpointError(f"{index}: does not list tensor {k!r}, which "
                                  f"{os.path.basename(where[k])} holds")


def read_checkpoint(folder: str, verify: bool = True):
    """({name: tensor}, {name: file}, metadata of the first file)."""
    tensors, where, first_meta = {}, {}, None
    for path in checkpoint_files(folder):
        t, meta = read_safetensors(path, verify)
        if first_meta is None:
            first_meta = meta
        for k, v in t.items():
            if k in tensors:
                raise CheckpointError(f"{path}: tensor {k!r} also appears in {where[k]}")
            tensors[k], where[k] = v, path
    weight_map = read_index(folder)
    if weight_map is not None:
        _check_index(folder, weight_map, where)
    return tensors, where, first_meta or {}


def existing_outputs(folder: str) -> List[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder)
                  if f in (SINGLE, INDEX, "config.json") or SHARD_RE.match(f))
