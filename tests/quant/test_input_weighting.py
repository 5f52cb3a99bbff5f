"""The input-weighted mse observer (observer_kwargs.weight_by: inputs).

Oracles written here: the moments E[u u^T] of each module's input, computed from the inputs by
hand (the first Linear's input is the batch, the second's relu(first(batch))); the weighted
search, a brute force over the same grid group by group with the error d^T M_g d (M_g the block of
the moments over the group's columns, or the diagonal where a group spans whole rows), followed
by the weighted least-squares refinement written out per group; export decompressed by
compressed-tensors' own validator and qcompress.load_quantized against effective_weight().
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.quant import observers
from qcompress.quant.reference import make_spec

GRID = [(100 - k) / 100 for k in range(80)]


def grid_scale(xs, p, bits):
    qmax = (1 << (bits - 1)) - 1
    return torch.maximum(xs.min().abs(), xs.max().abs()) * torch.as_tensor(p, dtype=torch.float32) / qmax


def fq(xs, s, bits):
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return torch.round(xs / s).clamp(qmin, qmax) * s, torch.round(xs / s).clamp(qmin, qmax)


def werr(y, xs, M):
    d = (y - xs).double()
    return float(d @ M @ d)


def oracle_shrink(xs, M, bits):
    """Brute force over GRID with the error d^T M d, then the weighted least squares of the scale
    s' = q^T M x / q^T M q (codes of the current scale), p' = p s' / s in float32, kept while the
    error drops, at most REFINE_ITERS times."""
    errs = [werr(fq(xs, grid_scale(xs, p, bits), bits)[0], xs, M) for p in GRID]
    best = min(range(len(GRID)), key=lambda k: (errs[k], k))
    p, err = torch.tensor(GRID[best], dtype=torch.float32), errs[best]
    for _ in range(observers.REFINE_ITERS):
        s = grid_scale(xs, p, bits)
        q = fq(xs, s, bits)[1].double()
        num, den = float(q @ M @ xs.double()), float(q @ M @ q)
        if den <= 0 or num <= 0:
            break
        p_new = torch.tensor(float(p) * num / (float(s) * den), dtype=torch.float32)
        e_new = werr(fq(xs, grid_scale(xs, p_new, bits), bits)[0], xs, M)
        if not e_new < err:
            break
        p, err = p_new, e_new
    return p, err, errs[0]


def correlated_inputs(n, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) * 0.4 + torch.eye(cols)
    scale = torch.logspace(-1.5, 0.7, cols)[torch.randperm(cols, generator=g)]
    return (torch.randn(n, cols, generator=g) @ mix) * scale


def heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()


# --- 1. the weighted search -------------------------------------------------------------------------


def kernel_backend(backend):
    """None: the fused CPU kernel's search (skipped, with the reason, where it is not built)."""
    from qcompress.quant import kernels

    if backend is None and not kernels.available():
        pytest.skip("the C++ extension is not built here: only the reference search runs")
    return backend


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("gran,gs", [("group", 16), ("channel", None)])
@pytest.mark.parametrize("bits", [3, 4])
def test_weighted_choice_equals_brute_force_and_never_loses_on_its_error(gran, gs, bits, backend):
    backend = kernel_backend(backend)
    x = heavy((6, 40), seed=bits)  # 40 = 2 x 16 + 8: a ragged last group
    u = correlated_inputs(500, 40)
    U = u.double().T @ u.double() / 500  # E[u u^T]
    spec = make_spec(bits, symmetric=True, granularity=gran, group_size=gs)
    if gran == "group":
        up = torch.nn.functional.pad(U, (0, 8, 0, 8))  # the ragged group's missing columns: zero
        moments = torch.stack([up[j : j + 16, j : j + 16] for j in range(0, 48, 16)])
        groups = [(r, j) for r in range(6) for j in range(0, 40, 16)]
        block = lambda j: U[j : j + 16, j : j + 16]
        cols = lambda j: slice(j, j + 16)
    else:
        moments = torch.diagonal(U).reshape(-1, 1, 1).clone()
        groups = [(r, 0) for r in range(6)]
        block = lambda j: torch.diag(torch.diagonal(U))
        cols = lambda j: slice(0, 40)
    chosen = observers.mse_shrink(x, spec, backend=backend, moments=moments)
    assert chosen.shape == (len(groups),)
    plain = observers.mse_shrink(x, spec)
    for g, (r, j) in enumerate(groups):
        xs = x[r, cols(j)]
        want, err, err_minmax = oracle_shrink(xs, block(j)[: xs.numel(), : xs.numel()], bits)
        assert chosen[g] == want, (g, float(want), float(chosen[g]))
        assert err <= err_minmax  # p = 1 is minmax: never worse on the weighted error
    assert not torch.equal(chosen, plain)  # the weighting does change choices


def test_weighted_search_with_uniform_moments_is_the_plain_search():
    """M = I on every block is the unweighted error: the same factors as the plain observer."""
    x = heavy((5, 48), seed=2)
    spec = make_spec(4, symmetric=True, granularity="group", group_size=16)
    eye = torch.eye(16, dtype=torch.float64).expand(3, 16, 16).clone()
    assert torch.equal(observers.mse_shrink(x, spec, moments=eye), observers.mse_shrink(x, spec, backend="reference"))


@pytest.mark.parametrize(
    "gran,gs,cols",
    [("group", 32, 96), ("group", 32, 80), ("group", 128, 256), ("channel", None, 72), ("tensor", None, 40)],
)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_weighted_errors_equal_the_reference(gran, gs, cols, sym, dtype):
    """The fused kernel's d^T M d of every candidate against the torch reference's (both float64;
    the sums are ordered differently, so to 1e-12), and the same factors chosen."""
    from qcompress.quant import kernels

    kernel_backend(None)
    x = heavy((24, cols), seed=cols).to(dtype)
    u = correlated_inputs(400, cols, seed=1)
    U = u.double().T @ u.double() / 400
    spec = make_spec(4, symmetric=sym, granularity=gran, group_size=gs)
    b = observers.moment_block(spec)
    if b == 1:
        moments = torch.diagonal(U).reshape(-1, 1, 1).clone()
    else:
        up = torch.nn.functional.pad(U, (0, -cols % b, 0, -cols % b))
        moments = torch.stack([up[j : j + b, j : j + b] for j in range(0, up.shape[0], b)])
    xf = x.float()
    X, counts = observers.group_view(xf, spec)
    lo, hi = observers.group_minmax(X, counts)
    W = observers.input_weighting(xf, spec, moments)
    grid = observers.shrink_grid(X.device, observers.DEFAULT_SEARCH)
    s, zp = observers.int_params(lo[None, :] * grid[:, None], hi[None, :] * grid[:, None], spec)
    got = kernels.mse_errors(x, spec, s, zp, moments)
    want = torch.stack([observers._errors(X, counts, lo, hi, p, spec, W=W)[0] for p in grid])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert torch.equal(
        observers.mse_shrink(x, spec, moments=moments),
        observers.mse_shrink(x, spec, backend="reference", moments=moments),
    )
    if sym:  # the refinement's terms <q, x>, <q, q>, <d, d>, weighted and plain, against torch's
        p = grid[30]
        _, q, s1 = observers._errors(X, counts, lo, hi, p, spec)
        plain = lambda a, c: (a * c).sum(dim=1)  # noqa: E731
        for mom, inner, weighting in ((moments, W, W), (None, plain, None)):
            num, den, err = kernels.mse_refine_terms(x, spec, s1, mom)
            torch.testing.assert_close(num, inner(q.double(), X.double()), rtol=1e-12, atol=0)
            torch.testing.assert_close(den, inner(q.double(), q.double()), rtol=1e-12, atol=0)
            want_err = observers._errors(X, counts, lo, hi, p, spec, W=weighting)[0]
            torch.testing.assert_close(err, want_err, rtol=1e-12, atol=0)


def test_kernels_refuse_moments_that_do_not_fit():
    from qcompress.quant import kernels

    kernel_backend(None)
    spec = make_spec(4, symmetric=True, granularity="group", group_size=16)
    x, s = heavy((4, 48)), torch.full((1, 12), 0.1)
    with pytest.raises(RuntimeError, match=r"moments of shape \[3, 8, 8\] fit neither 3 blocks of 16 columns"):
        kernels.mse_errors(x, spec, s, None, torch.ones(3, 8, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"moments must be float64 \[blocks, b, b\]"):
        kernels.mse_refine_terms(x, spec, s[0], torch.ones(3, 16, 8, dtype=torch.float64))


def test_moments_that_do_not_fit_the_weight_are_refused():
    spec = make_spec(4, symmetric=True, granularity="group", group_size=16)
    with pytest.raises(ValueError, match=r"input moments of shape \(3, 8, 8\) do not fit .* per group of 16"):
        observers.mse_shrink(heavy((4, 48)), spec, moments=torch.ones(3, 8, 8, dtype=torch.float64))


# --- 2. calibration on a model ------------------------------------------------------------------


def doc(gran="group", gs=16, bits=4, start=None, period=0, in_forward=True, **kw):
    params = {
        "start_bits": start or bits,
        "target_bits": bits,
        "quantization_period": period,
        "granularity": gran,
        "ternary": False,
    }
    if gs:
        params["group_size"] = gs
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": in_forward,
                    "observer": "mse",
                    "observer_kwargs": {"weight_by": "inputs", **kw},
                },
                "different_groups": {"w": {"params": params}},
            }
        }
    }


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))


def batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(10, 32, generator=g) * torch.linspace(0.05, 2.0, 32) for _ in range(n)]


def blocks_of(U, b):
    n = -(-U.shape[0] // b) * b
    up = torch.nn.functional.pad(U, (0, n - U.shape[0], 0, n - U.shape[0]))
    return torch.stack([up[j : j + b, j : j + b] for j in range(0, n, b)])


def assert_moments_close(got, want):
    """The recorder multiplies each batch's blocks in float32 (summed over batches in float64), so
    an element near zero carries the float32 rounding of the larger products it sums: tolerance
    relative to the largest moment (1e-6, about 10 float32 ulps), far below the 1/N a miscounted
    token or a dropped cross term would cost."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_calibration_records_the_input_moments_and_rechooses_the_ranges():
    m = mlp()
    ref = copy.deepcopy(m)
    qc.init_compression(m, doc())
    before = m[0].qc_wq.shrink.clone()
    pre = copy.deepcopy(m)  # as the calibration batches see it: quantized, plain mse
    bs = batches()
    assert qc.calibrate_weight_ranges(m, bs) == 2
    u0 = torch.cat(bs).double()
    with torch.no_grad():  # the second Linear's input, by hand
        u2 = torch.relu(torch.cat([pre[0](b) for b in bs])).double()
    for mod, u in ((m[0], u0), (m[2], u2)):
        got = mod.qc_wq.store.input_moments
        assert got.dtype == torch.float64
        assert_moments_close(got, blocks_of(u.T @ u / u.shape[0], 16))
        cross = mod.qc_wq.store.input_cross  # cross_groups (the default): the whole E[u u^T] too
        assert cross.dtype == torch.float32
        assert_moments_close(cross.double(), u.T @ u / u.shape[0])
        w = mod.weight.detach()
        assert torch.equal(mod.qc_wq.shrink, observers.mse_shrink(w, mod.qc_wq.spec(), moments=got, cross=cross))
    assert not torch.equal(m[0].qc_wq.shrink, before)
    assert m.training  # mode restored
    # the weighted ranges cut the layer's output error on the calibration inputs, vs the plain mse
    plain = mlp()
    qc.init_compression(plain, doc())
    x = torch.cat(bs)
    with torch.no_grad():
        want = ref[0](x)
        e_w = float((nn.functional.linear(x, m[0].effective_weight(), m[0].bias) - want).square().sum())
        e_p = float((nn.functional.linear(x, plain[0].effective_weight(), plain[0].bias) - want).square().sum())
    assert e_w < e_p


def test_channel_granularity_records_the_diagonal():
    m = mlp()
    qc.init_compression(m, doc(gran="channel", gs=None))
    bs = batches()
    qc.calibrate_weight_ranges(m, bs)
    u = torch.cat(bs).double()
    assert_moments_close(m[0].qc_wq.store.input_moments, (u.square().mean(0)).reshape(-1, 1, 1))


def test_no_weighted_group_runs_nothing():
    m = mlp()
    plain = doc()
    plain["compression_training"]["weight_quantization"]["shared_parameters"]["observer_kwargs"] = {}
    qc.init_compression(m, plain)

    def boom():
        raise AssertionError("no batch may be drawn")
        yield

    assert qc.calibrate_weight_ranges(m, boom()) == 0


def test_a_step_without_calibration_warns_once_naming_the_group():
    m = mlp()
    qc.init_compression(m, doc())
    sched = qc.CompressionScheduler(m, doc())
    with pytest.warns(
        UserWarning,
        match=r"different_groups\.w: observer_kwargs\.weight_by is 'inputs', but no "
        r"input statistics .*calibrate_weight_ranges",
    ):
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()  # said once
    m2 = mlp()
    qc.init_compression(m2, doc())
    qc.calibrate_weight_ranges(m2, batches())
    sched2 = qc.CompressionScheduler(m2, doc())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched2.step()


def test_bit_drops_and_resume_reuse_the_moments():
    """8 -> 4 bits (drops at steps 2, 4, 6, 8): each drop re-searches with the recorded moments; a
    scheduler resumed from a state_dict (moments included) makes the same later drops."""
    cfg = doc(start=8, bits=4, period=2)
    cfg["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["period_growth"] = "linear"
    a = mlp()
    qc.init_compression(a, cfg)
    qc.calibrate_weight_ranges(a, batches())
    sa = qc.CompressionScheduler(a, cfg)
    for _ in range(3):
        sa.step()
    saved_model, saved_sched = copy.deepcopy(a.state_dict()), sa.state_dict()
    assert "input_moments" in saved_sched["modules"]["0"]["wq"]
    assert "input_cross" in saved_sched["modules"]["0"]["wq"]
    for _ in range(7):
        sa.step()
    assert a[0].qc_wq.bits == 4
    moments, cross = a[0].qc_wq.store.input_moments, a[0].qc_wq.store.input_cross
    assert torch.equal(
        a[0].qc_wq.shrink, observers.mse_shrink(a[0].weight.detach(), a[0].qc_wq.spec(), moments=moments, cross=cross)
    )
    b = mlp(seed=7)  # other weights, no calibration: all from the checkpoint
    qc.init_compression(b, cfg)
    b.load_state_dict(saved_model)
    sb = qc.CompressionScheduler(b, cfg)
    sb.load_state_dict(saved_sched)
    for _ in range(7):
        sb.step()
    assert torch.equal(b[0].qc_wq.store.input_moments, moments)
    assert torch.equal(b[0].qc_wq.store.input_cross, cross)
    assert torch.equal(b[0].qc_wq.shrink, a[0].qc_wq.shrink)
    assert torch.equal(b[0].effective_weight(), a[0].effective_weight())


def test_optimizer_step_mode_requantizes_with_the_weights_at_the_next_step():
    cfg = doc(in_forward=False)
    m = mlp()
    w = m[0].weight.detach().clone()
    qc.init_compression(m, cfg)
    sched = qc.CompressionScheduler(m, cfg)
    qc.calibrate_weight_ranges(m, batches())
    sched.step()  # no optimizer step between: the master is w
    want = observers.mse_shrink(
        w, m[0].qc_wq.spec(), moments=m[0].qc_wq.store.input_moments, cross=m[0].qc_wq.store.input_cross
    )
    assert torch.equal(m[0].qc_wq.shrink, want)
    s, z = observers.weight_params(w, m[0].qc_wq.spec(), "mse", shrink=want)
    y = qc.quant.api.fake_quantize_spec(w, m[0].qc_wq.spec(), scale=s, zero_point=z)
    assert torch.equal(m[0].weight.detach(), y)


def test_tied_embedding_and_head_take_the_heads_moments_and_export_once(tmp_path):
    pytest.importorskip("transformers", reason="GPT-2 from transformers")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from tests.helpers.tiny_models import make_gpt2

    m = make_gpt2()
    cfg = doc(gs=16)
    qc.init_compression(m, cfg)
    wte, head = m.transformer.wte, m.lm_head
    assert wte.weight is head.weight and wte.qc_wq.store is head.qc_wq.store
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, m.config.vocab_size, (2, 12), generator=g) for _ in range(2)]
    seen = []
    h = head.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    qc.calibrate_weight_ranges(m, ids)
    h.remove()
    u = torch.cat(seen).double()
    assert_moments_close(head.qc_wq.store.input_moments, blocks_of(u.T @ u / u.shape[0], 16))
    assert torch.equal(wte.qc_wq.shrink, head.qc_wq.shrink)  # one tensor, one shrink
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qc.export_quantized(m, tmp_path / "g", cfg)
    conf = json.loads((tmp_path / "g" / "config.json").read_text())
    weights = [g["weights"] for g in conf["quantization_config"]["config_groups"].values() if g.get("weights")]
    assert weights and all(w["observer"] == "mse" for w in weights)
    for w in weights:
        assert w["observer_kwargs"] == {"grid": 100, "maxshrink": 0.8, "norm": 2.0}  # weight_by stays home
        QuantizationArgs.model_validate(w)
    fresh = qc.load_quantized(tmp_path / "g", make_gpt2(seed=3))
    assert torch.equal(fresh.lm_head.weight, head.effective_weight().detach())
    assert torch.equal(fresh.transformer.wte.weight, head.effective_weight().detach())


# --- 3. several ranks ---------------------------------------------------------------------------


def _ranks(rank, world, _):
    import torch
    import qcompress as qc

    m = mlp()
    qc.init_compression(m, doc())
    bs = batches(n=2, seed=10 + rank)  # each rank its own batches
    qc.calibrate_weight_ranges(m, bs)
    return {"moments": m[0].qc_wq.store.input_moments, "shrink": m[0].qc_wq.shrink, "inputs": torch.cat(bs)}


def test_ranks_pool_their_moments_and_choose_the_same_ranges(tmp_path):
    from tests.helpers.dist_utils import run_ranks

    res = run_ranks(_ranks, 2, str(tmp_path), timeout=120)
    u = torch.cat([r["inputs"] for r in res]).double()
    want = blocks_of(u.T @ u / u.shape[0], 16)
    for r in res:
        assert_moments_close(r["moments"], want)
    assert torch.equal(res[0]["shrink"], res[1]["shrink"])


# --- 4. config ----------------------------------------------------------------------------------


def test_config_errors_name_the_key():
    bad = doc(norm=2.4)
    with pytest.raises(
        qc.ConfigError,
        match=r"shared_parameters\.observer_kwargs\.weight_by: 'inputs' weighs the "
        r"output's squared error, but norm is 2\.4",
    ):
        qc.load_config(bad)
    act = doc()
    act["compression_training"]["activation_quantization"] = {
        "shared_parameters": {
            "enabled": True,
            "range_calibration": "static",
            "observer": "mse",
            "observer_kwargs": {"weight_by": "inputs"},
        },
        "different_groups": {"a": {"params": {"bits": 8}}},
    }
    with pytest.raises(
        qc.ConfigError,
        match=r"activation_quantization\.shared_parameters\.observer_kwargs\."
        r"weight_by: 'inputs' weights a weight's error",
    ):
        qc.load_config(act)
    chunks = doc(gran=None, gs=None)
    del chunks["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["granularity"]
    chunks["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_groups"] = 4
    with pytest.raises(
        qc.ConfigError,
        match=r"different_groups\.w\.params\.observer_kwargs\.weight_by: 'inputs' .* "
        r"4 chunks",
    ):
        qc.init_compression(mlp(), chunks)
    typo = doc(weight_by="input")
    with pytest.raises(qc.ConfigError, match=r"observer_kwargs\.weight_by"):
        qc.load_config(typo)
