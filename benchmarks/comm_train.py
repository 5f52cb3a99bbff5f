"""Training throughput of a communication-heavy model: Adam + DDP vs 1-bit Adam vs 0/1 Adam.

Two (or --worlds N ...) gloo ranks train a wide MLP (3 x Linear(4096, 4096), ~50M parameters) on a small batch, so a
step is dominated by moving the gradients (Adam + DDP: a 200 MB fp32 all-reduce per step) or by
the 1-bit path (compression math + ~N/4 bytes). By default the ranks run inside a private network
namespace whose loopback is shaped to 1 Gbit/s with tbf (root, `ip` and `tc` needed; otherwise
the shaping is skipped and said so). The namespace is always deleted afterwards.

Each optimizer's warmup and compression stage are timed separately (the first step of each stage
is excluded: DDP bucket rebuild, buffer allocation). Bytes per rank per step come from
qcompress.comm.stats() for the 1-bit runs (the DDP hook counts the warmup all-reduce) and from the
ring formula 2(P-1)/P * 4N for plain DDP. Writes the '## 1-bit optimizers: training throughput'
section of benchmarks/results/comm.md (other sections are kept).

    python benchmarks/comm_train.py                # shaped 1 Gbit/s when possible, ~3-5 minutes
    python benchmarks/comm_train.py --no-shape     # plain loopback
    python benchmarks/comm_train.py --worlds 2 4   # 2 and 4 ranks, one table each
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

SECTION = "## 1-bit optimizers: training throughput"
WIDTH, LAYERS, BATCH = 4096, 3, 4
# Throughput does not depend on the lr. It is tiny because 1-bit Adam's per-coordinate step is
# lr * (+-bucket RMS) / sqrt(v_i), up to ~1000 lr on this random-target ReLU net: at lr 1e-4 or
# 1e-5 the short run diverged to NaN a few steps after the freeze.
LR = 1e-7


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _configs(args):
    """name -> (factory(params), number of steps, phase(optimizer) read before each step)."""
    import torch
    from qcompress.optim import OneBitAdam, ZeroOneAdam

    w, c = args.warmup_steps, args.compression_steps
    return {
        "Adam + DDP (fp32)": (lambda ps: torch.optim.Adam(ps, lr=LR), 1 + w, lambda o: "all-reduce"),
        "1-bit Adam": (lambda ps: OneBitAdam(ps, lr=LR, freeze_step=w), w + 1 + c, lambda o: o.stage),
        # constant local-step policy (DeepSpeed tutorial: local_step_scaler=1, local_step_clipper=H)
        "0/1 Adam": (
            lambda ps: ZeroOneAdam(
                ps,
                lr=LR,
                var_freeze_step=w,
                var_update_scaler=1,
                local_step_scaler=1,
                local_step_clipper=args.local_steps,
            ),
            w + 1 + c,
            lambda o: "warmup" if not o.counters["frozen"] else "compression",
        ),
    }


def _rank(rank, world, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qcompress.comm as qcomm

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randn(BATCH, WIDTH, generator=gen)
    out = {}
    for name, (make, steps, phase_of) in _configs(args).items():
        model = _model()
        n_params = sum(p.numel() for p in model.parameters())
        ddp = DDP(model, bucket_cap_mb=25)
        opt = make(ddp.parameters())
        if hasattr(opt, "attach_ddp"):
            opt.attach_ddp(ddp)
        phases = {}
        last_phase = None
        for _ in range(steps):
            phase = phase_of(opt)
            dist.barrier()
            qcomm.reset_stats()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            sent = qcomm.stats()["bytes_sent"]
            if phase == last_phase:  # the first step of a phase pays for set-up; skip it
                rec = phases.setdefault(phase, {"times": [], "bytes": []})
                rec["times"].append(float(elapsed))
                rec["bytes"].append(sent)
            last_phase = phase
        out[name] = {"params": n_params, "phases": phases}
        del opt, ddp, model
    return out


def run_ranks_here(args):
    """{world size: results} for every --worlds entry."""
    from ranks import run_ranks

    return {str(w): run_ranks(_rank, w, args, timeout=args.timeout, threads=1)[0] for w in args.worlds}


# ---------------------------------------------------------------------------------------------- shaping
def shaping_unavailable() -> str:
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"{' and '.join(missing)} missing" if missing else ""


def run_shaped(args, argv, script=None, name="train"):
    """Run `script` (default: this file) with --inner-json in a private network namespace whose
    loopback is shaped to args.rate; returns the JSON it wrote. convergence.py shares this."""
    ns = f"qc-bench-{name}-{os.getpid()}"
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
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
            args.rate,
            "burst",
            "512kb",
            "latency",
            "50ms",
        )
        sh("ip", "netns", "exec", ns, sys.executable, os.path.abspath(script or __file__), "--inner-json", out, *argv)
        with open(out) as f:
            return json.load(f)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        os.unlink(out)


# ---------------------------------------------------------------------------------------------- report
def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def render(by_world, link, args, cmd):
    parts = [render_world(res, int(world), link, args, cmd) for world, res in by_world.items()]
    return SECTION + "\n\n" + "\n".join(parts)


def render_world(res, world, link, args, cmd):
    n = next(iter(res.values()))["params"]
    ring = 2 * (world - 1) / world * 4 * n
    bound = 1.05 * (world - 1) / world * n / 4
    rows, thr = [], {}
    for name, r in res.items():
        for phase, rec in r["phases"].items():
            t = _mean(rec["times"])
            sent = ring if name.startswith("Adam") else _mean(rec["bytes"])
            thr[(name, phase)] = world * BATCH / t
            rows.append((name, phase, len(rec["times"]), t, world * BATCH / t, sent))
    base = thr.get(("Adam + DDP (fp32)", "all-reduce"))
    lines = [
        f"### {world} ranks",
        "",
        f"`{cmd}` on {platform.machine()} / {os.cpu_count()} CPUs, {world} gloo ranks (1 thread each), {link}; "
        f"model {LAYERS} x Linear({WIDTH}, {WIDTH}) = {n / 1e6:.1f}M parameters, batch {BATCH} per rank, "
        f"MSE on random data; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1-min load average "
        f"at the end {os.getloadavg()[0]:.1f} (other jobs share the CPU: compare ratios within this table). "
        f"0/1 Adam uses a constant local-step interval H = {args.local_steps} in its compression stage "
        f"(local_step_scaler=1, local_step_clipper={args.local_steps}); times are means over the stage, "
        "first step of each stage excluded, max over ranks per step.",
        "",
        "| optimizer | stage | steps timed | s/step | samples/s | vs Adam+DDP | bytes sent/rank/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, phase, k, t, s, sent in rows:
        ratio = f"{s / base:.2f}x" if base else "n/a"
        src = " (ring formula)" if name.startswith("Adam") else ""
        lines.append(f"| {name} | {phase} | {k} | {t:.3f} | {s:.2f} | {ratio} | {sent / 1e6:.2f} MB{src} |")
    lines += ["", f"Targets, P = {world}, N = {n}:", ""]
    for name in ("1-bit Adam", "0/1 Adam"):
        rec = res.get(name, {}).get("phases", {}).get("compression")
        if rec:
            per_step = _mean(rec["bytes"])
            per_call = max(rec["bytes"])
            ok = per_call <= bound
            lines.append(
                f"- {name} compression-stage bytes per rank per step: mean {per_step / 1e6:.3f} MB, "
                f"max {per_call / 1e6:.3f} MB vs bound 1.05(P-1)/P*N/4 = {bound / 1e6:.3f} MB: "
                f"{'met' if ok else 'NOT met'}."
            )
    one = thr.get(("1-bit Adam", "compression"))
    zo = thr.get(("0/1 Adam", "compression"))
    if base and one:
        lines.append(
            f"- 1-bit Adam compression-stage throughput vs Adam+DDP: {one / base:.2f}x "
            f"(target >= 5x: {'met' if one / base >= 5 else 'NOT met'})."
        )
    if base and zo:
        lines.append(
            f"- 0/1 Adam compression-stage throughput vs Adam+DDP: {zo / base:.2f}x "
            f"(target >= 5x: {'met' if zo / base >= 5 else 'NOT met'})."
        )
    if one and zo:
        lines.append(
            f"- 0/1 Adam vs 1-bit Adam (compression stage): {zo / one:.2f}x "
            f"(target >= 1.5x: {'met' if zo / one >= 1.5 else 'NOT met'})."
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the shaped loopback (default 1gbit)")
    ap.add_argument("--no-shape", action="store_true", help="run on the plain loopback")
    ap.add_argument("--warmup-steps", type=int, default=3, help="freeze step (steps before compression)")
    ap.add_argument("--compression-steps", type=int, default=8, help="compression-stage steps per run")
    ap.add_argument("--local-steps", type=int, default=4, help="0/1 Adam local-step interval H")
    ap.add_argument("--worlds", nargs="+", type=int, default=[2], help="rank counts to run (e.g. 2 4)")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds before the ranks are killed")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results/comm.md alone")
    ap.add_argument("--inner-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup_steps < 2 or args.compression_steps < 2:
        ap.error("--warmup-steps and --compression-steps must be >= 2 (the first of each is not timed)")
    if args.inner_json:
        res = run_ranks_here(args)
        tmp = args.inner_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, args.inner_json)
        return
    t0 = time.time()
    why = "shaping disabled (--no-shape)" if args.no_shape else shaping_unavailable()
    if why:
        print(f"loopback not shaped: {why}", file=sys.stderr)
        res, link = run_ranks_here(args), f"plain loopback (NOT shaped: {why})"
    else:
        inner = [a for a in argv if a not in ("--no-write",)]
        res = run_shaped(args, inner)
        link = f"loopback shaped to {args.rate} (tbf, private network namespace; both directions share the queue)"
    cmd = "python benchmarks/comm_train.py " + " ".join(argv)
    text = render(res, link, args, cmd.strip())
    print(text)
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    if not args.no_write:
        import common

        path = common.write_section("comm", "train", text, title="Communication")
        print(f"wrote the training section of {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
