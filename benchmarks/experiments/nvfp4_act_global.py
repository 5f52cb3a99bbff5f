"""Should NVFP4 activations take a smaller static global scale than the calibrated maximum?

    python benchmarks/experiments/nvfp4_act_global.py [--blocks 4] [--cache DIR]

NVFP4 activations (groups of 16) get a dynamic e4m3 scale per group under one static FP32 global
scale, 448 * 6 / amax. Taking amax smaller than the calibrated maximum clips the largest groups'
scales at e4m3's 448 but gives every other group's scale more of e4m3's range. SmolLM2-135M-Instruct
(model_zoo/smollm2.py) in float32 reads --blocks training blocks of 512 Austen tokens; for every
Linear but the lm_head, its inputs X are fake-quantized to NVFP4 with the global scale of
amax * factor, and the layer's relative output error |(Q(X) - X) W^T|^2 / |X W^T|^2 is printed per
factor (a few layers, then the sum over all). A probe: it writes no results page.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))
import lm_eval  # noqa: E402

FACTORS = (1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 64)


def inputs(model, x) -> dict:
    """Each Linear's (but the lm_head's) inputs on the batch x, as [tokens, features]."""
    import torch

    got: dict = {}

    def keep(name):
        def hook(_mod, args):
            got[name] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    hooks = [
        m.register_forward_pre_hook(keep(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    ]
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    return got


def output_error(X, W, factor: float) -> float:
    import torch

    from qcompress.quant import floats

    spec = floats.float_spec("nvfp4", "group", 16)
    a = X.abs().amax() * factor
    g = floats.global_scale(-a, a)
    s, g = floats.qparams(X, spec, g)
    with torch.no_grad():
        ref = X @ W.T
        q = floats.fake_quantize_float(X, spec, scale=s, gscale=g)
        return float(((q @ W.T - ref) ** 2).mean() / (ref**2).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache"))
    a = p.parse_args(argv)
    import torch

    from model_zoo.smollm2 import load_smollm2

    torch.manual_seed(0)
    model, tok = load_smollm2()
    train, order, _ = lm_eval.austen_blocks(tok, 512, 1, 0, a.cache)
    xs = inputs(model, train[order[: a.blocks]])
    weights = dict(model.named_modules())
    print("relative output error per factor of the calibrated range: " + " ".join(f"{f:g}" for f in FACTORS))
    total = [0.0] * len(FACTORS)
    for name, X in xs.items():
        errs = [output_error(X, weights[name].weight.detach(), f) for f in FACTORS]
        total = [t + e for t, e in zip(total, errs)]
        if ".layers.0." in name or ".layers.29." in name or name.endswith("down_proj"):
            print(f"{name:38s} amax {float(X.abs().amax()):9.2f}  " + " ".join(f"{e:.2e}" for e in errs))
    print("sum over layers" + " " * 40 + " ".join(f"{t:.3f}" for t in total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
