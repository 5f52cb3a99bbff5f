"""The compiled extension loaded, unless a pure-Python install was asked for by name.

Every kernel test skips when the extension is missing, so without this test a build whose C++
extension failed to compile or to load would still pass `make test`. A pure-Python install is
asked for with `make test PURE_PYTHON=1`, which sets QCOMPRESS_PURE_PYTHON=1: setup.py then skips
the build, and the library (qcompress/quant/kernels.py) leaves even a built extension unloaded, so
the tests run the reference paths.
"""

import os
import subprocess
import sys

import pytest

from qcompress.quant import kernels, lowbit

PURE = os.environ.get("QCOMPRESS_PURE_PYTHON") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_compiled_extension_loaded():
    if PURE:
        pytest.skip("QCOMPRESS_PURE_PYTHON=1: a pure-Python install was asked for; the reference paths run")
    assert kernels.available(), (
        f"the qcompress C++ extension did not load ({kernels.load_error()}), so every kernel test "
        "would skip: run `make build` and read its compiler output, or ask for a pure-Python install "
        "by name: make test PURE_PYTHON=1"
    )
    assert lowbit.available(), "the extension loaded without its low-bit operators (a stale build): make clean build"


def test_pure_python_by_name_leaves_the_extension_unloaded():
    """In a fresh interpreter with QCOMPRESS_PURE_PYTHON=1 the operators are not registered and the
    quantizer still runs, on the reference: the default call equals backend="reference"."""
    code = (
        "import torch, warnings; warnings.simplefilter('ignore')\n"
        "from qcompress.quant import kernels, lowbit, reference\n"
        "from qcompress.quant.api import fake_quantize_spec\n"
        "x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))\n"
        "spec = reference.make_spec(4, symmetric=True, granularity='channel')\n"
        "same = torch.equal(fake_quantize_spec(x, spec), fake_quantize_spec(x, spec, backend='reference'))\n"
        "print(kernels.available(), lowbit.available(), hasattr(torch.ops.qcompress, 'fake_quant'), same)\n"
        "print(kernels.load_error())\n"
    )
    env = dict(os.environ, QCOMPRESS_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    flags, error = out.stdout.splitlines()
    assert flags == "False False False True", out.stdout
    assert "QCOMPRESS_PURE_PYTHON=1" in error
