"""Export of mixture-of-experts models: tensor names as save_pretrained writes them, compressed-
tensors decoding each expert to the compressed model's effective weight, exact reload, and
transformers loading the declared experts exactly or refusing loudly."""

import json
import warnings

import pytest
import torch
from safetensors import safe_open

import qcompress
from tests.helpers.moe_fixtures import FAMILIES, make_moe, tokens

ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_comp = pytest.importorskip("compressed_tensors.compressors")
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def cfg_w(bits=4, sym=True, gran="group", group_size=16, modules=(r"mlp\.experts",)):
    params = {"start_bits": bits, "target_bits": bits, "granularity": gran}
    if gran == "group":
        params["group_size"] = group_size
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                    "quantize_weight_in_forward": True,
                },
                "different_groups": {"wq": {"params": params, "modules": list(modules)}},
            }
        }
    }


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _saved_expert_names(folder):
    """The expert matrices' tensor names save_pretrained writes (per expert, or fused for gpt-oss)."""
    return sorted(
        k[: -len(".weight")] if k.endswith(".weight") else k
        for k in _tensors(folder)
        if ".experts." in k and not k.endswith("_bias") and "shared_experts" not in k
    )


def _parts(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "ExpertMatrix"}


def _streamed_names(fused_names, n_experts=4):
    """gpt-oss: the per-expert names vLLM's gpt-oss loader streams (`experts.{e}.w13` for gate_up_proj)."""
    param = {"gate_up_proj": "w13", "down_proj": "w2"}
    return sorted(
        f"{n.rsplit('.', 1)[0]}.{e}.{param[n.rsplit('.', 1)[1]]}" for n in fused_names for e in range(n_experts)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_names_equal_save_pretrained_and_compressed_tensors_decodes(tmp_path, family):
    model = make_moe(family)
    model.save_pretrained(tmp_path / "fp")
    want = _saved_expert_names(tmp_path / "fp")
    qcompress.init_compression(model, cfg_w(4, sym=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(model, tmp_path / "q")
    sd = _tensors(tmp_path / "q")
    fused = family == "gpt_oss"
    mark = "_weight_packed" if fused else ".weight_packed"
    if fused:  # per expert, under vLLM's parameter names (save_pretrained keeps them fused)
        want = _streamed_names(want)
        assert not any(k.endswith("weight_shape") for k in sd if ".experts." in k)
    assert sorted(k[: -len(mark)] for k in sd if ".experts." in k and k.endswith(mark)) == want
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in sd)  # no float copies left
    # compressed-tensors' own decompressor gives each expert's [out, in] rows of the effective weight
    args = ct_quant.QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], weights=args)
    comp = ct_comp.BaseCompressor.get_value_from_registry("pack-quantized")
    records = json.loads((tmp_path / "q" / "config.json").read_text())["qcompress"]["experts"]
    assert set(records) == set(_parts(model))
    decoded = 0
    for pname, part in _parts(model).items():
        eff = part.effective_weight().detach()
        rec = records[pname]
        e_n, out, _ = part.matrix_shape()
        st = rec.get("streamed")
        pieces = [(f"{st['prefix']}.{e}.{st['param']}", e, 0, out) for e in range(e_n)] if fused else rec["pieces"]
        assert sum(r for *_, r in pieces) == e_n * out  # every row of every expert, once
        for saved, e, o0, r in pieces:
            if fused:  # WNA16: [out, in] entries as vLLM's WNA16 MoE method copies them
                assert st["transposed"] is False
                local = {s: sd[f"{saved}_{s}"] for s in SUFFIXES if s != "weight_shape"}
                local["weight_shape"] = torch.tensor([r, eff.shape[1]])
                ref = eff[e].t()[o0 : o0 + r]
            else:
                local = {s: sd[saved[: -len("weight")] + s] for s in SUFFIXES}
                ref = eff[e][o0 : o0 + r]
            assert torch.equal(comp.decompress(local, scheme)["weight"], ref), (saved, e)
            decoded += 1
    assert decoded >= 2 * len(records)


@pytest.mark.parametrize(
    "family,bits,sym,gran",
    [
        ("qwen3_moe", 4, True, "group"),
        ("mixtral", 8, False, "channel"),
        ("gpt_oss", 4, False, "group"),
        ("deepseek_v3", 8, True, "tensor"),
        ("gpt_oss", 8, True, "tensor"),
    ],
)
def test_reload_exact_and_transformers_loads_exactly_or_refuses(tmp_path, family, bits, sym, gran):
    """Experts are declared in config_groups under their per-expert names: transformers either loads
    them into the effective weights bit for bit or fails loudly (int-quantized experts: its weight
    conversion stops; gpt-oss' experts under vLLM's names: the refusal group naming qcompress.load_quantized)."""
    from transformers import AutoModelForCausalLM
    from qcompress.export.hf_compat import dequantize_config

    model = make_moe(family)
    qcompress.init_compression(model, cfg_w(bits, sym=sym, gran=gran, modules=(r"mlp\.experts", "self_attn")))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    if family == "gpt_oss":
        with pytest.warns(UserWarning, match="load_quantized"):
            qcompress.export_quantized(model, tmp_path / "q")
    else:
        qcompress.export_quantized(model, tmp_path / "q")
    fresh = make_moe(family, seed=5)
    qcompress.load_quantized(tmp_path / "q", fresh)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, want)
    if family == "gpt_oss":
        with pytest.raises(Exception, match="qcompress.load_quantized"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "q")
        return
    try:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=dequantize_config()).eval()
    except Exception as err:  # noqa: BLE001 -- a loud refusal is allowed, wrong weights are not
        print(f"transformers refuses {family} {bits}-bit experts: {type(err).__name__}")
        return
    with torch.no_grad():
        assert torch.equal(hf(x).logits, want)


@pytest.mark.parametrize(
    "family,bits,gran", [("qwen3_moe", 4, "group"), ("gpt_oss", 4, "group"), ("mixtral", 8, "channel")]
)
def test_fast_mode_runs_experts_on_low_bit_kernels_and_matches_exact(tmp_path, family, bits, gran):
    from qcompress.quant import lowbit

    if not lowbit.available():
        pytest.skip("the low-bit kernels are not built (make build)")
    model = make_moe(family)
    cfg = cfg_w(bits, sym=False, gran=gran)
    cfg["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
        "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.experts"]}},
    }
    qcompress.init_compression(model, cfg)
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    qcompress.export_quantized(model, tmp_path / "q")
    exact = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=3))
    fast = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=4), mode="fast")
    parts = [m for m in fast.modules() if type(m).__name__ == "ExpertMatrix"]
    assert parts and all(p.qc_fast is not None for p in parts)
    calls = []

    class Spy:  # each expert is called on its routed tokens only
        def __init__(self, fast):
            self.fast = fast

        def runs_on(self, x):
            return self.fast.runs_on(x)

        def __call__(self, xx, e):
            calls.append((e, xx.shape[0]))
            return self.fast(xx, e)

    for p in parts:
        p.qc_fast = Spy(p.qc_fast)
    with torch.no_grad():
        got_exact, got_fast = exact(x).logits, fast(x).logits
    assert torch.equal(got_exact, want)  # inputs quantized per token after reload too
    torch.testing.assert_close(got_fast, want, rtol=1e-4, atol=1e-4)  # summation order only
    assert calls and max(n for _, n in calls) < x.numel()  # top-2 of 4 experts: never all tokens twice


def test_export_inspect_lists_each_expert(tmp_path):
    from qcompress.export.inspect import inspect_checkpoint

    model = make_moe("mixtral")
    qcompress.init_compression(model, cfg_w(4))
    qcompress.export_quantized(model, tmp_path / "q")
    table = inspect_checkpoint(tmp_path / "q").splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:-1]}
    # every expert's codes, with format, bits and the size of its fp32 matrix
    for layer in range(2):
        for e in range(4):
            for w, shape in (("w1", (48, 32)), ("w2", (32, 48)), ("w3", (48, 32))):
                row = rows[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight_packed"]
                assert row[1:3] == ["pack-quantized", "4"] and int(row[6]) == shape[0] * shape[1] * 4
    assert table[-1].endswith("4 fused expert Parameters")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_redundancy_clean_bakes_the_experts_and_the_export_reloads_exactly(tmp_path, family):
    model = make_moe(family)
    qcompress.init_compression(model, cfg_w(4, sym=False))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    qcompress.redundancy_clean(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
    if family == "gpt_oss":  # vLLM's per-expert names: transformers refuses, naming load_quantized
        with pytest.warns(UserWarning, match="load_quantized"):
            qcompress.export_quantized(model, tmp_path / "q")
    else:
        qcompress.export_quantized(model, tmp_path / "q")
    fresh = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=2))
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, want)


def test_gpt_oss_exports_of_earlier_versions_still_reload(tmp_path, monkeypatch):
    """Earlier versions stacked gpt-oss' expert entries under the fused name
    (`experts.gate_up_proj_packed` [E, ...]); load_quantized reads those exactly still."""
    import qcompress.export.experts as experts_mod

    model = make_moe("gpt_oss")
    qcompress.init_compression(model, cfg_w(4, sym=False))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    monkeypatch.setattr(experts_mod, "streamed_layout", lambda root, fused: None)  # the earlier writer
    with pytest.warns(UserWarning, match="load_quantized"):
        qcompress.export_quantized(model, tmp_path / "old")
    monkeypatch.undo()
    sd = _tensors(tmp_path / "old")
    assert "model.layers.0.mlp.experts.gate_up_proj_packed" in sd and not any(".experts.0." in k for k in sd)
    back = qcompress.load_quantized(tmp_path / "old", make_moe("gpt_oss", seed=4))
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)


def test_gpt_oss_int8_experts_are_written_transposed_for_vllm(tmp_path):
    """int8 (and FP8 / MX) experts: vLLM's gpt-oss loader transposes each streamed tensor (it takes
    them for gpt-oss' [in, out] float layout), so they are written [in, out]: codes [H, 2I] and
    per-channel scales [1, 2I] for gate_up_proj; load_quantized reads them back exactly."""
    model = make_moe("gpt_oss")
    qcompress.init_compression(model, cfg_w(8, sym=True, gran="channel"))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    with pytest.warns(UserWarning, match="vLLM"):
        qcompress.export_quantized(model, tmp_path / "q")
    sd = _tensors(tmp_path / "q")
    hidden, inter = 32, 48
    assert sd["model.layers.0.mlp.experts.3.w13_weight"].shape == (hidden, 2 * inter)
    assert sd["model.layers.0.mlp.experts.3.w13_weight_scale"].shape == (1, 2 * inter)
    assert sd["model.layers.0.mlp.experts.3.w2_weight"].shape == (inter, hidden)
    part = _parts(model)["model.layers.0.mlp.experts.gate_up_proj"]
    eff = part.effective_weight().detach()[3]  # [in, out]
    w = sd["model.layers.0.mlp.experts.3.w13_weight"].float() * sd["model.layers.0.mlp.experts.3.w13_weight_scale"]
    assert torch.equal(w, eff)
    back = qcompress.load_quantized(tmp_path / "q", make_moe("gpt_oss", seed=4))
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_precision_tensors_keep_the_names_save_pretrained_writes(tmp_path, family):
    # Mixtral's router is `mlp.gate` in transformers 5's memory and `block_sparse_moe.gate` in its
    # checkpoints, which vLLM loads; the export writes what save_pretrained writes, and
    # load_quantized maps it back
    model = make_moe(family)
    model.save_pretrained(tmp_path / "fp")
    plain = {k for k in _tensors(tmp_path / "fp") if ".experts." not in k and "shared_experts" not in k}
    qcompress.init_compression(model, cfg_w(4))
    x = tokens(model)
    with torch.no_grad():
        want = model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.export_quantized(model, tmp_path / "q")
    written = {k for k in _tensors(tmp_path / "q") if ".experts." not in k and "shared_experts" not in k}
    assert written == plain
    renamed = json.loads((tmp_path / "q" / "config.json").read_text())["qcompress"].get("saved_names", {})
    assert (family == "mixtral") == bool(renamed), renamed
    got = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=3))
    with torch.no_grad():
        assert torch.equal(got(x).logits, want)
