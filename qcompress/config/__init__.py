"""Config: typed schema, loading (JSON, YAML, dict), merging, validation."""

from ..errors import ConfigError
from .compression import (
    ActQuantParams,
    ActQuantShared,
    CompressionConfig,
    Group,
    LayerReduction,
    PruningParams,
    Technique,
    WeightQuantParams,
    WeightQuantShared,
)
from .loader import as_config, deep_merge, load_config, read_document
from .schema import to_dict
from .training import BF16, FP16, Config, Optimizer, Scheduler, ZeroOptimization

__all__ = [
    "ConfigError",
    "Config",
    "CompressionConfig",
    "Technique",
    "Group",
    "WeightQuantShared",
    "WeightQuantParams",
    "ActQuantShared",
    "ActQuantParams",
    "PruningParams",
    "LayerReduction",
    "FP16",
    "BF16",
    "Optimizer",
    "Scheduler",
    "ZeroOptimization",
    "load_config",
    "as_config",
    "deep_merge",
    "read_document",
    "to_dict",
]
