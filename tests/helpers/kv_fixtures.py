"""Tiny random-weight decoders of every transformers family qcompress's tests build, for the
KV-cache quantization tests, and the independent oracle: compressed-tensors' own KV-cache
quantizer (its QuantizedKVCache hook, which quantizes the keys and values an attention module
hands its cache) installed on an untouched copy with given k_scale / v_scale."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from tests.helpers.moe_fixtures import moe_config  # noqa: E402

FAMILIES = ("llama", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "gpt2", "bert_decoder")
_DENSE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def family_config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**_DENSE, intermediate_size=48)
    if family == "qwen3":
        return transformers.Qwen3Config(**_DENSE, intermediate_size=48, head_dim=8)
    if family == "mistral":
        return transformers.MistralConfig(**_DENSE, intermediate_size=48, head_dim=8)
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1
        )
    if family == "bert_decoder":
        return transformers.BertConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
            is_decoder=True,
        )
    return moe_config(family)


def make_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = family_config(family)
    if family == "bert_decoder":
        model = transformers.BertLMHeadModel(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # routers start at zero in some families: spread the routing
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    return model.eval()


def kv_config(fmt="fp8_e4m3", strategy="tensor", **extra):
    return {
        "compression_training": {
            "kv_cache_quantization": {"enabled": True, "format": fmt, "strategy": strategy, **extra}
        }
    }


def ct_args(fmt: str, strategy: str):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=8,
        type="float" if fmt == "fp8_e4m3" else "int",
        symmetric=True,
        dynamic=False,
        strategy="tensor" if strategy == "tensor" else "attn_head",
    )


def ct_oracle(model, scales, fmt: str, strategy: str):
    """A copy of `model` (taken before qcompress touched it) whose attention modules `scales`
    names ({name: (k_scale, v_scale)}) quantize their cache with compressed-tensors' QuantizedKVCache."""
    from compressed_tensors.modeling.kvcache import initialize_hooked_kv_cache
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus

    oracle = copy.deepcopy(model)
    named = dict(oracle.named_modules())
    for name, (k, v) in scales.items():
        mod = named[name]
        mod.quantization_scheme = QuantizationScheme(targets=[], input_activations=ct_args(fmt, strategy))
        mod.quantization_status = QuantizationStatus.FROZEN
        initialize_hooked_kv_cache(oracle, mod)
        mod.register_parameter("k_scale", torch.nn.Parameter(k.clone(), requires_grad=False))
        mod.register_parameter("v_scale", torch.nn.Parameter(v.clone(), requires_grad=False))
    return oracle.eval()


def qc_scales(model):
    """{attention module: (k_scale, v_scale)} qcompress quantizes with in eval now."""
    from qcompress.nn import kv_cache

    return {
        n: (
            kv_cache.current_scale(m, m.__dict__[kv_cache.ATTR], "k"),
            kv_cache.current_scale(m, m.__dict__[kv_cache.ATTR], "v"),
        )
        for n, m in kv_cache.quantized_modules(model)
    }
