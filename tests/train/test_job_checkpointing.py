"""`qcompress train --gradient-checkpointing` end to end: the run checkpoints the model's layers
and ends with the metrics and export of the same run without it (gradients are equal bit for bit,
so the trained weights are too). Oracle: the run without the flag."""

import json
import os

from tests.helpers import hf_fixtures as hf
import torch
from safetensors.torch import load_file

from qcompress.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W8A8 = os.path.join(ROOT, "schedules", "w8a8.yaml")


def test_gradient_checkpointing_run_equals_the_plain_run(tmp_path):
    gpt2 = hf.tiny_gpt2_folder(str(tmp_path / "gpt2"))
    data = tmp_path / "data.txt"
    data.write_text("\n".join(t for t, _ in hf.topic_texts(10) * 2), encoding="utf-8")
    reports = []
    for flags in ((), ("--gradient-checkpointing",)):
        out = str(tmp_path / ("ckpt" if flags else "plain"))
        args = [
            "train",
            W8A8,
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
            *flags,
        ]
        assert cli_main(args) == 0
        reports.append(json.load(open(os.path.join(out, "report.json"))))
    plain, ckpt = reports
    assert ckpt["config"]["activation_checkpointing"] == {} and "activation_checkpointing" not in plain["config"]
    for stage in ("qat", "exported"):
        assert ckpt["stages"][stage]["loss"] == plain["stages"][stage]["loss"], stage
    # the exported tensors (the files' metadata hold each run's config, which differs by the section)
    a = load_file(os.path.join(tmp_path, "plain", "export", "model.safetensors"))
    b = load_file(os.path.join(tmp_path, "ckpt", "export", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
