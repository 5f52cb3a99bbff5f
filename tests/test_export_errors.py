"""Export/load failure modes: existing outputs, sharding, truncation, corruption, config and model
mismatches, interrupted writes, un-exportable models, and the CLI entry points."""
import json
import os
import struct

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import qcompress
from qcompress.export import (CheckpointError, ExportError, export_quantized, load_quantized,
                              main_export, main_inspect)
from qcompress.export import safetensors_io as sio


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


CFG = {"compression_training": {"weight_quantization": {
    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
    "different_groups": {"wq1": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "group",
                                            "group_size": 32}, "modules": ["0", "2"]}}}}}


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
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for f in shards
                                                  for t in load_file(out / f).values())
    for f in shards:      # a shard passes 2 KB only when one tensor alone is larger
        sizes = [t.numel() * t.element_size() for t in load_file(out / f).values()]
        assert sum(sizes) <= 2000 or len(sizes) == 1, (f, sizes)
    x = torch.randn(3, 128)
    with torch.no_grad():
        assert torch.equal(load_quantized(out, make_net())(x), m(x))
    export_quantized(m, out, force=True)          # single file now: stale shards must go
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
    header = json.loads(bytes(data[8:8 + hlen]))
    start = 8 + hlen + header["0.weight_packed"]["data_offsets"][0]
    data[start + 3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted: tensor '0\.weight_packed' fails its CRC32"):
        load_quantized(out, make_net())
    data[8 + 2] = ord("!")                         # break the header JSON
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
            with open(path, "r+b") as f:          # half-written file, then the crash
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
        numerics="deepspeed", quantization_type="asymmetric")
    cfg = qcompress.load_config(doc)
    m = qcompress.init_compression(make_net(), cfg)
    with pytest.raises(ExportError, match="numerics"):
        export_quantized(m, tmp_path / "c")
    doc = json.loads(json.dumps(CFG))
    doc["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["4"]}}}
    m = qcompress.init_compression(make_net(), qcompress.load_config(doc))
    with pytest.raises(ExportError, match="'4'.*never calibrated"):
        export_quantized(m, tmp_path / "d")
    assert not any((tmp_path / d).exists() and os.listdir(tmp_path / d) for d in "abcd")


def test_cli_export_and_inspect(tmp_path, monkeypatch, capsys):
    (tmp_path / "qc_factory.py").write_text(
        "import torch.nn as nn, torch\n"
        "def build():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    net = make_net()
    save_file(net.state_dict(), tmp_path / "w.safetensors")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    out = tmp_path / "out"
    argv = ["--model", "qc_factory:build", "--weights", str(tmp_path / "w.safetensors"),
            "--config", str(tmp_path / "cfg.json"), "--out", str(out)]
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
