"""Learned float-format scales (quant/float_observers.py): FP8 scales and NVFP4's block and global
scales. Their gradients equal autograd's on the reference formula with the roundings passed
straight through, learning lowers the quantization error, and export writes the scales forward
used (compressed-tensors decompresses effective_weight bit for bit; reloads are exact)."""

import copy

import pytest
import torch

import qcompress as qc
from qcompress.quant import float_observers as fo
from qcompress.quant import floats
from tests.helpers.float_fixtures import export_round_trip, float_mlp, float_weight_doc

ct = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)"
)


def _ste(rounded, u):
    return u + (rounded - u).detach()


def reference(x, spec, sigma, g):
    """x^ written as the formula, every rounding straight through, differentiated by autograd:
    NVFP4 s = e4m3(clamp(sigma g, 2^-9, 448)) / g, FP8 s = sigma; x^ = cast(clamp(x / s)) s."""
    if g is None:
        s = sigma
    else:
        c = torch.clamp(sigma * g, 2.0**-9, 448.0)
        s = _ste(c.to(torch.float8_e4m3fn).to(torch.float32), c) / g
    # the division rounds in the dtype torch's promotion gives it (FP8 in bf16: bf16), passed through
    v_used = x.detach() / s.detach().to(x.dtype) if g is None else x.detach().to(torch.float32) / s.detach()
    v = _ste(v_used.to(torch.float32), x.to(torch.float32) / s)
    v = torch.clamp(v, -spec.qmax, spec.qmax)
    q = _ste(v.detach().to(torch.float8_e4m3fn).float() if spec.bits == 8 else floats._e2m1(v.detach()), v)
    return q * s


def _expand(s, spec, shape):
    """A scale [rows, 1] / [rows, groups] / [R, C] / [1] broadcast to each element of a 2-D weight."""
    rows, cols = shape
    if spec.granularity == "group":
        return s.repeat_interleave(spec.group_size, dim=1)
    if spec.granularity == "block":
        return s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "fmt,gran", [("fp8_e4m3", "tensor"), ("fp8_e4m3", "channel"), ("fp8_e4m3", "block"), ("nvfp4", "group")]
)
def test_gradients_equal_autograd_on_the_reference_formula(fmt, gran, dtype):
    torch.manual_seed(0)
    spec = floats.float_spec(fmt, gran)
    x = (torch.randn(136, 160) * 0.05).to(dtype).requires_grad_(True)
    s0, g0 = floats.qparams(x.detach(), spec)
    sigma, g = fo.learned_init(x, spec, s0, g0)
    sigma = (sigma * (0.8 + 0.4 * torch.rand_like(sigma))).requires_grad_(True)  # some clip, some not
    g = None if g is None else (g * 1.3).requires_grad_(True)  # some blocks saturate
    y = fo.fake_quantize_learned(x, spec, sigma, g, grad_scale=1.0)
    w = torch.randn(y.shape).to(dtype).float()  # the gradient y receives is in its dtype
    (y.float() * w).sum().backward()

    x2 = x.detach().clone().requires_grad_(True)
    sigma2 = sigma.detach().clone().requires_grad_(True)
    g2 = None if g is None else g.detach().clone().requires_grad_(True)
    sig_e = sigma2 if fmt == "nvfp4" else _ste(sigma2.detach().to(dtype).float(), sigma2)  # FP8: stored dtype
    y2 = reference(x2, spec, _expand(sig_e, spec, x.shape), g2)
    assert torch.equal(y2.detach().to(dtype), y.detach())
    (y2 * w).sum().backward()
    assert torch.allclose(x.grad.float(), x2.grad.float())
    tol = 1e-5 * float(sigma2.grad.abs().max())
    assert torch.allclose(sigma.grad, sigma2.grad, rtol=1e-4, atol=tol)
    if g is not None:
        assert g2.grad.abs() > 0
        assert torch.allclose(g.grad, g2.grad, rtol=1e-3, atol=1e-6 * float(g2.grad.abs()))


def test_default_gradient_scale_is_lsq():
    spec = floats.float_spec("nvfp4", "group")
    x = torch.randn(32, 64)
    s, g = fo.learned_init(x, spec, *floats.qparams(x, spec))
    grads = []
    for gs in (None, 1.0):
        sp = s.clone().requires_grad_(True)
        fo.fake_quantize_learned(x, spec, sp, g, grad_scale=gs).sum().backward()
        grads.append(sp.grad)
    assert torch.allclose(grads[0], grads[1] / (16 * 6.0) ** 0.5)


# --- modules --------------------------------------------------------------------------------


def _doc(fmt, gran=None, observer="minmax"):
    return float_weight_doc(fmt, gran, range_learning=True, observer=observer)


_mlp = float_mlp


def _compressed(doc, dtype):
    model = _mlp(dtype)
    cfg = qc.load_config(doc)
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    return model


CASES = [
    ("fp8_e4m3", "channel", torch.float32, 3e-6),
    ("fp8_e4m3", "block", torch.bfloat16, 3e-6),
    ("nvfp4", None, torch.float32, 2e-4),
    ("nvfp4", None, torch.bfloat16, 2e-4),
]


@pytest.mark.parametrize("observer", ["minmax", "mse"])
@pytest.mark.parametrize("fmt,gran", [("fp8_e4m3", "tensor"), ("nvfp4", None)])
def test_learned_scales_start_at_the_observers(fmt, gran, observer):
    model = _compressed(_doc(fmt, gran, observer), torch.float32)
    names = {n for n, _ in model[0].named_parameters()}
    assert names == {"weight", "bias", "weight_scale"} | ({"weight_global_scale"} if fmt == "nvfp4" else set())
    w = model[0].weight.detach()
    spec = model[0].qc_wq.spec()
    if observer == "mse":
        s, g = fo.scales_with_shrink(w, spec, fo.mse_shrink(w, spec))
    else:
        s, g = floats.qparams(w, spec)
    assert torch.equal(model[0].effective_weight(), floats.fake_quantize_float(w, spec, scale=s, gscale=g))


@pytest.mark.parametrize("fmt,gran,dtype,lr", CASES, ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}" for c in CASES])
def test_learning_lowers_the_error_and_exports_what_forward_used(tmp_path, fmt, gran, dtype, lr):
    model = _compressed(_doc(fmt, gran), dtype)
    teacher = _mlp(dtype)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 64, generator=gen).to(dtype) for _ in range(60)]
    held = torch.randn(256, 64, generator=gen).to(dtype)

    def error():
        with torch.no_grad():
            return float((model(held).float() - teacher(held).float()).square().mean())

    before = error()
    weights = [m.weight.detach().clone() for m in (model[0], model[2])]
    qc.learn_ranges(model, batches, loss=lambda m, x: (m(x).float() - teacher(x).float()).square().mean(), lr=lr)
    after = error()
    print(f"{fmt} {gran} {dtype}: output mse {before:.3e} -> {after:.3e} after 60 range-learning steps")
    assert after < 0.97 * before
    assert all(torch.equal(w, m.weight) for w, m in zip(weights, (model[0], model[2])))

    tensors, x, want = export_round_trip(model, tmp_path / "out", _mlp(dtype), dtype)
    for i in (0, 2):
        mod = model[i]
        local = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith(f"{i}.")}
        s, g = fo.learned_scales(
            mod.weight, mod.qc_wq.spec(), mod.weight_scale, mod._parameters.get("weight_global_scale")
        )
        assert torch.equal(local["weight_scale"].to(s.dtype).reshape(s.shape), s)  # stored as forward used it
        if g is not None:
            assert local["weight_scale"].dtype == torch.float8_e4m3fn
            assert torch.equal(local["weight_global_scale"], g)
        assert not torch.equal(s, floats.qparams(mod.weight.detach(), mod.qc_wq.spec())[0]), "nothing was learned"
    # a state_dict carries the learned scales into a freshly compressed model
    again = _mlp(dtype)
    cfg = qc.load_config(_doc(fmt, gran))
    qc.init_compression(again, cfg)
    again.load_state_dict(copy.deepcopy(model.state_dict()))
    qc.CompressionScheduler(again, cfg).step()
    with torch.no_grad():
        assert torch.equal(again(x), want)
