"""R1 / R2 / R4 keep the function: FP32 logits of each family unchanged (1e-4 relative), and the
rotated weights equal what compressed-tensors' own transforms make of the same model (an
independent implementation of the same products) after folding the norms by hand."""

import copy

import pytest
import torch

import qcompress as qc
from tests.helpers.rotation_fixtures import (
    DENSE,
    MOE,
    logits,
    make_dense,
    make_moe_model,
    rel_diff,
    rotation_doc,
    tokens,
)

ct = pytest.importorskip("compressed_tensors.transform", reason="compressed-tensors is not installed")


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_dense_families_keep_their_logits(family, kind):
    model = make_dense(family)
    ids = tokens(64)
    ref = logits(model, ids)
    qc.apply_rotations(model, rotation_doc(type=kind, seed=7))
    assert rel_diff(logits(model, ids), ref) < 1e-4
    rec = model.__dict__["_qc_rotation"]
    assert rec["blocks"] == {"R1": 16, "R2": 8, "R4": 32}  # 48 = 3 x 16, head 8, MLP 96 = 3 x 32
    for name, p in model.named_parameters():
        if "norm" in name and "q_norm" not in name and "k_norm" not in name:
            assert torch.equal(p, torch.ones_like(p)), name  # folded into the next layers
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert rec["untied"] == {"head": "lm_head", "embedding": "model.embed_tokens"}
    assert model.config.tie_word_embeddings is False
    assert "lm_head untied from model.embed_tokens" in qc.summary(model)


@pytest.mark.parametrize("family", MOE)
def test_moe_families_keep_their_logits_with_each_expert_and_router_rotated(family):
    model = make_moe_model(family)
    before = copy.deepcopy(model)
    ids = tokens(model.config.vocab_size)
    ref = logits(model, ids)
    qc.apply_rotations(model, rotation_doc(["R1", "R2"]))
    assert rel_diff(logits(model, ids), ref) < 1e-4
    experts = model.model.layers[0].mlp.experts
    old = before.model.layers[0].mlp.experts
    for pname in ("gate_up_proj", "down_proj"):  # every expert's matrix moved
        moved = (getattr(experts, pname) - getattr(old, pname)).flatten(1).abs().amax(1)
        assert bool((moved > 1e-3).all()), pname
    router = "router" if family == "gpt_oss" else "gate"
    assert not torch.allclose(
        getattr(model.model.layers[0].mlp, router).weight, getattr(before.model.layers[0].mlp, router).weight
    )


def test_a_tied_head_stays_tied_when_the_final_norm_weight_is_one():
    model = make_dense("llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    ids = tokens(64)
    ref = logits(model, ids)
    qc.apply_rotations(model, rotation_doc(["R1"]))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert rel_diff(logits(model, ids), ref) < 1e-4
    assert model.__dict__["_qc_rotation"]["untied"] is None and "stay tied" in qc.summary(model)


def test_forced_block_size_and_r2_alone():
    model = make_dense("qwen3", hidden=64, heads=4, kv=2, head_dim=16, inter=128)
    ids = tokens(64)
    ref = logits(model, ids)
    qc.apply_rotations(model, rotation_doc(block_size=8))
    assert model.__dict__["_qc_rotation"]["blocks"] == {"R1": 8, "R2": 8, "R4": 8}
    assert rel_diff(logits(model, ids), ref) < 1e-4
    model = make_dense("llama")
    ref = logits(model, ids)
    norms = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    qc.apply_rotations(model, rotation_doc(["R2"]))
    assert rel_diff(logits(model, ids), ref) < 1e-4
    assert all(torch.equal(p, norms[n]) for n, p in model.named_parameters() if "norm" in n)  # R2 folds none
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _fold_by_hand(model):
    """The norm folding written out: each norm's weight multiplies the input columns of the layers
    reading it, then becomes 1."""
    with torch.no_grad():
        for layer in model.model.layers:
            g = layer.input_layernorm.weight.clone()
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.weight.mul_(g)
            g2 = layer.post_attention_layernorm.weight.clone()
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight.mul_(g2)
            layer.input_layernorm.weight.fill_(1)
            layer.post_attention_layernorm.weight.fill_(1)
        model.lm_head.weight.mul_(model.model.norm.weight)
        model.model.norm.weight.fill_(1)


def test_weights_equal_compressed_tensors_transforms_of_the_folded_model():
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config

    model = make_dense("llama", tie=False)
    oracle = copy.deepcopy(model)
    qc.apply_rotations(model, rotation_doc())
    _fold_by_hand(oracle)
    readers = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*gate_proj$", "re:.*up_proj$", "lm_head"]
    config = TransformConfig(
        config_groups={
            "R1": TransformScheme(
                type="hadamard",
                head_dim=16,
                apply=[
                    TransformArgs(
                        targets=["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"], location="weight_output"
                    ),
                    TransformArgs(targets=readers, location="weight_input", inverse=True),
                ],
            ),
            "R2": TransformScheme(
                type="hadamard",
                head_dim=8,
                apply=[
                    TransformArgs(targets=["re:.*v_proj$"], location="weight_output"),
                    TransformArgs(targets=["re:.*o_proj$"], location="weight_input", inverse=True),
                ],
            ),
            "R4": TransformScheme(
                type="hadamard",
                head_dim=32,
                apply=[
                    TransformArgs(targets=["re:.*down_proj$"], location="input"),
                    TransformArgs(targets=["re:.*down_proj$"], location="weight_input", inverse=True),
                ],
            ),
        }
    )
    apply_transform_config(oracle, config)
    ours = dict(model.named_parameters())
    for name, p in oracle.named_parameters():
        if "R4_input" in name or "R1_" in name or "R2_" in name:
            continue
        assert torch.allclose(ours[name], p, atol=2e-6, rtol=0), name
    ids = tokens(64)
    assert torch.allclose(logits(model, ids), logits(oracle, ids), atol=1e-5, rtol=0)
    rot = model.model.layers[0].mlp.down_proj.R4_input
    assert torch.equal(rot.weight, oracle.model.layers[0].mlp.down_proj.R4_input.weight)


def test_r4_alone_matches_compressed_tensors_online_transform_bit_for_bit_in_the_forward():
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config

    model = make_dense("mistral")
    oracle = copy.deepcopy(model)
    qc.apply_rotations(model, rotation_doc(["R4"]))
    apply_transform_config(
        oracle,
        TransformConfig(
            config_groups={
                "R4": TransformScheme(
                    type="hadamard",
                    head_dim=32,
                    apply=[
                        TransformArgs(targets=["re:.*down_proj$"], location="input"),
                        TransformArgs(targets=["re:.*down_proj$"], location="weight_input", inverse=True),
                    ],
                )
            }
        ),
    )
    x = torch.randn(2, 5, 96)
    a = model.model.layers[1].mlp.down_proj.R4_input(x)
    b = oracle.model.layers[1].mlp.down_proj.R4_input(x)
    assert torch.equal(a, b)
    ids = tokens(64)
    assert torch.allclose(logits(model, ids), logits(oracle, ids), atol=1e-5, rtol=0)


def test_a_model_rotated_before_init_compression_is_not_rotated_twice():
    model = make_dense("llama")
    ids = tokens(64)
    ref = logits(model, ids)
    qc.apply_rotations(model, rotation_doc())
    weights = {n: p.clone() for n, p in model.named_parameters()}
    doc = rotation_doc()
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["layers"]}},
    }
    qc.init_compression(model, doc)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert rel_diff(logits(model, ids), ref) < 1e-2  # 8-bit weights: close, not equal
    assert len([h for h in model.model.layers[0].mlp.down_proj._forward_pre_hooks.values()]) == 1
