"""The CUDA quantizers against the CPU kernels, bit for bit, in a process of its own: the CUDA
kernel choice (QC_CUDA_ONE_PASS=1 asks for the one-pass kernel) is read once per process.
Run by tests/quant/test_cuda_onepass.py as `python cuda_onepass_check.py`; prints one JSON line,
the list of mismatches (empty when every case equals the CPU kernels)."""

import itertools
import json

import torch

from qcompress.quant import kernels as K, reference as R

# (name, shape, granularity, bits, group). float32 groups of 12288 elements fill the default 48 KiB
# of shared memory a block gets exactly, so with the kernel's own arrays they need the opt-in;
# 16384 is the one-pass limit (64 KiB of float32: beyond some devices' opt-in, which then fall
# back to two passes); 16385 always takes two passes.
CASES = [
    ("w8_channel", (64, 4096), "channel", 8, None),
    ("w8_channel_48k", (4, 12288), "channel", 8, None),
    ("w8_channel_limit", (4, 16384), "channel", 8, None),
    ("w8_channel_past_limit", (3, 16385), "channel", 8, None),
    ("w4_g128", (96, 4096), "group", 4, 128),
    ("w4_g128_ragged", (5, 1000), "group", 4, 128),
    ("a8_token", (2, 33, 2048), "token", 8, None),
]


def _spec(gran, bits, group, sym, numerics, rounding):
    return R.make_spec(
        bits, symmetric=sym, granularity=gran, group_size=group, rounding=rounding, seed=1234567, numerics=numerics
    )


def mismatches():
    bad = []
    for (name, shape, gran, bits, group), dtype in itertools.product(CASES, (torch.float32, torch.bfloat16)):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
        x[0, ..., :7] = 0.0  # ties and a run of zeros
        for sym, numerics, rounding in itertools.product(
            [True, False], ["default", "deepspeed"], ["nearest", "stochastic"]
        ):
            spec = _spec(gran, bits, group, sym, numerics, rounding)
            what = f"{name} {dtype} sym={sym} {numerics} {rounding}"
            y_cpu, m_cpu = K.fake_quantize_with_mask(x, spec)
            y_gpu, m_gpu = K.fake_quantize_with_mask(x.cuda(), spec)
            if not torch.equal(y_gpu.cpu(), y_cpu):
                bad.append(f"{what}: values")
            if not torch.equal(m_gpu.cpu(), m_cpu):
                bad.append(f"{what}: mask")
            for a, b, part in zip(K.quantize(x.cuda(), spec), K.quantize(x, spec), ("codes", "scale", "zero point")):
                if (a is None) != (b is None) or (b is not None and not torch.equal(a.cpu(), b)):
                    bad.append(f"{what}: {part}")
    # a NaN is counted on the device and raised at the next check
    x = torch.randn(4, 256)
    x[2, 5] = float("nan")
    K.fake_quantize(x.cuda(), _spec("channel", 8, None, True, "default", "nearest"))
    try:
        K.check_nonfinite()
        bad.append("nonfinite: not counted")
    except K.NonFiniteError as err:
        if "1 quantization groups" not in str(err):
            bad.append(f"nonfinite: {err}")
    torch.cuda.synchronize()
    return bad


if __name__ == "__main__":
    print(json.dumps(mismatches()))
