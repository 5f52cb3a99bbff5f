"""Export benchmark: qcompress.export_quantized / load_quantized against a plain fp32 safetensors
save/load of the same model, plus file sizes and the forward cost of dequantizing on the fly.

    .venv/bin/python benchmarks/export.py [--layers 8] [--width 1024] [--repeats 3]

Writes (replaces) its section of benchmarks/results/inference.md, keeping the others.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import qcompress  # noqa: E402
from qcompress.export import export_quantized, load_quantized  # noqa: E402


def build(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).eval()


def cfg_for(bits, group_size):
    return qcompress.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "w": {
                            "params": {
                                "start_bits": bits,
                                "target_bits": bits,
                                "ternary": False,
                                "granularity": "group",
                                "group_size": group_size,
                            }
                        }
                    },
                }
            }
        }
    )


def save_fsync(sd, path):
    save_file(sd, path, metadata={"format": "pt"})
    with open(path, "rb+") as f:  # same durability as the export's writes
        os.fsync(f.fileno())


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def folder_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def run(args):
    rows = []
    x = torch.randn(8, args.width)
    with tempfile.TemporaryDirectory() as tmp:
        fp = build(args.layers, args.width)
        fp_path = os.path.join(tmp, "fp32.safetensors")
        sd = {k: v.contiguous() for k, v in fp.state_dict().items()}
        t_save = timed(lambda: save_fsync(sd, fp_path), args.repeats)
        t_load = timed(lambda: build(args.layers, args.width).load_state_dict(load_file(fp_path)), args.repeats)
        with torch.no_grad():
            t_fwd = timed(lambda: fp(x), args.repeats * 5)
        fp_size = os.path.getsize(fp_path)
        rows.append(("fp32 safetensors (save_file + fsync)", t_save, t_load, fp_size, 1.0, t_fwd))
        for bits, gs in ((8, 128), (4, 128), (4, 32), (2, 64)):
            cfg = cfg_for(bits, gs)
            m = qcompress.init_compression(build(args.layers, args.width), cfg)
            qcompress.redundancy_clean(m, cfg)
            out = os.path.join(tmp, f"w{bits}g{gs}")
            t_exp = timed(lambda: export_quantized(m, out, cfg, force=True), args.repeats)
            loaded = []
            t_ld = timed(lambda: loaded.append(load_quantized(out, build(args.layers, args.width))), args.repeats)
            with torch.no_grad():
                ref = m(x)
                assert torch.equal(loaded[-1](x), ref), "loaded model differs"
                t_qf = timed(lambda: loaded[-1](x), args.repeats * 5)
            size = folder_size(out)
            rows.append((f"W{bits} group{gs} export_quantized", t_exp, t_ld, size, size / fp_size, t_qf))
    return rows


def table(rows, args):
    params = args.layers * (args.width * args.width + args.width)
    head = (
        f"Model: {args.layers} x Linear({args.width}, {args.width}) ({params / 1e6:.1f} M params), "
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} runs (forward: batch 8, median of {args.repeats * 5}); "
        f"1-min load average at the end {os.getloadavg()[0]:.1f} (other jobs share the CPU: "
        "compare ratios within this table only)."
    )
    lines = [
        head,
        "",
        "| checkpoint | save/export s | load s | size MB | size vs fp32 | forward ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ts, tl, size, ratio, tf in rows:
        lines.append(f"| {name} | {ts:.3f} | {tl:.3f} | {size / 1e6:.2f} | {ratio:.3f} | {tf * 1e3:.2f} |")
    lines += [
        "",
        "Export time includes computing, checking (dequantize == effective_weight(), bit for "
        "bit) and packing the integers, CRC32 of every tensor and fsync; load includes header "
        "and CRC checks. The loaded model dequantizes each Linear's weight in every forward, "
        "hence the slower forward; it holds only the packed integers.",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    text = table(run(args), args)
    print(text)
    if not args.no_write:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import common

        common.write_section(
            "inference", "export-sizes", "## Export: size, save and load time\n\n" + text, title="Inference and export"
        )


if __name__ == "__main__":
    main()
