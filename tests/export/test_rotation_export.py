"""A rotated model's export: R4 as compressed-tensors' transform_config, read back by
compressed-tensors (and transformers + apply_transform_config) with the logits load_quantized
gives, which equal the trained model's; an untied head stays untied on every reload."""

import copy
import json
import os
import warnings

import pytest
import torch

import qcompress as qc
from tests.helpers.rotation_fixtures import logits, make_dense, make_moe_model, rotation_doc, tokens, transformers

ct = pytest.importorskip("compressed_tensors.transform", reason="compressed-tensors is not installed")
from safetensors.torch import load_file  # noqa: E402

from qcompress.export.hf_compat import dequantize_config  # noqa: E402
from qcompress.export.rotations import apply_to_transformers  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def w4_doc(rotations=("R1", "R2", "R4"), act=False, **rot):
    doc = rotation_doc(rotations, **rot)
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {
            "w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 32}, "modules": ["layers"]}
        },
    }
    if act:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": 8}, "modules": ["layers"]}},
        }
    return doc


def _model(**kw):
    # hidden 64, MLP 96 = 3 x 32: whole groups of 32 (transformers loads them), R4 block 32 < 96
    return make_dense("llama", hidden=64, heads=4, kv=2, head_dim=16, inter=96, **kw)


def _export(tmp_path, model, doc, name="out"):
    fresh = copy.deepcopy(model)
    qc.init_compression(model, doc)
    out = str(tmp_path / name)
    qc.export_quantized(model, out)
    return fresh, out


def test_r4_export_reads_back_in_compressed_tensors_and_transformers_with_load_quantized_logits(tmp_path):
    model = _model()
    fresh, out = _export(tmp_path, model, w4_doc())
    ids = tokens(64)
    trained = logits(model, ids)
    loaded = qc.load_quantized(out, fresh)
    assert torch.equal(logits(loaded, ids), trained)
    assert isinstance(loaded.model.layers[0].mlp.down_proj.R4_input, torch.nn.Module)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] is False
    assert config["qcompress"]["rotation"]["untied"] == {"head": "lm_head", "embedding": "model.embed_tokens"}
    tc = ct.TransformConfig.model_validate(config["quantization_config"]["transform_config"])
    scheme = tc.config_groups["R4"]
    assert scheme.type == "hadamard" and scheme.head_dim == 32 and not scheme.randomize
    assert [a.location for a in scheme.apply] == ["input"]
    assert scheme.apply[0].targets == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    stored = load_file(os.path.join(out, "model.safetensors"))
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    for i in range(2):  # unnormalized, as compressed-tensors and vLLM store it
        assert torch.equal(
            stored[f"model.layers.{i}.mlp.down_proj.R4_input.weight"], deterministic_hadamard_matrix(32, torch.float32)
        )
    # transformers drops transform_config; compressed-tensors' own apply_transform_config restores R4
    for kwargs in ({}, {"quantization_config": dequantize_config()}):
        tm = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kwargs).eval()
        without = logits(tm, ids)
        ct.apply_transform_config(tm, tc)
        assert torch.allclose(logits(tm, ids), logits(loaded, ids), atol=1e-6, rtol=0)
        assert not torch.allclose(without, logits(loaded, ids), atol=1e-3)


def test_random_hadamard_blocks_come_from_the_stored_tensors(tmp_path):
    model = _model(seed=3)
    fresh, out = _export(tmp_path, model, w4_doc(type="random-hadamard", seed=11))
    ids = tokens(64)
    loaded = qc.load_quantized(out, fresh)
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["transform_config"]["config_groups"]["R4"]["type"] == "random-hadamard"
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=dequantize_config()
    ).eval()
    apply_to_transformers(tm, out)
    assert torch.allclose(logits(tm, ids), logits(loaded, ids), atol=1e-6, rtol=0)
    tm2 = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=dequantize_config()
    ).eval()
    apply_to_transformers(tm2, out, load_stored=False)  # compressed-tensors draws its own signs
    assert not torch.allclose(logits(tm2, ids), logits(loaded, ids), atol=1e-3)


def test_w4a8_export_with_rotations_reloads_exactly(tmp_path):
    model = _model()
    fresh, out = _export(tmp_path, model, w4_doc(act=True))
    ids = tokens(64)
    assert torch.equal(logits(qc.load_quantized(out, fresh), ids), logits(model, ids))


def test_tied_head_kept_tied_reloads_tied(tmp_path):
    model = _model()
    with torch.no_grad():
        model.model.norm.weight.fill_(1)
    fresh, out = _export(tmp_path, model, w4_doc(["R1", "R2"]))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] is True and config["quantization_config"]["transform_config"] == {}
    loaded = qc.load_quantized(out, fresh)
    ids = tokens(64)
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=dequantize_config()
    ).eval()
    assert torch.allclose(logits(tm, ids), logits(loaded, ids), atol=1e-5, rtol=0)


def test_moe_export_with_rotated_experts_reloads_exactly(tmp_path):
    model = make_moe_model("qwen3_moe")
    doc = rotation_doc(["R1", "R2"])
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {
            "e": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 16}, "modules": [r"mlp\.experts"]}
        },
    }
    fresh, out = _export(tmp_path, model, doc)
    ids = tokens(model.config.vocab_size)
    assert torch.equal(logits(qc.load_quantized(out, fresh), ids), logits(model, ids))
