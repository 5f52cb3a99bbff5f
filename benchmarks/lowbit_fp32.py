"""Weight-only float32 layers on AMX: int8 digits against bf16 pieces, side by side.

    python benchmarks/lowbit_fp32.py [--threads 2] [--tokens 32 64 2048]

For MiniLM's layer shapes (384 -> 384, 384 -> 1536, 1536 -> 384) and the 2048-wide stack's, W4
group 128 and W8 per channel, symmetric: microseconds per `lowbit.linear` call (min over 7 rounds
of 200 calls, after 20 warm-up calls), once with the default float32 path (two int8 digits per
element on the W-A8 tiles) and once with QCOMPRESS_LOWBIT_FP32=pieces (two bf16 pieces on the bf16
tiles), the two timed back to back per shape. Needs a CPU with AMX; elsewhere both rows time the
same vector kernel.

    python benchmarks/lowbit_fp32.py --accuracy

instead prints how far each path's output is from the exact plan's end to end: all-MiniLM-L6-v2
(`make workloads`) exported W4 g128 / W8 per channel, 4 x 64 tokens, the relative difference of the
last hidden state and the largest logit difference, fast against exact, for both paths.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qcompress.quant import lowbit  # noqa: E402

SHAPES = ((384, 384), (1536, 384), (384, 1536), (2048, 2048))   # (out, in)


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
    from qcompress.export import export_quantized, load_quantized
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import inference                                   # its MiniLM folder and recipes
    transformers.logging.set_verbosity_error()
    folder = inference.minilm_folder()
    if folder is None:
        sys.exit("all-MiniLM-L6-v2 not installed (make workloads)")

    def make():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=4).eval()

    ids = torch.randint(1000, 30000, (4, 64), generator=torch.Generator().manual_seed(0))
    print("| weights | outputs compared | last hidden state: relative difference | max logit difference |\n|---|---|---:|---:|")
    for name, doc, _ in inference.SCHEMES[:2]:
        doc = copy.deepcopy(doc)
        for tech in doc["compression_training"].values():
            for grp in tech["different_groups"].values():
                grp["modules"] = ["encoder", "pooler", "classifier"]
        model = make()
        qcompress.init_compression(model, qcompress.load_config(doc))
        model.eval()
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            model(input_ids=ids[:1])                     # the first forward sets the weights' codes
            export_quantized(model, os.path.join(tmp, "ckpt"), force=True)
            exact = load_quantized(os.path.join(tmp, "ckpt"), make())(input_ids=ids, output_hidden_states=True)
            base = make()(input_ids=ids, output_hidden_states=True)     # the quantization's own effect
            hb, he = base.hidden_states[-1], exact.hidden_states[-1]
            print(f"| {name} | exact plan against the FP32 model | {float((he - hb).norm() / hb.norm()):.2e} | "
                  f"{float((exact.logits - base.logits).abs().max()):.2e} |", flush=True)
            fast = load_quantized(os.path.join(tmp, "ckpt"), make(), mode="fast")
            for path in ("digits", "pieces"):
                if path == "pieces":
                    os.environ["QCOMPRESS_LOWBIT_FP32"] = "pieces"
                try:
                    out = fast(input_ids=ids, output_hidden_states=True)
                finally:
                    os.environ.pop("QCOMPRESS_LOWBIT_FP32", None)
                h, he = out.hidden_states[-1], exact.hidden_states[-1]
                print(f"| {name} | fast ({path}) against exact | {float((h - he).norm() / he.norm()):.2e} | "
                      f"{float((out.logits - exact.logits).abs().max()):.2e} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 2048])
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
                print(f"| {name} | {k} -> {n} | {m} | {digits:.1f} | {pieces:.1f} | {pieces / digits:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
