"""`qcompress verify --vllm`: vLLM's own classes on the export (vllm_worker.py, in child processes).

Per quantized module: the scheme (Linear layers) or MoE method (experts) vLLM's
CompressedTensorsConfig resolves; problems when a layer resolves to no scheme or to an unquantized
one, when a checkpoint tensor never reaches a parameter (dropped by the loader) or a parameter gets
no tensor. Where vLLM has kernels for every layer on this machine, it also generates, and its
greedy tokens and top-5 log-probabilities are compared with load_quantized's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from .export import Export, declared
from .report import ConsumerResult, Report

UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod")


def default_dtype(export: Export) -> str:
    """vLLM's CPU kernels for int W8A8, WNA16 and FP8 block scales take bfloat16 activations only;
    float32 exports of other schemes serve in float32."""
    recs = list(export.modules.values()) + list(export.experts.values())
    formats = {r.get("format") for r in recs}
    blocks = any((r.get("weights") or {}).get("strategy") == "block" for r in recs)
    return (
        "bfloat16"
        if formats & {"int-quantized", "pack-quantized"} or blocks
        else str(export.config.get("dtype") or "float32")
    )


def has_quantized_experts(export: Export) -> bool:
    return any(r.get("weights") is not None for r in export.experts.values())


def load_dtype(export: Export, dtype: str) -> str:
    """The dtype of the load check: the export's own for quantized experts (no CPU kernel serves
    them, and scales kept in the export's precision compare bit for bit), else the serving one."""
    return str(export.config.get("dtype") or "float32") if has_quantized_experts(export) else dtype


def expert_check(export: Export, dtype: str, params) -> dict:
    """vLLM's load check with the experts layers' parameters compared against `params` (the
    Parameters of a model load_quantized loaded): {"load": result, "experts": [(module, problem)]}."""
    import tempfile as _tf
    from safetensors.torch import load_file
    from .vllm_experts import compare_expert_weights

    with _tf.TemporaryDirectory(prefix="qc-vllm-dump-") as tmp:
        dump = os.path.join(tmp, "experts.safetensors")
        loaded = run_worker(["load", export.folder, "--dtype", dtype, "--dump", dump])
        if "error" in loaded or not os.path.exists(dump):
            return {"load": loaded, "experts": []}
        values = load_file(dump)
    return {"load": loaded, "experts": compare_expert_weights(values, export.experts, params)}


def load_error_line(export: Export, loaded: dict):
    """(module, reason) for vLLM's load_weights stopping at a checkpoint tensor: an experts tensor
    written under the names vLLM's own MoE loader asks for, in a layer it resolved to a quantized
    MoE method, is a limitation of vLLM's loader for that method."""
    tensor = loaded["load_error"]["tensor"] or "(model)"
    error = loaded["load_error"]["error"][:240]
    owner = next((p for p, r in export.experts.items() if r.get("weights") is not None and _owns(p, r, tensor)), None)
    if owner is None:
        return tensor, f"vLLM's load_weights stops at this checkpoint tensor: {error}"
    layer = _vllm_layer(loaded["layers"], owner.rsplit(".", 1)[0] + ".0.x") or owner
    method = loaded["layers"].get(layer, "?")
    return owner, (
        f"vLLM limitation: its {method} for {layer} stops on the expert tensors its own gpt-oss / MoE "
        f"name mapping asks for ({tensor}): {error}"
    )


def _owns(pname: str, rec: dict, tensor: str) -> bool:
    if rec.get("streamed"):
        return tensor.startswith(rec["streamed"]["prefix"] + ".")
    prefix = pname.rsplit(".", 1)[0]
    saved = [p[0] for p in rec.get("pieces") or ()]
    return tensor.startswith(prefix + ".") or any(tensor.startswith(s[: -len("weight")]) for s in saved)


def run_worker(args, timeout: int = 900) -> dict:
    """Run vllm_worker with `args` in a child process; its JSON result (or {"error": ...})."""
    with tempfile.TemporaryDirectory(prefix="qc-verify-") as tmp:
        out = os.path.join(tmp, "result.json")
        extra = []
        if args[0] == "generate":
            path = os.path.join(tmp, "prompts.json")
            with open(path, "w") as fh:
                json.dump(args[-1], fh)
            args = list(args[:-1]) + ["--prompts", path]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run(
            [sys.executable, "-m", "qcompress.verify.vllm_worker", *args, "--out", out, *extra],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
        )
        if not os.path.exists(out):
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            return {"error": f"the vLLM worker exited with status {proc.returncode}: {' | '.join(tail)}"}
        with open(out) as fh:
            return json.load(fh)


def _vllm_layer(layers: dict, name: str) -> Optional[str]:
    """vLLM's layer for an HF module name: itself, its fused qkv / gate_up layer, gpt-oss' `attn`,
    or the experts layer of `...experts.{e}.proj`."""
    import re

    cands = [name, re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", name), re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", name)]
    cands += [c.replace(".self_attn.", ".attn.") for c in cands]
    m = re.match(r"^(.*\.experts)\.(?:\*|\d+)\.[^.]+$", name)
    if m:
        cands += [m.group(1) + ".routed_experts", m.group(1)]
    return next((c for c in cands if c in layers), None)


def check_vllm(
    export: Export,
    report: Report,
    dtype: Optional[str] = None,
    prompts=None,
    steps: int = 6,
    reference=None,
    tol: float = 1e-2,
    model=None,
) -> dict:
    """Resolve and load with vLLM; compare its loaded expert weights with `model`'s (load_quantized's)
    where the export has quantized experts; generate where it has the kernels. Returns the raw results."""
    res = report.consumers.setdefault("vllm", ConsumerResult())
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        res.detail = f"vLLM is not importable here ({err})"
        report.problem(
            "vllm",
            "(export)",
            f"--vllm asked, but vLLM is not importable ({err}); run verify in "
            "vLLM's environment (make serve-check builds one)",
        )
        return {}
    dtype = dtype or default_dtype(export)
    experts = []
    if has_quantized_experts(export) and model is not None:
        checked = expert_check(export, load_dtype(export, dtype), dict(model.named_parameters()))
        loaded, experts = checked["load"], checked["experts"]
    else:
        loaded = run_worker(["load", export.folder, "--dtype", dtype])
    out = {"load": loaded, "dtype": dtype, "experts": experts}
    if "error" in loaded:
        res.loads = False
        res.detail = loaded["error"][:300]
        report.problem("vllm", "(model)", f"vLLM refuses the export: {loaded['error'][:300]}")
        return out
    layers = loaded["layers"]
    if "load_error" in loaded:
        res.loads = False
        res.detail = f"vLLM builds the model and its load_weights stops: {loaded['load_error']['error'][:200]}"
        report.problem("vllm", *load_error_line(export, loaded))
        return out
    for label, row in report.rows.items():
        layer = _vllm_layer(layers, label)
        used = layers.get(layer) if layer else None
        state, _ = declared(export.qc, label.replace(".*.", ".0."), row.kind)
        row.consumers["vllm"] = used or "no layer"
        if used in UNQUANTIZED and state == "group":
            report.problem("vllm", label, f"declared {row.declared}, but vLLM builds it with {used}")
        elif used in UNQUANTIZED and row.scheme.split(" / ")[0] != "W16":
            report.problem(
                "vllm", label, f"quantized ({row.scheme}) but vLLM builds it with {used} (config.json: {row.declared})"
            )
    for k in loaded["dropped"]:
        report.problem("vllm", k, "checkpoint tensor dropped by vLLM's weight loader (it reaches no parameter)")
    for p in loaded["unloaded"]:
        report.problem("vllm", p, "vLLM parameter that no checkpoint tensor fills")
    for module, why in experts:
        report.problem("vllm", module, why)
    res.loads = not loaded["dropped"] and not loaded["unloaded"] and not experts
    if not res.loads:
        res.detail = (
            "vLLM's loader drops checkpoint tensors, leaves parameters unfilled or fills expert "
            "weights other than the export holds"
        )
        return out
    if loaded["missing_kernels"]:
        kinds = sorted({m.split(":")[0] for m in loaded["missing_kernels"]})
        held = (
            "; every expert's weights as load_quantized's, bit for bit"
            if has_quantized_experts(export) and model is not None
            else ""
        )
        res.detail = (
            f"resolved and loaded{held}; no kernel on this machine ({', '.join(kinds)}): serves where vLLM has one"
        )
        return out
    if prompts is None:
        from .offline import probe_ids

        prompts = probe_ids(export.config, batch=2).tolist()
    gen = run_worker(["generate", export.folder, "--dtype", dtype, "--steps", str(steps), prompts])
    out["generate"] = gen
    if "error" in gen:
        res.generates = False
        report.problem("vllm", "(model)", f"vLLM loads but does not generate: {gen['error'][:300]}")
        return out
    res.generates = True
    if reference is not None:
        cmp = compare(reference, gen["outputs"], tol)
        out["compare"] = cmp
        res.detail = (
            f"{dtype}; greedy tokens equal load_quantized's in {cmp['equal_seqs']}/{cmp['seqs']} "
            f"sequences; top-5 log-prob max diff {cmp['max_lp_diff']:.2e}"
        )
        for line in cmp["problems"]:
            report.problem("vllm", "(generation)", line)
    return out


def compare(reference, outputs, tol: float, ties: bool = True) -> dict:
    """load_quantized's (tokens [n, steps], log-probs [n, steps, vocab]) against vLLM's outputs.
    With `ties`, a first differing token is a near-tie (not a problem) when load_quantized gives
    both tokens log-probabilities within `tol`; comparison of that sequence stops there."""
    tokens, lps = reference
    problems, equal, worst = [], 0, 0.0
    for i, o in enumerate(outputs):
        ok = True
        for s, tok in enumerate(o["tokens"]):
            want = int(tokens[i][s])
            for t, lp in o["logprobs"][s].items():
                worst = max(worst, abs(float(lps[i][s][int(t)]) - lp))
            if tok != want:
                gap = abs(float(lps[i][s][want]) - float(lps[i][s][tok]))
                ok = False
                if not (ties and gap <= tol):
                    problems.append(
                        f"sequence {i} step {s}: vLLM picks token {tok}, load_quantized {want} (log-prob gap {gap:.3g})"
                    )
                break
        equal += ok
    if worst > tol:
        problems.append(f"top-5 log-probabilities differ from load_quantized's by up to {worst:.3g} (> {tol})")
    return {"seqs": len(outputs), "equal_seqs": equal, "max_lp_diff": worst, "problems": problems}
