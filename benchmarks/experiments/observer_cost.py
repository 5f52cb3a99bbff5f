"""What choosing weight ranges costs (the range observers), side by side in one run: minmax, the
mse grid search and the input-weighted search (observer_kwargs.weight_by: inputs), each through
the fused CPU kernel and through the torch reference (`backend="reference"`), and the weighted
search with cross_groups (each row's groups chosen together against the whole E[u u^T]: the
per-group kernel search, then quant/cross_groups.py's descent, torch only), on square weights and,
with --lm, on a pretrained causal LM's own weights and input moments.

    python benchmarks/experiments/observer_cost.py [--sizes 1024,4096] [--lm runs/gpt2-austen] [--threads 2]

Prints a markdown table: ms per weight matrix, seconds per million weights, and each search's
time over minmax's and over the kernel's, and whether the two backends chose the same factors
(the tests hold both to a brute-force oracle: tests/quant/test_input_weighting.py, tests/nn/test_ranges.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from qcompress.quant import kernels, observers  # noqa: E402
from qcompress.quant.reference import make_spec  # noqa: E402

SPEC = make_spec(4, symmetric=True, granularity="group", group_size=32)


def best_of(fn, repeat: int):
    """(least time of `repeat` calls, the last call's result)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def moments_of(u: torch.Tensor, b: int):
    """([cols / b, b, b] blocks of E[u u^T] over each group's columns, float64; the whole E[u u^T],
    float32, as calibrate_weight_ranges keeps it)."""
    n, cols = u.shape
    v = u.double().reshape(n, cols // b, b)
    full = u.double().T @ u.double() / n
    return torch.einsum("ngi,ngj->gij", v, v) / n, full.to(torch.float32)


def rows_for(label: str, weights, repeat: int) -> list:
    """weights: [(w, (block moments, whole moments))]; one row per (observer, backend)."""
    numel = sum(w.numel() for w, _ in weights)
    cases = [
        ("minmax", None, False),
        ("mse", None, False),
        ("mse", "reference", False),
        ("mse weight_by inputs, groups alone", None, True),
        ("mse weight_by inputs, groups alone", "reference", True),
        ("mse weight_by inputs, cross_groups", None, "cross"),
    ]
    out, base, kernel_time, kernel_choice = [], None, {}, {}
    for name, backend, weighted in cases:
        if name == "minmax":
            fn = lambda: [observers.weight_params(w, SPEC, "minmax") for w, _ in weights]  # noqa: E731
        else:
            fn = lambda: [
                observers.mse_shrink(
                    w,
                    SPEC,
                    backend=backend,  # noqa: E731
                    moments=m[0] if weighted else None,
                    cross=m[1] if weighted == "cross" else None,
                )
                for w, m in weights
            ]
        t, chosen = best_of(fn, repeat if backend is None and weighted != "cross" else 1)
        base = t if base is None else base
        if backend is None and weighted != "cross":
            kernel_time[name], kernel_choice[name] = t, chosen
        vs_kernel, same = "", ""
        if backend is not None:
            vs_kernel = f"{t / kernel_time[name]:.1f}x"
            got = kernel_choice[name]
            differ = sum(int((a != b).sum()) for a, b in zip(got, chosen))
            groups = sum(a.numel() for a in got)
            same = "all equal" if differ == 0 else f"{differ} of {groups} differ"
        search = backend or ("-" if name == "minmax" else "kernel + descent" if weighted == "cross" else "kernel")
        out.append(
            f"| {label} | {name} | {search} | {t * 1e3:.0f} | "
            f"{t / numel * 1e6:.3f} | {t / base:.0f}x | {vs_kernel} | {same} |"
        )
    return out


def lm_weights(path: str, batches: int = 4):
    """The causal LM's 2-D weights quantized by the W4 g32 recipe, each with the input moments of
    the module that multiplies by it (lm_head's for the tied embedding), from held-out text."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = {}

    def hook(name):
        def record(mod, args):
            inputs.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
    ]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randint(0, model.config.vocab_size, (8, 128), generator=g))
    for h in handles:
        h.remove()
    out = []
    for name, m in model.named_modules():
        if name not in inputs:
            continue
        w = m.weight.detach()
        w = w.t().contiguous() if type(m).__name__ == "Conv1D" else w  # [out, in]
        if w.shape[1] % 32:
            continue
        out.append((w, moments_of(torch.cat(inputs[name]), 32)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--lm", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not kernels.available():
        raise SystemExit("the C++ extension is not built: run `make build` first")
    print(
        f"torch {torch.__version__}, {a.threads} thread(s), W4 g32 symmetric, grid of 80 shrink factors + "
        f"least-squares refinement; load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| weights | observer | search | ms | s per M weights | vs minmax | reference / kernel | "
        "factors, kernel vs reference |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    for n in (int(s) for s in a.sizes.split(",")):
        w = torch.randn(n, n, generator=g) * 0.02
        u = torch.randn(2048, n, generator=g) @ (torch.eye(n) + 0.05 * torch.randn(n, n, generator=g))
        for line in rows_for(f"{n} x {n}", [(w, moments_of(u, 32))], a.repeat):
            print(line, flush=True)
    if a.lm:
        weights = lm_weights(a.lm)
        label = (
            f"{os.path.basename(a.lm.rstrip('/'))} ({len(weights)} matrices, "
            f"{sum(w.numel() for w, _ in weights) / 1e6:.1f}M weights)"
        )
        for line in rows_for(label, weights, a.repeat):
            print(line, flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
