"""The Makefile's install stamps: a second `make test` goes straight to pytest, and only an edited
kernel or setup.py re-runs the build or the dependency install (checked with `make -n`)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_second_make_test_goes_straight_to_pytest(tmp_path):
    # the real Makefile over a stand-in checkout whose venv is already installed and built
    work = tmp_path / "repo"
    (work / "csrc" / "cpu").mkdir(parents=True)
    (work / "csrc" / "__pycache__").mkdir()
    (work / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "Makefile"), work / "Makefile")
    files = {
        "setup.py": 0,
        "Makefile": 0,
        "csrc/cpu/k.cpp": 0,
        "csrc/build.py": 0,
        ".venv/bin/python": 0,
        ".venv/.deps-stamp": 10,
        ".venv/.workloads-stamp": 20,
        ".venv/.build-stamp": 30,
    }
    t0 = 1_700_000_000
    for name, dt in files.items():
        path = work / name
        if not path.exists():
            path.write_text("")
        os.utime(path, (t0 + dt, t0 + dt))

    def dry():
        return subprocess.run(
            ["make", "-n", "test"], cwd=work, capture_output=True, text=True, timeout=60, check=True
        ).stdout

    first = dry()
    assert "pip" not in first and "-m pytest" in first, first
    assert dry() == first  # and again: nothing left to do
    (work / "csrc" / "__pycache__" / "build.cpython-311.pyc").write_text("")  # a build leaves it
    assert "pip" not in dry()
    os.utime(work / "csrc" / "cpu" / "k.cpp", (t0 + 40, t0 + 40))  # a kernel edited
    rebuilt = dry()
    assert "--no-deps -e ." in rebuilt and "torch==" not in rebuilt and "-m pytest" in rebuilt
    os.utime(work / "setup.py", (t0 + 50, t0 + 50))  # setup.py edited
    assert "torch==2.13.0" in dry() and "-e ." in dry()
