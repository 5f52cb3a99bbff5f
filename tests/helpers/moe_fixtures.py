"""Tiny random-weight mixture-of-experts causal LMs of transformers' families (built from their
configs, no download), and the independent oracle: an untouched FP copy whose expert matrices are
replaced by qcompress.quant.fake_quantize of each expert's [out, in] matrix."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def moe_config(family: str):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **_COMMON, intermediate_size=64, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=8
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **_COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=8
        )
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **_COMMON,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    if family == "deepseek_v3":
        common = {**_COMMON, "num_key_value_heads": 4}  # multi-head latent attention
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=64,
            moe_intermediate_size=48,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    raise ValueError(family)


def make_moe(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = moe_config(family)
    for k, v in overrides.items():  # e.g. expert widths a format's group size divides
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # routers start at zero in some families: spread the routing
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
            if name.endswith("e_score_correction_bias"):
                p.zero_()
    return model.eval()


def experts_params(model):
    """{dotted name: (3-D Parameter, transposed?)} of every fused expert matrix."""
    out = {}
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Experts"):
            for pname in ("gate_up_proj", "down_proj"):
                out[f"{name}.{pname}"] = (mod._parameters[pname], type(mod).__name__ == "GptOssExperts")
    return out


def oracle_copy(model_fp, quantize_matrix):
    """An untouched FP copy whose every expert [out, in] matrix m is replaced by quantize_matrix(m)."""
    ref = copy.deepcopy(model_fp)
    with torch.no_grad():
        for name, (p, transposed) in experts_params(ref).items():
            for e in range(p.shape[0]):
                m = p[e].t() if transposed else p[e]
                q = quantize_matrix(m.clone())
                p[e].copy_(q.t() if transposed else q)
    return ref


def tokens(model, batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


def reference_experts_forward(mod, quantize_input):
    """A reference experts forward written from the routing rule (not the model's loop): each
    expert on its routed tokens, each matrix's input passed through quantize_input(matrix, e, x)
    (matrix "gu" or "dn"), the products as plain matmuls."""
    gu, dn = mod._parameters["gate_up_proj"], mod._parameters["down_proj"]
    transposed = type(mod).__name__ == "GptOssExperts"

    def lin(which, e, x, w, b):
        x = quantize_input(which, e, x)
        y = x @ w if transposed else x @ w.t()
        return y if b is None else y + b

    def forward(x, idx, weights):
        out = torch.zeros_like(x)
        for e in range(gu.shape[0]):
            tok, pos = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            h = mod._apply_gate(lin("gu", e, x[tok], gu[e], mod.gate_up_proj_bias[e] if transposed else None))
            o = lin("dn", e, h, dn[e], mod.down_proj_bias[e] if transposed else None)
            out.index_add_(0, tok, o * weights[tok, pos, None])
        return out

    return forward
