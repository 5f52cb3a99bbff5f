"""An export as `qcompress verify` reads it: config.json, the tensors, and the name each quantized
weight is known by to compressed-tensors' loaders (a Linear's module name; an expert matrix's
per-expert names, `...experts.{e}.gate_proj`). Reading it runs load_quantized's own checks, so a
folder that is not an export, a truncated shard or a config that contradicts the tensors is a
CheckpointError naming the file and tensor (the CLI prints it on one line and exits 2)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..export import layout
from ..export import safetensors_io as sio
from ..export.errors import CheckpointError
from ..export.manifest import check_expert_groups, check_quant_config, check_tensors, read_config, resolve_ties


@dataclass
class Export:
    folder: str
    cfg_path: str
    config: dict
    qc: dict
    modules: Dict[str, dict]
    experts: Dict[str, dict]
    tensors: Dict[str, object] = field(repr=False, default_factory=dict)
    where: Dict[str, str] = field(repr=False, default_factory=dict)


def read_export(folder: str) -> Export:
    cfg_path, config, qc, modules = read_config(folder)
    check_quant_config(qc, modules, cfg_path)
    experts = config["qcompress"].get("experts") or {}
    if not isinstance(experts, dict):
        raise CheckpointError(f"{cfg_path}: qcompress.experts is {type(experts).__name__}, not an object")
    check_expert_groups(qc, experts, cfg_path)
    unbound: List[str] = []
    tensors, where, _ = sio.read_checkpoint(folder, problems=unbound)
    resolve_ties(tensors, where, modules)
    check_tensors(tensors, where, modules, cfg_path)
    if unbound:
        raise CheckpointError(unbound[0])
    _check_expert_tensors(experts, tensors, cfg_path)
    return Export(folder, cfg_path, config, qc, modules, experts, tensors, where)


def _check_expert_tensors(experts, tensors, cfg_path) -> None:
    """Every stored entry an experts record names must be there (load_quantized would stop at it)."""
    from ..export.experts import streamed_name, tensor_name

    for name, rec in experts.items():
        if rec.get("weights") is None:
            continue
        codes = (
            "weight_packed"
            if rec.get("format") in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")
            else "weight"
        )
        if rec.get("streamed"):
            keys = [
                streamed_name(rec["streamed"], e, s) for e in range(rec["shape"][0]) for s in (codes, "weight_scale")
            ]
        else:
            saved = [rec["fused"]] if rec.get("fused") is not None else [p[0] for p in rec.get("pieces") or ()]
            keys = [tensor_name(s, suffix) for s in saved for suffix in (codes, "weight_scale")]
        for key in keys:
            if key not in tensors:
                raise CheckpointError(
                    f"{cfg_path}: experts {name!r} needs tensor {key!r}, which no checkpoint file holds"
                )


# --- compressed-tensors' matching of a name against targets / ignore ---------------------------


def matches(pattern, name: str, kind: str) -> bool:
    """A `targets` / `ignore` entry against a module name: `re:` patterns with re.match, plain
    entries by equality or as the class name (`Linear` for an nn.Linear)."""
    if not isinstance(pattern, str):
        return False
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or (pattern == "Linear" and kind in ("linear", "experts"))


def declared(qc: dict, name: str, kind: str) -> Tuple[str, Optional[str]]:
    """("ignored" | "group" | "undeclared" | "ambiguous", the config group's name)."""
    if any(matches(p, name, kind) for p in qc.get("ignore") or ()):
        return "ignored", None
    hits = [
        g
        for g, s in (qc.get("config_groups") or {}).items()
        if isinstance(s, dict) and any(matches(t, name, kind) for t in s.get("targets") or ())
    ]
    if not hits:
        return "undeclared", None
    return ("group", hits[0]) if len(hits) == 1 else ("ambiguous", ", ".join(hits))


def expert_rows(rec: dict) -> List[Tuple[str, List[str]]]:
    """(row label, per-expert module names) of an experts record: one row per projection
    (`...experts.*.gate_proj`), or the fused Parameter's own name (gpt-oss)."""
    if not layout.expert_modules(rec):
        return [(rec.get("fused") or "?", [])]
    rows: Dict[str, List[str]] = {}
    for n in layout.expert_modules(rec):
        label = re.sub(r"\.\d+\.([^.]+)$", r".*.\1", n)
        rows.setdefault(label, []).append(n)
    return list(rows.items())
