"""`benchmarks/gpu.py --quick`: one prepared device check, one JSON out, one results section.

On a CUDA machine (8 minutes at most on one H100, the build included):

    .venv/bin/python benchmarks/gpu.py --quick --build --json benchmarks/gpu_quick.json

Parts, in this order, each timed and recorded even when it fails (its error in the JSON), the
expensive step timings last and cut at --budget-s so the JSON always comes back:
  build      pip install -e . with QCOMPRESS_CUDA=1 (--build only)
  pytest     pytest -m cuda (the GPU tests; every other test sees no GPU)
  quantizers W8 per channel, W4 group 128, A8 per token against a device copy (fp32, bf16)
  packed     an exported 4096-wide bf16 Linear (W4 g128, W8, W8 + A8) loaded into a model already
             on the device, exact, fast (packed kernels on CUDA) and mode="dense" (decoded once):
             time at 1 and 256 tokens and the device memory each holds against the dense layer
  onebit     the 1-bit compressed all-reduce in a 1-process group (NCCL; gloo on the CPU)
  zero3      a 1-process ZeRO-3 engine (FSDP2) trains to the stage-0 engine's loss
  torchao    torchao's QAT (int8 dynamic activations + int4 weights) when its wheel is present
             (absent: `pip install torchao==0.18.*`, a 3.4 MB wheel; on a machine without network,
             download it here and carry it)
  steps      the QAT step (W8A8, W4A8 g128, W4 g128) against FP32, eager and compiled, BERT and
             Llama-style at each --widths, bf16 autocast; compiled with mode reduce-overhead on a
             GPU (CUDA graphs), the default mode on the CPU
Without CUDA the same code runs on the CPU at tiny sizes (the CI test runs it so), with gloo.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

RECIPES = {"w8a8": "w8a8.yaml", "w4a8_g128": "w4a8_g128.yaml", "w4_g128": "w4a16_g128.yaml"}
# the exported layer's recipes (compression_training sections), also gpu.py's reload table
PACKED_RECIPES = {
    "W4 g128 weight-only": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 128}}},
        }
    },
    "W8 channel weight-only": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}}},
        }
    },
    "W8 channel + A8 dynamic": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": 8}}},
        },
    },
}


class Check:
    """Runs the parts, recording each one's result, seconds and error, within a time budget."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.result = {"parts": {}}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def run(self, name, fn, *args):
        t = time.perf_counter()
        if self.left() <= 0:
            entry = {"status": "skipped", "why": "time budget spent"}
        else:
            try:
                entry = {"status": "ok", "result": fn(*args)}
            except Exception as exc:  # a failed part is a finding: record it, run the next
                entry = {
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-3000:],
                }
        entry["seconds"] = round(time.perf_counter() - t, 2)
        self.result["parts"][name] = entry
        print(
            f"[quick] {name}: {entry['status']} in {entry['seconds']} s"
            + (f" ({entry['error']})" if "error" in entry else ""),
            flush=True,
        )
        return entry


def timer(device):
    """Median seconds of fn() (CUDA events on a GPU, the wall clock on the CPU)."""
    import torch

    def time_it(fn, reps=10, warm=2):
        for _ in range(warm):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return time_it


# --- parts -----------------------------------------------------------------------------------------


def build():
    env = dict(os.environ, QCOMPRESS_CUDA="1")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."],
        cwd=common.ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"build failed ({out.returncode}): {out.stderr[-2000:]}")
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, qcompress.quant.kernels as K; print(K.available(), K._has_cuda)"],
        cwd=common.ROOT,
        capture_output=True,
        text=True,
    )
    return {"kernels_loaded_with_cuda": probe.stdout.strip()}


def pytest_cuda(paths, timeout_s):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--timeout={int(timeout_s)}",
            *paths,
        ],
        cwd=common.ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s + 30,
    )
    tail = out.stdout.strip().splitlines()[-1:] or [""]
    if out.returncode not in (0, 5):  # 5: nothing collected / all deselected
        raise RuntimeError(f"pytest -m cuda exit {out.returncode}: {out.stdout[-2500:]}")
    return {"summary": tail[0], "exit": out.returncode}


def quantizers(device, elements):
    import torch
    from qcompress.quant import kernels as K, reference as R

    time_it = timer(device)
    rows = []
    specs = {
        "w8 channel sym": R.make_spec(8, granularity="channel"),
        "w4 group128 sym": R.make_spec(4, granularity="group", group_size=128),
        "a8 token sym": R.make_spec(8, granularity="token"),
    }
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(max(1, elements // 4096), 4096, device=device, dtype=dtype)
        copy_s = time_it(lambda: x.clone())
        for name, spec in specs.items():
            s = time_it(lambda: K.fake_quantize_with_mask(x, spec, with_mask=False))
            ref = R.fake_quantize_with_mask(x[:8], spec)[0]
            same = bool(torch.equal(K.fake_quantize_with_mask(x[:8], spec, with_mask=False)[0], ref))
            rows.append(
                {
                    "dtype": str(dtype)[6:],
                    "op": name,
                    "elements": x.numel(),
                    "ms": round(s * 1e3, 4),
                    "copy_ms": round(copy_s * 1e3, 4),
                    "copy_over_op": round(copy_s / s, 3),
                    "equals_reference": same,
                    # the two-pass kernels unless the one-pass one is asked for (QC_CUDA_ONE_PASS=1;
                    # groups that do not fit the device's shared memory still take two passes)
                    "kernel": "one-pass" if os.environ.get("QC_CUDA_ONE_PASS") == "1" else "two-pass",
                }
            )
    return rows


def packed(device, width):
    import torch
    import torch.nn as nn
    import qcompress
    from qcompress.export import export_quantized, load_quantized
    from qcompress.export.fast import plans_of

    time_it = timer(device)
    rows = []
    for name, cc in PACKED_RECIPES.items():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(width, width)).to(torch.bfloat16)  # the CUDA int4 kernel's dtype
        model = copy.deepcopy(base)
        qcompress.init_compression(model, {"compression_training": cc})
        model.eval()
        with tempfile.TemporaryDirectory() as folder:
            export_quantized(model, folder)
            held = {}
            mods = {}
            for mode in ("dense", "exact", "fast", "decoded"):
                before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                # loaded into a model already on the device: there fast keeps the codes packed
                m = (
                    copy.deepcopy(base).to(device)
                    if mode == "dense"
                    else load_quantized(
                        folder, copy.deepcopy(base).to(device), mode="dense" if mode == "decoded" else mode
                    )
                )
                held[mode] = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else None
                mods[mode] = m
            for tokens in (1, 256):
                x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    t = {mode: time_it(lambda m=m: m(x)) for mode, m in mods.items()}
                    want, got = mods["exact"](x), mods["fast"](x)
                    diff = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
                rows.append(
                    {
                        "recipe": name,
                        "tokens": tokens,
                        "dense_ms": round(t["dense"] * 1e3, 4),
                        "exact_over_dense": round(t["exact"] / t["dense"], 2),
                        "fast_over_dense": round(t["fast"] / t["dense"], 2),
                        "fast_vs_exact_max_rel": diff,
                        "decoded_over_dense": round(t["decoded"] / t["dense"], 2),
                        "fast_plan": ",".join(sorted(set(plans_of(mods["fast"]).values()))),
                        "bytes_dense": held["dense"],
                        "bytes_exact": held["exact"],
                        "bytes_fast": held["fast"],
                        "bytes_decoded": held["decoded"],
                    }
                )
    return rows


def _one_process_group(device):
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return True


def onebit(device):
    import torch
    import torch.distributed as dist
    import qcompress
    from qcompress.quant import onebit as O

    mine = _one_process_group(device)
    try:
        x = torch.randn(1 << 16, device=device)
        state = qcompress.comm.OneBitState()
        avg = qcompress.comm.compressed_allreduce(x.clone(), state)
        if device.type == "cuda":
            torch.cuda.synchronize()
        # one rank: the average is the sign of x times its mean |x| (worker phase), compressed again
        want = O.decode(*O.compress(x.cpu(), torch.zeros(x.numel()))[:2])
        return {
            "backend": dist.get_backend(),
            "elements": x.numel(),
            "finite": bool(torch.isfinite(avg).all()),
            "signs_match": bool(torch.equal(torch.sign(avg.cpu()), torch.sign(want))),
            "bytes_sent": qcompress.comm.stats()["bytes_sent"],
        }
    finally:
        if mine:
            dist.destroy_process_group()


def zero3(device):
    import torch
    import torch.nn as nn
    import torch.distributed as dist
    import qcompress

    mine = _one_process_group(device)
    try:
        losses = {}
        for stage in (0, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))
            doc = {
                "train_batch_size": 8,
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
            engine = qcompress.initialize(model, doc, device=str(device))
            g = torch.Generator().manual_seed(1)
            out = []
            for _ in range(3):
                x = torch.randn(8, 64, generator=g).to(device)
                loss = engine(x).square().mean()
                engine.backward(loss)
                engine.step()
                out.append(float(loss))
            losses[stage] = out
        return {
            "backend": dist.get_backend(),
            "stage0_losses": losses[0],
            "stage3_losses": losses[3],
            "max_abs_diff": max(abs(a - b) for a, b in zip(losses[0], losses[3])),
        }
    finally:
        if mine and dist.is_initialized():
            dist.destroy_process_group()


def _model(kind, width, layers, vocab, seq):
    import torch
    import transformers

    torch.manual_seed(0)
    heads = max(1, width // 64)
    if kind == "bert":
        cfg = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * width,
            max_position_embeddings=max(32, seq),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return transformers.BertForMaskedLM(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=8 * width // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(32, seq),
    )
    return transformers.LlamaForCausalLM(cfg)


def _loss(model, ids):
    import torch

    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def _apply(model, variant):
    """FP32, a qcompress recipe, or torchao's QAT (int8 dynamic activations + int4 group-32 weights)."""
    import qcompress as qc

    if variant in RECIPES:
        qc.init_compression(model, qc.load_config(os.path.join(common.ROOT, "schedules", RECIPES[variant])))
    elif variant == "torchao_w4a8":
        import torch
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
        quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
    return model


def steps(device, check, kinds, widths, variants, layers, batch, seq, vocab, rounds, backend):
    """Per model and width: each variant's eager and compiled step, interleaved, bf16 autocast."""
    import torch
    from qcompress.engine.compile import raise_recompile_limit

    raise_recompile_limit()
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows = []
    for width in widths:
        for kind in kinds:
            if check.left() < 30:
                rows.append({"model": kind, "width": width, "skipped": "time budget spent"})
                continue
            ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
            base = _model(kind, width, layers, vocab, seq)
            fns, first = {}, {}
            for variant in variants:
                for compiled in (False, True):
                    name = f"{variant}_{'compiled' if compiled else 'eager'}"
                    try:
                        model = _apply(copy.deepcopy(base), variant).to(device).train()
                        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                        kw = {"mode": mode} if backend == "inductor" else {}
                        loss_fn = torch.compile(_loss, fullgraph=True, backend=backend, **kw) if compiled else _loss

                        def one(model=model, opt=opt, loss_fn=loss_fn):
                            with torch.autocast(device.type, dtype=torch.bfloat16):
                                loss = loss_fn(model, ids)
                            loss.backward()
                            opt.step()
                            opt.zero_grad(set_to_none=True)

                        t = time.perf_counter()
                        one()
                        if sync:
                            sync()
                        first[name] = round(time.perf_counter() - t, 2)
                        fns[name] = one
                    except Exception as exc:  # e.g. torchao absent: the others still run
                        first[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            times = common.interleaved(fns, repeats=rounds, warmup=1, sync=sync)
            for name, tm in times.items():
                mode_of = name.rsplit("_", 1)[1]
                base_name = f"fp32_{mode_of}"
                rows.append(
                    {
                        "model": kind,
                        "width": width,
                        "variant": name,
                        "ms": round(tm.median * 1e3, 3),
                        "vs_fp32_same_mode": (
                            round(common.ratio_value(times, name, base_name), 3) if base_name in times else None
                        ),
                        "first_step_s": first[name],
                    }
                )
            rows += [
                {"model": kind, "width": width, "variant": n, "error": e}
                for n, e in first.items()
                if isinstance(e, str)
            ]
    return rows


def torchao_present():
    return importlib.util.find_spec("torchao") is not None


def page(result) -> str:
    """The results section: every part's status, then its rows."""
    head = (
        f"> `benchmarks/gpu.py --quick` on {result['device']}, torch {result['torch']}, "
        f"{result['when']}, commit {result['commit']}.\n\n"
    )
    lines = [head, "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, e in result["parts"].items():
        note = e.get("error") or e.get("why") or ""
        r = e.get("result")
        if isinstance(r, dict):
            note = note or ", ".join(f"{k}={v}" for k, v in r.items())[:300]
        lines.append(f"| {name} | {e['status']} | {e['seconds']} | {note.replace('|', '/')} |")
    for name, e in result["parts"].items():
        rows = e.get("result")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["", f"### {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def quick(args) -> dict:
    """Run the parts (see the module docstring); returns the JSON document."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    check = Check(args.budget_s)
    if args.build:
        check.run("build", build)
    import datetime

    check.result.update(
        device=torch.cuda.get_device_name() if cuda else f"CPU ({common.cpu_model()})",
        torch=torch.__version__,
        commit=common.commit(),
        when=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    small = not cuda  # the CPU fallback: the same code paths at tiny sizes
    check.run("pytest", pytest_cuda, args.pytest_paths.split(","), 240 if cuda else 120)
    check.run("quantizers", quantizers, device, 1 << 12 if small else 1 << 26)
    check.run("packed", packed, device, 256 if small else 4096)
    check.run("onebit", onebit, device)
    check.run("zero3", zero3, device)
    variants = ["fp32", "w8a8", "w4a8_g128", "w4_g128"] + (["torchao_w4a8"] if torchao_present() else [])
    if not torchao_present():
        check.result["parts"]["torchao"] = {
            "status": "absent",
            "seconds": 0,
            "why": "torchao is not installed: pip install torchao==0.18.* (3.4 MB wheel) and rerun",
        }
    widths = [int(w) for w in args.widths.split(",")] if args.widths else ([64] if small else [1024, 384])
    check.run(
        "steps",
        steps,
        device,
        check,
        args.models.split(","),
        widths,
        variants,
        1 if small else 2,
        2 if small else 16,
        16 if small else 256,
        128 if small else 8192,
        2 if small else 10,
        args.backend,
    )
    return check.result
