"""`qcompress verify`: the online rotations of an export (quantization_config.transform_config).

qcompress writes one scheme, R4: an input transform of every rotated down_proj, its block stored
unnormalized as `{module}.R4_input.weight`. What each consumer does with it:
- load_quantized rebuilds the rotation before the module (checked by loading the export);
- transformers' from_pretrained drops transform_config: its outputs differ from the trained
  model's unless compressed-tensors' apply_transform_config runs after loading
  (qcompress.export.rotations.apply_to_transformers does both steps); `--transformers` measures both;
- vLLM applies online input transforms of Linear layers (hadamard through its Hadamard kernel, any
  other type as a dense product), with tensor parallelism 1 only.
"""

from __future__ import annotations

from .report import Report
from .sections import section_check

VLLM_USE = "applies the online input transform (tensor parallelism 1 only)"
TRANSFORMERS_USE = "drops transform_config: apply_transform_config after from_pretrained"


@section_check("transform_config")
def check_transform_config(export, report: Report, value) -> None:
    """The section parses as compressed-tensors' TransformConfig, every target is a module of the
    export, and every target's block is stored with a square shape that divides its input width."""
    try:
        from compressed_tensors.transform import TransformConfig

        TransformConfig.model_validate(value)
    except ImportError:
        report.notes.append("compressed-tensors is not importable: transform_config checked by qcompress only")
    except Exception as err:  # noqa: BLE001 -- a pydantic error names the field
        report.problem(
            "config.json",
            "quantization_config.transform_config",
            f"compressed-tensors cannot read it: {str(err).splitlines()[0][:200]}",
        )
        return
    for scheme_name, scheme in (value.get("config_groups") or {}).items():
        for entry in scheme.get("apply", []):
            location = entry.get("location")
            for target in entry.get("targets", []):
                key = f"{target}.{scheme_name}_{location}.weight"
                row = report.rows.get(target)
                if row is None:
                    report.problem(
                        "config.json",
                        target,
                        f"transform_config {scheme_name!r} targets a module the export does not quantize or hold",
                    )
                    continue
                block = export.tensors.get(key)
                if block is None:
                    report.problem("load_quantized", target, f"transform_config names {key}, which no shard holds")
                    continue
                shape = tuple(block.shape)
                if len(shape) != 2 or shape[0] != shape[1]:
                    report.problem("load_quantized", target, f"{key} has shape {list(shape)}, not a square block")
                    continue
                row.scheme += f" + {scheme_name} {location} ({scheme.get('type')})"
                row.consumers["transformers"] = TRANSFORMERS_USE
                row.consumers["vllm"] = (
                    VLLM_USE
                    if location in ("input", "output")
                    else f"refuses {location} transforms (online input / output only)"
                )
                if location not in ("input", "output"):
                    report.problem(
                        "vllm", target, f"vLLM applies only online input / output transforms, not {location}"
                    )
