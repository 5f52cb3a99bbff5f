"""Bad input: a ConfigError that names the module (or key) and the reason, before anything changes."""

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from tests.helpers.rotation_fixtures import make_dense, make_moe_model, rotation_doc, transformers


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def _refused(model, doc, match, call=qc.apply_rotations):
    before = _state(model)
    hooks = {n: dict(m._forward_pre_hooks) for n, m in model.named_modules()}
    with pytest.raises(qc.ConfigError, match=match):
        call(model, doc)
    assert _unchanged(model, before)
    assert {n: dict(m._forward_pre_hooks) for n, m in model.named_modules()} == hooks
    assert "_qc_rotation" not in model.__dict__


def test_layernorm_family_is_refused_with_the_reason():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    _refused(model, rotation_doc(), r"GPT2LMHeadModel.*gpt2.*LayerNorms subtract the mean")


def test_unknown_family_is_refused_naming_the_known_ones():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.PhiConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    _refused(model, rotation_doc(), r"'phi'.*layout the rotations do not know.*llama")


def test_a_norm_that_is_not_an_rmsnorm_is_refused_naming_it():
    model = make_dense("llama")
    model.model.layers[1].post_attention_layernorm = nn.LayerNorm(48, bias=False)  # found by its output
    _refused(
        model,
        rotation_doc(),
        r"model\.layers\.1\.post_attention_layernorm.*LayerNorm does not compute "
        r"weight \* x / rms\(x\).*no norm to fold",
    )
    model = make_dense("llama")
    model.model.norm = nn.LayerNorm(48)
    _refused(model, rotation_doc(), r"module 'model\.norm': LayerNorm has a bias")


def test_an_unknown_parameter_in_a_layer_is_refused_naming_it():
    model = make_dense("llama")
    model.model.layers[0].self_attn.extra = nn.Linear(48, 48)
    _refused(model, rotation_doc(), r"model\.layers\.0\.self_attn\.extra\.weight.*not in the llama layout")


def test_fused_qkv_projection_is_an_unknown_attention_layout():
    model = make_dense("llama")
    model.model.layers[0].self_attn.q_proj = nn.Identity()
    _refused(model, rotation_doc(), r"model\.layers\.0\.self_attn\.q_proj.*unknown attention")


@pytest.mark.parametrize(
    "block,module,what",
    [(32, r"model\.embed_tokens", "residual width"), (16, r"model\.layers\.0\.self_attn\.v_proj", "head dim")],
)
def test_a_block_size_that_does_not_divide_a_width_names_the_module(block, module, what):
    model = make_dense("llama")  # hidden 48, head_dim 8, MLP 96
    rots = ["R1", "R2"] if what == "residual width" else ["R2"]
    _refused(
        model,
        rotation_doc(rots, block_size=block),
        rf"block_size: {block} does not divide the {what} of module '{module}'",
    )


def test_r4_on_fused_experts_is_refused_before_anything_changes():
    model = make_moe_model("mixtral")
    _refused(
        model,
        rotation_doc(["R1", "R2", "R4"]),
        r"R4 cannot rotate module 'model\.layers\.0\.mlp\.experts'.*fused experts",
    )


def test_init_compression_refuses_before_it_rewrites_anything():
    model = make_dense("llama")
    model.model.layers[1].input_layernorm = nn.LayerNorm(48)
    doc = rotation_doc()
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4}}},
    }
    _refused(model, doc, r"input_layernorm", call=qc.init_compression)
    assert not any(type(m).__name__.startswith("Compress") for m in model.modules())


def test_a_failed_module_rewrite_puts_the_rotation_back():
    model = make_dense("llama")
    doc = rotation_doc(learned=True)
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 7},
        "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["layers"]}},
    }
    # quantize_groups 7 divides no weight here: the rewrite raises after the rotation was applied
    _refused(model, doc, r"quantize_groups", call=qc.init_compression)
    assert "qc_rotations" not in dict(model.named_children())
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings


def test_rotating_again_with_other_settings_is_refused():
    model = make_dense("llama")
    qc.apply_rotations(model, rotation_doc(["R1"]))
    with pytest.raises(qc.ConfigError, match="already rotated"):
        qc.apply_rotations(model, rotation_doc(["R1", "R2"]))


@pytest.mark.parametrize(
    "section,match",
    [
        ({"block_size": 48}, r"rotation\.block_size: 48 is not a power of two"),
        ({"rotations": ["R3"]}, r"rotation\.rotations\[0\]: 'R3' is not a rotation"),
        ({"rotations": ["R1", "r1"]}, r"listed twice"),
        ({"type": "random"}, r"rotation\.type"),
    ],
)
def test_config_errors_name_the_key(section, match):
    with pytest.raises(qc.ConfigError, match=match):
        qc.load_config({"compression_training": {"rotation": {"enabled": True, **section}}})


def test_learned_rotations_need_in_forward_weights_and_r1_refuses_hidden_state_distillation():
    wq = {
        "shared_parameters": {"enabled": True},
        "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4}}},
    }
    with pytest.raises(qc.ConfigError, match=r"rotation\.learned.*quantize_weight_in_forward: true"):
        qc.load_config(
            {"compression_training": {"rotation": {"enabled": True, "learned": True}, "weight_quantization": wq}}
        )
    with pytest.raises(qc.ConfigError, match=r"rotation\.rotations.*hidden_mse"):
        qc.load_config(
            {
                "compression_training": {
                    "rotation": {"enabled": True},
                    "distillation": {"enabled": True, "hidden_mse": 1.0},
                }
            }
        )
