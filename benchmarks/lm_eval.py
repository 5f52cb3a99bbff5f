"""Held-out perplexity on Jane Austen's novels for the SmolLM2 benchmarks (llm.py, kv_quality.py):
the text split (model_zoo/lm_corpus.py; 5 % of the sections held out, seed 0), cut into
consecutive blocks tokenized without special tokens, and the perplexity over them."""

from __future__ import annotations

import math
import random


def token_blocks(text: str, tok, context: int):
    import torch

    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // context
    return torch.tensor(ids[: n * context], dtype=torch.long).view(n, context)


def austen_blocks(tok, context: int, eval_blocks: int, seed: int, cache: str):
    """(training blocks, their shuffled order, the first `eval_blocks` held-out blocks; 0: all)."""
    from model_zoo import lm_corpus

    train_text, held_text = lm_corpus.split_corpus(lm_corpus.load_corpus("austen", cache), 0.05, 0)
    train, held = token_blocks(train_text, tok, context), token_blocks(held_text, tok, context)
    if eval_blocks > len(held):
        raise SystemExit(f"--eval-blocks {eval_blocks}: the held-out text has only {len(held)} blocks of {context}")
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    return train, order, held[: eval_blocks or len(held)]


def perplexity(model, blocks, batch: int) -> float:
    """exp of the mean next-token loss over every position of every block (float64 sum), eval mode."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            x = blocks[i : i + batch]
            logits = model(input_ids=x).logits.float()
            total += (
                F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
                .double()
                .item()
            )
            count += x[:, 1:].numel()
    return math.exp(total / count)
