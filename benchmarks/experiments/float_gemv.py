"""Where the few-token float kernel (csrc/cpu/float_gemv.cpp) pays against torch's CPU matmul, on
an LLM head's shape (32000 x 768, the lm_head of benchmarks/serving_speed.py's model): float32
and bfloat16 weights, 1 to 16 tokens, at each instruction set the kernel can be held to,
interleaved in one process (median of --rounds calls). A copy of the weight into a buffer
(`dst.copy_(w)`, which reads and writes its bytes) is the bandwidth reference: a ratio near 2 there means the matmul
reads the weight at memory speed.

    .venv/bin/python benchmarks/experiments/float_gemv.py [--rounds 15] [--threads 2]

load_quantized(mode="fast") gives the kernel to unquantized Linears at up to
qcompress/export/fast/float_linear.py's MAX_TOKENS tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import common  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", default="32000x768")
    a = p.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import qcompress  # noqa: F401  (loads the operators)
    from qcompress.quant import lowbit

    torch.set_num_threads(a.threads)
    n, k = (int(v) for v in a.shape.split("x"))
    best = lowbit.isa("auto")
    isas = ["avx2"] + (["avx512"] if best in ("avx512", "avx512_vnni", "amx") else [])
    print(f"best ISA {best}; {a.threads} threads; weight {n} x {k}; median of {a.rounds}")
    print("| dtype | tokens | ISA | torch ms | qcompress ms | torch / qcompress | copy / qcompress |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k).to(dtype)
        dst = torch.empty_like(w)
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(1, m, k).to(dtype)
            for isa in isas:
                lowbit.isa(isa)
                t = common.interleaved(
                    {
                        "torch": lambda: F.linear(x, w),
                        "ours": lambda: torch.ops.qcompress.float_gemv(x, w, None),
                        "copy": lambda: dst.copy_(w),
                    },
                    repeats=a.rounds,
                )
                ours = t["ours"].median
                print(
                    f"| {str(dtype).split('.')[1]} | {m} | {isa} | {t['torch'].median * 1e3:.2f} | {ours * 1e3:.2f} "
                    f"| {t['torch'].median / ours:.2f}x | {t['copy'].median / ours:.2f} |"
                )
    lowbit.isa("auto")


if __name__ == "__main__":
    main()
