"""The one-pass CUDA quantizer (a group held on chip: read once) against the CPU kernels, bit for
bit: W8 per channel, W4 group 128, A8 per token, float32 and bfloat16, at and beyond the on-chip
limit (16384 elements a group; past it the two-pass kernels run).

Skips (with the reason) when there is no GPU or the extension was built without CUDA."""
import itertools

import pytest
import torch

from qcompress.quant import kernels as K, reference as R

if not K.available():
    pytest.skip(f"qcompress C++ extension not built ({K.load_error()})", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the one-pass CUDA quantizer is only compiled here (make cuda-check)",
                allow_module_level=True)
if not torch.ops.qcompress.fake_quant.default.has_kernel_for_dispatch_key("CUDA"):
    pytest.skip("the extension was built without CUDA (QCOMPRESS_CUDA=1 with nvcc to build it)",
                allow_module_level=True)

pytestmark = pytest.mark.cuda

# (name, shape, granularity, bits, group): 16384 columns is the on-chip limit, 16385 falls back
CASES = [("w8_channel", (64, 4096), "channel", 8, None), ("w8_channel_limit", (4, 16384), "channel", 8, None),
         ("w8_channel_past_limit", (3, 16385), "channel", 8, None), ("w4_g128", (96, 4096), "group", 4, 128),
         ("w4_g128_ragged", (5, 1000), "group", 4, 128), ("a8_token", (2, 33, 2048), "token", 8, None)]


def _spec(gran, bits, group, sym, numerics, rounding):
    return R.make_spec(bits, symmetric=sym, granularity=gran, group_size=group, rounding=rounding,
                       seed=1234567, numerics=numerics)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_onepass_equals_cpu_bit_for_bit(case, dtype):
    _, shape, gran, bits, group = case
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    x[0, ..., :7] = 0.0                          # ties and a run of zeros
    for sym, numerics, rounding in itertools.product([True, False], ["default", "deepspeed"],
                                                     ["nearest", "stochastic"]):
        spec = _spec(gran, bits, group, sym, numerics, rounding)
        what = f"{case[0]} {dtype} sym={sym} {numerics} {rounding}"
        y_cpu, m_cpu = K.fake_quantize_with_mask(x, spec)
        y_gpu, m_gpu = K.fake_quantize_with_mask(x.cuda(), spec)
        torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        assert torch.equal(m_gpu.cpu(), m_cpu), what
        for a, b, part in zip(K.quantize(x.cuda(), spec), K.quantize(x, spec), ("codes", "scale", "zero point")):
            if b is None:
                assert a is None, (what, part)
                continue
            assert torch.equal(a.cpu(), b), (what, part)


def test_onepass_counts_nonfinite_groups():
    x = torch.randn(4, 256)
    x[2, 5] = float("nan")
    spec = _spec("channel", 8, None, True, "default", "nearest")
    K.fake_quantize(x.cuda(), spec)
    with pytest.raises(K.NonFiniteError, match="1 quantization groups"):
        K.check_nonfinite()
