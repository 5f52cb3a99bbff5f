"""Rank-side code for tests/engine/test_moe_engine.py (spawned by tests/helpers/dist_utils.run_ranks): a
tiny Qwen3-MoE causal LM with W4 g16 experts trained through the engine at a ZeRO stage, saved
mid-way and resumed into a fresh engine. Returns plain data; the assertions live in the test."""

from __future__ import annotations


import torch

import qcompress as qc
from qcompress.engine import initialize
from tests.helpers.moe_fixtures import make_moe
from tests.helpers.engine_workers import full_params as full

STEPS, SAVE_AT, MICRO, SEQ = 4, 2, 2, 12


def make_cfg(stage, world, optimizer="AdamW", act=None):
    params = {"lr": 0.01}
    if optimizer in ("OneBitAdam", "OneBitLamb"):
        params["freeze_step"] = 1  # the compressed (1-bit) phase from the second step on
    cfg = {
        "train_batch_size": MICRO * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "wq": {
                        "params": {
                            "start_bits": 8,
                            "target_bits": 4,
                            "quantization_period": 1,
                            "granularity": "group",
                            "group_size": 16,
                        },
                        "modules": [r"mlp\.experts"],
                    }
                },
            }
        },
    }
    if act is not None:  # the experts' routed tokens quantized: per token, or a range per expert
        cfg["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "range_calibration": act, "schedule_offset": 0},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.experts"]}},
        }
    return cfg


def expert_ranges(engine):
    """{matrix name: [(min, max) or None per expert]} of the static per-expert input ranges."""
    out = {}
    for name, mod in engine.module.named_modules():
        aq = getattr(mod, "qc_aq", None)
        if type(mod).__name__ == "ExpertMatrix" and aq is not None and aq.calibration == "static":
            out[name] = [(float(r.min), float(r.max)) if r.initialized else None for r in aq.observer.experts]
    return out


def make_engine(cfg, seed=0):
    model = make_moe("qwen3_moe", seed=seed).train()
    return initialize(qc.init_compression(model, qc.load_config(cfg)), cfg)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 96, (MICRO * world, SEQ), generator=g)
    return x[rank * MICRO : (rank + 1) * MICRO]


def train(engine, first, last, rank, world):
    losses = []
    for step in range(first, last):
        x = batch(step, rank, world)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().double().item())
    return losses


def run(rank, world, ckdir, stage, optimizer="AdamW", act=None):
    cfg = make_cfg(stage, world, optimizer, act)
    engine = make_engine(cfg)
    losses = train(engine, 0, SAVE_AT, rank, world)
    engine.save_checkpoint(ckdir)
    saved = full(engine)
    tail = train(engine, SAVE_AT, STEPS, rank, world)
    final = full(engine)
    ranges = expert_ranges(engine)
    bits = engine.compression_scheduler.current_bits()
    del engine
    again = make_engine(cfg, seed=7)
    again.load_checkpoint(ckdir)
    loaded = full(again)
    resumed = train(again, SAVE_AT, STEPS, rank, world)
    return {
        "losses": losses + tail,
        "tail": tail,
        "saved": saved,
        "final": final,
        "loaded": loaded,
        "resumed": resumed,
        "resumed_final": full(again),
        "bits": bits,
        "ranges": ranges,
        "resumed_ranges": expert_ranges(again),
    }
