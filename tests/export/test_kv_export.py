"""KV-cache quantization in exports (qcompress/export/kv_cache.py): compressed-tensors'
kv_cache_scheme and the k_scale / v_scale tensors vLLM reads, read back by compressed-tensors,
by transformers' loader (which applies compressed-tensors' KV quantizer) and by load_quantized,
and the checkpoint errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import qcompress as qc
from qcompress.errors import CheckpointError
from qcompress.export import kv_cache as kv_export
from qcompress.nn import kv_cache

from tests.helpers.kv_fixtures import kv_config, make_model, qc_scales, transformers


def _trained(family, fmt, strategy, weights=False, learned=False, steps=2):
    model = make_model(family)
    raw = kv_config(fmt, strategy, range_learning=learned)
    if weights:
        raw["compression_training"]["weight_quantization"] = {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "w": {
                    "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                    "modules": ["proj"],
                }
            },
        }
    qc.init_compression(model, raw)
    sched = qc.CompressionScheduler(model, raw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for s in range(steps):
        x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model.eval()


X = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize(
    "family,fmt,strategy,weights,learned",
    [
        ("llama", "fp8_e4m3", "tensor", False, False),
        ("qwen3", "int8", "head", True, False),
        ("gpt2", "fp8_e4m3", "head", False, True),
        ("mixtral", "int8", "tensor", False, True),
    ],
)
def test_export_writes_what_compressed_tensors_reads_and_load_quantized_reproduces(
    tmp_path, family, fmt, strategy, weights, learned
):
    ct_q = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is the oracle")
    model = _trained(family, fmt, strategy, weights, learned)
    ref = model(X).logits
    scales = qc_scales(model)
    qc.export_quantized(model, tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    qconf = ct_q.QuantizationConfig.model_validate(config["quantization_config"])
    args = qconf.kv_cache_scheme
    assert (args.num_bits, args.type, args.symmetric, args.dynamic) == (
        8,
        "float" if fmt == "fp8_e4m3" else "int",
        True,
        False,
    )
    assert args.strategy == ("tensor" if strategy == "tensor" else "attn_head")
    tensors = load_file(tmp_path / "model.safetensors")
    names = [n for n, m in model.named_modules() if kv_cache.ATTR in m.__dict__]
    assert config["qcompress"]["kv_cache"]["modules"] == names
    vllm = kv_export.consumers(config["quantization_config"]["kv_cache_scheme"])["vllm"]
    assert vllm.startswith("serves" if fmt == "fp8_e4m3" else "does not serve")
    heads = kv_cache.kv_heads(dict(model.named_modules())[names[0]])
    for n in names:
        for s, want in zip(("k_scale", "v_scale"), scales[n]):
            t = tensors[f"{n}.{s}"]
            assert t.dtype == torch.float32 and t.shape == ((1,) if strategy == "tensor" else (heads, 1, 1))
            assert torch.equal(t, want)
    assert sum(k.endswith(("k_scale", "v_scale")) for k in tensors) == 2 * len(names)
    fresh = qc.load_quantized(tmp_path, make_model(family, seed=3))
    assert torch.equal(fresh(X).logits, ref)
    assert [r[0] for r in kv_export.report(tmp_path)] == names
    assert all(torch.equal(k, scales[n][0]) for n, k, _, _ in kv_export.report(fresh))


@pytest.mark.parametrize("fmt,strategy", [("fp8_e4m3", "tensor"), ("int8", "head")])
def test_transformers_loader_applies_compressed_tensors_kv_quantization(tmp_path, fmt, strategy):
    """transformers' from_pretrained hands kv_cache_scheme to compressed-tensors, which hooks each
    attention module's cache and loads k_scale / v_scale: its logits equal the trained model's."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors applies the KV scheme in transformers")
    model = _trained("llama", fmt, strategy, weights=True)
    ref = model(X).logits
    qc.export_quantized(model, tmp_path)
    from qcompress.export.hf_compat import transformers_kwargs

    assert transformers_kwargs(tmp_path) == {}  # dequantize=True would skip the KV scheme
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **transformers_kwargs(tmp_path)).eval()
    attn = loaded.model.layers[0].self_attn
    assert hasattr(attn, "kv_cache")  # compressed-tensors' QuantizedKVCache
    assert torch.equal(attn.k_scale.detach().float(), qc_scales(model)["model.layers.0.self_attn"][0])
    assert torch.equal(loaded(X).logits, ref)


def test_kv_only_export_needs_a_calibrated_range(tmp_path):
    model = make_model("llama")
    qc.init_compression(model, kv_config("fp8_e4m3", "tensor"))
    with pytest.raises(
        qc.export.ExportError, match="model.layers.0.self_attn: its KV-cache range has seen no training batch"
    ):
        qc.export_quantized(model, tmp_path)
    assert not os.path.exists(tmp_path / "config.json")


def _export(tmp_path):
    model = _trained("llama", "int8", "head")
    qc.export_quantized(model, tmp_path)
    return tmp_path


def test_missing_or_misshapen_scales_are_checkpoint_errors(tmp_path):
    folder = _export(tmp_path)
    config = json.load(open(folder / "config.json"))
    tensors = load_file(folder / "model.safetensors")
    model = make_model("llama")
    bad = dict(tensors, **{"model.layers.1.self_attn.v_scale": torch.ones(1)})
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.1.self_attn.v_scale' is "
        r"torch.float32 \[1\], but config.json implies torch.float32 \[2, 1, 1\]",
    ):
        kv_export.load_kv_cache(model, config, bad, {k: str(folder / "model.safetensors") for k in bad}, "config.json")
    bad = dict(tensors, **{"model.layers.0.self_attn.k_scale": -tensors["model.layers.0.self_attn.k_scale"]})
    with pytest.raises(CheckpointError, match="not finite and positive"):
        kv_export.load_kv_cache(model, config, bad, {}, "config.json")
    tensors.pop("model.layers.0.self_attn.k_scale")
    with pytest.raises(CheckpointError, match="needs tensor 'model.layers.0.self_attn.k_scale', which no checkpoint"):
        kv_export.load_kv_cache(model, config, tensors, {}, "config.json")
    assert not kv_cache.quantized_modules(model)
    assert model.config._attn_implementation == "sdpa"


def test_scheme_and_manifest_must_agree(tmp_path):
    folder = _export(tmp_path)
    config = json.load(open(folder / "config.json"))
    tensors = load_file(folder / "model.safetensors")
    config["quantization_config"]["kv_cache_scheme"]["type"] = "float"
    model = make_model("llama")
    with pytest.raises(CheckpointError, match="kv_cache_scheme is .* but the qcompress manifest says int8 per head"):
        kv_export.load_kv_cache(model, config, tensors, {}, "config.json")
    config = json.load(open(folder / "config.json"))
    del config["qcompress"]["kv_cache"]
    with pytest.raises(CheckpointError, match="kv_cache_scheme is set, but the qcompress manifest has no kv_cache"):
        kv_export.load_kv_cache(model, config, tensors, {}, "config.json")
    config = json.load(open(folder / "config.json"))
    config["qcompress"]["kv_cache"]["modules"] = ["model.layers.0.mlp"]
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp' is not an attention module"):
        kv_export.load_kv_cache(model, config, tensors, {}, "config.json")
    assert not kv_cache.quantized_modules(model)


@pytest.mark.parametrize("fmt,strategy", [("fp8_e4m3", "tensor"), ("int8", "head")])
def test_bfloat16_model_with_learned_scales_reloads_exactly(tmp_path, fmt, strategy):
    """K / V quantize in float32 with float32 scales whatever the model's dtype (as vLLM's cache
    write), so a bfloat16 model's learned scales export and reload to the same logits."""
    model = make_model("llama").to(torch.bfloat16)
    raw = kv_config(fmt, strategy, range_learning=True)
    qc.init_compression(model, raw)
    sched = qc.CompressionScheduler(model, raw)
    model.train()
    for _ in range(2):
        model(X, labels=X).loss.backward()
        sched.step()
    assert model.model.layers[0].self_attn.__dict__[kv_cache.ATTR].learned_ready
    model.eval()
    ref = model(X).logits
    qc.export_quantized(model, tmp_path)
    fresh = qc.load_quantized(tmp_path, make_model("llama").to(torch.bfloat16))
    assert torch.equal(fresh(X).logits, ref)
