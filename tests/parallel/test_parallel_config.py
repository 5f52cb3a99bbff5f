"""The tensor_parallel and pipeline sections: parsing, the mesh sizes, and the ConfigErrors
naming the key for sizes the world or the model cannot take (single process)."""

import warnings

import pytest
import torch.nn as nn

import qcompress as qc
from qcompress import ConfigError
from qcompress.config.parallel import MeshShape, check_model_sizes, mesh_shape
from qcompress.nn.sharded import check_split
from qcompress.parallel import resolve_plan

from tests.helpers import parallel_workers as pw


def test_sections_parse_with_deepspeed_defaults():
    cfg = qc.load_config(
        {"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": "auto", "partition": "parameters"}}
    )
    assert cfg.tensor_parallel.autotp_size == 2 and cfg.tensor_parallel.tp_plan is None
    assert (cfg.pipeline.stages, cfg.pipeline.partition, cfg.pipeline.schedule) == (1, "parameters", "1f1b")
    assert qc.load_config({}).tensor_parallel.autotp_size == 1


@pytest.mark.parametrize(
    "doc, key",
    [
        ({"tensor_parallel": {"autotp_size": 0}}, "tensor_parallel.autotp_size"),
        ({"tensor_parallel": {"tp_plan": {"fc": "diagonal"}}}, "tensor_parallel.tp_plan.fc"),
        ({"pipeline": {"stages": -1}}, "pipeline.stages"),
        ({"pipeline": {"stagse": 2}}, "pipeline.stagse"),
        ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
    ],
)
def test_bad_values_name_the_key(doc, key):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + ": "):
        qc.load_config(doc)


def test_pipeline_keys_without_effect_warn_by_name():
    with pytest.warns(UserWarning, match=r"'pipeline\.seed_layers' is a DeepSpeed setting with no effect"):
        qc.load_config({"pipeline": {"seed_layers": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qc.load_config({"pipeline": {"stages": 1, "seed_layers": False}})  # DeepSpeed's default: silent


def test_mesh_sizes_follow_deepspeed():
    assert mesh_shape(2, 1, 4) == MeshShape(pp=1, dp=2, tp=2)
    assert mesh_shape(2, 2, 8).as_dict() == {"pp": 2, "dp": 2, "tp": 2}
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.autotp_size: 3 does not divide the world size 4"):
        mesh_shape(3, 1, 4)
    with pytest.raises(ConfigError, match=r"^pipeline\.stages: .* does not divide the world size 6"):
        mesh_shape(2, 2, 6)


def test_model_sizes_the_split_cannot_take():
    check_model_sizes(2, 2, heads=4, kv_heads=2, hidden=64, blocks=2)
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.autotp_size: 3 does not divide the model's 4 attention"):
        check_model_sizes(3, 1, heads=4, kv_heads=4, hidden=48, blocks=2)
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.autotp_size: 4 does not divide the model's 2 key/value"):
        check_model_sizes(4, 1, heads=4, kv_heads=2, hidden=64, blocks=2)
    with pytest.raises(ConfigError, match=r"^pipeline\.stages: 3 stages but the model has 2 transformer blocks"):
        check_model_sizes(1, 3, heads=4, kv_heads=2, hidden=64, blocks=2)


def test_initialize_refuses_a_mesh_larger_than_the_world():
    model = pw.tiny_llama()
    doc = {
        "train_batch_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": 2},
    }
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.autotp_size: 2 does not divide the world size 1"):
        qc.initialize(model, doc)


def test_plans_from_the_model_and_from_the_config():
    model = pw.tiny_llama()
    plan = resolve_plan(model, qc.load_config({}).tensor_parallel)
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(plan) == 2 * 7 and "lm_head" not in plan  # transformers' base plan: 7 per block
    mlp_plan = resolve_plan(pw.MLP(), qc.load_config(pw.MLP_PLAN).tensor_parallel)
    assert mlp_plan == {"fc1": "colwise", "fc2": "rowwise"}
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.tp_plan: .*matches no module"):
        resolve_plan(pw.MLP(), qc.load_config({"tensor_parallel": {"tp_plan": {"proj$": "colwise"}}}).tensor_parallel)
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.tp_plan: Sequential has no base_model_tp_plan"):
        resolve_plan(nn.Sequential(nn.Linear(2, 2)), qc.load_config({}).tensor_parallel)


def _quantized_mlp(**kw):
    cfg = qc.load_config({"compression_training": pw.compression(**kw)})
    model = qc.init_compression(pw.MLP(), cfg)
    return model.fc2.qc_wq, model.fc2.qc_aq


PATH = "compression_training.weight_quantization.different_groups.wq.params"


def test_quantizers_a_split_cannot_keep_exact_are_refused_before_training():
    wq, aq = _quantized_mlp(bits=4, granularity="group", group_size=48)
    with pytest.raises(
        ConfigError,
        match=r"group_size: 48: module 'fc2' is row-parallel over 2 ranks, 64 "
        r"input columns each; a group would cross a shard boundary",
    ):
        check_split("fc2", wq, aq, "rowwise", 128, 2, PATH)
    check_split("fc2", wq, aq, "colwise", 128, 2, PATH)  # column-parallel: groups stay on their rows
    wq, aq = _quantized_mlp(bits=4, granularity="group", group_size=32)
    check_split("fc2", wq, aq, "rowwise", 128, 2, PATH)
    cfg = pw.compression(bits=8)
    cfg["weight_quantization"]["shared_parameters"]["quantize_weight_in_forward"] = False
    model = qc.init_compression(pw.MLP(), qc.load_config({"compression_training": cfg}))
    with pytest.raises(ConfigError, match=r"quantize_weight_in_forward: module 'fc2' is rowwise-parallel"):
        check_split("fc2", model.fc2.qc_wq, None, "rowwise", 128, 2, PATH)
    cfg = pw.compression(bits=8)
    cfg["weight_quantization"]["shared_parameters"]["rounding"] = "stochastic"
    model = qc.init_compression(pw.MLP(), qc.load_config({"compression_training": cfg}))
    with pytest.raises(ConfigError, match=r"stochastic rounding draws its noise by element index"):
        check_split("fc1", model.fc1.qc_wq, None, "colwise", 64, 2, PATH)


def test_pipeline_partitions():
    from qcompress.parallel.pipeline import split_blocks

    assert split_blocks([1] * 4, 2, "uniform") == [(0, 2), (2, 4)]
    assert split_blocks([1] * 5, 3, "uniform") == [(0, 2), (2, 3), (3, 5)]
    # by parameter count: a heavy first block is a stage of its own
    assert split_blocks([4, 1, 1, 1, 1], 2, "parameters") == [(0, 1), (1, 5)]
    assert split_blocks([1, 1, 1, 1, 8], 2, "best") == [(0, 4), (4, 5)]
    assert split_blocks([9, 1, 1], 3, "parameters") == [(0, 1), (1, 2), (2, 3)]  # one block each at least
    with pytest.raises(ConfigError, match=r"^pipeline\.stages: 3 stages but the model has 2 transformer blocks"):
        split_blocks([1, 1], 3, "uniform")


def test_float_formats_on_a_split_layer_are_refused():
    cfg = pw.compression(bits=8)
    cfg["weight_quantization"]["shared_parameters"]["format"] = "fp8_e4m3"
    model = qc.init_compression(pw.MLP(), qc.load_config({"compression_training": cfg}))
    with pytest.raises(
        ConfigError,
        match=r"^compression_training\.weight_quantization\.different_groups\.wq\.params: "
        r"module 'fc1' is colwise-parallel: float formats",
    ):
        check_split("fc1", model.fc1.qc_wq, None, "colwise", 64, 2, PATH)
