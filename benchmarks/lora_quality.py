"""How much of full-parameter QAT's recovery LoRA QAT gets, on SmolLM2-135M-Instruct at W4 g128.

    python benchmarks/lora_quality.py [--steps 20] [--batch 2] [--seq 256] [--eval-windows 8]
        [--r 16] [--lr-full 2e-5] [--lr-lora 2e-4] [--page lora] [--no-write]

All four rows quantize the same layers the same way (W4, groups of 128, symmetric, minmax, in forward:
every Linear of the 30 decoder blocks; the tied embedding / head stays float) and are evaluated the
same way: perplexity on the first --eval-windows windows of 512 tokens of the Austen held-out split
(model_zoo.lm_corpus: split_corpus(load_corpus("austen"), 0.05, 0)), each window scored on all of
its next-token predictions.
  FP32       the model as loaded
  PTQ        init_compression only (round to nearest)
  full QAT   every weight trains: AdamW at --lr-full, --steps steps of --batch x --seq tokens
  LoRA QAT   adapters of rank r (alpha 2r) on every block Linear, base frozen, the quantizer seeing
             W + (alpha / r) B A: AdamW at --lr-lora, the same steps on the same batches
Training batches are --seq token windows of the first 400k characters of the training split, in a
seeded order, the same for both. Recovery = (PTQ - method) / (PTQ - FP32) in perplexity; the last column is LoRA's
recovery over full QAT's. One seed; read small differences as noise.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

BLOCK_LINEARS = ["self_attn\\.(q|k|v|o)_proj", "mlp\\.(gate|up|down)_proj"]
EVAL_CTX = 512


def compression(lora_r=None) -> dict:
    cc = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantize_weight_in_forward": True,
                "quantization_type": "symmetric",
            },
            "different_groups": {
                "w4": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 128}, "modules": BLOCK_LINEARS}
            },
        }
    }
    if lora_r:
        cc["lora"] = {"enabled": True, "r": lora_r, "alpha": 2 * lora_r, "target_modules": BLOCK_LINEARS, "mode": "qat"}
    return {"compression_training": cc}


def token_ids(tok, cache, train_chars, held_chars):
    """Token ids of the first train_chars / held_chars characters of the two splits (what the run
    reads of them)."""
    from model_zoo.lm_corpus import load_corpus, split_corpus

    train, held = split_corpus(load_corpus("austen", cache), 0.05, 0)
    return (
        tok(train[:train_chars], return_tensors="pt").input_ids[0],
        tok(held[:held_chars], return_tensors="pt").input_ids[0],
    )


def perplexity(model, ids, windows: int, batch: int = 4) -> float:
    import torch
    import torch.nn.functional as F

    chunks = [ids[i * EVAL_CTX : (i + 1) * EVAL_CTX] for i in range(min(windows, len(ids) // EVAL_CTX))]
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            x = torch.stack(chunks[i : i + batch])
            logits = model(input_ids=x).logits[:, :-1].float()
            nll += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
            count += x[:, 1:].numel()
    return math.exp(nll / count)


def batches(ids, steps, batch, seq, seed=0):
    import torch

    n = len(ids) // seq
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: steps * batch]
    return [
        torch.stack([ids[j * seq : (j + 1) * seq] for j in order[s * batch : (s + 1) * batch].tolist()])
        for s in range(steps)
    ]


def train(model, data, lr, log):
    import qcompress as qc

    cfg = {
        "train_micro_batch_size_per_gpu": data[0].shape[0],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
    }
    engine = qc.initialize(model, cfg)
    model.train()
    for i, x in enumerate(data):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        if i % 10 == 0 or i == len(data) - 1:
            log(f"  step {i + 1}/{len(data)} loss {loss.item():.4f}")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--lr-full", type=float, default=2e-5)
    ap.add_argument("--lr-lora", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(ROOT, ".cache"), help="corpus cache folder")
    ap.add_argument("--page", default="lora", help="results page (benchmarks/results/<page>.md)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    import copy

    import torch
    import qcompress as qc
    from model_zoo.smollm2 import load_smollm2

    torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    model, tok = load_smollm2()
    # windows are drawn from the first 400k training characters (~100k tokens); the held-out windows
    # are the first ones of the split
    train_ids, held_ids = token_ids(tok, args.cache, 400_000, 4_000 * args.eval_windows)
    data = batches(train_ids, args.steps, args.batch, args.seq)
    rows, times = {}, {}
    rows["FP32"] = perplexity(model, held_ids, args.eval_windows)
    log(f"FP32 {rows['FP32']:.3f}")
    model.config.use_cache = False

    def fresh():
        return copy.deepcopy(model)

    m = qc.init_compression(fresh(), compression())
    rows["PTQ"] = perplexity(m, held_ids, args.eval_windows)
    log(f"PTQ {rows['PTQ']:.3f}")
    for name, r, lr in (("full QAT", None, args.lr_full), (f"LoRA QAT (r = {args.r})", args.r, args.lr_lora)):
        torch.manual_seed(0)
        m = qc.init_compression(fresh(), compression(r))
        t = time.perf_counter()
        train(m, data, lr, log)
        times[name] = time.perf_counter() - t
        rows[name] = perplexity(m, held_ids, args.eval_windows)
        log(f"{name} {rows[name]:.3f} ({times[name]:.0f} s)")
        del m
    fp, ptq = rows["FP32"], rows["PTQ"]
    rec = {k: (ptq - v) / (ptq - fp) for k, v in rows.items()}
    full = "full QAT"
    lora_name = [k for k in rows if k.startswith("LoRA")][0]
    lines = [
        f"SmolLM2-135M-Instruct, W4 g128 symmetric (minmax) on every decoder-block Linear; perplexity on "
        f"{args.eval_windows} x {EVAL_CTX} held-out Austen tokens. QAT: {args.steps} AdamW steps of "
        f"{args.batch} x {args.seq} tokens, full at lr {args.lr_full:g}, LoRA (r = {args.r}, alpha = {2 * args.r}) "
        f"at lr {args.lr_lora:g}, the same batches.",
        "",
        "| model | perplexity | recovered of PTQ's loss | training time (this machine) |",
        "|---|---|---|---|",
    ]
    for k, v in rows.items():
        rt = f"{rec[k]:.0%}" if k not in ("FP32", "PTQ") else "-"
        lines.append(f"| {k} | {v:.3f} | {rt} | {times[k]:.0f} s |" if k in times else f"| {k} | {v:.3f} | {rt} | - |")
    lines += [
        "",
        f"LoRA QAT recovers {rec[lora_name] / rec[full]:.0%} of what full-parameter QAT recovers "
        f"at the same step count (training time ratio LoRA / full: {times[lora_name] / times[full]:.2f}).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        import common

        common.write_section(args.page, "lora-quality", text, title="LoRA and QLoRA QAT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
