"""Engine checkpoint save / load time, and the share the crc32 table (engine.json's size and crc32
of every file, written at save and checked before load) takes, on a 100M-parameter model.

    .venv/bin/python benchmarks/checkpoint_cost.py [--rounds 3] [--dir runs]

One process, ZeRO stage 0, fp32 AdamW after one step (weights 403 MB + state 806 MB). Each round
saves a fresh checkpoint, loads it back, then times qcompress.engine.checkpoint._file_sums (the
table alone) on the saved files; min / median over rounds. The files were just written, so they are
read from the page cache: on a cold disk the table costs a disk read of the checkpoint instead.
Prints one paragraph; --write-results replaces its section of benchmarks/results/engine.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(ROOT, "runs"), help="where the checkpoints go (a disk, not tmpfs)")
    ap.add_argument("--write-results", action="store_true", help="replace its section of benchmarks/results/engine.md")
    a = ap.parse_args(argv)
    import torch
    import torch.nn as nn
    import qcompress as qc
    from qcompress.engine import checkpoint as ck

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
    eng = qc.initialize(model, {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    eng.backward(eng(torch.randn(4, a.width)).square().mean())
    eng.step()
    os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckpt_cost.", dir=a.dir)
    saves, loads, sums, size = [], [], [], 0
    try:
        for i in range(a.rounds):
            d = os.path.join(root, f"c{i}")
            t = time.perf_counter()
            eng.save_checkpoint(d)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            eng.load_checkpoint(d)
            loads.append(time.perf_counter() - t)
            tag = next(n for n in os.listdir(d) if not n.startswith(".") and os.path.isdir(os.path.join(d, n)))
            t = time.perf_counter()
            table = ck._file_sums(os.path.join(d, tag))
            sums.append(time.perf_counter() - t)
            size = sum(v[0] for v in table.values())
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mn, md = min, statistics.median
    text = (
        f"## Engine checkpoints: what the crc32 table costs\n\n"
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB, "
        f"{a.rounds} rounds, {a.threads} threads (min / median): save {mn(saves):.2f} / {md(saves):.2f} s, "
        f"load {mn(loads):.2f} / {md(loads):.2f} s, crc32 table alone {mn(sums):.2f} / {md(sums):.2f} s "
        f"({size / 1e9 / mn(sums):.2f} GB/s): {mn(sums) / mn(saves):.0%} of a save, "
        f"{mn(sums) / mn(loads):.0%} of a load.\n"
    )
    print(text)
    if a.write_results:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import common

        common.write_section("engine", "checkpoint", text, title="Engine costs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
