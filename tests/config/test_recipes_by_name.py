"""Recipes by name: load_config(train, "w4a8_g128") reads schedules/w4a8_g128.yaml from any
folder, a path that exists still wins, an unknown name lists the recipes, and an installed wheel
carries the recipes (and DeepSpeed's key list) as package data, so the README's quick start runs
in a new folder with no checkout."""

import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

import qcompress as qc
from qcompress.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = os.path.join(ROOT, "schedules")
TRAIN = {"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_a_recipe_loads_by_name_from_any_folder(tmp_path, monkeypatch):
    want = qc.load_config(TRAIN, os.path.join(SCHEDULES, "w4a8_g128.yaml"))
    monkeypatch.chdir(tmp_path)
    for name in ("w4a8_g128", "w4a8_g128.yaml"):
        got = qc.load_config(TRAIN, name)
        assert got == want and got.raw == want.raw, name
    # fragments too, merged in order
    got = qc.load_config(TRAIN, "w4a16_g32", "with_mse_observer")
    assert got.compression.weight_quantization.shared.observer == "mse"


def test_a_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w4a8_g128.yaml").write_text("train_batch_size: 4\n")
    (tmp_path / "w8a8").write_text("train_batch_size: 6\n")
    assert qc.load_config("w4a8_g128.yaml").train_batch_size == 4
    assert qc.load_config("w8a8").train_batch_size == 6
    assert qc.load_config("w4a8_g128").compression.weight_quantization.enabled  # no file: the recipe


def test_an_unknown_name_lists_the_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"^w4a8_g129: no such config file, and no recipe of that name "
        r"\(did you mean 'w4a8_g128'\?\); the recipes .*w8a8_static",
    ):
        qc.load_config(TRAIN, "w4a8_g129")
    # the checkout's relative path from another folder: says to pass the name
    with pytest.raises(
        ConfigError,
        match=r"schedules/w4a8_g128.yaml: no such config file; the recipe "
        r"'w4a8_g128' ships with qcompress: pass its name",
    ):
        qc.load_config(TRAIN, "schedules/w4a8_g128.yaml")
    # any other missing file is named as before
    with pytest.raises(ConfigError, match=r"mine/ds_config.json: cannot read config file"):
        qc.load_config("mine/ds_config.json")


def test_an_old_recipe_name_loads_with_its_deprecation_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(DeprecationWarning, match=re.escape("was renamed to w4a16_g128.yaml")):
        got = qc.load_config("w4_group128")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert got == qc.load_config("w4a16_g128")


def test_a_wheel_carries_the_recipes_and_the_quick_start_runs_in_a_new_folder(tmp_path):
    """Built from a copy of the sources (pure Python, no extension: seconds), installed into a
    folder of its own, and run from another folder: the README's quick start as it is written
    there, twice (the second export overwrites the first with force=True)."""
    pytest.importorskip("wheel", reason="the wheel package is not installed (pip install wheel)")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(ROOT, "setup.py"), src)
    shutil.copytree(
        os.path.join(ROOT, "qcompress"), src / "qcompress", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    shutil.copytree(SCHEDULES, src / "schedules")
    env = dict(os.environ, QCOMPRESS_PURE_PYTHON="1")
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(src)],
        check=True,
        env=env,
        cwd=str(src),
        timeout=300,
    )
    wheel = next((tmp_path / "whl").glob("qcompress-*.whl"))
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True, env=env, timeout=300
    )
    assert (tmp_path / "site" / "qcompress" / "schedules" / "w4a8_g128.yaml").is_file()
    assert (tmp_path / "site" / "qcompress" / "config" / "deepspeed_0_19_keys.json").is_file()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme[readme.index("## Quick start") :]
    quick_start = block[block.index("```python\n") + 10 : block.index("```", block.index("```python\n") + 10)]
    assert 'load_config(train, "w4a8_g128")' in quick_start and "force=True" in quick_start
    built = os.path.join(ROOT, "qcompress", "_C.so")
    if os.path.isfile(built):  # the checkout's kernels, so the 20 steps run at their speed
        shutil.copy(built, tmp_path / "site" / "qcompress")
        env.pop("QCOMPRESS_PURE_PYTHON")
    run_dir = tmp_path / "new_folder"
    run_dir.mkdir()
    env["PYTHONPATH"] = str(tmp_path / "site")
    script = (
        f"import qcompress\nassert qcompress.__file__.startswith({str(tmp_path / 'site')!r})\n"
        + quick_start
        + "\nprint('ok')\n"
    )
    for attempt in range(2):  # a second run overwrites its own output
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, cwd=str(run_dir), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (attempt, proc.stderr[-3000:])
