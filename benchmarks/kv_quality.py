"""KV-cache quantization on a real pretrained LLM: SmolLM2-135M-Instruct (model_zoo/smollm2.py).

    python benchmarks/kv_quality.py [--rows fp32,fp32_fp8,...] [--write-results]
    python benchmarks/kv_quality.py --list

Each row's perplexity on Jane Austen's held-out text (model_zoo/lm_corpus.py: 5 % of the sections
held out, seed 0; --eval-blocks consecutive blocks of --context tokens), against the same model
without KV-cache quantization:
  fp32_*   the float32 checkpoint with the cache quantized (compression_training.kv_cache_quantization),
           its static ranges calibrated on --calib-blocks training blocks in train mode;
  qat_*    W4 g128 symmetric weights (minmax) trained --steps optimizer steps of --batch training blocks
           through the engine (AdamW --lr, constant), the cache quantized in the loop from the first
           step (its ranges calibrated as training runs), against the same trained model with the
           cache quantizers switched off, and against `qat`, the same run without them.
Every row starts from the same checkpoint and reads the same batches. Targets (the issue's): FP8
KV <= 1.005 x and int8 KV <= 1.01 x the perplexity without KV quantization, before and after QAT.
Finished rows are kept in --out/summary.json with their settings and reused unless --rerun.
--write-results replaces the generated section `smollm2` of benchmarks/results/kv_cache.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import common  # noqa: E402
import lm_eval  # noqa: E402

LINEARS = "^(?!.*(embed|lm_head))"  # every Linear of the decoder; embeddings and lm_head stay float

# key: (base row it is compared with, label, KV (format, strategy) or None, QAT?)
ROWS = {
    "fp32": (None, "FP32, no KV quantization", None, False),
    "fp32_fp8": ("fp32", "FP32 + FP8 (e4m3) KV per tensor", ("fp8_e4m3", "tensor", "minmax"), False),
    "fp32_fp8_head": ("fp32", "FP32 + FP8 (e4m3) KV per head", ("fp8_e4m3", "head", "minmax"), False),
    "fp32_fp8_mse": ("fp32", "FP32 + FP8 (e4m3) KV per tensor, mse observer", ("fp8_e4m3", "tensor", "mse"), False),
    "fp32_int8": ("fp32", "FP32 + int8 KV per tensor", ("int8", "tensor", "minmax"), False),
    "fp32_int8_head": ("fp32", "FP32 + int8 KV per head", ("int8", "head", "minmax"), False),
    "qat": (None, "W4 g128 QAT, no KV quantization", None, True),
    "qat_fp8": ("qat", "W4 g128 QAT with FP8 KV per tensor in the loop", ("fp8_e4m3", "tensor", "minmax"), True),
    "qat_fp8_head": ("qat", "W4 g128 QAT with FP8 KV per head in the loop", ("fp8_e4m3", "head", "minmax"), True),
    "qat_fp8_mse": (
        "qat",
        "W4 g128 QAT with FP8 KV per tensor (mse observer) in the loop",
        ("fp8_e4m3", "tensor", "mse"),
        True,
    ),
    "qat_int8": ("qat", "W4 g128 QAT with int8 KV per tensor in the loop", ("int8", "tensor", "minmax"), True),
    "qat_int8_head": ("qat", "W4 g128 QAT with int8 KV per head in the loop", ("int8", "head", "minmax"), True),
}
TARGET = {"fp8_e4m3": 1.005, "int8": 1.01}


def config_doc(key: str, a) -> dict:
    _, _, kv, qat = ROWS[key]
    doc = {
        "train_batch_size": a.batch,
        "train_micro_batch_size_per_gpu": a.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0}},
    }
    cc = {}
    if qat:
        cc["weight_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
                "schedule_offset": 0,
            },
            "different_groups": {
                "w": {
                    "params": {
                        "start_bits": 4,
                        "target_bits": 4,
                        "quantization_period": 0,
                        "granularity": "group",
                        "group_size": 128,
                    },
                    "modules": [LINEARS],
                }
            },
        }
    if kv is not None:
        cc["kv_cache_quantization"] = {
            "enabled": True,
            "format": kv[0],
            "strategy": kv[1],
            "range_calibration": "static",
            "observer": kv[2],
        }
    if cc:
        doc["compression_training"] = cc
    return doc


def load_data(a, tok):
    return lm_eval.austen_blocks(tok, a.context, a.eval_blocks, a.seed, a.cache)


perplexity = lm_eval.perplexity


def run_row(key: str, base, train_blocks, order, held, a) -> dict:
    import qcompress as qc
    from qcompress.train.stages import calibrate_static_ranges

    t0 = time.time()
    model = copy.deepcopy(base)
    cfg = qc.load_config(config_doc(key, a))
    _, label, kv, qat = ROWS[key]
    if kv is not None or qat:
        qc.init_compression(model, cfg)
    if qat:
        engine = qc.initialize(model, cfg, device="cpu")
        model.train()
        for step in range(a.steps):
            x = train_blocks[[order[(step * a.batch + j) % len(order)] for j in range(a.batch)]]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            if step % 10 == 0 or step == a.steps - 1:
                print(f"    step {step + 1}/{a.steps} loss {float(loss.detach()):.4f}", flush=True)
    elif kv is not None:
        tail = order[len(order) - a.calib_blocks :]  # training batches read the order from its start
        calibrate_static_ranges(model, [{"input_ids": train_blocks[tail[i : i + 4]]} for i in range(0, len(tail), 4)])
    out = {"label": label, "perplexity": perplexity(model, held, a.eval_batch)}
    if qat and kv is not None:  # the same trained model with its cache left unquantized
        from qcompress.nn import kv_cache

        for _, mod in kv_cache.quantized_modules(model):
            mod.__dict__[kv_cache.ATTR].active = False
        out["perplexity_kv_off"] = perplexity(model, held, a.eval_batch)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def complete(key: str, row: dict) -> bool:
    """A stored row holds everything this version measures for it."""
    _, _, kv, qat = ROWS[key]
    return "perplexity" in row and (not (qat and kv is not None) or "perplexity_kv_off" in row)


def settings(a) -> dict:
    return {
        "context": a.context,
        "eval_blocks": a.eval_blocks,
        "calib_blocks": a.calib_blocks,
        "steps": a.steps,
        "batch": a.batch,
        "lr": a.lr,
        "seed": a.seed,
    }


def table(summary: dict) -> str:
    rows, s = summary["rows"], summary["settings"]
    out = [
        f"SmolLM2-135M-Instruct (float32), Austen held-out text: {s['eval_blocks']} blocks of {s['context']} "
        f"tokens. Calibration (FP32 rows): {s['calib_blocks']} training blocks in train mode. QAT rows: "
        f"{s['steps']} steps of {s['batch']} blocks, AdamW lr {s['lr']}, W4 g128 symmetric minmax weights; "
        "the cache quantized in the loop from step 1.",
        "",
        "`/ same model without KV` compares a model with its cache quantized and the same weights with the "
        "cache left unquantized (FP32 rows: the FP32 row; QAT rows: the trained model with the KV "
        "quantizers switched off): the cost of the cache quantization itself, which the targets bound. "
        "`/ QAT run without KV` compares with a separate QAT run without KV quantization, whose weights "
        "took other steps.",
        "",
        "| row | perplexity | / same model without KV | target | met | / QAT run without KV |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        ref_key, _, kv, qat = ROWS[key]
        if kv is None:
            out.append(f"| {r['label']} | {r['perplexity']:.4f} | - | - | - | - |")
            continue
        paired = r.get("perplexity_kv_off") if qat else rows.get(ref_key, {}).get("perplexity")
        other = rows.get(ref_key, {}).get("perplexity") if qat else None
        ratio = r["perplexity"] / paired if paired else None
        target = TARGET[kv[0]]
        cells = [
            f"{ratio:.4f}" if ratio else "-",
            f"<= {target}",
            ("yes" if ratio <= target else "no") if ratio else "-",
            f"{r['perplexity'] / other:.4f}" if other else "-",
        ]
        out.append(f"| {r['label']} | {r['perplexity']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        default="fp32,fp32_fp8,fp32_fp8_head,fp32_fp8_mse,fp32_int8,fp32_int8_head,qat,qat_fp8,qat_fp8_head,qat_fp8_mse,qat_int8",
    )
    p.add_argument("--list", action="store_true")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--eval-blocks", type=int, default=6, help="held-out blocks to evaluate (0: all)")
    p.add_argument("--eval-batch", type=int, default=4)
    p.add_argument("--calib-blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "kv_quality"))
    p.add_argument("--rerun", action="store_true", help="run every row again, not only those --out lacks")
    p.add_argument("--write-results", action="store_true")
    a = p.parse_args(argv)
    if a.list:
        for k, (ref, label, _, _) in ROWS.items():
            print(f"{k:16s} {label}" + (f" (against {ref})" if ref else ""))
        return 0
    keys = [k for k in a.rows.split(",") if k]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; --list shows them")
    for k in keys:  # a ratio needs its base row
        ref = ROWS[k][0]
        if ref and ref not in keys:
            keys.insert(keys.index(k), ref)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    from model_zoo.smollm2 import load_smollm2

    base, tok = load_smollm2()
    train_blocks, order, held = load_data(a, tok)
    a.eval_blocks = len(held)
    summary = {"settings": settings(a), "rows": {}}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "summary.json")
    stored = {}
    if os.path.exists(path) and not a.rerun:
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        if old.get("settings") == summary["settings"]:
            stored = old.get("rows", {})
    for k in dict.fromkeys(keys):
        print(f"{k}: {ROWS[k][1]}", flush=True)
        if k in stored and complete(k, stored[k]):
            summary["rows"][k] = stored[k]
            print("  kept from an earlier run with the same settings (--rerun runs it again)", flush=True)
            continue
        summary["rows"][k] = run_row(k, base, train_blocks, order, held, a)
        print(f"  perplexity {summary['rows'][k]['perplexity']:.4f} ({summary['rows'][k]['seconds']} s)", flush=True)
        with open(path, "w", encoding="utf-8") as fh:  # after every row, with the rows not asked for
            json.dump({"settings": summary["settings"], "rows": {**stored, **summary["rows"]}}, fh, indent=2)
    text = table(summary)
    print(text)
    if a.write_results:
        path = common.write_section(
            "kv_cache",
            "smollm2",
            text,
            title="KV-cache quantization",
            cmd="python benchmarks/kv_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
