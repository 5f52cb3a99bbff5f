"""The `qcompress` command: train | export | inspect | schedule | bench.

    qcompress schedule schedules/w4a8_progressive.yaml [--plot bits.png] [--steps 500]
    qcompress train CFG [CFG ...] --model DIR --data PATH --task T --out DIR   (the main job)
    qcompress export --model pkg.mod:fn --weights w.safetensors --config cfg.yaml --out dir
    qcompress inspect dir
    qcompress verify dir [--vllm] [--transformers]   (exit 1: a consumer refuses or dequantizes a module)
    qcompress bench [--full] [--write-results]   (prints; --write-results records benchmarks/RESULTS.md)

`python -m qcompress ...` is the same. Heavy parts (torch models, matplotlib, export) load only
when their command runs. Exit status: 0 ok, 1 a missing optional part, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .errors import install_hint

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.path.dirname(PACKAGE_DIR)  # the repository, for model_zoo/ and benchmarks/


class CLIError(Exception):
    """A user-facing failure: printed as 'qcompress <cmd>: message', exit status `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# --- schedule --------------------------------------------------------------------------------------


class Column:
    """One table column: a label, the value at any step, and the steps where it changes."""

    def __init__(
        self, label: str, value: Callable[[int], str], changes: Sequence[int], numeric: Callable[[int], Optional[float]]
    ):
        self.label, self.value, self.changes, self.numeric = label, value, list(changes), numeric


def schedule_columns(cfg) -> Tuple[List[Column], List[str]]:
    """Columns for every group of every enabled technique, and a description line per group."""
    from .pruning.state import PruningState
    from .schedule import bits_at, change_points

    cc = cfg.compression
    cols: List[Column] = []
    notes: List[str] = []

    def mods(group):
        return "all compressible modules" if group.modules is None else ", ".join(group.modules)

    wqt = cc.weight_quantization
    if wqt.enabled:
        for g in wqt.groups:
            w = g.settings
            off = w.offset
            mode = "in every forward" if w.in_forward else "once per optimizer step"
            kw = dict(start=w.start_bits, target=w.target_bits, period=w.period, offset=off, growth=w.growth)
            points = change_points(**kw)

            def bits(s, kw=kw, off=off):
                return bits_at(s, **kw) if s >= off else None

            cols.append(
                Column(
                    f"W:{g.name}", lambda s, f=bits: "off" if f(s) is None else str(f(s)), [s for s, _ in points], bits
                )
            )
            plan = (
                f"{w.start_bits} bits"
                if w.start_bits == w.target_bits
                else f"{w.start_bits} -> {w.target_bits} bits, period {w.period} ({w.growth})"
            )
            notes.append(
                f"W:{g.name}  weights {plan}, {w.quantization_type}, quantized {mode}, "
                f"from step {off}; modules: {mods(g)}"
            )
    aqt = cc.activation_quantization
    if aqt.enabled:
        for g in aqt.groups:
            a = g.settings
            b, off = a.bits, a.offset

            def abits(s, b=b, off=off):
                return b if s >= off else None

            cols.append(Column(f"A:{g.name}", lambda s, f=abits: "off" if f(s) is None else str(f(s)), [off], abits))
            notes.append(
                f"A:{g.name}  activations {b} bits, {a.quantization_type}, "
                f"{a.calibration} ranges, from step {off}; modules: {mods(g)}"
            )
    for tech in ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning"):
        technique = getattr(cc, tech)
        if not technique.enabled:
            continue
        sh = technique.shared
        end = getattr(sh, "schedule_offset_end", None)
        short = tech.replace("_pruning", "")
        for g in technique.groups:
            st = PruningState(tech, g.name, sh.method, g.params.dense_ratio, sh.schedule_offset, end)

            def keep(s, st=st):
                return None if s < st.offset else st.ratio_at(s)

            changes = [sh.schedule_offset] + ([end] if end is not None and end > sh.schedule_offset else [])
            cols.append(
                Column(
                    f"{short}:{g.name}",
                    lambda s, f=keep: "off" if f(s) is None else f"keep {f(s):.3g}",
                    changes,
                    lambda s: None,
                )
            )
            ramp = f", kept ratio ramps 1 -> {g.params.dense_ratio} until step {end}" if end else ""
            notes.append(
                f"{short}:{g.name}  {tech} ({sh.method}) keeps {g.params.dense_ratio} "
                f"from step {sh.schedule_offset}{ramp}; modules: {mods(g)}"
            )
    return cols, notes


def schedule_table(cols: List[Column], steps: Optional[int] = None) -> Tuple[List[int], str]:
    """The steps where anything changes (0 always; capped at `steps`, which then ends the table)."""
    points = sorted({0, *(s for c in cols for s in c.changes)})
    if steps is not None:
        points = sorted({p for p in points if p <= steps} | {steps})
    rows = [["step"] + [c.label for c in cols]]
    rows += [[str(s)] + [c.value(s) for c in cols] for s in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return points, "\n".join(lines)


def plot_schedule(cols: List[Column], last_step: int, path: str, title: str) -> None:
    """Bits vs step (step plot, weights solid, activations dashed), written atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:
        raise CLIError(
            f"--plot needs matplotlib, which is not installed ({err}); install it with: {install_hint('plot')}", code=1
        ) from None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    plotted = 0
    for c in cols:
        steps = sorted({0, last_step, *(s for s in c.changes if s <= last_step)})
        ys = [c.numeric(s) for s in steps]
        if all(y is None for y in ys):
            continue
        ax.step(
            steps,
            [float("nan") if y is None else y for y in ys],
            where="post",
            label=c.label,
            linestyle="--" if c.label.startswith("A:") else "-",
            linewidth=1.8,
        )
        plotted += 1
    ax.set_xlabel("training step (optimizer steps)")
    ax.set_ylabel("bits")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.08)
    ax.set_xlim(0, max(1, last_step))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if plotted:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CLIError(f"cannot write the plot: folder {directory} does not exist")
    ext = os.path.splitext(path)[1] or ".png"
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}{ext}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def cmd_schedule(args) -> int:
    from . import load_config

    if args.steps is not None and args.steps < 0:
        raise CLIError(f"--steps must be >= 0, got {args.steps}")
    cfg = load_config(*args.configs)
    cols, notes = schedule_columns(cfg)
    print(f"schedule of {' + '.join(args.configs)}")
    if not cols:
        print("no compression technique is enabled; nothing changes with the step")
        return 0
    for line in notes:
        print("  " + line)
    print()
    points, table = schedule_table(cols, args.steps)
    print(table)
    if args.plot:
        last = args.steps if args.steps is not None else max(1, int(points[-1] * 1.25) or 1)
        plot_schedule(cols, last, args.plot, " + ".join(os.path.basename(c) for c in args.configs))
        print(f"\nplot written to {args.plot}")
    return 0


# --- train (the main job: qcompress/train/) -------------------------------------------------------


def cmd_train(rest: List[str]) -> int:
    try:
        from .train.args import build_parser, options_from
        from .train.errors import JobError
        from .train.job import run_job
    except ImportError as err:
        raise CLIError(f"`qcompress train` needs transformers ({err}): {install_hint('hf')}", code=1) from None
    p = build_parser(argparse.ArgumentParser(prog="qcompress train"))
    ns = p.parse_args(rest)
    try:
        opts = options_from(ns)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    try:
        run_job(opts)
    except JobError as err:
        raise CLIError(str(err), code=err.code) from None
    return 0


# --- export / inspect / bench (other parts of the package) -------------------------------------------


def _export_module():
    try:
        from .export import cli as export_cli
    except ImportError as err:
        raise CLIError(f"the export module is not available in this build ({err})", code=1) from None
    return export_cli


def cmd_export(rest: List[str]) -> int:
    ecli = _export_module()
    p = argparse.ArgumentParser(
        prog="qcompress export", description="Export a trained model as a quantized safetensors checkpoint."
    )
    ns = ecli.export_parser(p).parse_args(rest)
    return int(ecli.cli_export(ns) or 0)


def cmd_inspect(rest: List[str]) -> int:
    ecli = _export_module()
    p = argparse.ArgumentParser(
        prog="qcompress inspect", description="Describe a quantized export: tensors, bits, scales, config."
    )
    if hasattr(ecli, "inspect_parser"):
        ns = ecli.inspect_parser(p).parse_args(rest)
    else:
        p.add_argument("path")
        ns = p.parse_args(rest)
    if not os.path.exists(ns.path):
        raise CLIError(f"{ns.path}: no such file or folder")
    return int(ecli.cli_inspect(ns) or 0)


def cmd_verify(rest: List[str]) -> int:
    """qcompress verify EXPORT [--vllm] [--transformers] [--json]: qcompress/verify/."""
    from .verify.cli import main_verify

    return main_verify(rest)


def cmd_bench(rest: List[str]) -> int:
    """benchmarks/kernels.py with `rest`: prints its tables, and touches benchmarks/RESULTS.md
    only with --write-results."""
    import runpy

    script = os.path.join(SOURCE_ROOT, "benchmarks", "kernels.py")
    if not os.path.isfile(script):
        raise CLIError(
            f"{script} not found: the benchmarks ship with the source tree; run `qcompress bench` from a checkout",
            code=1,
        )
    saved = sys.argv
    sys.argv = [script, *rest]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


# --- entry point ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcompress", description="Quantization-aware compression training.")
    sub = p.add_subparsers(dest="command", metavar="{train,export,inspect,verify,schedule,bench}")
    # Delegating commands parse their own arguments (lazily imported parsers), so no help here.
    sub.add_parser(
        "train", add_help=False, help="fine-tune a Hugging Face model with compression, evaluate, export, report"
    )
    sub.add_parser("export", add_help=False, help="export a model as quantized safetensors")
    sub.add_parser("inspect", add_help=False, help="describe a quantized export")
    sub.add_parser(
        "verify", add_help=False, help="what each consumer (load_quantized, transformers, vLLM) makes of an export"
    )
    s = sub.add_parser(
        "schedule",
        help="print (and plot) each group's bits at every step where they change",
        description="Print each group's bits at every step where something changes "
        "(technique offsets, bit drops). Several CFG files are merged in order.",
    )
    s.add_argument("configs", nargs="+", metavar="CFG", help="config / schedule files (JSON or YAML)")
    s.add_argument("--plot", metavar="OUT.png", help="also plot bits vs step with matplotlib")
    s.add_argument("--steps", type=int, metavar="N", help="show the schedule up to step N (default: the last change)")
    sub.add_parser(
        "bench",
        add_help=False,
        help="run benchmarks/kernels.py (prints; --write-results records it in benchmarks/RESULTS.md)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handlers: Dict[str, Callable[[List[str]], int]] = {
        "train": cmd_train,
        "export": cmd_export,
        "inspect": cmd_inspect,
        "bench": cmd_bench,
        "verify": cmd_verify,
    }
    try:
        if args.command == "schedule":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_schedule(args)
        return handlers[args.command](rest)
    except ConfigError as err:
        print(f"qcompress {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except CLIError as err:
        print(f"qcompress {args.command}: {err}", file=sys.stderr)
        return err.code
    except (FileExistsError, ValueError) as err:
        # export/inspect errors already name the file and tensor: a message, not a traceback
        if args.command not in ("export", "inspect"):
            raise
        from .export.errors import CheckpointError, ExportError

        if not isinstance(err, (FileExistsError, CheckpointError, ExportError)):
            raise
        print(f"qcompress {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
