"""`qcompress train` with schedules/w4a8_rotated.yaml on a Llama: the report says what was rotated
and that lm_head was untied; the export reloads to the trained model's perplexity, and the
transformers stage applies the export's transform_config."""

import json
import os

import pytest
import torch

from tests.helpers import hf_fixtures as hf
from tests.helpers.rotation_fixtures import spread_norms
from qcompress.cli import main as cli_main

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_job_rotates_reports_and_exports(tmp_path):
    folder = str(tmp_path / "llama")
    tok = hf.write_tokenizer(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
    )
    spread_norms(transformers.LlamaForCausalLM(cfg)).save_pretrained(folder)
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(" ".join(hf.WORDS[i : i + 12]) for i in range(0, len(hf.WORDS), 3)) * 4)
    out = str(tmp_path / "out")
    code = cli_main(
        [
            "train",
            os.path.join(ROOT, "schedules", "w4a8_rotated.yaml"),
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
            "4",
            "--eval-batch-size",
            "16",
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.load(open(os.path.join(out, "report.json")))
    rot = report["rotation"]
    assert rot["rotations"] == ["R1", "R2", "R4"] and rot["blocks"] == {"R1": 16, "R2": 8, "R4": 32}
    assert rot["untied"] == {"head": "lm_head", "embedding": "model.embed_tokens"}
    assert any("lm_head untied from model.embed_tokens" in n for n in report["notes"])
    assert "lm_head untied" in open(os.path.join(out, "report.md")).read()
    stages = report["stages"]
    assert stages["exported"]["perplexity"] == pytest.approx(stages["qat"]["perplexity"])
    assert "apply_transform_config" in stages["transformers"]["loaded_with"]
    config = json.load(open(os.path.join(out, "export", "config.json")))
    assert config["quantization_config"]["transform_config"]["config_groups"]["R4"]["head_dim"] == 32
