"""benchmarks/quality.py's results page: the table's derived columns and target lines are computed
from the measured rows (oracle: the closed-form shares worked out by hand below), and
--write-results replaces only its task's generated section of benchmarks/results/quality.md."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("qc_quality", os.path.join(ROOT, "benchmarks", "quality.py"))
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def summary(**rows):
    return {"metric": "accuracy", "title": "Classifier (accuracy)", "setup": "new setup", "recipes": rows}


def test_recovered_share_and_mse_cut_are_computed_from_the_rows():
    # FP32 0.90, PTQ minmax 0.80, PTQ mse 0.85: mse cuts the excess 0.10 -> 0.05, by 50 %;
    # QAT 0.88 recovers (0.80 - 0.88) / (0.80 - 0.90) = 80 %, QAT + RL 0.89: 90 %, QAD + RL 0.90: 100 %
    s = summary(
        w8a8={
            "label": "W8A8",
            "fp32": 0.9,
            "ptq_minmax": 0.8,
            "ptq_mse": 0.85,
            "qat": 0.88,
            "qat_rl": 0.89,
            "qad_rl": 0.9,
        }
    )
    row = quality.table(s).splitlines()[-1]
    assert row == (
        "| W8A8 | 0.9000 | 0.8000 | 0.8500 | 0.8800 | 0.8900 | — | 0.9000 | 80 % / 90 % / — / 100 % | 50 % | — |"
    )


def test_float_row_gives_qad_and_export_size():
    # a float recipe has no mse runs: QAT 0.88 recovers 80 %, QAD (minmax + distillation) 0.89: 90 %;
    # export 1,000 of 4,000 FP32 bytes
    s = summary(
        nvfp4={"label": "NVFP4", "fp32": 0.9, "ptq_minmax": 0.8, "qat": 0.88, "qad": 0.89, "export_ratio": 1000 / 4000}
    )
    row = quality.table(s).splitlines()[-1]
    assert row == "| NVFP4 | 0.9000 | 0.8000 | — | 0.8800 | — | 0.8900 | — | 80 % / — / 90 % / — | — | 0.250 |"
    assert quality.recipe_variants("nvfp4", ["qat", "qat_rl", "qad_rl"]) == ["qat", "qad"]
    assert quality.recipe_variants("w4_g32", ["qat", "qat_rl", "qad_rl"]) == ["qat", "qat_rl", "qad_rl"]


def test_no_share_where_ptq_is_as_good_as_fp32():
    s = summary(
        w8a8={
            "label": "W8A8",
            "fp32": 0.9,
            "ptq_minmax": 0.9,
            "ptq_mse": 0.9,
            "qat": 0.91,
            "qat_rl": 0.9,
            "qad_rl": 0.9,
        }
    )
    assert "| n/a (PTQ ≈ or > FP32) | n/a |" in quality.table(s)


def test_ternary_target_line_follows_the_numbers():
    met = summary(w2a8_kd={"label": "ternary", "fp32": 0.95, "ptq_minmax": 0.5, "qad_rl": 0.93})
    missed = summary(w2a8_kd={"label": "ternary", "fp32": 0.95, "ptq_minmax": 0.5, "qad_rl": 0.90})
    assert quality.targets(met) == [
        "Target: ternary W2 with distillation within 3 accuracy points of FP32: "
        "**met** (QAD + RL 0.9300 vs FP32 0.9500: -2.00 points)."
    ]
    assert "**missed**" in quality.targets(missed)[0] and "-5.00 points" in quality.targets(missed)[0]


def test_write_results_replaces_only_its_task_section(tmp_path, monkeypatch):
    monkeypatch.setattr(quality.common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(quality, "HERE", str(tmp_path))  # the index: tmp_path/RESULTS.md
    page = tmp_path / "quality.md"
    page.write_text(
        "# Compression quality\n\nA hand-written note.\n\n<!-- generated: lm -->\nlm table\n"
        "<!-- /generated: lm -->\n\n<!-- generated: classifier -->\nold table\n"
        "<!-- /generated: classifier -->\n"
    )
    s = summary(w8a8={"label": "W8A8", "fp32": 0.9, "ptq_minmax": 0.8, "qat": 0.88, "qat_commit": "abc123"})
    quality.write_results("classifier", s, cmd="python benchmarks/quality.py --task classifier --write-results")
    text = page.read_text()
    assert text.startswith("# Compression quality\n\nA hand-written note.\n")
    assert "<!-- generated: lm -->\nlm table\n<!-- /generated: lm -->" in text  # the other task untouched
    assert "old table" not in text and "| W8A8 | 0.9000 | 0.8000 |" in text
    assert "`python benchmarks/quality.py --task classifier --write-results` at commit" in text
    assert "Runs measured at commit abc123." in text and "## Method" in text
    before = text
    quality.write_results("classifier", s, cmd="python benchmarks/quality.py --task classifier --write-results")
    strip = lambda t: [ln for ln in t.splitlines() if not ln.startswith("> ")]  # header: date, load
    assert strip(page.read_text()) == strip(before)  # idempotent
    assert sorted(os.listdir(tmp_path)) == ["RESULTS.md", "quality.md"]  # no temporary left
    index = (tmp_path / "RESULTS.md").read_text()
    assert (
        "<!-- generated: headline-classifier -->" in index and "| W8A8 | 0.9000 | 0.8000 | 0.8800 | 0.8800 |" in index
    )


def test_float_rl_fragments_are_configs_the_float_recipes_take(monkeypatch):
    """--float-rl: every float recipe's variants load with their recipe (oracle: qcompress's config
    check, which refuses weight_by on float formats and range learning on MX's power-of-two scales),
    and learn ranges exactly where the format can."""
    import pytest
    from qcompress.config import ConfigError, load_config

    monkeypatch.setitem(quality.OBSERVER_KWARGS, "weight_by", "inputs")  # the integer recipes' default
    for key in quality.FLOAT_RECIPES:
        recipe = os.path.join(ROOT, quality.RECIPES[key][1])
        formats = quality.weight_formats(recipe)
        variants = quality.recipe_variants(key, ["qat", "qat_rl", "qad", "qad_rl"], float_rl=True)
        assert variants == ["qat", "qat_rl", "qad", "qad_rl"]
        for v in variants:
            wq = load_config(recipe, quality.fragment(v, "lm", formats)).compression.weight_quantization.shared
            assert wq.observer == ("mse" if v.endswith("_rl") else "minmax")
            assert wq.range_learning == (v.endswith("_rl") and formats != {"mxfp4"})
    mx = os.path.join(ROOT, quality.RECIPES["mxfp4a16"][1])
    with pytest.raises(ConfigError, match="range_learning"):
        load_config(
            mx,
            {
                "compression_training": {
                    "weight_quantization": {"shared_parameters": {"observer": "mse", "range_learning": True}}
                }
            },
        )
    with pytest.raises(ConfigError, match="weight_by"):
        load_config(
            mx,
            {
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"observer": "mse", "observer_kwargs": {"weight_by": "inputs"}}
                    }
                }
            },
        )
    assert quality.weight_formats(os.path.join(ROOT, quality.RECIPES["w4_g32"][1])) == {"int"}
