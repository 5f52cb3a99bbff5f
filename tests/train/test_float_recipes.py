"""The float-format recipes (schedules/fp8_dynamic, fp8_block, nvfp4, nvfp4a16, mxfp4a16) load,
rewrite a transformers model's Linear layers only, and train end to end with `qcompress train`."""

import json
import os
import warnings

import pytest
import torch

import qcompress as qc
from qcompress.cli import main as cli_main

hf = pytest.importorskip("tests.helpers.hf_fixtures", reason="transformers is not installed")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = ("fp8_dynamic", "fp8_block", "nvfp4", "nvfp4a16", "mxfp4a16")


def bert(hidden=128):
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_quantizes_linear_layers_only(name):
    cfg = qc.load_config(os.path.join(ROOT, "schedules", f"{name}.yaml"))
    model = bert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    quantized = {n for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None and m.qc_wq.active}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert quantized == linears
    ids = torch.randint(0, 60, (2, 7))
    model(ids).logits.sum().backward()  # trains: gradients reach the weights through the formats
    assert model.bert.encoder.layer[0].output.dense.weight.grad.abs().sum() > 0


def test_fp8_block_refuses_inputs_that_do_not_fill_groups():
    cfg = qc.load_config(os.path.join(ROOT, "schedules", "fp8_block.yaml"))
    with pytest.raises(
        qc.ConfigError, match="takes 64 inputs, not a multiple of the fp8_e4m3 activation groups of 128"
    ):
        qc.init_compression(bert(hidden=64), cfg)


def test_nvfp4_recipe_trains_and_exports_with_qcompress_train(tmp_path):
    folder = hf.tiny_bert_folder(str(tmp_path / "bert"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in hf.topic_texts(6)))
    out = tmp_path / "out"
    code = cli_main(
        [
            "train",
            os.path.join(ROOT, "schedules", "nvfp4.yaml"),
            "--model",
            folder,
            "--data",
            str(data),
            "--task",
            "text-classification",
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--max-length",
            "16",
            "--batch-size",
            "8",
            "--eval-batch-size",
            "32",
            "--no-progress",
        ]
    )
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    st = rep["stages"]
    assert st["exported"]["accuracy"] == st["qat"]["accuracy"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    qconf = json.loads((out / "export" / "config.json").read_text())["quantization_config"]
    assert {g["format"] for g in qconf["config_groups"].values()} == {"nvfp4-pack-quantized"}
    print("transformers stage:", st.get("transformers"))
