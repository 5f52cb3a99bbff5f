"""transformers integration: CompressionCallback (compression inside a Trainer, checkpoints,
export) and DistillationTrainer (quantization-aware distillation). Needs transformers."""
try:  # checked here so the error says what to install
    import transformers  # noqa: F401
    import accelerate  # noqa: F401  (the Trainer requires it)
except ImportError as err:
    raise ImportError(f"qcompress.hf needs transformers and accelerate ({err.name or err} is missing): "
                      "pip install qcompress[hf]") from err

from .callback import CompressionCallback, load_compression_state, save_compression_state
from .trainer import DistillationTrainer, distill_mask

__all__ = ["CompressionCallback", "DistillationTrainer", "save_compression_state",
           "load_compression_state", "distill_mask"]
