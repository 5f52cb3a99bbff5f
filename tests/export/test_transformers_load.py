"""Every export loads right in transformers, or transformers refuses it with an error.

Oracle: qcompress.load_quantized of the same export (itself bit-exact with the trained model,
test_export.py). "Right" means every quantized Linear holds exactly load_quantized's float
weight, and logits are equal where the export quantizes no activations (transformers runs
activations unquantized).
- `from_pretrained(dir, quantization_config=CompressedTensorsConfig(dequantize=True))`, the call
  the README documents, must load every single-scheme export right, except asymmetric 4-bit
  groups on a layer with at most 8 outputs (here the 3-label classifier), where
  compressed-tensors 0.20 fails to unpack the one-row zero-point tensor and transformers raises;
- plain `from_pretrained(dir)` must load right or raise (transformers 5.23 / compressed-tensors
  0.20 build the module layout of asymmetric 2/4-bit weights with unpacked zero points and
  refuse the exported, packed ones);
- mixed weight schemes: plain loads right; dequantize=True (which decompresses every Linear with
  the first config group's scheme) raises, through the export's guard group;
- exports with weights compressed-tensors cannot describe (GPT-2's Conv1D, Embedding) are
  refused by both calls with an error that names qcompress.load_quantized.
"""

import json
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.export import export_quantized, load_quantized

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)
pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from qcompress.export.hf_compat import dequantize_config  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(level)


def group(bits, gran="channel", gs=None, modules=("encoder", "pooler", "classifier"), ternary=False):
    params = {"start_bits": bits, "target_bits": bits, "granularity": gran, "ternary": ternary}
    if gs:
        params["group_size"] = gs
    return {"params": params, "modules": list(modules)}


def config(groups, sym=True, act=None):
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                },
                "different_groups": groups,
            }
        }
    }
    if act:
        calib, asym = act
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": calib,
                "quantization_type": "asymmetric" if asym else "symmetric",
            },
            "different_groups": {"a": {"params": {"bits": 8}, "modules": ["encoder"]}},
        }
    return doc


ENC, HEAD = ("encoder",), ("pooler", "classifier")
# name: (config, plain from_pretrained loads it, dequantize=True loads it)
SCHEMES = {
    "w8-channel": (config({"w": group(8)}), True, True),
    "w8-channel-asym": (config({"w": group(8)}, sym=False), True, True),
    "w8-group32": (config({"w": group(8, "group", 32)}), True, True),
    "w8-tensor": (config({"w": group(8, "tensor")}), True, True),
    "w5-group32": (config({"w": group(5, "group", 32)}), True, True),
    "w3-channel-asym": (config({"w": group(3)}, sym=False), True, True),
    "w4-group32": (config({"w": group(4, "group", 32)}), True, True),
    "w4-channel": (config({"w": group(4)}), True, True),
    "w4-channel-asym": (config({"w": group(4)}, sym=False), False, True),
    "w4-group32-asym-encoder": (config({"w": group(4, "group", 32, modules=ENC)}, sym=False), False, True),
    "w4-group32-asym": (config({"w": group(4, "group", 32)}, sym=False), False, False),
    "w2-group16": (config({"w": group(2, "group", 16)}), True, True),
    "w2-ternary": (config({"w": group(2, ternary=True)}), True, True),
    "w1-binary": (config({"w": group(1)}), True, True),
    "w8a8-dynamic": (config({"w": group(8)}, act=("dynamic", False)), True, True),
    "w8a8-static-asym": (config({"w": group(8)}, sym=False, act=("static", True)), True, True),
    "w4a8-dynamic": (config({"w": group(4, "group", 32)}, act=("dynamic", False)), True, True),
}
MIXED = {
    "mixed-w8-w4": config({"a": group(8, modules=ENC), "b": group(4, "group", 32, modules=HEAD)}),
    "mixed-channel-group16": config({"a": group(4, modules=ENC), "b": group(4, "group", 16, modules=HEAD)}),
    "mixed-group16-channel": config({"a": group(4, "group", 16, modules=ENC), "b": group(4, modules=HEAD)}),
    "mixed-group32-group16": config(
        {"a": group(4, "group", 32, modules=ENC), "b": group(4, "group", 16, modules=HEAD)}
    ),
    "mixed-w4-w2": config({"a": group(4, "group", 32, modules=ENC), "b": group(2, "group", 32, modules=HEAD)}),
    "mixed-w2-w4": config({"a": group(2, "group", 32, modules=ENC), "b": group(4, "group", 32, modules=HEAD)}),
    "mixed-w8-w5": config({"a": group(8, modules=ENC), "b": group(5, modules=HEAD)}),
}


def bert():
    torch.manual_seed(0)
    conf = transformers.BertConfig(
        vocab_size=60,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=96,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval()


IDS = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))


def export(tmp_path, doc, make=bert):
    model = make()
    qcompress.init_compression(model, qcompress.load_config(doc))
    model.train()
    model(IDS)  # calibrates static activation ranges
    model.eval()
    export_quantized(model, tmp_path / "export")
    return tmp_path / "export", load_quantized(tmp_path / "export", make())


def loaded_right(hf, ours, quantizes_inputs):
    """Same logits (where inputs are not quantized), and every Linear of the transformers model
    holds load_quantized's weight (checked after a forward: without dequantize=True,
    compressed-tensors decompresses the weights in the first one)."""
    with torch.no_grad():
        a, b = hf(IDS).logits, ours(IDS).logits
    if not quantizes_inputs:
        assert torch.equal(a, b)
    hf_sd = hf.state_dict()
    for name, mod in ours.named_modules():
        if isinstance(mod, nn.Linear):
            w = hf_sd[name + ".weight"]
            assert w.dtype == mod.weight.dtype and torch.equal(w, mod.weight), name


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_loads_right(tmp_path, name):
    doc, plain_loads, dequantize_loads = SCHEMES[name]
    folder, ours = export(tmp_path, doc)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert all("format" in g for g in qc["config_groups"].values())  # compressed-tensors infers wrong ones
    acts = "activation_quantization" in doc["compression_training"]
    cls = transformers.BertForSequenceClassification
    for loads, kwargs in ((dequantize_loads, {"quantization_config": dequantize_config()}), (plain_loads, {})):
        if loads:
            loaded_right(cls.from_pretrained(folder, **kwargs).eval(), ours, acts)
        else:
            with pytest.raises(RuntimeError):
                cls.from_pretrained(folder, **kwargs)


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_schemes_load_right_or_fail(tmp_path, name):
    # plain from_pretrained applies each config group's scheme; dequantize=True would decompress
    # every Linear with the first group's (mixed-w4-w2 then loads wrong weights without the
    # export's guard group), so it must refuse
    folder, ours = export(tmp_path, MIXED[name])
    loaded_right(transformers.BertForSequenceClassification.from_pretrained(folder).eval(), ours, False)
    with pytest.raises(RuntimeError, match="conversion"):
        transformers.BertForSequenceClassification.from_pretrained(folder, quantization_config=dequantize_config())


def gpt2():
    torch.manual_seed(0)
    conf = transformers.GPT2Config(vocab_size=60, n_positions=16, n_embd=64, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(conf).eval()


@pytest.mark.parametrize("case", ["gpt2-conv1d", "gpt2-conv1d-and-lm-head", "bert-embedding"])
def test_weights_transformers_cannot_describe_are_refused(tmp_path, case):
    if case.startswith("gpt2"):
        make, cls, mods = gpt2, transformers.GPT2LMHeadModel, ["attn", "mlp"]
        if case.endswith("lm-head"):
            mods.append("lm_head")
    else:
        make, cls, mods = bert, transformers.BertForSequenceClassification, ["word_embeddings", "encoder"]
    folder, ours = export(tmp_path, config({"w": group(4, "group", 32, modules=mods)}), make)
    # the refusal names each module with what keeps it from transformers
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    why = groups["qcompress_only_export"]["transformers_cannot_load_these_weights_use_qcompress_load_quantized"]
    assert ("(transformers Conv1D)" if case.startswith("gpt2") else "word_embeddings (embedding)") in why, why
    for kwargs in ({}, {"quantization_config": dequantize_config()}):
        with pytest.raises(Exception, match="transformers_cannot_load_these_weights_use_qcompress_load_quantized"):
            cls.from_pretrained(folder, **kwargs)
    # qcompress reads it, and it is what was trained
    with torch.no_grad():
        assert torch.isfinite(ours(IDS).logits).all()


def test_bfloat16_export_records_its_dtype(tmp_path):
    # a model cast with .to(bfloat16) keeps "float32" in its transformers config; save_pretrained
    # writes the parameters' dtype instead, and from_pretrained's default dtype ("auto") reads it:
    # the export loaded as a float32 model
    def make():
        return bert().to(torch.bfloat16)

    folder, ours = export(tmp_path, config({"w": group(8, modules=ENC)}), make)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.BertForSequenceClassification.from_pretrained(folder, quantization_config=dequantize_config())
    assert hf.dtype == torch.bfloat16
    loaded_right(hf.eval(), ours, False)
