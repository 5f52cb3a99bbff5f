"""Rank-side code for tests/nn/test_ranges.py (spawned by tests/helpers/dist_utils.run_ranks): learned
ranges under the engine at every ZeRO stage, with a checkpoint and resume. No test functions."""

from __future__ import annotations

import os

from tests.helpers import engine_workers as W

# Weights 6 -> 4 bits (drop at steps 2 and 4, each re-initialising the learned scales from the
# mse observer) with learned asymmetric per-channel scales and zero points; learned asymmetric
# static 8-bit activation ranges (initialised after the first step's synchronised EMA).
COMPRESSION = {
    "weight_quantization": {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 0,
            "quantization_type": "asymmetric",
            "quantize_weight_in_forward": True,
            "observer": "mse",
            "range_learning": True,
        },
        "different_groups": {
            "wq": {
                "params": {
                    "start_bits": 6,
                    "target_bits": 4,
                    "quantization_period": 2,
                    "period_growth": "linear",
                    "granularity": "channel",
                }
            }
        },
    },
    "activation_quantization": {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 0,
            "range_calibration": "static",
            "quantization_type": "asymmetric",
            "range_learning": True,
        },
        "different_groups": {"aq": {"params": {"bits": 8}}},
    },
}

STAGES = [("s0", 0), ("s1", 1), ("s2", 2), ("s3", 3)]


def make_cfg(stage, micro=4, gas=2, world=2):
    cfg = W.make_cfg(stage, micro, gas, world)
    cfg["compression_training"] = COMPRESSION
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.005, "weight_decay": 0.0}}
    cfg.pop("scheduler")
    return cfg


def run_stages(rank, world, ckpt_root):
    micro, gas = 4, 2
    out = {}
    for label, stage in STAGES:
        cfg = make_cfg(stage, micro, gas, world)
        out[label] = W.run_with_resume(rank, world, cfg, os.path.join(ckpt_root, label), micro, gas)
    return out
