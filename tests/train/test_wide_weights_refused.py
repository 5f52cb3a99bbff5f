"""Weights at 9-16 bits train but cannot be exported (the checkpoint stores at most 8-bit integer
codes): `qcompress train` refuses them before training, in one line with exit status 2 and nothing
written, and `export_quantized` names the modules and writes nothing."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main

FAST = ["--max-length", "16", "--batch-size", "8", "--eval-batch-size", "32", "--no-progress"]


def _recipe(tmp_path, start, target, period=1):
    cfg = tmp_path / "wide.yaml"
    cfg.write_text(
        "compression_training:\n  weight_quantization:\n    shared_parameters: {enabled: true}\n"
        "    different_groups:\n"
        f"      wide: {{params: {{start_bits: {start}, target_bits: {target}, "
        f"quantization_period: {period}, period_growth: linear}}, modules: [intermediate.dense]}}\n"
    )
    return str(cfg)


@pytest.fixture(scope="module")
def bert_and_data(tmp_path_factory):
    base = tmp_path_factory.mktemp("wide")
    bert = hf.tiny_bert_folder(str(base / "bert"))
    data = base / "data.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in hf.topic_texts(6)))
    return bert, str(data)


def _train(cfg, bert, data, out, steps):
    return cli_main(
        [
            "train",
            cfg,
            "--model",
            bert,
            "--data",
            data,
            "--task",
            "text-classification",
            "--out",
            out,
            "--max-steps",
            str(steps),
            "--save-steps",
            "0",
            *FAST,
        ]
    )


def test_twelve_bit_weights_are_refused_before_training(bert_and_data, tmp_path, capsys):
    bert, data = bert_and_data
    out = str(tmp_path / "out")
    assert _train(_recipe(tmp_path, 12, 12), bert, data, out, 2) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "12-bit" in err and "wide" in err and "wide.yaml" in err, err
    assert "intermediate.dense" in err and "target_bits" in err, err
    assert not os.path.exists(out)  # nothing trained, nothing written


def test_a_schedule_still_above_8_bits_at_the_last_step_is_refused(bert_and_data, tmp_path, capsys):
    """12 -> 4 bits, one bit per 10 steps (linear): at step 5 the weights are still 12-bit, at
    step 40 they are 8-bit. The first run would end at 12 bits, so it is refused with the step
    count; the second reaches 8 bits and exports."""
    from qcompress.schedule import bits_at

    bert, data = bert_and_data
    cfg = _recipe(tmp_path, 12, 4, period=10)
    assert bits_at(5, start=12, target=4, period=10, growth="linear") == 12
    assert bits_at(40, start=12, target=4, period=10, growth="linear") == 8
    out = str(tmp_path / "short")
    assert _train(cfg, bert, data, out, 5) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "12-bit" in err and "step 5" in err, err
    assert not os.path.exists(out)
    out = str(tmp_path / "long")
    assert _train(cfg, bert, data, out, 40) == 0
    assert os.path.isfile(os.path.join(out, "report.json"))


def test_export_quantized_names_the_modules_and_writes_nothing(tmp_path):
    import qcompress
    from qcompress.export import ExportError, export_quantized

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {
                    "w12": {"params": {"start_bits": 12, "target_bits": 12}, "modules": ["2"]},
                    "w8": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["0"]},
                },
            }
        }
    }
    qcompress.init_compression(model, cfg)
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=r"module '2': 12-bit weights cannot be exported.*target_bits <= 8"):
        export_quantized(model.eval(), out, cfg)
    assert not out.exists()
    # into an existing folder (force=True): the folder is left as it was, with no temporaries
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="12-bit"):
        export_quantized(model, out, cfg, force=True)
    assert sorted(os.listdir(out)) == ["keep.txt"]
