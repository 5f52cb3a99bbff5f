"""train_batch_size = micro_batch × gradient_accumulation × world_size: any two give the third;
train_batch_size or micro_batch alone take accumulation 1 (DeepSpeed's rules)."""

from __future__ import annotations

from typing import Optional, Tuple

from ..errors import ConfigError


def resolve_batch(tbs: Optional[int], mbs: Optional[int], gas: Optional[int], world: int) -> Tuple[int, int, int]:
    """Return (train_batch_size, micro_batch, accumulation); ConfigError when they disagree or
    neither train_batch_size nor train_micro_batch_size_per_gpu is given."""
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world:
            raise ConfigError(
                "train_batch_size",
                f"{tbs} != train_micro_batch_size_per_gpu ({mbs}) × "
                f"gradient_accumulation_steps ({gas}) × world size ({world}) = {mbs * gas * world}",
            )
        return tbs, mbs, gas
    if tbs is not None and mbs is not None:
        if tbs % (mbs * world):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by train_micro_batch_size_per_gpu ({mbs}) × world size ({world})",
            )
        return tbs, mbs, tbs // (mbs * world)
    if tbs is not None:
        gas = gas or 1
        if tbs % (gas * world):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by gradient_accumulation_steps ({gas}) × world size ({world})",
            )
        return tbs, tbs // (gas * world), gas
    if mbs is not None:
        gas = gas or 1
        return mbs * gas * world, mbs, gas
    # As DeepSpeed: accumulation alone does not say how many samples a step takes.
    given = f" (only gradient_accumulation_steps = {gas} is set)" if gas is not None else ""
    raise ConfigError(
        "train_batch_size",
        "set train_batch_size or train_micro_batch_size_per_gpu"
        + given
        + "; any two of train_batch_size, train_micro_batch_size_per_gpu and "
        "gradient_accumulation_steps give the third, and accumulation defaults to 1",
    )
