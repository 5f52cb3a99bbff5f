"""Compression quality per recipe: FP32, PTQ (minmax and mse observers), QAT, QAT + range
learning, QAD + range learning, all with the same step budget, through `qcompress train`.

    python benchmarks/quality.py --task classifier [--train-samples 960 --eval-samples 300]
    python benchmarks/quality.py --task lm --lm runs/gpt2-austen [--max-steps 60]
    ... [--recipes w4_g32,w3_g32] [--out runs/quality] [--write-results]

Workloads: all-MiniLM-L6-v2 fine-tuned on BBC News (accuracy; `make workloads`), and a causal LM
made here (benchmarks/pretrain_gpt2.py: a Hugging Face folder with train.txt and heldout.txt next
to the weights; perplexity on heldout.txt). Per recipe, three `qcompress train` runs share one FP32
baseline (the first run's --baseline, then --baseline-from), each with a fragment merged over the
recipe (written into its run folder):

  qat     observer minmax, no range learning, no distillation -> the PTQ (minmax) and QAT rows
  qat_rl  observer mse, range_learning, no distillation        -> the PTQ (mse) and QAT + RL rows
  qad_rl  observer mse, range_learning, distillation (KL, T 1, alpha 0.9): for the causal LM from
          the pretrained model itself (`teacher: self`, a frozen copy of --lm, as llm-compressor and
          ModelOpt distil from the original model); for the classifier from the FP32 fine-tune
          (`teacher: baseline`: its pretrained checkpoint has a random head)

Float recipes (FP8, NVFP4, MXFP4) run qat and qad (minmax, no range learning, the same distillation)
in place of qat_rl / qad_rl; with --float-rl they run the variants as given, the mse ones with the
plain mse search and range learning for FP8 / NVFP4 scales (MX: mse only). Each row also gives the
export's size over the FP32 model's (the run's sizes: export_bytes / fp32_bytes).

The learned ranges train in qcompress train's default AdamW, in their own group (0.1x the lr, no
weight decay).

The share of the PTQ degradation recovered is (PTQ - method) / (PTQ - FP32) on the metric, with
PTQ the minmax PTQ (the causal LM's target lines also give it against the pretrained checkpoint's
perplexity, the `self` teacher's); it is left out where minmax PTQ is within 0.5 points
(classifier) or 0.2 % (perplexity) worse than FP32, or better. The quality targets are checked
from the rows and listed under each table. Progressive recipes get their drops spread over the run
(linear growth, last drop at 4/5 of the steps). Each finished run is reused unless --rerun (its
report.json; --rerun reruns every run named by --recipes x --variants, and --baseline-from /
the summary's baseline_run lends the FP32 fine-tune only to runs with the same arguments: pass
--lm the same way, the job compares the eval path as given).
--ptq-whole-set (causal LM): also PTQ the borrowed FP32 fine-tune with each recipe's minmax and mse
configs and evaluate it on every held-out block (not only --eval-samples'), in this process with
the job's own steps (quantize_without_training, the job's calibration batches, evaluate); listed as
a separate line under the table, which keeps the runs' `ptq` stage (the table's measure).
--ptq-pretrained (causal LM): the same PTQ of the pretrained checkpoint --lm itself (no fine-tune),
on the first --eval-samples blocks and on all of them; another line under the table.
--write-results replaces this task's section of benchmarks/results/quality.md (its table, the
target lines computed from it, and the --note sentences); text outside the generated sections stays.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import common  # noqa: E402

RECIPES = {  # key: (label, schedule file, progressive)
    "w8a8": ("W8A8", "schedules/w8a8.yaml", False),
    "w4a8_g128": ("W4A8 g128", "schedules/w4a8_g128.yaml", False),
    "w4_g32": ("W4 g32 (weight-only)", "schedules/w4a16_g32.yaml", False),
    "w3_g32": ("W3 g32 (weight-only)", "schedules/w3a16_g32.yaml", False),
    "w2a8_kd": ("ternary W2A8 (+ distillation)", "schedules/w2a8_kd.yaml", False),
    "w8to4": ("progressive W8→4 A8", "schedules/w4a8_progressive.yaml", True),
    "fp8_dynamic": ("FP8 dynamic (e4m3, channel / token)", "schedules/fp8_dynamic.yaml", False),
    "fp8_block": ("FP8 block (e4m3, 128 × 128)", "schedules/fp8_block.yaml", False),
    "nvfp4": ("NVFP4 W4A4", "schedules/nvfp4.yaml", False),
    "nvfp4a16": ("NVFP4A16 (weight-only)", "schedules/nvfp4a16.yaml", False),
    "mxfp4a16": ("MXFP4A16 (weight-only)", "schedules/mxfp4a16.yaml", False),
}
VARIANTS = ("qat", "qat_rl", "qad_rl")
# Float recipes run qat and qad (minmax, distillation) in place of the three variants above, unless
# --float-rl.
FLOAT_RECIPES = ("fp8_dynamic", "fp8_block", "nvfp4", "nvfp4a16", "mxfp4a16")
FLOAT_VARIANTS = {"qat": "qat", "qat_rl": None, "qad_rl": "qad", "qad": "qad"}
# --float-rl: float recipes run the variants as given, with the mse observer's plain search (weight_by
# is for integer grids) and range learning where the format learns its scales; MX scales are E8M0
# powers of two, which a straight-through step never moves (the config refuses it): mse only there.
LEARNED_FLOAT_SCALES = ("fp8_e4m3", "nvfp4")
COLUMNS = ("qat", "qat_rl", "qad", "qad_rl")  # the table's trained columns
OBSERVER_KWARGS = {}  # --observer-kwargs: the mse variants' search (maxshrink, grid, norm, weight_by)
DEFAULT_OBSERVER_KWARGS = '{"weight_by": "inputs"}'  # the mse variants: the input-weighted search


def fragment(variant: str, task: str = "lm", formats=("int",)) -> dict:
    """The variant's overrides. QAD's teacher: the pretrained model itself (`self`) for the causal LM,
    as llm-compressor / ModelOpt distil from the original model; the FP32 fine-tune (`baseline`) for
    the classifier, whose pretrained checkpoint has a random head. `formats`: the recipe's weight
    formats (weight_formats); a float recipe's mse variants take the plain search."""
    mse, distil = variant in ("qat_rl", "qad_rl"), variant in ("qad", "qad_rl")
    floats = set(formats) - {"int"}
    wq = {"observer": "mse" if mse else "minmax", "range_learning": mse and floats <= set(LEARNED_FLOAT_SCALES)}
    if mse and OBSERVER_KWARGS and not floats:
        wq["observer_kwargs"] = dict(OBSERVER_KWARGS)
    doc = {
        "compression_training": {"weight_quantization": {"shared_parameters": wq}, "distillation": {"enabled": distil}}
    }
    if distil:
        doc["compression_training"]["distillation"].update(
            teacher="self" if task == "lm" else "baseline", temperature=1.0, alpha=0.9
        )
    return doc


def progressive_fix(recipe_file: str, steps: int) -> dict:
    """Spread the recipe's bit drops evenly over the run: the last at 4/5 of the steps."""
    import yaml

    with open(os.path.join(ROOT, recipe_file), encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    groups = doc["compression_training"]["weight_quantization"]["different_groups"]
    out = {}
    for name, g in groups.items():
        p = g["params"]
        drops = max(1, p["start_bits"] - p["target_bits"])
        out[name] = {"params": {"quantization_period": max(1, (4 * steps) // (5 * drops)), "period_growth": "linear"}}
    return {"compression_training": {"weight_quantization": {"different_groups": out}}}


def weight_formats(recipe_file: str) -> set:
    """The number formats of a recipe's weight groups (`params.format`, else the shared one, else int;
    a group that steps between formats gives each)."""
    import yaml

    with open(os.path.join(ROOT, recipe_file), encoding="utf-8") as fh:
        wq = yaml.safe_load(fh)["compression_training"]["weight_quantization"]
    shared = (wq.get("shared_parameters") or {}).get("format", "int")
    out = set()
    for g in wq["different_groups"].values():
        f = (g.get("params") or {}).get("format", shared)
        out |= set(f.values()) if isinstance(f, dict) else {f}
    return out


def recipe_variants(key: str, variants, float_rl: bool = False) -> list:
    """The variants a recipe runs: float recipes swap qat_rl / qad_rl for their minmax runs, unless
    float_rl (--float-rl) runs them as given."""
    if key not in FLOAT_RECIPES:
        return [v for v in variants if v != "qad"]
    if float_rl:
        return list(dict.fromkeys(variants))
    return list(dict.fromkeys(FLOAT_VARIANTS[v] for v in variants if FLOAT_VARIANTS[v]))


def write_yaml(path: str, doc: dict) -> str:
    import yaml

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        yaml.safe_dump(doc, fh, sort_keys=False)
    os.replace(tmp, path)
    return path


def task_args(a) -> tuple:
    """(qcompress train arguments for the data and model, metric, higher is better, steps)."""
    if a.task == "classifier":
        from model_zoo.demo_bbc import workloads

        model, data = workloads()
        args = [
            "--model",
            model,
            "--data",
            data,
            "--task",
            "text-classification",
            "--max-length",
            str(a.max_length),
            "--batch-size",
            str(a.batch_size),
            "--epochs",
            "1",
        ]
        if a.train_samples:
            args += ["--max-train-samples", str(a.train_samples)]
        if a.eval_samples:
            args += ["--max-eval-samples", str(a.eval_samples)]
        n = a.train_samples or 1780
        return args, "accuracy", True, math.ceil(n / a.batch_size)
    lm = a.lm
    for f in ("config.json", "train.txt", "heldout.txt"):
        if not os.path.isfile(os.path.join(lm, f)):
            raise SystemExit(f"--lm {lm}: no {f} there (make it with benchmarks/pretrain_gpt2.py)")
    args = [
        "--model",
        lm,
        "--data",
        os.path.join(lm, "train.txt"),
        "--eval-data",
        os.path.join(lm, "heldout.txt"),
        "--task",
        "causal-lm",
        "--max-length",
        str(a.max_length),
        "--batch-size",
        str(a.batch_size),
        "--max-steps",
        str(a.max_steps),
        "--lr",
        str(a.lr),
    ]
    if a.eval_samples:
        args += ["--max-eval-samples", str(a.eval_samples)]
    return args, "perplexity", False, a.max_steps


def run_one(out: str, configs, base_args, baseline_from, a) -> dict:
    report = os.path.join(out, "report.json")
    if os.path.isfile(report) and not a.rerun:
        print(f"=== reusing {report}", flush=True)
        with open(report, encoding="utf-8") as fh:
            return json.load(fh)
    from qcompress.cli import main as qcompress_main

    args = [
        *configs,
        *base_args,
        "--out",
        out,
        "--seed",
        str(a.seed),
        "--save-steps",
        "0",
        "--overwrite",
        "--no-progress",
    ]
    args += ["--baseline-from", baseline_from] if baseline_from else ["--baseline"]
    if a.threads:
        args += ["--threads", str(a.threads)]
    print(f"=== qcompress train {' '.join(args)}", flush=True)
    if qcompress_main(["train", *args]):
        raise SystemExit(f"run {out} failed")
    with open(report, encoding="utf-8") as fh:
        return json.load(fh)


def job_calibration(train, pad_id):
    """calibrate(model) as `qcompress train`'s PTQ stage runs it on its calibration batches (the
    first 8 training batches of 64): static activation ranges, then the input-weighted weight
    ranges (observer_kwargs.weight_by: inputs; else nothing runs)."""
    from qcompress import calibrate_weight_ranges
    from qcompress.train.batches import eval_batches
    from qcompress.train.stages import calibrate_static_ranges

    def batches():
        for i, b in enumerate(eval_batches(train, 64, pad_id)):
            if i >= 8:
                break
            b.pop("labels")
            yield b

    def calibrate(model):
        calibrate_static_ranges(model, batches())
        calibrate_weight_ranges(model, batches())

    return calibrate


def ptq_whole_set(a, recipes, baseline_run, n_eval=None) -> dict:
    """{recipe key: {"blocks", "fp32", "minmax", "mse"}}: the FP32 fine-tune of baseline_run (None:
    the pretrained checkpoint --lm itself) and its PTQ with each recipe's qat (minmax) and qat_rl
    (mse) configs, perplexity on the first n_eval held-out blocks (None: all of them). The same steps
    as the job's fp32_finetuned and ptq stages."""
    import torch
    from safetensors.torch import load_file
    from qcompress.config import load_config
    from qcompress.train.data import prepare_data
    from qcompress.train.evaluate import evaluate
    from qcompress.train.models import load_model, load_tokenizer
    from qcompress.train.stages import quantize_without_training

    if a.threads:
        torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.lm)
    data = prepare_data(
        "causal-lm",
        os.path.join(a.lm, "train.txt"),
        tok,
        eval_data=os.path.join(a.lm, "heldout.txt"),
        seed=a.seed,
        max_length=a.max_length,
        max_eval_samples=n_eval,
    )
    model = load_model(a.lm, "causal-lm", None, a.seed)
    if baseline_run:  # tied weights are saved once
        model.load_state_dict(
            load_file(os.path.join(baseline_run, "checkpoints", "fp32_finetuned.safetensors")), strict=False
        )

    def ev(m):
        return evaluate(m, data.eval, "causal-lm", 64, tok.pad_token_id)["perplexity"]

    calibration = job_calibration(data.train, tok.pad_token_id)
    fp32 = ev(model)
    out = {}
    for key in recipes:
        _, recipe, progressive = RECIPES[key]
        row = {"blocks": len(data.eval), "fp32": fp32}
        for variant, col in (("qat", "minmax"), ("qat_rl", "mse")):
            docs = [os.path.join(ROOT, recipe), fragment(variant, "lm", weight_formats(recipe))]
            if progressive:
                docs.append(progressive_fix(recipe, a.max_steps))
            row[col] = ev(quantize_without_training(model, load_config(*docs), calibration))
            print(
                f"=== whole-set PTQ {key} {col}: {row[col]:.4f} (FP32 {fp32:.4f}, {len(data.eval)} blocks)", flush=True
            )
        out[key] = row
    return out


def ordered(summary: dict) -> list:
    """(key, row) of the summary's recipes in RECIPES' order, whichever run finished first."""
    keys = list(RECIPES)
    return sorted(summary["recipes"].items(), key=lambda kv: keys.index(kv[0]) if kv[0] in keys else len(keys))


def whole_set_line(summary: dict) -> str:
    """The --ptq-whole-set figures as one labelled sentence (empty when none were measured)."""
    parts = []
    for key, row in ordered(summary):
        w = row.get("ptq_whole_set")
        if not w:
            continue
        fp, pm, ps = w["fp32"], w["minmax"], w["mse"]
        cut = f"cut {100 * (1 - (ps - fp) / (pm - fp)):.1f} %" if not small_ptq_loss(pm, fp, False) else "PTQ ≈ FP32"
        parts.append(f"{row['label']} minmax {pm:.3f}, mse {ps:.3f} ({cut})")
        blocks, fp32 = w["blocks"], fp
    if not parts:
        return ""
    return (
        f"Outside the table, PTQ of the same FP32 fine-tune on all {blocks} held-out blocks "
        f"(`--ptq-whole-set`, the mse columns' observer; the table's measure is the "
        f"runs' `ptq` stage on the first blocks above): FP32 {fp32:.3f}; " + "; ".join(parts) + "."
    )


def pretrained_line(summary: dict) -> str:
    """The --ptq-pretrained figures as one labelled sentence (empty when none were measured)."""
    parts, sizes = [], None
    for key, row in ordered(summary):
        ws = row.get("ptq_pretrained")
        if not ws:
            continue
        runs = sorted(ws.values(), key=lambda w: w["blocks"])
        sizes = " / ".join(str(w["blocks"]) for w in runs)
        fp32 = " / ".join(f"{w['fp32']:.3f}" for w in runs)
        cuts = " / ".join(f"{100 * (1 - (w['mse'] - w['fp32']) / (w['minmax'] - w['fp32'])):.1f} %" for w in runs)
        parts.append(
            f"{row['label']} minmax "
            + " / ".join(f"{w['minmax']:.3f}" for w in runs)
            + ", mse "
            + " / ".join(f"{w['mse']:.3f}" for w in runs)
            + f" (cut {cuts})"
        )
    if not parts:
        return ""
    return (
        f"PTQ of the pretrained checkpoint itself (`--ptq-pretrained`: no fine-tune, the model a user "
        f"would quantize; the same observers and steps), first {sizes} held-out blocks: FP32 {fp32}; "
        + "; ".join(parts)
        + "."
    )


def update_summary(path: str, metric: str, key=None, row=None, **fields) -> dict:
    """Read-modify-write of summary.json: several processes (one per recipe) may share it."""
    summary = {"metric": metric, "recipes": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh)
    if key is not None:
        summary["recipes"][key] = row
    summary.update({k: v for k, v in fields.items() if v is not None})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    os.replace(tmp, path)
    return summary


def share(ptq, method, fp32):
    return (ptq - method) / (ptq - fp32)


def fmt_metric(v, metric):
    return "—" if v is None else (f"{v:.4f}" if metric == "accuracy" else f"{v:.2f}")


def small_ptq_loss(pm, fp, acc: bool) -> bool:
    """PTQ too close to FP32 (or better) for a share to mean anything: less than 0.5 points
    (classifier, 2 of 445 articles) or 0.2 % (perplexity) worse."""
    return (fp - pm) < 0.005 if acc else (pm - fp) / fp < 0.002


def table(summary: dict) -> str:
    metric = summary["metric"]
    acc = metric == "accuracy"
    head = (
        "| recipe (budget) | FP32 | PTQ minmax | PTQ mse | QAT | QAT + RL | QAD | QAD + RL | recovered: QAT / QAT+RL / "
        "QAD / QAD+RL | mse cuts PTQ excess by | export / FP32 bytes |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for key, row in ordered(summary):
        fp, pm, ps = row["fp32"], row.get("ptq_minmax"), row.get("ptq_mse")
        vals = [row.get(v) for v in COLUMNS]
        if pm is None or small_ptq_loss(pm, fp, acc):
            rec = "n/a (PTQ ≈ or > FP32)" if pm is not None else "—"
            cut = "n/a" if pm is not None else "—"
        else:
            rec = " / ".join("—" if v is None else f"{round(100 * share(pm, v, fp))} %" for v in vals)  # no "-0 %"
            cut = "—" if ps is None else f"{100 * (1 - (ps - fp) / (pm - fp)):.0f} %"
        budget = f" ({row['budget']})" if row.get("budget") else ""
        size = f"{row['export_ratio']:.3f}" if row.get("export_ratio") is not None else "—"
        lines.append(
            f"| {row['label']}{budget} | {fmt_metric(fp, metric)} | {fmt_metric(pm, metric)} | "
            f"{fmt_metric(ps, metric)} | "
            + " | ".join(fmt_metric(v, metric) for v in vals)
            + f" | {rec} | {cut} | {size} |"
        )
    return "\n".join(lines)


def targets(summary: dict) -> list:
    """The quality targets, met or missed, from the measured rows (a target whose rows are missing is left out)."""
    r, out = summary["recipes"], []

    def verdict(ok):
        return "**met**" if ok else "**missed**"

    if summary["metric"] == "perplexity":
        w4 = r.get("w4_g32", {})
        if w4.get("ptq_minmax") is not None and w4.get("ptq_mse") is not None:
            fp, pm, ps = w4["fp32"], w4["ptq_minmax"], w4["ptq_mse"]
            cut = 1 - (ps - fp) / (pm - fp)
            out.append(
                f"Target: mse observer cuts the W4 g32 PTQ perplexity excess by ≥ 1/3: {verdict(cut >= 1 / 3)} "
                f"(+{pm - fp:.3f} → +{ps - fp:.3f} over FP32 {fp:.3f}: cut by {100 * cut:.0f} %)."
            )
        for key, bits, goal in (("w4_g32", "W4 g32", 0.9), ("w3_g32", "W3 g32", 0.7)):
            row = r.get(key, {})
            if row.get("qad_rl") is None or row.get("ptq_minmax") is None:
                continue
            fp, pm, v = row["fp32"], row["ptq_minmax"], row["qad_rl"]
            sh = share(pm, v, fp)
            pre = row.get("fp32_start")
            vs_pre = (
                f"; against the pretrained checkpoint's {pre:.3f}: {100 * share(pm, v, pre):.0f} %"
                if pre is not None and pm > pre
                else ""
            )
            out.append(
                f"Target: QAD + range learning recovers ≥ {100 * goal:.0f} % of the {bits} PTQ degradation: "
                f"{verdict(sh >= goal)} (FP32 {fp:.3f}, PTQ {pm:.3f}, QAD + RL {v:.3f}: {100 * sh:.0f} %"
                f"{vs_pre})."
            )
    else:
        row = r.get("w2a8_kd", {})
        if row.get("qad_rl") is not None:
            d = 100 * (row["qad_rl"] - row["fp32"])
            out.append(
                f"Target: ternary W2 with distillation within 3 accuracy points of FP32: {verdict(d >= -3)} "
                f"(QAD + RL {row['qad_rl']:.4f} vs FP32 {row['fp32']:.4f}: {d:+.2f} points)."
            )
    return out


METHOD = (
    "## Method\n\n"
    "`benchmarks/quality.py`: per recipe, three `qcompress train` runs with one shared FP32 baseline "
    "(same steps, data order and seed): `qat` (minmax observer, fixed ranges), `qat_rl` (mse observer + "
    "range learning) and `qad_rl` (the same + distillation, KL at T 1, alpha 0.9: for the causal LM from the "
    "pretrained model itself, `teacher: self`, as llm-compressor / ModelOpt distil from the original model; "
    "for the classifier from the FP32 fine-tune, `teacher: baseline`, since its pretrained head is random). "
    "Learned ranges train in their own AdamW group at 0.1x the lr without weight decay. "
    "PTQ columns are the runs' `ptq` stage (the FP32 fine-tune quantized at the recipe's target bits, "
    'minmax or mse). Recovered = (PTQ − method) / (PTQ − FP32) with the minmax PTQ; "mse cuts PTQ '
    'excess by" = 1 − (PTQ mse − FP32) / (PTQ minmax − FP32). RL = range learning. One seed per run: '
    "on a small held-out set one example moves accuracy by 1 / (held-out size). Float recipes (FP8, NVFP4, "
    "MXFP4) run `qat` and `qad` (minmax + the same distillation), the QAD column; where their mse columns "
    "are filled (`--float-rl`) the mse observer takes its plain search and range learning trains FP8 / NVFP4 "
    "scales (MX scales are powers of two: mse only). The classifier's QAD student starts from the "
    "pretrained checkpoint like every variant, and distils a teacher of the same short budget: "
    "\"The classifier's QAD and its teacher\" below measures what that teacher's confidence does to it. "
    "Export / FP32 bytes: the export folder's size over the FP32 model's.\n"
)


def measured_at(summary: dict) -> str:
    """The commits the table's runs were measured at (a reused run keeps the commit it ran at)."""
    commits = sorted({v for row in summary["recipes"].values() for k, v in row.items() if k.endswith("_commit")})
    return f" Runs measured at commit {', '.join(commits)}." if commits else ""


def task_text(summary: dict) -> str:
    """One task's part of the page: title, setup, table, then the generated target lines and notes."""
    lines = [whole_set_line(summary), pretrained_line(summary)] if summary.get("metric") == "perplexity" else []
    notes = targets(summary) + [x for x in lines if x] + list(dict.fromkeys(summary.get("notes") or []))
    text = f"## {summary['title']}\n\n{summary['setup']}{measured_at(summary)}\n\n{table(summary)}\n"
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return text


def headline(summary: dict) -> str:
    """The index's short table: FP32, minmax PTQ, plain QAT and the best trained variant per recipe."""
    metric = summary["metric"]
    lines = [
        f"**{summary['title']}** ([details](results/quality.md))",
        "",
        "| recipe | FP32 | PTQ | QAT | best of QAT / QAT + RL / QAD / QAD + RL |",
        "|---|---:|---:|---:|---:|",
    ]
    for _, row in ordered(summary):
        done = [row[v] for v in COLUMNS if row.get(v) is not None]
        best = (max if metric == "accuracy" else min)(done) if done else None
        lines.append(
            f"| {row['label']} | {fmt_metric(row.get('fp32'), metric)} | "
            f"{fmt_metric(row.get('ptq_minmax'), metric)} | {fmt_metric(row.get('qat'), metric)} | "
            f"{fmt_metric(best, metric)} |"
        )
    return "\n".join(lines) + "\n"


def write_results(task: str, summary: dict, cmd=None) -> str:
    """Replace this task's section of benchmarks/results/quality.md (and the method note above it),
    and its headline in benchmarks/RESULTS.md."""
    common.write_section("quality", "method", METHOD, title="Compression quality", header=False)
    common.write_section(os.path.join(HERE, "RESULTS.md"), f"headline-{task}", headline(summary), cmd=cmd)
    return common.write_section("quality", task, task_text(summary), title="Compression quality", cmd=cmd)


def _portable(text: str) -> str:
    """A data summary with an installed package's folder named from site-packages (a reader's
    machine has its own prefix)."""
    return re.sub(r"/\S*/site-packages/", "<site-packages>/", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("classifier", "lm"), required=True)
    p.add_argument("--lm", default=os.path.join(ROOT, "runs", "gpt2-austen"))
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {list(RECIPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "quality"))
    p.add_argument("--train-samples", type=int, default=None, help="classifier: first N training articles")
    p.add_argument("--eval-samples", type=int, default=None, help="first N held-out examples / blocks")
    p.add_argument("--max-steps", type=int, default=60, help="lm: optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per run (default: torch's)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument(
        "--baseline-from",
        default=None,
        metavar="RUN",
        help="a finished run folder of the same task and budget whose FP32 fine-tune to reuse",
    )
    p.add_argument(
        "--ptq-whole-set",
        action="store_true",
        help="lm: also PTQ the FP32 fine-tune (minmax, mse) and evaluate it on every held-out block",
    )
    p.add_argument(
        "--ptq-pretrained",
        action="store_true",
        help="causal LM: also PTQ the pretrained checkpoint (--lm, no fine-tune) with each recipe's "
        "minmax and mse configs, on the first --eval-samples blocks and on all of them",
    )
    p.add_argument(
        "--observer-kwargs",
        default=DEFAULT_OBSERVER_KWARGS,
        metavar="JSON",
        help='the mse variants\' observer_kwargs, e.g. \'{"maxshrink": 0.2, "norm": 2.4}\' (default: '
        f"{DEFAULT_OBSERVER_KWARGS}, the input-weighted search; '{{}}': the plain mse)",
    )
    p.add_argument(
        "--float-rl",
        action="store_true",
        help="float recipes also run the mse variants (qat_rl, qad_rl: the plain mse search; range "
        "learning for FP8 / NVFP4 scales, mse only for MX) and qad when --variants names it",
    )
    p.add_argument("--write-results", action="store_true")
    p.add_argument(
        "--note",
        action="append",
        default=None,
        help="a sentence listed under this task's table (repeat; replaces the task's notes)",
    )
    a = p.parse_args(argv)
    if a.observer_kwargs:
        OBSERVER_KWARGS.update(json.loads(a.observer_kwargs))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base_args, metric, _, steps = task_args(a)
    if a.task == "classifier":
        budget = f"{a.train_samples or 1780} articles, {steps} steps"
    else:
        budget = f"{a.max_steps} steps of {a.batch_size} × {a.max_length}"
    out_task = os.path.join(a.out, a.task)
    summary_path = os.path.join(out_task, "summary.json")
    summary = {"metric": metric, "recipes": {}}
    if os.path.isfile(summary_path):
        with open(summary_path, encoding="utf-8") as fh:
            summary = json.load(fh)
    t0 = time.perf_counter()
    baseline = a.baseline_from or summary.get("baseline_run")
    for key in [k for k in a.recipes.split(",") if k]:
        label, recipe, progressive = RECIPES[key]
        row = summary["recipes"].get(key, {"label": label})
        row["label"] = label
        for variant in recipe_variants(key, [v for v in a.variants.split(",") if v], a.float_rl):
            out = os.path.join(out_task, key, variant)
            frags = [
                write_yaml(
                    os.path.join(out_task, key, f"{variant}.yaml"), fragment(variant, a.task, weight_formats(recipe))
                )
            ]
            if progressive:
                frags.append(
                    write_yaml(os.path.join(out_task, key, "spread_drops.yaml"), progressive_fix(recipe, steps))
                )
            fresh = a.rerun or not os.path.isfile(os.path.join(out, "report.json"))
            rep = run_one(out, [os.path.join(ROOT, recipe), *frags], base_args, baseline, a)
            if fresh or f"{variant}_commit" not in row:
                row[f"{variant}_commit"] = common.commit()
            baseline = baseline or out
            st = rep["stages"]
            row["fp32"] = st["fp32_finetuned"][metric]
            row["fp32_start"] = st["fp32"][metric]
            row["ptq_minmax" if variant in ("qat", "qad") else "ptq_mse"] = st["ptq"][metric]
            row[variant] = st["qat"][metric]
            row[f"{variant}_exported"] = st["exported"][metric]
            row[f"{variant}_max_logit_diff"] = st["exported"].get("max_logit_diff_vs_qat")
            row[f"{variant}_train_s"] = rep["wall_time_s"].get("qat_train")
            row["export_ratio"] = rep["sizes"]["export_bytes"] / rep["sizes"]["fp32_bytes"]
            row["steps"] = rep["training"]["steps"]
            row["budget"] = budget
            summary = update_summary(
                summary_path, metric, key=key, row=row, baseline_run=baseline, data=rep["data"]["summary"]
            )
    if a.ptq_whole_set and a.task == "lm":
        if not baseline:
            raise SystemExit("--ptq-whole-set needs a finished FP32 fine-tune (--baseline-from or a measured run)")
        keys = [k for k in a.recipes.split(",") if k]
        for key, w in ptq_whole_set(a, keys, baseline).items():
            row = summary["recipes"].get(key, {"label": RECIPES[key][0]})
            row["ptq_whole_set"] = w
            summary = update_summary(summary_path, metric, key=key, row=row)
    if a.ptq_pretrained and a.task == "lm":
        keys = [k for k in a.recipes.split(",") if k]
        for n_eval in dict.fromkeys((a.eval_samples, None)):
            for key, w in ptq_whole_set(a, keys, None, n_eval).items():
                row = summary["recipes"].get(key, {"label": RECIPES[key][0]})
                row.setdefault("ptq_pretrained", {})[str(w["blocks"])] = w
                summary = update_summary(summary_path, metric, key=key, row=row)
    import torch
    from qcompress.nn.range_groups import RANGE_LR_FACTOR

    if a.task == "classifier":
        title = "all-MiniLM-L6-v2 on BBC News (accuracy)"
        setup = (
            f"One epoch on the first N training articles of the 80/20 split (seed {a.seed}; N and the "
            f"steps per recipe in its row), batch {a.batch_size}, max length {a.max_length}, AdamW "
            f"{a.lr} (weight decay 0.01); accuracy on {a.eval_samples or 445} held-out articles "
            f"({_portable(summary.get('data', ''))}). {a.threads or torch.get_num_threads()} thread(s) per run "
            "on a shared 2-core CPU."
        )
    else:
        title = f"Causal LM `{os.path.basename(a.lm.rstrip('/'))}` (held-out perplexity)"
        setup = (
            f"Steps of batch × tokens on its train.txt per recipe in its row, AdamW {a.lr} (weight decay "
            f"0.01; learned ranges {RANGE_LR_FACTOR * a.lr:g}, no decay), constant lr; perplexity on heldout.txt"
            f"{f' (its first {a.eval_samples} blocks of {a.max_length} tokens)' if a.eval_samples else ''}. "
            f"{a.threads or torch.get_num_threads()} thread(s) per run on a shared 2-core CPU. "
            f"The integer recipes' mse columns (PTQ mse, QAT + RL, QAD + RL) use observer_kwargs "
            f"{json.dumps(OBSERVER_KWARGS) if OBSERVER_KWARGS else '{} (the plain search)'}; the float "
            f"ones the plain search."
        )
    summary = update_summary(summary_path, metric, title=title, setup=setup, notes=a.note)
    print(f"\n{table(summary)}\n({time.perf_counter() - t0:.0f} s)")
    if a.write_results:
        cmd = common.command([os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None else argv))
        print(f"written to {write_results(a.task, summary, cmd)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
