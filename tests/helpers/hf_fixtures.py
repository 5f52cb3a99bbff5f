"""Tiny Hugging Face model folders built here (random weights, no download) for the main-job tests.

Each folder looks like a real checkpoint: config.json, model.safetensors and tokenizer files, so
`from_pretrained` and `qcompress train --model DIR` read it as they would a downloaded model.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)

WORDS = (
    "the a of and to in is was for on that with as by at from it this be are were which or an "
    "sport game team win match player goal score season league cup "
    "market bank profit shares company price growth trade economy firm "
    "film music star show award actor band album song stage "
    "vote party minister election government policy law labour tory parliament "
    "phone software computer net users technology digital mobile web data"
).split()


def write_tokenizer(folder: str, model_max_length: int = 64):
    """A word-level BERT WordPiece tokenizer over WORDS (lower-cased), saved into `folder`."""
    os.makedirs(folder, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(WORDS))
    tok = transformers.BertTokenizerFast(
        vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True, model_max_length=model_max_length
    )
    tok.save_pretrained(folder)
    return tok


def tiny_bert_folder(folder: str, num_labels: Optional[int] = None, seed: int = 0, layers: int = 2) -> str:
    """A 2-layer BERT (hidden 32) saved as a plain BertModel checkpoint, as sentence encoders ship,
    or as BertForSequenceClassification with `num_labels`."""
    import torch

    tok = write_tokenizer(folder)
    cfg = transformers.BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    if num_labels is None:
        model = transformers.BertModel(cfg)
    else:
        cfg.num_labels = num_labels
        model = transformers.BertForSequenceClassification(cfg)
    model.save_pretrained(folder)
    return folder


def tiny_gpt2_folder(folder: str, seed: int = 0, layers: int = 2) -> str:
    """A 2-layer GPT-2 (hidden 32, transformers' Conv1D projections) with the word-level tokenizer."""
    import torch

    tok = write_tokenizer(folder)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=layers,
        n_head=2,
        n_positions=128,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


TOPICS = {
    "sport": "sport game team win match player goal score season league cup",
    "business": "market bank profit shares company price growth trade economy firm",
    "politics": "vote party minister election government policy law labour tory parliament",
}


def topic_texts(n_per_class: int = 12, seed: int = 0, length: int = 12):
    """(text, label) pairs: each text mixes its topic's words with common words, so a classifier
    can learn the topic from the words."""
    import random

    rng = random.Random(seed)
    common = WORDS[:20]
    out = []
    for label, words in sorted(TOPICS.items()):
        ws = words.split()
        for _ in range(n_per_class):
            out.append(
                (" ".join(rng.choice(ws) if rng.random() < 0.6 else rng.choice(common) for _ in range(length)), label)
            )
    rng.shuffle(out)
    return out
