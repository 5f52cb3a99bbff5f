"""Independent loaders read our exports: compressed-tensors validates the quantization_config
and its own decompressors reproduce effective_weight() bit for bit; transformers loads a BERT
export through its compressed-tensors quantizer with logits identical to load_quantized's."""

import json
import re
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import qcompress
from qcompress.export import export_quantized, load_quantized

ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_comp = pytest.importorskip("compressed_tensors.compressors")


def cfg_for(bits, symmetric, granularity, group_size=None, modules=(".",), act=None):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False, "granularity": granularity}
    if group_size:
        params["group_size"] = group_size
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "symmetric" if symmetric else "asymmetric",
                },
                "different_groups": {"wq1": {"params": params, "modules": list(modules)}},
            }
        }
    }
    if act:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": act[0],
                "quantization_type": "symmetric" if act[1] else "asymmetric",
            },
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": list(modules)}},
        }
    return qcompress.load_config(doc)


CASES = [
    (8, True, "channel", None, None),
    (8, False, "tensor", None, ("static", False)),
    (8, True, "channel", None, ("dynamic", True)),
    (4, True, "group", 32, None),
    (4, False, "group", 64, None),
    (4, True, "channel", None, None),
    (2, False, "group", 128, None),
    (4, False, "tensor", None, None),
]


@pytest.mark.parametrize("bits,sym,gran,gs,act", CASES)
def test_compressed_tensors_validates_and_decompresses(tmp_path, bits, sym, gran, gs, act):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))
    cfg = cfg_for(bits, sym, gran, gs, act=act)
    qcompress.init_compression(m, cfg)
    m.train()
    m(torch.randn(4, 256))
    m.eval()
    export_quantized(m, tmp_path / "out", cfg)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = ct_quant.QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.quantization_status == "compressed"
    fmt = "int-quantized" if bits == 8 else "pack-quantized"
    assert qc.format == fmt
    sd = load_file(tmp_path / "out" / "model.safetensors")
    comp = ct_comp.BaseCompressor.get_value_from_registry(fmt)
    for idx in ("0", "2"):
        scheme = next(s for s in qc.config_groups.values() if any(re.match(t[3:], idx) for t in s.targets))
        local = {k[len(idx) + 1 :]: v for k, v in sd.items() if k.startswith(idx + ".")}
        names = set(comp.compression_param_names(scheme))
        assert names <= set(local), (names, set(local))
        dense = comp.decompress({k: local[k] for k in names}, scheme)["weight"]
        assert dense.dtype == torch.float32
        assert torch.equal(dense, m[int(idx)].effective_weight()), idx
        # CT's own compressor, fed the dense weight and our scales, gives our integers back
        if fmt == "pack-quantized" and sym:
            again = comp.compress({"weight": dense, "weight_scale": local["weight_scale"]}, scheme)
            assert torch.equal(again["weight_packed"], local["weight_packed"])
        if act and act[0] == "static":
            assert "input_scale" in local and scheme.input_activations.strategy == "tensor"


@pytest.mark.parametrize("symmetric", [True, False])
def test_transformers_bert_reload_identical_logits(tmp_path, symmetric):
    pytest.importorskip("transformers")
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
        CompressedTensorsConfig,
    )

    torch.manual_seed(0)
    conf = BertConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = BertForSequenceClassification(conf).eval()
    cfg = cfg_for(4, symmetric, "group", 32, modules=("encoder", "pooler"))
    qcompress.init_compression(model, cfg)
    ids = torch.randint(0, 99, (2, 11))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    qcompress.redundancy_clean(model, cfg)
    export_quantized(model, tmp_path / "bert", cfg)
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    assert config["model_type"] == "bert" and config["quantization_config"]["ignore"] == ["classifier"]
    hf = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "bert", quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    ours = load_quantized(tmp_path / "bert", BertForSequenceClassification(conf).eval())
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits
        our_logits = ours(input_ids=ids).logits
    assert torch.equal(hf_logits, our_logits)
    assert torch.equal(our_logits, trained)
    q = ours.bert.encoder.layer[0].attention.self.query
    assert q.weight_packed.dtype == torch.int32 and "weight" not in dict(q.named_parameters())


def test_gpt2_conv1d_and_stochastic_rounding(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    conf = GPT2Config(vocab_size=50, n_positions=16, n_embd=64, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(conf).eval()
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {
                        "enabled": True,
                        "quantize_weight_in_forward": True,
                        "rounding": "stochastic",
                        "seed": 3,
                    },
                    "different_groups": {
                        "wq1": {
                            "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 32},
                            "modules": ["attn", "mlp"],
                        }
                    },
                }
            }
        }
    )
    qcompress.init_compression(model, cfg)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    export_quantized(model, tmp_path / "gpt2", cfg)
    rec = json.loads((tmp_path / "gpt2" / "config.json").read_text())["qcompress"]["modules"]
    assert rec["transformer.h.0.mlp.c_fc"]["transposed"] is True
    assert rec["transformer.h.0.mlp.c_fc"]["weight_shape"] == [256, 64]  # [out, in]
    ours = load_quantized(tmp_path / "gpt2", GPT2LMHeadModel(conf).eval())
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref)


def test_transformers_w4_bert_with_an_activation_only_linear(tmp_path):
    # config_groups are written sorted and transformers 5.x decompresses every Linear with the
    # first group's scheme: the activation-only group ("aq1" < "wq1") must not come first
    pytest.importorskip("transformers")
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
        CompressedTensorsConfig,
    )

    torch.manual_seed(0)
    conf = BertConfig(
        vocab_size=99,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = BertForSequenceClassification(conf).eval()
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "wq1": {
                            "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 128},
                            "modules": ["encoder"],
                        }
                    },
                },
                "activation_quantization": {
                    "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
                    "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["pooler"]}},
                },
            }
        }
    )
    qcompress.init_compression(model, cfg)
    ids = torch.randint(0, 99, (2, 11))
    pooler = model.bert.pooler.dense
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        pooler.qc_aq.active = False
        trained_dense_pooler = model(input_ids=ids).logits
        pooler.qc_aq.active = True
    assert not torch.equal(trained, trained_dense_pooler)
    export_quantized(model, tmp_path / "bert", cfg)
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    groups = list(config["quantization_config"]["config_groups"].values())
    assert [g["format"] for g in groups] == ["pack-quantized", "dense"]
    hf = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "bert", quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    ours = load_quantized(tmp_path / "bert", BertForSequenceClassification(conf).eval())
    hf_sd = hf.state_dict()
    linears = [(n, m) for n, m in ours.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8
    for name, mod in linears:
        assert torch.equal(hf_sd[name + ".weight"], mod.weight), name
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits
        our_logits = ours(input_ids=ids).logits
    assert torch.equal(our_logits, trained)
    # transformers' dequantize path (run_compressed=False) runs activations unquantized
    assert torch.equal(hf_logits, trained_dense_pooler)


def _two_group_net(first, second):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    groups = {"a": {"params": dict(first), "modules": ["^0$"]}, "b": {"params": dict(second), "modules": ["^2$"]}}
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": groups,
                }
            }
        }
    )
    qcompress.init_compression(m, cfg)
    return m, cfg


W8 = {"start_bits": 8, "target_bits": 8, "granularity": "channel"}
W4 = {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 32}
W2 = {"start_bits": 2, "target_bits": 2, "granularity": "group", "group_size": 32}


@pytest.mark.parametrize(
    "first,second,message",
    [
        (W8, W4, "transformers.*cannot load checkpoints that mix int-quantized and pack-quantized"),
        (W2, W4, "transformers.*first config group's weight scheme.*2 different"),
    ],
)
def test_export_warns_about_mixed_weight_schemes(tmp_path, first, second, message):
    m, cfg = _two_group_net(first, second)
    with pytest.warns(UserWarning, match=message):
        export_quantized(m, tmp_path / "out", cfg)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    ct_quant.QuantizationConfig.model_validate(qc)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "out", _two_group_net(first, second)[0])(x), m(x))
    m, cfg = _two_group_net(W4, W4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_quantized(m, tmp_path / "same", cfg)
