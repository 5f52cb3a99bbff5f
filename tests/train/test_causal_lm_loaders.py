"""What a causal-LM export loads in: a Llama-style model's nn.Linear projections load in
transformers as in qcompress.load_quantized; GPT-2's Conv1D projections only in load_quantized,
and the warning before training says so instead of pointing at the schedules/ recipes (which
quantize Conv1D too). Run through `qcompress train`, as the README's example does."""

import json
import os
import warnings

import pytest
import torch

from tests.helpers import hf_fixtures as hf
from qcompress.cli import main as cli_main

transformers = hf.transformers
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def tiny_llama_folder(folder):
    tok = hf.write_tokenizer(folder)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "corpus.txt"
    path.write_text("\n".join(t for t, _ in hf.topic_texts(12)))
    return str(path)


def _train(model, corpus, out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = cli_main(
            ["train", "w4a16_g32", "--model", model, "--data", corpus, "--task", "causal-lm", "--out", out, *FAST]
        )
    assert code == 0
    said = [str(w.message) for w in caught if "no serving loader reads" in str(w.message)]
    return json.load(open(os.path.join(out, "report.json"))), said


def test_a_llama_export_loads_in_transformers_as_in_load_quantized(tmp_path, corpus):
    rep, said = _train(tiny_llama_folder(str(tmp_path / "llama")), corpus, str(tmp_path / "run"))
    assert said == []
    st = rep["stages"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert st["transformers"]["loaded_with"] and st["transformers"]["perplexity"] is not None
    assert st["transformers"]["max_weight_diff_vs_exported"] == 0.0


def test_a_gpt2_export_loads_in_load_quantized_only_and_the_warning_says_why(tmp_path, corpus):
    rep, said = _train(hf.tiny_gpt2_folder(str(tmp_path / "gpt2")), corpus, str(tmp_path / "run"))
    assert len(said) == 1, said
    msg = said[0]
    assert "transformers Conv1D" in msg and "nn.Linear (Llama" in msg, msg
    assert "the schedules/ recipes do" not in msg  # they quantize Conv1D like any recipe
    st = rep["stages"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0
    assert st["transformers"]["perplexity"] is None and st["transformers"]["reason"]
