"""The ZeRO settings the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) cannot run under,
refused when the config loads: they compress the exchange of each rank's whole local momentum
inside their own step, on the training device, so placements that shard or offload that state
do not hold what they need. (OneBitLamb under tensor parallelism is refused where the mesh is
built, parallel/mesh.py, as it depends on the model's split.)"""

from __future__ import annotations

from ..errors import ConfigError

ONEBIT_TYPES = ("onebitadam", "zerooneadam", "onebitlamb")


def is_onebit(opt_cfg) -> bool:
    """Whether the config's optimizer section names a 1-bit optimizer."""
    return opt_cfg is not None and opt_cfg.type.lower() in ONEBIT_TYPES


def refuse_onebit_placements(cfg) -> None:
    """ConfigError naming the key of a ZeRO setting the config's 1-bit optimizer cannot run under;
    nothing for other optimizers."""
    if not is_onebit(cfg.optimizer):
        return
    name, zero = cfg.optimizer.type, cfg.zero_optimization
    if zero.offload_optimizer.device == "nvme":
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            f"{name} keeps compression errors beside its moments and steps them "
            "all at once; 'nvme' offload streams plain optimizers (Adam, AdamW, Lamb, SGD) only",
        )
    if zero.offload_optimizer.device == "cpu":
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            f"{name} runs its compressed all-reduce inside its step, on the "
            "training device; 'cpu' offload steps plain optimizers (Adam, AdamW, Lamb, SGD) only",
        )
    if zero.stage >= 2:
        raise ConfigError(
            "zero_optimization.stage",
            f"{name} needs the full local gradient and momentum on every rank "
            f"for its compressed all-reduce; stage {zero.stage} shards them (FSDP2). "
            "Use stage 0 or 1",
        )
