"""`qcompress verify` without vLLM, and the MoE declarations it checks.

Oracles: compressed-tensors' own name matcher (`match_name`) for what config_groups declare, the
per-expert names vLLM's get_moe_method asks for (`{experts}.0.{proj}` with the family's checkpoint
names), transformers' from_pretrained for what it loads, and the exit codes / messages of the CLI."""

import json
import os

import pytest

import qcompress
import qcompress.verify
from qcompress.cli import main as cli_main
from tests.helpers.moe_fixtures import make_moe

ct_match = pytest.importorskip("compressed_tensors.utils.match")

# the names vLLM asks for when it picks an experts layer's MoE method (its ckpt_*_proj_name)
VLLM_PROJ = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("mlp.experts", ("w1", "w3", "w2")),
}


def cfg(bits=4, group_size=16, act=False):
    c = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "wq": {
                        "params": {
                            "start_bits": bits,
                            "target_bits": bits,
                            "granularity": "group",
                            "group_size": group_size,
                        },
                        "modules": [r"mlp\.experts", "self_attn"],
                    }
                },
            }
        }
    }
    if act:
        c["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.experts", "self_attn"]}},
        }
    return c


def export(tmp_path, family="qwen3_moe", **kw):
    model = make_moe(family)
    qcompress.init_compression(model, cfg(**kw))
    out = tmp_path / family
    qcompress.export_quantized(model, out)
    return model, out


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _declared(qc, name):
    """compressed-tensors' own matching: ignore wins, then the groups whose targets match."""
    if any(ct_match.match_name(name, t) for t in qc["ignore"]):
        return "ignored"
    hits = [g for g, s in qc["config_groups"].items() if any(ct_match.match_name(name, t) for t in s["targets"])]
    return hits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_declared_where_vllm_and_compressed_tensors_look(tmp_path, family):
    _, out = export(tmp_path, family)
    qc = _config(out)["quantization_config"]
    assert "qcompress_only_export" not in qc["config_groups"]
    stored = [k for k in _config(out)["qcompress"]["experts"]]
    assert stored
    n_experts = 4
    for layer in range(2):
        block = "block_sparse_moe.experts" if family == "mixtral" else VLLM_PROJ[family][0]
        for proj in VLLM_PROJ[family][1]:
            for e in range(n_experts):
                name = f"model.layers.{layer}.{block}.{e}.{proj}"
                hits = _declared(qc, name)
                assert hits != "ignored" and len(hits) == 1, (name, hits)
                g = qc["config_groups"][hits[0]]
                assert g["format"] == "pack-quantized" and g["weights"]["num_bits"] == 4
                assert g["weights"]["group_size"] == 16
            # and no expert beyond the model's is declared (the pattern is anchored)
            assert _declared(qc, f"model.layers.{layer}.{block}.{n_experts}x.{proj}") == []
    # per-expert tensors under the declared names, with compressed-tensors' suffixes
    with open(out / "model.safetensors", "rb"):
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
    block = "block_sparse_moe.experts" if family == "mixtral" else "mlp.experts"
    assert f"model.layers.0.{block}.3.{VLLM_PROJ[family][1][2]}.weight_packed" in keys


def test_verify_good_export_exit_0_and_names_every_module(tmp_path, capsys):
    _, out = export(tmp_path)
    assert cli_main(["verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.*.down_proj" in text and "W4 int g16 / A16" in text
    assert "load_quantized: loads yes, generates yes" in text
    report = qcompress.verify.verify(out)
    assert report.exit_code == 0 and report.consumers["load_quantized"].loads is True
    assert {r.kind for r in report.rows.values()} == {"linear", "experts"}


def test_verify_names_experts_an_older_export_left_undeclared(tmp_path, capsys):
    _, out = export(tmp_path)
    config = _config(out)
    for g in config["quantization_config"]["config_groups"].values():  # as exports before declared them
        g["targets"] = [t for t in g["targets"] if not t.startswith("re:")]
    (out / "config.json").write_text(json.dumps(config))
    assert cli_main(["verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "PROBLEM config.json: model.layers.0.mlp.experts.*.gate_proj: quantized experts are not in" in text
    # load_quantized still reads it exactly: such exports keep loading
    assert "load_quantized: loads yes" in text


def test_verify_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys):
    _, out = export(tmp_path)
    before = sorted(os.listdir(out))
    # a config group that contradicts the tensors (4-bit codes declared 8-bit for the experts)
    config = _config(out)
    good = json.dumps(config)
    for g in config["quantization_config"]["config_groups"].values():
        g["weights"]["num_bits"] = 8
    (out / "config.json").write_text(json.dumps(config))
    assert cli_main(["verify", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err and "num_bits" in err
    (out / "config.json").write_text(good)
    # a truncated shard: the error names the file
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert cli_main(["verify", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors" in err
    path.write_bytes(data)
    # not an export at all
    assert cli_main(["verify", str(tmp_path / "nothing")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before


def test_unknown_sections_are_noted_and_registered_checks_run(tmp_path):
    from qcompress.verify import sections

    _, out = export(tmp_path)
    config = _config(out)
    config["quantization_config"]["some_future_section"] = {"config_groups": {"x": {}}}
    (out / "config.json").write_text(json.dumps(config))
    report = qcompress.verify.verify(out, load=False)
    assert report.exit_code == 0
    assert any("some_future_section" in n for n in report.notes)
    seen = []
    sections.section_check("some_future_section")(lambda export, rep, value: seen.append(value))
    try:
        qcompress.verify.verify(out, load=False)
    finally:
        del sections.SECTION_CHECKS[("some_future_section", "offline")]
    assert seen == [{"config_groups": {"x": {}}}]


def test_verify_transformers_loads_declared_experts_exactly(tmp_path):
    pytest.importorskip("transformers")
    _, out = export(tmp_path)
    report = qcompress.verify.verify(out, transformers=True)
    assert report.exit_code == 0, report.format()
    assert report.consumers["transformers"].loads is True


def test_verify_transformers_reports_unquantized_expert_inputs_and_gpt_oss_refusal(tmp_path):
    pytest.importorskip("transformers")
    _, out = export(tmp_path, act=True)
    report = qcompress.verify.verify(out, transformers=True)
    bad = [p for p in report.problems if p.consumer == "transformers"]
    assert bad and any("experts" in p.module and "unquantized" in p.reason for p in bad), report.format()
    _, out = export(tmp_path, family="gpt_oss")
    report = qcompress.verify.verify(out, transformers=True)
    assert report.consumers["transformers"].loads is False and report.exit_code == 1
    assert any("gpt-oss experts under vLLM's per-expert names" in n for n in report.notes), report.notes
    rows = [r for r in report.rows.values() if r.kind == "experts"]  # declared per expert, as vLLM asks
    assert rows and all(r.declared.startswith("W") for r in rows), report.format()


def test_fused_projection_schemes_must_agree_for_vllm(tmp_path):
    model = make_moe("qwen3_moe")
    c = cfg()
    c["compression_training"]["weight_quantization"]["different_groups"]["wq"]["modules"] = [r"q_proj", r"k_proj"]
    qcompress.init_compression(model, c)
    qcompress.export_quantized(model, tmp_path / "q")
    report = qcompress.verify.verify(tmp_path / "q", load=False)
    assert any(p.consumer == "vllm" and "q_proj/k_proj/v_proj" in p.module for p in report.problems)


def test_load_quantized_refuses_an_expert_group_contradicting_the_tensors(tmp_path):
    model, out = export(tmp_path)
    config = _config(out)
    for g in config["quantization_config"]["config_groups"].values():
        g["weights"]["group_size"] = 32
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(qcompress.export.CheckpointError, match="group_size"):
        qcompress.load_quantized(out, make_moe("qwen3_moe", seed=3))


def test_verify_names_transformers_dropping_the_nvfp4_experts_global_scale(tmp_path):
    """transformers decompresses MoE experts from weight_packed and weight_scale only: NVFP4 experts
    come out times their weight_global_scale. verify says so, by expert tensor; the dense layers,
    decompressed in bfloat16, are load_quantized's weights rounded (the oracle: torch's rounding)."""
    pytest.importorskip("transformers")
    model = make_moe("qwen3_moe")
    c = cfg()
    c["compression_training"]["weight_quantization"]["different_groups"]["wq"]["params"] = {
        "start_bits": 4,
        "target_bits": 4,
        "format": "nvfp4",
    }
    qcompress.init_compression(model, c)
    out = tmp_path / "nvfp4"
    qcompress.export_quantized(model, out)
    report = qcompress.verify.verify(out, transformers=True)
    experts = [
        p
        for p in report.problems
        if p.consumer == "transformers" and p.module.endswith("_proj") and "experts" in p.module
    ]
    assert experts and all("weight_global_scale" in p.reason for p in experts), report.format()
    dense = [r for r in report.rows.values() if r.kind != "experts" and "self_attn" in r.name]
    assert dense and all("bfloat16" in r.consumers.get("transformers", "") for r in dense), report.format()
