"""The CUDA kernels against the CPU reference: the same bits on both devices.

Skips (with the reason) when there is no GPU or the extension was built without CUDA.
"""

import itertools

import pytest
import torch

from qcompress.errors import NonFiniteError
from qcompress.quant import kernels as K, onebit as O, packing as P, reference as R

if not K.available():
    pytest.skip(f"qcompress C++ extension not built ({K.load_error()})", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA kernels are only compiled (make cuda-check)", allow_module_level=True)
if not torch.ops.qcompress.fake_quant.default.has_kernel_for_dispatch_key("CUDA"):
    pytest.skip(
        "the extension was built without CUDA (QCOMPRESS_CUDA=1 with nvcc to build it)", allow_module_level=True
    )

DEV = torch.device("cuda")
pytestmark = pytest.mark.cuda


def same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    a = a.cpu()
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} differ"


def all_specs(granularity, **extra):
    out = []
    for bits, ternary in [(1, False), (2, True), (2, False), (4, False), (8, False)]:
        for sym, numerics, rounding in itertools.product(
            [True, False], ["default", "deepspeed"], ["nearest", "stochastic"]
        ):
            if (bits == 1 or ternary) and (not sym or rounding == "stochastic"):
                continue
            out.append(
                R.make_spec(
                    bits,
                    symmetric=sym,
                    granularity=granularity,
                    rounding=rounding,
                    numerics=numerics,
                    ternary=ternary,
                    seed=99,
                    **extra,
                )
            )
    return out


@pytest.mark.parametrize(
    "gran,extra",
    [
        ("tensor", {}),
        ("channel", {}),
        ("token", {}),
        ("group", {"group_size": 5}),
        ("group", {"group_size": 1}),
        ("group", {"group_size": 2048}),
        ("tensor", {"num_groups": 3}),
    ],
)
@pytest.mark.parametrize("shape", [(7, 3000), (3, 5, 9), (1,)])
def test_cuda_matches_cpu_reference(gran, extra, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    if "num_groups" in extra and x.numel() % extra["num_groups"]:
        pytest.skip(f"num_groups=3 does not divide {x.numel()} (shape {shape})")
    for dtype in (torch.float32, torch.bfloat16):
        xc = x.to(dtype)
        for spec in all_specs(gran, **extra):
            y_ref, m_ref = R.fake_quantize_with_mask(xc, spec)
            y, m = K.fake_quantize_with_mask(xc.to(DEV), spec)
            same(y, y_ref, f"y {spec} {dtype}")
            same(m, m_ref, f"mask {spec}")
            ref = R.quantize(xc, spec)
            ker = K.quantize(xc.to(DEV), spec)
            for name, a, b in zip(("q", "scale", "zp"), ker, ref):
                if b is None:
                    assert a is None
                else:
                    same(a, b, f"{name} {spec}")
            kw = {"group_size": spec.group_size} if gran == "group" else {}
            if spec.num_groups:
                kw = {"num_groups": spec.num_groups}
            same(K.dequantize(*ker, **kw), R.dequantize(*ref, **kw), f"dequantize {spec}")
            both = K.quantize_values(xc.to(DEV), spec)  # codes and values from one pass
            for name, a, b in zip(("q", "scale", "zp", "values"), both, (*ref, y_ref)):
                if b is None:
                    assert a is None, f"quantize_values {name} {spec}"
                else:
                    same(a, b, f"quantize_values {name} {spec} {dtype}")


def test_cuda_static_range_and_nonfinite():
    """NaN/Inf: counted without a sync and raised by check_nonfinite (once, with the count), or
    raised at the call itself in sync mode."""
    x = torch.randn(4, 33)
    spec = R.make_spec(8, symmetric=False)
    same(
        K.fake_quantize_with_mask(x.to(DEV), spec, -1.0, 2.0)[0],
        R.fake_quantize_with_mask(x, spec, -1.0, 2.0)[0],
        "static range",
    )
    x[1, 2] = float("nan")
    x[3, 30] = float("inf")
    gspec = R.make_spec(4, granularity="group", group_size=8)  # 5 groups per row: 2 are hit
    K.check_nonfinite()
    K.fake_quantize_with_mask(x.to(DEV), gspec)
    K.quantize(x.to(DEV), gspec)
    with pytest.raises(NonFiniteError, match="^4 quantization groups on cuda:0"):
        K.check_nonfinite()
    K.check_nonfinite()  # reset: nothing new since
    old = K.cuda_sync_checks(True)
    try:
        with pytest.raises(NonFiniteError, match="2 of 20 quantization groups"):
            K.fake_quantize_with_mask(x.to(DEV), gspec)
    finally:
        K.cuda_sync_checks(old)
    assert old is False


def test_cuda_packing_onebit_and_backward():
    g = torch.Generator().manual_seed(1)
    for bits in P.PACKABLE_BITS:
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 37), generator=g, dtype=torch.int8)
        packed = K.pack_int32(q.to(DEV), bits)
        same(packed, P.pack_int32(q, bits), f"pack {bits}")
        same(K.unpack_int32(packed, bits, 37), q, f"unpack {bits}")
    x, e = torch.randn(8 * 5001, generator=g), torch.randn(8 * 5001, generator=g)
    for a, b, name in zip(K.onebit_compress(x.to(DEV), e.to(DEV)), O.compress(x, e), ("packed", "scale", "err")):
        same(a, b, f"onebit {name}")
    packed = torch.randint(0, 256, (4, 100), generator=g, dtype=torch.uint8)
    scales = torch.rand(4, generator=g)
    same(K.onebit_decode_average(packed.to(DEV), scales.to(DEV)), O.decode_average(packed, scales), "decode")
    scales[2] = 0.0  # -0.0 for clear bits, as sign * scale gives
    rows = packed.to(DEV)[:, :96]  # strided rows, as payload rows without their scale bytes
    want = torch.stack([O.decode(packed[r, :96].contiguous(), scales[r]) for r in range(4)])
    got = K.onebit_decode(rows, scales.to(DEV))
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), "decode rows"
    grad, mask = torch.randn(9, 7), torch.rand(9, 7) > 0.5
    same(K.ste_backward(grad.to(DEV), mask.to(DEV)), grad * mask.float(), "ste")


def test_cuda_opcheck():
    x = torch.randn(6, 10, device=DEV)
    torch.library.opcheck(torch.ops.qcompress.fake_quant, (x, None, 6, 10, 4, 4, 0, False, False, 1, 7, True))
    torch.library.opcheck(torch.ops.qcompress.quantize, (x, None, 6, 10, 4, 4, 0, True, False, 0, 0))
    torch.library.opcheck(torch.ops.qcompress.quantize_values, (x, None, 6, 10, 4, 4, 0, False, False, 1, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("sym", [True, False])
def test_cuda_given_parameter_and_lsq_kernels_match_cpu_reference(dtype, rounding, sym):
    """Range learning's kernels (fake_quant_params, lsq_backward) on the GPU against the CPU
    reference: values and input gradients bit for bit; the scale / zero-point gradients are sums
    over each group, in another order on the GPU."""
    from qcompress.quant import observers

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 45, generator=g) / torch.rand(7, 45, generator=g).clamp(min=0.05).sqrt() + 0.3).to(dtype)
    for spec in (
        R.make_spec(5, symmetric=sym, granularity="group", group_size=16, rounding=rounding, seed=99),
        R.make_spec(4, symmetric=sym, granularity="channel", rounding=rounding, seed=7),
    ):
        s, z = observers.weight_params(x.float(), spec, "minmax")
        s = s * 0.8  # some values clip: both gradient regimes
        y_ref, m_ref = R.fake_quantize_with_mask(x, spec, params=(s, z))
        y, m = K.fake_quantize_with_mask(x.to(DEV), spec, params=(s.to(DEV), None if z is None else z.to(DEV)))
        same(y, y_ref, f"y {spec}")
        same(m, m_ref, f"mask {spec}")
        grad = torch.randn(x.shape, generator=g).to(dtype)
        want = R.lsq_backward(grad, x, spec, s, z)
        got = K.lsq_backward(grad.to(DEV), x.to(DEV), spec, s.to(DEV), None if z is None else z.to(DEV))
        same(got[0], want[0], f"grad x {spec}")
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-6)
        if not sym:
            torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-5, atol=1e-6)
        assert (m_ref == 0).any() and m_ref.any()
