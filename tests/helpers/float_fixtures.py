"""Shared by the float-format observer and range-learning tests: a weight-quantization config
for one format, a small MLP, and the check that compressed-tensors' own decompressor returns
each exported Linear's effective weight bit for bit."""

import json

import torch
import torch.nn as nn

from qcompress.quant import floats


def float_weight_doc(fmt, gran=None, **params):
    """One weight group in `fmt` at its own width over every Linear (params: observer, ...)."""
    p = {"start_bits": floats.WIDTH[fmt], "target_bits": floats.WIDTH[fmt], "format": fmt, **params}
    if gran:
        p["granularity"] = gran
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {"w": {"params": p}},
            }
        }
    }


def float_mlp(dtype, outlier=None):
    """Linear(64, 160), ReLU, Linear(160, 32), seeded; outlier: a value put at weight [3, 5] of the first."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 160), nn.ReLU(), nn.Linear(160, 32)).to(dtype)
    if outlier is not None:
        with torch.no_grad():
            m[0].weight[3, 5] = outlier
    return m


def assert_decompresses_to_effective(model, out_dir, indices=(0, 2)):
    """compressed-tensors' decompressor of the export's format gives model[i].effective_weight();
    returns the exported tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    qconf = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    (group,) = qconf["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    comp = BaseCompressor.get_value_from_registry(group["format"])
    tensors = load_file(str(out_dir / "model.safetensors"))
    for i in indices:
        local = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"{i}.")}
        dense = comp.decompress({k: local[k] for k in comp.compression_param_names(scheme)}, scheme)["weight"]
        eff = model[i].effective_weight().detach()
        assert torch.equal(dense, eff.to(dense.dtype)), f"module {i}"
    return tensors


def export_round_trip(model, out_dir, fresh, dtype):
    """Export `model`, check the decompressed weights, reload into `fresh` and check its outputs
    equal the model's; returns (exported tensors, input, the model's output on it)."""
    import warnings
    from qcompress.export import export_quantized, load_quantized

    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(model, out_dir)
        tensors = assert_decompresses_to_effective(model, out_dir)
        back = load_quantized(out_dir, fresh)
    with torch.no_grad():
        assert torch.equal(back(x), want)
    return tensors, x, want
