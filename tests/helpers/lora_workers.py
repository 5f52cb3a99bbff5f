"""Rank-side code for tests/engine/test_lora_engine.py (spawned by tests/helpers/dist_utils.run_ranks): LoRA
training through qcompress.initialize at every ZeRO stage, with a checkpoint and resume. Returns
plain data; the assertions live in the test file."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress.engine import initialize

IN, HID, OUT = 16, 32, 8
STEPS, SAVE_AT = 4, 2
STAGES = (0, 1, 2, 3)


def make_cfg(mode, stage, world):
    return {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 8}}},
            },
            "lora": {"enabled": True, "r": 2, "alpha": 4, "mode": mode},
        },
    }


def make_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT))
    return qc.init_compression(model, cfg)


def micro_batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(4 * world, IN, generator=g)
    y = torch.randint(0, OUT, (4 * world,), generator=g)
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]


def train(engine, first, last, rank, world):
    losses = []
    for step in range(first, last):
        x, y = micro_batch(step, rank, world)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().double().item())
    return losses


def full_state(engine):
    """Whole parameters and buffers by name (the same on every rank)."""
    out = {}
    for name, t in list(engine.module.named_parameters()) + list(engine.module.named_buffers()):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.detach().clone().cpu()
    return out


def optimizer_names(engine):
    opt = engine.optimizer
    inner = getattr(opt, "optim", opt)
    return sorted(engine.param_names[p] for g in inner.param_groups for p in g["params"])


def run(rank, world, root):
    out = {}
    for mode in ("qat", "qlora"):
        for stage in STAGES:
            cfg = make_cfg(mode, stage, world)
            engine = initialize(make_model(cfg), cfg)
            start = full_state(engine)
            losses = train(engine, 0, SAVE_AT, rank, world)
            ckdir = os.path.join(root, f"{mode}-{stage}")
            engine.save_checkpoint(ckdir)
            losses += train(engine, SAVE_AT, STEPS, rank, world)
            res = {"start": start, "final": full_state(engine), "losses": losses, "optimizer": optimizer_names(engine)}
            del engine
            resumed = initialize(make_model(cfg, seed=7), cfg)
            resumed.load_checkpoint(ckdir)
            res["resumed_losses"] = train(resumed, SAVE_AT, STEPS, rank, world)
            res["resumed_final"] = full_state(resumed)
            out[f"{mode}-{stage}"] = res
    return out
