"""Engine checkpoints: torch.distributed.checkpoint for tensors, JSON for the rest, committed atomically.

Layout of <dir>/<tag>/: DCP files (model.*, optim.*, compression.*, lr.*), engine.json (rank 0:
counters, loss scaler, LR and compression schedulers, optimizer hyper-parameters, client state)
and ranks/rank<r>.json (RNG states and other per-rank values); engine.json also holds the size and
crc32 of every other file, checked before a load reads anything else (CheckpointError names the
file). Everything is first written into <dir>/.<tag>.tmp and renamed into place by rank 0 once
every rank has finished, then <dir>/latest
is replaced atomically, so a crash mid-save leaves the previous checkpoint and `latest` intact.
Re-saving an existing tag parks the old <tag> at <dir>/.<tag>.old until the new one is in place;
loading falls back to the parked copy when <tag> is missing, so a crash at any point of the
commit leaves a complete checkpoint under every tag `latest` can name. Rank 0 holds an owner
lock (<dir>/.<tag>.lock, qcompress/atomic.py) while it saves; the next save removes what dead
writers left (their .tmp folders, .latest files, parked copies no longer needed), never what a
live writer owns. Every rename and removal goes through qcompress.atomic's hooks.

The optimizer state is stored in the layout the engine's placement names ("dcp", "zero1" or
"per_rank": engine/optimizer_layouts.py), recorded as engine.json's optimizer.mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import warnings
import zlib
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from .. import atomic
from ..errors import CheckpointError
from ..parallel.stage_state import merged_compression, own_compression
from ..serialize import flatten, tensor_keys, unflatten
from .optimizer_layouts import LAYOUTS, alloc_from_metadata, read_json

FORMAT_VERSION = 1


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group=None) -> None:
    if _dist_on() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    atomic.remove_quietly(tmp)
    atomic.write_text_new(tmp, json.dumps(obj))
    atomic.fs_replace(tmp, path)


_ENGINE_KEYS = ("format", "world_size", "counters", "optimizer", "client_state")


def _read_meta(path: str) -> Dict[str, Any]:
    meta = read_json(os.path.join(path, "engine.json"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{os.path.join(path, 'engine.json')}: checkpoint format {found!r}, expected {FORMAT_VERSION}"
        )
    missing = [k for k in _ENGINE_KEYS if k not in meta]
    if missing or not isinstance(meta["optimizer"], dict) or "mode" not in meta["optimizer"]:
        raise CheckpointError(
            f"{os.path.join(path, 'engine.json')}: damaged, missing {', '.join(missing) or 'optimizer.mode'}"
        )
    return meta


def _read_metadata(path: str):
    """DCP's .metadata index (torch reads it with pickle; any failure there means a damaged file)."""
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling fails in many ways on a damaged file
        raise CheckpointError(
            f"{os.path.join(path, '.metadata')}: cannot read the tensor index "
            f"({type(e).__name__}: {e}); the checkpoint is damaged or incomplete"
        ) from e


def _root(engine):
    """The module whose names a checkpoint uses (the placement's: the whole model's)."""
    return engine.placement.checkpoint_root


def _mesh(engine) -> Dict[str, int]:
    """The engine's (pp, dp, tp) sizes, recorded with a checkpoint and compared on load."""
    shape = getattr(getattr(engine, "parallel", None), "shape", None)
    return shape.as_dict() if shape is not None else {"pp": 1, "dp": engine.world_size, "tp": 1}


def _split(*meshes) -> bool:
    """Whether any of these meshes splits the model (tensor or pipeline parallel)."""
    return any(m["tp"] > 1 or m["pp"] > 1 for m in meshes)


def _mesh_note(meta, engine) -> str:
    """Both meshes, for an error loading a checkpoint into another mesh shape ('' on the same)."""
    saved, now = meta.get("mesh"), _mesh(engine)
    if saved is None or saved == now:
        return ""
    saved, now = (" x ".join(f"{k}{m[k]}" for k in ("pp", "dp", "tp")) for m in (saved, now))
    return f" (saved on the mesh {saved}, loading into {now})"


def _dcp_load(target, path: str, group, note: str = "") -> None:
    """dcp.load, with its CheckpointException (a BaseException holding every failing rank's
    error and traceback) turned into one CheckpointError naming the folder and each rank's error."""
    try:
        with _quiet_single_process():
            dcp.load(target, checkpoint_id=path, process_group=group, no_dist=not _dist_on())
    except CheckpointException as e:
        why = "; ".join(
            f"rank {r}: {type(exc).__name__}: {exc}".rstrip(": ") for r, (exc, _) in sorted(e.failures.items())
        )
        raise CheckpointError(
            f"{path}: reading the checkpoint's tensors (*.distcp) failed{note}: {why}. "
            "The files are damaged or the model differs from the saved one; this "
            "engine's weights may be partly overwritten, load another checkpoint"
        ) from None


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is off; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag or tag == "latest":
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.', not 'latest')")
    return tag


# --- RNG -------------------------------------------------------------------------------------
def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- optimizer state -------------------------------------------------------------------------
def _optim_mode(engine) -> str:
    """ "dcp", "zero1" or "per_rank" (see the module docstring): the placement's layout."""
    return engine.placement.optimizer_layout


def _optimizer_class(engine) -> str:
    """The optimizer's class name (ZeroRedundancyOptimizer's local one), checked on load."""
    return type(getattr(engine.optimizer, "optim", engine.optimizer)).__name__


def _collect_optimizer(engine, tensors, rank_extra) -> Dict[str, Any]:
    mode = _optim_mode(engine)
    meta: Dict[str, Any] = {"mode": mode, "class": _optimizer_class(engine)}
    LAYOUTS[mode].collect(engine, tensors, rank_extra, meta)
    return meta


# --- file checksums --------------------------------------------------------------------------
def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _file_sums(folder: str) -> Dict[str, list]:
    """{relative path: [size, crc32]} of every file but engine.json (which holds this table).
    DCP's files carry no checksum: a damaged tensor byte would otherwise load silently."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if rel != "engine.json":
                out[rel] = [os.path.getsize(full), _crc32(full)]
    return out


def _verify_files(path: str, sums: Optional[Dict[str, list]]) -> None:
    """Every file the save recorded, with its size and crc32 (read once more before loading)."""
    if not sums:
        return
    for rel, (size, crc) in sorted(sums.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full}: missing; the checkpoint is incomplete, load another tag")
        got = os.path.getsize(full)
        if got != size:
            raise CheckpointError(f"{full}: {got} bytes, {size} when saved; the file is damaged, load another tag")
        if _crc32(full) != crc:
            raise CheckpointError(
                f"{full}: contents differ from the save (crc32 mismatch); the file is damaged, load another tag"
            )


# --- save ------------------------------------------------------------------------------------
def _parked(save_dir: str, tag: str) -> str:
    """Where a re-save parks the tag's previous checkpoint while the new one is moved in."""
    return os.path.join(save_dir, f".{tag}.old")


def _temp(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.tmp")


def _lock_path(save_dir: str, tag: str) -> str:
    """Rank 0 holds an flock on this file while it saves `tag` (see qcompress/atomic.py)."""
    return os.path.join(save_dir, f".{tag}.lock")


def _latest_temp(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.latest")


_SUFFIXES = ("tmp", "old", "lock", "latest")  # .<tag>.<suffix>: the last dot ends the tag


def _take_lock(save_dir: str, tag: str) -> atomic.OwnerLock:
    """This writer's lock on `tag` (a dead writer's lock file is taken over)."""
    path = _lock_path(save_dir, tag)
    for _ in range(100):
        try:
            return atomic.OwnerLock.create(path)
        except FileExistsError:
            lock = atomic.OwnerLock.claim(path)
            if lock is None and atomic.claims_supported():
                raise RuntimeError(
                    f"another process is saving checkpoint tag {tag!r} into {save_dir!r} right now ({path} is locked)"
                ) from None
            if lock is not None:
                lock.release()  # a dead writer's: remove it and create ours
            else:
                atomic.remove_quietly(path)
    raise RuntimeError(f"cannot take the lock {path}")


def clean_leftovers(save_dir: str, own: Optional[str] = None) -> None:
    """Remove what crashed saves left in `save_dir`: `.<tag>.tmp` folders and `.<tag>.latest`
    files of writers that are gone, and `.<tag>.old` copies once `<tag>` is in place again.
    A tag whose lock a live writer holds is left alone (`own`: the caller's tag, already locked)."""
    tags = set()
    for name in os.listdir(save_dir):
        tag, _, suffix = name[1:].rpartition(".")
        if name.startswith(".") and tag and suffix in _SUFFIXES:
            tags.add(tag)
    for tag in sorted(tags):
        lock = None
        if tag != own:
            lock = atomic.OwnerLock.claim(_lock_path(save_dir, tag))
            if lock is None:  # a live writer's
                continue
        try:
            atomic.rmtree_quietly(_temp(save_dir, tag))
            atomic.remove_quietly(_latest_temp(save_dir, tag))
            if os.path.isfile(os.path.join(save_dir, tag, "engine.json")):
                atomic.rmtree_quietly(_parked(save_dir, tag))  # else: the tag's only copy
        finally:
            if lock is not None:
                lock.release()


def _commit(tmp: str, final: str, parked: str) -> None:
    """Rename the finished `tmp` to `final`. A directory cannot be replaced atomically, so an
    existing `final` is first parked; until `tmp` is in place the parked copy is the tag's
    checkpoint (resolve() falls back to it), so a crash between the renames loses nothing."""
    if os.path.exists(final):
        atomic.rmtree_quietly(parked)  # leftover of a re-save that completed
        atomic.fs_replace(final, parked)
    # else: a parked copy, if any, is the only complete one (an earlier re-save crashed): keep it
    atomic.fs_replace(tmp, final)
    atomic.rmtree_quietly(parked)


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    save_dir = os.fspath(save_dir)
    final = os.path.join(save_dir, tag)
    tmp = _temp(save_dir, tag)
    rank, group = engine.rank, engine.group
    lock = None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        lock = _take_lock(save_dir, tag)
    try:
        if rank == 0:
            clean_leftovers(save_dir, own=tag)  # crashed saves, this tag's included
            os.makedirs(os.path.join(tmp, "ranks"))
        _barrier(group)
        _write_checkpoint(engine, save_dir, tag, tmp, final, client_state)
    finally:
        if lock is not None:
            lock.release()
    return final


def _write_checkpoint(engine, save_dir, tag, tmp, final, client_state) -> None:
    rank, group = engine.rank, engine.group
    tensors: Dict[str, torch.Tensor] = {}
    for k, v in get_model_state_dict(_root(engine)).items():
        tensors[f"model.{k}"] = v
    rank_extra: Dict[str, Any] = {"rng": rng_state()}
    meta: Dict[str, Any] = {
        "format": FORMAT_VERSION,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "precision": engine.precision,
        "counters": engine.counters(),
        "optimizer": _collect_optimizer(engine, tensors, rank_extra),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": (
            flatten(engine.lr_scheduler.state_dict(), "lr", tensors) if engine.lr_scheduler is not None else None
        ),
        # pipeline stages: every stage's modules (parallel/stage_state.py), so any mesh can load it
        "compression": merged_compression(
            flatten(engine.compression_scheduler.state_dict(), "compression", tensors)
            if engine.compression_scheduler is not None
            else None,
            engine,
        ),
        "mesh": _mesh(engine),
        "client_state": flatten(client_state or {}, "client", tensors),
    }
    with _quiet_single_process():
        dcp.save(tensors, checkpoint_id=tmp, process_group=group, no_dist=not _dist_on())
    _write_json(os.path.join(tmp, "ranks", f"rank{rank}.json"), flatten(rank_extra, "", {}, inline=True))
    _barrier(group)
    if rank == 0:
        meta["files"] = _file_sums(tmp)  # every rank's files are in place now
        _write_json(os.path.join(tmp, "engine.json"), meta)
        _commit(tmp, final, _parked(save_dir, tag))
        tmp_latest = _latest_temp(save_dir, tag)
        atomic.remove_quietly(tmp_latest)
        atomic.write_text_new(tmp_latest, tag)
        atomic.fs_replace(tmp_latest, os.path.join(save_dir, "latest"))
        atomic.fsync_dir(save_dir)
    _barrier(group)


# --- load ------------------------------------------------------------------------------------
def resolve(load_dir: str, tag: Optional[str]) -> str:
    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(
                f"no checkpoint in {load_dir!r}: the 'latest' file is missing; pass tag= to pick one"
            )
        with open(latest, "r", encoding="utf-8") as fh:
            tag = fh.read().strip()
    tag = _check_tag(tag)
    path, parked = os.path.join(load_dir, tag), _parked(load_dir, tag)
    if not os.path.exists(path) and os.path.isfile(os.path.join(parked, "engine.json")):
        path = parked  # a re-save of this tag crashed before its new copy was in place
    if not os.path.isfile(os.path.join(path, "engine.json")):
        raise FileNotFoundError(f"{path!r} is not a complete qcompress checkpoint (engine.json missing)")
    return path


def load_checkpoint(
    engine, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True
) -> Tuple[str, dict]:
    path = resolve(load_dir, tag)
    meta = _read_meta(path)
    _verify_files(path, meta.get("files"))  # absent in checkpoints written before it existed
    md = _read_metadata(path)
    rank = engine.rank
    rank_file = os.path.join(path, "ranks", f"rank{rank}.json")
    same_rank = os.path.isfile(rank_file) and meta["world_size"] == engine.world_size
    rank_extra = unflatten(read_json(rank_file if same_rank else os.path.join(path, "ranks", "rank0.json")), {})

    target: Dict[str, torch.Tensor] = {}
    model_sd = get_model_state_dict(_root(engine))
    for k, v in model_sd.items():
        target[f"model.{k}"] = v
    unexpected = sorted(
        k[len("model.") :] for k in md.state_dict_metadata if k.startswith("model.") and k not in target
    )
    if unexpected and getattr(engine, "pipeline", None) is None:  # a stage skips the others' blocks
        # strict, as DeepSpeed's load_module_strict: weights must not be dropped silently
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{path}: the checkpoint holds weights this model does not have"
            f"{_mesh_note(meta, engine)}: {', '.join(unexpected[:5])}{more}"
        )

    ometa = meta["optimizer"]
    mode = _optim_mode(engine)
    optim_plan = None
    if load_optimizer_states:
        if ometa["mode"] != mode and not {ometa["mode"], mode} <= {"dcp", "zero1"}:
            raise CheckpointError(
                f"{path}: optimizer state was saved as {ometa['mode']!r}, this engine needs "
                f"{mode!r} (1-bit optimizer checkpoints load only into 1-bit optimizers)"
            )
        note = _mesh_note(meta, engine)
        if ometa["mode"] == "per_rank" and note and _split(meta["mesh"], _mesh(engine)):
            raise CheckpointError(
                f"{path}: the 1-bit optimizer state is saved rank by rank{note}; each rank's "
                "moments and compression errors belong to the tensors it held, which another "
                "split does not hold. Load on the saved mesh, or with load_optimizer_states=False "
                "to take the weights and schedules alone"
            )
        saved_cls, now_cls = ometa.get("class"), _optimizer_class(engine)
        if saved_cls is not None and saved_cls != now_cls:
            # torch would copy the other optimizer's hyper-parameters into these param groups
            raise CheckpointError(
                f"{path}: optimizer state was saved by {saved_cls}, this engine runs "
                f"{now_cls}; load with load_optimizer_states=False to take the weights "
                "(and schedules) alone"
            )
        optim_plan = LAYOUTS[mode].plan_load(engine, ometa, md, target, rank_extra, path)

    if getattr(engine, "pipeline", None) is not None and meta.get("compression") is not None:
        from ..schedule import compress_modules  # a stage loads its own modules' entries

        meta["compression"] = own_compression(meta["compression"], (n for n, _ in compress_modules(engine.module)))
    extra_keys = []
    for name in ("lr_scheduler", "compression", "client_state"):
        if meta.get(name) is not None:
            extra_keys += tensor_keys(meta[name])
    for key in extra_keys:
        target[key] = alloc_from_metadata(md, key)

    _dcp_load(target, path, engine.group, _mesh_note(meta, engine))

    set_model_state_dict(_root(engine), {k[len("model.") :]: v for k, v in target.items() if k.startswith("model.")})
    if optim_plan is not None:
        optim_plan(target)
    if engine.loss_scaler is not None and meta.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(unflatten(meta["lr_scheduler"], target))
    if engine.compression_scheduler is not None and meta.get("compression") is not None:
        engine.with_full_weights(engine.compression_scheduler.load_state_dict, unflatten(meta["compression"], target))
    engine.set_counters(meta["counters"])
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and monitor.enabled:
        monitor.resume_at(engine.global_samples)
    if same_rank:
        set_rng_state(rank_extra["rng"])
    return path, unflatten(meta["client_state"], target)
