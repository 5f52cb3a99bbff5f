"""Rank workers for tests/parallel/test_pipeline_checkpointing.py: a tiny Llama at 2 pipeline
stages, static activation ranges, trained with and without activation checkpointing."""

import torch

import qcompress as qc
from tests.helpers.parallel_workers import compression, tiny_llama


def train_pipeline(rank, world, schedule, checkpointing, fmt="int8", steps=1, gas=3):
    """`steps` train_batch calls at pp=world under `schedule` (gpipe | 1f1b); returns this stage's
    trained weights and static ranges (named as in the unsplit model)."""
    comp = compression(bits=8, granularity="channel", act="static")
    if fmt == "nvfp4":
        wq = comp["weight_quantization"]
        wq["shared_parameters"]["format"] = "nvfp4"
        wq["different_groups"]["wq"]["params"] = {"start_bits": 4, "target_bits": 4}
        aq = comp["activation_quantization"]
        aq["shared_parameters"].update(format="nvfp4", quantization_type="symmetric")
        aq["different_groups"]["aq"]["params"] = {"bits": 4}
    doc = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": world, "schedule": schedule},
        "compression_training": comp,
    }
    if checkpointing:
        doc["activation_checkpointing"] = {}
    model = qc.init_compression(tiny_llama(), qc.load_config(doc))
    engine = qc.initialize(model, doc)
    assert (engine.checkpointed_blocks > 0) == checkpointing, engine.checkpointed_blocks
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 64, (steps * gas * 2, 12), generator=g)

    def batches():
        for i in range(data.shape[0] // 2):
            ids = data[i * 2 : (i + 1) * 2]
            yield {"input_ids": ids, "labels": ids}

    it = batches()
    for _ in range(steps):
        engine.train_batch(it)
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ranges = {
        n: (m.qc_aq.observer.min.clone(), m.qc_aq.observer.max.clone())
        for n, m in engine.module.named_modules()
        if getattr(m, "qc_aq", None) is not None and m.qc_aq.observer.initialized
    }
    return weights, ranges
