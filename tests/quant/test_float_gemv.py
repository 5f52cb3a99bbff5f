"""The few-token float kernel (csrc/cpu/float_gemv.cpp) that load_quantized(mode="fast") gives the
unquantized nn.Linear layers (qcompress/export/fast/float_linear.py), on every instruction set this
CPU has.

Oracle: the float64 product of the same (exactly widened) inputs. Bound: the kernel multiplies
and sums in float32, so each output is within gamma_{K+2} (|x| @ |W|^T + |b|) of the real
result (gamma_n = n u / (1 - n u), u = 2^-24: a length-K dot product, the bias add and the
reduction of the vector lanes, which only reorders the same sums); bfloat16 rounds that float32
result once more to 8 bits, within 2^-8 of it. A wrong row, column, token or tail element moves
an output by a whole product, far above these bounds. torch's own F.linear sits within the same
bound, which the comparison with it checks.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qcompress.export.fast import float_linear
from qcompress.quant import lowbit

pytestmark = pytest.mark.skipif(not float_linear.available(), reason="the qcompress C++ extension is not built")

ALL_ISAS = ("scalar", "avx2", "avx512", "avx512_vnni", "amx")
U32 = 2.0**-24


def cpu_isas():
    best = lowbit.isa("auto")
    return ALL_ISAS[: ALL_ISAS.index(best) + 1]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    lowbit.isa("auto")


def gamma(n):
    return n * U32 / (1 - n * U32)


def bound(x, w, b, dtype):
    """Per output: how far the kernel may be from the float64 result."""
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    fp32 = gamma(k + 2) * mag
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.float32:
        return exact, fp32
    return exact, fp32 + 2.0**-8 * (exact.abs() + fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_within_the_fp32_bound_on_every_isa(dtype, bias):
    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (5, 15), (4, 16), (37, 17), (9, 33), (70, 768)):
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        for m in (1, 2, 3, 4, 5, 8, 9, 16):
            x = torch.randn(m, k, generator=g).to(dtype)
            exact, tol = bound(x, w, b, dtype)
            ref = F.linear(x, w, b).double()
            assert ((ref - exact).abs() <= tol).all()  # the bound holds for torch too
            for isa in cpu_isas():
                lowbit.isa(isa)
                got = torch.ops.qcompress.float_gemv(x, w, b)
                assert got.dtype == dtype and got.shape == (m, n)
                err = (got.double() - exact).abs()
                assert (err <= tol).all(), f"{isa} {dtype} m={m} n={n} k={k}: {float((err - tol).max())}"


def test_shapes_strides_and_empty():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(11, 20, generator=g)
    x3 = torch.randn(2, 3, 20, generator=g)
    assert torch.ops.qcompress.float_gemv(x3, w, None).shape == (2, 3, 11)
    x1 = torch.randn(20, generator=g)
    torch.testing.assert_close(torch.ops.qcompress.float_gemv(x1, w, None), F.linear(x1, w))
    xt = torch.randn(20, 4, generator=g).T  # not contiguous
    torch.testing.assert_close(torch.ops.qcompress.float_gemv(xt, w, None), F.linear(xt, w))
    assert torch.ops.qcompress.float_gemv(torch.empty(0, 20), w, None).shape == (0, 11)
    b = torch.randn(11, generator=g)
    torch.testing.assert_close(torch.ops.qcompress.float_gemv(torch.empty(1, 0), torch.empty(11, 0), b), b[None])


def test_bad_input_is_named():
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="x .*BFloat16.* and weight .*Float.* must have one dtype"):
        torch.ops.qcompress.float_gemv(torch.randn(1, 8).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="at most 16 rows of x, got 17"):
        torch.ops.qcompress.float_gemv(torch.randn(17, 8), w, None)
    with pytest.raises(RuntimeError, match="x has 7 columns, weight 8"):
        torch.ops.qcompress.float_gemv(torch.randn(1, 7), w, None)
    with pytest.raises(RuntimeError, match="weight must be float32 or bfloat16"):
        torch.ops.qcompress.float_gemv(torch.randn(1, 8).double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"bias must be \[4\]"):
        torch.ops.qcompress.float_gemv(torch.randn(1, 8), w, torch.randn(5))


def test_fast_float_linear_runs_the_kernel_only_where_it_may(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    model = nn.Sequential(lin)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert float_linear.convert(model) == 1 and type(lin) is float_linear.FastFloatLinear
    assert list(model.state_dict()) == list(sd) and all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    calls = []
    real = torch.ops.qcompress.float_gemv

    def spy(*a):
        calls.append(a[0].shape)
        return real(*a)

    monkeypatch.setattr(torch.ops.qcompress, "float_gemv", spy)
    with torch.no_grad():
        few = torch.randn(2, 3, 24)  # 6 tokens: the kernel
        exact, tol = bound(few.reshape(-1, 24), lin.weight, lin.bias, torch.float32)
        got = lin(few)
        assert calls == [few.shape]
        assert ((got.reshape(-1, 40).double() - exact).abs() <= tol).all()
        many = torch.randn(9, 24)  # above MAX_TOKENS: torch's matmul, bit for bit
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias)) and len(calls) == 1
    x = torch.randn(3, 24, requires_grad=True)  # gradients asked: torch's path
    y = lin(x)
    y.sum().backward()
    assert len(calls) == 1 and x.grad is not None and lin.weight.grad is not None
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
