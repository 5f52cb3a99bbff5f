"""The C++ build says what it compiles before it starts (pip runs it quietly for minutes):
`python csrc/build.py`, which `make build` runs first, names the extension and every source."""

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_build_lists_its_sources():
    proc = subprocess.run(
        [sys.executable, os.path.join("csrc", "build.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, QCOMPRESS_CUDA="0"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    if "no C++ extension is built" in out:
        print(f"no compiler here: {out.strip()}")
        return
    assert "qcompress._C" in out and "CPU kernels" in out
    sources = ["csrc/ops.cpp", "csrc/autograd.cpp"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
    )
    for src in sources:
        assert f"  {src}" in out, src
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert "csrc/build.py" in makefile[makefile.index("$(BUILD_STAMP):") : makefile.index("build: $(BUILD_STAMP)")]
