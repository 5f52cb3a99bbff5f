"""What every benchmark shares: the machine header, interleaved timing, and writing one generated
section of a results page atomically.

    import common
    t = common.interleaved({"fp32": step_fp32, "qat": step_qat}, repeats=7)
    text = f"QAT / FP32 step: {common.ratio(t, 'qat', 'fp32')}\n"        # median [min-max] of the per-round ratios
    common.write_section("train_step", "tiny-mlp", text, title="QAT training step")
    # -> benchmarks/results/train_step.md, section "tiny-mlp" between its generated markers,
    #    opened by the machine header (commit, date, CPU, ISA, threads, the exact command)

Each section is written between `<!-- generated: KEY -->` and `<!-- /generated: KEY -->`; text
outside the markers (hand-written notes) and the other sections stay as they are. The page's file is
replaced in one rename, never half-written.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS_DIR = os.path.join(HERE, "results")
# the tracked folders whose local changes would change a figure (the header names them)
_CODE_DIRS = ("qcompress/", "csrc/", "benchmarks/", "model_zoo/", "schedules/", "setup.py")
# environment variables that change which kernels run
_ENV_KEYS = ("ATEN_CPU_CAPABILITY", "QCOMPRESS_LOWBIT_ISA", "OMP_NUM_THREADS", "QCOMPRESS_CPU_CACHE_MB")


# --- the machine header ---------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """`abc1234`, or `abc1234 (dirty: qcompress/, csrc/)` when tracked code has local changes."""
    head = _git("rev-parse", "--short=10", "HEAD") or "unknown"
    changed = {line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()}
    dirty = sorted({d for d in _CODE_DIRS for p in changed if p.startswith(d)})
    return f"{head} (dirty: {', '.join(dirty)})" if dirty else head


_START = []  # the commit when this process imported common: the code a long run measured


def started_at() -> str:
    """commit() as it was when the run started; `(HEAD ... when written)` added if it moved since."""
    now = commit()
    return now if _START[0] == now else f"{_START[0]} (HEAD {now} when written)"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa() -> str:
    """What torch's CPU kernels and the qcompress extension's low-bit kernels dispatch to."""
    import torch

    out = f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
    try:
        from qcompress.quant import lowbit

        ext = f"extension {lowbit.isa()}" if lowbit.available() else "extension not loaded"
    except Exception as e:  # a broken build is a fact of the run, not a reason to lose the page
        ext = f"extension unavailable ({type(e).__name__})"
    return f"{out}, {ext}"


# options that only copy the raw numbers to a file of the machine that ran it: left out of the
# page's command (they change no figure, and the path means nothing elsewhere)
_OUTPUT_ONLY = ("--json",)


def command(argv: Optional[List[str]] = None) -> str:
    """The command line, with the environment variables that pick kernels or threads (without
    the output-only options: _OUTPUT_ONLY)."""
    argv = list(sys.argv if argv is None else argv)
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _OUTPUT_ONLY:
            skip = True
            continue
        if a.split("=", 1)[0] in _OUTPUT_ONLY and "=" in a:
            continue
        kept.append(a)
    argv = kept
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv and argv[0].endswith(".py") else argv[0]
    env = [f"{k}={os.environ[k]}" for k in _ENV_KEYS if k in os.environ]
    return " ".join(env + [".venv/bin/python", shlex.quote(script)] + [shlex.quote(a) for a in argv[1:]])


def machine_header(cmd: Optional[str] = None) -> str:
    """Two quoted lines: what produced the figures below, and where."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"> `{cmd or command()}` at commit {started_at()}, {now}.\n"
        f"> {cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; {isa()}; "
        f"1-min load average {load:.1f} at the end.\n"
    )


# --- timing ---------------------------------------------------------------------------------------


class Timing(NamedTuple):
    """Seconds per call over the repeats: the median, the fastest and the slowest."""

    median: float
    lo: float
    hi: float
    samples: tuple

    def ms(self, digits: int = 2) -> str:
        return f"{self.median * 1e3:.{digits}f} [{self.lo * 1e3:.{digits}f}-{self.hi * 1e3:.{digits}f}]"


def interleaved(
    fns: Dict[str, Callable[[], object]],
    repeats: int = 7,
    per_repeat: int = 1,
    warmup: int = 1,
    sync: Optional[Callable[[], object]] = None,
) -> Dict[str, Timing]:
    """Time every callable once per round, round after round, so a load spike from another job hits
    every variant alike. `per_repeat` calls make one sample (for calls shorter than a millisecond);
    `sync` runs before each clock read (e.g. torch.cuda.synchronize)."""
    done = sync or (lambda: None)
    for f in fns.values():
        for _ in range(warmup):
            f()
    done()
    samples: Dict[str, list] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(per_repeat):
                f()
            done()
            samples[name].append((time.perf_counter() - t) / per_repeat)
    return {n: Timing(statistics.median(v), min(v), max(v), tuple(v)) for n, v in samples.items()}


def ratio(times: Dict[str, Timing], num: str, den: str, digits: int = 2) -> str:
    """`1.07x [1.02-1.15]`: the median of the per-round ratios num / den, and their range. Ratios of
    one round were measured seconds apart, so they cancel most of a shared machine's drift."""
    r = sorted(a / b for a, b in zip(times[num].samples, times[den].samples))
    return f"{statistics.median(r):.{digits}f}x [{r[0]:.{digits}f}-{r[-1]:.{digits}f}]"


def ratio_value(times: Dict[str, Timing], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(times[num].samples, times[den].samples))


# --- results pages --------------------------------------------------------------------------------


def atomic_write(path: str, text: str) -> None:
    """Write through a temporary file in the same folder and one rename (qcompress's own writer)."""
    from qcompress.train.report import atomic_write as write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write(path, text)


def page_path(page: str) -> str:
    """`kernels` -> benchmarks/results/kernels.md; a path ending in .md is used as given."""
    return page if page.endswith(".md") else os.path.join(RESULTS_DIR, f"{page}.md")


def _markers(key: str):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        raise ValueError(f"section key {key!r}: use letters, digits, '_', '-' or '.'")
    return f"<!-- generated: {key} -->", f"<!-- /generated: {key} -->"


def replace_section(old: str, key: str, body: str) -> str:
    """`old` with section `key` replaced by `body` (appended when absent); the rest kept byte for byte."""
    start, end = _markers(key)
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pat.search(old):
        return pat.sub(lambda _: block, old, count=1)
    return old.rstrip("\n") + ("\n\n" if old.strip() else "") + block


def read_section(page: str, key: str) -> Optional[str]:
    """The body of section `key` on `page` as written (header included), or None."""
    path = page_path(page)
    if not os.path.exists(path):
        return None
    start, end = _markers(key)
    m = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), open(path, encoding="utf-8").read(), re.S)
    return m.group(1) if m else None


def write_section(
    page: str, key: str, text: str, title: Optional[str] = None, cmd: Optional[str] = None, header: bool = True
) -> str:
    """Replace section `key` of results page `page` with the machine header and `text`; a new page
    starts with `# title`. Returns the page's path."""
    path = page_path(page)
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else f"# {title or page}\n"
    body = (machine_header(cmd) + "\n" if header else "") + text
    atomic_write(path, replace_section(old, key, body))
    return path


_START.append(commit())
