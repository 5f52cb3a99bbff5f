"""Group.settings: each weight / activation group's effective values, resolved once at load
(qcompress/config/group_settings.py). The oracle is the documented rule (docs/config.md): a
group's own `params` value, else `shared_parameters`', else the schema's default; and DeepSpeed's
default granularity (one group per vocabulary row for an Embedding, quantize_groups chunks else)."""

import dataclasses

import pytest
import torch.nn as nn

import qcompress as qc
from qcompress.config.compression import ObserverKwargs


def _wq(shared, modules=("fc",), **groups):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, **shared},
                "different_groups": {name: {"params": p, "modules": list(modules)} for name, p in groups.items()},
            }
        }
    }


def test_own_value_else_shared_else_default_and_where_it_was_set():
    cfg = qc.load_config(
        _wq(
            {"observer": "mse", "observer_kwargs": {"grid": 50}},
            own={"start_bits": 8, "target_bits": 8, "observer": "minmax", "range_learning": True, "format": "fp8_e4m3"},
            inherits={"start_bits": 4, "target_bits": 4},
        )
    )
    own, inherits = (g.settings for g in cfg.compression.weight_quantization.groups)
    assert (own.observer, own.range_learning, own.format) == ("minmax", True, "fp8_e4m3")
    assert own.at("observer") == "different_groups.own.params.observer"
    assert own.at("format") == "different_groups.own.params.format"
    # not set by the group: shared_parameters' value, or its default
    assert (inherits.observer, inherits.observer_kwargs.grid) == ("mse", 50)
    assert (inherits.range_learning, inherits.format) == (False, "int")
    assert inherits.at("observer") == "shared_parameters.observer"
    assert inherits.at("range_learning") == "shared_parameters.range_learning"
    assert not inherits.own_observer_kwargs
    # the group's observer_kwargs replace the shared ones whole (no key-by-key merge)
    cfg = qc.load_config(
        _wq(
            {"observer": "mse", "observer_kwargs": {"grid": 50}},
            g={"start_bits": 8, "target_bits": 8, "observer_kwargs": {"maxshrink": 0.5}},
        )
    )
    s = cfg.compression.weight_quantization.groups[0].settings
    assert s.own_observer_kwargs and s.observer_kwargs == ObserverKwargs(maxshrink=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.observer = "mse"


def test_weight_schedule_and_shared_keys_are_carried():
    cfg = qc.load_config(
        _wq(
            {
                "schedule_offset": 7,
                "quantization_type": "asymmetric",
                "rounding": "stochastic",
                "seed": 3,
                "ste": "clip",
            },
            g={
                "start_bits": 8,
                "target_bits": 4,
                "quantization_period": 30,
                "period_growth": "linear",
                "granularity": "channel",
            },
        )
    )
    s = cfg.compression.weight_quantization.groups[0].settings
    assert (s.start_bits, s.target_bits, s.period, s.growth, s.offset) == (8, 4, 30, "linear", 7)
    assert (s.symmetric, s.quantization_type, s.rounding, s.clip_grad) == (False, "asymmetric", "stochastic", True)
    assert s.seed_of("fc") != s.seed_of("fc2")  # one stream per module under stochastic rounding


@pytest.mark.parametrize(
    "params, shared, vocab, want",
    [
        ({}, {}, False, ("tensor", None, None)),
        ({}, {}, True, ("channel", None, None)),  # an Embedding: one group per row
        ({}, {"quantize_groups": 4}, False, ("groups", None, 4)),
        ({}, {"quantize_groups": 4}, True, ("channel", None, None)),
        ({"granularity": "channel"}, {"quantize_groups": 4}, False, ("channel", None, None)),
        ({"group_size": 32}, {}, True, ("group", 32, None)),  # group_size alone means granularity group
    ],
)
def test_integer_granularity_on_a_module(params, shared, vocab, want):
    cfg = qc.load_config(_wq(shared, g={"start_bits": 8, "target_bits": 8, **params}))
    assert cfg.compression.weight_quantization.groups[0].settings.granularity_at(vocab) == want


@pytest.mark.parametrize(
    "fmt, bits, params, want",
    [
        ("nvfp4", 4, {}, ("group", 16)),  # the format fixes its group size
        ("mxfp8", 8, {}, ("group", 32)),
        ("fp8_e4m3", 8, {}, ("tensor", None)),  # no granularity given: per tensor
        ("fp8_e4m3", 8, {"granularity": "block"}, ("block", None)),
        ({"8": "fp8_e4m3", "4": "nvfp4"}, None, {}, ("group", 16)),
    ],
)
def test_float_formats_fix_their_granularity(fmt, bits, params, want):
    p = {"start_bits": bits or 8, "target_bits": bits or 4, "format": fmt, **params}
    s = qc.load_config(_wq({}, g=p)).compression.weight_quantization.groups[0].settings
    assert (s.granularity, s.group_size) == want
    assert s.granularity_at(True)[:2] == want  # an Embedding too: the format decides


def test_gptq_ranges_come_from_its_scale_observer():
    cfg = qc.load_config(
        _wq(
            {},
            g={
                "start_bits": 4,
                "target_bits": 4,
                "granularity": "channel",
                "observer": "gptq",
                "observer_kwargs": {"scale_observer": "mse", "damp": 0.1},
            },
        )
    )
    s = cfg.compression.weight_quantization.groups[0].settings
    assert (s.solver, s.range_observer) == ("gptq", "mse")
    assert s.solver_kwargs == (0.1, 128, True, True)  # damp, block_size, act_order, sequential


def test_activation_groups():
    doc = {
        "compression_training": {
            "activation_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "range_calibration": "static",
                    "momentum": 0.9,
                    "observer": "mse",
                },
                "different_groups": {
                    "a": {"params": {"bits": 8}, "modules": ["fc"]},
                    "f": {"params": {"bits": 4, "format": "nvfp4", "observer": "minmax"}, "modules": ["x"]},
                },
            }
        }
    }
    a, f = (g.settings for g in qc.load_config(doc).compression.activation_quantization.groups)
    assert (a.bits, a.calibration, a.momentum, a.observer, a.at("observer")) == (
        8,
        "static",
        0.9,
        "mse",
        "shared_parameters.observer",
    )
    assert (f.format, f.group_size, f.float_group_size) == ("nvfp4", None, 16)
    assert f.at("observer") == "different_groups.f.params.observer"


def test_the_modules_quantize_with_their_groups_settings():
    """init_compression copies the resolved values into each module's WeightQuant / ActQuant."""
    doc = _wq(
        {"observer": "mse", "schedule_offset": 2},
        g={"start_bits": 8, "target_bits": 4, "quantization_period": 5, "group_size": 16},
        modules=["0"],
    )
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 3},
        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["0"]}},
    }
    cfg = qc.load_config(doc)
    model = qc.init_compression(nn.Sequential(nn.Linear(32, 8)), cfg)
    s = cfg.compression.weight_quantization.groups[0].settings
    a = cfg.compression.activation_quantization.groups[0].settings
    wq, aq = model[0].qc_wq, model[0].qc_aq
    assert (wq.start_bits, wq.target_bits, wq.period, wq.offset) == (s.start_bits, s.target_bits, s.period, s.offset)
    assert (wq.start_bits, wq.target_bits, wq.period, wq.offset) == (8, 4, 5, 2)
    assert (wq.granularity, wq.group_size, wq.range_observer, wq.format) == ("group", 16, "mse", "int")
    assert (aq.bits, aq.offset, aq.calibration, aq.range_observer) == (a.bits, a.offset, a.calibration, a.observer)
    assert (aq.bits, aq.offset, aq.calibration, aq.range_observer) == (8, 3, "dynamic", "minmax")
