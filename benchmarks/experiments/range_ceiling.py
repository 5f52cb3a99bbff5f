"""How much of a causal LM's PTQ perplexity excess any choice of weight ranges can remove.

    python benchmarks/experiments/range_ceiling.py --lm runs/gpt2-austen
        [--finetuned RUN/checkpoints/fp32_finetuned.safetensors]
        [--recipes w4_g32,w3_g32] [--steps 200] [--lr 1e-5] [--threads 1] [--out runs/range_ceiling/NAME.json]

The quality target asks the mse observer alone to remove a third of the W4 g32 PTQ excess. The observers
choose each group's range without the loss; this benchmark puts beside them what the loss itself
can buy from the ranges: the same quantized model with every weight frozen and only its per-group
scales trained (range learning's LSQ gradient, AdamW's default betas, no decay) on training
batches for --steps steps, from the input-weighted mse ranges. Rows per recipe, perplexity on the
first --eval-samples held-out blocks and on all of them, and the share of the minmax excess removed:

  minmax            the group's own range (the recipes' default)
  mse               the plain mse search (the weights' own squared error)
  mse weight_by, groups alone
                    observer_kwargs {weight_by: inputs, cross_groups: false}: each group against its
                    own block of E[u u^T] (calibrate_weight_ranges, 8 batches of 64)
  mse weight_by     observer_kwargs {weight_by: inputs}: a row's groups chosen together against the
                    whole E[u u^T] (cross_groups, the default)
  learned ranges    the scales trained on the loss, weights frozen (evaluated every --every steps):
                    qcompress.learn_ranges' step (one AdamW, no decay), in one run

The model is the pretrained --lm, or its FP32 fine-tune (--finetuned: a safetensors state dict,
e.g. quality.py's FP32 baseline run), quantized as `qcompress train`'s PTQ stage does
(quantize_without_training with the job's calibration batches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def cut(v, minmax, fp32):
    return 100.0 * (1.0 - (v - fp32) / (minmax - fp32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm", default=os.path.join(ROOT, "runs", "gpt2-austen"))
    p.add_argument("--finetuned", default=None, metavar="SAFETENSORS")
    p.add_argument("--recipes", default="w4_g32,w3_g32")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-5, help="the scales' lr (quality.py's runs: 0.1 x 1e-4)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    import quality
    from qcompress.config import load_config
    from qcompress.train.data import prepare_data
    from qcompress.train.evaluate import evaluate
    from qcompress.train.models import load_model, load_tokenizer
    from qcompress.train.stages import quantize_without_training

    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.lm)

    def data_for(n):
        return prepare_data(
            "causal-lm",
            os.path.join(a.lm, "train.txt"),
            tok,
            eval_data=os.path.join(a.lm, "heldout.txt"),
            seed=a.seed,
            max_length=128,
            max_eval_samples=n,
        )

    data, first = data_for(None), data_for(a.eval_samples).eval
    model = load_model(a.lm, "causal-lm", None, a.seed)
    if a.finetuned:
        model.load_state_dict(load_file(a.finetuned), strict=False)  # tied weights are saved once

    def ev(m):
        return [evaluate(m, ds, "causal-lm", 64, tok.pad_token_id)["perplexity"] for ds in (first, data.eval)]

    calibration = quality.job_calibration(data.train, tok.pad_token_id)

    def quantized(key, wq):
        _, recipe, _ = quality.RECIPES[key]
        frag = {"compression_training": {"weight_quantization": {"shared_parameters": wq}}}
        return quantize_without_training(model, load_config(os.path.join(ROOT, recipe), frag), calibration)

    fp32 = ev(model)
    blocks = f"first {len(first)} / all {len(data.eval)} held-out blocks"
    print(f"FP32 {fp32[0]:.4f} / {fp32[1]:.4f} ({blocks})", flush=True)
    out = {
        "lm": a.lm,
        "finetuned": a.finetuned,
        "fp32": fp32,
        "blocks": [len(first), len(data.eval)],
        "steps": a.steps,
        "lr": a.lr,
        "batch_size": a.batch_size,
        "recipes": {},
    }
    for key in [k for k in a.recipes.split(",") if k]:
        rows = {}
        t0 = time.perf_counter()
        rows["minmax"] = ev(quantized(key, {"observer": "minmax"}))
        rows["mse"] = ev(quantized(key, {"observer": "mse"}))
        rows["mse weight_by, groups alone"] = ev(
            quantized(key, {"observer": "mse", "observer_kwargs": {"weight_by": "inputs", "cross_groups": False}})
        )
        q = quantized(key, {"observer": "mse", "observer_kwargs": {"weight_by": "inputs"}, "range_learning": True})
        rows["mse weight_by"] = ev(q)
        for label in ("minmax", "mse", "mse weight_by, groups alone", "mse weight_by"):
            r = rows[label]
            print(
                f"{key} {label}: {r[0]:.4f} / {r[1]:.4f}, cut {cut(r[0], rows['minmax'][0], fp32[0]):.1f} / "
                f"{cut(r[1], rows['minmax'][1], fp32[1]):.1f} %",
                flush=True,
            )
        scales = [prm for n, prm in q.named_parameters() if n.endswith("weight_scale")]
        for n, prm in q.named_parameters():
            prm.requires_grad_(n.endswith("weight_scale"))
        opt = torch.optim.AdamW(scales, lr=a.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(a.seed)
        learned, step = {}, 0
        q.train()
        while step < a.steps:
            order = torch.randperm(len(data.train), generator=gen)
            for i in range(0, len(order) - a.batch_size + 1, a.batch_size):
                ids = torch.stack(
                    [torch.as_tensor(data.train[int(j)]["input_ids"]) for j in order[i : i + a.batch_size]]
                )
                loss = q(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if step % a.every == 0 or step == a.steps:
                    q.eval()
                    r = learned[step] = ev(q)
                    q.train()
                    print(
                        f"{key} learned ranges, {step} steps: {r[0]:.4f} / {r[1]:.4f}, cut "
                        f"{cut(r[0], rows['minmax'][0], fp32[0]):.1f} / {cut(r[1], rows['minmax'][1], fp32[1]):.1f} %",
                        flush=True,
                    )
                if step >= a.steps:
                    break
        rows["learned ranges"] = learned
        rows["seconds"] = time.perf_counter() - t0
        out["recipes"][key] = rows
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        tmp = a.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
