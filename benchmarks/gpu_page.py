"""Render benchmarks/results/gpu.md from the figures benchmarks/gpu.py saved (--json) on a GPU.

    .venv/bin/python benchmarks/gpu_page.py [--json benchmarks/gpu_results.json]

No GPU is needed: the page only formats the saved figures. Its header names the machine recorded in
the file and the commit that added the file (git log), since the figures were not measured here.
Kept per table: the latest run that measured it (kernels and steps: the deferred NaN/Inf check;
reload: the weight decoded once for cuBLAS; wider models: their own run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def origin(path: str) -> str:
    """'<hash> (<date>)' of the last commit that changed the figures file."""
    rel = os.path.relpath(path, common.ROOT)
    line = common._git("log", "-1", "--format=%h %ad", "--date=format:%Y-%m-%d %H:%M UTC", "--", rel)
    return line.replace(" ", " (", 1) + ")" if line else "not committed"


def latest(runs: dict, key: str, pick=None) -> tuple:
    """(run name, rows) of the last run (in name order) holding `key` rows that `pick` accepts."""
    for name in sorted(runs, reverse=True):
        rows = [r for r in runs[name].get(key, []) if pick is None or pick(r)]
        if rows:
            return name, rows
    return None, []


def md_table(head: list, rows: list) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join("-" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def render(doc: dict, path: str) -> str:
    runs = {k: v for k, v in doc.items() if isinstance(v, dict)}
    any_run = next(iter(runs.values()))
    parts = [
        f"> Figures from `benchmarks/gpu.py --json` on {any_run['device']}, torch {any_run['torch']}; "
        f"the file `{os.path.relpath(path, common.ROOT)}` was added in commit {origin(path)}, and the "
        "runs were measured just before that commit. Not re-run at later commits (no GPU "
        "since); rendered by `.venv/bin/python benchmarks/gpu_page.py`.",
        "",
    ]
    _, steps = latest(runs, "steps", lambda r: r["model"] in ("bert", "llama"))
    if steps:
        parts += [
            "## QAT step vs FP32 (6 x 384 models)",
            "",
            "Forward + backward + AdamW, median of CUDA-event times, variants interleaved step by step; "
            "step peak = the step's allocation peak beyond the weights and optimizer state.",
            "",
            md_table(
                ["model", "math", "variant", "ms", "vs FP32", "step peak MiB", "peak vs FP32"],
                [
                    (
                        r["model"],
                        r["autocast"],
                        r["variant"],
                        f"{r['ms']:.2f}",
                        f"{r['vs_fp32']:.3f}",
                        f"{r['step_peak_mib']:.0f}",
                        f"{r['step_peak_vs_fp32']:.3f}",
                    )
                    for r in steps
                ],
            ),
            "",
        ]
    _, wide = latest(runs, "steps", lambda r: r["model"] not in ("bert", "llama"))
    if wide:
        parts += [
            "## QAT step vs FP32, wider models",
            "",
            md_table(
                ["model", "math", "variant", "ms", "vs FP32", "step peak MiB", "peak vs FP32"],
                [
                    (
                        r["model"],
                        r["autocast"],
                        r["variant"],
                        f"{r['ms']:.2f}",
                        f"{r['vs_fp32']:.3f}",
                        f"{r['step_peak_mib']:.0f}",
                        f"{r['step_peak_vs_fp32']:.3f}",
                    )
                    for r in wide
                ],
            ),
            "",
        ]
    _, kern = latest(runs, "kernels")
    if kern:
        parts += [
            "## Fake quantization vs a device copy",
            "",
            md_table(
                ["dtype", "op", "elements", "ms", "copy ms", "copy / op", "torch fake_quantize ms"],
                [
                    (
                        r["dtype"],
                        r["op"],
                        f"{r['elements'] >> 20}M",
                        f"{r['ms']:.3f}",
                        f"{r['copy_ms']:.3f}",
                        f"{r['copy_time_over_op_time']:.3f}",
                        f"{r['torch_fake_quantize_ms']:.3f}" if r.get("torch_fake_quantize_ms") else None,
                    )
                    for r in kern
                ],
            ),
            "",
        ]
    _, rel = latest(runs, "reload")
    if rel:
        parts += [
            "## Exported layer reloads vs the dense layer",
            "",
            "exact = dequantize in every forward; fast = the weight decoded once for cuBLAS; cuda kernels "
            "= the CUDA low-bit kernels. Ratios: time over the dense layer's (lower is faster).",
            "",
            md_table(
                ["recipe", "tokens", "dtype", "dense ms", "exact / dense", "fast / dense", "cuda kernels / dense"],
                [
                    (
                        r["recipe"],
                        r["tokens"],
                        r["dtype"],
                        f"{r['dense_ms']:.4f}",
                        f"{r['exact_over_dense']:.2f}",
                        f"{r['fast_over_dense']:.2f}",
                        f"{r['cuda_kernels_over_dense']:.2f}" if r.get("cuda_kernels_over_dense") else None,
                    )
                    for r in rel
                ],
            ),
            "",
        ]
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=os.path.join(HERE, "gpu_results.json"))
    a = p.parse_args(argv)
    with open(a.json, encoding="utf-8") as fh:
        doc = json.load(fh)
    path = common.write_section("gpu", "h100", render(doc, a.json), title="On a GPU", header=False)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
