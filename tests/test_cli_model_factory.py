"""Small usability fixes: the console script finds a --model factory in the current directory
and names a wrong one; config.json names the exported class; load_quantized returns an eval-mode
model; `qcompress bench` writes RESULTS.md only when asked; the Makefile's build step has a stamp."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import qcompress
from qcompress import cli
from qcompress.export import export_quantized, load_quantized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "qcompress")

CFG = {"compression_training": {"weight_quantization": {
    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
    "different_groups": {"wq1": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "group",
                                            "group_size": 16}, "modules": ["0", "2"]}}}}}

FACTORY = ("import torch, torch.nn as nn\n"
           "NOT_CALLABLE = 3\n"
           "def build():\n"
           "    torch.manual_seed(0)\n"
           "    return nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.5), nn.Linear(16, 4))\n"
           "def build_dict():\n"
           "    return {}\n")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.5), nn.Linear(16, 4))


def _workdir(tmp_path, module):
    (tmp_path / f"{module}.py").write_text(FACTORY)
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    save_file(_net().state_dict(), str(tmp_path / "w.safetensors"))
    return tmp_path


def _script_env():
    # as a user runs it: no PYTHONPATH pointing at the checkout or the tmp folder
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.skipif(not os.path.exists(SCRIPT), reason=f"no console script at {SCRIPT} (pip install -e .)")
def test_console_script_imports_a_factory_from_the_current_directory(tmp_path):
    work = _workdir(tmp_path, "mymodels")
    run = subprocess.run([SCRIPT, "export", "--model", "mymodels:build", "--weights", "w.safetensors",
                          "--config", "cfg.json", "--out", "out"], cwd=work, env=_script_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # oracle: the same weights compressed in this process, in eval mode (dropout off)
    ref = qcompress.init_compression(_net(), qcompress.load_config(CFG)).eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(load_quantized(work / "out", _net())(x), ref(x))
    # a misspelt factory: a one-line error naming it, status 2, no traceback
    run = subprocess.run([SCRIPT, "export", "--model", "mymodels:biuld", "--config", "cfg.json",
                          "--out", "out2"], cwd=work, env=_script_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("qcompress export: error: --model mymodels:biuld: module 'mymodels'")
    assert "no attribute 'biuld'" in run.stderr and "did you mean 'build'" in run.stderr
    assert "Traceback" not in run.stderr and not (work / "out2").exists()


@pytest.mark.parametrize("spec,message", [
    ("nosuchmodule_qc:build", "--model nosuchmodule_qc:build: no module named 'nosuchmodule_qc' "
                              "(looked in the current directory"),
    ("qc_fix_models:NOT_CALLABLE", "--model qc_fix_models:NOT_CALLABLE: qc_fix_models.NOT_CALLABLE is a "
                                   "int, not a callable"),
    ("qc_fix_models:build_dict", "--model qc_fix_models:build_dict: the factory returned a dict, "
                                 "not a torch.nn.Module"),
    ("qc_fix_models", "--model must look like 'package.module:function', got 'qc_fix_models'"),
])
def test_bad_factory_is_an_error_naming_it(tmp_path, monkeypatch, capsys, spec, message):
    work = _workdir(tmp_path, "qc_fix_models")
    monkeypatch.chdir(work)
    monkeypatch.delitem(sys.modules, "qc_fix_models", raising=False)
    path_before = list(sys.path)
    argv = ["export", "--model", spec, "--config", "cfg.json", "--out", "out"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qcompress export: error: {message}"), err
    assert "Traceback" not in err and not (work / "out").exists()
    assert sys.path == path_before             # the current directory was on sys.path only for the import


def test_missing_dependency_inside_the_factory_module_keeps_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "qc_fix_broken.py").write_text("import qc_no_such_dependency\ndef build():\n    pass\n")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="qc_no_such_dependency"):
        cli.main(["export", "--model", "qc_fix_broken:build", "--config", "cfg.json", "--out", "out"])


def test_config_json_names_the_exported_class_not_the_base_checkpoints(tmp_path):
    hf = pytest.importorskip("tests.helpers.hf_fixtures", reason="transformers is not installed")
    from transformers import AutoConfig, AutoModelForSequenceClassification
    base = hf.tiny_bert_folder(str(tmp_path / "base"))            # saved as a plain BertModel
    assert json.loads((tmp_path / "base" / "config.json").read_text())["architectures"] == ["BertModel"]
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3)
    assert model.config.architectures == ["BertModel"]            # what the old export copied
    cfg = qcompress.load_config({"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["encoder"]}}}}})
    qcompress.init_compression(model, cfg)
    qcompress.redundancy_clean(model, cfg)
    export_quantized(model, tmp_path / "out", cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["BertForSequenceClassification"]
    assert AutoConfig.from_pretrained(tmp_path / "out").architectures == ["BertForSequenceClassification"]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_load_quantized_returns_an_eval_mode_model(tmp_path, mode):
    cfg = qcompress.load_config(CFG)
    model = qcompress.init_compression(_net(), cfg)
    qcompress.redundancy_clean(model, cfg)
    export_quantized(model, tmp_path / "out", cfg)
    fresh = _net().train()
    loaded = load_quantized(tmp_path / "out", fresh, mode=mode)
    assert loaded is fresh and not any(m.training for m in loaded.modules())
    x = torch.randn(4, 32)
    with torch.no_grad():                     # dropout off: two calls agree, and equal the eval model
        assert torch.equal(loaded(x), loaded(x))
        if mode == "exact":
            assert torch.equal(loaded(x), model.eval()(x))


def _kernels_module(tmp_path, monkeypatch):
    """benchmarks/kernels.py with its measuring child replaced by canned rows and its RESULTS.md
    in tmp_path."""
    spec = importlib.util.spec_from_file_location("qc_bench_kernels", os.path.join(ROOT, "benchmarks", "kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [dict(c, copy=1e-3, clone=2e-3, torch_op=None, ours=1e-3, ours_fb=2e-3, ref=None, ref_fb=None)
            for c in mod._configs(False)]

    real_run = subprocess.run

    def fake_child(cmd, **kw):
        if "--out" not in cmd:                   # the machine header's git calls run for real
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
    assert mod.HEADER in out and "left as it was" in out     # the rows come from the child's stdout
    mod.main(["--no-write"])                  # the old flag: accepted, same behaviour
    assert not results.exists()
    results.write_text("# Kernels\n\n<!-- generated: quantizers -->\nold\n<!-- /generated: quantizers -->\n\nkept\n")
    mod.main(["--write-results"])
    text = results.read_text()
    assert "old" not in text and text.endswith("\n\nkept\n") and "| 16M | float32 | int8 |" in text
    assert "benchmarks/kernels.py --write-results`" in text      # the machine header names the command
    with pytest.raises(SystemExit):
        mod.main(["--write-results", "--no-write"])
    assert "contradict" in capsys.readouterr().err


def _make_dry(target, cwd):
    return subprocess.run(["make", "-n", target], cwd=cwd, capture_output=True, text=True, timeout=60).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_second_make_test_goes_straight_to_pytest(tmp_path):
    # the real Makefile over a stand-in checkout whose venv is already installed and built
    work = tmp_path / "repo"
    (work / "csrc" / "cpu").mkdir(parents=True)
    (work / "csrc" / "__pycache__").mkdir()
    (work / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "Makefile"), work / "Makefile")
    files = {"setup.py": 0, "Makefile": 0, "csrc/cpu/k.cpp": 0, "csrc/build.py": 0, ".venv/bin/python": 0,
             ".venv/.deps-stamp": 10, ".venv/.workloads-stamp": 20, ".venv/.build-stamp": 30}
    t0 = 1_700_000_000
    for name, dt in files.items():
        path = work / name
        if not path.exists():
            path.write_text("")
        os.utime(path, (t0 + dt, t0 + dt))

    def dry():
        return subprocess.run(["make", "-n", "test"], cwd=work, capture_output=True, text=True,
                              timeout=60, check=True).stdout

    first = dry()
    assert "pip" not in first and "-m pytest" in first, first
    assert dry() == first                                     # and again: nothing left to do
    (work / "csrc" / "__pycache__" / "build.cpython-311.pyc").write_text("")   # a build leaves it
    assert "pip" not in dry()
    os.utime(work / "csrc" / "cpu" / "k.cpp", (t0 + 40, t0 + 40))            # a kernel edited
    rebuilt = dry()
    assert "--no-deps -e ." in rebuilt and "torch==" not in rebuilt and "-m pytest" in rebuilt
    os.utime(work / "setup.py", (t0 + 50, t0 + 50))                          # setup.py edited
    assert "torch==2.13.0" in dry() and "-e ." in dry()
