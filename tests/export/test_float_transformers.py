"""Activation-quantized float exports run in transformers with compressed-tensors' quantization
lifecycle (plain from_pretrained, as hf_compat.transformers_kwargs picks): the logits equal
load_quantized's bit for bit, for 3-D inputs (the encoder) and 2-D ones (the pooler), except
FP8 per-token on 2-D inputs, which compressed-tensors quantizes per tensor (vLLM and qcompress per
row): there the difference is exactly that rule. FP4 / MX exports of float32 models are refused,
as compressed-tensors decompresses them to bfloat16."""

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress.export import ExportError, export_quantized, load_quantized
from qcompress.export.hf_compat import BF16_DECOMPRESSED, dequantize_config, transformers_kwargs
from qcompress.quant import floats

pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle (pip install compressed-tensors)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# compressed-tensors preset -> (weight params, activation params, activation calibration); the
# activation groups of FP8_BLOCK hold 128 inputs as the preset's
PRESETS = {
    "FP8": (dict(format="fp8_e4m3", granularity="tensor"), dict(bits=8, format="fp8_e4m3"), "static"),
    "FP8_DYNAMIC": (dict(format="fp8_e4m3", granularity="channel"), dict(bits=8, format="fp8_e4m3"), "dynamic"),
    "FP8_BLOCK": (
        dict(format="fp8_e4m3", granularity="block"),
        dict(bits=8, format="fp8_e4m3", group_size=128),
        "dynamic",
    ),
    "NVFP4": (dict(format="nvfp4"), dict(bits=4, format="nvfp4"), "static"),
    "MXFP4": (dict(format="mxfp4"), dict(bits=4, format="mxfp4"), "dynamic"),
    "MXFP8": (dict(format="mxfp8"), dict(bits=8, format="mxfp8"), "dynamic"),
}
SCOPE = ["encoder", "pooler"]  # the classifier head stays full precision
IDS = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def bert(dtype):
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval().to(dtype)


def doc_of(name, wbits=None):
    wp, ap, calib = PRESETS[name]
    bits = wbits or ap["bits"]
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {"w": {"params": dict(wp, start_bits=bits, target_bits=bits), "modules": SCOPE}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": calib},
                "different_groups": {"a": {"params": ap, "modules": SCOPE}},
            },
        }
    }


def exported(tmp_path, name, dtype, doc=None):
    model = bert(dtype)
    cfg = qc.load_config(doc or doc_of(name))
    qc.init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg).step()
    model.train()
    model(IDS)  # calibrates the static ranges
    model.eval()
    export_quantized(model, tmp_path / "out")
    return model, tmp_path / "out"


def quantized_linears(model):
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith(("bert.encoder", "bert.pooler"))
    }


def as_one_batch(module):
    """Hooks that run `module` on its 2-D input viewed as [1, rows, cols] and give back 2-D."""
    pre = module.register_forward_pre_hook(lambda m, args: (args[0].unsqueeze(0),) + args[1:])
    post = module.register_forward_hook(lambda m, args, out: out.squeeze(0))
    return pre, post


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_transformers_logits_equal_ours(tmp_path, name, dtype):
    trained, folder = exported(tmp_path, name, dtype)
    ours = load_quantized(folder, bert(dtype))
    with torch.no_grad():
        want = ours(IDS).logits
        assert torch.equal(want, trained(IDS).logits)
    qconf = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = qconf["config_groups"].values()
    assert group["input_activations"]["type"] == "float"
    if dtype != torch.bfloat16 and group["format"] in BF16_DECOMPRESSED:
        # the refusal holds while compressed-tensors' own decompressor returns bfloat16 weights
        tensors = load_file(str(folder / "model.safetensors"))
        prefix = "bert.encoder.layer.0.intermediate.dense."
        local = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        comp = BaseCompressor.get_value_from_registry(group["format"])
        scheme = QuantizationScheme.model_validate({k: v for k, v in group.items()})
        names = comp.compression_param_names(scheme)
        assert comp.decompress({k: local[k] for k in names}, scheme)["weight"].dtype == torch.bfloat16
        with pytest.raises(ExportError, match=r"decompresses these weights to bfloat16 only.*load_quantized"):
            transformers_kwargs(folder)
        return
    kwargs = transformers_kwargs(folder)
    assert kwargs == {}  # plain from_pretrained: compressed-tensors quantizes the inputs
    hf = transformers.BertForSequenceClassification.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    per_token_2d = group["input_activations"]["strategy"] == "token"
    with torch.no_grad():
        got = hf(IDS).logits
        if per_token_2d:  # the pooler's 2-D input: per tensor there, per row here and in vLLM
            assert not torch.equal(got, want)
            hooks = as_one_batch(hf.bert.pooler.dense)
            got = hf(IDS).logits
            for h in hooks:
                h.remove()
    assert torch.equal(got, want), (name, (got - want).abs().max().item())
    # decompressing on load drops the activation quantization: other logits
    dense = transformers.BertForSequenceClassification.from_pretrained(
        folder, dtype=dtype, quantization_config=dequantize_config()
    ).eval()
    with torch.no_grad():
        assert not torch.equal(dense(IDS).logits, want)

    # each quantized Linear on its own, 3-D and 2-D inputs, against load_quantized's module
    gen = torch.Generator().manual_seed(2)
    theirs = quantized_linears(hf)
    for n, mine in quantized_linears(ours).items():
        x3 = (torch.randn(3, 5, mine.in_features, generator=gen) * 3).to(dtype)
        x2 = x3[0]
        with torch.no_grad():
            assert torch.equal(theirs[n](x3), mine(x3)), (name, n, "3-D")
            if not per_token_2d:
                assert torch.equal(theirs[n](x2), mine(x2)), (name, n, "2-D")
                continue
            assert torch.equal(theirs[n](x2.unsqueeze(0))[0], mine(x2)), (name, n)
            per_tensor = floats.fake_quantize_float(x2, floats.float_spec("fp8_e4m3", "tensor"))
            assert torch.equal(theirs[n](x2), F.linear(per_tensor, theirs[n].weight, theirs[n].bias)), (name, n)
            assert not torch.equal(theirs[n](x2), mine(x2))


def test_weight_only_exports_keep_decompressing_on_load(tmp_path):
    """No float activations: dequantize=True gives the exact weights; the dtype rule does not apply."""
    doc = doc_of("NVFP4", wbits=4)
    del doc["compression_training"]["activation_quantization"]
    _, folder = exported(tmp_path, "NVFP4", torch.float32, doc)
    kwargs = transformers_kwargs(folder)
    assert kwargs["quantization_config"].dequantize is True


def test_bfloat16_load_of_a_float32_export_is_allowed(tmp_path):
    """The refusal follows the dtype transformers will run (an explicit bfloat16 load passes)."""
    _, folder = exported(tmp_path, "MXFP4", torch.float32)
    with pytest.raises(ExportError, match="float32 model"):
        transformers_kwargs(folder)
    assert transformers_kwargs(folder, dtype=torch.bfloat16) == {}


def test_train_stage_runs_float_activations_through_plain_from_pretrained(tmp_path):
    """`qcompress train`'s transformers stage: the plain call for float activations (no fallback that
    runs them unquantized), the refusal's message for a float32 NVFP4 export."""
    from qcompress.train.stages import transformers_attempts

    _, folder = exported(tmp_path / "fp8", "FP8", torch.float32)
    with torch.no_grad():
        want = load_quantized(folder, bert(torch.float32))(IDS).logits
    got = transformers_attempts(
        str(folder), "text-classification", lambda m: {"equal": torch.equal(m(input_ids=IDS).logits, want)}
    )
    assert got == {"equal": True, "loaded_with": "from_pretrained"}
    _, folder = exported(tmp_path / "nvfp4", "NVFP4", torch.float32)
    got = transformers_attempts(str(folder), "text-classification", lambda m: pytest.fail("loaded"))
    assert set(got) == {"reason"} and "bfloat16 only" in got["reason"]
