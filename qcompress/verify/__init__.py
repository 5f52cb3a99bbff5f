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
from . import kv_cache, transforms  # noqa: F401,E402 -- they register their section checks

__all__ = [
    "verify",
    "read_export",
    "Export",
    "Report",
    "ModuleRow",
    "ConsumerResult",
    "Problem",
    "section_check",
    "verify_offline",
]


def verify(folder, *, vllm: bool = False, transformers: bool = False, load: bool = True, vllm_dtype=None) -> Report:
    """The offline checks always; transformers' and vLLM's own loaders when asked (each import
    error is a problem of that consumer: it was asked for and is not there)."""
    import os
    from .offline import check_load_quantized, greedy, module_rows, probe_ids

    export = read_export(os.fspath(folder))
    report = Report(export.folder)
    module_rows(export, report)
    model = check_load_quantized(export, report) if load else None
    if transformers:
        from .hf import check_transformers

        check_transformers(export, report, model)
    if vllm:
        from .vllm import check_vllm, default_dtype

        dtype = vllm_dtype or default_dtype(export)
        prompts = probe_ids(export.config, batch=2)
        reference = None
        if model is not None and type(model).__name__.endswith("ForCausalLM"):
            reference = greedy(model, prompts, 6)
        # bfloat16 serving against a float32 reference: log-probabilities agree to bfloat16's precision
        check_vllm(
            export,
            report,
            dtype=dtype,
            prompts=prompts.tolist(),
            steps=6,
            reference=reference,
            tol=1e-2 if dtype == str(export.config.get("dtype") or "float32") else 0.1,
            model=model,
        )
    return report
