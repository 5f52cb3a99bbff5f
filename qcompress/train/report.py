"""What a run leaves behind: metrics.csv (one row per optimizer step), report.json / report.md, plots.

Every file is written atomically or appended line by line with a flush, so an interrupted run
never leaves a half-written report that looks finished.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Dict, List, Optional, Sequence

METRIC_COLUMNS = ["step", "loss", "task_loss", "distill_loss", "lr", "samples_per_s"]


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """Append-only CSV of per-step metrics; `resume_at(step)` drops rows past a checkpoint's step."""

    def __init__(self, path: str, columns: Sequence[str]):
        self.path, self.columns = path, list(columns)
        self._fh = None

    def resume_at(self, step: Optional[int]) -> None:
        """Keep the rows of steps <= step (None: start a new file)."""
        rows = []
        if step is not None and os.path.isfile(self.path):
            with open(self.path, newline="", encoding="utf-8") as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= step]
        text_rows = [self.columns] + [[r.get(c, "") for c in self.columns] for r in rows]
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            csv.writer(fh).writerows(text_rows)
        os.replace(tmp, self.path)

    def write(self, row: Dict[str, object]) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a", newline="", encoding="utf-8")
        csv.writer(self._fh).writerow([_cell(row.get(c)) for c in self.columns])
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def read_metrics(path: str) -> List[Dict[str, str]]:
    if not os.path.isfile(path):
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


# --- report.json / report.md -------------------------------------------------------------------

STAGE_ORDER = ("fp32", "fp32_finetuned", "ptq", "ptq_learned", "qat", "exported", "transformers")
STAGE_TEXT = {
    "fp32": "starting model, FP32",
    "fp32_finetuned": "FP32 fine-tuned, same budget (--baseline)",
    "ptq": "post-training quantization, no training",
    "ptq_learned": "the PTQ model's ranges trained on the loss, weights frozen (--ptq-range-steps)",
    "qat": "compressed model after training (eval mode)",
    "exported": "export reloaded by qcompress.load_quantized",
    "transformers": "export loaded by transformers from_pretrained",
}


def write_report(out_dir: str, report: dict) -> None:
    # report.json last: its presence is what marks a finished run
    atomic_write(os.path.join(out_dir, "report.md"), report_markdown(report))
    atomic_write(os.path.join(out_dir, "report.json"), json.dumps(report, indent=2, sort_keys=False) + "\n")


def _fmt(v, digits=4) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "—"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def stage_table(report: dict) -> str:
    """The metrics of every stage as a Markdown table (also what the CLI prints)."""
    metric = report["metric"]
    ref = report["stages"].get("fp32_finetuned") or {}
    lines = [f"| stage | {metric} | vs FP32 fine-tuned | loss | time | what |", "|---|---|---|---|---|---|"]
    for name in STAGE_ORDER:
        if name not in report["stages"]:
            continue
        st = report["stages"][name]
        if st is None or st.get(metric) is None:
            reason = (st or {}).get("reason", "not run")
            lines.append(f"| {name} | — | — | — | — | {STAGE_TEXT[name]}: {reason} |")
            continue
        delta = "—"
        if ref.get(metric) is not None and name != "fp32_finetuned":
            d = st[metric] - ref[metric]
            delta = f"{d * 100:+.2f} pts" if metric == "accuracy" else f"{d:+.3f}"
        secs = report["wall_time_s"].get(name)
        lines.append(
            f"| {name} | {_fmt(st[metric])} | {delta} | {_fmt(st.get('loss'))} | "
            f"{'—' if secs is None else f'{secs:.1f} s'} | {STAGE_TEXT[name]} |"
        )
    return "\n".join(lines)


def _mesh(training: dict) -> str:
    """' (pipeline 2 x data 1 x tensor 1)': the engine's mesh, when a run recorded one."""
    m = training.get("mesh")
    return "" if not m else f" (pipeline {m['pp']} x data {m['dp']} x tensor {m['tp']})"


def report_markdown(report: dict) -> str:
    sizes = report["sizes"]
    ratio = sizes.get("compression_ratio")
    out = [
        f"# qcompress train: {report['task']} on {os.path.basename(report['model'].rstrip('/'))}",
        "",
        f"- model: `{report['model']}` ({report['model_class']}, {report['parameters']:,} parameters)",
        f"- data: {report['data']['summary']}",
        f"- configs: {', '.join('`%s`' % c for c in report['configs']) or '(none)'}",
        f"- training: {report['training']['steps']} optimizer steps of {report['training']['train_batch_size']} "
        f"samples, world size {report['training']['world_size']}{_mesh(report['training'])}, "
        f"precision {report['training']['precision']}",
        "",
        "## Metrics",
        "",
        stage_table(report),
        "",
        "## Size",
        "",
        "| weights | bytes | size |",
        "|---|---|---|",
        f"| FP32 | {sizes['fp32_bytes']:,} | {_size(sizes['fp32_bytes'])} |",
        f"| export (safetensors) | {sizes.get('export_bytes') or 0:,} | {_size(sizes.get('export_bytes'))} |",
        "",
        f"Compression ratio: {ratio:.2f}x" if ratio else "",
        "",
        "## Final bits per group",
        "",
        "| group | bits | modules |",
        "|---|---|---|",
    ]
    for name, g in report["final_bits"].items():
        out.append(f"| {name} | {g['bits']} | {g['modules']} |")
    out += ["", "## Wall time per stage", "", "| stage | seconds |", "|---|---|"]
    for name, secs in report["wall_time_s"].items():
        out.append(f"| {name} | {secs:.1f} |")
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


# --- plots -----------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig, plt, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}.png"
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def _floats(rows, key):
    return [float(r[key]) if r.get(key) not in (None, "") else float("nan") for r in rows]


def plot_loss(path: str, runs: Dict[str, List[Dict[str, str]]]) -> bool:
    """Training loss per optimizer step of each run ({label: metrics rows}); False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for label, rows in runs.items():
        if rows:
            ax.plot(_floats(rows, "step"), _floats(rows, "loss"), label=label, linewidth=1.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, plt, path)
    return True


def plot_bits(path: str, rows: List[Dict[str, str]]) -> bool:
    """Bits of every group (and pruning density, right axis) over the optimizer steps."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = _floats(rows, "step")
    cols = list(rows[0].keys()) if rows else []
    top = 8.0
    for i, c in enumerate(x for x in cols if x.startswith(("bits.", "act_bits."))):
        ys = _floats(rows, c)
        top = max([top] + [y for y in ys if y == y])
        ax.step(
            steps,
            ys,
            where="post",
            label=c,
            linestyle="--" if c.startswith("act_") else "-",
            linewidth=2.2 - 0.4 * (i % 3),
        )  # equal lines stay visible on top of each other
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(0, top + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits (32 = not yet quantized)")
    ax.grid(alpha=0.3)
    dens = [c for c in cols if c.startswith("density.")]
    if dens:
        ax2 = ax.twinx()
        for c in dens:
            ax2.plot(steps, _floats(rows, c), ":", label=c)
        ax2.set_ylabel("kept density")
        ax2.set_ylim(0, 1.05)
        ax2.legend(fontsize=8, loc="lower right")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    _save(fig, plt, path)
    return True
