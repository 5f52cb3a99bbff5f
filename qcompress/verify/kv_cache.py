"""`qcompress verify`: the KV-cache quantization of an export (quantization_config.kv_cache_scheme).

One row per attention module, its k_scale / v_scale tensors and what each consumer does with them
(qcompress.export.kv_cache.consumers). The scheme must parse as compressed-tensors'
QuantizationArgs and every scale must be float32, finite and positive, one per tensor or one per
KV head. vLLM serves FP8 caches only: an int8 scheme is a problem of the vLLM consumer (it would
run the cache unquantized or refuse it).
"""

from __future__ import annotations

import torch

from ..export import kv_cache
from ..export.errors import CheckpointError
from .report import ModuleRow, Report
from .sections import section_check


@section_check("kv_cache_scheme")
def check_kv_cache_scheme(export, report: Report, value) -> None:
    try:
        from compressed_tensors.quantization import QuantizationArgs

        QuantizationArgs.model_validate(value)
    except ImportError:
        report.notes.append("compressed-tensors is not importable: kv_cache_scheme checked by qcompress only")
    except Exception as err:  # noqa: BLE001 -- a pydantic error names the field
        report.problem(
            "config.json",
            "quantization_config.kv_cache_scheme",
            f"compressed-tensors cannot read it: {str(err).splitlines()[0][:200]}",
        )
        return
    try:
        layers = kv_cache.report(export.folder)
    except CheckpointError as err:
        report.problem("load_quantized", "kv_cache", str(err))
        return
    if not layers:
        report.problem(
            "config.json",
            "quantization_config.kv_cache_scheme",
            "a kv_cache_scheme without qcompress.kv_cache's module list: load_quantized cannot "
            "tell which attention modules it covers",
        )
        return
    uses = kv_cache.consumers(value)
    per_head = value.get("strategy") == "attn_head"
    heads = int(export.config.get("num_key_value_heads") or export.config.get("num_attention_heads") or 1)
    fmt = f"{'fp8' if value.get('type') == 'float' else 'int'}{value.get('num_bits')}"
    for name, k, v, _ in layers:
        for which, t in (("k_scale", k), ("v_scale", v)):
            want = heads if per_head else 1
            if (
                t.dtype != torch.float32
                or t.numel() != want
                or not bool(torch.isfinite(t).all())
                or not bool((t > 0).all())
            ):
                report.problem(
                    "load_quantized",
                    f"{name}.{which}",
                    f"expected {want} finite positive float32 value(s), got {t.dtype} {list(t.shape)}",
                )
        label = f"{name} (KV cache)"
        row = ModuleRow(
            label,
            "kv_cache",
            f"K/V {fmt} {'per head' if per_head else 'per tensor'}",
            f"kv_cache_scheme {value.get('type')} {value.get('num_bits')}-bit {value.get('strategy')}",
        )
        row.consumers.update({c: uses[c] for c in ("transformers", "vllm") if c in uses})
        report.rows[label] = row
    if not (value.get("type") == "float" and value.get("num_bits") == 8):
        report.problem("vllm", "quantization_config.kv_cache_scheme", uses.get("vllm", "not an FP8 KV cache"))
