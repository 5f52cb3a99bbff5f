"""Config loading, merging and validation (qcompress.load_config)."""

import copy
import dataclasses
import glob
import json
import os

import pytest

import qcompress
from qcompress import ConfigError, load_config
from tests.helpers.shared_paths import DS_COMPRESSION

DS_CONFIGS = sorted(glob.glob(os.path.join(DS_COMPRESSION, "**", "*.json"), recursive=True))


def _w8(modules=None, **params):
    group = {"params": {"start_bits": 8, "target_bits": 8, **params}}
    if modules is not None:
        group["modules"] = modules
    return {
        "compression_training": {
            "weight_quantization": {"shared_parameters": {"enabled": True}, "different_groups": {"wq1": group}}
        }
    }


def test_six_deepspeed_configs_load():
    assert len(DS_CONFIGS) == 6, DS_CONFIGS
    for path in DS_CONFIGS:
        with open(path) as fh:
            raw = json.load(fh)
        before = copy.deepcopy(raw)
        cfg = load_config(path)
        cfg2 = load_config(raw)
        assert raw == before  # input not mutated
        assert cfg.compression == cfg2.compression
        wq = raw["compression_training"].get("weight_quantization")
        ours = cfg.compression.weight_quantization
        if wq:
            sh = wq["shared_parameters"]
            assert ours.enabled == sh["enabled"]
            assert ours.shared.quantize_groups == sh["quantize_groups"]
            assert ours.shared.quantize_weight_in_forward == sh["quantize_weight_in_forward"]
            assert ours.shared.fp16_mixed_quantize.quantize_change_ratio == float(
                sh["fp16_mixed_quantize"]["quantize_change_ratio"]
            )
            for g in ours.groups:
                rg = wq["different_groups"][g.name]
                assert g.params.start_bits == rg["params"]["start_bits"]
                assert g.params.target_bits == rg["params"]["target_bits"]
                assert list(g.modules) == rg["modules"]
        assert cfg.fp16.enabled == raw["fp16"]["enabled"]
        assert cfg.train_batch_size == raw["train_batch_size"]


def test_defaults_follow_deepspeed_code():
    cc = load_config({}).compression
    assert cc.activation_quantization.shared.range_calibration == "dynamic"
    assert cc.activation_quantization.shared.schedule_offset == 1000
    assert cc.activation_quantization.shared.momentum == 0.95
    assert cc.weight_quantization.shared.schedule_offset == 0
    assert cc.weight_quantization.shared.fp16_mixed_quantize.quantize_change_ratio == 0.001
    assert cc.sparse_pruning.shared.schedule_offset == 1000
    assert cc.head_pruning.shared.method == "topk"
    assert not any(t.enabled for _, t in cc.techniques())
    g = load_config(_w8(["x"])).compression.weight_quantization.groups[0]
    assert g.params.quantization_period == 1


def test_yaml_and_json_files_and_deep_merge(tmp_path):
    base = {
        "train_batch_size": 32,
        "fp16": {"enabled": True, "loss_scale": 0},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_groups": 4},
                "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["fc"]}},
            }
        },
    }
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "sched.yaml").write_text(
        "fp16:\n  enabled: false\n"
        "compression_training:\n  weight_quantization:\n    different_groups:\n      wq1:\n"
        "        params: {start_bits: 12, target_bits: 4, quantization_period: 10}\n"
    )
    override = {"train_batch_size": 64}
    before = copy.deepcopy(override), copy.deepcopy(base)
    cfg = load_config(str(tmp_path / "base.json"), tmp_path / "sched.yaml", override)
    assert (override, base) == before
    assert cfg.train_batch_size == 64
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale == 0  # sibling key kept
    wq = cfg.compression.weight_quantization
    assert wq.shared.quantize_groups == 4  # kept from base
    p = wq.groups[0].params
    assert (p.start_bits, p.target_bits, p.quantization_period) == (12, 4, 10)
    assert wq.groups[0].modules == ("fc",)  # kept from base
    # a parsed Config can be a source too
    cfg2 = load_config(cfg, {"gradient_clipping": 1.0})
    assert cfg2.gradient_clipping == 1.0 and cfg2.train_batch_size == 64
    # frozen dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train_batch_size = 3


def test_missing_or_all_modules_means_every_module():
    assert load_config(_w8()).compression.weight_quantization.groups[0].modules is None
    assert load_config(_w8("all")).compression.weight_quantization.groups[0].modules is None
    assert load_config(_w8(["all"])).compression.weight_quantization.groups[0].modules is None


def _ct(tech, shared=None, groups=None):
    body = {"shared_parameters": {"enabled": True, **(shared or {})}}
    if groups is not None:
        body["different_groups"] = groups
    return {"compression_training": {tech: body}}


def _wq(params, modules=("fc",), shared=None, **extra):
    return _ct("weight_quantization", shared, {"wq1": {"params": params, "modules": list(modules), **extra}})


WQ = "compression_training.weight_quantization"
AQ = "compression_training.activation_quantization"
OK = {"start_bits": 8, "target_bits": 8}

MISTAKES = [
    # (id, document, expected key path, words the message must contain)
    ("unknown top key", {"train_batch_szie": 8}, "train_batch_szie", "did you mean 'train_batch_size'"),
    (
        "unknown shared key",
        _wq(OK, shared={"quantize_group": 4}),
        f"{WQ}.shared_parameters.quantize_group",
        "did you mean 'quantize_groups'",
    ),
    ("unknown group key", _wq(OK, modulez=["x"]), f"{WQ}.different_groups.wq1.modulez", "did you mean 'modules'"),
    (
        "unknown technique key",
        {"compression_training": {"weight_quantisation": {}}},
        "compression_training.weight_quantisation",
        "did you mean 'weight_quantization'",
    ),
    (
        "unknown params key",
        _wq({**OK, "start_bit": 8}),
        f"{WQ}.different_groups.wq1.params.start_bit",
        "did you mean 'start_bits'",
    ),
    (
        "string for bool",
        _wq(OK, shared={"quantize_weight_in_forward": "yes"}),
        f"{WQ}.shared_parameters.quantize_weight_in_forward",
        "true or false",
    ),
    ("string for int", {"train_batch_size": "32"}, "train_batch_size", "integer"),
    (
        "float for int bits",
        _wq({"start_bits": 8.5, "target_bits": 8}),
        f"{WQ}.different_groups.wq1.params.start_bits",
        "integer",
    ),
    (
        "bits out of range",
        _wq({"start_bits": 17, "target_bits": 8}),
        f"{WQ}.different_groups.wq1.params.start_bits",
        "<= 16",
    ),
    ("negative offset", _wq(OK, shared={"schedule_offset": -1}), f"{WQ}.shared_parameters.schedule_offset", ">= 0"),
    ("quantize_groups 0", _wq(OK, shared={"quantize_groups": 0}), f"{WQ}.shared_parameters.quantize_groups", ">= 1"),
    (
        "bad quantization_type",
        _wq(OK, shared={"quantization_type": "symetric"}),
        f"{WQ}.shared_parameters.quantization_type",
        "did you mean 'symmetric'",
    ),
    ("bad rounding", _wq(OK, shared={"rounding": "floor"}), f"{WQ}.shared_parameters.rounding", "nearest"),
    (
        "bad range_calibration",
        _ct(
            "activation_quantization",
            {"range_calibration": "minmax"},
            {"aq1": {"params": {"bits": 8}, "modules": ["fc"]}},
        ),
        f"{AQ}.shared_parameters.range_calibration",
        "dynamic",
    ),
    (
        "target above start",
        _wq({"start_bits": 4, "target_bits": 8}),
        f"{WQ}.different_groups.wq1.params.target_bits",
        "start_bits",
    ),
    (
        "group_size without group granularity",
        _wq({**OK, "granularity": "channel", "group_size": 64}),
        f"{WQ}.different_groups.wq1.params.group_size",
        "granularity",
    ),
    (
        "group granularity without size",
        _wq({**OK, "granularity": "group"}),
        f"{WQ}.different_groups.wq1.params.group_size",
        "required",
    ),
    ("missing start_bits", _wq({"target_bits": 8}), f"{WQ}.different_groups.wq1.params.start_bits", "required"),
    (
        "missing act bits",
        _ct("activation_quantization", None, {"aq1": {"params": {}, "modules": ["fc"]}}),
        f"{AQ}.different_groups.aq1.params.bits",
        "required",
    ),
    (
        "act bits 1",
        _ct("activation_quantization", None, {"aq1": {"params": {"bits": 1}, "modules": ["fc"]}}),
        f"{AQ}.different_groups.aq1.params.bits",
        ">= 2",
    ),
    (
        "missing dense_ratio",
        _ct("sparse_pruning", None, {"sp1": {"params": {}, "modules": ["fc"]}}),
        "compression_training.sparse_pruning.different_groups.sp1.params.dense_ratio",
        "required",
    ),
    (
        "dense_ratio above 1",
        _ct("row_pruning", None, {"rp1": {"params": {"dense_ratio": 1.5}, "modules": ["fc"]}}),
        "compression_training.row_pruning.different_groups.rp1.params.dense_ratio",
        "<= 1",
    ),
    (
        "missing num_heads",
        _ct("head_pruning", None, {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["o"]}}),
        "compression_training.head_pruning.shared_parameters.num_heads",
        "required",
    ),
    ("missing different_groups", _ct("weight_quantization"), f"{WQ}.different_groups", "required"),
    (
        "related_modules length",
        _ct(
            "row_pruning",
            None,
            {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["a", "b"], "related_modules": [["c"]]}},
        ),
        "compression_training.row_pruning.different_groups.rp1.related_modules",
        "lengths must match",
    ),
    ("bad regex", _wq(OK, modules=["fc", "layer.(1"]), f"{WQ}.different_groups.wq1.modules[1]", "not a valid regex"),
    ("modules not a list", _wq(OK, modules=[3]), f"{WQ}.different_groups.wq1.modules[0]", "regex string"),
    ("fp16 and bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "both"),
    (
        "offload with stage 0",
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.stage",
        "stage",
    ),
    ("zero stage 4", {"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "[0, 1, 2, 3]"),
    ("bad optimizer", {"optimizer": {"type": "Adamm", "params": {}}}, "optimizer.type", "did you mean 'adam'"),
    ("bad scheduler", {"scheduler": {"type": "CosineLR"}}, "scheduler.type", "WarmupLR"),
    ("optimizer without type", {"optimizer": {"params": {"lr": 1}}}, "optimizer.type", "required"),
    (
        "teacher_layer mismatch",
        {
            "compression_training": {
                "layer_reduction": {
                    "enabled": True,
                    "keep_number_layer": 3,
                    "module_name_prefix": "bert.encoder.layer",
                    "teacher_layer": [1, 3],
                }
            }
        },
        "compression_training.layer_reduction.keep_number_layer",
        "teacher_layer",
    ),
    (
        "layer_reduction without prefix",
        {"compression_training": {"layer_reduction": {"enabled": True, "teacher_layer": [1, 3]}}},
        "compression_training.layer_reduction.module_name_prefix",
        "required",
    ),
    (
        "snip end before offset",
        _ct("sparse_pruning", {"method": "snip_momentum", "schedule_offset": 100, "schedule_offset_end": 50}),
        "compression_training.sparse_pruning.shared_parameters.schedule_offset_end",
        "before",
    ),
    (
        "bad block pattern",
        _ct("sparse_pruning", {"method": "snip_momentum", "block_pattern": "4by1"}),
        "compression_training.sparse_pruning.shared_parameters.block_pattern",
        "NxM",
    ),
    (
        "change ratio 0",
        _wq(OK, shared={"fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0}}),
        f"{WQ}.shared_parameters.fp16_mixed_quantize.quantize_change_ratio",
        "> 0",
    ),
    (
        "momentum 1",
        _ct("activation_quantization", {"momentum": 1.0}, {"aq1": {"params": {"bits": 8}, "modules": ["fc"]}}),
        f"{AQ}.shared_parameters.momentum",
        "< 1",
    ),
    ("groups not a mapping", _ct("weight_quantization", None, ["wq1"]), f"{WQ}.different_groups", "mapping"),
    (
        "bad period_growth",
        _wq({**OK, "period_growth": "quadratic"}),
        f"{WQ}.different_groups.wq1.params.period_growth",
        "exponential",
    ),
]


@pytest.mark.parametrize("doc,path,words", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_config_mistakes_raise_with_key_path(doc, path, words):
    before = copy.deepcopy(doc)
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.path == path, str(info.value)
    msg = str(info.value)
    assert msg.startswith(path + ":")
    assert words.lower() in msg.lower(), msg
    assert doc == before


def test_at_least_twenty_distinct_mistakes():
    assert len({m[2] for m in MISTAKES}) >= 20


def test_message_names_bad_value_and_allowed():
    with pytest.raises(ConfigError) as info:
        load_config(_wq(OK, shared={"quantization_type": "symetric"}))
    assert "'symetric'" in str(info.value) and "asymmetric" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 0})
    assert "0" in str(info.value) and ">= 1" in str(info.value)


def test_duplicate_keys_in_files(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    assert info.value.path == str(p) and "duplicate key 'train_batch_size'" in str(info.value)
    p = tmp_path / "dup.yaml"
    p.write_text("fp16:\n  enabled: true\n  enabled: false\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    assert info.value.path == str(p) and "duplicate key 'enabled'" in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in info.value.path
    p = tmp_path / "bad.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(p))
    p = tmp_path / "typo.yaml"
    p.write_text("train_batch_size: -3\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    assert info.value.path == "train_batch_size" and "typo.yaml" in str(info.value)
    p = tmp_path / "evil.yaml"
    p.write_text("a: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError):
        load_config(str(p))
    with pytest.raises(ConfigError):
        load_config(42)
    with pytest.raises(ConfigError):
        load_config()


def test_case_insensitive_choices_and_aliases():
    cfg = load_config(_wq(OK, shared={"quantization_type": "Asymmetric"}))
    assert cfg.compression.weight_quantization.shared.quantization_type == "asymmetric"
    assert load_config({"optimizer": {"type": "AdamW"}}).optimizer.type == "AdamW"
    assert load_config({"bfloat16": {"enabled": True}}).precision == "bf16"


def test_snip_momentum_is_refused_at_load():
    # DeepSpeed needs no groups for it, so without this check it would load and do nothing
    with pytest.raises(ConfigError, match=r"sparse_pruning\.shared_parameters\.method.*Neural Compressor"):
        load_config(_ct("sparse_pruning", {"method": "snip_momentum"}))


def test_config_error_is_value_error():
    assert issubclass(qcompress.ConfigError, ValueError)


def test_group_size_alone_means_group_granularity():
    params = load_config(_wq({**OK, "group_size": 32})).compression.weight_quantization.groups[0].params
    assert (params.granularity, params.group_size) == ("group", 32)
    for gran in ("tensor", "channel"):
        with pytest.raises(ConfigError) as info:
            load_config(_wq({**OK, "granularity": gran, "group_size": 32}))
        assert info.value.path == f"{WQ}.different_groups.wq1.params.group_size"
        assert repr(gran) in str(info.value)


def test_internal_fields_are_not_document_keys():
    from dataclasses import dataclass
    from typing import Any, Dict
    from qcompress.config.schema import field, parse, to_dict

    @dataclass(frozen=True)
    class Doc:
        size: int = field(1)
        raw: Dict[str, Any] = field({}, internal=True)

    with pytest.raises(ConfigError) as info:
        parse(Doc, {"raw": {}})
    assert info.value.path == "raw" and "allowed keys: ['size']" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse(Doc, {"sise": 2})
    assert "'raw'" not in str(info.value)
    assert to_dict(parse(Doc, {"size": 2})) == {"size": 2}


def test_top_level_allowed_keys_do_not_list_raw():
    with pytest.raises(ConfigError) as info:
        load_config({"bogus": 1})
    assert "'raw'" not in str(info.value)


def test_merged_sources_errors_name_the_file(tmp_path):
    base = tmp_path / "ds_config.json"
    base.write_text(json.dumps({"train_batch_size": 8, **_wq(OK)}))
    sched = tmp_path / "schedule.yaml"
    sched.write_text(
        "compression_training:\n  weight_quantization:\n    different_groups:\n"
        "      wq1:\n        params: {start_bits: 8, target_bits: 4, quantisation_period: 3}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(base), str(sched))
    assert info.value.path == f"{WQ}.different_groups.wq1.params.quantisation_period"
    assert "schedule.yaml" in str(info.value) and "ds_config.json" not in str(info.value)
    # a bad value the later file does not override comes from the earlier one
    base.write_text(json.dumps({"train_batch_size": 0, **_wq(OK)}))
    sched.write_text(
        "compression_training:\n  weight_quantization:\n    different_groups:\n"
        "      wq1:\n        params: {start_bits: 8, target_bits: 4}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(base), str(sched))
    assert info.value.path == "train_batch_size"
    assert "ds_config.json" in str(info.value) and "schedule.yaml" not in str(info.value)
    # ... and an overridden one from the later one; dicts are named by position
    with pytest.raises(ConfigError) as info:
        load_config(str(sched), {"train_batch_size": 4}, {"train_batch_size": -1})
    assert "source 3 (a dict)" in str(info.value) and "schedule.yaml" not in str(info.value)


@pytest.mark.parametrize("pattern", ["a{4294967296}", "(" * 2000 + ")" * 2000], ids=["huge_repeat", "deep"])
def test_pld_module_regexes_that_do_not_compile_are_config_errors(pattern):
    """progressive_layer_drop.modules let OverflowError / RecursionError out of re.compile (the
    compression groups' modules already turned them into ConfigErrors)."""
    with pytest.raises(ConfigError, match=r"^progressive_layer_drop\.modules\[0\]: .* is not a valid regex"):
        load_config({"progressive_layer_drop": {"enabled": True, "modules": [pattern]}})
