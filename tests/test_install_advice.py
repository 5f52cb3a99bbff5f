"""Install advice names the checkout, not the PyPI package called qcompress (an unrelated project):
no file of the repository advises installing `qcompress[...]` from PyPI, and the messages of a missing optional
part say `pip install -e ".[hf]"` / `".[plot]"`."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRONG = re.compile(r"pip install\s+['\"]?qcompress\[")


def _texts():
    for folder in ("qcompress", "docs", "tests", "benchmarks", "model_zoo", "schedules"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith((".py", ".md", ".yaml", ".sh")):
                    yield os.path.join(base, f)
    yield os.path.join(ROOT, "README.md")
    yield os.path.join(ROOT, "Makefile")
    yield os.path.join(ROOT, "setup.py")


def test_no_file_advises_the_unrelated_pypi_package():
    found = []
    for path in _texts():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if WRONG.search(line):
                    found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, found


@pytest.mark.parametrize(
    "what,code,extra",
    [
        ("train", "from qcompress.train.models import _transformers\n_transformers()", "hf"),
        ("hf", "import qcompress.hf", "hf"),
        ("plot", "from qcompress.cli import main\nmain(['schedule', 'w8a8', '--plot', 'x.png'])", "plot"),
    ],
)
def test_missing_parts_say_how_to_install_them_from_the_checkout(tmp_path, what, code, extra):
    blocked = "transformers" if extra == "hf" else "matplotlib"
    script = (
        f"import sys\nsys.modules[{blocked!r}] = None\n"
        f"try:\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "except SystemExit as e:\n    print('EXIT', e.code)\n"
        + "except Exception as e:\n    print('ERR', e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    said = res.stdout + res.stderr
    assert f'pip install -e ".[{extra}]"' in said, said[-2000:]
    assert "qcompress[" not in said
