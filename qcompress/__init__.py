"""qcompress: quantization-aware compression training for PyTorch.

import qcompress as qc
cfg = qc.load_config("ds_config.json", "schedules/w4a8_progressive.yaml")
model = qc.init_compression(model, cfg)
engine = qc.initialize(model, cfg)          # or: sched = qc.CompressionScheduler(model, cfg)
...
model = qc.redundancy_clean(model, cfg)
qc.export_quantized(model, "out/")
"""

from . import quant
from .config import Config, load_config
from .errors import CheckpointError, ConfigError, NonFiniteError
from .quant import kernels_available
from .rewrite import init_compression, redundancy_clean, summary
from .transforms import apply_rotations
from .calibrate.input_moments import calibrate_weight_ranges
from .calibrate.learn_ranges import learn_ranges
from .schedule import CompressionScheduler

__version__ = "0.1.0"


def __getattr__(name):
    # Heavier parts load on first use, so `import qcompress` stays light.
    if name in ("initialize", "estimate_memory"):
        from . import engine

        return getattr(engine, name)
    if name in ("export_quantized", "load_quantized"):
        from . import export

        return getattr(export, name)
    if name in ("comm", "optim", "engine", "export", "pruning"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'qcompress' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ConfigError",
    "NonFiniteError",
    "Config",
    "load_config",
    "init_compression",
    "redundancy_clean",
    "summary",
    "apply_rotations",
    "CompressionScheduler",
    "calibrate_weight_ranges",
    "learn_ranges",
    "initialize",
    "estimate_memory",
    "export_quantized",
    "load_quantized",
    "kernels_available",
    "quant",
    "comm",
    "optim",
    "__version__",
]
