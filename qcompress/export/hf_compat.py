"""Loading an export in transformers (README, Export: "In transformers").

`from_pretrained(folder, quantization_config=dequantize_config())` decompresses every quantized
nn.Linear at load time with compressed-tensors, into the same float weights as
`qcompress.load_quantized` (bit for bit); activations then run unquantized. Exports with weights
outside compressed-tensors' reach (transformers' Conv1D, Conv, Embedding, Linears with partial
groups) carry a config group that makes transformers refuse them (layout.REFUSAL_GROUP).
"""
from __future__ import annotations


def dequantize_config():
    """transformers' CompressedTensorsConfig that decompresses on load: `dequantize=True`
    (transformers 5), or its older spelling `run_compressed=False`."""
    import inspect

    from transformers import CompressedTensorsConfig
    if "dequantize" in inspect.signature(CompressedTensorsConfig.__init__).parameters:
        return CompressedTensorsConfig(dequantize=True)
    return CompressedTensorsConfig(run_compressed=False)
