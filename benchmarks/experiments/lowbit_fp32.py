"""Weight-only float32 layers: int8 digits against the earlier float paths, side by side.

    python benchmarks/experiments/lowbit_fp32.py [--threads 2] [--tokens 1 32 64 2048]

For MiniLM's and GPT-2's layer shapes (384 -> 384, 384 -> 1536, 1536 -> 384) and the 2048-wide
stack's, W4 group 128 and W8 per channel, symmetric: microseconds per `lowbit.linear` call (min over
7 rounds of 200 calls, after 20 warm-up calls), once with the default float32 path (two int8 digits
per element: on the W-A8 tiles from 16 tokens, on the VNNI W-A8 kernel below that) and once with
QCOMPRESS_LOWBIT_FP32=pieces (the bf16 pieces on the bf16 tiles from 16 tokens, the float kernel
below), the two timed back to back per shape. Needs AVX-512 VNNI, and AMX for 16 tokens or more;
elsewhere both rows time the same kernel.

    python benchmarks/experiments/lowbit_fp32.py --accuracy

instead prints how far each path's output is from the exact plan's end to end: all-MiniLM-L6-v2
(`make workloads`) exported W4 g128 / W8 per channel, 4 x 64 tokens (tiles) and 1 x 8 (GEMV), the
relative difference of the last hidden state and the largest logit difference, fast against exact for
both paths, and exact against the FP32 model.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from qcompress.quant import lowbit  # noqa: E402

SHAPES = ((384, 384), (1536, 384), (384, 1536), (2048, 2048))  # (out, in)


def per_call_us(fn, reps=200, rounds=7):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def accuracy():
    import copy
    import tempfile
    import transformers
    import qcompress
    from qcompress.export import export_quantized

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import inference  # its MiniLM folder and recipes

    transformers.logging.set_verbosity_error()
    folder = inference.minilm_folder()
    if folder is None:
        sys.exit("all-MiniLM-L6-v2 not installed (make workloads)")

    def make():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=4).eval()

    g = torch.Generator().manual_seed(0)
    print(
        "| weights | tokens | outputs compared | last hidden state: relative difference | max logit difference |\n"
        "|---|---|---|---:|---:|"
    )
    for name, doc, _ in inference.SCHEMES[:2]:
        doc = copy.deepcopy(doc)
        for tech in doc["compression_training"].values():
            for grp in tech["different_groups"].values():
                grp["modules"] = ["encoder", "pooler", "classifier"]
        model = make()
        qcompress.init_compression(model, qcompress.load_config(doc))
        model.eval()
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            model(input_ids=torch.randint(1000, 30000, (1, 64), generator=g))  # sets the weights' codes
            ckpt = os.path.join(tmp, "ckpt")
            export_quantized(model, ckpt, force=True)
            for shape in ((4, 64), (1, 8)):  # 4 x 64 tokens: the AMX tiles; 8: the digit GEMV
                compare(name, make, ckpt, torch.randint(1000, 30000, shape, generator=g))


def compare(name, make, ckpt, ids):
    """Rows of --accuracy for one export and input: exact against FP32, fast (both paths) against exact."""
    from qcompress.export import load_quantized

    tokens = " x ".join(map(str, ids.shape))

    def row(what, out, ref):
        h, hr = out.hidden_states[-1], ref.hidden_states[-1]
        print(
            f"| {name} | {tokens} | {what} | {float((h - hr).norm() / hr.norm()):.2e} | "
            f"{float((out.logits - ref.logits).abs().max()):.2e} |",
            flush=True,
        )

    with torch.no_grad():
        exact = load_quantized(ckpt, make())(input_ids=ids, output_hidden_states=True)
        row("exact plan against the FP32 model", exact, make()(input_ids=ids, output_hidden_states=True))
        fast = load_quantized(ckpt, make(), mode="fast")
        for path in ("digits", "pieces"):
            if path == "pieces":
                os.environ["QCOMPRESS_LOWBIT_FP32"] = "pieces"
            try:
                row(f"fast ({path}) against exact", fast(input_ids=ids, output_hidden_states=True), exact)
            finally:
                os.environ.pop("QCOMPRESS_LOWBIT_FP32", None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 64, 2048])
    ap.add_argument("--accuracy", action="store_true", help="end-to-end difference to the exact plan instead")
    args = ap.parse_args()
    if not lowbit.available():
        sys.exit("the qcompress extension is not built (make build)")
    torch.set_num_threads(args.threads)
    if args.accuracy:
        return accuracy()
    g = torch.Generator().manual_seed(0)
    print(f"lowbit kernels: {lowbit.isa()}, {args.threads} threads")
    print("| weights | layer | tokens | digits (us) | pieces (us) | pieces / digits |\n|---|---|---:|---:|---:|---:|")
    for bits, name in ((4, "W4 g128"), (8, "W8 channel")):
        for m in args.tokens:
            for n, k in SHAPES:
                group = 128 if bits == 4 else k
                q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=g, dtype=torch.int8)
                s = torch.rand(n, -(-k // group), generator=g) * 0.01 + 1e-3
                p = lowbit.prepack(q, s, None, group, lowbit.container_bits(bits))
                x = torch.randn(m, k, generator=g)
                call = lambda: lowbit.linear(x, p, None, n, group, lowbit.container_bits(bits))  # noqa: E731
                digits = per_call_us(call)
                os.environ["QCOMPRESS_LOWBIT_FP32"] = "pieces"
                try:
                    pieces = per_call_us(call)
                finally:
                    del os.environ["QCOMPRESS_LOWBIT_FP32"]
                print(
                    f"| {name} | {k} -> {n} | {m} | {digits:.1f} | {pieces:.1f} | {pieces / digits:.2f}x |", flush=True
                )


if __name__ == "__main__":
    main()
