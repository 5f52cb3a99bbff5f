"""`qcompress train --calibrate gptq` and the GPTQ recipes on a tiny GPT-2: the PTQ and QAT stages
start from GPTQ's solution (another PTQ than minmax's), the export reloaded equals the trained
model, the fragment and the flag are the same run, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main
from tests.train.test_train_job import FAST, ROOT, train_until_qat_checkpoint, write_data

G128 = os.path.join(ROOT, "schedules", "w4a16_g128.yaml")
WITH_GPTQ = os.path.join(ROOT, "schedules", "with_gptq.yaml")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("gptq_job")
    gpt2 = hf.tiny_gpt2_folder(str(base / "gpt2"))
    data = write_data(str(base / "d"), "txt", hf.topic_texts(10) * 2)
    return gpt2, data


def stages(out):
    return json.load(open(os.path.join(out, "report.json")))["stages"]


def test_calibrate_gptq_trains_from_gptqs_solution(setup, tmp_path, capsys):
    gpt2, data = setup
    base = ["--model", gpt2, "--data", data, "--task", "causal-lm", "--max-steps", "2", *FAST]
    assert cli_main(["train", G128, *base, "--out", str(tmp_path / "rtn")]) == 0
    capsys.readouterr()
    assert cli_main(["train", G128, *base, "--out", str(tmp_path / "gptq"), "--calibrate", "gptq"]) == 0
    said = capsys.readouterr().out
    assert "solved by GPTQ" in said
    rtn, gptq = stages(tmp_path / "rtn"), stages(tmp_path / "gptq")
    assert gptq["fp32"]["perplexity"] == rtn["fp32"]["perplexity"]
    assert gptq["ptq"]["perplexity"] != rtn["ptq"]["perplexity"]
    assert gptq["exported"]["perplexity"] == gptq["qat"]["perplexity"]
    assert gptq["exported"]["max_logit_diff_vs_qat"] == 0.0
    # the fragment is the flag
    assert cli_main(["train", G128, WITH_GPTQ, *base, "--out", str(tmp_path / "fragment")]) == 0
    frag = stages(tmp_path / "fragment")
    for stage in ("ptq", "qat", "exported"):
        assert frag[stage]["perplexity"] == gptq[stage]["perplexity"], stage


def test_calibrate_gptq_with_no_group_to_take_it_is_refused(setup, tmp_path, capsys):
    gpt2, data = setup
    own = tmp_path / "own.yaml"
    own.write_text(
        "compression_training:\n  weight_quantization:\n    different_groups:\n      w4_g128:\n"
        "        params:\n          observer: mse\n"
    )
    code = cli_main(
        [
            "train",
            G128,
            str(own),
            "--model",
            gpt2,
            "--data",
            data,
            "--task",
            "causal-lm",
            "--max-steps",
            "1",
            "--out",
            str(tmp_path / "x"),
            "--calibrate",
            "gptq",
            *FAST,
        ]
    )
    assert code == 2 and "--calibrate gptq: no weight quantization group" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x" / "report.json")


def test_calib_batches_sets_how_many_batches_gptq_reads(setup, tmp_path, capsys):
    """--calib-batches N: GPTQ (and every calibration) reads N training batches (of 9: 36 blocks in
    batches of 4); 1 batch gives another PTQ than the default 8, 20 reads all 9 and says 9, and 0
    is refused before anything runs."""
    gpt2, data = setup
    base = ["--model", gpt2, "--data", data, "--task", "causal-lm", "--max-steps", "1", *FAST, "--eval-batch-size", "4"]
    assert cli_main(["train", G128, *base, "--out", str(tmp_path / "all"), "--calibrate", "gptq"]) == 0
    assert "solved by GPTQ on 8 calibration batches" in capsys.readouterr().out
    one = ["--calibrate", "gptq", "--calib-batches", "1"]
    assert cli_main(["train", G128, *base, "--out", str(tmp_path / "one"), *one]) == 0
    assert "solved by GPTQ on 1 calibration batches" in capsys.readouterr().out
    more = ["--calibrate", "gptq", "--calib-batches", "20"]
    assert cli_main(["train", G128, *base, "--out", str(tmp_path / "more"), *more]) == 0
    assert "solved by GPTQ on 9 calibration batches" in capsys.readouterr().out
    assert stages(tmp_path / "one")["ptq"]["perplexity"] != stages(tmp_path / "all")["ptq"]["perplexity"]
    code = cli_main(["train", G128, *base, "--out", str(tmp_path / "zero"), "--calib-batches", "0"])
    assert code == 2 and "--calib-batches must be >= 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "zero")


def test_resume_after_gptq_matches_uninterrupted(setup, tmp_path, monkeypatch):
    gpt2, data = setup
    args = [
        G128,
        "--model",
        gpt2,
        "--data",
        data,
        "--task",
        "causal-lm",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        "--calibrate",
        "gptq",
        *FAST,
    ]
    assert cli_main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    out = str(tmp_path / "cut")
    train_until_qat_checkpoint([*args, "--out", out], 2, monkeypatch)
    assert cli_main(["train", *args, "--out", out, "--resume"]) == 0
    whole, cut = stages(tmp_path / "whole"), stages(out)
    for stage in ("ptq", "qat", "exported"):
        assert cut[stage]["perplexity"] == whole[stage]["perplexity"], stage


def test_calibrate_gptq_in_optimizer_step_mode_with_quantized_activations(setup, tmp_path):
    """schedules/w8a8.yaml quantizes the weights once per optimizer step from a master copy (GPTQ's
    compensated weights become that master) and the activations per token."""
    gpt2, data = setup
    out = str(tmp_path / "w8a8")
    assert (
        cli_main(
            [
                "train",
                os.path.join(ROOT, "schedules", "w8a8.yaml"),
                "--model",
                gpt2,
                "--data",
                data,
                "--task",
                "causal-lm",
                "--max-steps",
                "2",
                "--out",
                out,
                "--calibrate",
                "gptq",
                *FAST,
            ]
        )
        == 0
    )
    st = stages(out)
    assert st["exported"]["perplexity"] == st["qat"]["perplexity"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
