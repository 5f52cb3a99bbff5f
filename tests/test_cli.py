"""`qcompress` command line: schedule tables against the documented bit rule, plots, errors."""

import os
import subprocess
import sys
import textwrap

import pytest

from qcompress import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def table(out: str):
    """Parse the printed table: {column label: {step: cell}}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    header = lines[start].split()
    rows = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows[int(cells[0])] = cells[1:]
    return {label: {s: cells[i] for s, cells in rows.items()} for i, label in enumerate(header[1:])}


def doubling_rule(start, target, period, offset=0):
    """Oracle from the issue: one bit less at P, 2P, 4P, ... after the offset."""
    points = {offset: start}
    for k in range(start - target):
        points[offset + period * 2**k] = start - k - 1
    return points


CFG_12_8 = """\
compression_training:
  weight_quantization:
    shared_parameters: {enabled: true, quantize_weight_in_forward: true}
    different_groups:
      wq1:
        params: {start_bits: 12, target_bits: 8, quantization_period: 50}
        modules: [conv1]
"""


def test_schedule_12_to_8_period_50_lists_every_drop(tmp_path, capsys):
    path = write(tmp_path, "s.yaml", CFG_12_8)
    assert cli.main(["schedule", path]) == 0
    got = table(capsys.readouterr().out)
    expected = doubling_rule(12, 8, 50)
    assert expected == {0: 12, 50: 11, 100: 10, 200: 9, 400: 8}
    assert {s: int(b) for s, b in got["W:wq1"].items()} == expected


def test_schedule_linear_growth_offsets_and_activation_offset(tmp_path, capsys):
    path = write(
        tmp_path,
        "lin.yaml",
        """\
        compression_training:
          weight_quantization:
            shared_parameters: {enabled: true, schedule_offset: 100}
            different_groups:
              w: {params: {start_bits: 8, target_bits: 5, quantization_period: 20, period_growth: linear}}
          activation_quantization:
            shared_parameters: {enabled: true, schedule_offset: 150}
            different_groups:
              a: {params: {bits: 4}}
        """,
    )
    assert cli.main(["schedule", path]) == 0
    got = table(capsys.readouterr().out)
    # linear rule: drops at offset + P, 2P, 3P; activations switch on at their own offset
    assert got["W:w"] == {0: "off", 100: "8", 120: "7", 140: "6", 150: "6", 160: "5"}
    assert got["A:a"] == {0: "off", 100: "off", 120: "off", 140: "off", 150: "4", 160: "4"}


def test_schedule_steps_caps_the_table(tmp_path, capsys):
    path = write(tmp_path, "s.yaml", CFG_12_8)
    assert cli.main(["schedule", path, "--steps", "150"]) == 0
    got = table(capsys.readouterr().out)["W:wq1"]
    assert got == {0: "12", 50: "11", 100: "10", 150: "10"}


def test_progressive_schedule_reaches_4_bits_within_the_demo(capsys):
    demo_steps = 2 * -(-20000 // 128)  # demo defaults: 2 QAT epochs of 20k images, batch 128
    path = os.path.join(ROOT, "schedules", "w4a8_progressive.yaml")
    assert cli.main(["schedule", path, "--steps", str(demo_steps)]) == 0
    got = table(capsys.readouterr().out)["W:w8_to_4"]
    assert got[0] == "8" and got[demo_steps] == "4"
    assert [int(got[s]) for s in sorted(got)] == sorted((int(v) for v in got.values()), reverse=True)


def test_schedule_plot_written(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed, so --plot cannot be exercised")
    path = write(tmp_path, "s.yaml", CFG_12_8)
    out = tmp_path / "bits.png"
    assert cli.main(["schedule", path, "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "temporary file left behind"


def test_plot_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = write(tmp_path, "s.yaml", CFG_12_8)
    assert cli.main(["schedule", path, "--plot", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install" in err
    assert not (tmp_path / "x.png").exists()


def test_bad_config_path_exits_nonzero_naming_the_file(tmp_path):
    missing = str(tmp_path / "no_such_schedule.yaml")
    proc = subprocess.run(
        [PY, "-m", "qcompress", "schedule", missing],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode != 0
    assert missing in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_mistake_reported_with_key_path(tmp_path, capsys):
    path = write(tmp_path, "typo.yaml", CFG_12_8.replace("quantization_period", "quantisation_period"))
    assert cli.main(["schedule", path]) == 2
    err = capsys.readouterr().err
    assert "compression_training.weight_quantization.different_groups.wq1.params.quantisation_period" in err
    assert "quantization_period" in err.split("quantisation_period", 2)[-1]  # did-you-mean


def test_no_command_and_unknown_arguments(capsys):
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["schedule", os.path.join(ROOT, "schedules", "w8a8.yaml"), "--bogus"])
    assert exc.value.code == 2


def test_train_bad_config_fails_before_training(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")
    assert (
        cli.main(
            [
                "train",
                missing,
                "--model",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--task",
                "text-classification",
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert missing in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_names_its_required_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", os.path.join(ROOT, "schedules", "w8a8.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "--data" in err and "--task" in err and "--out" in err


def test_export_and_inspect_report_a_missing_export_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "qcompress.export.cli", None)
    monkeypatch.setitem(sys.modules, "qcompress.export", None)
    assert cli.main(["export", "--model", "m:f", "--config", "c.yaml", "--out", "o"]) == 1
    assert "export module is not available" in capsys.readouterr().err
    assert cli.main(["inspect", "somewhere"]) == 1
    assert "export module is not available" in capsys.readouterr().err


def test_bench_without_benchmarks_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "SOURCE_ROOT", str(tmp_path))
    assert cli.main(["bench"]) == 1
    assert os.path.join(str(tmp_path), "benchmarks", "kernels.py") in capsys.readouterr().err


def test_bench_runs_the_script_with_arguments(monkeypatch, tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "kernels.py").write_text(
        "import sys\nprint('bench args', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n"
    )
    monkeypatch.setattr(cli, "SOURCE_ROOT", str(tmp_path))
    assert cli.main(["bench", "--quick"]) == 0
    assert "bench args ['--quick']" in capsys.readouterr().out
    assert cli.main(["bench", "--fail"]) == 3


@pytest.mark.parametrize(
    "flag, value", [("--lr", "-1"), ("--lr", "nan"), ("--epochs", "inf"), ("--threads", "-2"), ("--threads", "0")]
)
def test_train_bad_numbers_exit_2_before_anything(tmp_path, capsys, flag, value):
    """Options torch would refuse only later (AdamW's lr, after the FP32 stages; set_num_threads) or
    never (--epochs inf overflowed the step count) are one line and exit status 2 up front."""
    import torch

    threads = torch.get_num_threads()
    assert (
        cli.main(
            [
                "train",
                os.path.join(ROOT, "schedules", "w8a8.yaml"),
                "--model",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--task",
                "text-classification",
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
                flag,
                value,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()
    assert torch.get_num_threads() == threads


def test_train_text_and_label_column_must_differ(tmp_path, capsys):
    """--label-column text (with --text-column text): the label was read as the text."""
    assert (
        cli.main(
            [
                "train",
                os.path.join(ROOT, "schedules", "w8a8.yaml"),
                "--model",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--task",
                "text-classification",
                "--out",
                str(tmp_path / "out"),
                "--label-column",
                "text",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "--text-column and --label-column" in err and "'text'" in err and "\n" not in err
    assert not (tmp_path / "out").exists()
