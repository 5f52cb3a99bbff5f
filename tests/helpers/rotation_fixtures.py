"""Tiny random-weight decoders of the families rotations know (built from transformers configs, no
download), with norm weights drawn away from 1 so that folding them is exercised, and helpers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("qwen3_moe", "mixtral", "gpt_oss")

_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def spread_norms(model, seed: int = 5):
    """Norm weights in [0.5, 1.5] (a trained model's are far from the initial ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


def make_dense(
    family: str = "llama",
    seed: int = 0,
    tie: bool = True,
    hidden: int = 48,
    heads: int = 6,
    kv: int = 2,
    head_dim: int = 8,
    inter: int = 96,
    layers: int = 2,
    dtype=torch.float32,
):
    """A 2-layer decoder: hidden 48 = 3 x 16 (no power of two: block-diagonal R1), GQA 6 / 2 heads."""
    torch.manual_seed(seed)
    cfg = getattr(transformers, _CONFIGS[family])(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=tie,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    return spread_norms(model).eval()


def make_moe_model(family: str, seed: int = 0):
    from tests.helpers.moe_fixtures import make_moe

    return spread_norms(make_moe(family, seed)).eval()


def tokens(vocab: int, batch: int = 2, seq: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def rotation_doc(rotations=("R1", "R2", "R4"), **kw):
    return {"compression_training": {"rotation": {"enabled": True, "rotations": list(rotations), **kw}}}


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def rel_diff(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())
