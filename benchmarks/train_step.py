"""QAT training step side by side: step time and memory of FP32, qcompress (W8A8,
W4A8 g128, W4 weight-only g128), DeepSpeed 0.19.6 `init_compression` and torchao 0.18 QAT, on a
MiniLM-size BERT and a Llama-style decoder of similar size (random init, built from a config).

    make bench-peers     # once: DeepSpeed 0.19.6 and torchao 0.18 into .venv (benchmark only)
    nice -n 10 .venv/bin/python benchmarks/train_step.py [--models bert,llama] [--variants ...]
        [--rounds 3] [--steps 1] [--mem-steps 2] [--mem-jobs 2] [--threads 2] [--label L] [--write-results]

One step = forward + backward + AdamW step (+ the framework's scheduler step), batch 16 x 128
tokens. Every variant quantizes the same modules, every nn.Linear (heads included; embeddings
left alone, as torchao's Linear-only QAT does):
  qc_*   qcompress recipes schedules/{w8a8,w4a8_g128,w4a16_g128}.yaml, `modules` set to the Linears;
         W8A8 / W4A8 carry `int8_forward: auto` (integer forward where the CPU has VNNI / AMX; the
         header says what this CPU ran)
  qc_*_float  the same with `int8_forward: false` (the bit-exact float forward everywhere)
  ds_*   DeepSpeed: symmetric weights quantized in forward, dynamic symmetric per-token 8-bit inputs;
         DeepSpeed has one `quantize_groups` for all modules, so each layer's group count is set
         after init_compression: out_features (= per channel) or numel / 128 (= groups of 128)
  ao_*   torchao QATConfig: int8 per-channel / int4 group-128 symmetric weights, int8 per-token
         inputs, which torchao supports only asymmetric (qcompress and DeepSpeed: symmetric)
Time: all variants of one model live in this process and take turns round by round (--rounds x
--steps timed steps each, after one warm-up step), min and median per step. Memory: one fresh
subprocess per variant (each imports the same libraries) runs --mem-steps steps and reports the
process peak RSS (VmHWM); its last step runs under saved_tensors_hooks, which count the bytes
autograd keeps for backward (a deterministic figure; parameters, already held, not counted). A peer
that is not installed or fails is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_BUILD_OPS", "0")
warnings.filterwarnings("ignore")

SECTION = "## QAT training step: time and memory"
BATCH, SEQ = 16, 128
VARIANTS = {  # name: (framework, recipe)
    "fp32": ("fp32", None),
    "qc_w8a8": ("qcompress", "w8a8"),
    "qc_w4a8": ("qcompress", "w4a8"),
    "qc_w4": ("qcompress", "w4"),
    "qc_w8a8_float": ("qcompress", "w8a8+float"),
    "qc_w4a8_float": ("qcompress", "w4a8+float"),
    "ds_w8a8": ("deepspeed", "w8a8"),
    "ds_w4a8": ("deepspeed", "w4a8"),
    "ao_w8a8": ("torchao", "w8a8"),
    "ao_w4a8": ("torchao", "w4a8"),
}
LABELS = {
    "fp32": "FP32",
    "qc_w8a8": "qcompress W8A8",
    "qc_w4a8": "qcompress W4A8 g128",
    "qc_w4": "qcompress W4 g128 (weight-only)",
    "qc_w8a8_float": "qcompress W8A8, float forward",
    "qc_w4a8_float": "qcompress W4A8 g128, float forward",
    "ds_w8a8": "DeepSpeed W8A8",
    "ds_w4a8": "DeepSpeed W4A8 g128",
    "ao_w8a8": "torchao W8A8 (asym act)",
    "ao_w4a8": "torchao W4A8 g128 (asym act)",
}
TITLES = {
    "bert": "BERT 6 x 384, 12 heads, MLP 1536 (all-MiniLM-L6-v2's shape), sequence classification",
    "llama": "Llama-style decoder 6 x 384, 6 heads, gate/up/down MLP 1024, vocab 8192, causal LM",
}
SCHEDULES = {"w8a8": "w8a8.yaml", "w4a8": "w4a8_g128.yaml", "w4": "w4a16_g128.yaml"}


def build(model_name):
    """(model, batch) with fixed seeds; the batch carries its labels."""
    import torch
    import transformers

    torch.manual_seed(0)
    if model_name == "bert":  # all-MiniLM-L6-v2's shape
        cfg = transformers.BertConfig(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=1536,
            num_labels=5,
        )
        model = transformers.BertForSequenceClassification(cfg)
        labels = torch.randint(0, 5, (BATCH,))
    else:  # gate/up/down MLP, separate q/k/v
        cfg = transformers.LlamaConfig(
            vocab_size=8192,
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=6,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(cfg)
        labels = None
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    return model.train(), {"input_ids": ids, "labels": ids if labels is None else labels}


def linear_pattern(model):
    """One regex (re.search) naming exactly the model's nn.Linear modules."""
    import re
    import torch.nn as nn

    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def apply_qcompress(model, recipe):
    import yaml
    import qcompress as qc

    recipe, _, option = recipe.partition("+")
    with open(os.path.join(ROOT, "schedules", SCHEDULES[recipe]), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    if option:  # "float": the recipes' int8_forward: auto switched off; "int8": forced on
        cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = option == "int8"
    for tech in cfg["compression_training"].values():
        for group in tech["different_groups"].values():
            group["modules"] = [linear_pattern(model)]
    qc.init_compression(model, cfg)
    return qc.CompressionScheduler(model).step


def apply_deepspeed(model, recipe):
    from deepspeed.compression.compress import init_compression
    from deepspeed.compression.config import get_compression_config
    from deepspeed.compression.scheduler import compression_scheduler

    bits = 8 if recipe == "w8a8" else 4
    mods = [linear_pattern(model)]
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantizer_kernel": False,
                    "schedule_offset": 0,
                    "quantize_groups": 1,
                    "quantization_type": "symmetric",
                    "quantize_weight_in_forward": True,
                    "rounding": "nearest",
                },
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": bits, "target_bits": bits, "quantization_period": 0},
                        "modules": mods,
                    }
                },
            },
            "activation_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantization_type": "symmetric",
                    "range_calibration": "dynamic",
                    "schedule_offset": 0,
                },
                "different_groups": {"aq": {"params": {"bits": 8}, "modules": mods}},
            },
        }
    }
    init_compression(model, cfg)
    for m in model.modules():  # per-module group counts (DeepSpeed's is one for all)
        if getattr(m, "weight_quantization_enabled_in_forward", False):
            m.weight_quantize_num_groups = m.out_features if bits == 8 else m.weight.numel() // 128
    sched = compression_scheduler(model, get_compression_config(cfg))
    sched.step()  # switches quantization on (schedule_offset 0)
    return sched.step


def apply_torchao(model, recipe):
    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    weight = (
        IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
        if recipe == "w8a8"
        else IntxFakeQuantizeConfig(torch.int4, group_size=128, is_symmetric=True)
    )
    quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
    return None


def setup(model_name, variant):
    """(model, batch, one-step function) for a variant."""
    import torch

    model, batch = build(model_name)
    framework, recipe = VARIANTS[variant]
    after = {
        "fp32": lambda m, r: None,
        "qcompress": apply_qcompress,
        "deepspeed": apply_deepspeed,
        "torchao": apply_torchao,
    }[framework](model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after is not None:
            after()

    return model, batch, step


def import_peers():
    """Import every framework in every process, so library code weighs the same in each RSS."""
    out = {}
    for mod in ("qcompress", "deepspeed.compression.compress", "torchao.quantization.qat"):
        try:
            __import__(mod)
        except Exception as e:  # reported in the table, not fatal
            out[mod.split(".")[0]] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def vm_kb(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def saved_bytes(model, step):
    """Bytes autograd saves for backward in one step, by dtype; parameters (already held) left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = (str(t.dtype).replace("torch.", ""), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    by_dtype = {}
    for dtype, n in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return by_dtype


def child(model_name, variant, steps, threads):
    """Memory of one variant in this fresh process; prints one JSON line."""
    import torch

    torch.set_num_threads(threads)
    errors = import_peers()
    framework = VARIANTS[variant][0]
    if framework in errors:
        print(json.dumps({"error": errors[framework]}))
        return
    model, _, step = setup(model_name, variant)
    before = vm_kb("VmRSS")
    for _ in range(steps - 1):
        step()
    saved = saved_bytes(model, step)  # the hooks allocate nothing: this step counts for the peak
    print(json.dumps({"rss_before_mb": before / 1024, "peak_rss_mb": vm_kb("VmHWM") / 1024, "saved": saved}))


def memory(model_name, variant, a):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        model_name,
        variant,
        "--mem-steps",
        str(a.mem_steps),
        "--threads",
        str(a.threads),
    ]
    # a fixed mmap threshold: glibc's adaptive one made FP32's peak RSS vary by ~100 MB between runs
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {p.returncode}: {err[:200]}"}
    return json.loads(lines[-1])


def timing(model_name, variants, a):
    """Per-step seconds of each variant, the variants taking turns round by round."""
    steps, errors = {}, {}
    for v in variants:
        try:
            steps[v] = setup(model_name, v)[2]
            steps[v]()  # warm-up (and: does it run at all?)
        except Exception as e:
            steps.pop(v, None)
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    times = {v: [] for v in steps}
    for _ in range(a.rounds):
        for v, step in steps.items():
            for _ in range(a.steps):
                t = time.perf_counter()
                step()
                times[v].append(time.perf_counter() - t)
    return times, errors


def table(model_name, variants, times, errors, mem):
    base_t = times.get("fp32")
    base_m = mem.get("fp32", {})
    lines = [
        f"**{TITLES[model_name]}**, batch {BATCH} x {SEQ}",
        "",
        "| variant | step s min / median | vs FP32 min / median | peak RSS MB | Δ RSS vs FP32 MB | "
        "saved for backward MB (int8) | Δ saved vs FP32 MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    mb = 1 / 2**20
    for v in variants:
        m = mem.get(v, {})
        err = errors.get(v) or m.get("error")
        if v not in times and times:
            lines.append(f"| {LABELS[v]} | fails: {err} | | | | | |")
            continue
        t = times.get(v) or [float("nan")]
        tmin, tmed = min(t), statistics.median(t)
        rel = f"{tmin / min(base_t):.3f} / {tmed / statistics.median(base_t):.3f}" if base_t else "-"
        if "error" in m or not m:
            cells = [f"fails: {m.get('error', 'not measured')}", "", "", ""]
        else:
            sv = sum(m["saved"].values())
            sv0 = sum(base_m["saved"].values()) if "saved" in base_m else None
            cells = [
                f"{m['peak_rss_mb']:.0f}",
                f"{m['peak_rss_mb'] - base_m['peak_rss_mb']:+.0f}" if "peak_rss_mb" in base_m else "-",
                f"{sv * mb:.0f} ({m['saved'].get('int8', 0) * mb:.0f})",
                f"{(sv - sv0) * mb:+.0f}" if sv0 is not None else "-",
            ]
        lines.append(f"| {LABELS[v]} | {tmin:.3f} / {tmed:.3f} | {rel} | " + " | ".join(cells) + " |")
    return lines


def targets(model_name, times, mem):
    """Met / missed lines for the QAT step targets (memory, step time, peers)."""
    out = []
    if "fp32" not in times or "peak_rss_mb" not in mem.get("fp32", {}):
        return out
    f_min, f_med = min(times["fp32"]), statistics.median(times["fp32"])
    f_rss = mem["fp32"]["peak_rss_mb"]
    for v in ("qc_w8a8", "qc_w4a8", "qc_w8a8_float", "qc_w4a8_float"):
        if v not in times or "peak_rss_mb" not in mem.get(v, {}):
            continue
        r_min, r_med = min(times[v]) / f_min, statistics.median(times[v]) / f_med
        d = mem[v]["peak_rss_mb"] - f_rss
        base = v.replace("_float", "")
        peers = [p for p in (base.replace("qc_", "ds_"), base.replace("qc_", "ao_")) if p in times]
        ahead_t = all(statistics.median(times[p]) > statistics.median(times[v]) for p in peers)
        ahead_m = all(mem.get(p, {}).get("peak_rss_mb", 0) > mem[v]["peak_rss_mb"] for p in peers)
        out.append(
            f"- {model_name} {LABELS[v]}: peak RSS ≤ FP32 {'met' if d <= 0 else 'missed'} ({d:+.0f} MB); "
            f"step ≤ 1.03x FP32 {'met' if r_med <= 1.03 else 'missed'} (median {r_med:.3f}x, min {r_min:.3f}x); "
            f"ahead of {', '.join(LABELS[p] for p in peers) or 'no peer'} in time "
            f"{'yes' if ahead_t and peers else 'no'}, in peak RSS {'yes' if ahead_m and peers else 'no'}"
        )
    return out


def int8_note():
    """What the recipes' `int8_forward: auto` resolves to on this CPU."""
    from qcompress.quant import lowbit

    if not lowbit.available():
        return "extension not built: int8_forward auto runs the float forward"
    on = "the integer forward in training steps" if lowbit.int8_dot() else "the float forward"
    return f"low-bit kernels' ISA {lowbit.isa()}, so the recipes' int8_forward auto runs {on}"


def headline(saved, isa):
    """The index's line: each variant's step over FP32's, median [range] of the per-round ratios."""
    out = []
    for model_name, r in saved.items():
        base = r["times"].get("fp32")
        cells = []
        for v, t in r["times"].items():
            if v != "fp32" and base and len(t) == len(base):
                q = sorted(x / y for x, y in zip(t, base))
                cells.append(f"{LABELS[v]} {statistics.median(q):.2f}x [{q[0]:.2f}-{q[-1]:.2f}]")
        out.append(
            f"- QAT step / FP32 step, {TITLES[model_name]}, {isa}: "
            + "; ".join(cells)
            + " ([details](results/train_step.md))"
        )
    return "\n".join(out) + "\n"


def profile(model_name, variants, a):
    """Where a step's time goes: torch.profiler over 3 steps per variant (after 2 warm-up steps),
    the ops with the most self CPU time in ms per step, and the minor page faults and system time of
    3 more steps (getrusage). For the overhead of a variant over FP32, compare their tables."""
    import resource
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for v in variants:
        step = setup(model_name, v)[2]
        step()
        step()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(3):
            step()
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: a.profile_top]
        print(
            f"\n{model_name} {LABELS[v]}: minor page faults {(after.ru_minflt - before.ru_minflt) / 3:.0f} per step, "
            f"system time {(after.ru_stime - before.ru_stime) / 3 * 1e3:.0f} ms per step"
        )
        print("| op | calls per step | self CPU ms per step |\n|---|---:|---:|")
        for e in rows:
            print(f"| {e.key} | {e.count / 3:.0f} | {e.self_cpu_time_total / 3e3:.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,llama")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3, help="0: memory only")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    p.add_argument("--mem-steps", type=int, default=2, help="steps before reading the peak RSS")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-jobs", type=int, default=2, help="memory subprocesses run at once")
    p.add_argument("--label", default="", help="what code was measured (e.g. a commit)")
    p.add_argument("--save", help="also write the raw numbers to this JSON file")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--profile", action="store_true", help="print where each variant's step time goes, no timing table")
    p.add_argument("--profile-top", type=int, default=16, help="ops listed per variant with --profile")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(*a.child, a.mem_steps, a.threads)
    import torch

    torch.set_num_threads(a.threads)
    import_peers()
    variants = [v for v in a.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    if a.profile:  # one process per variant: allocator and caches as a fresh job has them
        for model_name in a.models.split(","):
            for v in variants:
                if len(variants) == 1 and "," not in a.models:
                    profile(model_name, variants, a)
                else:
                    subprocess.run(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--profile",
                            "--models",
                            model_name,
                            "--variants",
                            v,
                            "--threads",
                            str(a.threads),
                            "--profile-top",
                            str(a.profile_top),
                        ],
                        check=True,
                    )
        return 0
    t0 = time.time()
    load0 = os.getloadavg()
    parts, goals, saved = [], [], {}
    for model_name in a.models.split(","):
        with ThreadPoolExecutor(a.mem_jobs) as pool:  # RSS is per process: running side by side is fine
            mem = dict(zip(variants, pool.map(lambda v: memory(model_name, v, a), variants)))
        times, errors = timing(model_name, variants, a) if a.rounds else ({}, {})
        saved[model_name] = {"times": times, "errors": errors, "memory": mem}
        parts += table(model_name, variants, times, errors, mem) + [""]
        goals += targets(model_name, times, mem)
        print("\n".join(parts[-len(variants) - 5 :]), flush=True)
    head = [
        SECTION,
        "",
        f"{a.label + ': ' if a.label else ''}torch with {a.threads} threads, DeepSpeed {version('deepspeed')}, "
        f"torchao {version('torchao')}; {int8_note()}; load average {load0[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {time.time() - t0:.0f} s in all. Step time: {a.rounds} rounds x "
        f"{a.steps} steps per variant, interleaved in one process (min and median). Memory: fresh process per "
        f"variant, peak RSS after {a.mem_steps} steps; saved for backward = bytes autograd keeps for the "
        "backward of one step (saved_tensors_hooks, parameters not counted; in brackets its int8 part).",
        "",
    ]
    if a.save:
        with open(a.save, "w", encoding="utf-8") as fh:
            json.dump(saved, fh, indent=1)
    text = "\n".join(head + parts + ["Targets:", ""] + goals) + "\n"
    print("\n" + text)
    if a.write_results:
        import common

        isa = os.environ.get("ATEN_CPU_CAPABILITY")  # a run held to an ISA gets its own section
        path = common.write_section(
            "train_step", f"step-{isa}" if isa else "step", text, title="QAT training step vs FP32"
        )
        common.write_section(
            os.path.join(HERE, "RESULTS.md"),
            f"headline-step-{isa}" if isa else "headline-step",
            headline(saved, isa or "this CPU's best ISA"),
        )
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
