"""benchmarks/gpu.py --quick without CUDA: the device check's parts run on the CPU at tiny sizes,
one JSON comes back and the results section is written from it. Oracles: the reference quantizer,
the stage-0 engine's losses, the 1-bit compressor's signs, the exact reload."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check itself runs on the GPU")
def test_quick_check_cpu_fallback_runs_every_part(tmp_path):
    out, page = tmp_path / "quick.json", tmp_path / "gpu.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu.py",
            "--quick",
            "--json",
            str(out),
            "--page",
            str(page),
            "--pytest-paths",
            "tests/quant/test_kernels_cuda.py",
            "--models",
            "llama",
            "--widths",
            "32",
            "--backend",
            "aot_eager",
            "--budget-s",
            "900",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    parts = doc["parts"]
    for name in ("pytest", "quantizers", "packed", "onebit", "zero3", "steps"):
        assert parts[name]["status"] == "ok", (name, parts[name])
    assert all(r["equals_reference"] for r in parts["quantizers"]["result"])
    z = parts["zero3"]["result"]
    assert z["backend"] == "gloo" and z["max_abs_diff"] < 1e-5
    assert parts["onebit"]["result"]["signs_match"]
    assert all(r["fast_vs_exact_max_rel"] < 1e-2 for r in parts["packed"]["result"])
    steps = {r["variant"]: r for r in parts["steps"]["result"]}
    for v in ("fp32", "w8a8", "w4a8_g128", "w4_g128"):
        for mode in ("eager", "compiled"):
            assert steps[f"{v}_{mode}"]["ms"] > 0, steps
    assert parts["torchao"]["status"] in ("absent", "ok") or "torchao_w4a8_compiled" in steps
    text = page.read_text()
    assert "<!-- generated: quick-check -->" in text and "| zero3 | ok |" in text
