"""Training engine: qcompress.initialize(model, cfg) and memory estimates per ZeRO stage."""
from .engine import Engine
from .memory import estimate_memory


def initialize(model, cfg, model_parameters=None) -> Engine:
    """Build the engine for `model` from one DeepSpeed-layout config (Config, dict or path).

    Reads RANK/WORLD_SIZE from torchrun (or reuses an initialized process group), wraps the model
    for the configured ZeRO stage, builds optimizer, LR schedule, loss scaler and the compression
    scheduler. See Engine for the training rhythm.
    """
    return Engine(model, cfg, model_parameters)


__all__ = ["initialize", "estimate_memory", "Engine"]
