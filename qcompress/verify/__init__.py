"""`qcompress verify EXPORT [--vllm] [--transformers]`: for every quantized module of an export,
the scheme each consumer uses (qcompress.load_quantized, transformers / compressed-tensors, vLLM),
whether the export loads and generates there, and the problems that make it exit 1.

    report = qcompress.verify.verify("out/export", vllm=False, transformers=False)
    print(report.format()); report.exit_code

Reading the export runs load_quantized's own checks: bad input raises CheckpointError (exit 2).
Per-section checks of quantization_config register in sections.py.
"""
from __future__ import annotations

from .export import Export, read_export
from .offline import verify_offline
from .report import ConsumerResult, ModuleRow, Problem, Report
from .sections import section_check

__all__ = ["verify", "read_export", "Export", "Report", "ModuleRow", "ConsumerResult", "Problem",
           "section_check", "verify_offline"]


def verify(folder, *, vllm: bool = False, transformers: bool = False, load: bool = True,
           vllm_dtype=None) -> Report:
    """The offline checks always; transformers' and vLLM's own loaders when asked (each import
    error is a problem of that consumer: it was asked for and is not there)."""
    import os
    export = read_export(os.fspath(folder))
    report = verify_offline(export, load=load)
    if transformers:
        from .hf import check_transformers
        check_transformers(export, report)
    if vllm:
        from .vllm import check_vllm
        check_vllm(export, report, dtype=vllm_dtype)
    return report
