"""LoRA exports (qcompress/export/lora.py): merged weights bit for bit in both modes, peft's own loader
reading the qlora adapter onto the base export (load_quantized and transformers), peft-wrapped models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import qcompress as qc
from qcompress.quant.api import fake_quantize

from tests.helpers.lora_fixtures import adapted, batch, lora_cfg, peft_section, tiny_llama, train

peft = pytest.importorskip("peft", reason="peft is not installed (the Makefile's test install adds it)")


def _trained(mode, **kw):
    model = tiny_llama()
    qc.init_compression(model, lora_cfg(mode, **kw))
    train(model)
    return model


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def _ref_fq(w, group_size=16):
    return fake_quantize(w, 4, symmetric=True, granularity="group", group_size=group_size, backend="reference")


def test_qat_export_is_the_trained_effective_weights(tmp_path):
    # v_proj is adapted but not quantized (only q_proj and down_proj are): written dense, merged
    model = _trained("qat", wq_modules=["q_proj", "down_proj"])
    x = batch(9)
    want = _logits(model, x)
    qc.export_quantized(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert not [k for k in load_file(tmp_path / "model.safetensors") if "lora" in k]
    back = qc.load_quantized(tmp_path, tiny_llama(seed=3))
    for name, layer in adapted(model):
        got = back.get_submodule(name).weight
        assert torch.equal(got, layer.effective_weight().detach()), name
        a, b = layer.lora_A.detach(), layer.lora_B.detach()
        merged = layer.weight.detach() + (b @ a) * 2.0  # peft's merge, alpha / r = 2
        assert torch.equal(got, _ref_fq(merged) if layer.qc_wq is not None else merged), name
    assert torch.equal(_logits(back, x), want)


def test_qlora_adapter_loads_with_peft_onto_the_base_export(tmp_path):
    from peft import PeftModel

    model = _trained("qlora")
    x = batch(9)
    want = _logits(model, x)
    qc.export_quantized(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "config.json",
        "model.safetensors",
    ]
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    assert sorted(conf["target_modules"]) == sorted(n for n, _ in adapted(model))
    base = qc.load_quantized(tmp_path, tiny_llama(seed=3))
    for name, layer in adapted(model):  # the base is the stored codes, frozen since step 0
        assert torch.equal(base.get_submodule(name).weight, layer.weight)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path))
    assert torch.equal(_logits(with_adapter, x), want)


def test_qlora_export_loads_with_its_adapter_in_transformers(tmp_path):
    """transformers' from_pretrained finds adapter_config.json beside the compressed-tensors base and
    loads the adapter with peft: the trained logits, in one call."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = _trained("qlora")
    x = batch(9)
    want = _logits(model, x)
    qc.export_quantized(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    layer = loaded.model.layers[0].self_attn.q_proj
    assert type(layer).__module__.startswith("peft.") and list(layer.lora_A.keys()) == ["default"]
    assert torch.equal(_logits(loaded, x), want)


def test_qlora_merged_export_requantizes_the_merged_weight(tmp_path):
    model = _trained("qlora", lora_extra={"merge": True})
    qc.export_quantized(model, tmp_path)
    base = qc.load_quantized(tmp_path, tiny_llama(seed=3))
    merged = qc.load_quantized(tmp_path / "merged", tiny_llama(seed=4))
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    for name, _ in adapted(model):
        a = adapter[f"base_model.model.{name}.lora_A.weight"]
        b = adapter[f"base_model.model.{name}.lora_B.weight"]
        want = _ref_fq(base.get_submodule(name).weight + (b @ a) * 2.0)
        assert torch.equal(merged.get_submodule(name).weight, want), name
    # the model itself still holds its stored base and adapters
    assert all("qlora_codes" in m._buffers for n, m in adapted(model))


def test_qlora_unquantized_target_keeps_a_float_base(tmp_path):
    from peft import PeftModel

    model = _trained("qlora", wq_modules=["q_proj"])
    x = batch(9)
    want = _logits(model, x)
    qc.export_quantized(model, tmp_path)
    got = _logits(PeftModel.from_pretrained(qc.load_quantized(tmp_path, tiny_llama(seed=3)), str(tmp_path)), x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["qat", "qlora"])
def test_peft_wrapped_model_is_adopted_not_wrapped_again(tmp_path, mode):
    from peft import LoraConfig, PeftModel, get_peft_model

    pm = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    names_before = [n for n, _ in pm.named_modules()]
    qc.init_compression(pm, peft_section(mode))
    assert [n for n, _ in pm.named_modules()] == names_before  # nothing wrapped twice
    trainable = sorted(n for n, p in pm.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # peft's adapter modules are adapters: no weight quantizer on them, only on the base layers
    quantized = [n for n, m in pm.named_modules() if getattr(m, "qc_wq", None) is not None]
    assert quantized and not [n for n in quantized if "lora_" in n]
    train(pm)
    x = batch(9)
    want = _logits(pm, x)
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    if mode == "qat":  # the adapter is in the quantized weight, once
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        assert torch.equal(
            layer.base_layer.effective_weight().detach(), _ref_fq(layer.base_layer.weight.detach() + (b @ a) * 2.0)
        )
    qc.export_quantized(pm, tmp_path)
    back = qc.load_quantized(tmp_path, tiny_llama(seed=3))  # the plain model's names
    if mode == "qlora":
        back = PeftModel.from_pretrained(back, str(tmp_path))
    assert torch.equal(_logits(back, x), want)


@pytest.mark.parametrize("mode", ["qat", "qlora"])
def test_redundancy_clean_keeps_the_model_and_its_export(tmp_path, mode):
    from qcompress.export.lora import with_adapter

    model = _trained(mode)
    x = batch(5)
    want = _logits(model, x)
    qc.redundancy_clean(model)  # qat: the merged quantized weight baked in, the adapter idle
    assert torch.equal(_logits(model, x), want)
    qc.export_quantized(model, tmp_path)
    back = with_adapter(qc.load_quantized(tmp_path, tiny_llama(seed=3)), tmp_path)
    assert torch.equal(_logits(back, x), want)
