"""Where `int8_forward: auto` pays: one QAT step of the W8A8 / W4A8 g128 recipes with
the integer forward at each instruction set the low-bit kernels can be held to, against FP32 and
the float forward, interleaved in one process (min and median of --rounds steps after 2 warm-ups).

    nice -n 10 .venv/bin/python benchmarks/experiments/int8_forward_isa.py [--models bert,llama] [--rounds 5]

The models and steps are benchmarks/train_step.py's; the integer rows force `int8_forward: true`.
`auto` turns it on at avx512_vnni and amx only, where it is not slower than the float forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import train_step  # noqa: E402  (sets the paths and offline flags)

ISAS = ("avx2", "avx512", "avx512_vnni", "amx")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,llama")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    import torch
    from qcompress.quant import lowbit

    torch.set_num_threads(a.threads)
    best = lowbit.isa("auto")
    isas = ISAS[: ISAS.index(best) + 1] if best in ISAS else ()
    print(f"best ISA {best}; {a.threads} threads; {a.rounds} rounds")
    for model_name in a.models.split(","):
        rows = [("FP32", "fp32", None)]
        for recipe in ("w8a8", "w4a8"):
            rows.append((f"{recipe} float forward", f"qc_{recipe}_float", None))
            train_step.VARIANTS[f"qc_{recipe}_int8"] = ("qcompress", f"{recipe}+int8")  # int8_forward: true
            rows += [(f"{recipe} integer forward @ {isa}", f"qc_{recipe}_int8", isa) for isa in isas]
        steps = {v: train_step.setup(model_name, v)[2] for v in {r[1] for r in rows}}
        for f in steps.values():
            f(), f()
        times = {r[0]: [] for r in rows}
        for _ in range(a.rounds):
            for label, v, isa in rows:
                lowbit.isa(isa or best)
                t = time.perf_counter()
                steps[v]()
                times[label].append(time.perf_counter() - t)
        lowbit.isa(best)
        f_min, f_med = min(times["FP32"]), statistics.median(times["FP32"])
        print(
            f"\n{train_step.TITLES[model_name]}\n\n"
            "| variant | step s min / median | vs FP32 min / median |\n|---|---:|---:|"
        )
        for label, _, _ in rows:
            t = times[label]
            print(
                f"| {label} | {min(t):.3f} / {statistics.median(t):.3f} | "
                f"{min(t) / f_min:.3f} / {statistics.median(t) / f_med:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
