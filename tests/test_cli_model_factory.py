"""`qcompress export --model module:factory`: the console script finds a factory module in the current
directory, and a wrong module, factory or return value is a one-line error naming it (exit 2)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import qcompress
from qcompress import cli
from qcompress.export import load_quantized

SCRIPT = os.path.join(os.path.dirname(sys.executable), "qcompress")

CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                    "modules": ["0", "2"],
                }
            },
        }
    }
}

FACTORY = (
    "import torch, torch.nn as nn\n"
    "NOT_CALLABLE = 3\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.5), nn.Linear(16, 4))\n"
    "def build_dict():\n"
    "    return {}\n"
)


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
    run = subprocess.run(
        [
            SCRIPT,
            "export",
            "--model",
            "mymodels:build",
            "--weights",
            "w.safetensors",
            "--config",
            "cfg.json",
            "--out",
            "out",
        ],
        cwd=work,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    # oracle: the same weights compressed in this process, in eval mode (dropout off)
    ref = qcompress.init_compression(_net(), qcompress.load_config(CFG)).eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(load_quantized(work / "out", _net())(x), ref(x))
    # a misspelt factory: a one-line error naming it, status 2, no traceback
    run = subprocess.run(
        [SCRIPT, "export", "--model", "mymodels:biuld", "--config", "cfg.json", "--out", "out2"],
        cwd=work,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("qcompress export: error: --model mymodels:biuld: module 'mymodels'")
    assert "no attribute 'biuld'" in run.stderr and "did you mean 'build'" in run.stderr
    assert "Traceback" not in run.stderr and not (work / "out2").exists()


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "nosuchmodule_qc:build",
            "--model nosuchmodule_qc:build: no module named 'nosuchmodule_qc' (looked in the current directory",
        ),
        (
            "qc_fix_models:NOT_CALLABLE",
            "--model qc_fix_models:NOT_CALLABLE: qc_fix_models.NOT_CALLABLE is a int, not a callable",
        ),
        (
            "qc_fix_models:build_dict",
            "--model qc_fix_models:build_dict: the factory returned a dict, not a torch.nn.Module",
        ),
        ("qc_fix_models", "--model must look like 'package.module:function', got 'qc_fix_models'"),
    ],
)
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
    assert sys.path == path_before  # the current directory was on sys.path only for the import


def test_missing_dependency_inside_the_factory_module_keeps_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "qc_fix_broken.py").write_text("import qc_no_such_dependency\ndef build():\n    pass\n")
    (tmp_path / "cfg.json").write_text(json.dumps(CFG))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="qc_no_such_dependency"):
        cli.main(["export", "--model", "qc_fix_broken:build", "--config", "cfg.json", "--out", "out"])
