"""inspect_checkpoint: a per-tensor table of an export (format, bits, shape, bytes, ratio vs fp32)."""

from __future__ import annotations

import math
import os

from . import safetensors_io as sio
from .reader import read_config


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def inspect_checkpoint(folder) -> str:
    """Rows per stored tensor; quantized modules' fp32 size is their weight's numel * 4."""
    folder = os.fspath(folder)
    _, config, qc, modules = read_config(folder)
    headers = {}
    for path in sio.checkpoint_files(folder):
        entries, _, _ = sio.read_header(path)
        for k, info in entries.items():
            headers[k] = info
    owner = {}
    for name, rec in modules.items():
        for suffix in (
            "weight",
            "weight_packed",
            "weight_scale",
            "weight_zero_point",
            "weight_shape",
            "input_scale",
            "input_zero_point",
        ):
            owner[f"{name}.{suffix}"] = (name, rec)
    from .experts import inspect_owners  # fused mixture-of-experts Parameters, per expert

    experts = config["qcompress"].get("experts") or {}
    owner.update(inspect_owners(experts))
    kv = config["qcompress"].get("kv_cache") or {}  # KV-cache scales (export/kv_cache.py)
    kv_scales = {f"{n}.{s}" for n in kv.get("modules") or () for s in ("k_scale", "v_scale")}
    rows = [("tensor", "format", "bits", "dtype", "shape", "bytes", "fp32 bytes", "ratio")]
    total = total_fp32 = 0
    for k in sorted(headers):
        info = headers[k]
        b = info["data_offsets"][1] - info["data_offsets"][0]
        numel = math.prod(info["shape"]) if info["shape"] else 1
        fmt, bits, fp32 = "dense", "-", numel * 4
        if k in kv_scales:
            fmt, bits, fp32 = f"kv cache {kv.get('format')} per {kv.get('strategy')}", "8", 0
        elif k in owner:
            name, rec = owner[k]
            w = rec.get("weights")
            fmt = rec["format"]
            if w is not None:
                bits = str(w["num_bits"]) + ("" if rec["qtype"] == "int" else f" ({rec['qtype']})")
            if w is not None and (k.endswith((".weight", ".weight_packed")) or rec.get("codes_key") == k):
                fp32 = math.prod(rec["weight_shape"]) * 4
            elif k.endswith(".weight") and w is None:
                fp32 = numel * 4
            else:
                fp32 = 0  # scales etc. have no fp32 counterpart
        total += b
        total_fp32 += fp32
        ratio = f"{b / fp32:.3f}" if fp32 else "-"
        rows.append(
            (k, fmt, bits, info["dtype"], "x".join(map(str, info["shape"])) or "scalar", str(b), str(fp32), ratio)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"total {_fmt_bytes(total)} vs fp32 {_fmt_bytes(total_fp32)}: ratio "
        f"{total / max(total_fp32, 1):.3f}; quantization_config format "
        f"{qc.get('format')!r}, {len(modules)} quantized modules"
        + (f", {len(experts)} fused expert Parameters" if experts else "")
        + (
            f" ({tied} tied to another's stored weight)"
            if (tied := sum("tied_to" in r for r in modules.values()))
            else ""
        )
    )
    return "\n".join(lines)
