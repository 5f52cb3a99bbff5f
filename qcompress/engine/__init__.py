"""Training engine: qcompress.initialize(model, cfg) and memory estimates per ZeRO stage."""

from .checkpoint import CheckpointError
from .engine import Engine
from .memory import estimate_memory


def initialize(model, cfg, model_parameters=None, optimizer=None, device=None) -> Engine:
    """Build the engine for `model` from one DeepSpeed-layout config (Config, dict or path).

    Reads RANK/WORLD_SIZE from torchrun (or reuses an initialized process group), wraps the model
    for the configured ZeRO stage, builds optimizer, LR schedule, loss scaler and the compression
    scheduler. See Engine for the training rhythm.

    optimizer: a client optimizer for configs without an `optimizer` section, as DeepSpeed takes
    one: a callable `params -> torch.optim.Optimizer` (every ZeRO stage: it is built on the wrapped,
    possibly sharded parameters) or a ready instance over the model's parameters (stage 0, or any
    stage in a single process up to 1). The config's `scheduler` drives its learning rate.

    device: where the model trains: None (cuda:LOCAL_RANK when torch sees a GPU, else the CPU, as
    DeepSpeed), "cpu", "cuda" or "cuda:N". Batches passed to the engine must already be there.
    """
    return Engine(model, cfg, model_parameters, optimizer, device)


__all__ = ["initialize", "estimate_memory", "Engine", "CheckpointError"]
