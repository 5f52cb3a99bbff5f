"""Training, exporting and reloading on the GPU: the fused QAT layers against the unfused path,
the fast reload's CUDA kernels against the exact reload, and `qcompress train --device cuda` end
to end (exported == qat bit for bit, as on the CPU).

Skips (with the reason) without a GPU or without the CUDA kernels.
"""

import copy
import itertools
import json
import os

import pytest
import torch
import torch.nn as nn

from tests.helpers import hf_fixtures as hf
from qcompress import init_compression
from qcompress.cli import main as cli_main
from qcompress.nn import fused
from qcompress.quant import kernels as K, lowbit

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU paths are only compiled (make cuda-check)", allow_module_level=True)
if not (K.available() and torch.ops.qcompress.fake_quant.default.has_kernel_for_dispatch_key("CUDA")):
    pytest.skip(
        "the extension was built without CUDA (QCOMPRESS_CUDA=1 with nvcc to build it)", allow_module_level=True
    )

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- fused QAT layers --------------------------------------------------------------------------


def qat_cfg(granularity, calibration, learn, wbits=8):
    params = {"start_bits": wbits, "target_bits": wbits, "quantization_period": 0}
    if granularity == "group":
        params["group_size"] = 16
    else:
        params["granularity"] = granularity
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "schedule_offset": 0,
                    "range_learning": learn,
                },
                "different_groups": {"w": {"params": params}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "range_calibration": calibration, "schedule_offset": 0},
                "different_groups": {"a": {"params": {"bits": 8}}},
            },
        }
    }


def fwd_bwd(model, x, use_fused):
    model = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_(True)
    with fused.enabled(use_fused):
        out = model(x)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    (out * r).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads["input"] = x.grad
    return out, grads


@pytest.mark.parametrize(
    "kind,granularity,calibration,learn",
    list(itertools.product(("linear", "conv"), ("channel", "group"), ("dynamic", "static"), (False, True))),
)
def test_fused_layers_on_the_gpu_equal_the_unfused_path(kind, granularity, calibration, learn):
    torch.manual_seed(0)
    if kind == "linear":
        model, shape = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32)), (3, 7, 48)
    else:
        model, shape = (
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1)),
            (2, 3, 9, 9),
        )
    init_compression(model, qat_cfg(granularity, calibration, learn))
    model.to(DEV)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 0.3).to(DEV)
    first = model[0]
    assert fused.plan(first, x, first.qc_kind) is not None
    (out_a, ga), (out_b, gb) = fwd_bwd(model, x, True), fwd_bwd(model, x, False)
    assert out_a.is_cuda and torch.equal(out_a, out_b)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert (ga[name] is None) == (gb[name] is None), name
        if ga[name] is not None:
            assert ga[name].is_cuda and torch.equal(ga[name], gb[name]), name


# --- fast reload on the GPU ----------------------------------------------------------------------


@pytest.mark.skipif(not lowbit.runs_on(DEV), reason="the low-bit operators have no CUDA kernel in this build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [False, True], ids=["cublas", "cuda_kernels"])
def test_fast_reload_on_the_gpu(tmp_path, monkeypatch, dtype, kernels):
    """On a GPU the fast reload multiplies by the exact path's weight, decoded once: the exact
    reload's outputs bit for bit. With CUDA_LOWBIT_KERNELS, the CUDA low-bit kernels against the
    exact reload with test_lowbit_kernels' bound (the same weight bit for bit; only sums differ)."""
    from tests.quant.test_lowbit_kernels import WEIGHTS, cfg_for, check, exact_and_bound, export_pair, odd_model
    from qcompress.export.fast import lowbit_plans
    from qcompress.export.fast import plans_of

    monkeypatch.setattr(lowbit_plans, "CUDA_LOWBIT_KERNELS", kernels)
    for (bits, gran, gs), act in itertools.product(WEIGHTS, (None, ("dynamic", True))):
        g = torch.Generator().manual_seed(bits)
        folder = tmp_path / f"w{bits}{gran}{act is not None}"
        trained, exact, fast = export_pair(
            folder,
            lambda: odd_model(dtype),
            cfg_for(bits, gran, gs, False, act),
            torch.randn(6, 100, generator=g).to(dtype),
        )
        assert set(plans_of(fast).values()) == {"lowbit_a8" if act else "lowbit"}
        exact, fast = exact.to(DEV), fast.to(DEV)
        with torch.no_grad():
            for x in (torch.randn(1, 100, generator=g), torch.randn(3, 11, 100, generator=g)):
                h = x.to(dtype).to(DEV)
                for i, (e, f) in enumerate(zip(exact, fast)):
                    if not isinstance(e, nn.Linear):
                        h = e(h)
                        continue
                    assert torch.equal(f.weight, e.weight)
                    want, bound = exact_and_bound(e, h, dtype)
                    got = f(h)
                    assert got.is_cuda
                    if kernels:
                        check(got, want, bound, f"w{bits} {gran} act={act} layer {i} {tuple(h.shape)}")
                    else:
                        assert torch.equal(got, want), f"w{bits} {gran} act={act} layer {i}"
                    h = want
        if not kernels:  # decoded once, and again after a move
            first = fast[0]
            assert first.__dict__["qx_dense"][1].is_cuda
            fast.cpu()
            assert "qx_dense" not in first.__dict__


# --- qcompress train --device cuda ----------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("job")
    return dict(
        bert=hf.tiny_bert_folder(str(base / "bert")),
        gpt2=hf.tiny_gpt2_folder(str(base / "gpt2")),
        rows=hf.topic_texts(10),
    )


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for t, y in rows:
            fh.write(json.dumps({"text": t, "label": y}) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "task,recipe",
    [("text-classification", "w8a8.yaml"), ("causal-lm", "w4a8_g128.yaml"), ("causal-lm", "w4a16_g32.yaml")],
)
def test_train_on_the_gpu_exports_the_trained_model(folders, tmp_path, capsys, task, recipe):
    model = folders["bert"] if task == "text-classification" else folders["gpt2"]
    data = write_jsonl(tmp_path / "d.jsonl", folders["rows"] * (1 if task == "text-classification" else 2))
    out = str(tmp_path / "out")
    args = [
        os.path.join(ROOT, "schedules", recipe),
        "--model",
        model,
        "--data",
        data,
        "--task",
        task,
        "--out",
        out,
        "--max-steps",
        "3",
        "--max-length",
        "16",
        "--batch-size",
        "8",
        "--no-progress",
        "--device",
        "cuda",
        "--baseline",
    ]
    assert cli_main(["train", *args]) == 0
    said = capsys.readouterr().out
    assert "training on cuda:0" in said
    rep = json.load(open(os.path.join(out, "report.json")))
    metric = rep["metric"]
    st = rep["stages"]
    for stage in ("fp32", "fp32_finetuned", "ptq", "qat", "exported"):
        assert st[stage][metric] is not None, stage
    # the reload runs on the GPU with the same kernels: the trained model, bit for bit
    assert st["exported"]["reload_mode"] == "exact"
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert st["exported"][metric] == st["qat"][metric]


def test_device_cpu_on_a_gpu_machine_trains_on_the_cpu(folders, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", folders["rows"])
    out = str(tmp_path / "out")
    assert (
        cli_main(
            [
                "train",
                os.path.join(ROOT, "schedules", "w8a8.yaml"),
                "--model",
                folders["bert"],
                "--data",
                data,
                "--task",
                "text-classification",
                "--out",
                out,
                "--max-steps",
                "2",
                "--max-length",
                "16",
                "--batch-size",
                "8",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert "training on the CPU" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "report.json")))["stages"]["exported"]["max_logit_diff_vs_qat"] == 0.0


def test_a_nan_in_gpu_qat_is_raised_at_the_scheduler_step():
    """The CUDA quantizers count NaN/Inf instead of syncing per call; the step reports them."""
    import qcompress as qc
    from qcompress.errors import NonFiniteError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    cfg = qat_cfg("channel", "dynamic", False)
    init_compression(model, cfg)
    model.to(DEV)
    sched = qc.CompressionScheduler(model, cfg)
    x = torch.randn(8, 16, device=DEV)
    model(x).sum().backward()
    sched.step()  # clean step: nothing to report
    x[3, 5] = float("nan")
    model(x).sum().backward()
    with pytest.raises(NonFiniteError, match="cuda:0 contained NaN or Inf"):
        sched.step()
