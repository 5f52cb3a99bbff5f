"""The report says how much of the export is full-precision embedding tables and how to quantize
them (the with_embeddings fragment): the recipes leave embeddings unquantized, so on a small model
they bound the compression ratio. Oracle: the export's own tensors, read back."""

import json
import os

import pytest
from safetensors import safe_open

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
    "2",
    "--save-steps",
    "0",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("emb")
    bert = hf.tiny_bert_folder(str(base / "bert"))
    data = base / "data.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in hf.topic_texts(6)))
    return bert, str(data)


def _run(setup, out, *recipes):
    bert, data = setup
    assert (
        cli_main(
            ["train", *recipes, "--model", bert, "--data", data, "--task", "text-classification", "--out", out, *FAST]
        )
        == 0
    )
    return json.load(open(os.path.join(out, "report.json")))


def test_the_report_says_the_embeddings_stay_full_precision_and_how_to_quantize_them(setup, tmp_path, capsys):
    out = str(tmp_path / "w8a8")
    rep = _run(setup, out, "w8a8")
    with safe_open(os.path.join(out, "export", "model.safetensors"), "pt") as f:
        emb = {k: f.get_tensor(k) for k in f.keys() if "embeddings" in k and k.endswith("_embeddings.weight")}
    want = sum(t.numel() * t.element_size() for t in emb.values())
    assert emb and all(t.is_floating_point() for t in emb.values())
    assert rep["sizes"]["float_embedding_bytes"] == want
    notes = [n for n in rep["notes"] if "embedding tables kept in full precision" in n]
    assert len(notes) == 1 and "with_embeddings" in notes[0], rep["notes"]
    assert f"{want / 2**20:.1f} MiB" in notes[0]
    assert "with_embeddings" in open(os.path.join(out, "report.md")).read()
    assert "note: " in capsys.readouterr().out
    # with the fragment, the embeddings are 8-bit codes: nothing to say
    rep = _run(setup, str(tmp_path / "emb"), "w8a8", "with_embeddings")
    assert rep["sizes"]["float_embedding_bytes"] == 0
    assert not [n for n in rep["notes"] if "embedding tables kept in full precision" in n]
