"""Export round trips: what is written dequantizes to effective_weight() bit for bit, and
load_quantized reproduces the trained model's eval outputs. The oracle for the bytes on disk
is compressed-tensors' own unpacking helper plus the closed-form (q - zp) * s."""

import json
import math
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import qcompress
from qcompress.export import export_quantized, inspect_checkpoint, load_quantized
from qcompress.export.errors import ExportError
from qcompress.quant import reference as R

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 256)
        self.fc = nn.Linear(256, 48)
        self.conv = nn.Conv2d(16, 8, 3)  # K = 144: ragged last group for 64 and 128
        self.head = nn.Linear(48, 5)

    def forward(self, ids, img):
        h = self.fc(self.emb(ids))
        return self.head(torch.relu(h)), self.conv(img)


def wq_cfg(
    bits,
    symmetric=True,
    granularity="channel",
    group_size=None,
    modules=("fc", "emb", "conv"),
    act=None,
    quantize_groups=1,
    numerics="default",
):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False}
    if granularity is not None:
        params["granularity"] = granularity
    if group_size:
        params["group_size"] = group_size
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "symmetric" if symmetric else "asymmetric",
                    "quantize_groups": quantize_groups,
                    "numerics": numerics,
                },
                "different_groups": {"wq1": {"params": params, "modules": list(modules)}},
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
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["fc", "head", "conv"]}},
        }
    return qcompress.load_config(doc)


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 40, (3, 7), generator=g), torch.randn(2, 16, 9, 9, generator=g)


def compressed_net(cfg, seed=0):
    torch.manual_seed(seed)
    m = Net()
    qcompress.init_compression(m, cfg)
    m.train()
    m(*inputs())  # calibrates static activation ranges
    return m.eval()


def _dense(t):
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides, even for size-1 dims


def oracle_dequant(sd, prefix, rec):
    """Dequantize one module straight from the file with compressed-tensors' unpacker."""
    w = rec["weights"]
    shape = rec["weight_shape"]
    rows, k = shape[0], math.prod(shape[1:])
    bits = w["num_bits"]
    if rec["format"] == "pack-quantized":
        q = ct_helpers.unpack_from_int32(sd[prefix + ".weight_packed"], bits, torch.Size([rows, k]))
    else:
        q = sd[prefix + ".weight"].reshape(rows, k)
    s = sd[prefix + ".weight_scale"]
    z = sd.get(prefix + ".weight_zero_point")
    if z is not None and rec["format"] == "pack-quantized" and w["strategy"] != "tensor":
        # packed along dim 0 == packed along dim 1 of the transpose (CT 0.20's own dim-0 path
        # trips over a 1-row packed tensor's strides, so use the dim-1 path)
        z = ct_helpers.unpack_from_int32(_dense(z.t()), bits, torch.Size([s.shape[1], rows])).t()
    if w["strategy"] == "group":
        s = s.repeat_interleave(w["group_size"], 1)[:, :k]
        z = None if z is None else z.repeat_interleave(w["group_size"], 1)[:, :k]
    x = q.float() - z.float() if z is not None else q.float()
    return (x * s).reshape(shape)


CASES = [
    (b, sym, gran, gs)
    for b in (8, 4, 2, 1)
    for sym in (True, False)
    if not (b == 1 and not sym)
    for gran, gs in (("channel", None), ("group", 32), ("group", 64), ("group", 128))
]


@pytest.mark.parametrize("bits,sym,gran,gs", CASES)
def test_round_trip_bit_exact(tmp_path, bits, sym, gran, gs):
    cfg = wq_cfg(bits, sym, gran, gs)
    m = compressed_net(cfg)
    ids, img = inputs()
    with torch.no_grad():
        ref = m(ids, img)
    eff = {n: getattr(m, n).effective_weight().detach().clone() for n in ("fc", "emb", "conv")}
    export_quantized(m, tmp_path / "out", cfg)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    sd = load_file(tmp_path / "out" / "model.safetensors")
    modules = config["qcompress"]["modules"]
    for name in ("fc", "emb", "conv"):
        rec = modules[name]
        assert rec["format"] == ("int-quantized" if bits == 8 else "pack-quantized")
        assert rec["weights"]["num_bits"] == (2 if bits == 1 else bits)
        assert (name + ".weight" in sd) == (bits == 8)
        assert torch.equal(oracle_dequant(sd, name, rec), eff[name]), name
        if bits != 8:
            assert sd[name + ".weight_packed"].dtype == torch.int32
            assert sd[name + ".weight_shape"].tolist() == list(eff[name].shape)
        assert (name + ".weight_zero_point" in sd) == (not sym)
    fresh = load_quantized(tmp_path / "out", Net().eval())
    for name in ("fc", "emb", "conv"):
        assert torch.equal(getattr(fresh, name).weight, eff[name])
        assert "weight" not in dict(getattr(fresh, name).named_parameters())
    with torch.no_grad():
        out = fresh(ids, img)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


@pytest.mark.parametrize("act", [("dynamic", False), ("static", False), ("static", True)])
def test_activation_quantization_round_trip(tmp_path, act):
    cfg = wq_cfg(4, True, "group", 32, act=act)
    m = compressed_net(cfg)
    ids, img = inputs()
    ids2, img2 = ids.flip(0), img * 1.7  # static ranges must come from the checkpoint
    with torch.no_grad():
        ref, ref2 = m(ids, img), m(ids2, img2)
    export_quantized(m, tmp_path / "out", cfg)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    sd = load_file(tmp_path / "out" / "model.safetensors")
    ia = [g["input_activations"] for g in qc["config_groups"].values() if g["input_activations"]]
    assert ia, qc
    if act[0] == "dynamic":
        assert ia[0]["strategy"] == "token" and ia[0]["dynamic"] is True
        assert "fc.input_scale" not in sd
    else:
        assert ia[0]["strategy"] == "tensor" and ia[0]["dynamic"] is False
        assert sd["fc.input_scale"].dtype == torch.float32 and sd["fc.input_scale"].shape == (1,)
        assert ("fc.input_zero_point" in sd) == act[1]
        obs = m.fc.qc_aq.observer
        amax = torch.maximum(obs.min.abs(), obs.max.abs())
        if not act[1]:
            assert torch.equal(sd["fc.input_scale"], (amax / 127).reshape(1))
    fresh = load_quantized(tmp_path / "out", Net().eval())
    with torch.no_grad():
        out, out2 = fresh(ids, img), fresh(ids2, img2)
    for a, b in zip(list(ref) + list(ref2), list(out) + list(out2)):
        assert torch.equal(a, b)


def test_ternary_and_binary_written_as_two_bits(tmp_path):
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "t": {
                            "params": {"start_bits": 2, "target_bits": 2, "ternary": True, "granularity": "channel"},
                            "modules": ["fc"],
                        },
                        "b": {
                            "params": {"start_bits": 1, "target_bits": 1, "granularity": "channel"},
                            "modules": ["head"],
                        },
                    },
                }
            }
        }
    )
    m = compressed_net(cfg)
    export_quantized(m, tmp_path / "out", cfg)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    sd = load_file(tmp_path / "out" / "model.safetensors")
    mods = config["qcompress"]["modules"]
    assert mods["fc"]["qtype"] == "ternary" and mods["head"]["qtype"] == "binary"
    q = ct_helpers.unpack_from_int32(sd["fc.weight_packed"], 2, torch.Size([48, 256]))
    assert set(q.unique().tolist()) == {-1, 0, 1}
    q = ct_helpers.unpack_from_int32(sd["head.weight_packed"], 2, torch.Size([5, 48]))
    assert set(q.unique().tolist()) == {-1, 1}
    for n in ("fc", "head"):
        assert torch.equal(oracle_dequant(sd, n, mods[n]), getattr(m, n).effective_weight())


def test_quantize_groups_chunks(tmp_path):
    # 48x256 weight: 4 chunks = 12 whole rows each -> channel; 96 chunks = half rows -> group 128
    for n, strategy, gs in ((4, "channel", None), (96, "group", 128)):
        cfg = wq_cfg(4, True, None, None, modules=("fc",), quantize_groups=n)
        m = compressed_net(cfg)
        out = tmp_path / f"g{n}"
        export_quantized(m, out, cfg)
        rec = json.loads((out / "config.json").read_text())["qcompress"]["modules"]["fc"]
        assert (rec["weights"]["strategy"], rec["weights"]["group_size"]) == (strategy, gs)
        sd = load_file(out / "model.safetensors")
        assert torch.equal(oracle_dequant(sd, "fc", rec), m.fc.effective_weight())
    # 48*256 / 256 chunks = 48 elements: neither divides nor is a multiple of the 256-long rows
    cfg = wq_cfg(4, True, None, None, modules=("fc",), quantize_groups=256)
    m = compressed_net(cfg)
    with pytest.raises(ExportError, match="quantize_groups"):
        export_quantized(m, tmp_path / "bad", cfg)
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_odd_widths_and_baked_model(tmp_path):
    cfg = wq_cfg(3, False, "group", 64)
    m = compressed_net(cfg)
    ids, img = inputs()
    with torch.no_grad():
        ref = m(ids, img)
    qcompress.redundancy_clean(m, cfg)
    export_quantized(m, tmp_path / "out", cfg)
    sd = load_file(tmp_path / "out" / "model.safetensors")
    assert sd["fc.weight"].dtype == torch.int8 and int(sd["fc.weight"].min()) >= -4
    with torch.no_grad():
        out = load_quantized(tmp_path / "out", Net().eval())(ids, img)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_metadata_and_inspect(tmp_path):
    cfg = wq_cfg(4, True, "group", 32)
    m = compressed_net(cfg)
    export_quantized(m, tmp_path / "out", cfg)
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert meta["qcompress_version"] == qcompress.__version__
    assert json.loads(meta["qcompress_config"]) == cfg.raw
    export_quantized(m, tmp_path / "nocfg")  # without cfg: the config init_compression applied
    with safe_open(tmp_path / "nocfg" / "model.safetensors", framework="pt") as f:
        assert json.loads(f.metadata()["qcompress_config"]) == cfg.raw
    text = inspect_checkpoint(tmp_path / "out")
    line = next(l for l in text.splitlines() if l.startswith("fc.weight_packed"))
    assert "pack-quantized" in line and "48x32" in line and "0.125" in line
    assert "ratio" in text.splitlines()[-1]


def test_w4a16_g128_size_ratio(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "fp32.safetensors")
    cfg = wq_cfg(4, True, "group", 128, modules=("0", "2"))
    qcompress.init_compression(m, cfg)
    export_quantized(m, tmp_path / "out", cfg)
    ratio = os.path.getsize(tmp_path / "out" / "model.safetensors") / os.path.getsize(tmp_path / "fp32.safetensors")
    assert ratio <= 0.14, ratio


def test_tied_gpt2_exports_after_redundancy_clean(tmp_path):
    # GPT-2 ties lm_head to wte; redundancy_clean bakes the shared weight once, so both modules
    # hold the same code and scale tensors, which safetensors refuses to write as two names.
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import warnings

    def build():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=32)
        return transformers.GPT2LMHeadModel(cfg)

    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w4": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "channel"}}},
            }
        }
    }
    cfg = qcompress.load_config(doc)
    model = build()
    wte = model.transformer.wte.weight.detach().clone()
    model = qcompress.redundancy_clean(qcompress.init_compression(model, cfg), cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Conv1D / Embedding: qcompress-only export
        export_quantized(model, tmp_path / "out", cfg)
    sd = load_file(tmp_path / "out" / "model.safetensors")
    # the tied codes and scales are stored once, under the Linear's name; wte points to them
    assert "lm_head.weight_packed" in sd and not any(k.startswith("transformer.wte.") for k in sd)
    manifest = json.load(open(tmp_path / "out" / "config.json"))["qcompress"]["modules"]
    assert manifest["transformer.wte"]["tied_to"] == "lm_head" and "tied_to" not in manifest["lm_head"]
    loaded = load_quantized(tmp_path / "out", build())
    # oracle: the reference quantizer on the starting embedding, 4-bit per row
    want = R.fake_quantize_with_mask(wte, R.make_spec(4, granularity="channel"))[0]
    assert torch.equal(loaded.lm_head.weight, want) and torch.equal(loaded.transformer.wte.weight, want)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_float32_export_loads_into_a_bfloat16_model(tmp_path, mode):
    # was a dtype error at the first forward (float32 weights, bfloat16 activations); now the
    # weights are the exported ones rounded to the model's dtype, as transformers casts a checkpoint
    def net(dtype=torch.float32):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16, bias=False)).to(dtype)

    cfg = qcompress.load_config(wq_cfg(4, granularity="group", group_size=32, modules=("0", "2")))
    model = qcompress.init_compression(net(), cfg).eval()
    export_quantized(model, tmp_path / "out", cfg)
    ours = load_quantized(tmp_path / "out", net(torch.bfloat16), mode=mode)
    # oracle: a plain bfloat16 model holding the float32 reload's weights cast to bfloat16
    exact32 = load_quantized(tmp_path / "out", net())
    dense = net(torch.bfloat16)
    with torch.no_grad():
        for i in (0, 2):
            assert torch.equal(ours[i].weight, exact32[i].weight.to(torch.bfloat16)), i
            dense[i].weight.copy_(exact32[i].weight)
        x = torch.randn(5, 64).to(torch.bfloat16)
        y, want = ours(x), dense(x)
    assert y.dtype == torch.bfloat16
    if mode == "exact":
        assert torch.equal(y, want)
    else:  # the fused kernels sum in another order: within bfloat16 rounding of the result
        assert torch.allclose(y.float(), want.float(), rtol=2**-6, atol=2**-6 * float(want.abs().max()))


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_loaded_model_cast_with_to_keeps_its_scales(tmp_path, mode):
    # loaded.to(bfloat16) cast the float32 scales (changing the weights) and left the dequantized
    # weight float32: the first forward failed. Now the scales stay as exported and the weights
    # follow the model's dtype, as a load into a bfloat16 model gives them.
    def net(dtype=torch.float32):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).to(dtype)

    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["0", "2"]}},
            }
        }
    }
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["0", "2"]}},
    }
    cfg = qcompress.load_config(doc)
    model = qcompress.init_compression(net(), cfg)
    model.train()
    model(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)))  # calibrates the ranges
    qcompress.CompressionScheduler(model, cfg).step()
    export_quantized(model.eval(), tmp_path / "out", cfg)
    cast = load_quantized(tmp_path / "out", net(), mode=mode).to(torch.bfloat16)
    want = load_quantized(tmp_path / "out", net(torch.bfloat16), mode=mode)  # oracle: loaded as bf16
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(cast(x), want(x))
    sd = cast.state_dict()
    for k, t in load_file(tmp_path / "out" / "model.safetensors").items():
        if not k.endswith("bias"):
            assert sd[k].dtype == t.dtype and torch.equal(sd[k], t), k


def test_bf16_gpt2_trained_baked_and_reloaded_agree_bit_for_bit(tmp_path):
    """transformers' Conv1D stores its weight [in, out]. Training multiplied a transposed view of
    the fake-quantized [out, in] weight, baking (redundancy_clean) and reloading a contiguous one;
    bf16 GEMMs round differently for the two layouts (logits 0.008 apart here, 0.03 on the 10M GPT-2
    of benchmarks/). All three now multiply the contiguous [in, out] weight. The oracle is the trained
    model's own output."""
    transformers = pytest.importorskip("transformers")

    def gpt2():
        torch.manual_seed(0)
        return (
            transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_embd=384, n_layer=2, n_head=6, vocab_size=512, n_positions=64)
            )
            .to(torch.bfloat16)
            .eval()
        )

    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "w4": {
                        "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 64},
                        "modules": [r"\.h\.\d+\."],
                    }
                },
            }
        }
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the blocking where the two layouts' sums differ on CPU
    try:
        model = qcompress.init_compression(gpt2(), qcompress.load_config(cfg))
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            trained = model(ids).logits
            export_quantized(model, tmp_path / "out", cfg)
            reloaded = load_quantized(tmp_path / "out", gpt2())(ids).logits
            baked = qcompress.redundancy_clean(model, cfg)(ids).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(reloaded, trained)
    assert torch.equal(baked, trained)


# The recipe leaves wte / lm_head out (serving loaders do not read them); the tied-weight tests need
# the one Parameter both modules share quantized, so its group takes every module.
ALL_MODULES_W4_G32 = {
    "compression_training": {"weight_quantization": {"different_groups": {"w4_g32": {"modules": ["."]}}}}
}


def _tied_gpt2_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import warnings

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=1, n_head=2, n_positions=32)
        ).eval()

    cfg = qcompress.load_config(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "schedules", "w4a16_g32.yaml"
        ),
        ALL_MODULES_W4_G32,
    )
    model = qcompress.init_compression(build(), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Conv1D / Embedding: qcompress-only export
        export_quantized(model, tmp_path / "out", cfg)
    return model, build


def test_tied_weights_are_stored_once_and_load_into_both_modules(tmp_path):
    """GPT-2's wte / lm_head quantize one Parameter to one set of codes: the export held them twice
    (a quarter of this model's file). The oracle for the reload is the trained model itself, and for
    the size the same export with the tie removed from the manifest and the copy written back."""
    model, build = _tied_gpt2_export(tmp_path)
    out = tmp_path / "out"
    sd = load_file(out / "model.safetensors")
    assert not any(k.startswith("transformer.wte.") for k in sd)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for mode in ("exact", "fast"):
            loaded = load_quantized(out, build(), mode=mode)
            assert torch.equal(loaded.transformer.wte.weight, loaded.lm_head.weight)
            got = loaded(input_ids=ids).logits
            if mode == "exact":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    stored = sum(v.numel() * v.element_size() for v in sd.values())
    tied = sum(v.numel() * v.element_size() for k, v in sd.items() if k.startswith("lm_head.weight"))
    assert tied > 0.2 * stored  # what storing it twice would have added


def _edit_manifest(out, fn):
    path = out / "config.json"
    cfg = json.load(open(path))
    fn(cfg["qcompress"]["modules"])
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing target", r"tied_to='nowhere' does not name another module"),
        ("itself", r"tied_to='transformer.wte' does not name another module"),
        ("chain", r"tied_to='transformer.wte' does not name another module"),
        ("records differ", r"tied_to='lm_head', but the two modules' weight records differ"),
    ],
)
def test_bad_tie_records_are_checkpoint_errors(tmp_path, case, match):
    _, build = _tied_gpt2_export(tmp_path)
    out = tmp_path / "out"

    def edit(mods):
        if case == "missing target":
            mods["transformer.wte"]["tied_to"] = "nowhere"
        elif case == "itself":
            mods["transformer.wte"]["tied_to"] = "transformer.wte"
        elif case == "chain":
            mods["lm_head"]["tied_to"] = "transformer.wte"
            mods["transformer.h.0.attn.c_attn"]["tied_to"] = "lm_head"
        else:
            mods["transformer.wte"]["weights"]["group_size"] = 16

    _edit_manifest(out, edit)
    from qcompress.export.errors import CheckpointError

    with pytest.raises(CheckpointError, match=match):
        load_quantized(out, build())


def test_a_tied_module_whose_tensors_are_stored_anyway_is_refused(tmp_path):
    """resolve_ties (the loader's step after reading the files, before the tensor checks) refuses a
    weight tensor stored under a name the manifest says is tied, rather than pick one."""
    from qcompress.export import safetensors_io as sio
    from qcompress.export.errors import CheckpointError
    from qcompress.export.reader import read_config, resolve_ties

    _tied_gpt2_export(tmp_path)
    out = tmp_path / "out"
    _, _, _, modules = read_config(str(out))
    tensors, where, _ = sio.read_checkpoint(str(out))
    resolve_ties(dict(tensors), dict(where), modules)  # as exported: fine
    tensors["transformer.wte.weight_scale"] = tensors["lm_head.weight_scale"].clone()
    where["transformer.wte.weight_scale"] = where["lm_head.weight_scale"]
    with pytest.raises(
        CheckpointError,
        match=r"'transformer.wte.weight_scale' is stored although config.json "
        r"says 'transformer.wte' is tied_to 'lm_head'",
    ):
        resolve_ties(tensors, where, modules)


def test_tied_weights_with_learned_ranges_are_stored_once_and_reload_exactly(tmp_path):
    """With range learning the tied modules also share a learned weight_scale Parameter, which the
    export wrote under the Embedding's name too: the reload refused the export. The oracle is the
    trained model's own logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import warnings

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=1, n_head=2, n_positions=32)
        )

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = qcompress.load_config(
        os.path.join(root, "schedules", "w4a16_g32.yaml"),
        ALL_MODULES_W4_G32,
        {
            "compression_training": {
                "weight_quantization": {"shared_parameters": {"observer": "mse", "range_learning": True}}
            }
        },
    )
    model = qcompress.init_compression(build(), cfg)
    sched = qcompress.CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # the learned scales move
    opt.step()
    sched.step()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(model, tmp_path / "out", cfg)
    sd = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(k.startswith("transformer.wte.") for k in sd)
    loaded = load_quantized(tmp_path / "out", build())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_tied_full_precision_weights_are_stored_once_and_reload_tied(tmp_path):
    """A recipe that leaves the embeddings out keeps a tied embedding / lm_head in full precision:
    the export writes it once, as save_pretrained does, not once per name. Oracles: the compressed
    model's logits, and transformers' own loader (which ties lm_head back to the embedding)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from safetensors.torch import load_file
    import warnings

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            )
        ).eval()

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = qcompress.load_config(
        os.path.join(root, "schedules", "w4a16_g128.yaml"),
        {
            "compression_training": {
                "weight_quantization": {"different_groups": {"w4_g128": {"params": {"group_size": 64}}}}
            }
        },
    )
    model = qcompress.init_compression(build(), cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(model, tmp_path / "out", cfg)
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    want = model(ids).logits
    loaded = load_quantized(tmp_path / "out", build())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded(ids).logits, want)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(hf.lm_head.weight, loaded.lm_head.weight)
    torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)
