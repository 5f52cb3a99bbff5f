"""load_quantized(mode="fast") on CUDA: W4 / W8 weights kept packed for torch's weight-only kernels.

Oracle: the exact reload (mode="exact"). On the CPU the layout conversion (export codes -> the
kernels' tensors) is checked against it through a re-implementation of int4mm.cu's dequantization
and through torch's CPU kernels that share the semantics (_weight_int4pack_mm_for_cpu reads the
same [K/group, N, 2] scales-and-zeros with bf16(u - 8) * scale + zero; _weight_int8pack_mm is the
same op as on CUDA). Bounds: the kernels round the scale and zero to bf16 (2^-9 relative each) and
the weight or output to bf16 once more, so |kernel - exact| <= 2^-7 (|exact| + |zero|) per weight
and 2^-7 (|x| @ |W|^T) + 2^-7 |exact| per output; a wrong code, nibble, group or zero sign is off
by a whole quantization step (>= 1/15 of a group's range). The tests marked cuda run the kernels
themselves on a GPU and skip elsewhere with the reason printed.
"""

import os

import pytest
import torch
import torch.nn as nn

from qcompress.export import export_quantized, load_quantized
from qcompress.export import fast as fastmod
from qcompress.export import fast_cuda
from qcompress.export.fast import plans_of, tensor_bytes

from tests.export.test_export_fast import cfg_for
import qcompress

BF = torch.bfloat16
EPS = 2.0**-7


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 64)).to(BF).eval()


def _export(tmp_path, bits, sym, gran, gs, make=_mlp):
    model = make()
    qcompress.init_compression(model, cfg_for(bits, symmetric=sym, granularity=gran, group_size=gs))
    model.eval()
    export_quantized(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _exact_layers(folder, device="cpu"):
    exact = load_quantized(folder, _mlp().to(device))
    return exact, [m for m in exact.modules() if isinstance(m, nn.Linear)]


W4_CASES = [(True, "group", 32), (False, "group", 128), (False, "group", 64), (True, "channel", None)]


@pytest.mark.parametrize("sym,gran,gs", W4_CASES)
def test_int4_layout_reproduces_the_exact_weights(tmp_path, sym, gran, gs):
    _, layers = _exact_layers(_export(tmp_path, 4, sym, gran, gs))
    for mod in layers:
        if gran == "channel" and mod.in_features not in fast_cuda.INT4_GROUPS:
            continue
        q, s, z = fastmod._exported_codes(mod, mod.qx_rec)
        assert (z is None) == sym
        nibbles, sz = fast_cuda.int4_layout(q, s, z)
        assert nibbles.dtype == torch.uint8 and nibbles.shape == (mod.out_features, mod.in_features // 2)
        assert sz.shape == (s.shape[1], mod.out_features, 2) and sz.dtype == BF
        got = fast_cuda.int4_dequantize(nibbles, sz).float()
        want = mod.weight.float()
        bound = EPS * (want.abs() + sz[..., 1].t().float().abs().repeat_interleave(got.shape[1] // sz.shape[0], 1))
        assert ((got - want).abs() <= bound).all()
        step = s.repeat_interleave(got.shape[1] // s.shape[1], 1)  # one code step per weight
        assert (bound < 0.5 * step).all()  # so a wrong code cannot pass


@pytest.mark.parametrize("sym,gran,gs", W4_CASES[:3])
def test_int4_scales_and_zeros_read_as_torch_kernel_reads_them(tmp_path, sym, gran, gs):
    """torch's CPU int4 kernel, given the same codes and scales_and_zeros, computes x @ W^T with the
    W that int4_dequantize writes down (the CUDA kernel's formula) and the exact reload's output."""
    exact, layers = _exact_layers(_export(tmp_path, 4, sym, gran, gs))
    torch.manual_seed(1)
    for mod in layers:
        q, s, z = fastmod._exported_codes(mod, mod.qx_rec)
        nibbles, sz = fast_cuda.int4_layout(q, s, z)
        x = torch.randn(5, mod.in_features).to(BF)
        cpu_w = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_w, mod.in_features // s.shape[1], sz).float()
        w = fast_cuda.int4_dequantize(nibbles, sz).float()
        assert torch.allclose(y, x.float() @ w.t(), rtol=EPS, atol=EPS * (x.float().abs() @ w.abs().t()).max())
        want = (x @ mod.weight.t()).float()
        assert ((y - want).abs() <= EPS * (x.float().abs() @ mod.weight.float().abs().t()) + EPS * want.abs()).all()


@pytest.mark.parametrize("gran", ["channel", "tensor"])
def test_int8_layout_with_torch_kernel_matches_exact(tmp_path, gran):
    _, layers = _exact_layers(_export(tmp_path, 8, True, gran, None))
    torch.manual_seed(2)
    for mod in layers:
        q, s, z = fastmod._exported_codes(mod, mod.qx_rec)
        assert z is None
        codes, scales = fast_cuda.int8_layout(q, s)
        assert codes.dtype == torch.int8 and scales.shape == (mod.out_features,) and scales.dtype == BF
        x = torch.randn(7, mod.in_features).to(BF)
        y = torch.ops.aten._weight_int8pack_mm(x, codes, scales).float()
        want = (x @ mod.weight.t()).float()
        assert ((y - want).abs() <= EPS * (x.float().abs() @ mod.weight.float().abs().t()) + EPS * want.abs()).all()


def _rec(bits, strat="group", gs=128, sym=True, dtype="bfloat16", n=64, k=256, kind="linear", qtype="int"):
    return {
        "kind": kind,
        "qtype": qtype,
        "dtype": dtype,
        "weight_shape": [n, k],
        "weights": {"num_bits": bits, "strategy": strat, "group_size": gs, "symmetric": sym},
    }


def test_plan_choice_and_reasons():
    ampere = (8, 0)
    assert fast_cuda.choose(_rec(4), True, ampere) == ("int4pack_cuda", "")
    assert fast_cuda.choose(_rec(4, sym=False, gs=32), True, ampere) == ("int4pack_cuda", "")
    assert fast_cuda.choose(_rec(4, "channel", None, k=128), True, ampere) == ("int4pack_cuda", "")
    assert fast_cuda.choose(_rec(8, "channel", None), True, ampere) == ("int8pack_cuda", "")
    refused = {
        "group 96": _rec(4, gs=96, k=288),
        "n % 8": _rec(4, n=60),
        "float32": _rec(4, dtype="float32"),
        "2-bit": _rec(2),
        "asymmetric 8-bit": _rec(8, "channel", None, sym=False),
        "8-bit group": _rec(8),
        "conv": _rec(4, kind="conv"),
        "fp4": _rec(4, qtype="float"),
        "group 512": _rec(4, "channel", None, k=512),
    }
    for what, rec in refused.items():
        plan, why = fast_cuda.choose(rec, rec["kind"] == "linear", ampere)
        assert plan == "" and why, what
    assert fast_cuda.choose(_rec(4), True, (7, 5))[0] == ""
    assert fast_cuda.choose(_rec(4), False, ampere)[0] == ""  # a Linear subclass with its own forward


def test_inner_k_tiles():
    assert [fast_cuda.inner_k_tiles(k) for k in (128, 256, 64, 96, 32)] == [8, 8, 4, 2, 2]


def test_dense_mode_on_cpu_gives_the_fast_plans(tmp_path):
    folder = _export(tmp_path, 4, True, "group", 32)
    fast = load_quantized(folder, _mlp(), mode="fast")
    dense = load_quantized(folder, _mlp(), mode="dense")
    assert plans_of(dense) == plans_of(fast) and not set(plans_of(fast).values()) & set(fast_cuda.PLANS)
    x = torch.randn(3, 256).to(BF)
    assert torch.equal(dense[0](x), fast[0](x))


# --- on a GPU ----------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)),
    reason="needs a CUDA GPU of compute capability 8.0+ (torch's int4 weight-only kernel)",
)


def _disk_bytes(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(
    "bits,sym,gran,gs,plan",
    [
        (4, True, "group", 128, "int4pack_cuda"),
        (4, False, "group", 32, "int4pack_cuda"),
        (8, True, "channel", None, "int8pack_cuda"),
    ],
)
def test_cuda_packed_matches_exact_in_export_memory(tmp_path, bits, sym, gran, gs, plan):
    folder = _export(tmp_path, bits, sym, gran, gs)
    exact = load_quantized(folder, _mlp().cuda())
    fast = load_quantized(folder, _mlp().cuda(), mode="fast")
    dense = load_quantized(folder, _mlp().cuda(), mode="dense")
    assert set(plans_of(fast).values()) == {plan}
    assert not set(plans_of(dense).values()) & set(fast_cuda.PLANS)
    torch.manual_seed(3)
    for m in (1, 33, 256):
        x = torch.randn(m, 256, device="cuda").to(BF)
        h = exact[1](exact[0](x))  # layer by layer: same input for both
        for i, (e, f) in enumerate(((exact[0], fast[0]), (exact[2], fast[2]))):
            xin = x if i == 0 else h
            want, got = e(xin).float(), f(xin).float()
            bound = EPS * (xin.float().abs() @ e.weight.float().abs().t()) + EPS * want.abs()
            assert ((got - want).abs() <= bound).all(), (plan, m, i)
    # GPU bytes: the export's size (codes, scales, biases), not the dense bf16 model's
    fast_bytes, dense_bytes = tensor_bytes(fast), sum(p.numel() * 2 for p in _mlp().parameters())
    assert fast_bytes <= 1.1 * _disk_bytes(folder)
    assert fast_bytes < (0.35 if bits == 4 else 0.6) * dense_bytes
    assert torch.allclose(fast[0].weight.float(), exact[0].weight.float(), rtol=EPS, atol=0)


@pytest.mark.cuda
@needs_gpu
def test_cuda_unsupported_layers_fall_back_with_one_warning(tmp_path):
    folder = _export(tmp_path, 2, True, "group", 32)
    with pytest.warns(UserWarning, match="2-bit") as rec:
        fast = load_quantized(folder, _mlp().cuda(), mode="fast")
    assert len([w for w in rec if "CUDA layers keep" in str(w.message)]) == 1
    assert not set(plans_of(fast).values()) & set(fast_cuda.PLANS)
    exact = load_quantized(folder, _mlp().cuda())
    x = torch.randn(4, 256, device="cuda").to(BF)
    assert torch.allclose(fast(x).float(), exact(x).float(), rtol=EPS, atol=EPS)


def test_int8_module_plan_runs_on_torch_cpu_kernel(tmp_path):
    """The int8pack_cuda module wiring (buffers, forward with bias and leading dims, weight, no
    state_dict) on the CPU, where _weight_int8pack_mm has the same kernel contract."""
    folder = _export(tmp_path, 8, True, "channel", None)
    exact = load_quantized(folder, _mlp())
    mod = load_quantized(folder, _mlp())[0]
    fast_cuda.to_packed(mod, mod.qx_rec, "int8pack_cuda", *fastmod._exported_codes(mod, mod.qx_rec))
    fastmod._swap_fast(mod, "int8pack_cuda")
    assert set(mod._buffers) == {"cuda_int8", "cuda_scales"}
    x = torch.randn(2, 3, 256).to(BF)
    want = exact[0](x).float()
    got = mod(x)
    assert got.shape == want.shape and got.dtype == BF
    bound = EPS * (x.float().abs() @ exact[0].weight.float().abs().t() + exact[0].bias.float().abs()) + EPS * want.abs()
    assert ((got.float() - want).abs() <= bound).all()
    assert torch.allclose(mod.weight.float(), exact[0].weight.float(), rtol=EPS, atol=0)
    with pytest.raises(Exception, match="cannot be saved back"):
        mod.state_dict()
