"""The config's `compile` section: torch.compile of the model the engine trains.

The model is compiled in place (`Module.compile`, as DeepSpeed's engine.compile does), so the
engine, DDP / FSDP2 and a caller holding the model all run the compiled forward and backward.

A compressed model compiles one graph per schedule state: each bit level of a weight group and
each technique switching on is a different graph (the bits are constants of the quantizer ops),
while steps within a state reuse it. torch's default recompile limit (8 per code object) would
send a long schedule (8 to 2 bits, activations switching on, pruning) back to eager without a
word, so the limit is raised to RECOMPILE_LIMIT while compiling.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn as nn

from ..errors import ConfigError

log = logging.getLogger("qcompress")

RECOMPILE_LIMIT = 64


def check_backend(backend: str) -> None:
    """ConfigError naming compile.backend when torch has no backend of that name."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        from ..config.schema import did_you_mean

        raise ConfigError(
            "compile.backend",
            f"{backend!r} is not a torch.compile backend here; known: "
            f"{', '.join(sorted(known))}{did_you_mean(backend, known)}",
        )


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """At least `limit` graphs per compiled frame (one per schedule state, see the module docstring)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(int(cfg.recompile_limit), limit)
    cfg.accumulated_recompile_limit = max(int(cfg.accumulated_recompile_limit), 4 * limit)


def per_step_graphs(module: nn.Module) -> list:
    """Names of the modules whose quantizer changes a Python constant every step, so that each step
    compiles a new graph: stochastic rounding with learned or observer-chosen ranges (there the step
    is folded into the seed, an int argument of the quantizer op; with min/max ranges it is a tensor
    input, quant/stepped.py) and an fp16_mixed_quantize blend in progress (its ratio, a float)."""
    out = []
    for name, mod in module.named_modules():
        wq = mod.__dict__.get("qc_wq")
        if wq is not None and ((wq.rounding == "stochastic" and not wq.step_as_input()) or wq.mix_enabled):
            out.append(name)
    return out


def compile_model(module: nn.Module, section) -> bool:
    """Compile `module` in place when section.enabled (config/compile.py's Compile); returns
    whether it did."""
    if section is None or not section.enabled:
        return False
    check_backend(section.backend)
    raise_recompile_limit()
    moving = per_step_graphs(module)
    if moving:
        warnings.warn(
            f"compile: {len(moving)} modules ({', '.join(moving[:3])}{', ...' if len(moving) > 3 else ''}) "
            "use stochastic rounding with learned or mse ranges, or fp16_mixed_quantize, whose seed / blend "
            "ratio changes every step: "
            f"each step compiles a new graph, and after {RECOMPILE_LIMIT} the model runs eagerly. Use "
            "rounding: nearest (or min/max ranges) and no fp16_mixed_quantize with compile",
            stacklevel=3,
        )
    module.compile(backend=section.backend, **dict(section.kwargs))
    log.info(
        "compile: %s compiled in place with backend=%s %s", type(module).__name__, section.backend, dict(section.kwargs)
    )
    return True
