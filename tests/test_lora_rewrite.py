"""The lora section against a model (qcompress/lora_rewrite.py): bad input is a ConfigError naming the
key and what to do, raised by init_compression before anything in the model changes."""

from __future__ import annotations

import pytest
import torch

import qcompress as qc
from qcompress.nn.layers import CompressMixin

from tests.helpers.lora_fixtures import lora_cfg, peft_section, tiny_llama


def _snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        [type(m) for m in model.modules()],
    )


def _refused(model, cfg, path, *words):
    before = _snapshot(model)
    with pytest.raises(qc.ConfigError) as err:
        qc.init_compression(model, cfg)
    assert err.value.path == path, str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)
    after = _snapshot(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1] == after[1] and before[2] == after[2]
    assert not any(isinstance(m, CompressMixin) for m in model.modules())
    return err.value


def test_rank_below_one():
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(lora_cfg(lora_extra={"r": 0}))
    assert err.value.path == "compression_training.lora.r" and "rank >= 1" in str(err.value)


def test_pattern_matching_nothing():
    cfg = lora_cfg(targets=["q_proj", "q_porj"])
    _refused(tiny_llama(), cfg, "compression_training.lora.target_modules[1]", "'q_porj'", "matches no Linear")


def test_pattern_selecting_only_other_kinds_says_so():
    cfg = lora_cfg(targets=["embed_tokens"])
    _refused(tiny_llama(), cfg, "compression_training.lora.target_modules[0]", "Embedding", "Linear layers only")


def test_qlora_with_a_float_format():
    cfg = lora_cfg("qlora", bits=8, params_extra={"format": "fp8_e4m3"})
    del cfg["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["group_size"]
    cfg["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["granularity"] = "channel"
    _refused(
        tiny_llama(),
        cfg,
        "compression_training.weight_quantization.different_groups.w.params.format",
        "fp8_e4m3",
        "no stored-quantized path",
        "mode qat",
    )


def test_qlora_with_a_bit_schedule():
    cfg = lora_cfg("qlora", params_extra={"start_bits": 8, "quantization_period": 5})
    _refused(
        tiny_llama(),
        cfg,
        "compression_training.weight_quantization.different_groups.w.params.start_bits",
        "set start_bits to target_bits",
    )


def test_qlora_with_range_learning():
    cfg = lora_cfg("qlora", params_extra={"range_learning": True})
    _refused(
        tiny_llama(),
        cfg,
        "compression_training.weight_quantization.different_groups.w.params.range_learning",
        "range_learning off",
    )


def test_qat_needs_quantization_in_forward():
    cfg = lora_cfg("qat", shared_extra={"quantize_weight_in_forward": False})
    _refused(
        tiny_llama(),
        cfg,
        "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward",
        "set it to true",
    )


def test_qat_refuses_dropout_and_merge():
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(lora_cfg("qat", lora_extra={"dropout": 0.1}))
    assert err.value.path == "compression_training.lora.dropout" and "mode qlora" in str(err.value)
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config(lora_cfg("qat", lora_extra={"merge": True}))
    assert err.value.path == "compression_training.lora.merge"


def test_tied_weight_is_refused():
    cfg = lora_cfg(targets=["lm_head"], wq_modules=["proj"])
    _refused(tiny_llama(tie=True), cfg, "compression_training.lora.target_modules", "tied", "embed_tokens")


def test_all_skips_the_output_head():
    model = tiny_llama(tie=False)
    cfg = lora_cfg(targets=["all"])
    qc.init_compression(model, cfg)
    assert "qc_lora" not in model.lm_head.__dict__
    assert all("qc_lora" in m.__dict__ for n, m in model.named_modules() if n.endswith("_proj"))


def test_fused_experts_are_refused_by_name():
    from tests.helpers.moe_fixtures import make_moe

    model = make_moe("qwen3_moe")
    err = _refused(
        model,
        lora_cfg(targets=["mlp"], wq_modules=["self_attn"]),
        "compression_training.lora.target_modules[0]",
        "fused mixture-of-experts",
    )
    assert "experts" in str(err)


def test_experts_that_are_linear_modules_get_one_adapter_each():
    """A mixture of experts built from nn.Linear experts: each expert is a Linear layer, with its own adapter."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(16, 3)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            w = self.router(x).softmax(-1)
            return sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))

    torch.manual_seed(0)
    model = Experts()
    qc.init_compression(model, lora_cfg(targets=["experts"], wq_modules=["experts"]))
    assert [n for n, m in model.named_modules() if "qc_lora" in m.__dict__] == ["experts.0", "experts.1", "experts.2"]
    model(torch.randn(4, 16)).sum().backward()
    assert all(e.lora_A.grad is not None for e in model.experts)


def test_peft_model_with_section_keys():
    peft = pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")
    pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    cfg = peft_section("qat", r=16)
    _refused(pm, cfg, "compression_training.lora.r", "already wrapped by peft")


def test_peft_model_with_dora_or_dropout_in_qat():
    peft = pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")
    pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    _refused(pm, peft_section("qat"), "compression_training.lora.enabled", "use_dora")
    pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1))
    _refused(pm, peft_section("qat"), "compression_training.lora.mode", "lora_dropout", "mode qlora")


def test_peft_model_with_the_section_off():
    peft = pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")
    pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    cfg = peft_section("qat")
    cfg["compression_training"]["lora"]["enabled"] = False
    _refused(pm, cfg, "compression_training.lora.enabled", "Set enabled: true")
