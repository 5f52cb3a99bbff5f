"""qcompress: quantization-aware compression training for PyTorch.

Public API (see README.md): load_config, init_compression, summary, CompressionScheduler,
redundancy_clean, initialize, export_quantized, load_quantized, ConfigError, kernels_available,
and the submodules quant, comm, optim.
"""
from .errors import ConfigError, NonFiniteError
from .config import load_config
from .quant import kernels_available

__version__ = "0.1.0"

__all__ = ["ConfigError", "NonFiniteError", "load_config", "kernels_available", "__version__"]
