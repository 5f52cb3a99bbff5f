"""Fake-quantization throughput: our fused kernel vs our reference, torch's fake_quantize op and
a plain copy (the bandwidth limit), side by side in one run.

    python benchmarks/kernels.py                   # default sweep (~3 minutes on 2 cores), printed
    python benchmarks/kernels.py --full            # 1M..64M elements, every mode
    python benchmarks/kernels.py --write-results   # also record it in benchmarks/results/kernels.md

Each configuration is timed in two processes: with the kernels' reused output blocks (the default,
see csrc/cpu/block_cache.h) and with QCOMPRESS_CPU_CACHE_MB=0 (fresh output pages faulted in and
zeroed by the OS on every call, as for any op returning a new tensor from torch's CPU allocator).
`--allocators thp` adds a run with torch's THP_MEM_ALLOC_ENABLE=1.
Ratios are "copy time / op time" (higher is better; 1.0 = copy speed). Forward+backward uses the
clip-aware straight-through gradient and is compared with the time of two copies.
Times are medians of --reps interleaved repeats (benchmarks/common.py). Prints the tables; only
--write-results replaces the quantizer section of benchmarks/results/kernels.md (a run on a busy
machine should not overwrite the recorded figures by accident).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402


def _timeit(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _paired(fns, reps):
    """Median times of several functions, interleaved so that load changes hit all alike."""
    t = common.interleaved({str(i): f for i, f in enumerate(fns)}, repeats=reps)
    return [t[str(i)].median for i in range(len(fns))]


def _configs(full):
    sizes = [1 << 20, 1 << 22, 1 << 24, 1 << 26] if full else [1 << 20, 1 << 24]
    out = []
    for n in sizes:
        for dtype in ("float32", "bfloat16"):
            for bits in (8, 4):
                for sym in (True, False):
                    for gran in ("group128", "channel", "tensor"):
                        for rounding in ("nearest", "stochastic"):
                            big = n == 1 << 24 and dtype == "float32"
                            if not full and not big and not (bits == 8 and rounding == "nearest"):
                                continue  # default run: the whole matrix at the target size only
                            if not full and dtype == "bfloat16" and n != 1 << 24:
                                continue
                            out.append(dict(n=n, dtype=dtype, bits=bits, sym=sym, gran=gran, rounding=rounding))
    return out


def child(args):
    import torch
    from qcompress.quant import api, kernels

    torch.set_num_threads(args.threads)
    if not kernels.available():
        print(f"kernels not built: {kernels.load_error()}", file=sys.stderr)
        sys.exit(2)
    rows = []
    cache = {}
    for cfg in _configs(args.full):
        n, dtype = cfg["n"], getattr(torch, cfg["dtype"])
        key = (n, cfg["dtype"])
        if key not in cache:
            x = torch.randn(n // 4096, 4096).to(dtype)
            y = torch.empty_like(x)
            cache[key] = (x, y)
        x, y = cache[key]
        s = torch.full((x.shape[0],), 0.02)
        zp = torch.zeros(x.shape[0], dtype=torch.int32)
        try:  # timed next to ours (see below) so that both see the same machine load
            torch_fn = lambda: torch.fake_quantize_per_channel_affine(x, s, zp, 0, -128, 127)  # noqa: E731
            torch_fn()
        except RuntimeError:
            torch_fn = None
        kw = dict(symmetric=cfg["sym"], rounding=cfg["rounding"], seed=1)
        if cfg["gran"] == "group128":
            kw.update(granularity="group", group_size=128)
        else:
            kw["granularity"] = cfg["gran"]

        def fwd(backend):
            return lambda: api.fake_quantize(x, cfg["bits"], backend=backend, **kw)

        xg = x.detach().clone().requires_grad_(True)
        g = torch.randn_like(x)

        def fwd_bwd(backend):
            def run():
                y = api.fake_quantize(xg, cfg["bits"], clip_grad=True, backend=backend, **kw)
                torch.autograd.grad(y, xg, g)

            return run

        copy, clone, ours, ours_fb = _paired(
            [lambda: y.copy_(x), lambda: x.clone(), fwd("kernel"), fwd_bwd("kernel")], args.reps
        )
        torch_op = None
        if torch_fn is not None:
            torch_op, ours_again = _paired([torch_fn, fwd("kernel")], 2)
            torch_op *= ours / ours_again  # scale to the load the main measurement saw
        slow_ok = args.full or (cfg["bits"] == 8 and cfg["rounding"] == "nearest")
        ref = _timeit(fwd("reference"), 1) if slow_ok else None
        ref_fb = _timeit(fwd_bwd("reference"), 1) if slow_ok and cfg["gran"] == "group128" else None
        row = dict(cfg, copy=copy, clone=clone, torch_op=torch_op, ours=ours, ours_fb=ours_fb, ref=ref, ref_fb=ref_fb)
        rows.append(row)
        print(_line(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f)


def _r(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


def _line(r):
    return (
        f"| {r['n'] >> 20}M | {r['dtype']} | int{r['bits']} | {'sym' if r['sym'] else 'asym'} | {r['gran']} | "
        f"{r['rounding']} | {r['copy'] * 1e3:.1f} | {r['ours'] * 1e3:.1f} | {_r(r['copy'], r['ours'])} | "
        f"{_r(r['clone'], r['ours'])} | {_r(r['torch_op'], r['ours'])} | {_r(r['ref'], r['ours'])} | "
        f"{_r(2 * r['copy'], r['ours_fb'])} | {_r(r['ref_fb'], r['ours_fb'])} |"
    )


HEADER = (
    "| n | dtype | bits | range | granularity | rounding | copy ms | ours ms | copy/ours | "
    "clone/ours | torch op/ours | reference/ours | fwd+bwd: 2 copies/ours | fwd+bwd: reference/ours |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _targets(rows):
    """The kernels' targets on the 16M fp32 rows: forward >= 0.8x copy and >= 10x torch's op,
    forward+backward <= 1.25x two copies."""
    big = [r for r in rows if r["n"] == 1 << 24 and r["dtype"] == "float32"]
    if not big:
        return ""

    def frac(pred):
        ok = [r for r in big if pred(r)]
        return f"{len(ok)}/{len(big)}"

    fwd = sorted(r["copy"] / r["ours"] for r in big)
    top = sorted(r["torch_op"] / r["ours"] for r in big if r["torch_op"])
    fb = sorted(2 * r["copy"] / r["ours_fb"] for r in big)
    return (
        f"\n\nTargets at 16M fp32 ({len(big)} modes): forward >= 0.8x copy in "
        f"{frac(lambda r: r['copy'] / r['ours'] >= 0.8)} "
        f"(median {fwd[len(fwd) // 2]:.2f}x, range {fwd[0]:.2f}-{fwd[-1]:.2f}); >= 10x torch's op in "
        f"{frac(lambda r: r['torch_op'] and r['torch_op'] / r['ours'] >= 10)}"
        + (f" (median {top[len(top) // 2]:.1f}x)" if top else "")
        + f"; forward+backward <= 1.25x two copies in {frac(lambda r: 2 * r['copy'] / r['ours_fb'] >= 0.8)} "
        f"(median 2 copies/ours {fb[len(fb) // 2]:.2f})."
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the whole sweep (1M..64M, every mode)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--allocators", default="default,nocache", help="comma list of default,nocache,thp")
    p.add_argument(
        "--write-results",
        action="store_true",
        help="replace the quantizer section of benchmarks/results/kernels.md with this run",
    )
    p.add_argument("--no-write", action="store_true", help="accepted for old scripts; printing only is the default now")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.write_results and args.no_write:
        p.error("--write-results and --no-write contradict each other")
    if args.child:
        return child(args)
    tables = []
    for alloc in args.allocators.split(","):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("THP_MEM_ALLOC_ENABLE", None)
        env.pop("QCOMPRESS_CPU_CACHE_MB", None)
        if alloc == "thp":
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        if alloc == "nocache":
            env["QCOMPRESS_CPU_CACHE_MB"] = "0"
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        title = {
            "default": "reused output blocks (default)",
            "nocache": "QCOMPRESS_CPU_CACHE_MB=0 (fresh pages)",
            "thp": "reused output blocks, THP_MEM_ALLOC_ENABLE=1",
        }[alloc] + f", {args.threads} threads"
        print(f"\n{title}\n{HEADER}", flush=True)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--out",
            out,
            "--threads",
            str(args.threads),
            "--reps",
            str(args.reps),
        ] + (["--full"] if args.full else [])
        subprocess.run(cmd, env=env, check=True)
        rows = json.load(open(out))
        os.unlink(out)
        tables.append(f"{title}:\n\n{HEADER}\n" + "\n".join(_line(r) for r in rows) + _targets(rows))
    if args.write_results:
        text = (
            "## Fake quantization vs copy bandwidth\n\n"
            f"Times: median of {args.reps} interleaved repeats. Ratios: copy time / op time "
            "(forward), 2 x copy time / op time (forward + clip-aware backward), higher is better; "
            "clone = copy into a freshly allocated tensor; torch op = "
            "torch.fake_quantize_per_channel_affine; reference = qcompress's pure-torch path.\n\n"
            + "\n\n".join(tables)
            + "\n"
        )
        cmd = common.command([os.path.abspath(__file__)] + list(sys.argv[1:] if argv is None else argv))
        path = common.write_section("kernels", "quantizers", text, title="Kernels", cmd=cmd)
        print(f"\nrecorded in {path}")
    else:
        print("\nbenchmarks/results/kernels.md left as it was (--write-results records this run there)")


if __name__ == "__main__":
    main()
