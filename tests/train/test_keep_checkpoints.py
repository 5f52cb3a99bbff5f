"""`qcompress train --keep-checkpoints {all,last,none}` (default last): what a finished run leaves in
--out/checkpoints. all: every checkpoint saved (each --save-steps); last: the latest of each
training phase, as --resume uses; none: the engine checkpoints and the baseline's weights removed
once the report is written (progress.json stays). The export and the report are the same."""

import json
import os

import pytest

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main

FAST = [
    "--max-length",
    "16",
    "--batch-size",
    "8",
    "--eval-batch-size",
    "32",
    "--no-progress",
    "--max-steps",
    "4",
    "--save-steps",
    "2",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("keep")
    bert = hf.tiny_bert_folder(str(base / "bert"))
    data = base / "data.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in hf.topic_texts(6)))
    return bert, str(data)


def _run(setup, out, *extra):
    bert, data = setup
    code = cli_main(
        [
            "train",
            "w8a8",
            "--model",
            bert,
            "--data",
            data,
            "--task",
            "text-classification",
            "--out",
            out,
            "--baseline",
            *FAST,
            *extra,
        ]
    )
    assert code == 0
    return json.load(open(os.path.join(out, "report.json")))


def _tags(out, phase):
    folder = os.path.join(out, "checkpoints", phase)
    return sorted(n for n in os.listdir(folder) if n.startswith("step")) if os.path.isdir(folder) else []


def test_default_last_keeps_the_latest_of_each_phase(setup, tmp_path):
    out = str(tmp_path / "last")
    _run(setup, out)
    assert _tags(out, "qat") == ["step4"] and _tags(out, "fp32") == ["step4"]
    assert os.path.isfile(os.path.join(out, "checkpoints", "fp32_finetuned.safetensors"))


def test_all_keeps_every_checkpoint_and_none_keeps_none(setup, tmp_path, capsys):
    last = _run(setup, str(tmp_path / "last"))
    out = str(tmp_path / "all")
    rep = _run(setup, out, "--keep-checkpoints", "all")
    assert _tags(out, "qat") == ["step2", "step4"] and _tags(out, "fp32") == ["step2", "step4"]
    out = str(tmp_path / "none")
    capsys.readouterr()
    rep_none = _run(setup, out, "--keep-checkpoints", "none")
    left = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert left == ["progress.json"], left
    assert "--keep-checkpoints none" in capsys.readouterr().out
    for r in (rep, rep_none):  # the same run otherwise
        assert r["stages"]["qat"] == last["stages"]["qat"]
        assert r["sizes"]["export_bytes"] == last["sizes"]["export_bytes"]
    # a run without its baseline's weights cannot lend it, and says why
    bert, data = setup
    code = cli_main(
        [
            "train",
            "w8a8",
            "--model",
            bert,
            "--data",
            data,
            "--task",
            "text-classification",
            "--out",
            str(tmp_path / "borrow"),
            "--baseline-from",
            out,
            *FAST,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--keep-checkpoints none" in err, err
