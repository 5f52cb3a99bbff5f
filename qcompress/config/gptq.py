"""GPTQ's settings: `observer: gptq` in a weight group, its `observer_kwargs`, and the checks a
group must pass to be solved by GPTQ (docs/gptq-and-rotations.md).

The keys sit in `observer_kwargs` beside the mse search's (grid, maxshrink, norm), which the
mse scale observer inside GPTQ takes (`scale_observer: mse`). Defaults are the GPTQ paper's and
llm-compressor's GPTQModifier's: dampening 0.01 of the Hessian's mean diagonal, lazy updates in
blocks of 128 columns, activation order on (llm-compressor's default "static" order for group
strategies; the paper's code leaves it off; benchmarks/experiments/README.md says what it did on
SmolLM2), each decoder block calibrated on the outputs of the already-quantized blocks before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .schema import field, join

GPTQ = "gptq"
SCALE_OBSERVERS = ("minmax", "mse")


@dataclass(frozen=True)
class GptqKwargs:
    """ext, observer gptq only: the solver's settings (ObserverKwargs takes these fields)."""

    damp: float = field(
        0.01,
        gt=0.0,
        le=10.0,
        doc="ext, gptq: dampening added to the Hessian's diagonal, as a fraction of its mean diagonal",
    )
    block_size: int = field(
        128, ge=1, le=1 << 20, doc="ext, gptq: columns per lazy batch update (rounded to a multiple of the group size)"
    )
    act_order: bool = field(
        True,
        doc="ext, gptq: columns in order of decreasing Hessian diagonal; group "
        "scales stay those of the original groups, chosen before the solve",
    )
    sequential: bool = field(
        True, doc="ext, gptq: each repeated block calibrated on the outputs of the already-quantized blocks before it"
    )
    scale_observer: str = field(
        "minmax",
        choices=SCALE_OBSERVERS,
        lower=True,
        doc="ext, gptq: how each group's (row's) scale is chosen inside the solve; mse takes grid, maxshrink and norm",
    )


GPTQ_KEYS = tuple(f.name for f in dataclasses.fields(GptqKwargs))
_DEFAULTS = GptqKwargs()


def gptq_keys_set(kw) -> list:
    """The GPTQ keys of an ObserverKwargs that differ from their defaults."""
    return [k for k in GPTQ_KEYS if getattr(kw, k) != getattr(_DEFAULTS, k)]


def check_kwargs(observer, kw, where: str) -> None:
    """GPTQ's keys only on a gptq group (observer None: the shared defaults, which no group
    solves with GPTQ); the mse search's input weighting never on one."""
    if kw is None:
        return
    if observer != GPTQ:
        keys = gptq_keys_set(kw)
        if keys:
            who = f"the group's observer is {observer!r}" if observer else "no group uses observer 'gptq'"
            raise ConfigError(
                join(where, keys[0]), f"is a setting of observer 'gptq', but {who}; set observer: gptq, or drop {keys}"
            )
        return
    if kw.weight_by != "none":
        raise ConfigError(
            join(where, "weight_by"),
            f"{kw.weight_by!r} weighs the mse search by the inputs; "
            "GPTQ solves against the whole input Hessian already: drop weight_by",
        )


def check_group(settings, tech_path: str) -> None:
    """What GPTQ cannot solve for, refused at the key that asks for it (settings: the group's
    WeightGroupSettings; tech_path: the weight_quantization section's path)."""
    group = settings.name
    params_at = join(tech_path, f"different_groups.{group}.params")
    if settings.start_bits != settings.target_bits:
        raise ConfigError(
            join(params_at, "start_bits"),
            f"GPTQ solves the weights once for one width, but "
            f"the schedule goes from {settings.start_bits} to {settings.target_bits} bits; set "
            "start_bits = target_bits (or use minmax / mse for a bit schedule)",
        )
    if settings.target_bits <= 2 and (settings.target_bits == 1 or settings.ternary):
        raise ConfigError(
            join(params_at, "target_bits"),
            f"{settings.target_bits}-bit weights are binary / "
            "ternary (a scale from the mean |w|, no integer grid for GPTQ to round onto); use "
            "observer minmax / mse, or ternary: false for the 4-level grid",
        )
    if settings.rounding != "nearest":
        raise ConfigError(
            join(tech_path, "shared_parameters.rounding"),
            f"group {group!r} uses observer gptq, which propagates each column's round-to-nearest "
            "error; stochastic rounding draws another grid point every step: use rounding: nearest",
        )
    if settings.mix_enabled:
        raise ConfigError(
            join(tech_path, "shared_parameters.fp16_mixed_quantize.enabled"),
            f"group {group!r} uses observer gptq, whose grid the blend of full-precision and "
            "quantized weights would hide; turn fp16_mixed_quantize off",
        )
