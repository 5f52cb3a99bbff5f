"""Host (Python + dispatch) cost of a compress-aware layer: forward + backward of a stack of small
Linears whose arithmetic is negligible, so the time is what each framework spends per layer call
outside the math. On a GPU this cost is what can keep a small QAT step CPU-bound (benchmarks/results/gpu.md);
here it is measured on the CPU, where it is the same Python and dispatch.

    nice -n 10 .venv/bin/python benchmarks/experiments/host_overhead.py [--layers 32] [--width 128] [--tokens 8]
        [--rounds 15] [--reps 20] [--variants ...] [--threads 1]

Model: --layers x nn.Linear(width, width), input [2, tokens / 2, width]; one step = forward +
backward (no optimizer step: it costs every variant the same). Variants as benchmarks/train_step.py
names them (qcompress recipes with `modules` set to the Linears; DeepSpeed and torchao when
installed, `make bench-peers`). All variants live in this process and take turns round by round;
per-layer time = median step time / layers, and its ratio to FP32's from the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import train_step  # noqa: E402  (the recipes and the peers' set-up)

DEFAULT = "fp32,qc_w8a8_float,qc_w4a8_float,qc_w4,qc_w8a8,ds_w8a8,ao_w8a8"


def setup(variant, layers, width, tokens):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    framework, recipe = train_step.VARIANTS[variant]
    apply = {
        "fp32": lambda m, r: None,
        "qcompress": train_step.apply_qcompress,
        "deepspeed": train_step.apply_deepspeed,
        "torchao": train_step.apply_torchao,
    }[framework]
    apply(model, recipe)
    x = torch.randn(2, max(1, tokens // 2), width)

    def step():
        model(x).sum().backward()

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20, help="steps per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=DEFAULT)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    steps, errors = {}, {}
    for v in a.variants.split(","):
        try:
            steps[v] = setup(v, a.layers, a.width, a.tokens)
            steps[v]()
        except Exception as exc:  # noqa: BLE001 - a peer that is missing or fails is reported
            errors[v] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            steps.pop(v, None)
    times = {v: [] for v in steps}
    for _ in range(a.rounds):
        for v, step in steps.items():
            t = time.perf_counter()
            for _ in range(a.reps):
                step()
            times[v].append((time.perf_counter() - t) / a.reps)
    print(
        f"torch {torch.__version__}, {a.threads} thread(s); {a.layers} x Linear({a.width}, {a.width}), "
        f"{a.tokens} tokens; forward + backward, median of {a.rounds} rounds of {a.reps} steps"
    )
    print("| variant | us per layer | x FP32 |")
    print("|---|---:|---:|")
    per = {v: statistics.median(t) / a.layers * 1e6 for v, t in times.items()}
    base = per.get("fp32")
    for v, us in per.items():
        ratio = f"{us / base:.2f}" if base else "–"
        print(f"| {train_step.LABELS.get(v, v)} | {us:.1f} | {ratio} |")
    for v, err in errors.items():
        print(f"| {train_step.LABELS.get(v, v)} | failed: {err} | |")


if __name__ == "__main__":
    main()
