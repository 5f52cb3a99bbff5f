"""What an export says of its model and what load_quantized gives back: config.json names the
exported class (not the base checkpoint's), and load_quantized returns an eval-mode model."""

import json

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.export import export_quantized, load_quantized

CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                    "modules": ["0", "2"],
                }
            },
        }
    }
}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.5), nn.Linear(16, 4))


def test_config_json_names_the_exported_class_not_the_base_checkpoints(tmp_path):
    hf = pytest.importorskip("tests.helpers.hf_fixtures", reason="transformers is not installed")
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = hf.tiny_bert_folder(str(tmp_path / "base"))  # saved as a plain BertModel
    assert json.loads((tmp_path / "base" / "config.json").read_text())["architectures"] == ["BertModel"]
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3)
    assert model.config.architectures == ["BertModel"]  # what the old export copied
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["encoder"]}
                    },
                }
            }
        }
    )
    qcompress.init_compression(model, cfg)
    qcompress.redundancy_clean(model, cfg)
    export_quantized(model, tmp_path / "out", cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["BertForSequenceClassification"]
    assert AutoConfig.from_pretrained(tmp_path / "out").architectures == ["BertForSequenceClassification"]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_load_quantized_returns_an_eval_mode_model(tmp_path, mode):
    cfg = qcompress.load_config(CFG)
    model = qcompress.init_compression(_net(), cfg)
    qcompress.redundancy_clean(model, cfg)
    export_quantized(model, tmp_path / "out", cfg)
    fresh = _net().train()
    loaded = load_quantized(tmp_path / "out", fresh, mode=mode)
    assert loaded is fresh and not any(m.training for m in loaded.modules())
    x = torch.randn(4, 32)
    with torch.no_grad():  # dropout off: two calls agree, and equal the eval model
        assert torch.equal(loaded(x), loaded(x))
        if mode == "exact":
            assert torch.equal(loaded(x), model.eval()(x))
