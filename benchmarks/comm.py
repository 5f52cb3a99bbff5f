"""Compressed all-reduce benchmark: our 1-bit all-reduce vs dist.all_reduce.

    .venv/bin/python benchmarks/comm.py            # 2 and 4 ranks, 1M / 4M / 16M elements (~2-3 min)
    .venv/bin/python benchmarks/comm.py --full     # adds 64M elements
    .venv/bin/python benchmarks/comm.py --shaped         # also on a loopback shaped to 1 Gbit/s (root)
    .venv/bin/python benchmarks/comm.py --sizes 1M 8M --worlds 2 --reps 5 --no-write

Per world size and element count, in one spawned gloo job (side by side, same processes):
  onebit   qcompress.comm.compressed_allreduce (1 bit + fp32 scale per chunk, two collectives)
  fp32     dist.all_reduce of the fp32 tensor
  fp16     dist.all_reduce of an fp16 copy (the cast is included in the time)
  math     the 1-bit compression math alone (world size 1 formula, no communication)
Time: median over --reps calls after one warm-up call, the max over ranks of each call (the step
waits for the slowest rank). Bytes per rank: measured by qcompress.comm.stats() for onebit; for
all_reduce the ring volume 2 (P-1)/P * N * bytes_per_element (the counting rule of
qcompress.comm.stats). Results replace the all-reduce section of benchmarks/results/comm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ranks import run_ranks  # noqa: E402
import common  # noqa: E402

SECTION = "## Compressed all-reduce"


def parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1], 1)
    return int(float(t[:-1] if t[-1] in "KMG" else t) * mult)


def _timed(fn, reps):
    """Per-call max-over-ranks seconds (each call is fenced by barriers)."""
    import torch.distributed as dist

    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:  # the first call warms up allocations and connections
            times.append(float(t))
    return statistics.median(times)


def _bench_rank(rank, world, sizes, reps):
    import torch.distributed as dist

    import qcompress.comm as qcomm

    solo, _ = dist.new_subgroups(group_size=1)
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        state = qcomm.OneBitState()
        qcomm.compressed_allreduce(x, state)  # allocate errors outside the measurement
        qcomm.reset_stats()
        t_onebit = _timed(lambda: qcomm.compressed_allreduce(x, state), reps)
        s = qcomm.stats()
        onebit_bytes = s["bytes_sent"] // (reps + 1)

        buf32 = x.clone()
        t_fp32 = _timed(lambda: dist.all_reduce(buf32), reps)

        def fp16():
            h = x.to(torch.float16)
            dist.all_reduce(h)
            return h

        t_fp16 = _timed(fp16, reps)

        local = qcomm.OneBitState()  # a one-rank group: the same math, nothing travels
        qcomm.compressed_allreduce(x, local, group=solo)
        math_times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            qcomm.compressed_allreduce(x, local, group=solo)
            math_times.append(time.perf_counter() - t0)
        t_math = statistics.median(math_times)

        ring = 2 * (world - 1) * n // world
        rows.append(
            {
                "n": n,
                "onebit_s": t_onebit,
                "fp32_s": t_fp32,
                "fp16_s": t_fp16,
                "math_s": t_math,
                "onebit_bytes": onebit_bytes,
                "fp32_bytes": ring * 4,
                "fp16_bytes": ring * 2,
                "bound_bytes": 1.05 * (world - 1) / world * qcomm.padded_length(n, world) / 4,
            }
        )
        x = buf32 = state = local = None  # freed before the next size
    return rows


def fmt_n(n):
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def fmt_b(b):
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


def table(results):
    lines = [
        "| ranks | elements | 1-bit ms | fp32 ms | fp16 ms | math ms | fp32/1-bit time | fp16/1-bit time | "
        "1-bit bytes | fp32 bytes | fp16 bytes | fp32/1-bit bytes | within bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, rows in results:
        for r in rows:
            lines.append(
                f"| {world} | {fmt_n(r['n'])} | {r['onebit_s'] * 1e3:.1f} | {r['fp32_s'] * 1e3:.1f} | "
                f"{r['fp16_s'] * 1e3:.1f} | {r['math_s'] * 1e3:.1f} | {r['fp32_s'] / r['onebit_s']:.2f}x | "
                f"{r['fp16_s'] / r['onebit_s']:.2f}x | {fmt_b(r['onebit_bytes'])} | {fmt_b(r['fp32_bytes'])} | "
                f"{fmt_b(r['fp16_bytes'])} | {r['fp32_bytes'] / r['onebit_bytes']:.1f}x | "
                f"{'yes' if r['onebit_bytes'] <= r['bound_bytes'] else 'NO'} |"
            )
    return lines


def render(tables, reps, notes):
    from qcompress.quant import kernels

    ops = (
        "fused csrc kernels"
        if kernels.available() and hasattr(kernels, "onebit_compress")
        else "the pure-torch reference"
    )
    lines = [
        SECTION,
        "",
        f"gloo over 127.0.0.1, 1-bit ops from {ops}. Median of {reps} calls, max over ranks per call. "
        "Bytes are per rank per call (sent; received is "
        f"equal): measured by `qcompress.comm.stats()` for 1-bit, ring volume 2(P-1)/P·N·bytes for "
        f"all_reduce. Bound = 1.05·(P-1)/P·N/4, the 1-bit payload plus 5 % for scales. 'math' = the "
        f"1-bit compression math alone (world-size-1 formula on a one-rank group, no communication), "
        f"measured in the same job. Other jobs share the CPU: compare columns within a row.",
        "",
    ]
    for label, results in tables:
        lines += [f"{label}:", ""] + table(results) + [""]
    lines += notes + [""]
    return "\n".join(lines)


def run_all(worlds, sizes, reps):
    results = []
    for world in worlds:
        t0 = time.time()
        rows = run_ranks(_bench_rank, world, sizes, reps, timeout=3600)[0]
        results.append((world, rows))
        print(f"world {world}: {time.time() - t0:.0f} s", file=sys.stderr)
    return results


def shaping_unavailable(rate) -> str:
    """'' when a shaped namespace can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} missing" if missing else ""


def run_shaped(rate, worlds, sizes, reps, latency="50ms"):
    """Run the same measurements inside a private network namespace whose loopback is shaped to
    `rate` with tbf (see shared/reference/environment.md); the namespace is deleted afterwards."""
    ns = f"qc-bench-comm-{os.getpid()}"
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
    out.close()
    sh = lambda *cmd: subprocess.run(list(cmd), check=True)  # noqa: E731
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "512kb",
            "latency",
            latency,
        )
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            os.path.abspath(__file__),
            "--inner-json",
            out.name,
            "--worlds",
            *map(str, worlds),
            "--sizes",
            *map(str, sizes),
            "--reps",
            str(reps),
        )
        with open(out.name) as f:
            return [(w, rows) for w, rows in json.load(f)]
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        os.unlink(out.name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="1M, 4M, 16M and 64M elements")
    ap.add_argument("--sizes", nargs="+", help="element counts, e.g. 1M 4M (overrides the defaults)")
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 5, 3 with --full)")
    ap.add_argument(
        "--shaped",
        nargs="?",
        const="1gbit",
        default=None,
        metavar="RATE",
        help="also measure on a loopback shaped to RATE (default 1gbit) in a private network "
        "namespace (root, ip and tc needed; skipped with a note otherwise)",
    )
    ap.add_argument("--shaped-sizes", nargs="+", default=["1M", "4M"], help="element counts for --shaped")
    ap.add_argument("--tbf-latency", default="50ms", help="tbf queue limit as latency (packets beyond it drop)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results/comm.md alone")
    ap.add_argument("--inner-json", help=argparse.SUPPRESS)  # used by --shaped inside the namespace
    args = ap.parse_args(argv)
    sizes = (
        [parse_size(s) for s in args.sizes if s != "0"]
        if args.sizes
        else [1 << 20, 4 << 20, 16 << 20] + ([64 << 20] if args.full else [])
    )
    reps = args.reps or (3 if args.full else 5)
    if any(w < 2 for w in args.worlds):
        ap.error("--worlds must be >= 2")
    if args.inner_json:
        results = run_all(args.worlds, sizes, reps)
        tmp = args.inner_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, args.inner_json)
        return
    tables = [("Unshaped loopback", run_all(args.worlds, sizes, reps))] if sizes else []
    notes = [
        "On the unshaped loopback, bandwidth is memory-copy speed, so the 1-bit path wins in time only "
        "where its compression math (column 'math') costs less than moving the fp32 bytes through memory "
        "(see the time ratios); the byte columns are what carries over to real networks."
    ]
    if args.shaped:
        why = shaping_unavailable(args.shaped)
        if why:
            print(f"--shaped skipped: {why}", file=sys.stderr)
            notes.append(f"Shaped run skipped: {why}.")
        else:
            shaped_sizes = [parse_size(s) for s in args.shaped_sizes]
            notes.append(
                "On the shaped link time follows bytes as long as the compression math (column "
                "'math', world-size-1 formula, an upper bound of the per-rank math at P ranks) stays "
                "below the transfer time of the uncompressed all_reduce. tbf drops packets beyond its "
                "queue limit (--tbf-latency); a TCP retransmission timeout then shows up as a ~200 ms "
                "outlier, which the median of the calls absorbs."
            )
            tables.append(
                (
                    f"Loopback shaped to {args.shaped} (tbf, private network namespace; both "
                    f"directions share the one queue)",
                    run_shaped(args.shaped, args.worlds, shaped_sizes, reps, args.tbf_latency),
                )
            )
    text = render(tables, reps, notes)
    print(text)
    if not args.no_write:
        path = common.write_section("comm", "allreduce", text, title="Communication")
        print(f"wrote the all-reduce section of {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
