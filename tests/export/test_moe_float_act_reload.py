"""Float-format dynamic input activations on fused experts (FP8 per token, MXFP8 groups of 32)
reload exactly: load_quantized, exact and fast, gives the logits of the compressed model it was
exported from, before training and after a few optimizer steps. The loaded experts used to quantize
their inputs as int8 per token, whatever format the export's input_activations named."""

import warnings

import pytest
import torch

import qcompress
from tests.helpers.moe_fixtures import make_moe, tokens

RECIPES = {
    "fp8_e4m3": (
        {"format": "fp8_e4m3", "start_bits": 8, "target_bits": 8, "granularity": "channel"},
        {"format": "fp8_e4m3", "bits": 8},
    ),
    "mxfp8": ({"format": "mxfp8", "start_bits": 8, "target_bits": 8}, {"format": "mxfp8", "bits": 8}),
}
WIDTHS = {"qwen3_moe": {"moe_intermediate_size": 64}, "mixtral": {"intermediate_size": 64}}


def _config(fmt):
    w, a = RECIPES[fmt]
    return {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"wq": {"params": w, "modules": [r"mlp\.experts"]}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
                "different_groups": {"aq": {"params": a, "modules": [r"mlp\.experts"]}},
            },
        },
    }


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "fp8_e4m3"), ("mixtral", "fp8_e4m3"), ("qwen3_moe", "mxfp8")])
@pytest.mark.parametrize("steps", [0, 3])
def test_float_dynamic_expert_inputs_reload_exactly(tmp_path, family, fmt, steps):
    cfg = _config(fmt)
    model = make_moe(family, **WIDTHS[family])
    qcompress.init_compression(model, cfg)
    parts = [m for m in model.modules() if type(m).__name__ == "ExpertMatrix"]
    assert parts and all(p.qc_aq is not None and p.qc_aq.format == fmt for p in parts)
    x = tokens(model)
    if steps:
        engine = qcompress.initialize(model, cfg)
        for _ in range(steps):
            loss = model(x, labels=x).loss
            engine.backward(loss)
            engine.step()
    model.eval()
    with torch.no_grad():
        want = model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(model, tmp_path / "q", cfg)
    for mode in ("exact", "fast"):
        loaded = qcompress.load_quantized(tmp_path / "q", make_moe(family, **WIDTHS[family]), mode=mode)
        got_parts = [m for m in loaded.modules() if type(m).__name__ == "ExpertMatrix"]
        assert got_parts and all(p.qc_aq.format == fmt for p in got_parts), mode
        with torch.no_grad():
            got = loaded(x).logits
        assert torch.equal(got, want), (mode, (got - want).abs().max().item())
