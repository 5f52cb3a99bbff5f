"""Rank-side code for tests/engine/test_kv_engine.py (spawned by tests/helpers/dist_utils.run_ranks): the
engine averaging KV-cache ranges over data-parallel ranks, and resuming a checkpoint. No tests."""

from __future__ import annotations

import os

import torch

import qcompress as qc
from qcompress.nn import kv_cache

from tests.helpers.kv_fixtures import make_model

MICRO = 2


def engine_cfg(world=1, learned=True, stage=0):
    return {
        "train_batch_size": MICRO * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "compression_training": {
            "kv_cache_quantization": {
                "enabled": True,
                "format": "int8",
                "strategy": "head",
                "range_learning": learned,
                "momentum": 0.5,
            },
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["proj"]}},
            },
        },
    }


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 96, (MICRO, 10), generator=g)


def ranges(model):
    """{name.k/v: (min, max)} of every KV quantizer, copied."""
    out = {}
    for name, mod in kv_cache.quantized_modules(model):
        state = mod.__dict__[kv_cache.ATTR]
        for which in ("k", "v"):
            obs = getattr(state, which)
            out[f"{name}.{which}"] = (obs.min.clone(), obs.max.clone())
    return out


def run_sync(rank, world):
    """One step per rank on its own batch: the ranges each rank's EMA held before the engine's
    sync, and after it."""
    model = make_model("llama").train()
    cfg = engine_cfg(world, learned=False)
    qc.init_compression(model, cfg)
    engine = qc.initialize(model, cfg)
    x = batch(0, rank)
    loss = engine(input_ids=x, labels=x).loss
    local = ranges(engine.module)
    engine.backward(loss)
    engine.step()
    return {"local": local, "synced": ranges(engine.module)}


def train(engine, start, stop, rank=0):
    losses = []
    for step in range(start, stop):
        x = batch(step, rank)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def state_of(engine):
    """(state_dict with whole tensors, KV ranges); collective under ZeRO 2 / 3."""
    sd = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in engine.module.state_dict().items()
    }
    return sd, ranges(engine.module)


def run_resume(rank, world, ckdir, stage=0):
    cfg = engine_cfg(world, learned=True, stage=stage)
    model = make_model("llama").train()
    qc.init_compression(model, cfg)
    engine = qc.initialize(model, cfg)
    train(engine, 0, 3, rank)
    engine.save_checkpoint(ckdir)
    tail = train(engine, 3, 5, rank)
    final = state_of(engine)
    model2 = make_model("llama", seed=7).train()
    qc.init_compression(model2, cfg)
    engine2 = qc.initialize(model2, cfg)
    engine2.load_checkpoint(ckdir)
    resumed = train(engine2, 3, 5, rank)
    return {
        "tail": tail,
        "resumed": resumed,
        "final": final,
        "resumed_final": state_of(engine2),
        "files": sorted(os.listdir(ckdir)),
    }


def run_ranks_checks(rank, world, ckdir):
    """Both multi-rank checks in one process group: the range sync, and a ZeRO-3 resume."""
    return {"sync": run_sync(rank, world), "zero3": run_resume(rank, world, ckdir, stage=3)}
