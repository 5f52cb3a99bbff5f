"""Config keys that were accepted and silently ignored: each is now implemented or a
ConfigError; a loss scale that makes every step an overflow is refused or reported loudly."""

import logging
import math

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress import ConfigError, load_config

SP = "compression_training.sparse_pruning.shared_parameters"


def sparse_cfg(modules=(".*",), ratio=0.5, **shared):
    sp = {"enabled": True, "schedule_offset": 0, "method": "l1", **shared}
    return {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": sp,
                "different_groups": {"g1": {"params": {"dense_ratio": ratio}, "modules": list(modules)}},
            }
        }
    }


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# --- fp16 loss scale ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e30, -1.0])
def test_unusable_loss_scales_are_config_errors(value):
    with pytest.raises(ConfigError, match=r"^fp16\.loss_scale: "):
        load_config({"fp16": {"enabled": True, "loss_scale": value}})


def test_loss_scale_inf_from_json_and_yaml(tmp_path):
    (tmp_path / "a.json").write_text('{"fp16": {"enabled": true, "loss_scale": Infinity}}')
    (tmp_path / "a.yaml").write_text("fp16: {enabled: true, loss_scale: .inf}\n")
    for name in ("a.json", "a.yaml"):
        with pytest.raises(ConfigError, match=r"fp16\.loss_scale"):
            load_config(str(tmp_path / name))


def _fp16_engine(**fp16):
    cfg = {
        "train_batch_size": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, **fp16},
    }
    return qc.initialize(mlp(), cfg)


def _overflowing_step(engine):
    x = torch.randn(4, 8)
    loss = engine(x).float().sum() * 1e30  # x 2^64 overflows float32
    engine.backward(loss)
    engine.step()


def test_a_static_loss_scale_that_overflows_is_a_warning(caplog):
    engine = _fp16_engine(loss_scale=2.0**64)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with caplog.at_level(logging.INFO, logger="qcompress.engine"):
        _overflowing_step(engine)
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    rec = [r for r in caplog.records if "overflow" in r.getMessage()]
    assert rec and rec[0].levelno == logging.WARNING and "cannot go lower" in rec[0].getMessage()
    # dynamic scaling adapts: an overflow there is routine (INFO), until min_loss_scale is reached
    caplog.clear()
    engine = _fp16_engine(loss_scale=0, initial_scale_power=4, hysteresis=1, min_loss_scale=8)
    with caplog.at_level(logging.INFO, logger="qcompress.engine"):
        _overflowing_step(engine)  # 16 -> 8
        _overflowing_step(engine)  # at the floor
    levels = [r.levelno for r in caplog.records if "overflow" in r.getMessage()]
    assert levels == [logging.INFO, logging.WARNING]


# --- sparse pruning keys of DeepSpeed's snip_momentum ------------------------------------------------


def test_block_pattern_and_shared_dense_ratio_are_refused_for_l1_and_topk():
    for method in ("l1", "topk"):
        with pytest.raises(ConfigError, match=rf"^{SP}\.block_pattern: '4x1': l1 and topk .*single weights"):
            load_config(sparse_cfg(method=method, block_pattern="4x1"))
        with pytest.raises(ConfigError, match=rf"^{SP}\.dense_ratio: applies to 'snip_momentum' only"):
            load_config(sparse_cfg(method=method, dense_ratio=0.2))
    assert load_config(sparse_cfg(block_pattern="1x1")).compression.sparse_pruning.shared.block_pattern == "1x1"
    with pytest.raises(ConfigError, match=rf"^{SP}\.block_pattern: '4by1' must look like"):
        load_config(sparse_cfg(block_pattern="4by1"))


def test_snip_momentum_enabled_is_refused_even_without_groups():
    doc = {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": {
                    "enabled": True,
                    "method": "snip_momentum",
                    "dense_ratio": 0.2,
                    "block_pattern": "4x1",
                },
                "different_groups": {},
            }
        }
    }
    with pytest.raises(ConfigError, match=rf"^{SP}\.method: 'snip_momentum' .*not supported"):
        load_config(doc)


@pytest.mark.parametrize("bad", ["(", "a{1,99999999999}", "(" * 1200 + ")" * 1200, 3])
def test_excluded_modules_must_be_regexes(bad):
    with pytest.raises(ConfigError, match=rf"^{SP}\.excluded_modules(\[0\])?: "):
        load_config(sparse_cfg(excluded_modules=[bad]))


def test_excluded_modules_are_not_pruned():
    cfg = load_config(sparse_cfg(excluded_modules=["^2$"]))
    model = qc.init_compression(mlp(), cfg)
    assert "sparse_pruning" in model[0].qc_pruning
    assert "sparse_pruning" not in getattr(model[2], "qc_pruning", {})
    w0 = model[0].effective_weight().detach()
    assert int((w0 == 0).sum()) == w0.numel() // 2  # oracle: half of 8 x 16 kept
    w2 = model[2].effective_weight() if hasattr(model[2], "effective_weight") else model[2].weight
    assert torch.equal(w2.detach(), mlp()[2].weight.detach())  # untouched
    # without the exclusion the same group prunes it
    model = qc.init_compression(mlp(), load_config(sparse_cfg()))
    assert int((model[2].effective_weight() == 0).sum()) == 32


def test_schedule_offset_stride_steps_the_ramp():
    # kept ratio ramps from 1 to 0.5 over steps 10..30, updated every 4 steps (DeepSpeed's
    # pruning frequency): closed form 1 - 0.5 * (10 + 4 * floor((t - 10) / 4) - 10) / 20
    cfg = load_config(sparse_cfg(schedule_offset=10, schedule_offset_end=30, schedule_offset_stride=4))
    model = qc.init_compression(mlp(), cfg)
    state = model[0].qc_pruning["sparse_pruning"]
    for t in range(0, 40):
        if t < 10:
            want = 1.0
        elif t >= 30:
            want = 0.5
        else:
            want = 1.0 - 0.5 * (4 * ((t - 10) // 4)) / 20
        assert state.ratio_at(t) == pytest.approx(want), t
    assert len({state.ratio_at(t) for t in range(10, 14)}) == 1


# --- DeepSpeed keys qcompress does not implement -------------------------------------------------------


@pytest.mark.parametrize("key", ["eigenvalue", "quantize_training", "sparse_attention", "wandb", "hybrid_engine"])
def test_unimplemented_deepspeed_keys_warn_instead_of_unknown_key(key):
    with pytest.warns(UserWarning, match=rf"config key '{key}' is a DeepSpeed setting with no effect in qcompress: "):
        cfg = load_config({"train_batch_size": 8, key: {"enabled": True}})
    assert cfg.train_batch_size == 8


def test_comm_timeout_key():
    from qcompress.engine.comm_timeout import DEFAULT_S, timeout_of

    assert timeout_of(load_config({})).total_seconds() == DEFAULT_S == 1800
    assert timeout_of(load_config({"comm_timeout_s": 2.5})).total_seconds() == 2.5
    for bad in (0, -1, math.inf, "10"):
        with pytest.raises(ConfigError, match=r"^comm_timeout_s: "):
            load_config({"comm_timeout_s": bad})
