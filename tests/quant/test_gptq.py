"""GPTQ's solver (qcompress.quant.gptq) against the reference written from the paper in
tests/helpers/gptq_reference.py (float64, Cholesky of the damped inverse Hessian, column loop with error
propagation, lazy block updates; integer scales and rounding written out there); float formats use
the format's own quantizer (quant/floats.py, checked against compressed-tensors elsewhere) inside
that reference loop."""

from __future__ import annotations

import pytest
import torch

from qcompress.quant import floats, gptq, observers
from qcompress.quant.api import fake_quantize_spec
from qcompress.quant.reference import make_spec

from tests.helpers.gptq_reference import int_quant, problem, reference, int_fit  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread; on a shared machine threads mostly wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def params_of(spec, refs, rows, cols, width, upfront_tensor=False):
    """The reference's per-group params in the solver's layout (float32 [groups] in group order)."""
    if spec.granularity == "tensor":
        return refs[0][0][:1], None if refs[0][1] is None else refs[0][1][:1]
    s = torch.stack([p[0] for p in refs], dim=1).reshape(-1)
    z = None if refs[0][1] is None else torch.stack([p[1] for p in refs], dim=1).reshape(-1)
    return s, z


CASES = [  # granularity, group size, bits, symmetric
    ("group", 32, 4, True),
    ("group", 32, 4, False),
    ("group", 16, 3, True),
    ("channel", None, 4, True),
    ("channel", None, 8, False),
    ("tensor", None, 4, True),
    ("tensor", None, 4, False),
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("gran,gs,bits,sym", CASES)
def test_integer_solve_matches_reference(gran, gs, bits, sym, act_order):
    # 72 columns: groups of 32 leave a partial last group of 8 (SmolLM2's 576 = 4.5 x 128 the same way)
    W, H = problem(dead=(5,))
    rows, cols = W.shape
    spec = make_spec(bits, symmetric=sym, granularity=gran, group_size=gs)
    width = gs or cols
    if gran == "tensor":

        def fit(X):
            s, z = int_fit(W.reshape(1, -1), bits, sym)
            return s.expand(rows), None if z is None else z.expand(rows)
    else:

        def fit(X):
            return int_fit(X, bits, sym)

    for block in (128, 24, 7):  # the lazy updates' block size changes nothing
        settings = gptq.Settings(damp=0.01, block_size=block, act_order=act_order)
        grid = gptq.make_grid(spec, rows, cols, W.dtype, settings)
        sol = gptq.solve(W, H, grid, settings)
        Wc, Q, refs = reference(
            W,
            H,
            fit,
            lambda w, p: int_quant(w, p, bits),
            width,
            upfront=act_order or gran != "group",
            block=block,
            act_order=act_order,
        )
        assert (sol.weight - Wc).abs().max() < 1e-6
        assert (sol.quantized - Q).abs().max() < 1e-6
        s, z = params_of(spec, refs, rows, cols, width)
        assert torch.allclose(sol.params[0], s, rtol=1e-6, atol=0)
        if z is None:
            assert sol.params[1] is None
        else:
            assert torch.equal(sol.params[1], z)
        # the module's forward quantizes the compensated weights with these scales: that is Q
        again = fake_quantize_spec(sol.weight, spec, scale=sol.params[0], zero_point=sol.params[1])
        assert torch.equal(again, sol.quantized)


def test_gptq_lowers_the_output_error_below_round_to_nearest():
    W, H = problem(rows=48, cols=96, seed=3)
    spec = make_spec(4, granularity="group", group_size=32)
    sol = gptq.solve(W, H, gptq.make_grid(spec, 48, 96, W.dtype, gptq.Settings()), gptq.Settings())
    rtn = fake_quantize_spec(W, spec)

    def err(Q):
        D = (W - Q).double()
        return float((D @ H * D).sum())

    assert err(sol.quantized) < 0.8 * err(rtn)


def test_mse_scale_observer_matches_reference():
    W, H = problem(seed=1)
    rows, cols = W.shape
    spec = make_spec(4, granularity="group", group_size=32)
    row = make_spec(4, granularity="channel")
    settings = gptq.Settings(observer="mse", act_order=False)
    sol = gptq.solve(W, H, gptq.make_grid(spec, rows, cols, W.dtype, settings), settings)
    Wc, Q, _ = reference(
        W, H, lambda X: observers.weight_params(X, row, "mse"), lambda w, p: int_quant(w, p, 4), 32, upfront=False
    )
    assert (sol.weight - Wc).abs().max() < 1e-6 and (sol.quantized - Q).abs().max() < 1e-6
    minmax = gptq.Settings(act_order=False)
    plain = gptq.solve(W, H, gptq.make_grid(spec, rows, cols, W.dtype, minmax), minmax)
    assert not torch.equal(plain.params[0], sol.params[0])  # mse chose other scales


FLOATS = [
    ("fp8_e4m3", "channel"),
    ("fp8_e4m3", "tensor"),
    ("fp8_e4m3", "block"),
    ("nvfp4", "group"),
    ("mxfp4", "group"),
    ("mxfp8", "group"),
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt,gran", FLOATS)
def test_float_solve_matches_reference(fmt, gran, act_order):
    rows, cols = (160, 192) if gran == "block" else (24, 64)  # 192: a partial 128-column block
    W, H = problem(rows, cols, seed=2)
    spec = floats.float_spec(fmt, gran)
    width = {"group": spec.group_size, "block": 128}.get(gran, cols)
    gscale = floats.tensor_global_scale(W) if spec.scale_kind == "e4m3" else None
    sub = floats.FloatSpec(fmt, gran, spec.group_size) if gran in ("group", "block") else spec

    def fit(X):
        s = floats.qparams(X, sub, gscale)[0]
        if gran == "block":
            return s.reshape(-1).repeat_interleave(128)[:rows]
        return s.reshape(-1).expand(rows) if gran == "tensor" else s.reshape(-1)

    def quant(w, s):
        return floats.fake_quantize_float(
            w.reshape(-1, 1), floats.FloatSpec(fmt, "channel"), scale=s.reshape(-1, 1), gscale=gscale
        ).reshape(-1)

    settings = gptq.Settings(block_size=64, act_order=act_order)
    sol = gptq.solve(W, H, gptq.make_grid(spec, rows, cols, W.dtype, settings), settings)
    Wc, Q, _ = reference(
        W,
        H,
        fit if gran != "tensor" else (lambda X: fit(W)),
        quant,
        width,
        upfront=act_order or gran in ("tensor", "channel"),
        block=64,
        act_order=act_order,
    )
    assert (sol.weight - Wc).abs().max() < 1e-6
    assert (sol.quantized - Q).abs().max() < 1e-6
    s, g = sol.params
    assert tuple(s.shape) == tuple(floats.qparams(W, spec)[0].shape)
    assert torch.equal(floats.fake_quantize_float(sol.weight, spec, scale=s, gscale=g), sol.quantized)


def test_dead_columns_keep_their_weights():
    W, H = problem(dead=(3, 40))
    spec = make_spec(4, granularity="group", group_size=32)
    sol = gptq.solve(W, H, gptq.make_grid(spec, *W.shape, W.dtype, gptq.Settings()), gptq.Settings())
    # a column no input reached takes no error from the others: it is only rounded
    for c in (3, 40):
        assert torch.equal(sol.weight[:, c], W[:, c])
    assert torch.isfinite(sol.weight).all()


def test_a_hessian_no_dampening_factors_is_rounded_to_nearest():
    W, _ = problem()
    H = -torch.eye(W.shape[1], dtype=torch.float64)  # negative definite: no Cholesky
    spec = make_spec(4, granularity="group", group_size=32)
    sol = gptq.solve(W, H, gptq.make_grid(spec, *W.shape, W.dtype, gptq.Settings()), gptq.Settings())
    assert sol.rounded
    assert torch.equal(sol.quantized, fake_quantize_spec(W, spec))


@pytest.mark.parametrize("fmt", ["int", "nvfp4", "fp8_e4m3"])
def test_bfloat16_weights_quantize_back_to_the_solution(fmt):
    """bf16 weights: each column is stored and quantized in bf16, as the module's forward does."""
    W, H = problem(rows=32, cols=64, seed=5)
    W = W.to(torch.bfloat16)
    spec = (
        make_spec(4, granularity="group", group_size=32)
        if fmt == "int"
        else floats.float_spec(fmt, "group" if fmt == "nvfp4" else "channel")
    )
    sol = gptq.solve(W, H, gptq.make_grid(spec, 32, 64, W.dtype, gptq.Settings()), gptq.Settings())
    assert sol.weight.dtype == sol.quantized.dtype == torch.bfloat16
    s, z = sol.params
    again = (
        fake_quantize_spec(sol.weight, spec, scale=s, zero_point=z)
        if fmt == "int"
        else floats.fake_quantize_float(sol.weight, spec, scale=s, gscale=z)
    )
    assert torch.equal(again, sol.quantized)
    rtn = fake_quantize_spec(W, spec) if fmt == "int" else floats.fake_quantize_float(W, spec)

    def err(Q):
        D = (W - Q).double()
        return float((D @ H * D).sum())

    assert err(sol.quantized) < err(rtn)
