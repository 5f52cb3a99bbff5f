"""The fused csrc/ kernels (CPU) against the pure-torch reference: same bits for every mode.

Oracles: qcompress.quant.reference / packing / onebit (independent torch code), compressed-tensors'
own pack_to_int32, and closed-form values for the 1-bit compressor.
"""

import itertools
import math

import pytest
import torch

from qcompress.errors import NonFiniteError
from qcompress.quant import api, kernels as K, onebit as O, packing as P, reference as R

if not K.available():
    pytest.skip(f"qcompress C++ extension not built ({K.load_error()}); run `make build`", allow_module_level=True)


# --- helpers -------------------------------------------------------------------------------------


def same(a, b, what=""):
    """Equal shape, dtype and values (NaN equal to NaN, -0.0 equal to 0.0)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a!r} vs {b!r}"
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ"


def run_both(fn_ref, fn_ker):
    """Both give the same result, or both raise the same documented error.

    Where the reference itself crashes (a RuntimeError from a reshape of a tensor with zero
    rows, in reference.ungroup) the kernel must still run; there is nothing to compare with.
    """
    try:
        ref = fn_ref()
    except (NonFiniteError, ValueError) as exc:
        with pytest.raises(type(exc)):
            fn_ker()
        return None, None
    except RuntimeError:
        fn_ker()
        return None, None
    return ref, fn_ker()


def specs(granularity, **extra):
    """Every valid mode for one granularity."""
    out = []
    for bits, ternary in [(1, False), (2, True), (2, False), (3, False), (4, False), (8, False), (12, False)]:
        for sym, numerics, rounding in itertools.product(
            [True, False], ["default", "deepspeed"], ["nearest", "stochastic"]
        ):
            if bits == 1 or ternary:
                if not sym or rounding == "stochastic":
                    continue
            out.append(
                R.make_spec(
                    bits,
                    symmetric=sym,
                    granularity=granularity,
                    rounding=rounding,
                    numerics=numerics,
                    ternary=ternary,
                    seed=1234567,
                    **extra,
                )
            )
    return out


def check_spec(x, spec, min_val=None, max_val=None):
    ref, ker = run_both(
        lambda: R.fake_quantize_with_mask(x, spec, min_val, max_val),
        lambda: K.fake_quantize_with_mask(x, spec, min_val, max_val),
    )
    if ref is not None:
        same(ker[0], ref[0], f"y {spec}")
        same(ker[1], ref[1], f"mask {spec}")
        same(K.fake_quantize(x, spec, min_val, max_val), ref[0], f"y (no mask) {spec}")
    ref, ker = run_both(lambda: R.quantize(x, spec, min_val, max_val), lambda: K.quantize(x, spec, min_val, max_val))
    if ref is not None:
        for name, a, b in zip(("q", "scale", "zero_point"), ker, ref):
            same(a, b, f"{name} {spec}")
        kw = {}
        if spec.granularity == "group":
            kw["group_size"] = spec.group_size
        if spec.granularity == "groups":
            kw["num_groups"] = spec.num_groups
        if x.numel():
            for dtype in (torch.float32, torch.bfloat16):
                same(K.dequantize(*ker, dtype=dtype, **kw), R.dequantize(*ref, dtype=dtype, **kw), f"dequantize {spec}")
    # codes and values from one pass: quantize's and the fake quantizer's, bit for bit
    both = run_both(
        lambda: (R.quantize(x, spec, min_val, max_val), R.fake_quantize_with_mask(x, spec, min_val, max_val)[0]),
        lambda: K.quantize_values(x, spec, min_val, max_val),
    )
    if both[0] is not None and both[1] is not None:
        (codes, y), ker = both
        for name, a, b in zip(("q", "scale", "zero_point", "values"), ker, (*codes, y)):
            same(a, b, f"quantize_values {name} {spec}")
    elif both[0] is not None:
        assert x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not x.numel(), (
            f"quantize_values declined a {x.dtype} tensor of shape {tuple(x.shape)}"
        )


SHAPES = [(7, 13), (3, 5, 9), (33,), (1,), (5, 1), (2, 1, 6)]


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3


# --- every mode, every granularity ----------------------------------------------------------------


@pytest.mark.parametrize(
    "gran,extra",
    [
        ("tensor", {}),
        ("channel", {}),
        ("token", {}),
        ("group", {"group_size": 4}),
        ("group", {"group_size": 1}),
        ("group", {"group_size": 128}),
    ],
)
def test_modes_match_reference(gran, extra):
    for shape in SHAPES:
        x = _inputs(shape)
        for spec in specs(gran, **extra):
            check_spec(x, spec)


def test_num_groups_match_reference():
    x = _inputs((6, 10))
    for g in (1, 3, 60):
        for spec in specs("tensor", num_groups=g):
            check_spec(x, spec)
    with pytest.raises(ValueError, match="does not divide"):
        K.fake_quantize_with_mask(x, R.make_spec(8, num_groups=7))


def test_non_contiguous_and_low_precision_inputs():
    base = _inputs((12, 20), seed=1)
    views = [base.t(), base[:, ::3], base[1::2]]
    for x in views:
        assert not x.is_contiguous()
        for spec in specs("group", group_size=5)[::3] + specs("channel")[::3]:
            check_spec(x, spec)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = base.to(dtype)
        for spec in specs("group", group_size=8) + specs("token")[::2]:
            check_spec(x, spec)


def test_empty_tensors():
    for shape in [(0,), (0, 5), (4, 0), (2, 0, 3)]:
        x = torch.zeros(shape)
        for gran, extra in [("tensor", {}), ("channel", {}), ("group", {"group_size": 4})]:
            for spec in specs(gran, **extra):
                if spec.kind == "ternary" and x.numel() == 0 and gran != "group":
                    continue  # the reference itself fails there (no threshold for a zero-width view)
                check_spec(x, spec)


def test_special_values():
    cases = {
        "zeros": torch.zeros(4, 16),
        "constant": torch.full((4, 16), 2.5),
        "negative constant": torch.full((4, 16), -7.0),
        "huge": torch.tensor([[3.0e38, -3.0e38, 1.0, -2.0] * 4] * 4),
        "wide": torch.tensor([[2.0e38, -2.0e38, 1.0, -2.0] * 4] * 4),  # hi - lo, 2 absmax > FLT_MAX
        "tiny": torch.full((4, 16), 1e-40) * torch.arange(16.0),
        "ties": torch.arange(-32, 32, dtype=torch.float32).reshape(4, 16) / 2,
    }
    for name, x in cases.items():
        for gran, extra in [("tensor", {}), ("channel", {}), ("group", {"group_size": 6})]:
            for spec in specs(gran, **extra):
                check_spec(x, spec)
                # ranges that overflow float32 still give finite results; except deepspeed's
                # asymmetric sequence q * s + z, whose product q * s itself overflows there
                if name == "wide" and not (spec.numerics == "deepspeed" and not spec.symmetric):
                    assert torch.isfinite(K.fake_quantize_with_mask(x, spec)[0]).all(), spec


def test_nan_and_inf_raise_like_the_reference():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = _inputs((4, 8))
        x[2, 3] = bad
        for spec in specs("group", group_size=4)[::2] + specs("tensor")[::2]:
            with pytest.raises(NonFiniteError):
                R.fake_quantize_with_mask(x, spec)
            with pytest.raises(NonFiniteError):
                K.fake_quantize_with_mask(x, spec)
            with pytest.raises(NonFiniteError):
                K.quantize(x, spec)
            with pytest.raises(NonFiniteError):
                K.quantize_values(x, spec)


def test_static_range():
    x = _inputs((5, 7))
    x[0, 0] = float("nan")  # with a static range NaN is not a range problem: it propagates
    x[1, 1] = float("inf")
    for spec in specs("tensor"):
        check_spec(x, spec, min_val=-2.0, max_val=1.5)
        check_spec(x, spec, min_val=torch.tensor(-0.5), max_val=torch.tensor(4.0))
    with pytest.raises(NonFiniteError):
        K.fake_quantize_with_mask(x, R.make_spec(8), float("nan"), 1.0)


def test_large_tensors_use_the_parallel_paths():
    # group 128: fused per-group path; tensor / 3 channels: chunked reduction + elementwise pass
    x = _inputs((3, 100_003), seed=2)
    for gran, extra in [("tensor", {}), ("channel", {}), ("group", {"group_size": 128})]:
        for spec in specs(gran, **extra)[::3]:
            check_spec(x, spec)


def test_reused_output_blocks_are_fully_written():
    # Outputs of >= 4 MB come from the kernels' block cache (csrc/cpu/block_cache.h): a block freed
    # by one call is handed to the next call of the same size, so every element must be rewritten.
    g = torch.Generator().manual_seed(11)
    spec = R.make_spec(4, symmetric=False, granularity="group", group_size=128)
    first = K.fake_quantize_with_mask(torch.randn(1024, 1536, generator=g) * 50, spec)
    first[0].fill_(float("nan"))  # poison the block before it goes back to the cache
    first[1].fill_(False)
    ptr = first[0].data_ptr()
    del first
    x = torch.randn(1024, 1536, generator=g)
    y, mask = K.fake_quantize_with_mask(x, spec)
    assert y.data_ptr() == ptr, "the freed block was not reused (QCOMPRESS_CPU_CACHE_MB set to 0?)"
    yr, mr = R.fake_quantize_with_mask(x, spec)
    same(y, yr, "fake_quant into a reused block")
    same(mask, mr, "clip mask into a reused block")
    grad = torch.randn(1024, 1536, generator=g)
    same(K.ste_backward(grad, mask), grad * mask.to(grad.dtype), "ste_backward into a reused block")
    y.requires_grad_(False)
    y.resize_(1024, 1536)  # same size: fine; the block's storage is not resizable beyond it
    with pytest.raises(RuntimeError):
        y.resize_(2048, 1536)


def test_seed_and_rng_are_the_reference_rng():
    x = torch.linspace(-1, 1, 4099)
    spec = R.make_spec(4, rounding="stochastic", seed=2**40 + 77)  # seed folds to its low 32 bits
    same(K.fake_quantize_with_mask(x, spec)[0], R.fake_quantize_with_mask(x, spec)[0], "seed")
    a = K.fake_quantize_with_mask(x, R.make_spec(4, rounding="stochastic", seed=1))[0]
    b = K.fake_quantize_with_mask(x, R.make_spec(4, rounding="stochastic", seed=2))[0]
    assert not torch.equal(a, b)


# --- dequantize, backward ------------------------------------------------------------------------


def test_dequantize_layouts_and_fallbacks():
    q = torch.randint(-8, 8, (6, 10), dtype=torch.int8)
    s = torch.rand(6, 3) + 0.1
    z = torch.randint(-3, 3, (6, 3), dtype=torch.int32)
    for zp in (None, z):
        same(K.dequantize(q, s, zp, group_size=4), R.dequantize(q, s, zp, group_size=4), "group")
        same(
            K.dequantize(q, s.reshape(-1)[:6].reshape(6, 1), None if zp is None else zp[:, :1]),
            R.dequantize(q, s.reshape(-1)[:6].reshape(6, 1), None if zp is None else zp[:, :1]),
            "channel",
        )
        same(
            K.dequantize(
                q.to(torch.int32),
                s.reshape(-1)[:2].reshape(2, 1),
                None if zp is None else zp.reshape(-1)[:2].reshape(2, 1),
                num_groups=2,
            ),
            R.dequantize(
                q.to(torch.int32),
                s.reshape(-1)[:2].reshape(2, 1),
                None if zp is None else zp.reshape(-1)[:2].reshape(2, 1),
                num_groups=2,
            ),
            "groups",
        )
    odd = torch.rand(1, 10)  # broadcast along rows: not a kernel layout, falls back
    same(K.dequantize(q, odd), R.dequantize(q, odd), "fallback")


def test_ste_backward_and_api_gradients():
    x = _inputs((8, 32), seed=3)
    for clip in (False, True):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        ys = [
            api.fake_quantize(t, 4, granularity="group", group_size=16, symmetric=False, clip_grad=clip, backend=b)
            for t, b in zip(xs, ("kernel", "reference"))
        ]
        same(ys[0], ys[1], "api forward")
        g = torch.randn_like(x)
        for y in ys:
            y.backward(g)
        same(xs[0].grad, xs[1].grad, f"api backward clip={clip}")
    mask = torch.rand(5, 7) > 0.5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grad = torch.randn(5, 7).to(dtype)
        same(K.ste_backward(grad, mask), grad * mask.to(dtype), f"ste {dtype}")


# --- packing ---------------------------------------------------------------------------------------


def test_packing_matches_reference_and_round_trips():
    g = torch.Generator().manual_seed(4)
    for bits in P.PACKABLE_BITS:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
        for shape, dim in [((5, 37), -1), ((5, 37), 0), ((3, 4, 9), 1), ((1,), 0), ((4, 0), -1)]:
            q = torch.randint(lo, hi, shape, generator=g, dtype=torch.int8)
            packed = K.pack_int32(q, bits, dim)
            same(packed, P.pack_int32(q, bits, dim), f"pack {bits} {shape} {dim}")
            length = shape[dim]
            same(K.unpack_int32(packed, bits, length, dim), q, f"round trip {bits} {shape}")
            same(K.unpack_int32(packed, bits, length, dim), P.unpack_int32(packed, bits, length, dim), "unpack")
        same(K.pack_int32(q.to(torch.int32), bits), P.pack_int32(q.to(torch.int32), bits), "int32 codes")


def test_packing_matches_compressed_tensors():
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers", reason="compressed-tensors is not installed"
    )
    fixed = torch.tensor([[-8, -1, 0, 1, 7, 3, -4, 2, 5, -6, 6, -7, 4, -3, -2, -5, 0, 7]], dtype=torch.int8)
    for bits in (2, 4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q = fixed.clamp(lo, hi).repeat(3, 1)
        same(K.pack_int32(q, bits), helpers.pack_to_int32(q, bits, packed_dim=1), f"ct dim1 {bits}")
        same(K.pack_int32(q, bits, dim=0), helpers.pack_to_int32(q, bits, packed_dim=0), f"ct dim0 {bits}")
    # a known word: eight 4-bit codes 0..7 -> nibbles 8..15, element 0 in the low nibble
    word = K.pack_int32(torch.arange(8, dtype=torch.int8).reshape(1, 8), 4)
    assert word.item() == int.from_bytes(bytes([0x98, 0xBA, 0xDC, 0xFE]), "little", signed=True)


# --- 1-bit compressor ------------------------------------------------------------------------------


def test_onebit_matches_reference_and_formula():
    g = torch.Generator().manual_seed(5)
    for n in (8, 64, 8 * 12_347):
        x = torch.randn(n, generator=g)
        e = torch.randn(n, generator=g) * 0.1
        e[:8] = -x[:8]  # y == 0 exactly: counts as positive
        for xin in (x, x.to(torch.bfloat16)):
            ker = K.onebit_compress(xin, e)
            ref = O.compress(xin, e)
            for name, a, b in zip(("packed", "scale", "error"), ker, ref):
                same(a, b, f"onebit {name} n={n}")
        y = x.double() + e.double()
        y = (x + e).double()
        packed, scale, new_err = K.onebit_compress(x, e)
        assert scale.item() == float(torch.tensor(math.sqrt((y * y).sum().item() / n), dtype=torch.float32))
        assert packed[0].item() == 0xFF  # the zeros
        signs = torch.where(y >= 0, 1.0, -1.0).float()
        same(new_err, (x + e) - scale * signs, "new error formula")
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.float32) - 0.5
    assert K.onebit_compress(bits, torch.zeros(16))[0].tolist() == [0x81, 0x7F]  # MSB first


def test_onebit_decode_average_and_error_feedback_telescopes():
    g = torch.Generator().manual_seed(6)
    P_, m = 3, 1000
    packed = torch.randint(0, 256, (P_, m), generator=g, dtype=torch.uint8)
    scales = torch.rand(P_, generator=g)
    same(K.onebit_decode_average(packed, scales), O.decode_average(packed, scales), "decode average")
    err = torch.zeros(8 * 512)
    total_in = torch.zeros(8 * 512, dtype=torch.float64)
    total_out = torch.zeros(8 * 512, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(8 * 512, generator=g)
        packed, scale, err = K.onebit_compress(x, err)
        total_in += x.double()
        total_out += O.decode(packed, scale).double()
    torch.testing.assert_close(total_in - total_out, err.double(), rtol=0, atol=1e-4)


def test_onebit_large_and_strided_rows_match_reference():
    # outputs of >= 4 MB go through the kernels' reused-block path; payload rows are strided views
    g = torch.Generator().manual_seed(7)
    P_, m = 3, (1 << 17) + 5
    payload = torch.randint(0, 256, (P_, m + 4), generator=g, dtype=torch.uint8)
    rows, scales = payload[:, :m], torch.rand(P_, generator=g)
    scales[1] = 0.0
    for _ in range(2):
        same(K.onebit_decode_average(rows, scales), O.decode_average(rows.contiguous(), scales), "average")
        want = torch.stack([O.decode(rows[r].contiguous(), scales[r]) for r in range(P_)])
        got = K.onebit_decode(rows, scales)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "decode rows (signed zeros too)"
    for n in ((1 << 20) + 8, (1 << 20) + 8, 3 * 65536 + 24):
        x, e = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
        for a, b in zip(K.onebit_compress(x, e), O.compress(x, e)):
            same(a, b, f"onebit compress n={n}")


# --- torch.library and torch.compile ---------------------------------------------------------------


def test_opcheck_every_op():
    ops = torch.ops.qcompress
    x = _inputs((6, 10))
    rng = torch.tensor([-2.0, 3.0])
    for args in [
        (x, None, 6, 10, 4, 4, 0, False, False, 1, 7, True),
        (x, rng, 1, 60, 60, 8, 0, True, True, 0, 0, True),
        (x.bfloat16(), None, 6, 10, 10, 2, 2, True, False, 0, 0, False),
    ]:
        torch.library.opcheck(ops.fake_quant, args)
        torch.library.opcheck(ops.quantize, args[:-1])
        torch.library.opcheck(ops.quantize_values, args[:-1])
    xg = x.clone().requires_grad_(True)
    torch.library.opcheck(ops.fake_quant, (xg, None, 6, 10, 4, 4, 0, True, False, 0, 0, True))
    q, s, z = ops.quantize(x, None, 6, 10, 4, 4, 0, False, False, 0, 0)
    torch.library.opcheck(ops.dequantize, (q, s, z.float(), 6, 10, 4, torch.bfloat16))
    torch.library.opcheck(ops.dequantize, (q, s, None, 6, 10, 4, torch.float32))
    torch.library.opcheck(ops.ste_backward, (torch.randn(6, 10), torch.rand(6, 10) > 0.5))
    torch.library.opcheck(ops.pack_int32, (q, 4))
    torch.library.opcheck(ops.unpack_int32, (ops.pack_int32(q, 4), 4, 10))
    torch.library.opcheck(ops.onebit_compress, (torch.randn(64), torch.randn(64)))
    torch.library.opcheck(ops.onebit_decode_average, (torch.randint(0, 256, (3, 8), dtype=torch.uint8), torch.rand(3)))
    torch.library.opcheck(ops.onebit_decode, (torch.randint(0, 256, (3, 8), dtype=torch.uint8), torch.rand(3)))


def test_raw_fake_quant_op_passes_the_gradient_straight_through():
    # the op's own autograd (csrc/autograd.cpp): d x^ / d x taken as the identity, the mask none
    x = _inputs((6, 10)).requires_grad_(True)
    y, mask = torch.ops.qcompress.fake_quant(x, None, 6, 10, 4, 4, 0, True, False, 0, 0, True)
    same(y, K.fake_quantize_with_mask(x.detach(), R.make_spec(4, granularity="group", group_size=4))[0], "raw op value")
    assert y.requires_grad and not mask.requires_grad
    g = torch.randn(6, 10)
    (y * g).sum().backward()
    same(x.grad, g, "straight-through gradient")
    with torch.no_grad():
        assert not torch.ops.qcompress.fake_quant(x, None, 6, 10, 4, 4, 0, True, False, 0, 0, False)[0].requires_grad


class _QLinear(torch.nn.Module):
    def __init__(self, clip):
        super().__init__()
        self.lin = torch.nn.Linear(32, 16)
        self.clip = clip

    def forward(self, x):
        w = api.fake_quantize(
            self.lin.weight,
            4,
            granularity="group",
            group_size=8,
            symmetric=False,
            clip_grad=self.clip,
            backend="kernel",
        )
        a = api.fake_quantize(x, 8, granularity="token", rounding="stochastic", seed=3, backend="kernel")
        return torch.nn.functional.linear(a, w, self.lin.bias)


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _QLinear(clip=True)
    x = torch.randn(5, 32)
    eager = model(x)
    eager.sum().backward()
    g_eager = model.lin.weight.grad.clone()
    model.lin.weight.grad = None
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    same(out, eager, "compiled forward")
    same(model.lin.weight.grad, g_eager, "compiled backward")
