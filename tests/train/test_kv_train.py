"""`qcompress train` with a kv_cache_quantization section merged over a recipe: the trained model
quantizes its KV cache, the PTQ stage calibrates its ranges, and the export (kv_cache_scheme,
k_scale / v_scale) reloads to the trained model bit for bit."""

from __future__ import annotations

import json
import os


import pytest

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W8A8 = os.path.join(ROOT, "schedules", "w8a8.yaml")


@pytest.mark.filterwarnings("ignore:the weight groups")  # W8A8 on GPT-2's Conv1D: said by the job
def test_train_job_quantizes_and_exports_the_kv_cache(tmp_path):
    folder = hf.tiny_gpt2_folder(str(tmp_path / "gpt2"))
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(t for t, _ in hf.topic_texts(10)) + "\n", encoding="utf-8")
    kv = tmp_path / "kv.json"
    kv.write_text(
        json.dumps(
            {"compression_training": {"kv_cache_quantization": {"enabled": True, "format": "int8", "strategy": "head"}}}
        ),
        encoding="utf-8",
    )
    out = str(tmp_path / "out")
    assert (
        cli_main(
            [
                "train",
                W8A8,
                str(kv),
                "--model",
                folder,
                "--data",
                str(data),
                "--task",
                "causal-lm",
                "--out",
                out,
                "--max-steps",
                "2",
                "--max-length",
                "16",
                "--batch-size",
                "8",
                "--eval-batch-size",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    rep = json.load(open(os.path.join(out, "report.json")))
    st = rep["stages"]
    assert st["exported"]["perplexity"] == st["qat"]["perplexity"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    cfg = json.load(open(os.path.join(out, "export", "config.json")))
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    assert cfg["qcompress"]["kv_cache"]["modules"] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(out, "export", "model.safetensors"))
    assert tensors["transformer.h.1.attn.v_scale"].shape == (2, 1, 1)
