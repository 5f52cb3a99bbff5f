"""The GPT-2 pretraining pieces (benchmarks/pretrain_gpt2.py), offline: tiny texts and a tiny GPT-2."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small gain nothing from a second thread; on a busy machine it only waits."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


pretrain_spec = importlib.util.spec_from_file_location(
    "qc_pretrain_gpt2", os.path.join(ROOT, "benchmarks", "pretrain_gpt2.py")
)


@pytest.fixture(scope="module")
def pg():
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    mod = importlib.util.module_from_spec(pretrain_spec)
    pretrain_spec.loader.exec_module(mod)
    return mod


TEXT = "\n\n".join(
    [
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife.",
        "However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families.",
        '"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"',
    ]
    * 12
)


def test_tokenizer_is_lossless_and_loads_with_autotokenizer(pg, tmp_path):
    from transformers import AutoTokenizer

    tok = pg.train_tokenizer(pg.paragraphs(TEXT), vocab_size=320, model_max_length=16)
    assert 257 < len(tok) <= 320  # 256 bytes + <|endoftext|> + merges
    assert tok.eos_token == tok.bos_token == pg.EOT and tok.convert_tokens_to_ids(pg.EOT) == tok.eos_token_id
    for s in (TEXT[:300], "na\u00efve caf\u00e9 \u2014 \u65e5\u672c \U0001f642\ttabs\n\nnew lines"):
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s  # byte-level: unseen characters round-trip
    common = tok(" truth", add_special_tokens=False)["input_ids"]
    assert len(common) == 1  # a frequent word became one merge
    tok.save_pretrained(str(tmp_path))
    tok2 = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok2(TEXT, add_special_tokens=False)["input_ids"] == tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok2.eos_token_id == tok.eos_token_id


def test_token_stream_matches_qcompress_train_blocks(pg, tmp_path):
    from qcompress.train import data as train_data

    tok = pg.train_tokenizer(pg.paragraphs(TEXT), vocab_size=320, model_max_length=16)
    path = tmp_path / "heldout.txt"
    path.write_text(TEXT, encoding="utf-8")
    ours = pg.full_blocks(pg.token_stream(tok, TEXT), 16)
    theirs = train_data.tokenize_causal_lm(tok, train_data.read_examples(str(path), "causal-lm"), 16)
    assert len(theirs) == ours.shape[0]
    assert all(theirs[i]["input_ids"].tolist() == ours[i].tolist() for i in range(len(theirs)))


def test_pretrain_checks_its_budget_arguments(pg):
    with pytest.raises(ValueError, match="minutes, max_steps or both"):
        pg.pretrain(TEXT, TEXT, minutes=None, max_steps=None)
    with pytest.raises(ValueError, match="clock must be 'cpu' or 'wall'"):
        pg.pretrain(TEXT, TEXT, minutes=1, clock="gpu")


def test_lr_schedule_closed_form(pg):
    peak = 1e-3
    assert pg.lr_at(0, 0.0, peak, 10) == pytest.approx(peak / 10)
    assert pg.lr_at(9, 0.0, peak, 10) == pytest.approx(peak)
    assert pg.lr_at(50, 0.5, peak, 10) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert pg.lr_at(50, 1.0, peak, 10) == pytest.approx(0.1 * peak)
    assert pg.lr_at(50, 7.0, peak, 10) == pytest.approx(0.1 * peak)  # past the budget: the floor
    assert pg.lr_at(50, 0.25, peak, 0) == pytest.approx(peak * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))))


@pytest.fixture(scope="module")
def tiny_run(pg):
    train, held = TEXT, TEXT[:1200] + " Mr. Bennet made no answer."
    model, tok, report = pg.pretrain(
        train,
        held,
        vocab_size=300,
        layers=1,
        d_model=32,
        heads=2,
        context=16,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        minutes=None,
        max_steps=60,
        bf16=False,
        seed=0,
        log=lambda s: None,
    )
    return model, tok, report, train, held


def test_pretrain_learns_and_reports(tiny_run):
    model, tok, report, _, _ = tiny_run
    assert report["steps"] == 60 and report["train_tokens_seen"] == 60 * 8 * 16
    assert report["config"]["clock"] == "cpu" and report["train_cpu_seconds"] > 0
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert report["config"]["vocab_size"] == len(tok) == model.config.vocab_size
    # a repetitive text: 60 steps take the held-out perplexity far below the untrained one (~vocab)
    assert report["initial_heldout_ppl_probe"] > 150
    assert report["heldout_ppl"] < report["initial_heldout_ppl_probe"] / 5
    assert report["heldout_ppl"] == pytest.approx(math.exp(report["heldout_nll"]))


def test_mean_nll_equals_a_direct_log_softmax(pg, tiny_run):
    import torch

    model, tok, _, _, held = tiny_run
    blocks = pg.full_blocks(pg.token_stream(tok, held), 16)
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=blocks).logits.double(), dim=-1)
    direct = -logp[:, :-1].gather(-1, blocks[:, 1:, None]).mean().item()
    assert pg.mean_nll(model, blocks, batch_size=3) == pytest.approx(direct, rel=1e-5)


def test_saved_folder_loads_with_auto_classes(pg, tiny_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, report, train, held = tiny_run
    out = str(tmp_path / "gpt2-tiny")
    pg.save_folder(out, model, tok, train, held, report)
    names = set(os.listdir(out))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "train.txt",
        "heldout.txt",
        "pretrain_report.json",
    } <= names
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp folder left
    assert open(os.path.join(out, "heldout.txt"), encoding="utf-8").read() == held
    assert json.load(open(os.path.join(out, "pretrain_report.json")))["steps"] == 60
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    blocks = pg.full_blocks(pg.token_stream(tok2, held), 16)
    assert pg.mean_nll(loaded, blocks) == pytest.approx(report["heldout_nll"], rel=1e-6)
    diff, n = pg.check_reload(out, model, tok, held)
    assert diff == 0.0 and n >= 1
    # an existing folder is kept unless overwrite is given; overwrite swaps in the new one
    with pytest.raises(FileExistsError, match="--overwrite"):
        pg.save_folder(out, model, tok, train, held, report)
    report2 = dict(report, steps=61)
    pg.save_folder(out, model, tok, train, held, report2, overwrite=True)
    assert json.load(open(os.path.join(out, "pretrain_report.json")))["steps"] == 61
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    with torch.no_grad():
        assert torch.equal(
            AutoModelForCausalLM.from_pretrained(out).transformer.wte.weight, model.transformer.wte.weight
        )
