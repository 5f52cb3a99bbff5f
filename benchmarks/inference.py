"""Inference of exported checkpoints: plain nn.Linear model vs load_quantized(mode="exact") vs
load_quantized(mode="fast"), side by side in one run.

    .venv/bin/python benchmarks/inference.py [--layers 12] [--width 2048] [--rounds 7] [--threads 2,1]

Model: a stack of Linear(width, width) + ReLU (12 x 2048 = 50.3 M parameters). Batch sizes 1 and
32. The three variants are timed in interleaved rounds (each round runs every variant), so a
noisy machine slows them alike; the table gives the minimum and the median per forward.
Writes (replaces) the '## Inference of exported checkpoints' section of benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch                                      # noqa: E402
import torch.nn as nn                             # noqa: E402
import torch.nn.functional as F                   # noqa: E402

import qcompress                                  # noqa: E402
from qcompress.export import export_quantized, load_quantized  # noqa: E402
from qcompress.export.fast import plans_of, tensor_bytes  # noqa: E402

SECTION = "## Inference of exported checkpoints"


def build(layers, width, dtype):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).to(dtype).eval()


def cfg_for(bits, granularity, group_size=None, act=False):
    params = {"start_bits": bits, "target_bits": bits, "ternary": False, "granularity": granularity}
    if group_size:
        params["group_size"] = group_size
    doc = {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"w": {"params": params}}}}}
    if act:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": 8}}}}
    return qcompress.load_config(doc)


# name, dtype, config
SCHEMES = [
    ("W8 channel, fp32", torch.float32, lambda: cfg_for(8, "channel")),
    ("W8A8 channel + dynamic token int8, fp32", torch.float32, lambda: cfg_for(8, "channel", act=True)),
    ("W4 group128, fp32", torch.float32, lambda: cfg_for(4, "group", 128)),
    ("W8 channel, bf16", torch.bfloat16, lambda: cfg_for(8, "channel")),
    ("W4 group128, bf16", torch.bfloat16, lambda: cfg_for(4, "group", 128)),
]


def loaded_pair(args, dtype, cfg, tmp):
    model = build(args.layers, args.width, dtype)
    qcompress.init_compression(model, cfg)
    model.eval()
    path = os.path.join(tmp, "ckpt")
    export_quantized(model, path, force=True)
    del model
    exact = load_quantized(path, build(args.layers, args.width, dtype))
    fast = load_quantized(path, build(args.layers, args.width, dtype), mode="fast")
    return exact.eval(), fast.eval()


def interleaved(fns, x, rounds, per_round):
    """{name: (min, median)} seconds per forward; every round times every variant once."""
    times = {n: [] for n in fns}
    with torch.no_grad():
        for f in fns.values():
            f(x)                                   # warm-up (allocator, oneDNN primitives)
        for _ in range(rounds):
            for n, f in fns.items():
                t = time.perf_counter()
                for _ in range(per_round):
                    f(x)
                times[n].append((time.perf_counter() - t) / per_round)
    return {n: (min(v), statistics.median(v)) for n, v in times.items()}


def kernel_probe(width, rounds):
    """One Linear(width, width): torch's weight-only int8/int4 kernels with fp32 vs bf16 inputs."""
    torch.manual_seed(0)
    w = torch.randn(width, width)
    q8 = torch.randint(-128, 128, (width, width), dtype=torch.int8)
    s8 = torch.rand(width)
    u4 = torch.randint(0, 16, (width, width), dtype=torch.int32)
    p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u4, 1)
    sz = torch.rand(width // 128, width, 2)
    rows = []
    for m in (1, 32):
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(m, width, dtype=dt)
            wd, sd, szd = w.to(dt), s8.to(dt), sz.to(dt)
            fns = {"dense": lambda x: F.linear(x, wd),
                   "int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, sd),
                   "int4pack": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, 128, szd)}
            r = interleaved(fns, x, rounds, 1)
            rows.append((m, str(dt).replace("torch.", ""), r))
    return rows


def run(args, threads):
    rows = []
    for name, dtype, make_cfg in SCHEMES:
        torch.set_num_threads(max(threads))
        base = build(args.layers, args.width, dtype)
        with tempfile.TemporaryDirectory() as tmp:
            exact, fast = loaded_pair(args, dtype, make_cfg(), tmp)
        plans = sorted(set(plans_of(fast).values()))
        nbytes = {"base": tensor_bytes(base), "exact": tensor_bytes(exact), "fast": tensor_bytes(fast)}
        for nt in threads:
            torch.set_num_threads(nt)
            for batch in (1, 32):
                x = torch.randn(batch, args.width, dtype=dtype)
                t = interleaved({"base": base, "exact": exact, "fast": fast}, x, args.rounds,
                                args.per_round if batch == 1 else 1)
                rows.append((name, "/".join(plans), nt, batch, t, nbytes))
                print(name, nt, batch, {k: f"{v[0] * 1e3:.1f}/{v[1] * 1e3:.1f} ms" for k, v in t.items()},
                      flush=True)
        del base, exact, fast
    torch.set_num_threads(threads[0])
    probe = kernel_probe(args.width, args.rounds * 2)
    return rows, probe


def fmt_section(args, threads, rows, probe):
    params = args.layers * (args.width * args.width + args.width)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = [SECTION, "",
           f"Model: {args.layers} x Linear({args.width}, {args.width}) + ReLU ({params / 1e6:.1f} M params), "
           f"torch {torch.__version__}, {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
           f"{' and '.join(map(str, threads))} threads; {args.rounds} interleaved rounds, min / median ms per forward "
           f"(batch 1: {args.per_round} forwards per round). 1-min load average at the end {load:.1f} "
           "(other jobs share the CPU: compare within a row only). Baseline: the same model unquantized "
           "in the same dtype. x = min-time ratio to the baseline (lower is faster).", "",
           "| scheme | fast plan | threads | batch | baseline ms | exact ms | fast ms | exact x | fast x | "
           "weights MB base / exact / fast |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, plan, nt, batch, t, nb in rows:
        b, e, f = t["base"], t["exact"], t["fast"]
        out.append(f"| {name} | {plan} | {nt} | {batch} | {b[0] * 1e3:.1f} / {b[1] * 1e3:.1f} | "
                   f"{e[0] * 1e3:.1f} / {e[1] * 1e3:.1f} | {f[0] * 1e3:.1f} / {f[1] * 1e3:.1f} | "
                   f"{e[0] / b[0]:.2f} | {f[0] / b[0]:.2f} | "
                   f"{nb['base'] / 1e6:.1f} / {nb['exact'] / 1e6:.1f} / {nb['fast'] / 1e6:.1f} |")
    out += ["", f"torch's weight-only kernels on one Linear({args.width}, {args.width}), {threads[0]} threads "
            "(min / median ms; why float32 layers do not use them):", "",
            "| batch | input dtype | dense F.linear | _weight_int8pack_mm | _weight_int4pack_mm_for_cpu g128 |",
            "| ---: | --- | ---: | ---: | ---: |"]
    for m, dt, r in probe:
        out.append(f"| {m} | {dt} | " + " | ".join(
            f"{r[k][0] * 1e3:.2f} / {r[k][1] * 1e3:.2f}" for k in ("dense", "int8pack", "int4pack")) + " |")
    out += ["", "Plans (qcompress/export/fast.py): int_mm = int8 activation codes x int8 weight codes "
            "summed exactly by torch._int_mm, scales applied once per output; int8pack / int4pack = "
            "torch's weight-only kernels (bf16); int_mm24 = fp32 tokens split into three int8 digits "
            "(24-bit grid) x int8 weight codes by torch._int_mm; dequant = the exact path's float weight "
            "(bit-identical), rebuilt per call from a bit-plane re-layout of the packed codes. "
            "Weights MB = bytes of all parameters and buffers.", ""]
    return "\n".join(out)


def write_section(text):
    """Replace only our section of RESULTS.md (other helpers write other sections)."""
    path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmark results\n"
    pat = re.compile(r"^" + re.escape(SECTION) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    new = pat.sub(lambda _: text, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + text
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    ap.add_argument("--no-write", action="store_true", help="print only, leave RESULTS.md alone")
    args = ap.parse_args()
    threads = [int(t) for t in str(args.threads).split(",")]
    rows, probe = run(args, threads)
    text = fmt_section(args, threads, rows, probe)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
