"""The CNN demo (`make demo-cnn`): FP32 vs quantization-aware training of a small CNN on
Fashion-MNIST, driven by YAML schedule files.

    python -m model_zoo.demo_fashion_mnist                      # W8A8 and W8->4 progressive
    python -m model_zoo.demo_fashion_mnist --schedule schedules/w4a16_g128.yaml
    python -m model_zoo.demo_fashion_mnist --schedule schedules/w8a8.yaml+schedules/with_onebit_adam.yaml

Each --schedule is one QAT run; `a.yaml+b.yaml` merges several files into one run. Every run's
config is load_config(base, *files) with the base at model_zoo/configs/fashion_mnist.yaml.

Defaults (about a minute of CPU time on one torch thread): a fixed random 20,000-image subset
of the 60,000 training images; FP32 baseline 2 epochs from scratch; each QAT run fine-tunes a
copy of the FP32 model for 2 more epochs (314 steps at batch 128) while the CompressionScheduler
walks the bit schedule, and is compared with a copy fine-tuned for the same 2 epochs in FP32
(same budget, same data order); the full 10,000-image test set. Each QAT model is evaluated as
trained (fake quantization), then baked with redundancy_clean and evaluated again, exported as a
quantized checkpoint (runs/demo/<schedule>/) and loaded back into a fresh model with
load_quantized, whose test accuracy is printed next to the file size.

One plain loop (forward, loss, backward, clip, optimizer step, scheduler step), no engine.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

import qcompress
from qcompress.optim.build import build_optimizer
from qcompress.schedule import compress_modules

from .data import DatasetMissing, batches, load_fashion_mnist
from .models import SmallCNN

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASE_CONFIG = os.path.join(HERE, "configs", "fashion_mnist.yaml")
DEFAULT_SCHEDULES = [
    os.path.join(ROOT, "schedules", "w8a8.yaml"),
    os.path.join(ROOT, "schedules", "w4a8_progressive.yaml"),
]
QUICK = dict(train_limit=600, test_limit=1000, epochs=1, qat_epochs=1)


@dataclass
class RunResult:
    name: str
    accuracy: float  # test accuracy of the model as trained
    baked_accuracy: Optional[float] = None  # after redundancy_clean (compressed runs)
    steps: int = 0
    seconds: float = 0.0
    bits: Dict[str, int] = field(default_factory=dict)
    size_bytes: float = 0.0
    disk_bytes: Optional[int] = None  # exported checkpoint (model.safetensors) on disk
    reload_accuracy: Optional[float] = None  # load_quantized(export, fresh model)
    summary: str = ""


# --- training and evaluation ---------------------------------------------------------------------


def batch_size_of(cfg) -> tuple:
    """(micro batch, accumulation steps) from DeepSpeed's keys (single process)."""
    accum = cfg.gradient_accumulation_steps or 1
    micro = cfg.train_micro_batch_size_per_gpu or (cfg.train_batch_size // accum if cfg.train_batch_size else 128)
    if micro < 1:
        raise qcompress.ConfigError(
            "train_batch_size", f"{cfg.train_batch_size} is smaller than gradient_accumulation_steps {accum}"
        )
    return micro, accum


def train(model, cfg, x, y, *, epochs: int, seed: int, desc: str, scheduler=None, progress=True) -> int:
    """Train in place; returns the number of optimizer steps. LR: cosine from the config's lr to 10%."""
    from tqdm.auto import tqdm

    micro, accum = batch_size_of(cfg)
    opt_cfg = cfg.optimizer or {"type": "Adam", "params": {"lr": 1e-3}}
    optimizer = build_optimizer(model.parameters(), opt_cfg)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    micro_per_epoch = math.ceil(len(y) / micro)
    total_steps = max(1, (micro_per_epoch * epochs) // accum)
    if cfg.fp16.enabled:
        warnings.warn("fp16 is for the engine on GPU; the CPU demo trains in fp32", stacklevel=2)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16.enabled)
    gen = torch.Generator().manual_seed(seed)
    step = 0
    model.train()
    bar = tqdm(
        total=total_steps, desc=desc, unit="step", disable=not progress, mininterval=0.5, dynamic_ncols=True, leave=True
    )
    for epoch in range(epochs):
        for i, (xb, yb) in enumerate(batches(x, y, micro, shuffle=True, generator=gen)):
            with autocast:
                loss = F.cross_entropy(model(xb), yb) / accum
            loss.backward()
            if (i + 1) % accum:
                continue
            if step >= total_steps:  # a trailing partial accumulation window is dropped
                optimizer.zero_grad(set_to_none=True)
                continue
            lr_mult = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr * lr_mult
            if cfg.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if scheduler is not None:
                scheduler.step()  # bits and offsets for the next step
            post = {"epoch": epoch + 1, "loss": f"{loss.item() * accum:.3f}"}
            if scheduler is not None:
                bits = [b for b in scheduler.current_bits().values() if b]
                if bits:
                    post["wbits"] = min(bits)
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    bar.close()
    return step


@torch.no_grad()
def evaluate(model, x, y, batch_size: int = 1000) -> float:
    model.eval()
    correct = 0
    for xb, yb in batches(x, y, batch_size):
        correct += (model(xb).argmax(1) == yb).sum().item()
    model.train()
    return correct / len(y)


# --- sizes ---------------------------------------------------------------------------------------


def _num_scales(mod) -> int:
    wq = mod.qc_wq
    w = mod.weight_matrix_view(mod.weight)
    rows = w.shape[0] if w.dim() >= 2 else 1
    cols = w.numel() // rows if rows else 0
    if wq.granularity == "channel":
        return rows
    if wq.granularity == "group":
        return rows * math.ceil(cols / wq.group_size)
    if wq.granularity == "groups":
        return wq.num_groups
    return 1


def model_size_bytes(model, at: str = "target") -> float:
    """Storage of the model's state: quantized weights at `target` (or `current`) bits plus one
    fp32 scale (and an 8-bit zero point when asymmetric) per group; everything else at its dtype."""
    quantized = {}
    for name, mod in compress_modules(model):
        wq = mod.qc_wq
        if wq is None:
            continue
        bits = wq.target_bits if at == "target" else (wq.bits if wq.active else None)
        if bits is None:
            continue
        n = _num_scales(mod)
        quantized[f"{name}.weight" if name else "weight"] = (
            mod.weight.numel() * bits + n * 32 + (0 if wq.symmetric or bits <= 2 else n * 8)
        )
    total_bits = 0
    for key, t in model.state_dict().items():
        total_bits += quantized.get(key, t.numel() * t.element_size() * 8)
    return total_bits / 8


# --- runs ----------------------------------------------------------------------------------------


def split_schedule(arg: str) -> List[str]:
    """'a.yaml+b.yaml' -> ['a.yaml', 'b.yaml'] (one run of the merged files)."""
    return [p for p in arg.split("+") if p]


def export_and_reload(model, cfg, out_dir: str, xt, yt) -> tuple:
    """Write the baked model as a quantized checkpoint, load it into a fresh SmallCNN: (bytes, accuracy)."""
    with warnings.catch_warnings():  # the CNN's convs are stored qcompress-style (README, Export)
        warnings.filterwarnings("ignore", message=".*not nn.Linear layers with whole groups.*")
        qcompress.export_quantized(model, out_dir, cfg, force=True)
    reloaded = qcompress.load_quantized(out_dir, SmallCNN())
    return os.path.getsize(os.path.join(out_dir, "model.safetensors")), evaluate(reloaded, xt, yt)


def safe_name(files: Sequence[str]) -> str:
    return "+".join(os.path.splitext(os.path.basename(f))[0] for f in files)


def qat_run(
    fp32_model,
    files: Sequence[str],
    base: str,
    data,
    *,
    epochs: int,
    seed: int,
    progress: bool,
    export_dir: Optional[str] = None,
) -> RunResult:
    (x, y), (xt, yt) = data
    cfg = qcompress.load_config(base, *files)
    name = "+".join(os.path.basename(f) for f in files)
    model = copy.deepcopy(fp32_model)
    qcompress.init_compression(model, cfg)
    if not any(m.qc_wq or m.qc_aq or m.qc_pruning for _, m in compress_modules(model)):
        print(f"note: {name} enables no compression technique; this run only fine-tunes in FP32")
    sched = qcompress.CompressionScheduler(model, cfg)
    t0 = time.perf_counter()
    steps = train(
        model, cfg, x, y, epochs=epochs, seed=seed + 1, desc=f"QAT {name}", scheduler=sched, progress=progress
    )
    res = RunResult(name=name, accuracy=evaluate(model, xt, yt), steps=steps)
    res.bits = sched.current_bits()
    res.summary = qcompress.summary(model)
    late = sorted(
        {
            m.qc_wq.group
            for _, m in compress_modules(model)
            if m.qc_wq is not None and m.qc_wq.active and m.qc_wq.bits != m.qc_wq.target_bits
        }
    )
    if late:
        print(
            f"note: weight group(s) {', '.join(late)} did not reach target_bits in {steps} steps; "
            "run longer or shorten quantization_period (see `qcompress schedule`)"
        )
    idle = sorted({m.qc_aq.group for _, m in compress_modules(model) if m.qc_aq is not None and not m.qc_aq.active})
    if idle:
        print(
            f"note: activation group(s) {', '.join(idle)} had not started after {steps} steps "
            "(schedule_offset); their accuracy is without activation quantization"
        )
    qcompress.redundancy_clean(model, cfg)
    res.baked_accuracy = evaluate(model, xt, yt)
    res.size_bytes = model_size_bytes(model, at="target")
    if export_dir:
        res.disk_bytes, res.reload_accuracy = export_and_reload(
            model, cfg, os.path.join(export_dir, safe_name(files)), xt, yt
        )
    res.seconds = time.perf_counter() - t0
    return res


def run(
    schedules: Sequence[Sequence[str]],
    *,
    base: str = BASE_CONFIG,
    epochs: int = 2,
    qat_epochs: int = 2,
    train_limit: Optional[int] = 20000,
    test_limit: Optional[int] = None,
    seed: int = 0,
    data_dir: Optional[str] = None,
    progress: bool = True,
    export_dir: Optional[str] = None,
) -> List[RunResult]:
    """Train the FP32 baseline, then one QAT run per entry of `schedules` (a list of files each)."""
    t_start = time.perf_counter()
    # Parse every config before any training so a typo fails in a second, not after the baseline.
    base_cfg = qcompress.load_config(base)
    for files in schedules:
        qcompress.load_config(base, *files)
    data = load_fashion_mnist(data_dir, train_limit=train_limit, test_limit=test_limit, seed=seed)
    (x, y), (xt, yt) = data
    print(
        f"Fashion-MNIST: {len(y)} training images (of 60000), {len(yt)} test images; "
        f"FP32 {epochs} epoch(s), QAT {qat_epochs} epoch(s) per schedule; "
        f"torch threads: {torch.get_num_threads()}"
    )
    torch.manual_seed(seed)
    model = SmallCNN()
    t0 = time.perf_counter()
    steps = train(model, base_cfg, x, y, epochs=epochs, seed=seed, desc="FP32", progress=progress)
    fp32 = RunResult(
        name="fp32",
        accuracy=evaluate(model, xt, yt),
        steps=steps,
        size_bytes=model_size_bytes(model),
        seconds=time.perf_counter() - t0,
    )
    if export_dir:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(export_dir, "fp32"), exist_ok=True)
        path = os.path.join(export_dir, "fp32", "model.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        fp32.disk_bytes = os.path.getsize(path)
    print(
        f"FP32 test accuracy: {fp32.accuracy:.4f}  ({steps} steps, {fp32.seconds:.1f} s, "
        f"{fp32.size_bytes / 1024:.1f} KiB)"
    )
    results = [fp32]
    ref = fp32
    if schedules:
        # Each QAT run fine-tunes a copy for qat_epochs more; the fair baseline gets the same extra
        # epochs in FP32 (same data order), so accuracy changes are not training-budget effects.
        same = copy.deepcopy(model)
        t0 = time.perf_counter()
        steps = train(
            same,
            base_cfg,
            x,
            y,
            epochs=qat_epochs,
            seed=seed + 1,
            desc=f"FP32 +{qat_epochs} epoch(s)",
            progress=progress,
        )
        ref = RunResult(
            name=f"fp32 +{qat_epochs} epoch(s) (QAT's budget)",
            accuracy=evaluate(same, xt, yt),
            steps=fp32.steps + steps,
            size_bytes=fp32.size_bytes,
            seconds=time.perf_counter() - t0,
        )
        results.append(ref)
        print(f"FP32 fine-tuned for {qat_epochs} more epoch(s), the budget of each QAT run: {ref.accuracy:.4f}")
    for files in schedules:
        res = qat_run(model, files, base, data, epochs=qat_epochs, seed=seed, progress=progress, export_dir=export_dir)
        results.append(res)
        print(f"\n[{res.name}] bits in force after {res.steps} steps:")
        print(res.summary)
        print(
            f"[{res.name}] compressed test accuracy: {res.accuracy:.4f} "
            f"(baked by redundancy_clean: {res.baked_accuracy:.4f}; FP32 with the same budget "
            f"{ref.accuracy:.4f}, change {100 * (res.accuracy - ref.accuracy):+.2f} points)"
        )
        print(
            f"[{res.name}] model size at target bits: {res.size_bytes / 1024:.1f} KiB "
            f"(FP32 {fp32.size_bytes / 1024:.1f} KiB, {fp32.size_bytes / res.size_bytes:.2f}x smaller); "
            f"{res.seconds:.1f} s"
        )
        if res.disk_bytes is not None:
            print(
                f"[{res.name}] exported to {os.path.join(export_dir, safe_name(files))}: model.safetensors "
                f"{res.disk_bytes / 1024:.1f} KiB on disk (FP32 safetensors {fp32.disk_bytes / 1024:.1f} KiB, "
                f"{fp32.disk_bytes / res.disk_bytes:.2f}x smaller); reloaded with load_quantized: "
                f"test accuracy {res.reload_accuracy:.4f}"
            )
    print("\nsummary")
    print(f"  {'run':<40} {'test acc':>8} {'size KiB':>9} {'on disk KiB':>12}")
    for r in results:
        disk = f"{r.disk_bytes / 1024:>12.1f}" if r.disk_bytes is not None else f"{'-':>12}"
        print(f"  {r.name:<40} {r.accuracy:>8.4f} {r.size_bytes / 1024:>9.1f} {disk}")
    print(f"total wall time: {time.perf_counter() - t_start:.1f} s (process CPU time {time.process_time():.1f} s)")
    return results


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="python -m model_zoo.demo_fashion_mnist", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--schedule",
        action="append",
        metavar="PATH[+PATH...]",
        help="schedule file(s) for one QAT run; repeat for several runs "
        "(default: schedules/w8a8.yaml and schedules/w4a8_progressive.yaml)",
    )
    p.add_argument("--base", default=BASE_CONFIG, help="base training config (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=None, help="FP32 baseline epochs (default 2)")
    p.add_argument("--qat-epochs", type=int, default=None, help="epochs of each QAT run (default 2)")
    p.add_argument(
        "--train-limit", type=int, default=None, help="random training subset size; 0 = all 60000 (default 20000)"
    )
    p.add_argument("--test-limit", type=int, default=None, help="test subset size (default: all 10000)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['train_limit']} training / {QUICK['test_limit']} test images, 1 epoch each",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST *-ubyte.gz files")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument(
        "--export-dir",
        default=os.path.join(ROOT, "runs", "demo"),
        help="where each QAT model is exported as a quantized checkpoint and reloaded "
        "(default: %(default)s; '' skips the export)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: this small CNN gains little from more, and "
        "spinning threads slow it down badly on a busy machine)",
    )
    return p


def options(args) -> dict:
    """Resolve flag defaults (--quick changes them; explicit flags still win)."""
    d = dict(QUICK) if args.quick else dict(train_limit=20000, test_limit=None, epochs=2, qat_epochs=2)
    for key in ("epochs", "qat_epochs", "train_limit", "test_limit"):
        v = getattr(args, key)
        if v is not None:
            if v < 0 or (v == 0 and key in ("epochs", "qat_epochs")):
                raise SystemExit(f"--{key.replace('_', '-')} must be positive, got {v}")
            d[key] = v or None  # --train-limit 0 means all
    return d


def set_threads(n: Optional[int]) -> None:
    if n is not None:
        if n < 1:
            raise SystemExit(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    schedules = [split_schedule(s) for s in args.schedule] if args.schedule else [[f] for f in DEFAULT_SCHEDULES]
    set_threads(args.threads)
    try:
        run(
            schedules,
            base=args.base,
            seed=args.seed,
            data_dir=args.data_dir,
            progress=not args.no_progress,
            export_dir=args.export_dir or None,
            **options(args),
        )
    except DatasetMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except qcompress.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
