"""Opt-in integer forward of the fused QAT path (qcompress.nn.int8_forward): the forward's
product from the integer codes, against the float64 product of the unfused fake-quantized input
and weight; backward unchanged (a layer's gradients equal the float path's bit for bit)."""

import copy

import pytest
import torch
import torch.nn as nn

from qcompress import init_compression
from qcompress.config import load_config
from qcompress.nn import fused, int8_forward
from qcompress.quant import kernels, lowbit

from tests.nn.test_fused_qat import make_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore:qcompress kernels are not built"),
    pytest.mark.skipif(
        not (kernels.available() and lowbit.available()),
        reason="the C++ extension with the low-bit kernels is not built",
    ),
]
U = 2.0**-24


def layer(kind, cfg, int8=True, k=80, n=40):
    """One compress-aware layer (K not a multiple of the vector width), int8_forward set."""
    torch.manual_seed(0)
    if kind == "linear":
        mod = nn.Sequential(nn.Linear(k, n))
    else:
        from transformers.pytorch_utils import Conv1D

        mod = nn.Sequential(Conv1D(n, k))
        with torch.no_grad():
            mod[0].bias.normal_()
    cfg = copy.deepcopy(cfg)
    cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = int8
    init_compression(mod, cfg)
    return mod


def inputs(tokens=33, k=80):
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, tokens, k, generator=g) * 2 + 0.3


CASES = [
    (kind, gran, sym, wbits)
    for kind in ("linear", "hf_conv1d")
    for gran in ("tensor", "channel", "group")
    for sym in (True, False)
    for wbits in (8, 4)
]


@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("kind,granularity,symmetric,wbits", CASES)
def test_output_is_the_exact_product_within_the_bound(kind, granularity, symmetric, wbits, dtype, tokens):
    """Oracle: x^ and w^ from the unfused fake quantizers, multiplied in float64. The kernel's
    int32 group sums are exact; each output adds ng group terms (sx sw_g) acc_g and the bias in
    fp32, i.e. at most ng + 3 roundings of size u = 2^-24 on the sum of absolute terms,
    |x^| @ |w^|.T + |b|; autocast then rounds once to bf16 (2^-8 relative)."""
    cfg = make_cfg(granularity=granularity, symmetric=symmetric, wbits=wbits)
    mod = layer(kind, cfg)
    q = mod[0]
    x = inputs(tokens)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        assert fused.plan(q, x, kind).int8
        y = mod(x)
    with torch.no_grad(), fused.enabled(False):
        xh = q.quantize_input(x).double()
        wh = q.weight_matrix_view(q.effective_weight()).double()
    b = q.bias.double()
    exact = xh @ wh.t() + b
    ng = 80 // 16 if granularity == "group" else 1
    bound = (ng + 3) * U * (xh.abs() @ wh.abs().t() + b.abs())
    if dtype is not None:
        assert y.dtype == dtype
        bound = bound + 2.0**-8 * exact.abs()
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@pytest.mark.parametrize("learn", [False, True], ids=["observer", "range_learning"])
@pytest.mark.parametrize("ste", ["identity", "clip"])
@pytest.mark.parametrize("kind,granularity,symmetric,wbits", CASES[::3])
def test_layer_gradients_equal_the_float_path_bit_for_bit(kind, granularity, symmetric, wbits, ste, learn):
    """Backward is untouched: given the same output gradient, every gradient of the layer is the
    float forward's bit for bit."""
    cfg = make_cfg(granularity=granularity, symmetric=symmetric, wbits=wbits, ste=ste, learn=learn)
    grads = []
    for int8 in (False, True):
        mod = layer(kind, cfg, int8=int8)
        x = inputs().requires_grad_(True)
        out = mod(x)
        assert fused.plan(mod[0], x, kind).int8 == int8
        g = torch.Generator().manual_seed(2)
        out.backward(torch.randn(out.shape, generator=g))
        grads.append({"input": x.grad, **{n: p.grad for n, p in mod.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_static_ranges_and_the_config_switch():
    raw = make_cfg(calibration="static")
    assert load_config(raw).compression.activation_quantization.shared.int8_forward is False
    mod = layer("linear", raw)
    assert mod[0].qc_aq.int8_forward is True
    x = inputs()
    mod(x)  # calibrates the static range
    mod.eval()
    y = mod(x)
    with torch.no_grad(), fused.enabled(False):
        ref = mod(x)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_where_it_does_not_apply_the_float_forward_runs():
    conv_cfg = make_cfg()
    conv = nn.Sequential(nn.Conv2d(3, 8, 3))
    conv_cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = True
    init_compression(conv, conv_cfg)
    x = torch.randn(2, 3, 9, 9)
    assert not fused.plan(conv[0], x, "conv").int8
    q = conv[0]
    assert "convolution" in int8_forward.reason(q, "conv", "fake_quant", q.qc_wq.spec(), q.input_spec())
    assert int8_forward.reason(q, "linear", "fake_quant", q.qc_wq.spec(), None) == "no activation codes (weight-only)"
    # groups that do not tile the rows (80 columns, groups of 16 do; DeepSpeed's 4 tensor-wide do not)
    mod = layer("linear", make_cfg(granularity="groups"))
    assert not fused.plan(mod[0], inputs(), "linear").int8
    # off by default: the fused float path, bit for bit the unfused one
    mod = layer("linear", make_cfg(), int8=False)
    assert not fused.plan(mod[0], inputs(), "linear").int8


def test_auto_runs_the_integer_forward_only_with_int8_dot_products():
    """`int8_forward: auto` (the W8A8 / W4A8 recipes'): the integer kernel in training mode where
    the low-bit kernels use VNNI or AMX, the float forward (bit for bit int8_forward: false) below
    them and in eval mode, so the trained model in eval mode equals its exact reload."""
    raw = make_cfg()
    raw["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = "AUTO"
    assert load_config(raw).compression.activation_quantization.shared.int8_forward == "auto"
    auto, off = layer("linear", raw, int8="auto"), layer("linear", raw, int8=False)
    x = inputs()
    best = lowbit.isa()
    try:
        for isa in ("scalar", "avx2", "avx512", "avx512_vnni", "amx"):
            try:
                lowbit.isa(isa)
            except RuntimeError:
                print(f"this CPU has no {isa}: not checked")
                continue
            dot = isa in ("avx512_vnni", "amx")
            assert lowbit.int8_dot() is dot
            assert int8_forward.enabled(auto[0].qc_aq) is dot
            assert int8_forward.enabled(auto[0].qc_aq, training=False) is False
            assert int8_forward.reload_mode(auto) == int8_forward.reload_mode(off) == "exact"
            said = int8_forward.describe(auto)
            assert said.startswith("int8_forward auto: ") and isa in said
            assert ("training forwards multiply the integer codes" in said) is dot
            assert ("float forward runs" in said) is not dot
            assert int8_forward.describe(off) is None
            for mode in ("train", "eval"):
                auto.train(mode == "train"), off.train(mode == "train")
                ran = dot and mode == "train"
                assert fused.plan(auto[0], x, "linear").int8 is ran
                y, y_off = auto(x), off(x)
                if ran:  # the kernel's exact integer sums, not the float GEMM's
                    assert not torch.equal(y, y_off)
                else:
                    assert torch.equal(y, y_off)
    finally:
        lowbit.isa(best)
    on = layer("linear", raw, int8=True).eval()  # true: the integer forward in eval mode too
    assert int8_forward.reload_mode(on) == "fast" and fused.plan(on[0], x, "linear").int8
    assert "CPU Linear / Conv1D forwards multiply the integer codes" in int8_forward.describe(on)


@pytest.mark.parametrize("value", ["on", 1])
def test_a_wrong_int8_forward_value_names_the_key(value):
    raw = make_cfg()
    raw["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = value
    with pytest.raises(Exception, match=r"activation_quantization\.shared_parameters\.int8_forward") as err:
        load_config(raw)
    if value == "on":  # choices as the document writes them
        assert "choose one of [false, true, 'auto']" in str(err.value)


def test_training_follows_the_float_path():
    """Five SGD steps of a two-layer MLP: the losses track the float forward's (they differ only
    by the float GEMM's rounding, which can move a code by one step)."""
    losses = []
    for int8 in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 10))
        cfg = make_cfg(granularity="group", wbits=4)
        cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = int8
        init_compression(model, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(3)
        x, t = torch.randn(64, 48, generator=g), torch.randint(0, 10, (64,), generator=g)
        run = []
        for _ in range(5):
            loss = nn.functional.cross_entropy(model(x), t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss.detach()))
        losses.append(run)
    assert losses[0][-1] < losses[0][0]
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-3 * abs(a), losses


def test_bf16_weights_and_inputs():
    """A model cast to bfloat16 (no autocast). The oracle's x^ and w^ are the bf16 fake quantizers'
    outputs, (q - zp) * s rounded to bf16 (2^-8 relative each), while the kernel multiplies the
    codes with the fp32 scales; so the bound is those two roundings, the fp32 sums' and the bf16
    output's."""
    mod = layer("linear", make_cfg(granularity="group", wbits=4)).to(torch.bfloat16)
    q = mod[0]
    x = inputs().to(torch.bfloat16)
    assert fused.plan(q, x, "linear").int8
    y = mod(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad(), fused.enabled(False):
        xh = q.quantize_input(x).double()
        wh = q.effective_weight().double()
    b = q.bias.double()
    exact = xh @ wh.t() + b
    bound = (8 * U + 2 * 2.0**-8) * (xh.abs() @ wh.abs().t() + b.abs()) + 2.0**-8 * exact.abs()
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
