"""Command-line arguments of `qcompress train` and their mapping onto JobOptions."""

from __future__ import annotations

import argparse
import math
from typing import Optional

from .options import JobOptions

EPILOG = """\
examples:
  qcompress train schedules/w8a8.yaml --model ./all-MiniLM-L6-v2 --data bbc/ \\
      --task text-classification --out runs/w8a8 --baseline
  qcompress train ds_config.json schedules/w4a16_g32.yaml --model ./gpt2-austen \\
      --data austen.txt --task causal-lm --out runs/w4 --max-steps 200
  torchrun --nproc_per_node=2 -m qcompress train ... (rank 0 writes the outputs)

outputs in --out: export/ (quantized safetensors + config + tokenizer), report.json, report.md,
metrics.csv (one row per optimizer step), plots/loss.png, plots/bits.png, tensorboard/ (when
tensorboard is installed), checkpoints/ (for --resume).
"""


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="qcompress train")
    p.description = (
        "Fine-tune a local Hugging Face model with compression on your data, evaluate FP32 / "
        "PTQ / QAT / exported, export a quantized checkpoint and write a report. CFG files "
        "(DeepSpeed layout, JSON or YAML) are merged in order."
    )
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("configs", nargs="+", metavar="CFG", help="config / schedule files, merged in order")
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="local Hugging Face model folder (config.json, safetensors, tokenizer files)",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH",
        help="CSV, TSV or JSON-lines file, a folder of class sub-folders of .txt files, "
        "or (causal-lm) a .txt file or a folder of them",
    )
    p.add_argument("--task", required=True, choices=("text-classification", "causal-lm"))
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    d = p.add_argument_group("data")
    d.add_argument("--eval-data", metavar="PATH", help="evaluation data (default: a held-out fraction)")
    d.add_argument(
        "--eval-fraction",
        type=float,
        default=0.2,
        help="held-out share when --eval-data is not given (seeded split; default 0.2)",
    )
    d.add_argument("--text-column", default="text", help="text column of CSV/TSV/JSONL data (default: text)")
    d.add_argument("--label-column", default="label", help="label column (default: label)")
    d.add_argument("--max-length", type=int, default=128, help="tokens per sample / LM block (default 128)")
    d.add_argument("--max-train-samples", type=int, metavar="N", help="use the first N training samples")
    d.add_argument("--max-eval-samples", type=int, metavar="N", help="use the first N evaluation samples")
    t = p.add_argument_group("training")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, default=1.0, help="passes over the training data (default 1)")
    length.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps (overrides --epochs)")
    t.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the split, the head, the data order (default: the config's seed, else 0)",
    )
    t.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute the transformer blocks in the backward: less memory, more time (as the "
        "config's activation_checkpointing section)",
    )
    t.add_argument(
        "--lora-r",
        type=int,
        metavar="R",
        help="train LoRA adapters of rank R with the base frozen (the config's lora section, switched "
        "on at rank R; its mode, alpha and target_modules as the config gives them)",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model for training (as the config's compile section with enabled: "
        "true; its backend and kwargs, default inductor)",
    )
    t.add_argument(
        "--baseline",
        action="store_true",
        help="also fine-tune an FP32 copy with the same budget (fp32_finetuned) and take PTQ of it",
    )
    t.add_argument(
        "--baseline-from",
        metavar="RUN",
        help="reuse the FP32 baseline of an earlier --baseline run in RUN (same model, data, "
        "budget and training config; checked)",
    )
    t.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="learning rate of the default AdamW when the config has no optimizer (default 1e-4)",
    )
    t.add_argument(
        "--batch-size", type=int, default=32, help="train_batch_size when the config sets no batch size (default 32)"
    )
    t.add_argument("--eval-batch-size", type=int, default=64)
    t.add_argument(
        "--ptq-range-steps",
        type=int,
        default=0,
        metavar="N",
        help="after the ptq stage, train the PTQ model's learned ranges on the loss for N batches of "
        "--batch-size, weights frozen (qcompress.learn_ranges; needs range_learning: true): "
        "the ptq_learned stage (default 0: none)",
    )
    t.add_argument(
        "--calibrate",
        choices=("gptq",),
        default=None,
        help="gptq: the weight groups' weights solved by GPTQ on --calib-batches training batches before the ptq and "
        "qat stages (observer: gptq in weight_quantization's shared_parameters, as merging "
        "schedules/with_gptq.yaml; a group that sets its own observer keeps it)",
    )
    t.add_argument(
        "--calib-batches",
        type=int,
        default=8,
        metavar="N",
        help="training batches of --eval-batch-size that calibration reads: static activation ranges, "
        "input-weighted weight ranges and GPTQ (default 8)",
    )
    t.add_argument(
        "--save-steps",
        type=int,
        default=50,
        help="checkpoint every N optimizer steps for --resume (0: only at the end; default 50)",
    )
    t.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype the model is loaded, trained, exported and reloaded in (default float32; "
        "bfloat16 for NVFP4 / MX exports that transformers runs with their activation "
        "quantization)",
    )
    t.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    t.add_argument(
        "--device",
        default="auto",
        metavar="DEV",
        help="where training and evaluation run: auto (a CUDA GPU when torch sees one, else the "
        "CPU), cpu, cuda or cuda:N (default auto)",
    )
    r = p.add_argument_group("run")
    r.add_argument("--resume", action="store_true", help="continue the interrupted run in --out exactly")
    r.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    r.add_argument(
        "--keep-checkpoints",
        choices=("all", "last", "none"),
        default="last",
        help="what a finished run keeps in --out/checkpoints: every checkpoint saved (all), the "
        "latest of each training phase (last, default), or none once the report is written "
        "(an interrupted run keeps the latest either way, for --resume)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def options_from(ns: argparse.Namespace) -> JobOptions:
    # checked here, before anything runs: AdamW refused them only after the FP32 stages, with a traceback
    if not (math.isfinite(ns.lr) and ns.lr >= 0):
        raise ValueError(f"--lr must be a finite number >= 0, got {ns.lr}")
    if not (math.isfinite(ns.epochs) and ns.epochs > 0):
        raise ValueError(f"--epochs must be a finite number > 0, got {ns.epochs}")
    if ns.task == "text-classification" and ns.text_column == ns.label_column:
        # the label would be read as the text: a classifier of its own answer
        raise ValueError(f"--text-column and --label-column name the same column {ns.text_column!r}")
    if ns.threads is not None and ns.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {ns.threads}")
    for name in ("max_length", "batch_size", "eval_batch_size"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.calib_batches < 1:
        raise ValueError(f"--calib-batches must be >= 1, got {ns.calib_batches}")
    if ns.ptq_range_steps < 0:
        raise ValueError(f"--ptq-range-steps must be >= 0, got {ns.ptq_range_steps}")
    if ns.lora_r is not None and ns.lora_r < 1:
        raise ValueError(f"--lora-r must be >= 1 (an adapter's rank), got {ns.lora_r}")
    if ns.save_steps < 0:
        raise ValueError(f"--save-steps must be >= 0, got {ns.save_steps}")
    for name in ("max_train_samples", "max_eval_samples"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    return JobOptions(
        configs=list(ns.configs),
        model=ns.model,
        data=ns.data,
        task=ns.task,
        out=ns.out,
        eval_data=ns.eval_data,
        eval_fraction=ns.eval_fraction,
        text_column=ns.text_column,
        label_column=ns.label_column,
        max_length=ns.max_length,
        epochs=ns.epochs,
        max_steps=ns.max_steps,
        seed=ns.seed,
        baseline=ns.baseline,
        resume=ns.resume,
        overwrite=ns.overwrite,
        lr=ns.lr,
        batch_size=ns.batch_size,
        eval_batch_size=ns.eval_batch_size,
        max_train_samples=ns.max_train_samples,
        max_eval_samples=ns.max_eval_samples,
        save_steps=ns.save_steps,
        baseline_from=ns.baseline_from,
        device=ns.device,
        ptq_range_steps=ns.ptq_range_steps,
        progress=not ns.no_progress,
        gradient_checkpointing=ns.gradient_checkpointing,
        compile=ns.compile,
        dtype=ns.dtype,
        keep_checkpoints=ns.keep_checkpoints,
        lora_r=ns.lora_r,
        calibrate=ns.calibrate,
        calib_batches=ns.calib_batches,
    )
