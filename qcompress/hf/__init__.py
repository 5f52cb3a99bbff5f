"""transformers integration: CompressionCallback (compression inside a Trainer, checkpoints,
export), CompressionTrainer (learned ranges in their own optimizer groups) and DistillationTrainer
(quantization-aware distillation). Needs transformers."""

try:  # checked here so the error says what to install
    import transformers  # noqa: F401
    import accelerate  # noqa: F401  (the Trainer requires it)
except ImportError as err:
    from ..errors import install_hint

    raise ImportError(
        f"qcompress.hf needs transformers and accelerate ({err.name or err} is missing): {install_hint('hf')}"
    ) from err

from .callback import CompressionCallback, load_compression_state, save_compression_state
from .trainer import CompressionTrainer, DistillationTrainer, distill_mask

__all__ = [
    "CompressionCallback",
    "CompressionTrainer",
    "DistillationTrainer",
    "save_compression_state",
    "load_compression_state",
    "distill_mask",
]
