"""qcompress's fused low-bit kernels (load_quantized(mode="fast") plans lowbit / lowbit_a8) against
the exact path, on every instruction set this CPU has (scalar, AVX2, AVX-512, AVX-512 VNNI, AMX).

Oracle: load_quantized(mode="exact") of the same export (itself checked bit for bit against the
trained model here and in test_export.py), and float64 sums for the raw operators.

Bound. The fast plans multiply by the exact path's float weight bit for bit (w = (q - zp) * s in
fp32; `weight` equality is asserted), so in float32 the outputs differ only in the rounding of
the K products and of their sums: each side is within gamma_{K+4} * (|x| @ |W|^T + |b|) of the
real-number result, gamma_n = n u / (1 - n u), u = 2^-24 (the standard bound for a length-K dot
product; +4 for the bias add and, on lowbit_a8, the group-scale products, the token scale and the
exact path's rounding of its fake-quantized input, while lowbit_a8's int32 group sums are exact).
Hence |fast - exact| <= (2K + 8) u (|x^| @ |W|^T + |b|) elementwise, x^ the quantized input.
The AMX weight-only kernel (16 tokens or more) sums differently: x is split into P <= 2 bf16
pieces, each rounded to nearest. bf16 (1 piece) and fp16 (2: 8 + at most 3 more significant bits)
are split exactly; float32's 2 pieces leave a rest |x - pieces| <= 2^-16 |x| (the high piece is
within 2^-8 |x|, the second rounds that rest to 8 bits: 2^-8 * 2^-8 |x|), i.e. at most
2^-16 (|x| @ |W|^T) per output, below the fp32 summation term for K >= 100. Every product
piece * (q - zp) is exact, the P * (group length) <= 2K of them are summed in fp32 per group,
then y += s_g * S_g (one rounding per group, ng <= K, and the bias): within gamma_{2K + K + 1}
* 1.01 (the pieces' magnitudes sum to at most 1.01 |x|) of the real result, so
|fast - exact| <= (4.1 K + 6) u (...) + 2^-16 (...) there; the tests use (6K + 16) u for every
kernel, plus a float32 term for the AMX tiles. Where the groups are whole 64-column steps and
unpadded, AMX takes float32 inputs as two int8 digits per element instead (csrc/cpu/lowbit_amx.h
digits), and so does the GEMV below 16 tokens on a CPU with VNNI (any group, through the W-A8
kernel): x^ = sx D per token, |x - x^| <= amax / 64000 with amax the token's largest |x|, and then
the W-A8 int32 sums (exact) and one rounding of 256 A0 + A1 per group; so the float32 term is
(amax / 64000) sum |W| per output, which also covers the pieces' 2^-16 (|x| @ |W|^T).
A wrong code, scale, zero point or group boundary moves an output by a quantization step,
about 2^-8 of it or more, far above (6K + 16) u <= 2^-14 here.
bfloat16 / float16 (unit roundoff u_d = 2^-8 / 2^-11): the kernels take the same (fake-quantized)
input, widened exactly to fp32, multiply by the fp32 weight and round only the result to the
dtype; the exact path rounds the weight to the dtype (u_d each), on lowbit_a8 also its
dequantized input (u_d each), sums in fp32 and rounds the result (u_d). So
|fast - exact| <= 2 u_d |x^| @ |W|^T + u_d (|exact| + |fast|) + the fp32 summation term above,
and |fast| <= |exact| + |fast - exact| turns the middle term into 2 u_d |exact| up to u_d^2.
float16 also has subnormals below 2^-14: a rounded weight or input entry can be off by 2^-25
absolutely, which adds 2^-25 (sum |x^| + sum |W| + 1) per output (the weights here never get that
small, the term is there for soundness).
"""

import functools
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.export import export_quantized, load_quantized
from tests.helpers.fast_patch import patch_fast
from qcompress.quant import lowbit
from qcompress.export.fast import plans_of

pytestmark = pytest.mark.skipif(not lowbit.available(), reason="the qcompress C++ extension is not built")

ALL_ISAS = ("scalar", "avx2", "avx512", "avx512_vnni", "amx")


def cpu_isas():
    best = lowbit.isa("auto")
    return ALL_ISAS[: ALL_ISAS.index(best) + 1]


@pytest.fixture(autouse=True)
def _restore_isa_and_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if lowbit.available():
        lowbit.isa("auto")


def cfg_for(bits, gran, gs, sym, act):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False, "granularity": gran}
    if gs:
        params["group_size"] = gs
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                },
                "different_groups": {"w": {"params": params}},
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
            "different_groups": {"a": {"params": {"bits": 8}}},
        }
    return qcompress.load_config(doc)


def odd_model(dtype):
    """In-features 100 / 37 / 50 and out-features 37 / 50 / 19: no multiple of the vector width
    (8, 16 rows), and partial last groups for group sizes 16 and 32."""
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 50, bias=False), nn.GELU(), nn.Linear(50, 19))
        .to(dtype)
        .eval()
    )


def export_pair(tmp_path, make, cfg, calib):
    trained = make()
    qcompress.init_compression(trained, cfg)
    trained.train()
    trained(calib)  # calibrates static activation ranges
    trained.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # partial groups: "only qcompress.load_quantized reads them"
        export_quantized(trained, tmp_path / "ckpt")
    exact = load_quantized(tmp_path / "ckpt", make())
    fast = load_quantized(tmp_path / "ckpt", make(), mode="fast")
    return trained, exact, fast


def no_float_weight(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel plan built the float weight in forward")

    for name in ("_lowbit_weight", "planes_dequantize", "dequantize_record"):
        patch_fast(monkeypatch, name, boom)


def digit_term(x, w):
    """The AMX float32 term of the docstring: (token amax / 64000) * sum |W| per output."""
    return x.double().abs().amax(-1, keepdim=True) / 64000 * w.double().abs().sum(-1)


def exact_and_bound(e, h, dtype, split_rest=False):
    """The exact layer's output on h and the elementwise bound of the docstring (split_rest: plus
    the AMX weight-only kernel's float32 term)."""
    want = e(h)
    xin = e._qx_input(h).double()
    w = e.weight.double()
    b = 0.0 if e.bias is None else e.bias.double().abs()
    mag = xin.abs() @ w.abs().t() + b
    fp32_sums = (6 * w.shape[1] + 16) * 2.0**-24 * mag
    if dtype == torch.float32:
        return want, fp32_sums + (digit_term(xin, w) if split_rest else 0.0)
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = 2 * u * (mag + want.double().abs()) + fp32_sums
    if dtype == torch.float16:  # subnormal rounding of weights, inputs and the result
        bound = bound + 2.0**-25 * (xin.abs().sum(-1, keepdim=True) + w.abs().sum(-1) + 1)
    return want, bound


def check(got, want, bound, where):
    assert got.dtype == want.dtype and got.shape == want.shape, where
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= bound).all()), f"{where}: worst {float((diff / bound.clamp_min(1e-30)).max()):.3g} x bound"


WEIGHTS = [  # bits, granularity, group size
    (4, "group", 32),  # pack-quantized, 4-bit container
    (2, "group", 16),  # pack-quantized 2-bit, in the 4-bit container
    (8, "channel", None),  # int-quantized, 8-bit container
    (5, "tensor", None),  # int-quantized 5-bit, one scale, 8-bit container
]
FP32_ACTS = [  # symmetric weights?, activation quantization (calibration, asymmetric)
    (True, None),
    (False, None),
    (True, ("dynamic", False)),
    (False, ("dynamic", True)),
    (False, ("static", True)),
]
HALF_WEIGHTS = WEIGHTS + [(8, "group", 32), (4, "channel", None)]  # W4/W8 x group/channel
HALF_ACTS = (None, ("dynamic", True))
CASES = [(w, sym, act, torch.float32) for w in WEIGHTS for sym, act in FP32_ACTS] + [
    (w, sym, act, dt)
    for dt in (torch.bfloat16, torch.float16)
    for w in HALF_WEIGHTS
    for sym in (True, False)
    for act in HALF_ACTS
]


@pytest.mark.parametrize(
    "weights,sym,act,dtype",
    CASES,
    ids=[
        f"w{w[0]}{w[1]}{w[2] or ''}-{'sym' if s else 'asym'}-"
        f"{'none' if a is None else a[0] + ('A' if a[1] else 'S')}-{str(d)[6:]}"
        for w, s, a, d in CASES
    ],
)
def test_kernels_match_exact_path(tmp_path, monkeypatch, weights, sym, act, dtype):
    bits, gran, gs = weights
    g = torch.Generator().manual_seed(bits)
    trained, exact, fast = export_pair(
        tmp_path,
        lambda: odd_model(dtype),
        cfg_for(bits, gran, gs, sym, act),
        torch.randn(6, 100, generator=g).to(dtype),
    )
    plan = "lowbit_a8" if act else "lowbit"
    assert set(plans_of(fast).values()) == {plan}
    for e, f in zip(exact, fast):
        if isinstance(e, nn.Linear):  # the kernels' weight is the exact path's, bit for bit
            assert torch.equal(f.weight, e.weight)
    inputs = [
        torch.randn(1, 100, generator=g).to(dtype),  # one token: the GEMV path
        torch.randn(3, 11, 100, generator=g).to(dtype),
    ]  # 33 tokens: tiles of 8/6/4/2 + rest
    with torch.no_grad():
        assert torch.equal(exact(inputs[1]), trained(inputs[1]))
        for x in inputs:
            h = x
            for i, (e, f) in enumerate(zip(exact, fast)):
                if not isinstance(e, nn.Linear):
                    h = e(h)
                    continue
                want, bound = exact_and_bound(e, h, dtype)
                # weight-only float32 on int8 digits or bf16 pieces: the AMX tiles (16+ tokens) and,
                # with VNNI, the digit GEMV (fewer tokens)
                tiles = h.numel() // h.shape[-1] >= 16
                split = {"amx": not act, "avx512_vnni": not act and not tiles}
                with monkeypatch.context() as mp:
                    no_float_weight(mp)
                    for isa in cpu_isas():
                        lowbit.isa(isa)
                        b = exact_and_bound(e, h, dtype, split_rest=True)[1] if split.get(isa) else bound
                        check(f(h), want, b, f"{isa}, {tuple(x.shape[:-1])} tokens, layer {i}")
                h = want


def test_isa_choice_and_refusal():
    best = lowbit.isa("auto")
    assert best in ALL_ISAS
    assert lowbit.isa() == best
    assert lowbit.isa("scalar") == "scalar" and lowbit.isa() == "scalar"
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'"):
        lowbit.isa("sse9")
    if best != "amx":
        with pytest.raises(RuntimeError, match="does not have"):
            lowbit.isa("amx")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512_vnni" in flags and " avx512bw" in flags:
        want = "amx" if all(f" {f}" in flags for f in ("amx_tile", "amx_int8", "amx_bf16")) else "avx512_vnni"
        assert best == want, f"the CPU has {want} but the kernels use {best}"
    env = dict(os.environ, QCOMPRESS_LOWBIT_ISA="scalar")
    out = subprocess.run(
        [sys.executable, "-c", "from qcompress.quant import lowbit; print(lowbit.isa())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "scalar", out.stderr[-500:]


def _reference(q, s, zp, group):
    n, k = q.shape
    sc = s.double().repeat_interleave(group, 1)[:, :k]
    z = 0.0 if zp is None else zp.double().repeat_interleave(group, 1)[:, :k]
    return (q.double() - z) * sc


def test_prepack_round_trip_and_errors():
    g = torch.Generator().manual_seed(7)
    for cbits, lo, hi in ((4, -8, 7), (8, -128, 127)):
        for n, k, group in ((1, 1, 1), (17, 9, 4), (33, 100, 32), (5, 3000, 3000)):
            ng = math.ceil(k / group)
            q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
            s = torch.rand(n, ng, generator=g)
            zp = torch.randint(lo, hi + 1, (n, ng), generator=g, dtype=torch.int8)
            p = lowbit.prepack(q, s, zp, group, cbits)
            q2, s2, z2 = lowbit.unpack(p, n, k, group, cbits)
            assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(z2, zp.to(torch.int32))
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="codes outside the signed 4-bit range"):
        lowbit.prepack(q + 8, torch.ones(4, 1), None, 8, 4)
    with pytest.raises(RuntimeError, match=r"scale must be \[4, 2\]"):
        lowbit.prepack(q, torch.ones(4, 1), None, 4, 4)
    with pytest.raises(RuntimeError, match="group length 20000 outside"):
        lowbit.prepack(torch.zeros(1, 20000, dtype=torch.int8), torch.ones(1, 1), None, 20000, 8)
    p = lowbit.prepack(q, torch.ones(4, 1), None, 8, 4)
    with pytest.raises(RuntimeError, match="bias has 3 elements, expected 4"):
        lowbit.linear(torch.zeros(2, 8), p, torch.zeros(3), 4, 8, 4)


def test_int32_sums_at_the_longest_group():
    # lowbit_a8 at the extremes the layout allows (group 16384, 8-bit codes at their ends,
    # activation codes -128 and zero points -128): the int32 group sums must stay exact.
    # Oracle: float64 sums of the same integers (exact below 2^53).
    n, k = 16, lowbit.MAX_GROUP
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    zp = torch.full((n, 1), 127, dtype=torch.int8)
    zp[2::3] = -128
    s = torch.full((n, 1), 2.0**-20)
    p = lowbit.prepack(q, s, zp, k, 8)
    xq = torch.full((2, k), -128, dtype=torch.int8)
    xq[1, ::2] = 127
    zx = torch.tensor([127, -128], dtype=torch.int32)
    sx = torch.tensor([2.0**-10, 1.0])
    a = xq.double() - zx.double()[:, None]
    want = (a @ (q.double() - zp.double()).t()) * 2.0**-20 * sx.double()[:, None]
    for isa in cpu_isas():
        lowbit.isa(isa)
        got = lowbit.linear_a8(xq, sx, zx, p, None, n, k, 8, torch.float32)
        # one float32 rounding of each 31-bit group sum and of the two scale products
        assert torch.allclose(got.double(), want, rtol=4 * 2.0**-24, atol=0), isa


def test_gpt2_conv1d_runs_the_kernels(tmp_path):
    transformers = pytest.importorskip("transformers")
    conf = transformers.GPT2Config(vocab_size=64, n_embd=48, n_layer=2, n_head=2, n_positions=32)

    def make():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(conf).eval()

    cfg = cfg_for(4, "group", 16, False, ("dynamic", True))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    trained = make()
    qcompress.init_compression(trained, cfg)
    trained.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(trained, tmp_path / "gpt2")
    exact = load_quantized(tmp_path / "gpt2", make())
    fast = load_quantized(tmp_path / "gpt2", make(), mode="fast")
    plans = plans_of(fast)
    conv1d = [n for n, m in fast.named_modules() if type(m).__name__.startswith("FastQuantizedConv1D")]
    assert conv1d and all(plans[n] == "lowbit_a8" for n in conv1d)
    with torch.no_grad():
        e = exact(ids).logits
        f = fast(ids).logits
        assert torch.equal(e, trained(ids).logits)
    for n in conv1d:
        m, me = dict(fast.named_modules())[n], dict(exact.named_modules())[n]
        assert torch.equal(m.weight, me.weight)
    # per-layer gaps of the documented bound, through LayerNorms and 2 blocks
    assert (f - e).abs().max().item() <= 1e-4 * e.abs().max().item()


def _codes(g, n, k, group, cbits, sym):
    lo, hi = -(1 << (cbits - 1)), (1 << (cbits - 1)) - 1
    ng = math.ceil(k / group)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, ng, generator=g) * 0.01 + 1e-4
    zp = None if sym else torch.randint(lo, hi + 1, (n, ng), generator=g, dtype=torch.int8)
    return q, s, zp


def _layer(g, cbits, n, k, group, sym):
    """Random codes of one layer: (its packed form, its float64 weight, a bias)."""
    q, s, zp = _codes(g, n, k, group, cbits, sym)
    return lowbit.prepack(q, s, zp, group, cbits), _reference(q, s, zp, group), torch.randn(n, generator=g)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_tiles_against_references(monkeypatch):
    # Shapes where the AMX kernels run (16+ tokens, padded groups of whole k steps): 4/8-bit,
    # sym/asym, group and channel scales, partial last groups, rows not a multiple of 16 or 32,
    # token counts 16 / 33 / 300 (padded to tiles of 16, two token tiles per pass).
    # W-A8: the int32 sums and the epilogue are the VNNI kernel's, so outputs are equal bit for
    # bit; weight-only: float64 reference within the docstring's (6K + 16) u bound (fp32) or the
    # half-precision one (inputs already in the dtype, so only the result rounding: u_d).
    g = torch.Generator().manual_seed(11)
    for cbits in (4, 8):
        for n, k, group in ((37, 200, 64), (16, 384, 384), (50, 128, 128), (33, 96, 32)):
            for sym in (True, False):
                p, w, bias = _layer(g, cbits, n, k, group, sym)
                for m in (16, 33, 300):
                    for dt in (torch.float32, torch.bfloat16, torch.float16):
                        x = torch.randn(m, k, generator=g).to(dt)
                        lowbit.isa("amx")
                        got = lowbit.linear(x, p, bias, n, group, cbits)
                        assert got.dtype == dt
                        want = x.double() @ w.t() + bias.double()
                        mag = x.double().abs() @ w.abs().t() + bias.double().abs()
                        bound = (6 * k + 16) * 2.0**-24 * mag
                        if dt == torch.float32:  # int8 digits, or the rest of two pieces
                            bound = bound + digit_term(x, w)
                        else:
                            bound = bound + (2.0**-8 if dt == torch.bfloat16 else 2.0**-11) * want.abs()
                        where = f"{cbits}-bit {n}x{k} group {group} {'sym' if sym else 'asym'} {m} tokens {dt}"
                        assert bool(((got.double() - want).abs() <= bound).all()), where
                        if dt == torch.float32:  # the bf16 pieces, within 2^-16 |x|
                            monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", "pieces")
                            got = lowbit.linear(x, p, bias, n, group, cbits)
                            monkeypatch.delenv("QCOMPRESS_LOWBIT_FP32")
                            bound = (6 * k + 16) * 2.0**-24 * mag + 2.0**-16 * mag
                            assert bool(((got.double() - want).abs() <= bound).all()), where + " pieces"
                    if k % 64:
                        continue  # W-A8 tiles take 64-column steps
                    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
                    sx = torch.rand(m, generator=g)
                    for zx in (None, torch.randint(-128, 128, (m,), generator=g, dtype=torch.int32)):
                        lowbit.isa("avx512_vnni")
                        want = lowbit.linear_a8(xq, sx, zx, p, bias, n, group, cbits, torch.float32)
                        lowbit.isa("amx")
                        got = lowbit.linear_a8(xq, sx, zx, p, bias, n, group, cbits, torch.float32)
                        assert torch.equal(got, want), f"W-A8 {cbits}-bit {n}x{k} group {group} {m} tokens"


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_weight_only_token_split_equals_block_split(monkeypatch):
    # With 2+ threads and 64+ tokens the AMX weight-only kernel splits small layers over tokens
    # (each task all row blocks, its own tokens) instead of row blocks; every output row is then
    # summed in the same order, so the result equals the one-thread (row block) run bit for bit,
    # for float32 on int8 digits and on bf16 pieces alike.
    g = torch.Generator().manual_seed(12)
    for fp32 in ("digits", "pieces"):
        monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", fp32)
        for cbits, n, k, group in ((4, 50, 384, 128), (8, 40, 256, 256)):
            q, s, zp = _codes(g, n, k, group, cbits, False)
            p = lowbit.prepack(q, s, zp, group, cbits)
            bias = torch.randn(n, generator=g)
            for m in (64, 100, 300):
                for dt in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, generator=g).to(dt)
                    lowbit.isa("amx")
                    torch.set_num_threads(1)
                    one = lowbit.linear(x, p, bias, n, group, cbits)
                    torch.set_num_threads(2)
                    two = lowbit.linear(x, p, bias, n, group, cbits)
                    assert torch.equal(one, two), f"{fp32} {cbits}-bit {n}x{k} {m} tokens {dt}"


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_leaves_other_tile_users_alone():
    # oneDNN runs bf16 matmuls on AMX tiles too, with its own tile configuration; our kernels
    # load theirs per task and release the tiles after. Interleaved calls must not change
    # torch's results (oracle: the same matmul before any of ours ran).
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 256, generator=g).bfloat16()
    x = torch.randn(48, 256, generator=g).bfloat16()
    first = torch.nn.functional.linear(x, w)
    q, s, zp = _codes(g, 96, 256, 128, 4, True)
    p = lowbit.prepack(q, s, zp, 128, 4)
    lowbit.isa("amx")
    for _ in range(5):
        lowbit.linear(x, p, None, 96, 128, 4)
        assert torch.equal(torch.nn.functional.linear(x, w), first)


def test_amx_takes_nonfinite_inputs_elsewhere():
    # inf / nan have no bf16 pieces: the AMX path hands such inputs to the vector kernels, whose
    # results follow IEEE (oracle: the float64 product, inf and nan where it has them)
    g = torch.Generator().manual_seed(3)
    q, s, zp = _codes(g, 16, 64, 64, 8, True)
    q[q == 0] = 1  # no 0 * inf
    p = lowbit.prepack(q, s, zp, 64, 8)
    x = torch.randn(20, 64, generator=g)
    x[3, 5] = float("inf")
    x[7, 1] = float("nan")
    want = x.double() @ _reference(q, s, zp, 64).t()
    got = lowbit.linear(x, p, None, 16, 64, 8).double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_half_inputs_and_outputs_match_the_float32_path(monkeypatch):
    # bf16 / fp16 activations are read and the result written in their own dtype (no copies):
    # the pieces of a bf16/fp16 value widened to fp32 are the same plus exact zeros, so the result
    # must equal the float32 call on bf16 pieces converted by torch, bit for bit (with and without
    # padded groups)
    monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", "pieces")
    g = torch.Generator().manual_seed(1)
    for dt in (torch.bfloat16, torch.float16):
        for k, group in ((384, 128), (200, 64)):
            q, s, zp = _codes(g, 40, k, group, 4, False)
            p = lowbit.prepack(q, s, zp, group, 4)
            x = torch.randn(33, k, generator=g).to(dt)
            b = torch.randn(40, generator=g)
            lowbit.isa("amx")
            got = lowbit.linear(x, p, b, 40, group, 4)
            assert got.dtype == dt
            assert torch.equal(got, lowbit.linear(x.float(), p, b, 40, group, 4).to(dt)), (dt, k)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_split_scratch_reuse_keeps_results():
    # The bf16 pieces of the input live in a grow-only buffer per calling thread (a fresh one per
    # call page-faulted 5-19 MB per MiniLM layer at 2048 tokens). A later, smaller call runs on a
    # buffer holding a bigger call's pieces, and other threads have their own: every result must
    # equal the same call made first on a fresh thread, bit for bit (stale pieces never read),
    # and the big call must still be within the float64 bound.
    import threading

    g = torch.Generator().manual_seed(7)
    lowbit.isa("amx")
    calls = []
    for n, k, group, cbits, m, dt in (
        (40, 200, 64, 4, 33, torch.float32),
        (96, 384, 128, 8, 1100, torch.float32),
        (24, 96, 32, 4, 17, torch.float16),
        (40, 200, 64, 4, 300, torch.bfloat16),
    ):
        q, s, zp = _codes(g, n, k, group, cbits, False)
        calls.append(
            (
                torch.randn(m, k, generator=g).to(dt),
                lowbit.prepack(q, s, zp, group, cbits),
                torch.randn(n, generator=g),
                n,
                group,
                cbits,
            )
        )

    def run_all(out):
        lowbit.isa("amx")
        out.extend(lowbit.linear(*c) for c in calls)

    fresh = []
    for c in calls:  # each call first on a thread of its own
        t = threading.Thread(target=lambda c=c: (lowbit.isa("amx"), fresh.append(lowbit.linear(*c))))
        t.start()
        t.join()
    for _ in range(2):  # grown, shrunk, grown again on this thread
        here = []
        run_all(here)
        for i, (a, b) in enumerate(zip(here, fresh)):
            assert torch.equal(a, b), f"call {i}"
    other = []
    t = threading.Thread(target=run_all, args=(other,))
    t.start()
    t.join()
    assert all(torch.equal(a, b) for a, b in zip(other, fresh))
    x, p, bias, n, group, cbits = calls[1]
    q, s, zp = lowbit.unpack(p, n, x.shape[1], group, cbits)
    w = _reference(q, s, zp, group)
    want = x.double() @ w.t() + bias.double()
    bound = (6 * x.shape[1] + 16) * 2.0**-24 * (x.double().abs() @ w.abs().t() + bias.double().abs())
    assert bool(((fresh[1].double() - want).abs() <= bound + digit_term(x, w)).all())


def _digits_reference(x):
    """x^ = sx D per token in float64, from the definition in csrc/cpu/lowbit_amx.h (digits), each
    step in float32 as the kernel rounds it: inv = kDigitMax / amax, D = round(x * inv) clamped to
    +-kDigitMax, sx = amax / kDigitMax (a zero token: zeros)."""
    top = 127 * 256 + 127
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.tensor(float(top)) / amax
    d = torch.round(x * inv).clamp(-top, top)
    xh = (amax / top).double() * d.double()
    return torch.where(amax == 0, torch.zeros_like(xh), xh)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_float32_digits_against_their_definition(monkeypatch):
    # The int8-digit path must compute exactly x^ @ W^T with x^ the digits' value (reference above,
    # written from the definition), up to float32 rounding of the group sums: (6K + 16) u, no
    # digit term. Ragged tokens (16 / 33 / 300, one of them all zeros, scales from 1e-3 to 1e3),
    # 4 / 8-bit, sym / asym, one thread and two (row-block and token split).
    g = torch.Generator().manual_seed(21)
    lowbit.isa("amx")
    for cbits, n, k, group in ((4, 50, 384, 128), (8, 37, 256, 256), (4, 24, 192, 64)):
        for sym in (True, False):
            p, w, bias = _layer(g, cbits, n, k, group, sym)
            for m in (16, 33, 300):
                x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=g)
                x[m // 2] = 0
                xh = _digits_reference(x)
                want = xh @ w.t() + bias.double()
                bound = (6 * k + 16) * 2.0**-24 * (xh.abs() @ w.abs().t() + bias.double().abs())
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    got = lowbit.linear(x, p, bias, n, group, cbits).double()
                    where = f"{cbits}-bit {n}x{k} group {group} {'sym' if sym else 'asym'} {m} tokens {threads} threads"
                    assert bool(((got - want).abs() <= bound).all()), where
                    monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", "pieces")  # not the same sums: the
                    other = lowbit.linear(x, p, bias, n, group, cbits).double()  # digit path ran
                    monkeypatch.delenv("QCOMPRESS_LOWBIT_FP32")
                    assert not torch.equal(got, other), where


@pytest.mark.skipif(
    not lowbit.available() or lowbit.isa("auto") not in ("avx512_vnni", "amx"), reason="the CPU has no AVX-512 VNNI"
)
def test_gemv_float32_digits_against_their_definition(monkeypatch):
    # Below 16 tokens, float32 weight-only runs each token's two int8 digits as two rows of the
    # VNNI W-A8 kernel: exactly x^ @ W^T (x^ the digits' value, reference above) up to float32
    # rounding, (6K + 16) u. 2 / 4 / 8-bit containers, sym / asym, padded and partial groups, 1 / 5
    # tokens with a zero token; inf / nan and a tiny token take the float kernel (IEEE results,
    # and within its own bound of the float64 product).
    g = torch.Generator().manual_seed(23)
    for isa in ("avx512_vnni", lowbit.isa("auto")):
        lowbit.isa(isa)
        for cbits, n, k, group in ((4, 50, 384, 128), (8, 37, 200, 200), (4, 24, 100, 32), (2, 20, 96, 16)):
            for sym in (True, False):
                p, w, bias = _layer(g, cbits, n, k, group, sym)
                for m in (1, 5):
                    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=g)
                    if m > 1:
                        x[m - 1] = 0
                    xh = _digits_reference(x)
                    want = xh @ w.t() + bias.double()
                    bound = (6 * k + 16) * 2.0**-24 * (xh.abs() @ w.abs().t() + bias.double().abs())
                    got = lowbit.linear(x, p, bias, n, group, cbits).double()
                    where = f"{isa} {cbits}-bit {n}x{k} group {group} {'sym' if sym else 'asym'} {m} tokens"
                    assert bool(((got - want).abs() <= bound).all()), where
                    monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", "pieces")  # the float kernel: other sums
                    assert not torch.equal(got, lowbit.linear(x, p, bias, n, group, cbits).double()), where
                    monkeypatch.delenv("QCOMPRESS_LOWBIT_FP32")
        p, w, bias = _layer(g, 8, 16, 64, 64, True)
        for bad in (float("inf"), float("nan"), 1e-33):
            x = torch.randn(2, 64, generator=g)
            if bad < 1:
                x[1] *= bad  # a tiny token
            else:
                x[1, 5] = bad
            got = lowbit.linear(x, p, None, 16, 64, 8).double()
            want = x.double() @ w.t()
            assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
            fin = torch.isfinite(want)
            mag = (x.double().abs() @ w.abs().t())[fin]
            assert bool(((got[fin] - want[fin]).abs() <= (6 * 64 + 16) * 2.0**-24 * mag).all()), (isa, bad)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_amx_float32_digits_hand_tiny_tokens_to_the_pieces():
    # A token whose amax is below kDigitTiny (1e-30) has no digit scale (kDigitMax / amax overflows):
    # the call takes the bf16 pieces, within their 2^-16 |x| bound of the float64 product
    g = torch.Generator().manual_seed(22)
    q, s, zp = _codes(g, 32, 128, 128, 8, True)
    p = lowbit.prepack(q, s, zp, 128, 8)
    w = _reference(q, s, zp, 128)
    x = torch.randn(20, 128, generator=g)
    x[4] *= 1e-33
    lowbit.isa("amx")
    got = lowbit.linear(x, p, None, 32, 128, 8).double()
    want = x.double() @ w.t()
    mag = x.double().abs() @ w.abs().t()
    assert bool(((got - want).abs() <= (6 * 128 + 16) * 2.0**-24 * mag + 2.0**-16 * mag).all())
    assert float(got[4].abs().max()) > 0  # not flushed to zero as a digit scale of 0 would


def _check_dyn_a8(g, p, bias, n, k, m, group, cbits):
    """lowbit_linear_dyn_a8 on 3 x m tokens equals the quantize op's codes fed to lowbit_linear_a8,
    bit for bit, for 8-bit sym / asym and 5-bit activations, float32 and bfloat16."""
    from qcompress.quant import kernels as K
    from qcompress.quant.api import make_spec

    for abits, sym in ((8, True), (8, False), (5, True)):
        spec = make_spec(abits, symmetric=sym, granularity="token")
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(3, m, k, generator=g) * 3).to(dtype)
            xq, sx, zx = K.quantize(x.reshape(-1, k), spec)
            want = lowbit.linear_a8(
                xq, sx, None if zx is None else zx.to(torch.int32), p, bias, n, group, cbits, dtype
            ).reshape(3, m, n)
            got = lowbit.linear_dyn_a8(x, p, bias, n, group, cbits, abits, sym, spec.seed)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got, want), (cbits, n, k, m, abits, sym, dtype)


@pytest.mark.skipif(not lowbit.available() or lowbit.isa("auto") != "amx", reason="the CPU has no AMX tiles")
def test_one_call_dynamic_a8_token_tasks_equal_quantize_then_linear_a8():
    # With AMX, 2 threads, 64+ tokens and groups of whole 64-column steps, lowbit_linear_dyn_a8 runs
    # one parallel region whose tasks quantize, sum and multiply their own tokens: still the quantize
    # op's codes fed to lowbit_linear_a8, bit for bit; NaN input fails as the quantize op does.
    g = torch.Generator().manual_seed(6)
    torch.set_num_threads(2)
    for cbits, group, sym_w in ((8, 128, True), (4, 64, False)):
        n, k = 40, 128
        q, s, zp = _codes(g, n, k, group, cbits, sym_w)
        p = lowbit.prepack(q, s, zp, group, cbits)
        bias = torch.randn(n, generator=g)
        for m in (22, 100):  # 66 and 300 tokens (not multiples of 16)
            _check_dyn_a8(g, p, bias, n, k, m, group, cbits)
        x = torch.randn(100, k, generator=g)
        x[70, 3] = float("nan")
        with pytest.raises(RuntimeError, match="contain NaN or Inf"):
            lowbit.linear_dyn_a8(x, p, bias, n, group, cbits, 8, True, 0)


def test_one_call_dynamic_a8_equals_quantize_then_linear_a8():
    # lowbit_linear_dyn_a8 (what the fast plan runs for dynamic per-token inputs) must be the
    # quantize op's codes fed to lowbit_linear_a8, bit for bit, for every shape and dtype
    g = torch.Generator().manual_seed(5)
    for cbits, group, sym_w in ((8, 37, True), (4, 32, False)):
        for n, k, m in ((19, 37, 1), (33, 70, 17), (16, 64, 40)):
            q, s, zp = _codes(g, n, k, min(group, k), cbits, sym_w)
            p = lowbit.prepack(q, s, zp, min(group, k), cbits)
            bias = torch.randn(n, generator=g)
            _check_dyn_a8(g, p, bias, n, k, m, min(group, k), cbits)
    # fewer tokens than a tile with unpadded groups (dyn_a8_gemv: codes in plain buffers, the vector
    # kernel, act in its store loop), on every ISA, bias or none, sym / asym weights
    for isa in cpu_isas():
        lowbit.isa(isa)
        for cbits, n, k, group, sym_w in ((8, 45, 96, 96, True), (4, 33, 128, 32, False), (8, 17, 64, 32, False)):
            q, s, zp = _codes(g, n, k, group, cbits, sym_w)
            p = lowbit.prepack(q, s, zp, group, cbits)
            for m in (1, 5):  # 3 and 15 tokens
                _check_dyn_a8(g, p, torch.randn(n, generator=g), n, k, m, group, cbits)
                _check_dyn_a8(g, p, None, n, k, m, group, cbits)
            x = torch.randn(2, k, generator=g)
            x[1, 3] = float("inf")
            with pytest.raises(RuntimeError, match="contain NaN or Inf"):
                lowbit.linear_dyn_a8(x, p, None, n, group, cbits, 8, True, 0)
    lowbit.isa("auto")
    with pytest.raises(RuntimeError, match="activation bits must be 2..8"):
        lowbit.linear_dyn_a8(
            torch.zeros(2, 8),
            lowbit.prepack(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), None, 8, 4),
            None,
            4,
            8,
            4,
            9,
            True,
            0,
        )


# --- the activation epilogue (lowbit_linear's `act`, fused by load_quantized; export/fuse.py) ----
# The kernel's GELU is lowbit.h gelu_erf (Abramowitz & Stegun 7.1.28 for erf): within 2e-6 |y| +
# 1e-6 |gelu(y)| of torch's (the formula's 3e-7 and float rounding of p^16: see lowbit.h); ReLU is
# exact. Oracle: torch's F.gelu / F.relu of the same call without `act`, which every path computes
# identically (the activation is applied to the finished output, in the tile / GEMV store or after).


def _gelu_bound(y):
    y = y.double()
    return 2e-6 * y.abs() + 1e-6 * torch.nn.functional.gelu(y).abs() + 1e-30


@pytest.mark.parametrize("sym", [True, False])
def test_activation_epilogue_on_every_path(monkeypatch, sym):
    g = torch.Generator().manual_seed(21)
    F = torch.nn.functional
    for isa in cpu_isas():
        for cbits, n, k, group in ((4, 37, 200, 64), (8, 50, 128, 128), (4, 33, 384, 128)):
            p, _, bias = _layer(g, cbits, n, k, group, sym)
            for m in (1, 5, 33):
                for dt in (torch.float32, torch.bfloat16):
                    for pieces in (False, True) if dt == torch.float32 else (False,):
                        if pieces:
                            monkeypatch.setenv("QCOMPRESS_LOWBIT_FP32", "pieces")
                        lowbit.isa(isa)
                        x = (torch.randn(m, k, generator=g) * 3).to(dt)
                        base = lowbit.linear(x, p, bias, n, group, cbits)
                        gelu = lowbit.linear(x, p, bias, n, group, cbits, act="gelu")
                        tanh = lowbit.linear(x, p, bias, n, group, cbits, act="gelu_tanh")
                        relu = lowbit.linear(x, p, bias, n, group, cbits, act="relu")
                        silu = lowbit.linear(x, p, bias, n, group, cbits, act="silu")
                        monkeypatch.delenv("QCOMPRESS_LOWBIT_FP32", raising=False)
                        where = f"{isa} {cbits}-bit {n}x{k} g{group} {m} tokens {dt} {'pieces' if pieces else ''}"
                        assert gelu.dtype == relu.dtype == dt and gelu.shape == base.shape, where
                        assert torch.equal(relu, F.relu(base)), where
                        for got, approx in ((gelu, "none"), (tanh, "tanh"), (silu, "silu")):
                            fn = F.silu if approx == "silu" else functools.partial(F.gelu, approximate=approx)
                            if dt == torch.float32:
                                diff = (got.double() - fn(base.double())).abs()
                                assert bool((diff <= _gelu_bound(base)).all()), where + approx
                            else:  # the float result of the epilogue, rounded once to bf16
                                want = fn(base.float())
                                diff = (got.float() - want).abs()
                                assert bool((diff <= 2.0**-8 * want.abs() + _gelu_bound(base.float())).all()), (
                                    where + approx
                                )


def test_gelu_epilogue_special_values():
    # one token per value, x = (v, 0, ..., 0), identity weights (8-bit codes 1 on the diagonal,
    # scale 1) on the scalar kernel: output column 0 is v exactly, so the epilogue sees v as it is
    vals = torch.tensor(
        [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            1e-3,
            -1e-3,
            0.5,
            -0.5,
            1.0,
            -1.0,
            3.0,
            -3.0,
            5.5,
            -5.5,
            10.0,
            -10.0,
            30.0,
            -30.0,
            1e4,
            -1e4,
            float("nan"),
            float("inf"),
        ]
    )
    k = 16
    x = torch.zeros(vals.numel(), k)
    x[:, 0] = vals
    p = lowbit.prepack(torch.eye(k, dtype=torch.int8), torch.ones(k, 1), None, k, 8)
    lowbit.isa("scalar")
    assert torch.equal(lowbit.linear(x, p, None, k, k, 8)[:-2, 0], vals[:-2])
    for act, approx in (("gelu", "none"), ("gelu_tanh", "tanh")):
        got = lowbit.linear(x, p, None, k, k, 8, act=act)[:, 0]
        want = torch.nn.functional.gelu(vals.double(), approximate=approx)
        finite = torch.isfinite(vals)
        assert bool(((got.double() - want).abs()[finite] <= _gelu_bound(vals)[finite]).all()), act
        assert got[-2].isnan() and got[-1] == float("inf"), act
        assert bool((got[vals < -9] <= 0).all()) and bool((got[vals < -9] > -1e-15).all()), act  # no cancellation


def test_activation_argument_is_checked():
    p, _, _ = _layer(torch.Generator().manual_seed(2), 4, 16, 32, 32, True)
    with pytest.raises(RuntimeError, match="act must be 'none', 'gelu', 'gelu_tanh', 'relu' or 'silu', got 'tanh'"):
        lowbit.linear(torch.randn(2, 32), p, None, 16, 32, 4, act="tanh")


def test_residual_epilogue_is_the_same_add_on_every_path(monkeypatch):
    # residual: added after act in the kernels' store (float32) or after the call (other dtypes);
    # either way the same single add as torch's y + r, so equal bit for bit
    g = torch.Generator().manual_seed(23)
    for isa in cpu_isas():
        for cbits, n, k, group in ((4, 37, 200, 64), (4, 48, 384, 128)):
            p, _, bias = _layer(g, cbits, n, k, group, True)
            for m in (1, 5, 33):
                for dt in (torch.float32, torch.bfloat16):
                    lowbit.isa(isa)
                    x = torch.randn(2, m, k, generator=g).to(dt)
                    r = torch.randn(2, m, n, generator=g).to(dt)
                    for act in ("none", "gelu"):
                        base = lowbit.linear(x, p, bias, n, group, cbits, act=act)
                        got = lowbit.linear(x, p, bias, n, group, cbits, act=act, residual=r)
                        assert torch.equal(got, base + r), f"{isa} {n}x{k} {m} tokens {dt} {act}"
    with pytest.raises(RuntimeError, match="residual has shape"):
        lowbit.linear(x, p, bias, n, group, cbits, residual=r[..., :-1])


def test_dynamic_a8_activation_is_applied_to_the_output():
    # lowbit_linear_dyn_a8's act: applied in place to the finished output (lowbit.h apply_act)
    g = torch.Generator().manual_seed(25)
    F = torch.nn.functional
    torch.set_num_threads(2)  # 70 tokens on AMX: the token-task path, act in the tile store
    for isa in cpu_isas():
        p, _, bias = _layer(g, 8, 48, 128, 128, True)
        for m in (1, 5, 40, 70):
            lowbit.isa(isa)
            x = torch.randn(m, 128, generator=g) * 2
            base = lowbit.linear_dyn_a8(x, p, bias, 48, 128, 8, 8, True, 0)
            assert torch.equal(lowbit.linear_dyn_a8(x, p, bias, 48, 128, 8, 8, True, 0, act="relu"), F.relu(base))
            for act, approx in (("gelu", "none"), ("gelu_tanh", "tanh"), ("silu", "silu")):
                got = lowbit.linear_dyn_a8(x, p, bias, 48, 128, 8, 8, True, 0, act=act)
                want = F.silu(base.double()) if act == "silu" else F.gelu(base.double(), approximate=approx)
                diff = (got.double() - want).abs()
                assert bool((diff <= _gelu_bound(base)).all()), f"{isa} {m} {act}"
                # the residual: added after act, the same float add wherever it happens (the tile or
                # GEMV store for float32, after the call otherwise)
                for dt in (torch.float32, torch.bfloat16):
                    xd, r = x.to(dt), torch.randn(m, 48, generator=g).to(dt)
                    want = lowbit.linear_dyn_a8(xd, p, bias, 48, 128, 8, 8, True, 0, act=act) + r
                    assert torch.equal(
                        lowbit.linear_dyn_a8(xd, p, bias, 48, 128, 8, 8, True, 0, act=act, residual=r), want
                    ), f"{isa} {m} {act} {dt}"
            # bfloat16: act on the output already rounded to bfloat16, rounded again (ReLU exactly)
            xb = x.bfloat16()
            base_b = lowbit.linear_dyn_a8(xb, p, bias, 48, 128, 8, 8, True, 0)
            relu_b = lowbit.linear_dyn_a8(xb, p, bias, 48, 128, 8, 8, True, 0, act="relu")
            assert relu_b.dtype == torch.bfloat16 and torch.equal(relu_b, F.relu(base_b)), f"{isa} {m}"
            silu_b = lowbit.linear_dyn_a8(xb, p, bias, 48, 128, 8, 8, True, 0, act="silu").double()
            want_b = F.silu(base_b.double())
            assert bool(((silu_b - want_b).abs() <= _gelu_bound(base_b.float()) + 2.0**-8 * want_b.abs()).all())
            with pytest.raises(RuntimeError, match="lowbit_linear_dyn_a8: residual has shape"):
                lowbit.linear_dyn_a8(x, p, bias, 48, 128, 8, 8, True, 0, residual=torch.zeros(m, 47))


@pytest.mark.skipif(not lowbit.available(), reason="the qcompress C++ extension is not built")
def test_fast_layers_keep_the_gradients_of_their_bias(tmp_path):
    # The kernels have no backward: with grad enabled, a bias that needs a gradient keeps the call on
    # the exact path (before, the kernel ran and the bias gradient came out wrong, with only a
    # torch warning), so the fast model's bias gradients are the exact model's.
    g = torch.Generator().manual_seed(8)
    _, exact, fast = export_pair(
        tmp_path,
        lambda: odd_model(torch.float32),
        cfg_for(4, "group", 32, True, None),
        torch.randn(6, 100, generator=g),
    )
    x = torch.randn(3, 100, generator=g)  # an input that needs no gradient
    for model in (exact, fast):
        model(x).square().sum().backward()
    for e, f in zip(exact, fast):
        if isinstance(e, nn.Linear) and e.bias is not None:
            assert f.bias.grad is not None and torch.equal(f.bias.grad, e.bias.grad)
    with torch.no_grad():  # inference: the kernels run
        assert torch.allclose(fast(x), exact(x), rtol=1e-4, atol=1e-5)
