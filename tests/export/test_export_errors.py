"""Export/load failure modes: existing outputs, sharding, truncation, corruption, config and model
mismatches, interrupted writes, un-exportable models, and the CLI entry points."""

import copy
import json
import os
import re
import struct

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import qcompress
from qcompress.export import CheckpointError, ExportError, export_quantized, load_quantized, main_export, main_inspect
from qcompress.export import safetensors_io as sio
from qcompress.quant import reference as R


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 32},
                    "modules": ["0", "2"],
                }
            },
        }
    }
}


def exported(tmp_path, name="out", **kw):
    cfg = qcompress.load_config(CFG)
    m = qcompress.init_compression(make_net(), cfg).eval()
    out = tmp_path / name
    export_quantized(m, out, cfg, **kw)
    return m, out


def test_no_overwrite_without_force(tmp_path):
    m, out = exported(tmp_path)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="model.safetensors|config.json"):
        export_quantized(m, out)
    assert (out / "model.safetensors").read_bytes() == before
    export_quantized(m, out, force=True)
    load_quantized(out, make_net())


def test_sharded_export_and_force_cleans_old_layout(tmp_path):
    m, out = exported(tmp_path, max_shard_size="2KB")
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / sio.INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in shards for t in load_file(out / f).values()
    )
    for f in shards:  # a shard passes 2 KB only when one tensor alone is larger
        sizes = [t.numel() * t.element_size() for t in load_file(out / f).values()]
        assert sum(sizes) <= 2000 or len(sizes) == 1, (f, sizes)
    x = torch.randn(3, 128)
    with torch.no_grad():
        assert torch.equal(load_quantized(out, make_net())(x), m(x))
    export_quantized(m, out, force=True)  # single file now: stale shards must go
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_truncated_file_names_file_and_tensor(tmp_path):
    _, out = exported(tmp_path)
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated.*tensor '"):
        load_quantized(out, make_net())
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        load_quantized(out, make_net())


def test_corrupted_bytes_and_header(tmp_path):
    _, out = exported(tmp_path)
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", bytes(data[:8]))
    header = json.loads(bytes(data[8 : 8 + hlen]))
    start = 8 + hlen + header["0.weight_packed"]["data_offsets"][0]
    data[start + 3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted: tensor '0\.weight_packed' fails its CRC32"):
        load_quantized(out, make_net())
    data[8 + 2] = ord("!")  # break the header JSON
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted header"):
        load_quantized(out, make_net())


def _edit_config(out, fn):
    cfg = json.loads((out / "config.json").read_text())
    fn(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def test_config_tensor_mismatch(tmp_path):
    _, out = exported(tmp_path)

    def two_bits(c):
        for n in ("0", "2"):
            c["qcompress"]["modules"][n]["weights"]["num_bits"] = 2
        for g in c["quantization_config"]["config_groups"].values():
            g["weights"]["num_bits"] = 2

    _edit_config(out, two_bits)
    with pytest.raises(CheckpointError, match=r"tensor '0\.weight_packed' is torch.int32 \[64, 16\].*\[64, 8\]"):
        load_quantized(out, make_net())
    _, out = exported(tmp_path, "b")

    def group64(c):
        for g in c["quantization_config"]["config_groups"].values():
            g["weights"]["group_size"] = 64

    _edit_config(out, group64)
    with pytest.raises(CheckpointError, match=r"config\.json.*group_size=64 for '0'"):
        load_quantized(out, make_net())
    (out / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_quantized(out, make_net())


def test_missing_tensor_and_wrong_model(tmp_path):
    _, out = exported(tmp_path)
    sd = load_file(out / "model.safetensors")
    del sd["2.weight_scale"]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'2\.weight_scale'"):
        load_quantized(out, make_net())
    _, out = exported(tmp_path, "b")
    wrong = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(CheckpointError, match=r"module '2' weight is \[32, 64\].*\[16, 64\]"):
        load_quantized(out, wrong)
    with pytest.raises(CheckpointError, match="is a linear in the checkpoint but a ReLU"):
        load_quantized(out, nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU()))


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_export_leaves_no_partial_file(tmp_path, monkeypatch, existing):
    cfg = qcompress.load_config(CFG)
    m = qcompress.init_compression(make_net(), cfg).eval()
    out = tmp_path / "out"
    if existing:
        export_quantized(m, out, cfg)
        before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    real = sio.save_file
    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:  # half-written file, then the crash
                f.truncate(os.path.getsize(path) // 2)
            raise KeyboardInterrupt("simulated crash mid-export")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(sio, "save_file", failing)
    with pytest.raises(KeyboardInterrupt):
        export_quantized(m, out, cfg, max_shard_size="2KB", force=True)
    assert len(calls) == 2
    left = sorted(os.listdir(out))
    if existing:
        assert left == sorted(before) and all((out / f).read_bytes() == b for f, b in before.items())
    else:
        assert left == []


def test_unexportable_models(tmp_path):
    cfg = qcompress.load_config(CFG)
    plain = make_net()
    with pytest.raises(ExportError, match="nothing to export"):
        export_quantized(plain, tmp_path / "a")
    m = qcompress.init_compression(make_net(), cfg)
    m[0].qc_wq.mix_enabled, m[0].qc_wq.mix_ratio = True, 0.3
    with pytest.raises(ExportError, match=r"'0'.*fp16_mixed_quantize"):
        export_quantized(m, tmp_path / "b")
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["weight_quantization"]["shared_parameters"].update(
        numerics="deepspeed", quantization_type="asymmetric"
    )
    cfg = qcompress.load_config(doc)
    m = qcompress.init_compression(make_net(), cfg)
    with pytest.raises(ExportError, match="numerics"):
        export_quantized(m, tmp_path / "c")
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["4"]}},
    }
    m = qcompress.init_compression(make_net(), qcompress.load_config(doc))
    with pytest.raises(ExportError, match="'4'.*never calibrated"):
        export_quantized(m, tmp_path / "d")
    assert not any((tmp_path / d).exists() and os.listdir(tmp_path / d) for d in "abcd")


def write_factory(tmp_path, monkeypatch, module):
    """An importable `<module>:build` building make_net()'s architecture, for the CLI's --model."""
    (tmp_path / f"{module}.py").write_text(
        "import torch.nn as nn, torch\n"
        "def build():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_cli_export_and_inspect(tmp_path, monkeypatch, capsys):
    write_factory(tmp_path, monkeypatch, "qc_factory")
    net = make_net()
    save_file(net.state_dict(), tmp_path / "w.safetensors")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    out = tmp_path / "out"
    argv = [
        "--model",
        "qc_factory:build",
        "--weights",
        str(tmp_path / "w.safetensors"),
        "--config",
        str(tmp_path / "cfg.json"),
        "--out",
        str(out),
    ]
    assert main_export(argv) == 0
    with pytest.raises(FileExistsError):
        main_export(argv)
    assert main_inspect([str(out)]) == 0
    text = capsys.readouterr().out
    assert "0.weight_packed" in text and "pack-quantized" in text
    ref = qcompress.init_compression(net, qcompress.load_config(CFG)).eval()
    x = torch.randn(2, 128)
    with torch.no_grad():
        assert torch.equal(load_quantized(out, make_net())(x), ref(x))


@pytest.mark.parametrize("in_forward", [True, False])
def test_cli_export_writes_target_bit_codes(tmp_path, monkeypatch, in_forward):
    # an 8 -> 4 bit schedule: the export must hold the weights quantized at 4 bits (optimizer-step
    # mode quantized them at 8 bits when init_compression ran), whatever the mode
    write_factory(tmp_path, monkeypatch, "qc_factory3")
    net = make_net()
    save_file(net.state_dict(), tmp_path / "w.safetensors")
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_weight_in_forward"] = in_forward
    doc["compression_training"]["weight_quantization"]["different_groups"]["wq1"]["params"].update(
        start_bits=8, target_bits=4, quantization_period=10
    )
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert (
        main_export(
            [
                "--model",
                "qc_factory3:build",
                "--weights",
                str(tmp_path / "w.safetensors"),
                "--config",
                str(tmp_path / "cfg.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    loaded = load_quantized(out, make_net())
    for i in (0, 2):  # oracle: the reference quantizer at the target bits on the trained weights
        want = R.fake_quantize_with_mask(net[i].weight.detach(), R.make_spec(4, granularity="group", group_size=32))[0]
        assert torch.equal(loaded[i].weight, want), i


def test_cli_export_from_an_engine_checkpoint_keeps_static_ranges(tmp_path, monkeypatch):
    # static activation ranges are training state, not weights: --weights cannot export them,
    # --checkpoint restores them (and everything else) from engine.save_checkpoint
    write_factory(tmp_path, monkeypatch, "qc_factory4")
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["0", "2"]}},
    }
    doc.update(train_batch_size=4, optimizer={"type": "SGD", "params": {"lr": 0.05}})
    cfg = qcompress.load_config(doc)
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    model = qcompress.init_compression(make_net(), cfg)
    engine = qcompress.initialize(model, cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        loss = engine(torch.randn(4, 128, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    trained = qcompress.redundancy_clean(copy.deepcopy(engine.module), cfg).eval()  # the oracle
    out = tmp_path / "out"
    assert (
        main_export(
            [
                "--model",
                "qc_factory4:build",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--config",
                str(tmp_path / "cfg.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "0.input_scale" in load_file(out / "model.safetensors")
    x = torch.randn(5, 128, generator=g)
    with torch.no_grad():
        assert torch.equal(load_quantized(out, make_net())(x), trained(x))
    with pytest.raises(SystemExit, match="not both"):
        main_export(
            [
                "--model",
                "qc_factory4:build",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--weights",
                "w",
                "--config",
                str(tmp_path / "cfg.json"),
                "--out",
                str(tmp_path / "o2"),
            ]
        )


def _act_cfg(calibration):
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": calibration},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["0", "2"]}},
    }
    return qcompress.load_config(doc)


def _exported_act(tmp_path, calibration):
    cfg = _act_cfg(calibration)
    m = qcompress.init_compression(make_net(), cfg).train()
    m(torch.randn(4, 128))  # calibrates the static ranges
    out = tmp_path / calibration
    export_quantized(m.eval(), out, cfg)
    return out


def _groups(c):
    return c["quantization_config"]["config_groups"].values()


def _set_inputs(c, value):
    for g in _groups(c):
        g["input_activations"] = value


DYNAMIC_TOKEN = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "group_size": None,
    "dynamic": True,
    "actorder": None,
    "observer": None,
    "observer_kwargs": {},
    "block_structure": None,
}
STATIC_TENSOR = dict(DYNAMIC_TOKEN, strategy="tensor", dynamic=False, observer="minmax")

QC_EDITS = [
    (
        "plain",
        lambda c: c["quantization_config"].update(format="int-quantized"),
        r"'0' format 'int-quantized'.*pack-quantized",
    ),
    ("plain", lambda c: c["quantization_config"].update(ignore=["0"]), r"ignore lists '0'"),
    ("plain", lambda c: c["quantization_config"].update(ignore=["re:^2$"]), r"ignore lists '2'"),
    (
        "plain",
        lambda c: c["quantization_config"].update(quantization_status="frozen"),
        r"quantization_status is 'frozen'",
    ),
    ("plain", lambda c: _set_inputs(c, DYNAMIC_TOKEN), r"input_activations=8-bit token dynamic for '0'"),
    ("static", lambda c: _set_inputs(c, DYNAMIC_TOKEN), r"input_activations\.strategy='token' for '0'"),
    ("static", lambda c: _set_inputs(c, None), r"input_activations=null for '0'.*static"),
    ("dynamic", lambda c: _set_inputs(c, STATIC_TENSOR), r"input_activations\.strategy='tensor' for '0'"),
    ("dynamic", lambda c: _set_inputs(c, None), r"input_activations=null for '0'.*dynamic"),
]


@pytest.mark.parametrize(
    "kind,edit,message",
    QC_EDITS,
    ids=[
        "format",
        "ignore",
        "ignore-regex",
        "status",
        "inputs-added",
        "static-to-dynamic",
        "static-to-null",
        "dynamic-to-static",
        "dynamic-to-null",
    ],
)
def test_quantization_config_must_agree_with_the_tensors(tmp_path, kind, edit, message):
    out = exported(tmp_path)[1] if kind == "plain" else _exported_act(tmp_path, kind)
    load_quantized(out, make_net())  # the untouched export loads
    _edit_config(out, edit)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        load_quantized(out, make_net())


def _drop(key):
    return lambda c: c["qcompress"]["modules"]["0"].pop(key)


def _group_size_zero(c):
    for w in [g["weights"] for g in _groups(c)] + [r["weights"] for r in c["qcompress"]["modules"].values()]:
        w["group_size"] = 0


MANIFEST_EDITS = [
    (_group_size_zero, r"module '0': weights\.group_size=0"),
    (_drop("weight_shape"), r"module '0': weight_shape=None"),
    (lambda c: c["qcompress"]["modules"]["0"]["weights"].pop("num_bits"), r"module '0': weights\.num_bits=None"),
    (lambda c: c["qcompress"]["modules"]["0"].update(kind="lstm"), r"module '0': kind='lstm'"),
]


@pytest.mark.parametrize(
    "edit,message", MANIFEST_EDITS, ids=["group-size-0", "no-weight-shape", "no-num-bits", "bad-kind"]
)
def test_malformed_manifest_names_config_and_module(tmp_path, edit, message):
    _, out = exported(tmp_path)
    _edit_config(out, edit)
    pattern = r"config\.json: qcompress manifest entry of " + message
    with pytest.raises(CheckpointError, match=pattern):
        load_quantized(out, make_net())
    with pytest.raises(CheckpointError, match=pattern):
        qcompress.export.inspect_checkpoint(out)


def test_module_missing_from_manifest(tmp_path):
    _, out = exported(tmp_path)
    _edit_config(out, lambda c: c["qcompress"]["modules"].pop("2"))
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: the qcompress manifest does not list "
        r"module '2'.*'2\.weight_packed'",
    ):
        load_quantized(out, make_net())


def test_index_pointing_at_the_wrong_shard(tmp_path):
    _, out = exported(tmp_path, max_shard_size="2KB")
    index = json.loads((out / sio.INDEX).read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) >= 2
    key = next(k for k, f in wm.items() if f == shards[0])
    assert key in load_file(out / shards[0]) and key not in load_file(out / shards[1])
    (out / sio.INDEX).write_text(json.dumps(dict(index, weight_map=dict(wm, **{key: shards[1]}))))
    with pytest.raises(
        CheckpointError,
        match=rf"index\.json: maps tensor '{re.escape(key)}' to "
        rf"'{shards[1]}', but it is stored in {shards[0]}",
    ):
        load_quantized(out, make_net())
    (out / sio.INDEX).write_text(json.dumps(dict(index, weight_map={k: f for k, f in wm.items() if k != key})))
    with pytest.raises(CheckpointError, match=rf"index\.json: does not list tensor '{re.escape(key)}'"):
        load_quantized(out, make_net())


def test_cli_main_reports_export_errors_without_traceback(tmp_path, monkeypatch, capsys):
    from qcompress import cli

    write_factory(tmp_path, monkeypatch, "qc_factory2")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    out = tmp_path / "out"
    argv = ["export", "--model", "qc_factory2:build", "--config", str(tmp_path / "cfg.json"), "--out", str(out)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv) == 2  # FileExistsError: no --force
    err = capsys.readouterr().err
    assert err.startswith("qcompress export: error: ") and "already exists" in err and "--force" in err
    assert "Traceback" not in err
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["weight_quantization"]["shared_parameters"].update(
        numerics="deepspeed", quantization_type="asymmetric"
    )
    (tmp_path / "ds.json").write_text(json.dumps(doc))
    argv = [
        "export",
        "--model",
        "qc_factory2:build",
        "--config",
        str(tmp_path / "ds.json"),
        "--out",
        str(tmp_path / "ds"),
    ]
    assert cli.main(argv) == 2  # ExportError
    assert capsys.readouterr().err.startswith("qcompress export: error: module '0': asymmetric DeepSpeed")
    _edit_config(out, _group_size_zero)
    assert cli.main(["inspect", str(out)]) == 2  # CheckpointError
    err = capsys.readouterr().err
    assert err.startswith("qcompress inspect: error: ") and "config.json" in err and "group_size=0" in err


def test_cli_export_weights_errors_name_the_file(tmp_path, monkeypatch, capsys):
    # --weights that is missing, truncated or from another model: one line naming the file (and
    # the tensors), exit status 2, nothing written
    from qcompress import cli

    write_factory(tmp_path, monkeypatch, "qc_factory5")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    save_file(make_net().state_dict(), tmp_path / "w.safetensors")
    (tmp_path / "trunc.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:900])
    other = make_net().state_dict()
    other["4.weight"] = torch.zeros(8, 16)  # a layer of another shape
    save_file(other, tmp_path / "shape.safetensors")
    save_file({k: v for k, v in make_net().state_dict().items() if k != "2.bias"}, tmp_path / "miss.safetensors")
    cases = {
        "nope": r"--weights .*nope\.safetensors: no such file",
        "trunc": r"trunc\.safetensors: truncated: tensor '[0-9.a-z]+' ends at byte",
        "shape": r"shape\.safetensors: tensor '4\.weight' is \[8, 16\], the model's is \[8, 32\]",
        "miss": r"miss\.safetensors: does not fit .* 1 tensors of the model are not in the file \(2\.bias\)",
    }
    for name, pattern in cases.items():
        out = tmp_path / f"out_{name}"
        argv = [
            "export",
            "--model",
            "qc_factory5:build",
            "--weights",
            str(tmp_path / f"{name}.safetensors"),
            "--config",
            str(tmp_path / "cfg.json"),
            "--out",
            str(out),
        ]
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("qcompress export: error: ") and "Traceback" not in err, err
        assert re.search(pattern, err), (name, err)
        assert not out.exists()


def test_cli_export_weights_with_tied_tensors_saved_once(tmp_path, monkeypatch):
    # transformers' save_pretrained and safetensors' save_model keep one name of a tied tensor
    # (GPT-2: transformer.wte.weight, no lm_head.weight): --weights must accept such a file
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    (tmp_path / "qc_gpt2f.py").write_text(
        "import torch, transformers\n"
        "def build():\n    torch.manual_seed(0)\n"
        "    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, "
        "n_layer=1, n_head=2, n_positions=16))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(5)
    trained = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    )
    trained.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    assert "lm_head.weight" not in load_file(weights)
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "w8": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["wte", "lm_head"]}
                },
            }
        }
    }
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Embedding is a qcompress-only export
        assert (
            main_export(
                [
                    "--model",
                    "qc_gpt2f:build",
                    "--weights",
                    str(weights),
                    "--config",
                    str(tmp_path / "cfg.json"),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    import qc_gpt2f

    loaded = load_quantized(out, qc_gpt2f.build())
    # oracle: the reference 8-bit per-row quantizer on the saved (trained) embedding
    want = R.fake_quantize_with_mask(trained.transformer.wte.weight.detach(), R.make_spec(8, granularity="channel"))[0]
    assert torch.equal(loaded.lm_head.weight, want) and torch.equal(loaded.transformer.wte.weight, want)
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight, trained.transformer.h[0].attn.c_attn.weight)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
@pytest.mark.parametrize("baked", [False, True])
def test_nonfinite_weight_is_an_export_error_naming_the_tensor(tmp_path, value, baked):
    # was a NonFiniteError without a module name (or "integers do not reproduce" once baked);
    # the export already in the folder stays as it was
    m, out = exported(tmp_path)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    cfg = qcompress.load_config(CFG)
    bad = qcompress.init_compression(make_net(), cfg)
    if baked:
        bad = qcompress.redundancy_clean(bad, cfg)
    with torch.no_grad():
        bad[2].weight[5, 7] = value
    with pytest.raises(
        ExportError,
        match=r"module '2': tensor '2\.weight' holds 1 NaN or Inf values "
        r"\(the first at index \[5, 7\]",
    ):
        export_quantized(bad.eval(), out, cfg, force=True)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    load_quantized(out, make_net())


def test_folder_in_place_of_the_safetensors_file(tmp_path):
    # was an IsADirectoryError (a traceback in the CLI) instead of a CheckpointError naming it
    m, out = exported(tmp_path)
    os.remove(out / "model.safetensors")
    os.mkdir(out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a regular file"):
        load_quantized(out, make_net())


def test_wrong_model_class_names_both_classes(tmp_path):
    # a classifier's export loaded into the bare encoder: the missing module alone does not say
    # what went wrong; config.json's architectures does
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import warnings

    bcfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(0)
    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["classifier"]}
                    },
                }
            }
        }
    )
    model = qcompress.init_compression(transformers.BertForSequenceClassification(bcfg), cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_quantized(model, tmp_path / "out", cfg)
    with pytest.raises(
        CheckpointError,
        match=r"module 'classifier' does not exist in the given model \(the "
        r"export is a BertForSequenceClassification, the given model a BertModel\)",
    ):
        load_quantized(tmp_path / "out", transformers.BertModel(bcfg))


def test_loading_into_an_already_loaded_model_says_so(tmp_path):
    # was KeyError: 'weight'
    m, out = exported(tmp_path)
    loaded = load_quantized(out, make_net())
    with pytest.raises(
        CheckpointError,
        match=r"module '0' of the given model already holds a loaded export "
        r"\(QuantizedLinear\); pass a fresh model",
    ):
        load_quantized(out, loaded)


def test_a_file_given_for_the_export_folder(tmp_path, capsys):
    # `qcompress inspect out/model.safetensors` was a NotADirectoryError traceback
    from qcompress import cli

    m, out = exported(tmp_path)
    target = str(out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a folder; an export is the folder"):
        load_quantized(target, make_net())
    assert cli.main(["inspect", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qcompress inspect: error: ") and "not a folder" in err


@pytest.mark.parametrize("kind,flag", [("hf_conv1d", False), ("linear", True)])
def test_manifest_transposed_flag_must_fit_the_kind(tmp_path, kind, flag):
    # a square Conv1D (GPT-2's attn.c_proj) passes every shape check: with the flag cleared it
    # loaded the transposed weight without a word
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import warnings

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)
        )

    cfg = qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["attn.c_proj", "mlp.c_fc"]}
                    },
                }
            }
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = qcompress.init_compression(build(), cfg).eval()
        export_quantized(model, tmp_path / "out", cfg)
    loaded = load_quantized(tmp_path / "out", build())
    assert torch.equal(
        loaded.transformer.h[0].attn.c_proj.weight, model.transformer.h[0].attn.c_proj.effective_weight()
    )
    name = "transformer.h.0.attn.c_proj"

    def edit(c):
        rec = c["qcompress"]["modules"][name]
        rec["transposed"] = flag
        if kind == "linear":
            rec["kind"] = "linear"

    _edit_config(tmp_path / "out", edit)
    with pytest.raises(
        CheckpointError,
        match=rf"module '{re.escape(name)}': transposed={flag} does not fit "
        rf"kind '{kind}'",
    ):
        load_quantized(tmp_path / "out", build())
