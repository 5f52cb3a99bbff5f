"""Rank functions of the parallel I/O tests (export and checkpoints across meshes): importable by
spawned ranks. Each trains the tiny Llama of parallel_workers on a mesh and returns what the test
compares against one process: whole weights, compression state, exported files."""

from __future__ import annotations

import os

import torch

import qcompress as qc
from tests.helpers import parallel_workers as pw


def config(tp=1, pp=1, gas=2, act="static"):
    """W4 group-16 asymmetric weights and 8-bit inputs (static: a range the stages carry)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp},
        "compression_training": pw.compression(bits=4, granularity="group", group_size=16, symmetric=False, act=act),
    }


def batches(n=8, seed=5):
    ids = torch.randint(0, 64, (2 * n, 12), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[i : i + 2], "labels": ids[i : i + 2]} for i in range(0, 2 * n, 2)]


def engine_for(doc, seed=0):
    return qc.initialize(qc.init_compression(pw.tiny_llama(seed=seed), qc.load_config(doc)), doc)


def whole_weights(engine):
    """{name in the whole model: full tensor} of this rank's parameters and buffers."""
    out = {}
    for n, t in engine.module.state_dict().items():
        out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def stage_export(rank, world, folder, tp, pp):
    """Train 2 steps on pp pipeline stages of tp ranks each (world / (pp x tp) data-parallel
    replicas, each its own micro-batches), export from every rank. Returns (this rank's whole
    weights, its compression scheduler's state)."""
    doc = config(tp=tp, pp=pp)
    engine = engine_for(doc)
    replicas, me = engine.data_parallel_world_size, engine.data_parallel_rank
    it = iter(batches(4 * replicas)[me::replicas])
    engine.train_batch(it), engine.train_batch(it)
    qc.export_quantized(engine, os.path.join(folder, "split"))
    return whole_weights(engine), engine.compression_scheduler.state_dict()


def single_export(results, folder, doc):
    """The oracle: one unsplit model given the ranks' weights and compression state, exported by
    one process into folder/single."""
    weights, modules, steps = {}, {}, 0
    for w, comp in results:
        weights.update(w)
        modules.update(comp["modules"])
        steps = comp["training_steps"]
    cfg = qc.load_config(doc)
    single = qc.init_compression(pw.tiny_llama(seed=1), cfg)
    single.load_state_dict(weights, strict=True)
    qc.CompressionScheduler(single, cfg).load_state_dict({"training_steps": steps, "modules": modules})
    return qc.export_quantized(single, os.path.join(folder, "single"))


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(engine):
    """What a resume must carry, whole tensors keyed by name (this rank's share under pipeline
    stages): weights, optimizer state, compression state, LR schedule, counters."""
    opt = getattr(engine.optimizer, "optim", engine.optimizer)
    optim = {
        f"{engine.param_names[p]}.{k}": _whole(v) if torch.is_tensor(v) else v
        for p, st in opt.state.items()
        for k, v in st.items()
    }
    comp = engine.compression_scheduler.state_dict()
    return {
        "model": whole_weights(engine),
        "optim": optim,
        "compression": comp["modules"],
        "training_steps": comp["training_steps"],
        "lr": engine.get_lr(),
        "lr_scheduler": engine.lr_scheduler.state_dict(),
        "counters": engine.counters(),
    }


def mesh_resume(rank, world, folder, tp, pp, save):
    """At tp x pp over `world` ranks: `save`: train 2 steps, snapshot, save into folder; else a
    fresh engine (other initial weights) loads folder and snapshots. Then both train the third
    step. Returns (snapshot, third step's loss)."""
    doc = config(tp=tp, pp=pp)
    data = batches()
    engine = engine_for(doc, seed=0 if save else 2)
    if save:
        it = iter(data)
        engine.train_batch(it), engine.train_batch(it)
        state = snapshot(engine)
        engine.save_checkpoint(folder)
    else:
        engine.load_checkpoint(folder)
        state = snapshot(engine)
    return state, float(engine.train_batch(iter(data[4:6])))


def onebit_save(rank, world, folder):
    """Two OneBitAdam steps at PP2, saved into folder (its optimizer state is saved per rank)."""
    doc = dict(config(pp=2), optimizer={"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 1}})
    engine = engine_for(doc)
    it = iter(batches())
    engine.train_batch(it), engine.train_batch(it)
    engine.save_checkpoint(folder)
    return doc


def tied_export(rank, world, folder):
    """export_quantized at PP2 of a Llama whose lm_head is its embedding: (error type, message)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    doc = config(pp=2)
    engine = qc.initialize(qc.init_compression(model, qc.load_config(doc)), doc)
    try:
        qc.export_quantized(engine, os.path.join(folder, "tied"))
    except Exception as err:  # noqa: BLE001 - the test reads which error each rank raised
        return type(err).__name__, str(err)
    return None
