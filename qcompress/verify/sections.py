"""Checks of quantization_config's sections, one function per key, registered by name.

compressed-tensors' quantization_config grows sections (`kv_cache_scheme` with `self_attn.k_scale`
/ `v_scale` tensors, `transform_config` with `{module}.{scheme}_{location}.weight` tensors, ...).
A section with a registered check is checked; a section without one is reported as present and
not checked, never a failure, so an export of a newer writer still verifies. To add a check:

    from qcompress.verify.sections import section_check

    @section_check("kv_cache_scheme")
    def _kv(export, report, value):      # export: verify.export.Export; value: the section
        ...                               # report.problem(consumer, module, reason) / report.notes

Checks registered for consumer "vllm" run only under `qcompress verify --vllm`, with vLLM
importable; they get `vllm_config` (vLLM's CompressedTensorsConfig) as a fourth argument.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

# keys of quantization_config that verify's module checks cover (or that carry no tensors)
CORE_KEYS = (
    "quant_method",
    "format",
    "quantization_status",
    "config_groups",
    "ignore",
    "global_compression_ratio",
    "version",
)

SECTION_CHECKS: Dict[Tuple[str, str], Callable] = {}


def section_check(key: str, consumer: str = "offline"):
    """Register `fn(export, report, value[, vllm_config])` as the check of quantization_config[key]."""

    def register(fn):
        SECTION_CHECKS[(key, consumer)] = fn
        return fn

    return register


def empty(value) -> bool:
    return value is None or value == {} or value == []


def run_sections(export, report, consumer: str = "offline", *extra) -> None:
    for key, value in (export.qc or {}).items():
        if key in CORE_KEYS or empty(value):
            continue
        fn = SECTION_CHECKS.get((key, consumer))
        if fn is not None:
            fn(export, report, value, *extra)
        elif consumer == "offline" and not any(k == key for k, _ in SECTION_CHECKS):
            report.notes.append(
                f"quantization_config.{key} is present; qcompress verify has no check "
                "for it (its tensors and what consumers do with it are not verified)"
            )


@section_check("sparsity_config")
def _sparsity(export, report, value) -> None:
    """qcompress never writes sparse layouts; vLLM has dropped them (it refuses such configs)."""
    report.problem(
        "vllm",
        "quantization_config.sparsity_config",
        "a non-empty sparsity_config: vLLM no longer loads compressed-tensors sparsity",
    )
