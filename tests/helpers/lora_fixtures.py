"""Shared pieces of the LoRA tests: a tiny Llama, configs, a few training steps."""

from __future__ import annotations

import copy

import torch

import qcompress as qc

TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny_llama(seed=0, tie=True, hidden=32, inter=64, vocab=64):
    import transformers

    torch.manual_seed(seed)
    conf = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(conf)


def lora_cfg(
    mode="qat",
    targets=TARGETS,
    wq_modules=("proj",),
    group_size=16,
    bits=4,
    lora_extra=None,
    shared_extra=None,
    params_extra=None,
):
    shared = {"enabled": True, "quantize_weight_in_forward": True}
    shared.update(shared_extra or {})
    params = {"start_bits": bits, "target_bits": bits, "group_size": group_size}
    params.update(params_extra or {})
    section = {"enabled": True, "r": 4, "alpha": 8, "target_modules": list(targets), "mode": mode}
    section.update(lora_extra or {})
    cc = {
        "weight_quantization": {
            "shared_parameters": shared,
            "different_groups": {"w": {"params": params, "modules": list(wq_modules)}},
        },
        "lora": section,
    }
    return {"compression_training": cc}


def peft_section(mode="qat", **extra):
    """A config for a peft-wrapped model: only the section's mode (peft sets the rest)."""
    cfg = lora_cfg(mode)
    cfg["compression_training"]["lora"] = {"enabled": True, "mode": mode, **extra}
    return cfg


def batch(seed=0, n=2, t=8, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def train(model, steps=3, lr=1e-2, seed=0):
    """A few AdamW steps on the trainable tensors (the adapters); returns the optimizer."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for i in range(steps):
        x = batch(seed + i)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return opt


def adapted(model):
    """(name, layer) of the layers carrying a LoRA state."""
    return [(n, m) for n, m in model.named_modules() if "qc_lora" in m.__dict__]


def fresh_copy(model):
    return copy.deepcopy(model)


def compressed(mode="qat", seed=0, **kw):
    model = tiny_llama(seed)
    qc.init_compression(model, lora_cfg(mode, **kw))
    return model
