"""`qcompress train --task causal-lm` on a mixture-of-experts model: the experts are quantized and
exported, and the model's router load-balancing loss is part of the training loss."""

import functools
import json
import os

import pytest
import yaml

from tests.helpers import hf_fixtures as hf
from tests.helpers.moe_fixtures import make_moe
from qcompress.cli import main as cli_main

transformers = pytest.importorskip("transformers")


def test_causal_lm_job_trains_quantized_experts_with_the_router_aux_loss(tmp_path, monkeypatch):
    folder = str(tmp_path / "moe")
    tok = hf.write_tokenizer(folder)
    model = make_moe("qwen3_moe")
    model.resize_token_embeddings(len(tok))
    model.config.router_aux_loss_coef = 0.02
    model.save_pretrained(folder)
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(" ".join(hf.WORDS[i : i + 12]) for i in range(0, len(hf.WORDS), 3)) * 4)
    cfg = tmp_path / "w4_experts.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                        "different_groups": {
                            "experts": {
                                "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                                "modules": [r"mlp\.experts"],
                            }
                        },
                    }
                }
            }
        )
    )
    seen = []
    cls = transformers.Qwen3MoeForCausalLM
    real = cls.forward

    @functools.wraps(real)  # keeps the signature, which says the model takes the flag
    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.training:
            seen.append((kwargs.get("output_router_logits"), out.aux_loss))
        return out

    monkeypatch.setattr(cls, "forward", spy)
    out = str(tmp_path / "out")
    code = cli_main(
        [
            "train",
            str(cfg),
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
    # every training forward asked for the router logits, so `loss` carried the aux loss
    assert seen and all(flag is True and aux is not None and float(aux) > 0 for flag, aux in seen)
    config = json.load(open(os.path.join(out, "export", "config.json")))
    assert sorted(config["qcompress"]["experts"]) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
    ]
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["stages"]["exported"]["perplexity"] == pytest.approx(report["stages"]["qat"]["perplexity"])
