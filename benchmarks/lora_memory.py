"""Peak training memory of LoRA QAT next to full-parameter QAT on SmolLM2-135M-Instruct.

    python benchmarks/lora_memory.py [--batch 1] [--seq 256] [--steps 2] [--r 16] [--page lora]
        [--variants full,lora,qlora] [--checkpointing] [--no-write]

Every variant quantizes the same layers the same way (W4, groups of 128, symmetric, in forward: every
Linear of the 30 decoder blocks; the tied embedding / head stays float) and trains through
qcompress.initialize with AdamW, --steps steps of --batch x --seq tokens of Austen:
  full    full-parameter QAT: every weight trains
  lora    LoRA QAT, mode qat: adapters of rank r on every block Linear, the base frozen; the
          quantizer sees W + (alpha / r) B A
  qlora   the same adapters over the base stored as its 4-bit codes (mode qlora)
Each variant runs in a fresh subprocess (the same imports), which reports:
  peak RSS       the process's peak resident memory (VmHWM) over the training steps only: the peak
                 is reset (/proc/self/clear_refs) once the model is loaded and rewritten; glibc's
                 mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_=131072), so that memory freed within
                 a step is returned rather than kept in the allocator's heaps
  above the libraries  that peak minus the process's resident memory once torch, transformers and
                 qcompress are imported, before the model is loaded (what the training itself adds)
  tracked        parameters + gradients + optimizer state held after the last step, plus the bytes
                 autograd keeps for backward in the last step (saved_tensors_hooks, unique storages;
                 parameters already counted)
The table gives each variant's figures and its ratio to full-parameter QAT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

# glibc's malloc raises its mmap threshold as large blocks are freed, after which freed activations
# and fake-quantized weights stay in its heaps: RSS then shows what the allocator kept, not what the
# step holds. A fixed threshold maps every block above 128 KiB on its own and unmaps it when freed.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
LABELS = {"full": "full-parameter QAT", "lora": "LoRA QAT (mode qat)", "qlora": "QLoRA (mode qlora)"}
BLOCK_LINEARS = ["self_attn\\.(q|k|v|o)_proj", "mlp\\.(gate|up|down)_proj"]


def config(variant: str, r: int, checkpointing: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5 if variant == "full" else 1e-4, "weight_decay": 0.0}},
        "compression_training": {
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
        },
    }
    if variant != "full":
        cfg["compression_training"]["lora"] = {
            "enabled": True,
            "r": r,
            "alpha": 2 * r,
            "target_modules": BLOCK_LINEARS,
            "mode": "qat" if variant == "lora" else "qlora",
        }
    if checkpointing:
        cfg["activation_checkpointing"] = {"partition_activations": False}
    return cfg


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _text_batches(tok, batch: int, seq: int, steps: int, cache: str):
    from model_zoo.lm_corpus import load_corpus, split_corpus

    train, _ = split_corpus(load_corpus("austen", cache), 0.05, 0)
    ids = tok(train[:200_000], return_tensors="pt").input_ids[0]
    n = batch * seq
    return [ids[i * n : (i + 1) * n].reshape(batch, seq) for i in range(steps)]


def child(args) -> dict:
    import torch
    import transformers  # noqa: F401  (imported before the baseline is read)
    import qcompress as qc
    import qcompress.engine  # noqa: F401
    from model_zoo.smollm2 import load_smollm2

    libraries = _status("VmRSS")  # the interpreter and its libraries, before the model exists
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    model.train()
    model.config.use_cache = False
    batches = _text_batches(tok, args.batch, args.seq, args.steps, args.cache)
    cfg = config(args.child, args.r, args.checkpointing)
    cfg["train_micro_batch_size_per_gpu"] = args.batch
    qc.init_compression(model, cfg)
    engine = qc.initialize(model, cfg)
    import gc

    gc.collect()
    reset = _reset_peak()
    before = _status("VmRSS")
    saved = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine(input_ids=x, labels=x).loss
        else:
            loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    peak = _status("VmHWM")
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt_state = [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    bufs = list(model.buffers())
    return {
        "peak_rss": peak,
        "before": before,
        "reset": reset,
        "libraries": libraries,
        "params": nbytes(model.parameters()) + nbytes(bufs),
        "grads": nbytes(p for p in trainable),
        "opt": nbytes(opt_state),
        "saved": sum(v for k, v in saved.items() if k not in params),
        "trainable": sum(p.numel() for p in trainable),
        "loss": float(loss),
    }


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="full,lora,qlora")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on every block")
    ap.add_argument("--cache", default=os.path.join(ROOT, ".cache"), help="corpus cache folder")
    ap.add_argument("--page", default="lora", help="results page (benchmarks/results/<page>.md)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0
    rows = {}
    for v in args.variants.split(","):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            v,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--steps",
            str(args.steps),
            "--r",
            str(args.r),
            "--threads",
            str(args.threads),
            "--cache",
            args.cache,
        ] + (["--checkpointing"] if args.checkpointing else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ALLOCATOR))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"variant {v} failed")
        rows[v] = json.loads(line[len("RESULT ") :])
        print(v, rows[v], flush=True)
    base = rows.get("full")
    lines = [
        f"SmolLM2-135M-Instruct (float32), W4 g128 symmetric on every decoder-block Linear, AdamW, "
        f"{args.steps} steps of {args.batch} x {args.seq} tokens"
        f"{', activation checkpointing' if args.checkpointing else ''}; adapters r = {args.r}, alpha = {2 * args.r}. "
        "MiB; ratios to full-parameter QAT.",
        "",
        "| variant | trainable params | peak RSS | ratio | peak above the libraries | ratio "
        "| tracked (params + grads + optimizer + saved) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, r in rows.items():
        tracked = r["params"] + r["grads"] + r["opt"] + r["saved"]
        above = r["peak_rss"] - r["libraries"]
        babove = base["peak_rss"] - base["libraries"] if base else 1
        tr = lambda x, y: f"{x / y:.2f}x" if base else "-"  # noqa: E731
        btracked = base["params"] + base["grads"] + base["opt"] + base["saved"] if base else 1
        lines.append(
            f"| {LABELS[v]} | {r['trainable']:,} | {mib(r['peak_rss'])} "
            f"| {tr(r['peak_rss'], base['peak_rss'] if base else 1)} "
            f"| {mib(above)} | {tr(above, babove)} | {mib(tracked)} ({mib(r['params'])} + {mib(r['grads'])} "
            f"+ {mib(r['opt'])} + {mib(r['saved'])}) "
            f"| {tr(tracked, btracked)} |"
        )
    if not all(r["reset"] for r in rows.values()):
        lines.append("\n(the peak could not be reset after loading: peak RSS includes the load)")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        import common

        key = "lora-memory" + ("-checkpointing" if args.checkpointing else "")
        common.write_section(args.page, key, text, title="LoRA and QLoRA QAT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
