"""Loading an export in transformers (README, Export: "In transformers"; docs/formats.md).

`from_pretrained(folder, quantization_config=dequantize_config())` decompresses every quantized
nn.Linear at load time with compressed-tensors, into the same float weights as
`qcompress.load_quantized` (bit for bit); activations then run unquantized. Plain
`from_pretrained(folder)` decompresses too and keeps compressed-tensors' quantize-dequantize of the
input activations, which for float formats is qcompress's own math: `transformers_kwargs` picks
the call that reproduces an export's logits. Exports with weights outside compressed-tensors' reach
(transformers' Conv1D, Conv, Embedding, Linears with partial groups) carry a config group that makes
transformers refuse them (layout.REFUSAL_GROUP).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .errors import ExportError

# compressed-tensors 0.20 decompresses these layouts to bfloat16 whatever the model's dtype
# (its FP4 unpacking and E8M0 scales are bfloat16); the plain route then multiplies a bfloat16
# weight with the model's float32 inputs and fails
BF16_DECOMPRESSED = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")


def dequantize_config():
    """transformers' CompressedTensorsConfig that decompresses on load: `dequantize=True`
    (transformers 5), or its older spelling `run_compressed=False`."""
    import inspect

    from transformers import CompressedTensorsConfig

    if "dequantize" in inspect.signature(CompressedTensorsConfig.__init__).parameters:
        return CompressedTensorsConfig(dequantize=True)
    return CompressedTensorsConfig(run_compressed=False)


def _groups(qconf: dict) -> list:
    """The config groups that quantize modules (not the guard or refusal groups)."""
    return [
        g
        for g in (qconf.get("config_groups") or {}).values()
        if isinstance(g, dict) and g.get("targets") not in ([], ["re:^$"])
    ]


def transformers_kwargs(folder, dtype: Optional[str] = None) -> dict:
    """from_pretrained keyword arguments under which transformers computes the export's logits.

    Exports with float input activations or a kv_cache_scheme: none, so compressed-tensors applies
    its quantization lifecycle and fake-quantizes each Linear's input and each attention module's
    keys / values as qcompress did (`dequantize=True` would drop that; FP8 per-token inputs of
    rank 2 are the one difference, docs/formats.md). Other
    exports: `dequantize_config()`, exact weights (compressed-tensors' dynamic int8 activations
    divide absmax by 127.5 where qcompress and vLLM divide by 127, so int activations match in
    neither call). Refused with an ExportError naming the reason: float-activation exports with
    NVFP4 / MXFP4 / MXFP8 weights in a model that is not bfloat16 (`dtype`, default the export's
    config.json dtype), as compressed-tensors decompresses those weights to bfloat16 only."""
    path = os.path.join(os.fspath(folder), "config.json")
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    qconf = config.get("quantization_config") or {}
    groups = _groups(qconf)
    kv = qconf.get("kv_cache_scheme") is not None  # applied by the lifecycle only, as float activations
    if not kv and not any((g.get("input_activations") or {}).get("type") == "float" for g in groups):
        return {"quantization_config": dequantize_config()}
    dtype = str(dtype or config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    formats = sorted({g.get("format") or qconf.get("format") for g in groups} & set(BF16_DECOMPRESSED))
    if formats and dtype != "bfloat16":
        raise ExportError(
            f"{path}: quantization_config formats {formats} with quantized input activations or KV cache: "
            f"compressed-tensors decompresses these weights to bfloat16 only, so transformers cannot run "
            f"this {dtype} model with its activation quantization (dequantize=True would run the "
            "activations unquantized); use qcompress.load_quantized(folder, model), or train and "
            "export the model in bfloat16 (qcompress train --dtype bfloat16; in Python, load it with "
            "from_pretrained(..., dtype=torch.bfloat16))"
        )
    return {}
