"""Quantizer edge cases: finite inputs give finite outputs at the float32 / bf16 / fp16
limits, a float64 input beyond float32's range is reported as what it is, and the kernels agree
with the reference bit for bit on the sign of zero (all-zero groups, deepspeed asymmetric with
stochastic rounding was where they differed)."""

import itertools

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress import NonFiniteError
from qcompress.quant import reference as R
from qcompress.quant.reference import make_spec

try:
    from qcompress.quant import kernels as K

    IMPLS = [R, K] if K.available() else [R]
except ImportError:  # pragma: no cover
    IMPLS = [R]
if len(IMPLS) == 1:
    print("test_quant_edge_values: the C++ kernels are not built; checking the reference only")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _specs():
    for bits, sym, num, rnd in itertools.product(
        [2, 3, 4, 8], [True, False], ["default", "deepspeed"], ["nearest", "stochastic"]
    ):
        yield make_spec(bits, symmetric=sym, numerics=num, rounding=rnd, seed=1, ternary=False)


def _edge_inputs(dt):
    m = torch.finfo(dt).max
    rows = [
        [m, -m, 1.0, 0.5],
        [m, 0.3, 0.1, 0.2],
        [-m, 0.3, 0.1, 0.2],
        [m, -m / 3, 0.0, 1.0],
        [m * 0.999, -m * 0.6, 0.0, 1.0],
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dt)


def _unsaturated(x, spec):
    """The plain formula's x^ (what the quantizer gave before saturation), by the reference."""
    xf = x.to(torch.float32)
    q, s, zp, _ = R._codes(xf, spec, None, None, None)
    return R.ungroup(R.dequantize_view(q, s, zp, spec), xf, spec)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("impl", IMPLS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
@pytest.mark.parametrize("gran", ["tensor", "channel"])
def test_finite_in_finite_out_at_the_dtype_limit(dt, impl, gran):
    x = _edge_inputs(dt)
    m = torch.finfo(dt).max
    overshoots = 0
    for spec in _specs():
        spec = make_spec(
            spec.bits,
            symmetric=spec.symmetric,
            numerics=spec.numerics,
            rounding=spec.rounding,
            seed=1,
            granularity=gran,
        )
        y = impl.fake_quantize_with_mask(x, spec)[0]
        assert bool(torch.isfinite(y).all()), (spec, y)
        # oracle: the plain formula, saturated at the dtype's largest finite value; every element
        # the formula kept finite in this dtype has exactly its bits
        plain = _unsaturated(x, spec)
        want = plain.clamp(-m, m).to(dt) if dt != torch.float32 else plain.clamp(-m, m)
        assert torch.equal(y, want), (spec, y, want)
        overshoots += int((~torch.isfinite(plain.to(dt))).sum())
    assert overshoots > 0  # the edge inputs do reach the cases that used to give inf


def test_float32_symmetric_at_flt_max_closed_form():
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([fmax, -fmax, 1.0, 0.25])
    spec = make_spec(8)
    s = torch.tensor(fmax) / 127  # absmax / qmax
    for impl in IMPLS:
        y = impl.fake_quantize_with_mask(x, spec)[0]
        assert y[0].item() == fmax and y[1].item() == -fmax  # 127 * s rounds past FLT_MAX
        assert torch.equal(y[2:], torch.round(x[2:] / s) * s)


def test_asymmetric_fp16_model_exports_and_loads_at_the_limit(tmp_path):
    # a fp16 weight at the fp16 limit: the asymmetric grid reaches past 65504; training, export
    # and load_quantized all saturate, so the export check passes and the load is bit-exact
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4))
    with torch.no_grad():
        net[0].weight[0, 0] = 65504.0
        net[0].weight[1, 1] = -200.0
    net = net.half()
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "asymmetric",
                },
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["0"]}},
            }
        }
    }
    m = qcompress.init_compression(net, qcompress.load_config(cfg))
    w = m[0].effective_weight().detach()
    assert bool(torch.isfinite(w).all()) and w.max().item() == 65504.0
    qcompress.export_quantized(m, tmp_path / "out")
    fresh = nn.Sequential(nn.Linear(8, 4)).half()
    loaded = qcompress.load_quantized(tmp_path / "out", fresh)
    assert torch.equal(loaded[0].weight, w)


def test_float64_beyond_float32_is_reported_as_such():
    x = torch.tensor([1e300, 1.0, -2.0], dtype=torch.float64)
    for fn in (
        lambda: qcompress.quant.fake_quantize(x, 8),
        lambda: qcompress.quant.quantize(x, 8),
        lambda: qcompress.quant.fake_quantize(x, 8, backend="reference"),
    ):
        with pytest.raises(
            NonFiniteError,
            match=r"1 finite float64 values exceed float32's range "
            r"\(largest \|x\| = 1e\+300",
        ):
            fn()
    with pytest.raises(NonFiniteError, match="NaN or Inf"):  # a real inf keeps its report
        qcompress.quant.fake_quantize(torch.tensor([float("inf"), 1.0], dtype=torch.float64), 8)
    y = qcompress.quant.fake_quantize(torch.tensor([1e30, -1.0], dtype=torch.float64), 8)
    assert y.dtype == torch.float64 and bool(torch.isfinite(y).all())


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t.view(torch.int32)


@pytest.mark.skipif(len(IMPLS) == 1, reason="the C++ kernels are not built")
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: str(d)[6:])
def test_sign_of_zero_agrees_with_the_reference(dt):
    g = torch.Generator().manual_seed(0)
    n = 4 * 64
    zeros = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, -0.0)
    sparse = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.3)
    sparse = torch.where(torch.rand(n, generator=g) < 0.5, sparse, -sparse)
    checked = 0
    for x0, shape in itertools.product((zeros, sparse, torch.full((n,), -0.0)), [(4, 64), (8, 32)]):
        x = x0.to(dt).reshape(shape)
        for bits, sym, num, rnd, gran in itertools.product(
            [1, 2, 4, 8],
            [True, False],
            ["default", "deepspeed"],
            ["nearest", "stochastic"],
            ["tensor", "channel", "group", "token"],
        ):
            try:
                spec = make_spec(
                    bits,
                    symmetric=sym,
                    numerics=num,
                    rounding=rnd,
                    seed=5,
                    granularity=gran,
                    group_size=16 if gran == "group" else None,
                    ternary=bits == 2,
                )
            except ValueError:
                continue
            ref = R.fake_quantize_with_mask(x, spec)[0]
            for got in (K.fake_quantize_with_mask(x, spec)[0], K.fake_quantize(x, spec)):
                assert torch.equal(_bits(ref), _bits(got)), (
                    spec,
                    x.flatten()[:8],
                    ref.flatten()[:8],
                    got.flatten()[:8],
                )
            checked += 1
    assert checked > 300


def test_all_zero_group_offset_is_positive_zero():
    # documented: deepspeed asymmetric's zero offset round(lo / s) * s of an all-zero group is +0,
    # whichever zero the min kept, so x^ = q s + z is +0 for every element (q = -0 or +0)
    x = torch.tensor([[-0.0, 0.0, -0.0, -0.0]])
    spec = make_spec(4, symmetric=False, numerics="deepspeed", rounding="stochastic", seed=3)
    for impl in IMPLS:
        y = impl.fake_quantize_with_mask(x, spec)[0]
        assert torch.equal(_bits(y), torch.zeros(1, 4, dtype=torch.int32)), (impl, y)
