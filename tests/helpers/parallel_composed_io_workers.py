"""Rank functions of the composed-mesh I/O tests (tests/parallel/test_composed_io.py): checkpoints
and export of TP2 x DP2 engines (ZeRO stage 0 and 3, CPU offload), all cases in one spawn of the
ranks. Each data-parallel replica reads its own share of one batch stream, as train_batch asks."""

from __future__ import annotations

import os


import qcompress as qc
from tests.helpers import parallel_io_workers as iow

STEPS, MORE = 2, 2  # steps before the save, steps after it


def composed_config(zero=None, act="static"):
    """parallel_io_workers' AdamW / W4 g16 / 8-bit input config at TP2 (dp from the world)."""
    doc = iow.config(tp=2, act=act)
    if zero is not None:
        doc["zero_optimization"] = zero
    return doc


def _share(engine, n):
    """This replica's share of n micro-batches per replica (replica r takes every dp-th one)."""
    replicas, me = engine.data_parallel_world_size, engine.data_parallel_rank
    return iter(iow.batches(n * replicas)[me::replicas])


def _run(engine, it, steps):
    return [float(engine.train_batch(it)) for _ in range(steps)]


def save_resume_export(folder, zero):
    """Train STEPS steps, snapshot, save, export, train MORE steps; then a fresh engine (other initial
    weights) loads the checkpoint, snapshots and trains the same MORE steps. Returns {saved,
    loaded: snapshots; export: (whole weights, compression state) at the save; continued, resumed:
    (losses, whole weights after)} for this rank."""
    doc = composed_config(zero)
    gas = doc["gradient_accumulation_steps"]
    engine = iow.engine_for(doc)
    it = _share(engine, gas * (STEPS + MORE))
    _run(engine, it, STEPS)
    saved = iow.snapshot(engine)
    engine.save_checkpoint(folder)
    qc.export_quantized(engine, os.path.join(folder, "split"))
    export = (iow.whole_weights(engine), engine.compression_scheduler.state_dict())
    continued = (_run(engine, it, MORE), iow.whole_weights(engine))

    fresh = iow.engine_for(doc, seed=2)
    fresh.load_checkpoint(folder)
    loaded = iow.snapshot(fresh)
    it = _share(fresh, gas * (STEPS + MORE))
    for _ in range(gas * STEPS):  # the micro-batches the saving run had consumed
        next(it)
    resumed = (_run(fresh, it, MORE), iow.whole_weights(fresh))
    return {"saved": saved, "loaded": loaded, "export": export, "continued": continued, "resumed": resumed}


def offload_step(zero):
    """One TP2 x DP2 step under this zero_optimization section: (losses, whole weights, how many
    parameters FSDP2 offloaded), or the error's (type name, message) when the engine refuses it.
    Dynamic input ranges: static ones observe each replica's micro-batches apart (then averaged),
    so only a dynamic run equals one process fed the global batch."""
    doc = composed_config(zero, act="dynamic")
    try:
        engine = iow.engine_for(doc)
    except Exception as err:  # noqa: BLE001 - the test reads which error each rank raised
        return type(err).__name__, str(err)
    losses = _run(engine, _share(engine, doc["gradient_accumulation_steps"]), 1)
    return losses, iow.whole_weights(engine), len(engine._offloaded_ids)


def composed_io(rank, world, folder, zero_cases, offload_cases):
    """save_resume_export for each {name: zero section} into folder/<name>, then offload_step for
    each offload case, in one spawn of the ranks."""
    out = {name: save_resume_export(os.path.join(folder, name), zero) for name, zero in zero_cases.items()}
    out.update({name: offload_step(zero) for name, zero in offload_cases.items()})
    return out
