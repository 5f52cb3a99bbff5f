"""engine.save_16bit_model: DeepSpeed's consolidated save. The whole state dict (FSDP2 shards
gathered, collectively) in the training dtype (fp16 / bf16; fp32 when training in fp32), written
by rank 0 as one safetensors file, atomically. At stage 3 DeepSpeed writes it only with
zero_optimization.stage3_gather_16bit_weights_on_model_save; without, it warns and writes nothing."""

from __future__ import annotations

import logging
import os
from typing import Dict

import torch

from .. import atomic

log = logging.getLogger("qcompress.engine")

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def consolidated_state_dict(
    module: torch.nn.Module, precision: str, exclude_frozen: bool = False
) -> Dict[str, torch.Tensor]:
    """Whole CPU tensors; floating ones cast to the training dtype. Collective when sharded."""
    dtype = _DTYPES[precision]
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if name in frozen:
            continue
        value = value.detach().cpu()
        out[name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    return out


def _unshared(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied embeddings): keep the first of each."""
    seen, out = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), v.numel())
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def save_16bit_model(
    engine, save_dir: str, save_filename: str = "model.safetensors", exclude_frozen_parameters: bool = False
) -> bool:
    """Collective. Returns True when the file was written (rank 0) or would be (other ranks)."""
    zero = engine.config.zero_optimization
    if engine.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        if engine.rank == 0:
            log.warning(
                "save_16bit_model: nothing saved; at ZeRO stage 3 it needs "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (save_checkpoint "
                "saves the shards)"
            )
        return False
    sd = consolidated_state_dict(engine.module, engine.precision, exclude_frozen_parameters)
    if engine.rank == 0:
        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            save_file(_unshared(sd), tmp, metadata={"format": "pt"})
            atomic.fsync_file(tmp)
            atomic.fs_replace(tmp, path)  # a reader sees the old file or the whole new one
        finally:
            atomic.remove_quietly(tmp)
        atomic.fsync_dir(save_dir)
    if engine.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    return True
