import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", message="qcompress kernels are not built")


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A single-process engine at ZeRO stage 2/3 creates a private 1-rank process group that lives
    on in the pytest process; later tests would then see rank 0 of it whatever RANK says, and tests
    that need no group would skip. Each test ends without one."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on the GPU (the rest of the suite sees none)")


def pytest_report_header(config):
    """Whether the kernel tests can run: they skip without the extension, and
    tests/quant/test_extension_loaded.py fails then unless QCOMPRESS_PURE_PYTHON=1 asked for it."""
    from qcompress.quant import kernels

    if kernels.available():
        return "qcompress C++ extension: loaded"
    return f"qcompress C++ extension: NOT loaded ({kernels.load_error()}); the kernel tests skip"


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request, monkeypatch):
    """The suite is written for the CPU, and the engine and `qcompress train` take a GPU when torch
    sees one (as DeepSpeed does): on a GPU machine, tests not marked `cuda` see none, nor do the
    ranks they spawn. The `cuda` tests run there on the GPU."""
    import torch

    if request.node.get_closest_marker("cuda") is None and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield
