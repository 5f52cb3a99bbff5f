"""Wording a newcomer reads: transformers' logit note says what the load did with the activations
(plain from_pretrained quantizes them itself; only dequantize=True runs them unquantized), the
transformers stage draws no compressed-tensors progress bars into a log, a YAML error names the
file, docs/cli.md lists every option of `qcompress export`, and the docs name real commands."""

import os
import re
import warnings

import pytest

from tests.helpers import hf_fixtures as hf
import qcompress as qc
from qcompress.errors import ConfigError
from qcompress.train import stages

transformers = hf.transformers
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = tmp_path_factory.mktemp("exports")
    folder = hf.tiny_bert_folder(str(base / "bert"), num_labels=3)
    out = {}
    for name in ("w8a8", "fp8_dynamic", "w4a16_g32"):
        model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
        cfg = qc.load_config(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qc.init_compression(model, cfg)
            qc.export_quantized(model, base / name, cfg)
        out[name] = str(base / name)
    return out


def test_the_note_says_what_the_load_did_with_the_activations(exports):
    plain, dequantized = (
        "from_pretrained",
        "from_pretrained(quantization_config=CompressedTensorsConfig(dequantize=True))",
    )
    int_note = stages.why_logits_differ(exports["w8a8"], plain)
    assert "unquantized" not in int_note and "127.5" in int_note
    fp8_note = stages.why_logits_differ(exports["fp8_dynamic"], plain)
    assert "unquantized" not in fp8_note and "one scale for a whole 2-D input" in fp8_note
    for name in ("w8a8", "fp8_dynamic"):
        assert "activations unquantized" in stages.why_logits_differ(exports[name], dequantized)
    assert "activations unquantized" in stages.why_logits_differ(exports["w4a16_g32"], plain)


def test_the_transformers_stage_draws_no_library_progress_bars(exports, capfd):
    for name in ("w8a8", "fp8_dynamic"):
        got = stages.transformers_attempts(exports[name], "text-classification", lambda m: {"accuracy": 1.0})
        assert got.get("loaded_with"), got
    err = capfd.readouterr().err
    for bar in ("Applying quantization config", "Compressing model", "Decompressing model", "Dispatching model"):
        assert bar not in err, err[-2000:]
    from tqdm import std  # tqdm is itself again afterwards

    assert std.tqdm.__init__.__name__ != "quiet"


def test_a_yaml_error_names_the_file_not_a_unicode_string(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compression_training:\n  weight_quantization: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        qc.load_config(str(bad))
    msg = str(err.value)
    assert "<unicode string>" not in msg and f'in "{bad}", line' in msg, msg


def test_docs_cli_lists_every_export_option():
    from qcompress.export.cli import export_parser

    page = open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8").read()
    section = page[page.index("## `qcompress export`") : page.index("## `qcompress inspect")]
    for action in export_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert re.search(rf"(?<![\w-]){flag}(?![\w-])", section), flag


def test_docs_name_only_real_commands():
    from qcompress.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    commands = set(sub.choices)
    found = []
    for path in [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
    ]:
        text = open(path, encoding="utf-8").read()
        for cmd, word in re.findall(r"`qcompress ([a-z]\w*)(?: (\w+))?", text):
            if cmd not in commands:
                found.append(f"{os.path.basename(path)}: qcompress {cmd}")
            elif cmd == "export" and word in commands:  # `qcompress export inspect`
                found.append(f"{os.path.basename(path)}: qcompress {cmd} {word}")
    assert not found, found


def _expert_warnings(family, tmp_path):
    from tests.helpers.moe_fixtures import make_moe

    model = make_moe(family)
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "wq": {"params": {"start_bits": 8, "target_bits": 8}, "modules": [r"mlp\.experts"]}
                },
            }
        }
    }
    qc.init_compression(model, cfg)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        qc.export_quantized(model, tmp_path / family, cfg)
    fused = [n for n, p in model.named_parameters() if p.dim() == 3]
    return [str(w.message) for w in seen if "expert Parameters" in str(w.message)], fused


def test_the_expert_layout_warnings_say_each_thing_once(tmp_path):
    # Qwen3-MoE experts are written per expert, which transformers and vLLM read: nothing to warn
    assert _expert_warnings("qwen3_moe", tmp_path)[0] == []
    # gpt-oss' are written under vLLM's names, which transformers does not read: one warning that
    # counts them, names two, and names the loaders that read them
    said, fused = _expert_warnings("gpt_oss", tmp_path)
    assert len(said) == 1 and len(fused) > 2, said
    named = ", ".join(sorted(fused)[:2])
    assert said[0].startswith(f"{len(fused)} quantized gpt-oss expert Parameters ({named}, ...) "), said
    assert "vLLM" in said[0] and "qcompress.load_quantized" in said[0], said
    words = said[0].split()
    assert not any(a == b for a, b in zip(words, words[1:])), said  # no doubled word


def test_setup_times_are_the_measured_ones_not_a_few_minutes():
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "model_zoo", "demo_bbc.py")] + [
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
    ]
    for path in paths:
        text = " ".join(open(path, encoding="utf-8").read().split())
        assert "a few minutes" not in text and "within minutes" not in text, path
    dev = open(os.path.join(ROOT, "docs", "development.md"), encoding="utf-8").read()
    assert "### How long setup takes" in dev and "18 minutes" in dev
