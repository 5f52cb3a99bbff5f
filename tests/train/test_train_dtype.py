"""`qcompress train --dtype bfloat16`: the model is loaded, trained, exported and reloaded in
bfloat16, so an NVFP4 export with quantized activations runs in transformers (compressed-tensors
decompresses FP4 weights to bfloat16 only); in float32 the report says to use --dtype bfloat16."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main
from tests.train.test_causal_lm_loaders import tiny_llama_folder

FAST = [
    "--max-length",
    "16",
    "--batch-size",
    "8",
    "--eval-batch-size",
    "32",
    "--no-progress",
    "--max-steps",
    "2",
    "--save-steps",
    "0",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("dtype")
    corpus = base / "corpus.txt"
    corpus.write_text("\n".join(t for t, _ in hf.topic_texts(12)))
    return tiny_llama_folder(str(base / "llama")), str(corpus)


def _run(setup, out, *extra):
    model, corpus = setup
    assert (
        cli_main(
            ["train", "nvfp4", "--model", model, "--data", corpus, "--task", "causal-lm", "--out", out, *FAST, *extra]
        )
        == 0
    )
    return json.load(open(os.path.join(out, "report.json")))


def test_bfloat16_runs_end_to_end_and_transformers_loads_the_nvfp4_export(setup, tmp_path):
    out = str(tmp_path / "bf16")
    rep = _run(setup, out, "--dtype", "bfloat16")
    cfg = json.load(open(os.path.join(out, "export", "config.json")))
    assert cfg["dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "export", "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16  # unquantized weights
    st = rep["stages"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert st["transformers"].get("loaded_with") == "from_pretrained", st["transformers"]
    assert st["transformers"]["perplexity"] is not None
    assert st["transformers"]["max_weight_diff_vs_exported"] == 0.0


def test_float32_says_how_to_get_there(setup, tmp_path):
    rep = _run(setup, str(tmp_path / "fp32"))
    st = rep["stages"]["transformers"]
    assert st["perplexity"] is None and "--dtype bfloat16" in st["reason"], st


def test_dtype_is_part_of_the_run_a_resume_must_match(setup, tmp_path, capsys):
    out = str(tmp_path / "run")
    _run(setup, out)
    model, corpus = setup
    code = cli_main(
        [
            "train",
            "nvfp4",
            "--model",
            model,
            "--data",
            corpus,
            "--task",
            "causal-lm",
            "--out",
            out,
            *FAST,
            "--dtype",
            "bfloat16",
            "--resume",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "other options" in err, err
