"""load_quantized(mode="fast") against mode="exact".

The oracle is the exact path (itself checked bit for bit against the trained model here and in
test_export.py). With the C++ extension every int Linear runs qcompress's own kernels (plans
lowbit / lowbit_a8, checked elementwise against a derived bound on odd shapes and every ISA in
test_lowbit_kernels.py; here through the same whole-model tolerances as below). The torch-kernel
plans (the only ones of a build without the extension) are tested with the extension switched
off. Tolerances:
- fp32 integer GEMMs (int_mm, int_mm24): the fast path sums code products exactly in int32 and rounds
  only when applying the two scales; the exact path rounds every product and partial sum in
  fp32. Their gap is float summation error, <= K * 2^-24 * sum|x^ w^| in the worst case and
  about sqrt(K) * 2^-24 of it in practice. We allow 1e-5 of the output scale (~170 * 2^-24 for
  K <= 256), while a wrong code, scale or zero point moves outputs by at least one
  quantization step (~1e-2 relative). int_mm24 also rounds each input token to 2^-24 of its
  largest entry, an error of the same size as fp32 rounding of the products.
- bf16 kernels (int8pack / int4pack): both paths round the output to bf16 (2^-8 relative) and
  either the weight (exact) or the scale / zero (fast) to bf16 (2^-8 relative each), so
  |fast - exact| <= 2^-7 * (|x| @ |W|^T) + 2^-7 * |exact| elementwise.
- lowbit / lowbit_a8 in fp32: the exact path's weight bit for bit, summed in another order (and
  integer sums for A8): within the same 1e-5 of the output scale; in bf16 the int8pack bound.
- dequant plan: same values as the exact weight, so outputs are bit-identical.
"""

import logging

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.export import export_quantized, load_quantized
from qcompress.export import fast as fastmod
from tests.helpers.fast_patch import patch_fast
from qcompress.export import quantized
from qcompress.quant import lowbit
from qcompress.export.errors import CheckpointError
from qcompress.export.fast import plans_of, tensor_bytes


def cfg_for(bits, symmetric=True, granularity="channel", group_size=None, act=None, modules=(".",)):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False, "granularity": granularity}
    if group_size:
        params["group_size"] = group_size
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "symmetric" if symmetric else "asymmetric",
                },
                "different_groups": {"wq1": {"params": params, "modules": list(modules)}},
            }
        }
    }
    if act:
        calib, asym = act
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": calib,
                "quantization_type": "asymmetric" if asym else "symmetric",
            },
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": list(modules)}},
        }
    return qcompress.load_config(doc)


def mlp(dtype):
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))
        .to(dtype)
        .eval()
    )


def export_and_load(tmp_path, make, cfg, calib_input, fuse=True):
    trained = make()
    qcompress.init_compression(trained, cfg)
    trained.train()
    trained(*calib_input)  # calibrates static activation ranges
    trained.eval()
    export_quantized(trained, tmp_path / "ckpt")
    exact = load_quantized(tmp_path / "ckpt", make()).eval()
    fast = load_quantized(tmp_path / "ckpt", make(), mode="fast", fuse_activations=fuse).eval()
    return trained, exact, fast


def no_float_weight(monkeypatch):
    """Make any per-call weight dequantization fail loudly."""

    def boom(*a, **k):
        raise AssertionError("a kernel plan dequantized the float weight in forward")

    patch_fast(monkeypatch, "planes_dequantize", boom)
    patch_fast(monkeypatch, "dequantize_record", boom)
    patch_fast(monkeypatch, "_lowbit_weight", boom)


def without_extension(monkeypatch):
    """Plan selection of a build without qcompress's kernels (torch's own kernels only)."""
    monkeypatch.setattr(lowbit, "available", lambda: False)


def meta_bytes(fast, exact):
    """What the kernels' layout may hold beyond the export: a zero point as one byte (offsets;
    the export packs it at the weight's width) and a scale per row for per-tensor weights. The
    codes themselves take no more than exported (out-features multiples of 16 and groups of
    multiples of 8 / 16 columns, as here)."""
    extra = 0
    em = dict(exact.named_modules())
    for name, m in fast.named_modules():
        if "lowbit_scales" in getattr(m, "_buffers", {}):
            extra += m.lowbit_offsets.numel()
            extra += max(0, 4 * (m.lowbit_scales.numel() - em[name].weight_scale.numel()))
    return extra


needs_ext = pytest.mark.skipif(not lowbit.available(), reason="the qcompress C++ extension is not built")

TORCH_CASES = [  # bits, sym, granularity, group, act, dtype, expected plan (no extension)
    (8, True, "channel", None, None, torch.float32, "int_mm24"),
    (8, False, "channel", None, None, torch.float32, "int_mm24"),
    (8, False, "tensor", None, None, torch.float32, "int_mm24"),
    (4, True, "group", 32, None, torch.float32, "dequant"),
    (4, False, "group", 64, None, torch.float32, "dequant"),
    (4, True, "group", 128, None, torch.float32, "dequant"),
    (8, True, "channel", None, ("dynamic", False), torch.float32, "int_mm"),
    (8, False, "channel", None, ("dynamic", True), torch.float32, "int_mm"),
    (8, True, "tensor", None, ("static", True), torch.float32, "int_mm"),
    (8, False, "channel", None, ("static", False), torch.float32, "int_mm"),
    (8, True, "channel", None, None, torch.bfloat16, "int8pack"),
    (8, True, "channel", None, ("dynamic", False), torch.bfloat16, "int_mm"),
    (4, True, "group", 32, None, torch.bfloat16, "int4pack"),
    (4, False, "group", 64, None, torch.bfloat16, "int4pack"),
    (4, True, "group", 128, None, torch.bfloat16, "int4pack"),
    (4, False, "group", 128, None, torch.bfloat16, "int4pack"),
]
# with the extension, the same layers run qcompress's kernels
CASES = (
    [c + (False,) for c in TORCH_CASES]
    + [c[:6] + ("lowbit_a8" if c[4] else "lowbit", True) for c in TORCH_CASES]
    + [
        (2, False, "group", 16, None, torch.float32, "lowbit", True),
        (8, False, "group", 32, ("static", True), torch.float32, "lowbit_a8", True),
    ]
)


@pytest.mark.parametrize("bits,sym,gran,gs,act,dtype,plan,ext", CASES)
def test_fast_matches_exact_layer_by_layer(tmp_path, monkeypatch, bits, sym, gran, gs, act, dtype, plan, ext):
    if ext and not lowbit.available():
        pytest.skip("the qcompress C++ extension is not built")
    if not ext:
        without_extension(monkeypatch)
    g = torch.Generator().manual_seed(1)
    calib = (torch.randn(6, 256, generator=g).to(dtype),)
    trained, exact, fast = export_and_load(tmp_path, lambda: mlp(dtype), cfg_for(bits, sym, gran, gs, act), calib)
    assert set(plans_of(fast).values()) == {plan}
    assert tensor_bytes(fast) <= tensor_bytes(exact) + meta_bytes(fast, exact)
    x = torch.randn(3, 5, 256, generator=g).to(dtype)  # 3-D input: tokens flattened
    with torch.no_grad():
        assert torch.equal(exact(x), trained(x))  # the oracle is the trained model
        if plan != "dequant":
            no_float_weight(monkeypatch)
        h = x
        for i, (e, f) in enumerate(zip(exact, fast)):
            want, got = e(h), f(h)
            assert got.dtype == want.dtype and got.shape == want.shape
            if plan == "dequant" or not isinstance(e, nn.Linear):
                assert torch.equal(got, want), f"layer {i}"
            elif dtype == torch.float32:  # tests/quant/test_lowbit_kernels.py's bound: float32 sums, and
                xin = e._qx_input(h).double()  # the int8 digits of the input (amax / 64000 per element)
                w = e.weight.double().abs()
                b = 0.0 if e.bias is None else e.bias.double().abs()
                bound = (6 * w.shape[1] + 16) * 2.0**-24 * (xin.abs() @ w.t() + b) + xin.abs().amax(
                    -1, keepdim=True
                ) / 64000 * w.sum(-1)
                worst = float(((got.double() - want.double()).abs() / bound).max())
                assert worst <= 1, f"layer {i}: {worst:.3g} x bound"
            else:
                xin = e._qx_input(h).float()
                bound = 2.0**-7 * (xin.abs() @ e.weight.float().abs().t() + want.float().abs())
                assert bool(((got.float() - want.float()).abs() <= bound).all()), f"layer {i}"
            h = want


@needs_ext
@pytest.mark.parametrize(
    "bits,sym,gran,gs,act",
    [
        (8, True, "channel", None, ("dynamic", False)),  # int-quantized, lowbit_a8
        (8, False, "tensor", None, None),  # int-quantized zero point [1]
        (4, False, "group", 32, None),  # packed codes and zero points
        (4, False, "channel", None, ("static", True)),
        (2, False, "tensor", None, None),  # packed codes, zero point [1]
        (5, False, "group", 64, None),  # odd width in int8
    ],
)
def test_lowbit_weight_and_state_dict(tmp_path, bits, sym, gran, gs, act):
    # the kernel layout gives the exported tensors back (names, dtypes, shapes, values) and the
    # exact path's float weight, bit for bit
    g = torch.Generator().manual_seed(2)
    calib = (torch.randn(6, 256, generator=g),)
    _, exact, fast = export_and_load(tmp_path, lambda: mlp(torch.float32), cfg_for(bits, sym, gran, gs, act), calib)
    assert set(plans_of(fast).values()) == {"lowbit_a8" if act else "lowbit"}
    assert "lowbit_packed" in fast[0]._buffers
    a, b = exact.state_dict(), fast.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
    for e, f in zip(exact, fast):
        if isinstance(e, nn.Linear):
            assert torch.equal(f.weight, e.weight)


def test_fast_weight_and_state_dict(tmp_path, monkeypatch):
    without_extension(monkeypatch)
    g = torch.Generator().manual_seed(2)
    calib = (torch.randn(6, 256, generator=g),)
    _, exact, fast = export_and_load(
        tmp_path, lambda: mlp(torch.float32), cfg_for(8, True, "channel", act=("dynamic", False)), calib
    )
    # int_mm keeps the exported int8 codes: weight and state_dict are those of the exact path
    assert torch.equal(fast[0].weight, exact[0].weight)
    a, b = exact.state_dict(), fast.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # an input that needs a gradient takes the differentiable exact path (kernels have no backward)
    xe = torch.randn(4, 256, generator=g, requires_grad=True)
    xf = xe.detach().clone().requires_grad_(True)
    exact(xe).square().sum().backward()
    fast(xf).square().sum().backward()
    assert torch.equal(xe.grad, xf.grad)
    if lowbit.available():  # the same with qcompress's kernels (lowbit_a8)
        monkeypatch.undo()
        fast_k = load_quantized(tmp_path / "ckpt", mlp(torch.float32), mode="fast")
        assert set(plans_of(fast_k).values()) == {"lowbit_a8"}
        xk = xe.detach().clone().requires_grad_(True)
        fast_k(xk).square().sum().backward()
        assert torch.equal(xe.grad, xk.grad)
        without_extension(monkeypatch)

    # dequant plan on re-laid-out 4-bit planes: state_dict gives the exported tensors back
    _, exact_p, fast_p = export_and_load(
        tmp_path / "planes", lambda: mlp(torch.float32), cfg_for(4, False, "group", 32), calib
    )
    assert set(plans_of(fast_p).values()) == {"dequant"} and "fast_planes" in fast_p[0]._buffers
    a, b = exact_p.state_dict(), fast_p.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(fast_p[0].weight, exact_p[0].weight)

    _, exact4, fast4 = export_and_load(
        tmp_path / "w4", lambda: mlp(torch.bfloat16), cfg_for(4, False, "group", 32), (calib[0].bfloat16(),)
    )
    # int4pack: `weight` is what the kernel uses, (u - 8) * s + z with s and z = -zp * s in bf16:
    # each rounding is <= 2^-9 of at most 16 steps s, so it is within s / 8 of the exact weight,
    # while one wrong code would be a whole step s off
    w_fast, w_exact = fast4[0].weight.float(), exact4[0].weight.float()
    assert w_fast.shape == w_exact.shape
    step = exact4[0].weight_scale.repeat_interleave(32, dim=1)
    assert bool(((w_fast - w_exact).abs() <= step / 8).all())
    with pytest.raises(CheckpointError, match="mode='exact'"):
        fast4.state_dict()


def test_digits_are_exact_and_fine():
    # int_mm24's activation split: the three int8 digits rebuild the 24-bit integers exactly, and
    # those are within half a step (2^-24 of the row's largest |x|, ~1 fp32 ulp) of the input
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-20, 20, 6).reshape(6, 1)
    x[1] = 0.0
    x[2, :] = -3.0  # every entry at the extreme of the grid
    x[3, 7] = 1e6  # one dominant entry
    (a1, a2, a3), big, sx = fastmod._digits(x)
    assert a1.dtype == a2.dtype == a3.dtype == torch.int8
    rebuilt = a1.double() * 65536 + a2.double() * 256 + a3.double()
    assert torch.equal(rebuilt, big.double())
    step = sx.double()
    assert bool(((big.double() * step - x.double()).abs() <= 0.5 * step * (1 + 1e-6)).all())
    assert bool((x.abs().amax(dim=1, keepdim=True).double() <= fastmod._D1 * step * (1 + 1e-6)).all())


def test_bad_mode(tmp_path):
    with pytest.raises(ValueError, match="'turbo'"):
        load_quantized(tmp_path, mlp(torch.float32), mode="turbo")


class Mixed(nn.Module):
    """Linear layers the kernels run, and layers that must fall back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 48)  # W8A8 -> lowbit_a8 (no extension: int_mm)
        self.two = nn.Linear(48, 32)  # 2-bit -> lowbit (no extension: dequant)
        self.conv = nn.Conv2d(4, 8, 3)  # conv -> dequant

    def forward(self, x, img):
        return self.two(torch.relu(self.fc(x))), self.conv(img)


@pytest.mark.parametrize("ext", [False, True])
def test_fallback_is_exercised_and_logged(tmp_path, caplog, monkeypatch, ext):
    if ext and not lowbit.available():
        pytest.skip("the qcompress C++ extension is not built")
    if not ext:
        without_extension(monkeypatch)
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "w8": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}, "modules": ["fc"]},
                    "w2": {
                        "params": {
                            "start_bits": 2,
                            "target_bits": 2,
                            "ternary": False,
                            "granularity": "group",
                            "group_size": 16,
                        },
                        "modules": ["two", "conv"],
                    },
                },
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
                "different_groups": {"a": {"params": {"bits": 8}, "modules": ["fc"]}},
            },
        }
    }
    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(5, 64, generator=g), torch.randn(2, 4, 7, 7, generator=g))
    with caplog.at_level(logging.INFO, logger="qcompress.export.fast"):
        trained, exact, fast = export_and_load(
            tmp_path, lambda: (torch.manual_seed(0), Mixed())[1], qcompress.load_config(doc), inputs
        )
    text = caplog.text
    if ext:
        assert plans_of(fast) == {"fc": "lowbit_a8", "two": "lowbit", "conv": "dequant"}
        assert "1 x dequant, 1 x lowbit, 1 x lowbit_a8" in text
        assert f"lowbit kernels use {lowbit.isa()}" in text
        assert "'two' falls back" not in text
    else:
        assert plans_of(fast) == {"fc": "int_mm", "two": "dequant", "conv": "dequant"}
        assert "'two' falls back" in text and "2-bit group" in text
    assert "'conv' falls back" in text and "conv layer" in text
    assert "'fc' falls back" not in text
    with torch.no_grad():
        (ye, ce), (yf, cf) = exact(*inputs), fast(*inputs)
    assert torch.equal(ce, cf)
    # float32 weight-only layers take the input as int8 digits (within amax / 64000 of each element;
    # every layer's bound: tests/quant/test_lowbit_kernels.py), carried through two layers here
    assert (yf - ye).abs().max().item() <= 1e-4 * ye.abs().max().item()
    assert tensor_bytes(fast) <= tensor_bytes(exact)


@needs_ext
def test_lowbit_plan_refuses_overlong_groups():
    # the int32 sums of the kernels hold groups of at most lowbit.MAX_GROUP columns
    mod = fastmod._QLinear.__new__(type("QL", (fastmod._QLinear, nn.Linear), {}))
    rec = {
        "kind": "linear",
        "qtype": "int",
        "dtype": "float32",
        "weight_shape": [4, 40000],
        "input_activations": None,
        "weights": {"num_bits": 4, "strategy": "group", "group_size": 20000, "symmetric": True},
    }
    assert fastmod.choose_plan(mod, rec) == ("dequant", "group size 20000 above the kernels' 16384")
    rec["weights"] = dict(rec["weights"], strategy="channel", group_size=None)  # chunked: kernels
    assert fastmod.choose_plan(mod, rec) == ("lowbit", "")


@pytest.mark.parametrize(
    "dtype,ext", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)]
)
def test_transformers_bert_fast_matches_exact(tmp_path, monkeypatch, dtype, ext):
    pytest.importorskip("transformers")
    if ext and not lowbit.available():
        pytest.skip("the qcompress C++ extension is not built")
    if not ext:
        without_extension(monkeypatch)
    from transformers import BertConfig, BertModel

    conf = BertConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
    )

    def make():
        torch.manual_seed(0)
        return BertModel(conf).to(dtype).eval()

    if dtype == torch.float32:  # W8A8 attention (int_mm), W8 feed-forward (int_mm24), W4 pooler
        cfg = qcompress.load_config(
            {
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                        "different_groups": {
                            "enc": {
                                "params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"},
                                "modules": ["encoder"],
                            },
                            "pool": {
                                "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 32},
                                "modules": ["pooler"],
                            },
                        },
                    },
                    "activation_quantization": {
                        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
                        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["attention"]}},
                    },
                }
            }
        )
        want = {"lowbit_a8", "lowbit"} if ext else {"int_mm", "int_mm24", "dequant"}
    else:  # W4 group 32 everywhere (int4pack)
        cfg = cfg_for(4, False, "group", 32, modules=("encoder", "pooler"))
        want = {"lowbit"} if ext else {"int4pack"}
    ids = torch.randint(0, 99, (2, 11), generator=torch.Generator().manual_seed(4))
    trained, exact, fast = export_and_load(tmp_path, make, cfg, (ids,))
    assert set(plans_of(fast).values()) == want
    assert tensor_bytes(fast) <= tensor_bytes(exact) + meta_bytes(fast, exact)
    with torch.no_grad():
        e = exact(input_ids=ids).last_hidden_state.float()
        f = fast(input_ids=ids).last_hidden_state.float()
        assert torch.equal(exact(input_ids=ids).last_hidden_state, trained(input_ids=ids).last_hidden_state)
    err = (f - e).abs().max().item()
    if dtype == torch.float32:
        # per-layer gaps of 1e-5 relative pass through LayerNorm (unit-scale outputs) twice
        assert err <= 1e-4 * e.abs().max().item(), err
    else:
        # bf16: per-layer 2^-7 gaps (see the module docstring) through two LayerNorm'd blocks;
        # a wrong group, scale or zero point gives O(1) differences after LayerNorm
        assert err <= 2.0**-3 * e.abs().max().item(), err
        assert (f - e).abs().mean().item() <= 2.0**-6 * e.abs().mean().item()


@pytest.mark.skipif(not lowbit.available(), reason="needs the compiled lowbit kernels")
@pytest.mark.parametrize(
    "act,direct",
    [
        (None, True),  # lowbit: weight-only float input
        (("dynamic", False), True),  # lowbit_a8, dynamic per-token codes in one call
        (("dynamic", True), True),
        (("static", True), False),  # static range: codes made in Python first (general path)
    ],
)
def test_direct_call_matches_general_path(tmp_path, monkeypatch, act, direct):
    # the per-call shortcut (_direct) runs the same op on the same tensors as the general path, so
    # outputs are equal bit for bit; under autograd the general path runs (activations not fused:
    # a fused GELU is the kernel's, the general path's torch's; tests/export/test_export_fuse.py)
    g = torch.Generator().manual_seed(5)
    calib = (torch.randn(6, 256, generator=g),)
    _, exact, fast = export_and_load(
        tmp_path, lambda: mlp(torch.float32), cfg_for(4, True, "group", 32, act), calib, fuse=False
    )
    mods = [m for m in fast if hasattr(m, "qx_plan")]
    assert all((m.qx_direct is not None) == direct for m in mods)
    calls = []
    real = fastmod._direct
    patch_fast(monkeypatch, "_direct", lambda m, x: calls.append(real(m, x) is not None) or real(m, x))
    for x in (torch.randn(1, 256, generator=g), torch.randn(3, 33, 256, generator=g)):
        with torch.no_grad():
            y_direct = fast(x)
            saved = [m.qx_direct for m in mods]
            for m in mods:
                m.qx_direct = None
            y_general = fast(x)
            for m, d in zip(mods, saved):
                m.qx_direct = d
        assert torch.equal(y_direct, y_general)  # (fast against exact: the tests above)
    assert any(calls) == direct
    calls.clear()
    x = torch.randn(2, 256, generator=g, requires_grad=True)
    fast(x).sum().backward()  # autograd: the general path (a float weight), with gradients
    assert x.grad is not None and not any(calls)


@pytest.mark.parametrize("act", [None, ("dynamic", False), ("static", True)])
def test_loaded_models_pickle_and_deepcopy(tmp_path, act):
    # the loaded-module classes are made at load time; torch.save(model) (pickle) names the model's
    # own classes and the mixins instead, and the unpickled model runs the same plan with the same
    # outputs; it loads with weights_only=True given qcompress.export.pickle_globals() and the
    # model's own classes
    import copy
    import io
    from qcompress.export import pickle_globals

    g = torch.Generator().manual_seed(9)
    _, exact, fast = export_and_load(
        tmp_path, lambda: mlp(torch.float32), cfg_for(4, True, "group", 32, act), (torch.randn(6, 256, generator=g),)
    )
    x = torch.randn(3, 256, generator=g)
    for model in (exact, fast):
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        with torch.serialization.safe_globals(pickle_globals() + [nn.Sequential, nn.Linear, nn.GELU]):
            back = torch.load(buf, weights_only=True)
        for other in (back, copy.deepcopy(model)):
            assert [type(m).__name__ for m in other] == [type(m).__name__ for m in model]
            assert plans_of(other) == plans_of(model)
            with torch.no_grad():
                assert torch.equal(other(x), model(x))
            if lowbit.available() and model is fast:
                assert all(
                    (m.qx_direct is None) == (n.qx_direct is None)
                    for m, n in zip(other, model)
                    if hasattr(m, "qx_plan")
                )


@pytest.mark.parametrize(
    "bits,sym,gran,gs,plan",
    [
        (4, True, "group", 16, "gather"),  # pack-quantized, per-row groups
        (2, True, "channel", None, "gather"),
        (8, False, "channel", None, "gather"),  # int-quantized: zero points per row, gathered with it
        (8, True, "tensor", None, "gather"),  # one scale for the table
        (4, False, "group", 16, "dequant"),  # packed zero points run across rows: whole table
    ],
)
def test_embedding_gathers_only_the_looked_up_rows(tmp_path, monkeypatch, bits, sym, gran, gs, plan):
    # oracle: F.embedding on the whole dequantized table (the `weight` property, checked against the
    # trained model in test_export.py); gathering the rows' codes must give the same bits
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 8)).eval()

    ids = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(2))
    cfg = cfg_for(bits, sym, gran, gs, modules=["0"])
    _, exact, fast = export_and_load(tmp_path, make, cfg, (ids,))
    assert plans_of(fast)["0"] == plan
    for model in (exact, fast):
        emb = model[0]
        want = torch.nn.functional.embedding(ids, emb.weight)
        calls = []
        real = quantized.gather_rows
        monkeypatch.setattr(quantized, "gather_rows", lambda *a: calls.append(1) or real(*a))
        assert torch.equal(emb(ids), want)
        assert bool(calls) == (plan == "gather")
        monkeypatch.setattr(quantized, "gather_rows", real)
        emb.max_norm = 1.0  # renormalizing rows: the whole table, as F.embedding does
        assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, emb.weight, max_norm=1.0))
        emb.max_norm = None
