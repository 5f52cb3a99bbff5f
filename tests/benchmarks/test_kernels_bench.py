"""benchmarks/kernels.py (`qcompress bench`): it prints its tables and writes RESULTS.md only when
asked with --write-results. Its measuring child is replaced by canned rows."""

import importlib.util
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kernels_module(tmp_path, monkeypatch):
    """benchmarks/kernels.py with its measuring child replaced by canned rows and its RESULTS.md
    in tmp_path."""
    spec = importlib.util.spec_from_file_location("qc_bench_kernels", os.path.join(ROOT, "benchmarks", "kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [
        dict(c, copy=1e-3, clone=2e-3, torch_op=None, ours=1e-3, ours_fb=2e-3, ref=None, ref_fb=None)
        for c in mod._configs(False)
    ]

    real_run = subprocess.run

    def fake_child(cmd, **kw):
        if "--out" not in cmd:  # the machine header's git calls run for real
            return real_run(cmd, **kw)
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump(rows, f)

    monkeypatch.setattr(mod.subprocess, "run", fake_child)
    monkeypatch.setattr(mod.common, "RESULTS_DIR", str(tmp_path))
    return mod


def test_bench_prints_only_unless_asked_to_write_results(tmp_path, monkeypatch, capsys):
    mod = _kernels_module(tmp_path, monkeypatch)
    results = tmp_path / "kernels.md"
    mod.main([])
    assert not results.exists()
    out = capsys.readouterr().out
    assert mod.HEADER in out and "left as it was" in out  # the rows come from the child's stdout
    mod.main(["--no-write"])  # the old flag: accepted, same behaviour
    assert not results.exists()
    results.write_text("# Kernels\n\n<!-- generated: quantizers -->\nold\n<!-- /generated: quantizers -->\n\nkept\n")
    mod.main(["--write-results"])
    text = results.read_text()
    assert "old" not in text and text.endswith("\n\nkept\n") and "| 16M | float32 | int8 |" in text
    assert "benchmarks/kernels.py --write-results`" in text  # the machine header names the command
    with pytest.raises(SystemExit):
        mod.main(["--write-results", "--no-write"])
    assert "contradict" in capsys.readouterr().err
