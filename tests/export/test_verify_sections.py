"""`qcompress verify` on exports with online rotations (transform_config) and KV-cache quantization
(kv_cache_scheme): the rows it reports, the problems that make it exit 1, and transformers' own
loading as the oracle of what that consumer does (it drops transform_config; compressed-tensors'
apply_transform_config puts it back)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import qcompress
import qcompress.verify
from tests.helpers.rotation_fixtures import make_dense

pytest.importorskip("compressed_tensors", reason='compressed-tensors is not installed (pip install -e ".[hf]")')

W4 = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "symmetric"},
        "different_groups": {
            "w": {
                "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                "modules": ["^(?!.*(embed|lm_head))"],
            }
        },
    }
}


def _export(tmp_path, **sections):
    model = make_dense("llama")
    cfg = qcompress.load_config({"compression_training": {**W4, **sections}})
    qcompress.init_compression(model, cfg)
    if "kv_cache_quantization" in sections:
        from qcompress.train.stages import calibrate_static_ranges

        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
        calibrate_static_ranges(model, [{"input_ids": ids}])
    folder = tmp_path / "export"
    qcompress.export_quantized(model, str(folder), cfg)
    return folder


def _rewrite(folder, fn):
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    fn(config)
    with open(path, "w") as fh:
        json.dump(config, fh)


def test_rotated_export_rows_and_transformers_dropping_the_rotation(tmp_path):
    folder = _export(tmp_path, rotation={"enabled": True, "rotations": ["R1", "R2", "R4"]})
    offline = qcompress.verify.verify(folder)
    assert offline.exit_code == 0, offline.format()
    down = offline.rows["model.layers.0.mlp.down_proj"]
    assert "R4 input" in down.scheme and "apply_transform_config" in down.consumers["transformers"]
    assert not any("transform_config" in n for n in offline.notes)  # a registered check ran

    full = qcompress.verify.verify(folder, transformers=True)
    lines = [p.line() for p in full.problems]
    assert full.exit_code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("transformers: model.layers.0.mlp.down_proj") and "drops" in lines[0]
    # with the rotation applied by compressed-tensors, transformers gives load_quantized's tokens
    assert "apply_transform_config: greedy tokens equal in 2/2" in full.consumers["transformers"].detail


def test_rotated_export_missing_its_block_is_a_problem(tmp_path):
    folder = _export(tmp_path, rotation={"enabled": True, "rotations": ["R4"]})

    def retarget(config):
        scheme = config["quantization_config"]["transform_config"]["config_groups"]["R4"]
        scheme["apply"][0]["targets"].append("model.layers.1.self_attn.o_proj")  # no block stored for it

    _rewrite(folder, retarget)
    report = qcompress.verify.verify(folder, load=False)
    assert any(
        p.module == "model.layers.1.self_attn.o_proj" and "no shard holds" in p.reason for p in report.problems
    ), report.format()


@pytest.mark.parametrize("fmt,vllm_ok", [("fp8_e4m3", True), ("int8", False)])
def test_kv_cache_rows_and_vllm_refusing_int8(tmp_path, fmt, vllm_ok):
    folder = _export(tmp_path, kv_cache_quantization={"enabled": True, "format": fmt, "strategy": "head"})
    report = qcompress.verify.verify(folder)
    kv_rows = [r for r in report.rows.values() if r.kind == "kv_cache"]
    assert len(kv_rows) == 2 and all("per head" in r.scheme for r in kv_rows)
    vllm = [p for p in report.problems if p.consumer == "vllm"]
    assert (not vllm) == vllm_ok, report.format()
    assert report.exit_code == (0 if vllm_ok else 1)


def test_kv_cache_bad_scale_is_a_problem(tmp_path, monkeypatch):
    """A scale that is not positive: the export's digests refuse an edited shard, so the scales
    verify reads are edited on their way out of qcompress.export.kv_cache.report."""
    folder = _export(tmp_path, kv_cache_quantization={"enabled": True, "format": "fp8_e4m3"})
    from qcompress.export import kv_cache

    real = kv_cache.report

    def negated(source):
        return [(n, -k if n.endswith("layers.1.self_attn") else k, v, s) for n, k, v, s in real(source)]

    monkeypatch.setattr(kv_cache, "report", negated)
    report = qcompress.verify.verify(folder, load=False)
    assert [p.module for p in report.problems] == ["model.layers.1.self_attn.k_scale"], report.format()
