"""The part of `qcompress verify` that needs neither vLLM nor a transformers load of the export:
what each quantized module holds, what config.json declares for it, whether the declarations let
compressed-tensors' loaders read it, and whether load_quantized loads it and generates."""

from __future__ import annotations

import json
from typing import Optional

from ..export import layout
from .export import Export, declared, expert_rows
from .report import ConsumerResult, ModuleRow, Report
from .sections import run_sections

_FLOAT_NAMES = {"nvfp4-pack-quantized": "NVFP4", "mxfp4-pack-quantized": "MXFP4", "mxfp8-quantized": "MXFP8"}
# projections vLLM fuses into one layer, which must then share one scheme (its packed_modules_mapping)
FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def describe(weights: Optional[dict], act: Optional[dict], fmt: Optional[str]) -> str:
    """A short name of a scheme: `W4 int g32 sym`, `W8 int channel / A8 int token dynamic`, `NVFP4 / A NVFP4`."""
    if weights is None:
        w = "W16"
    elif fmt in _FLOAT_NAMES:
        w = _FLOAT_NAMES[fmt]
    else:
        kind = "fp" if weights.get("type") == "float" else "int"
        gran = (
            f"g{weights.get('group_size')}"
            if weights.get("strategy") in ("group", "tensor_group")
            else str(weights.get("strategy"))
        )
        w = f"W{weights.get('num_bits')} {kind} {gran}" + ("" if weights.get("symmetric", True) else " asym")
    if not act:
        return w if weights is None else f"{w} / A16"
    if act.get("strategy") == "tensor_group" and act.get("type") == "float":
        return f"{w} / A NVFP4"
    how = "dynamic" if act.get("dynamic") is True else "static"
    kind = "fp" if act.get("type") == "float" else "int"
    return f"{w} / A{act.get('num_bits')} {kind} {act.get('strategy')} {how}"


def _declared_text(export: Export, name: str, kind: str) -> str:
    state, group = declared(export.qc, name, kind)
    if state == "group":
        g = export.qc["config_groups"][group]
        return describe(g.get("weights"), g.get("input_activations"), g.get("format") or export.qc.get("format"))
    return {"ignored": "ignore (load_quantized only)", "undeclared": "not declared"}.get(state, f"{state}: {group}")


def module_rows(export: Export, report: Report) -> None:
    """A row per quantized module and per expert projection, and the declaration problems."""
    for name, rec in export.modules.items():
        if rec.get("tied_to"):
            continue
        report.rows[name] = ModuleRow(
            name,
            rec["kind"],
            describe(rec["weights"], rec["input_activations"], rec["format"]),
            _declared_text(export, name, rec["kind"]),
        )
        state, _ = declared(export.qc, name, rec["kind"])
        if rec["weights"] is not None and not layout.portable(rec) and state == "undeclared":
            report.notes.append(
                f"{name}: {layout.unportable_reason(rec)} is not in quantization_config.ignore "
                "(an export of an older qcompress); only the refusal group keeps loaders off it"
            )
    for pname, rec in export.experts.items():
        if rec.get("weights") is None and not rec.get("input_activations"):
            continue
        for label, names in expert_rows(rec):
            scheme = describe(rec.get("weights"), rec.get("input_activations"), rec.get("format"))
            texts = sorted({_declared_text(export, n, "experts") for n in names}) or [
                _declared_text(export, label, "experts")
            ]
            report.rows[label] = ModuleRow(label, "experts", scheme, " | ".join(texts))
            states = {declared(export.qc, n, "experts")[0] for n in names}
            if rec.get("weights") is not None and names and "undeclared" in states:
                report.problem(
                    "config.json",
                    label,
                    "quantized experts are not in quantization_config.config_groups: vLLM and "
                    "transformers build them unquantized and then refuse their weight_scale "
                    "tensors (an export of an older qcompress: export it again)",
                )
            if rec.get("weights") is not None and rec.get("fused") is not None:
                report.notes.append(f"{label}: fused experts are stored for load_quantized only")
            elif rec.get("weights") is not None and rec.get("streamed") and label.endswith(("gate_proj", "down_proj")):
                report.notes.append(
                    f"{pname}: gpt-oss experts under vLLM's per-expert names "
                    f"({rec['streamed']['prefix']}.{{e}}.{rec['streamed']['param']}_*), which its gpt-oss "
                    "loader streams; load_quantized reads them; transformers refuses (it reads "
                    "gpt-oss experts only unquantized)"
                )
    _fused_shards(export, report)
    run_sections(export, report, "offline")


def _fused_shards(export: Export, report: Report) -> None:
    """vLLM runs q/k/v (and gate/up) as one layer with one scheme: their declarations must agree."""
    known = set(export.modules) | {i for i in export.qc.get("ignore") or () if isinstance(i, str)}
    for name in export.modules:
        for shards in FUSED_SHARDS:
            parent, _, leaf = name.rpartition(".")
            if leaf != shards[0]:
                continue
            seen = {}
            for s in shards:
                full = f"{parent}.{s}"
                if full not in known:
                    continue
                rec = export.modules.get(full)
                state, group = declared(export.qc, full, "linear")
                seen[s] = (state, group, json.dumps(rec and rec.get("weights"), sort_keys=True))
            if len({v[:2] for v in seen.values()}) > 1:
                report.problem(
                    "vllm",
                    f"{parent}.{'/'.join(shards)}",
                    "vLLM fuses these projections into one layer and needs one scheme for all of "
                    f"them; config.json declares {sorted({v[1] or v[0] for v in seen.values()})}",
                )


# --- load_quantized ----------------------------------------------------------------------------


def fresh_model(config: dict):
    """A random-weight model of the export's architecture, built from its config.json with
    transformers (None when transformers or the class is not there)."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or "model_type" not in config:
        return None, f"no transformers class for architectures={config.get('architectures')!r}"
    plain = {k: v for k, v in config.items() if k not in ("quantization_config", "qcompress", "architectures")}
    import torch

    try:
        conf = transformers.AutoConfig.for_model(**plain)
        model = cls._from_config(conf, dtype=torch.float32) if hasattr(cls, "_from_config") else cls(conf)
    except Exception as err:  # noqa: BLE001 -- an architecture this transformers cannot build
        return None, f"transformers cannot build {arch} ({type(err).__name__}: {err})"
    return model, ""


def probe_ids(config: dict, batch: int = 1, length: int = 8):
    import torch

    vocab = int(config.get("vocab_size") or 32)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=g)


def greedy(model, ids, steps: int):
    """`steps` greedy tokens after `ids` with full recomputation (any causal LM, no cache), and the
    log-probabilities of every step [steps, vocab]."""
    import torch

    out, lps = ids, []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(out).logits[:, -1].float()
            lps.append(torch.log_softmax(logits, -1))
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
    return out[:, ids.shape[1] :], torch.stack(lps, 1)


def check_load_quantized(export: Export, report: Report, steps: int = 4):
    """Load the export with load_quantized into a fresh model of its class and generate; returns the
    loaded model (None when it could not be built)."""
    import torch
    from ..export.reader import load_quantized

    res = report.consumers.setdefault("load_quantized", ConsumerResult())
    model, why = fresh_model(export.config)
    if model is None:
        res.detail = f"not run: {why}"
        return None
    res.loads = False
    try:
        if str(export.config.get("dtype")) == "bfloat16":
            model = model.to(torch.bfloat16)
        load_quantized(export.folder, model)
        res.loads = True
        ids = probe_ids(export.config)
        if hasattr(model, "generation_config") and type(model).__name__.endswith("ForCausalLM"):
            _, lps = greedy(model, ids, steps)
            res.generates = bool(torch.isfinite(lps).all())
        else:
            with torch.inference_mode():
                out = model(ids)
            first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
            res.generates = bool(torch.isfinite(first.float()).all())
        if not res.generates:
            report.problem("load_quantized", "(model)", "the loaded model computes non-finite outputs")
    except Exception as err:  # noqa: BLE001 -- reported, with the module where the error names one
        report.problem("load_quantized", "(model)", f"{type(err).__name__}: {err}")
        return None
    for row in report.rows.values():
        row.consumers["load_quantized"] = row.scheme
    return model


def verify_offline(export: Export, load: bool = True) -> Report:
    report = Report(export.folder)
    module_rows(export, report)
    if load:
        check_load_quantized(export, report)
    return report


def offline_verify(folder: str) -> dict:
    """`qcompress verify FOLDER`'s offline part for a training report (the caller has reloaded the
    export already): {"exit_code", "problems", "notes"}."""
    from .export import read_export

    report = verify_offline(read_export(folder), load=False)
    return {"exit_code": report.exit_code, "problems": [p.line() for p in report.problems], "notes": list(report.notes)}
