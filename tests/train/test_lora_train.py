"""`qcompress train --lora-r R` end to end on a tiny GPT-2 (transformers Conv1D layers): LoRA QAT
exports the merged quantized model, whose reload ('exported') scores as the trained model ('qat');
mode qlora exports the base plus peft's adapter files, and the reload with the adapter scores the
same. Oracle: the run's own trained model."""

import json
import os

from tests.helpers import hf_fixtures as hf
import pytest

from qcompress.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W4 = os.path.join(ROOT, "schedules", "w4a16_g32.yaml")


@pytest.mark.parametrize("mode", ["qat", "qlora"])
def test_lora_r_trains_adapters_and_exports(tmp_path, mode):
    if mode == "qlora":
        pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")
    gpt2 = hf.tiny_gpt2_folder(str(tmp_path / "gpt2"))
    data = tmp_path / "data.txt"
    data.write_text("\n".join(t for t, _ in hf.topic_texts(10) * 2), encoding="utf-8")
    extra = tmp_path / "lora.yaml"
    extra.write_text(f"compression_training:\n  lora:\n    mode: {mode}\n    alpha: 8\n", encoding="utf-8")
    out = str(tmp_path / "run")
    args = [
        "train",
        W4,
        str(extra),
        "--model",
        gpt2,
        "--data",
        str(data),
        "--task",
        "causal-lm",
        "--out",
        out,
        "--max-steps",
        "2",
        "--max-length",
        "32",
        "--batch-size",
        "4",
        "--no-progress",
        "--lora-r",
        "4",
        "--lr",
        "0.01",
    ]
    assert cli_main(args) == 0
    report = json.load(open(os.path.join(out, "report.json")))
    section = report["config"]["compression_training"]["lora"]
    assert section == {"mode": mode, "alpha": 8, "enabled": True, "r": 4}
    stages = report["stages"]
    assert stages["exported"]["loss"] == stages["qat"]["loss"]
    assert stages["exported"]["max_logit_diff_vs_qat"] == 0.0
    files = sorted(os.listdir(os.path.join(out, "export")))
    assert ("adapter_config.json" in files) == (mode == "qlora")
    if mode == "qlora":
        conf = json.load(open(os.path.join(out, "export", "adapter_config.json")))
        assert conf["r"] == 4 and conf["fan_in_fan_out"] is True
