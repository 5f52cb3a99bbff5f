"""Where tensor parallelism first departs from one process: weight codes and static activation ranges.

The tiny Llama of benchmarks/parallel.py with W8A8 and *static* activation ranges (the EMA of each
input's min / max, all-reduced over the TP group where the input is split) trains --steps steps at
a constant LR. After step 1 and the last step, each run is compared with the unperturbed single
process: how many integer weight codes differ (the TP2 shards joined back), the largest relative
difference of any static range, and the step's loss. The controls are single processes: initial
weights nudged by one ulp, and row-parallel layers summed as two halves (TP's order).
Writes benchmarks/results/parallel.md (section "flips").

    .venv/bin/python benchmarks/parallel_flips.py [--steps 5]
"""

from __future__ import annotations

import argparse

import torch

import common
import parallel as P
from ranks import run_ranks

ROW_PARALLEL = ("o_proj", "down_proj")  # transformers' Llama plan; the others are column-parallel


def _snapshot(model) -> dict:
    """{module: (this rank's weight codes, static range min, max)} of every quantized Linear."""
    from qcompress.nn.sharded import is_dtensor, weight_codes
    from qcompress.quant.api import quantize_spec

    out = {}
    for name, mod in model.named_modules():
        if getattr(mod, "qc_wq", None) is None:
            continue
        q = weight_codes(mod)[0] if is_dtensor(mod.weight) else quantize_spec(mod.weight.detach(), mod.qc_wq.spec())[0]
        obs = mod.qc_aq.observer
        out[name] = (q.clone(), float(obs.min), float(obs.max))
    return out


def run(rank: int, world: int, steps: int, opts: dict):
    import qcompress as qc

    torch.set_num_threads(1)
    doc = P._doc(P.SCHEMES["W8A8"], world, 1, 1, dict(opts, steps=steps))
    doc["compression_training"]["activation_quantization"]["shared_parameters"]["range_calibration"] = "static"
    model = qc.init_compression(P._model(opts.get("ulp_seed")), qc.load_config(doc))
    engine = qc.initialize(model, doc)
    if opts.get("tp_order"):
        P.sum_in_tp_order(model)
    it = P._micro_batches(P._data(steps), steps, 0, 1)
    snaps, losses = {}, []
    for s in range(1, steps + 1):
        losses.append(float(engine.train_batch(it)))
        if s in (1, steps):
            snaps[s] = _snapshot(model)
    return snaps, losses


def compare(base, ranks, step: int):
    """(codes differing, codes in all, largest relative static-range difference, |loss difference|)."""
    differ = total = 0
    worst = 0.0
    for name, (q, lo, hi) in base[0][step].items():
        parts = [r[0][step][name] for r in ranks]
        joined = torch.cat([p[0] for p in parts], 1 if name.endswith(ROW_PARALLEL) else 0)
        differ += int((joined != q).sum())
        total += q.numel()
        worst = max(worst, abs(parts[0][1] - lo) / abs(lo), abs(parts[0][2] - hi) / abs(hi))
    return differ, total, worst, abs(ranks[0][1][step - 1] - base[1][step - 1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    opts = dict(lr=args.lr, warmup=0)
    base = run(0, 1, args.steps, opts)
    runs = [
        ("1 process, initial weights +1 ulp (seed 1)", [run(0, 1, args.steps, dict(opts, ulp_seed=1))]),
        ("1 process, initial weights +1 ulp (seed 2)", [run(0, 1, args.steps, dict(opts, ulp_seed=2))]),
        ("1 process, row-parallel layers summed as two halves", [run(0, 1, args.steps, dict(opts, tp_order=True))]),
        ("TP2", run_ranks(run, 2, args.steps, opts, timeout=1800)),
    ]
    rows = [
        "| run | after step | weight codes differing | largest static-range difference (relative) "
        "| loss difference (abs) |",
        "|---|---|---|---|---|",
    ]
    for label, out in runs:
        for step in (1, args.steps):
            differ, total, worst, dloss = compare(base, out, step)
            rows.append(f"| {label} | {step} | {differ} of {total} | {worst:.1e} | {dloss:.1e} |")
            print(rows[-1], flush=True)
    text = (
        f"W8A8 with static activation ranges, {args.steps} steps at a constant LR {args.lr:g}, each run "
        "against the unperturbed single process (the loss difference is that of the step's own loss, "
        "computed before its update).\n\n" + "\n".join(rows) + "\n"
    )
    common.write_section("parallel", "flips", text, title="Tensor and pipeline parallelism")


if __name__ == "__main__":
    main()
