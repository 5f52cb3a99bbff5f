"""Do the rotations keep SmolLM2-135M's function, and how much do they buy W4A8 / W4A4 RTN?

    python benchmarks/experiments/rotations_smollm2.py [--eval-blocks 8] [--cache DIR]

SmolLM2-135M-Instruct (model_zoo/smollm2.py) in float32; Jane Austen's held-out text
(model_zoo/lm_corpus.py, 5 % of the sections, seed 0), the first --eval-blocks blocks of 512
tokens. Prints (1) the largest relative logit difference of the model rotated by R1 R2 and by
R1 R2 R4 against the original, and (2) held-out perplexity of round-to-nearest quantization (minmax
ranges, no calibration, symmetric) without rotations, with R4 alone and with R1 R2 R4: W4A16
(weights per channel), W4A8 (int8 per-token activations), W4A4 (int4 per-token activations) and
NVFP4 W4A4. A probe: it writes no results page (the SmolLM2 page is benchmarks/llm.py's).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))
import lm_eval  # noqa: E402

LINEARS = "^(?!.*(embed|lm_head))"
R124 = ["R1", "R2", "R4"]
# name: (weight params, activation (format, bits) or None)
RECIPES = {
    "W4A16 (channel)": ({"granularity": "channel"}, None),
    "W4A8 (channel)": ({"granularity": "channel"}, ("int", 8)),
    "W4A4 (channel, per-token int4)": ({"granularity": "channel"}, ("int", 4)),
    "NVFP4 W4A4": ({"format": "nvfp4"}, ("nvfp4", 4)),
}
COLUMNS = (None, ["R4"], R124)


def doc(weights, acts, rotations):
    cc = {}
    if weights is not None:
        cc["weight_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
            },
            "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4, **weights}, "modules": [LINEARS]}},
        }
    if acts is not None:
        fmt, bits = acts
        shared = {
            "enabled": True,
            "quantization_type": "symmetric",
            "schedule_offset": 0,
            "range_calibration": "dynamic",
        }
        if fmt != "int":
            shared["format"] = fmt
        cc["activation_quantization"] = {
            "shared_parameters": shared,
            "different_groups": {"a": {"params": {"bits": bits}, "modules": [LINEARS]}},
        }
    if rotations:
        cc["rotation"] = {"enabled": True, "rotations": rotations, "type": "hadamard"}
    return {"compression_training": cc}


def perplexity(model, blocks, batch=4):
    return lm_eval.perplexity(model, blocks, batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eval-blocks", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache"))
    a = p.parse_args(argv)
    import torch
    import qcompress as qc
    from model_zoo import lm_corpus
    from model_zoo.smollm2 import load_smollm2

    torch.manual_seed(0)
    base, tok = load_smollm2()
    _, held_text = lm_corpus.split_corpus(lm_corpus.load_corpus("austen", a.cache), 0.05, 0)
    ids = tok(held_text, add_special_tokens=False)["input_ids"]
    n = min(a.eval_blocks, len(ids) // a.context)
    held = torch.tensor(ids[: n * a.context]).view(n, a.context)
    print(
        f"held-out: {n} blocks of {a.context} tokens ({n * a.context:,} tokens); torch threads "
        f"{torch.get_num_threads()} (shared machine: timings are indicative only)"
    )
    with torch.no_grad():
        ref = base(input_ids=held[:2]).logits
    for rots in (["R1", "R2"], R124):
        m = copy.deepcopy(base)
        t0 = time.time()
        qc.apply_rotations(m, doc(None, None, rots))
        dt = time.time() - t0
        with torch.no_grad():
            out = m(input_ids=held[:2]).logits
        rel = float((out - ref).abs().max() / ref.abs().max())
        print(f"FP32 {' '.join(rots)}: max |logit diff| / max |logit| = {rel:.2e} (rotation took {dt:.1f} s)")
        print("  " + qc.summary(m).splitlines()[-1])
    fp32 = perplexity(base, held)
    print(f"\nperplexity, FP32: {fp32:.3f}")
    print("| recipe (RTN) | no rotation | R4 | R1 R2 R4 |")
    print("|---|---|---|---|")
    for name, (weights, acts) in RECIPES.items():
        got = []
        for rots in COLUMNS:
            m = copy.deepcopy(base)
            cfg = doc(weights, acts, rots)
            qc.init_compression(m, cfg)
            qc.CompressionScheduler(m, cfg).finish()
            got.append(perplexity(m.eval(), held))
        print(f"| {name} | " + " | ".join(f"{p:.3f}" for p in got) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
