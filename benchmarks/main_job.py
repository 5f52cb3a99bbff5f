"""Full-size main-job runs: all-MiniLM-L6-v2 fine-tuned on BBC News (80/20 seeded split, 1 epoch,
max length 128, batch 32), with each recipe through `qcompress train`, side by side against one FP32
fine-tune of the same budget (the first run's --baseline; the others reuse it with --baseline-from).

    python benchmarks/main_job.py [--out runs/main_job] [--write-results]

Prints the quality table (accuracy after training, PTQ, the reloaded export, transformers' load,
size vs FP32, training time vs FP32); --write-results replaces its section of
benchmarks/results/quality.md. Needs the packaged workloads (`make workloads`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from model_zoo.demo_bbc import workloads  # noqa: E402

RECIPES = [  # (name, config files, target in points below the FP32 fine-tune)
    ("W8A8", ["schedules/w8a8.yaml"], 0.3),
    ("W4A8 g128", ["schedules/w4a8_g128.yaml"], 1.0),
    ("ternary W2A8 + distillation", ["schedules/w2a8_kd.yaml"], 3.0),
]


def run(name, cfgs, out, model, data, baseline_from, a) -> dict:
    from qcompress.cli import main as qcompress_main

    args = [
        *(os.path.join(ROOT, c) for c in cfgs),
        "--model",
        model,
        "--data",
        data,
        "--task",
        "text-classification",
        "--out",
        out,
        "--max-length",
        str(a.max_length),
        "--batch-size",
        str(a.batch_size),
        "--epochs",
        "1",
        "--seed",
        str(a.seed),
        "--save-steps",
        "0",
        "--overwrite",
        "--no-progress",
    ]
    args += ["--baseline-from", baseline_from] if baseline_from else ["--baseline"]
    print(f"=== {name}: qcompress train {' '.join(args)}", flush=True)
    if qcompress_main(["train", *args]):
        raise SystemExit(f"{name} failed")
    with open(os.path.join(out, "report.json"), encoding="utf-8") as fh:
        return json.load(fh)


def step_times(model_dir: str, data_dir: str, a, rounds: int = 3, steps: int = 3) -> dict:
    """Median training-step time of FP32 and of each recipe on the same batch (32 BBC articles, max
    length 128), measured interleaved in one process so machine load hits them alike."""
    import copy
    import statistics

    import torch
    import qcompress as qc
    from qcompress.train.data import prepare_data
    from qcompress.train.distill import Distiller, load_teacher
    from qcompress.train.models import load_model, load_tokenizer
    from qcompress.train.data import collate

    tok = load_tokenizer(model_dir)
    data = prepare_data(
        "text-classification",
        data_dir,
        tok,
        max_length=a.max_length,
        seed=a.seed,
        max_train_samples=a.batch_size,
        max_eval_samples=1,
    )
    batch = collate([data.train[i] for i in range(len(data.train))], tok.pad_token_id)
    base = load_model(model_dir, "text-classification", data.labels, a.seed)
    setups = {"FP32": (copy.deepcopy(base), None)}
    for name, cfgs, _ in RECIPES:
        cfg = qc.load_config(*(os.path.join(ROOT, c) for c in cfgs))
        model = copy.deepcopy(base)
        kd = None
        if cfg.compression.distillation.enabled:
            kd = Distiller.from_config(cfg, load_teacher("self", base, None))
        qc.init_compression(model, cfg)
        setups[name] = (model, kd)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-5) for n, (m, _) in setups.items()}
    times = {n: [] for n in setups}

    def step(name):
        model, kd = setups[name]
        model.train()
        t0 = time.perf_counter()
        out = model(**batch)
        loss = out.loss
        if kd is not None:
            loss = kd.loss(out, kd.teacher_outputs(batch), out.loss)[0]
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for n in setups:
        step(n)  # warm-up
    for _ in range(rounds):
        for n in setups:
            times[n] += [step(n) for _ in range(steps)]
    return {n: statistics.median(v) for n, v in times.items()}


def table(results, times=None) -> str:
    fp = results[0][1]["stages"]["fp32_finetuned"]["accuracy"]
    times = times or {}
    lines = [
        "| recipe | accuracy after training | Δ vs FP32 (target) | PTQ | reloaded export | transformers | "
        "export size | vs FP32 size | step time vs FP32 |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| FP32 fine-tune (same budget) | {fp:.4f} | — | — | — | — | "
        f"{results[0][1]['sizes']['fp32_bytes'] / 2**20:.1f} MiB | 1.00x | "
        f"{'1.00 (%.2f s/step)' % times['FP32'] if 'FP32' in times else '—'} |",
    ]
    for name, rep, target in results:
        st, sz = rep["stages"], rep["sizes"]
        q = st["qat"]["accuracy"]
        d = (q - fp) * 100
        tr = st.get("transformers") or {}
        tr_txt = f"{tr['accuracy']:.4f}" if tr.get("accuracy") is not None else "not loadable"
        ok = "met" if -d <= target else "missed"
        lines.append(
            f"| {name} | {q:.4f} | {d:+.2f} pts (≤ {target} pts: {ok}) | {st['ptq']['accuracy']:.4f} | "
            f"{st['exported']['accuracy']:.4f} | {tr_txt} | {sz['export_bytes'] / 2**20:.1f} MiB | "
            f"{sz['fp32_bytes'] / sz['export_bytes']:.2f}x smaller | "
            f"{'%.2f' % (times[name] / times['FP32']) if name in times else '—'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "main_job"))
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reuse-runs",
        action="store_true",
        help="read the reports of an earlier run in --out; only measure the step times",
    )
    p.add_argument("--write-results", action="store_true", help="replace its section of benchmarks/results/quality.md")
    a = p.parse_args(argv)
    model, data = workloads()
    results, first = [], None
    for name, cfgs, target in RECIPES:
        out = os.path.join(a.out, re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_"))
        if a.reuse_runs:
            with open(os.path.join(out, "report.json"), encoding="utf-8") as fh:
                rep = json.load(fh)
        else:
            rep = run(name, cfgs, out, model, data, first, a)
        first = first or out
        results.append((name, rep, target))
    times = step_times(model, data, a)
    import torch

    section = (
        "## Main job: all-MiniLM-L6-v2 on BBC News (`benchmarks/main_job.py`)\n\n"
        f"One epoch of the 1,780-article training split (80/20, seed {a.seed}), max length {a.max_length}, "
        f"batch {a.batch_size} ({results[0][1]['training']['steps']} steps), AdamW 1e-4, accuracy on the "
        f"445 held-out articles; {torch.get_num_threads()} threads, CPU. Every row is one `qcompress train` "
        "run (commands printed by the script); the FP32 "
        "fine-tune is the first run's `--baseline`, which the others reuse (`--baseline-from`). "
        "Step time: median of 9 training steps (forward, backward, AdamW; the teacher's forward "
        "included for distillation) on the same 32 articles, the configurations interleaved in one "
        "process after the runs, so machine load hits them alike (the runs' own wall times are in "
        "each report.json but were taken on a machine shared with other jobs).\n\n" + table(results, times) + "\n"
    )
    print("\n" + section)
    if a.write_results:
        sys.path.insert(0, HERE)
        import common

        print(f"written to {common.write_section('quality', 'main-job', section, title='Compression quality')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
