"""`qcompress train` under torchrun with 2 gloo ranks and a config's `pipeline` / `tensor_parallel`
keys, on a tiny Llama (causal LM): the loop steps through engine.train_batch (pipeline) or the
split engine, each step's loss follows the one-process run of the same config without the
split (same samples per step), rank 0 measures and exports the whole trained model (the export
reloads equal to it), and the report records the mesh."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import hf_fixtures as hf
from tests.helpers.dist_utils import free_port
from qcompress.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["--task", "causal-lm", "--max-length", "16", "--max-steps", "3", "--eval-batch-size", "32", "--no-progress"]
W8A8 = {
    "weight_quantization": {
        "shared_parameters": {
            "enabled": True,
            "quantization_type": "symmetric",
            "schedule_offset": 0,
            "quantize_weight_in_forward": True,
        },
        "different_groups": {
            "w8": {
                "params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0, "granularity": "channel"},
                "modules": ["proj"],
            }
        },
    },
    "activation_quantization": {
        "shared_parameters": {
            "enabled": True,
            "quantization_type": "symmetric",
            "range_calibration": "dynamic",
            "schedule_offset": 0,
            "int8_forward": False,
        },
        "different_groups": {"a8": {"params": {"bits": 8}, "modules": ["proj"]}},
    },
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 2-block Llama (4 heads, 2 key/value heads) with the word-level tokenizer, and a corpus."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path_factory.mktemp("llama")
    folder = str(base / "model")
    tok = hf.write_tokenizer(folder)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    corpus = base / "corpus.txt"
    corpus.write_text("\n".join(t for t, _ in hf.topic_texts(12)))
    return folder, str(corpus)


def _config(path, **split):
    doc = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "compression_training": W8A8, **split}
    with open(path, "w") as fh:
        yaml.safe_dump(doc, fh)
    return str(path)


def _losses(out):
    with open(os.path.join(out, "metrics.csv")) as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh)]


@pytest.mark.parametrize(
    "split,mesh",
    [
        ({"pipeline": {"stages": 2}}, {"pp": 2, "dp": 1, "tp": 1}),
        ({"tensor_parallel": {"autotp_size": 2}}, {"pp": 1, "dp": 1, "tp": 2}),
    ],
    ids=["pp2", "tp2"],
)
def test_train_under_torchrun_with_split_keys_follows_one_process(llama, tmp_path, split, mesh):
    model, corpus = llama
    one = str(tmp_path / "one")
    assert (
        cli_main(["train", _config(tmp_path / "one.yaml"), "--model", model, "--data", corpus, "--out", one, *FAST])
        == 0
    )
    out = str(tmp_path / "split")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "qcompress",
        "train",
        _config(tmp_path / "split.yaml", **split),
        "--model",
        model,
        "--data",
        corpus,
        "--out",
        out,
        *FAST,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "report.json")) as fh:
        rep = json.load(fh)
    with open(os.path.join(one, "report.json")) as fh:
        ref = json.load(fh)
    assert rep["training"]["mesh"] == mesh and rep["training"]["world_size"] == 2
    assert ref["training"]["mesh"] == {"pp": 1, "dp": 1, "tp": 1}
    assert rep["training"]["train_batch_size"] == ref["training"]["train_batch_size"] == 4
    with open(os.path.join(out, "report.md")) as fh:
        assert f"(pipeline {mesh['pp']} x data 1 x tensor {mesh['tp']})" in fh.read()
    # the same samples each step: the losses of the split run are the one-process run's
    assert _losses(out) == pytest.approx(_losses(one), rel=1e-5)
    st, st_ref = rep["stages"], ref["stages"]
    assert st["qat"]["perplexity"] == pytest.approx(st_ref["qat"]["perplexity"], rel=1e-3)
    # rank 0 measured the whole model rebuilt from the final checkpoint, and exported it
    assert st["exported"]["perplexity"] == st["qat"]["perplexity"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert rep["final_bits"]["weight:w8"] == ref["final_bits"]["weight:w8"]
    assert proc.stdout.count("| qat |") == 1
