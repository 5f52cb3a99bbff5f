"""The CUDA integer quantizers against the CPU kernels, bit for bit: the default two-pass kernels
and the one-pass kernel (a group held on chip, read once; opt-in with QC_CUDA_ONE_PASS=1 until it
has passed here on a GPU). W8 per channel up to and past the one-pass limit (including a float32
group that needs the shared-memory opt-in), W4 group 128, A8 per token, float32 and bfloat16.
Each mode runs in a process of its own (tests/helpers/cuda_onepass_check.py), since the kernel choice is
read once per process.

Skips (with the reason) when there is no GPU or the extension was built without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qcompress.quant import kernels as K
from tests.helpers.child_env import child_env

if not K.available():
    pytest.skip(f"qcompress C++ extension not built ({K.load_error()})", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA quantizers are only compiled here (make cuda-check)", allow_module_level=True)
if not torch.ops.qcompress.fake_quant.default.has_kernel_for_dispatch_key("CUDA"):
    pytest.skip(
        "the extension was built without CUDA (QCOMPRESS_CUDA=1 with nvcc to build it)", allow_module_level=True
    )

pytestmark = pytest.mark.cuda

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("one_pass", ["0", "1"], ids=["two_pass_default", "one_pass_asked"])
def test_cuda_quantizer_equals_cpu_bit_for_bit(one_pass):
    env = child_env(QC_CUDA_ONE_PASS=one_pass)
    proc = subprocess.run(
        [sys.executable, os.path.join(TESTS, "helpers", "cuda_onepass_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bad == [], bad[:20]
