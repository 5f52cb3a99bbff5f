"""Float formats on fused experts (FP8 per channel, NVFP4 group 16 with a global scale per expert
matrix, MXFP4 group 32): compressed-tensors' own decompressor turns every per-expert entry into
the compressed model's effective weight bit for bit, NVFP4's global scale is the closed form
448 * 6 / amax of that expert's matrix, and load_quantized reloads the logits exactly."""

import json
import warnings

import pytest
import torch
from safetensors import safe_open

import qcompress
from tests.helpers.moe_fixtures import make_moe, tokens

ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_comp = pytest.importorskip("compressed_tensors.compressors")

PARAMS = {
    "fp8_e4m3": {"start_bits": 8, "target_bits": 8, "format": "fp8_e4m3", "granularity": "channel"},
    "nvfp4": {"start_bits": 4, "target_bits": 4, "format": "nvfp4"},
    "mxfp4": {"start_bits": 4, "target_bits": 4, "format": "mxfp4"},
}
WIDTHS = {
    "qwen3_moe": {"moe_intermediate_size": 64},
    "gpt_oss": {"intermediate_size": 64},
    "mixtral": {"intermediate_size": 64},
}  # MXFP4's groups of 32 divide every expert input


def _compressed(family, fmt):
    model = make_moe(family, **WIDTHS[family])
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"wq": {"params": PARAMS[fmt], "modules": [r"mlp\.experts"]}},
            }
        }
    }
    qcompress.init_compression(model, cfg)
    return model


@pytest.mark.parametrize(
    "family,fmt",
    [
        ("qwen3_moe", "nvfp4"),
        ("gpt_oss", "nvfp4"),
        ("mixtral", "fp8_e4m3"),
        ("qwen3_moe", "mxfp4"),
        ("gpt_oss", "mxfp4"),
    ],
)
def test_compressed_tensors_decodes_each_expert_and_reload_is_exact(tmp_path, family, fmt):
    model = _compressed(family, fmt)
    raw = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m).__name__ == "ExpertMatrix"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(model, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    records = config["qcompress"]["experts"]
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    fused = family == "gpt_oss"
    decoded = 0
    for pname, rec in records.items():
        part = dict(model.named_modules())[pname]
        eff = part.effective_weight().detach()
        e_n, out, _ = part.matrix_shape()
        ct_format = rec["format"]
        args = ct_quant.QuantizationArgs(**{k: v for k, v in rec["weights"].items() if v is not None})
        scheme = ct_quant.QuantizationScheme(targets=["Linear"], weights=args, format=ct_format)
        comp = ct_comp.BaseCompressor.get_value_from_registry(ct_format)
        st = rec.get("streamed")
        pieces = [(f"{st['prefix']}.{e}.{st['param']}", e, 0, out) for e in range(e_n)] if fused else rec["pieces"]
        globals_of = {}
        for saved, e, o0, r in pieces:
            names = comp.compression_param_names(scheme)
            if fused:  # vLLM's per-expert names; transposed where its loader transposes (MXFP4)
                assert st["transposed"] == (fmt != "nvfp4")
                local = {s: sd[f"{saved}_{s}"] for s in names if s != "weight_shape"}
                local = {s: t.t() if st["transposed"] and t.dim() == 2 else t for s, t in local.items()}
                if "weight_shape" in names:
                    local["weight_shape"] = torch.tensor([r, eff.shape[1]])
                ref = eff[e].t()[o0 : o0 + r]
                w_e = raw[pname][e].t()
            else:
                local = {s: sd[saved[: -len("weight")] + s] for s in names}
                ref = eff[e][o0 : o0 + r]
                w_e = raw[pname][e]
            dense = comp.decompress(local, scheme)["weight"]  # in the decompressor's dtype (bf16 for FP4)
            assert torch.equal(dense, ref.to(dense.dtype)), (saved, e)
            decoded += 1
            if fmt == "nvfp4":  # one global scale per expert matrix (gate and up pieces share it)
                g = local["weight_global_scale"].reshape(())
                torch.testing.assert_close(g, (448.0 * 6.0 / w_e.abs().amax()).float(), rtol=1e-6, atol=0)
                assert globals_of.setdefault(e, g) == g
        if fmt == "nvfp4":
            assert len(set(float(g) for g in globals_of.values())) == e_n  # not one for the layer
    assert decoded >= 2 * len(records)
    x = tokens(model)
    back = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=7, **WIDTHS[family]))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


def test_mxfp4_group_that_does_not_divide_an_expert_input_is_refused_by_name():
    model = make_moe("qwen3_moe")  # expert input 48: not a multiple of 32
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"wq": {"params": PARAMS["mxfp4"], "modules": [r"mlp\.experts"]}},
            }
        }
    }
    with pytest.raises(qcompress.ConfigError, match=r"experts\.down_proj.*mxfp4"):
        qcompress.init_compression(model, cfg)


@pytest.mark.parametrize("recipe,fmt", [("nvfp4a16.yaml", "nvfp4"), ("mxfp4a16.yaml", "mxfp4")])
def test_float_recipes_include_the_experts(recipe, fmt):
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "schedules" / recipe
    model = make_moe("qwen3_moe", **WIDTHS["qwen3_moe"])
    qcompress.init_compression(model, qcompress.load_config(str(path)))
    parts = [m for m in model.modules() if type(m).__name__ == "ExpertMatrix"]
    assert len(parts) == 4 and all(p.qc_wq.format == fmt for p in parts)
    assert model.model.layers[0].mlp.gate.__class__.__name__ == "Qwen3MoeTopKRouter"  # router stays FP


def _fp8_cfg(gran, inputs):
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "format": "fp8_e4m3"},
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": 8, "target_bits": 8, "granularity": gran},
                        "modules": [r"mlp\.experts"],
                    }
                },
            }
        }
    }
    if inputs:
        cfg["compression_training"]["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "range_calibration": "dynamic",
                "format": "fp8_e4m3",
                "quantization_type": "symmetric",
                "schedule_offset": 0,
            },
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.experts"]}},
        }
    return cfg


@pytest.mark.parametrize(
    "family,gran,inputs,widths",
    [
        ("qwen3_moe", "channel", True, {}),
        ("gpt_oss", "channel", True, {}),
        ("qwen3_moe", "block", True, {"moe_intermediate_size": 128}),
        ("gpt_oss", "block", False, {}),
    ],
)
def test_fp8_dynamic_inputs_and_block_scales_of_experts_reload_exactly(tmp_path, family, gran, inputs, widths):
    """FP8 per-token input quantization of the experts is applied again after reload (the logits
    equal the trained model's), and 128 x 128 block scales are written per expert."""
    model = make_moe(family, **widths)
    qcompress.init_compression(model, _fp8_cfg(gran, inputs))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
        unquantized_inputs = None
        if inputs:
            plain = make_moe(family, **widths)
            qcompress.init_compression(plain, _fp8_cfg(gran, False))
            unquantized_inputs = plain(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(model, tmp_path / "q")
    back = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=7, **widths))
    with torch.no_grad():
        got = back(x).logits
    assert torch.equal(got, want)
    if inputs:  # the inputs' quantization is visible in the logits
        assert not torch.equal(got, unquantized_inputs)


def test_fp8_block_scales_cut_by_a_projection_are_refused_by_name(tmp_path):
    model = make_moe("qwen3_moe")  # gate rows 0-48 and up rows 48-96 share one 128-row block
    qcompress.init_compression(model, _fp8_cfg("block", False))
    with pytest.raises(qcompress.export.errors.ExportError, match=r"experts\.0\.gate_proj.*rows 0-48.*128-row"):
        qcompress.export_quantized(model, tmp_path / "q")
