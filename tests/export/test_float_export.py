"""Float-format exports (float-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized,
mxfp8-quantized): compressed-tensors' own decompressors return the trained effective weights,
load_quantized reloads exactly, transformers loads the same weights or refuses."""

import json
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.export import ExportError, export_quantized, load_quantized

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)"
)
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# name -> (weight params, activation params or None, activation calibration)
PRESETS = {
    "FP8": (
        dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="tensor"),
        dict(bits=8, format="fp8_e4m3"),
        "static",
    ),
    "FP8_DYNAMIC": (
        dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="channel"),
        dict(bits=8, format="fp8_e4m3"),
        "dynamic",
    ),
    "FP8_BLOCK": (
        dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="block"),
        dict(bits=8, format="fp8_e4m3", group_size=32),
        "dynamic",
    ),
    "NVFP4A16": (dict(start_bits=4, target_bits=4, format="nvfp4"), None, None),
    "NVFP4": (dict(start_bits=4, target_bits=4, format="nvfp4"), dict(bits=4, format="nvfp4"), "static"),
    "MXFP4A16": (dict(start_bits=4, target_bits=4, format="mxfp4"), None, None),
    "MXFP4": (dict(start_bits=4, target_bits=4, format="mxfp4"), dict(bits=4, format="mxfp4"), "dynamic"),
    "MXFP8": (dict(start_bits=8, target_bits=8, format="mxfp8"), dict(bits=8, format="mxfp8"), "dynamic"),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def doc_of(name, modules=None):
    wp, ap, calib = PRESETS[name]
    group = {"params": wp, **({"modules": modules} if modules else {})}
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {"w": group},
            }
        }
    }
    if ap:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": calib},
            "different_groups": {"a": {"params": ap, **({"modules": modules} if modules else {})}},
        }
    return doc


def mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 160), nn.ReLU(), nn.Linear(160, 32)).to(dtype)


def trained(model, doc, x):
    cfg = qc.load_config(doc)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    model.train()
    model(x)  # calibrates static ranges
    model.eval()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_round_trip(tmp_path, name, dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    model = trained(mlp(dtype), doc_of(name), x)
    with torch.no_grad():
        want = model(x)
    export_quantized(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qconf = config["quantization_config"]
    (group,) = [g for g in qconf["config_groups"].values()]
    fmt = group["format"]
    assert qconf["format"] == fmt
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"} | {"format": fmt})
    comp = BaseCompressor.get_value_from_registry(fmt)
    for i in (0, 2):
        local = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{i}.")}
        names = set(comp.compression_param_names(scheme))
        assert names <= set(local), (names, sorted(local))
        dense = comp.decompress({k: local[k] for k in names}, scheme)["weight"]
        eff = model[i].effective_weight().detach()
        assert torch.equal(dense, eff.to(dense.dtype)), name
        if dtype == torch.bfloat16 or fmt in ("float-quantized",):
            assert dense.dtype == eff.dtype
    # the tensors vLLM reads, with their dtypes
    dt = {k.split(".", 1)[1]: str(v.dtype) for k, v in tensors.items() if k.startswith("0.")}
    expect = {
        "float-quantized": {"weight": "torch.float8_e4m3fn"},
        "mxfp8-quantized": {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.uint8"},
        "nvfp4-pack-quantized": {
            "weight_packed": "torch.uint8",
            "weight_scale": "torch.float8_e4m3fn",
            "weight_global_scale": "torch.float32",
        },
        "mxfp4-pack-quantized": {"weight_packed": "torch.uint8", "weight_scale": "torch.uint8"},
    }[fmt]
    assert {k: dt.get(k) for k in expect} == expect
    if name == "NVFP4":
        assert "input_global_scale" in dt
    if name == "FP8":
        assert "input_scale" in dt
    back = load_quantized(tmp_path / "out", mlp(dtype))
    with torch.no_grad():
        got = back(x)
    assert torch.equal(got, want), name
    fast = load_quantized(tmp_path / "out", mlp(dtype), mode="fast")
    with torch.no_grad():
        assert torch.equal(fast(x), want), name


def test_nvfp4_dynamic_global_scale_is_refused_by_name(tmp_path):
    doc = doc_of("NVFP4")
    doc["compression_training"]["activation_quantization"]["shared_parameters"]["range_calibration"] = "dynamic"
    model = trained(mlp(torch.float32), doc, torch.randn(2, 64))
    with pytest.raises(ExportError, match="range_calibration: static"):
        export_quantized(model, tmp_path / "out")


def test_mixed_formats_write_mixed_precision(tmp_path):
    """NVFP4 on one layer, FP8 on the other: compressed-tensors' mixed-precision layout."""
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {
                    "fp4": {"params": dict(start_bits=4, target_bits=4, format="nvfp4"), "modules": ["^0$"]},
                    "fp8": {
                        "params": dict(start_bits=8, target_bits=8, format="fp8_e4m3", granularity="channel"),
                        "modules": ["^2$"],
                    },
                },
            }
        }
    }
    x = torch.randn(4, 64).to(torch.bfloat16)
    model = trained(mlp(torch.bfloat16), doc, x)
    with torch.no_grad():
        want = model(x)
    export_quantized(model, tmp_path / "out")
    qconf = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qconf["format"] == "mixed-precision"
    assert sorted(g["format"] for n, g in qconf["config_groups"].items() if g.get("targets") != ["re:^$"]) == [
        "float-quantized",
        "nvfp4-pack-quantized",
    ]
    back = load_quantized(tmp_path / "out", mlp(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(back(x), want)


transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def bert(dtype):
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=96,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval().to(dtype)


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "NVFP4A16", "MXFP4A16", "FP8_BLOCK"])
def test_transformers_loads_the_same_weights(tmp_path, name):
    """transformers (decompressing) holds load_quantized's weights in every quantized Linear, or
    refuses to load with an error."""
    from qcompress.export.hf_compat import dequantize_config

    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    model = bert(torch.bfloat16)
    doc = doc_of(name, modules=["encoder", "pooler"])
    wp = doc["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]
    cfg = qc.load_config(doc)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    model.train()
    model(ids)
    model.eval()
    export_quantized(model, tmp_path / "out")
    ours = load_quantized(tmp_path / "out", bert(torch.bfloat16))
    transformers.logging.set_verbosity_error()
    try:
        hf = transformers.BertForSequenceClassification.from_pretrained(
            tmp_path / "out", quantization_config=dequantize_config()
        ).eval()
    except Exception as err:  # a refusal must say why; record it
        pytest.fail(f"{name} ({wp}): transformers refused: {type(err).__name__}: {err}")
    sd = hf.state_dict()
    for n, mod in ours.named_modules():
        if isinstance(mod, nn.Linear) and n.startswith(("bert.encoder", "bert.pooler")):
            w = sd[n + ".weight"]
            assert torch.equal(w.to(mod.weight.dtype), mod.weight), n
    if PRESETS[name][1] is None:
        with torch.no_grad():
            assert torch.equal(hf(ids).logits, ours(ids).logits)
