"""qcompress on a CUDA GPU, side by side in one process: the QAT training step against FP32, the
fake-quantization kernels against a device copy and torch's own fake-quant op, and the exported
model's reloads (exact; fast, which on a GPU decodes the weight once for cuBLAS; fast with the
CUDA low-bit kernels) against the dense layer.

    python benchmarks/gpu.py [--steps 20] [--batch 64] [--json OUT.json]
    python benchmarks/gpu.py --quick [--build] [--json OUT.json]   # the prepared device check (gpu_quick.py)

Step: forward + backward + AdamW step of train_step.py's BERT 6 x 384 and Llama-style 6 x 384
models (random init), batch x 128 tokens, FP32 weights with fp32 math or bf16 autocast; the
variants take turns step by step (interleaved), median of --steps timed steps after warm-up. Step
memory: torch.cuda.max_memory_allocated over one step less what was allocated before it (the
weights and optimizer state: activations saved for backward, gradients, temporaries), per variant.
Kernels: median over repeats, timed with CUDA events. Needs a GPU and the extension built with CUDA (QCOMPRESS_CUDA=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import train_step  # noqa: E402  (model builders and the qcompress recipes)

STEP_VARIANTS = ("fp32", "qc_w8a8", "qc_w4a8", "qc_w4", "qc_w8a8+sync")  # +sync: a NaN/Inf check per call


def cuda_time(fn, reps=20, warm=3):
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def build(model_name):
    """train_step's models, or "bertW": a BERT of 6 layers W wide (W/64 heads, MLP 4W): the same
    number of quantized layers, W^2 more GPU work per layer."""
    if not model_name.startswith("bert") or model_name == "bert":
        return train_step.build(model_name)
    import transformers

    w = int(model_name[4:])
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=w,
        num_hidden_layers=6,
        num_attention_heads=w // 64,
        intermediate_size=4 * w,
        num_labels=5,
    )
    ids = torch.randint(0, cfg.vocab_size, (train_step.BATCH, train_step.SEQ))
    return transformers.BertForSequenceClassification(cfg).train(), {
        "input_ids": ids,
        "labels": torch.randint(0, 5, (train_step.BATCH,)),
    }


def step_table(model_name, batch, steps, autocast, variants=STEP_VARIANTS):
    train_step.BATCH = batch
    runs = {}
    from qcompress.quant import kernels as K

    for v in variants:
        model, data = build(model_name)
        framework, recipe = train_step.VARIANTS[v.partition("+")[0]]
        after = train_step.apply_qcompress(model, recipe) if framework == "qcompress" else None
        sync = v.endswith("+sync")
        model.cuda()
        data = {k: t.cuda() for k, t in data.items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def one(model=model, data=data, opt=opt, after=after, sync=sync):
            old = K.cuda_sync_checks(sync)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**data).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after is not None:
                after()
            K.cuda_sync_checks(old)

        for _ in range(3):
            one()
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        one()
        torch.cuda.synchronize()
        # what one step adds over the resident weights and optimizer state (activations, grads)
        runs[v] = {"one": one, "times": [], "peak": torch.cuda.max_memory_allocated() - resident}
    for _ in range(steps):  # interleaved: clock changes hit every variant alike
        for v, r in runs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            r["one"]()
            b.record()
            b.synchronize()
            r["times"].append(a.elapsed_time(b))
    base_t = statistics.median(runs["fp32"]["times"])
    base_m = runs["fp32"]["peak"]
    out = []
    for v, r in runs.items():
        t = statistics.median(r["times"])
        out.append(
            {
                "model": model_name,
                "autocast": "bf16" if autocast else "fp32",
                "variant": v,
                "ms": round(t, 3),
                "vs_fp32": round(t / base_t, 3),
                "step_peak_mib": round(r["peak"] / 2**20, 1),
                "step_peak_vs_fp32": round(r["peak"] / base_m, 3),
            }
        )
    for r in runs.values():
        r.clear()
    torch.cuda.empty_cache()
    return out


def profile(model_name, batch):
    """torch.profiler's top ops of one qcompress W8A8 step (what the QAT step spends beyond FP32)."""
    from torch.profiler import ProfilerActivity, profile as prof

    train_step.BATCH = batch
    model, data = train_step.build(model_name)
    after = train_step.apply_qcompress(model, "w8a8")
    model.cuda()
    data = {k: t.cuda() for k, t in data.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def one():
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after()

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        one()
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)


def kernel_table(n):
    from qcompress.quant import kernels as K, reference as R

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n // 4096, 4096, device="cuda", dtype=dtype)
        copy_ms = cuda_time(lambda: x.clone())
        specs = {
            "w8 channel sym": R.make_spec(8, granularity="channel"),
            "w4 group128 sym": R.make_spec(4, granularity="group", group_size=128),
            "a8 token asym": R.make_spec(8, symmetric=False, granularity="token"),
        }
        for name, spec in specs.items():
            ms = cuda_time(lambda: K.fake_quantize_with_mask(x, spec, with_mask=False))
            row = {
                "dtype": str(dtype)[6:],
                "op": name,
                "elements": n,
                "ms": round(ms, 4),
                "copy_ms": round(copy_ms, 4),
                "copy_time_over_op_time": round(copy_ms / ms, 3),
            }
            if dtype == torch.float32 and name == "w8 channel sym":
                s = (x.abs().amax(1) / 127).clamp(min=1e-8)
                z = torch.zeros(x.shape[0], dtype=torch.int32, device="cuda")
                t_ms = cuda_time(lambda: torch.fake_quantize_per_channel_affine(x, s, z, 0, -128, 127))
                row["torch_fake_quantize_ms"] = round(t_ms, 4)
            out.append(row)
    return out


def reload_table(tmp):
    """One 4096 x 4096 Linear exported at W4 g128 (weight-only) and W8 + A8 dynamic; exact vs fast."""
    import copy

    import torch.nn as nn

    import qcompress
    from qcompress.export import export_quantized, load_quantized
    from qcompress.export.fast import lowbit_plans  # where the fast plans read CUDA_LOWBIT_KERNELS
    from gpu_quick import PACKED_RECIPES

    out = []
    for name, cc in PACKED_RECIPES.items():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(4096, 4096))
        model = copy.deepcopy(base)
        qcompress.init_compression(model, {"compression_training": cc})
        model.eval()
        folder = os.path.join(tmp, name.replace(" ", "_").replace("+", ""))
        export_quantized(model, folder)
        exact = load_quantized(folder, copy.deepcopy(base)).cuda()
        fast = load_quantized(folder, copy.deepcopy(base), mode="fast").cuda()
        dense = base.cuda()
        for tokens in (1, 16, 256):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(tokens, 4096, device="cuda", dtype=dtype)
                e, f, d = exact.to(dtype), fast.to(dtype), dense.to(dtype)
                with torch.no_grad():
                    t_d = cuda_time(lambda: d(x))
                    t_e = cuda_time(lambda: e(x))
                    t_f = cuda_time(lambda: f(x))
                    lowbit_plans.CUDA_LOWBIT_KERNELS = True
                    t_k = cuda_time(lambda: f(x))
                    lowbit_plans.CUDA_LOWBIT_KERNELS = False
                out.append(
                    {
                        "recipe": name,
                        "tokens": tokens,
                        "dtype": str(dtype)[6:],
                        "dense_ms": round(t_d, 4),
                        "exact_ms": round(t_e, 4),
                        "fast_ms": round(t_f, 4),
                        "cuda_kernels_ms": round(t_k, 4),
                        "exact_over_dense": round(t_e / t_d, 2),
                        "fast_over_dense": round(t_f / t_d, 2),
                        "cuda_kernels_over_dense": round(t_k / t_d, 2),
                    }
                )
    return out


def markdown(rows):
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def run_quick(a):
    import common
    import gpu_quick

    result = gpu_quick.quick(a)
    if a.json:
        common.atomic_write(a.json, json.dumps(result, indent=1, default=str) + "\n")
    page = a.page or ("gpu" if torch.cuda.is_available() else None)
    if page:
        path = common.write_section(
            page,
            "quick-check",
            "## The quick device check\n\n" + gpu_quick.page(result),
            title="On a GPU",
            header=False,
        )
        print(f"written to {path}")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--elements", type=int, default=1 << 26)
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--models", default="bert,llama", help="also bertW: BERT 6 x W (e.g. bert1024)")
    p.add_argument("--parts", default="kernels,steps,reload", help="also: profile")
    q = p.add_argument_group("--quick: the prepared device check (benchmarks/gpu_quick.py); CPU fallback without CUDA")
    q.add_argument("--quick", action="store_true")
    q.add_argument("--build", action="store_true", help="first pip install -e . with QCOMPRESS_CUDA=1")
    q.add_argument("--budget-s", type=float, default=450.0, help="parts not started by then are skipped")
    q.add_argument("--pytest-paths", default="tests", help="comma-separated paths for pytest -m cuda")
    q.add_argument("--widths", help="model widths of the step part (default 1024,384 on a GPU, 64 on the CPU)")
    q.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of the step part (the CI "
        "test's CPU run: aot_eager, the same graphs without inductor's compile time)",
    )
    q.add_argument(
        "--page",
        help="results page to write the quick-check section to (default: results/gpu.md on a GPU, none on the CPU)",
    )
    a = p.parse_args(argv)
    if a.quick:
        return run_quick(a)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device")
    import tempfile

    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(f"# {result['device']}, torch {result['torch']}", flush=True)
    parts = a.parts.split(",")
    if "kernels" in parts:
        result["kernels"] = kernel_table(a.elements)
        print(markdown(result["kernels"]), "\n", flush=True)
    if "steps" in parts:
        result["steps"] = []
        for model_name in a.models.split(","):
            for autocast in (False, True):
                rows = step_table(
                    model_name,
                    a.batch,
                    a.steps,
                    autocast,
                    STEP_VARIANTS if model_name in ("bert", "llama") else STEP_VARIANTS[:4],
                )
                result["steps"] += rows
                print(markdown(rows), "\n", flush=True)
    if "profile" in parts:
        result["profile"] = profile("bert", a.batch)
        print(result["profile"], flush=True)
    if "reload" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            result["reload"] = reload_table(tmp)
        print(markdown(result["reload"]), "\n", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
