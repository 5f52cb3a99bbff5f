"""Optimizer construction: qcompress.optim.build_optimizer when present, else a torch fallback."""

from __future__ import annotations

import inspect

import torch

from ..config.onebit import is_onebit  # noqa: F401 - the engine's placements ask it here
from ..errors import ConfigError


def _torch_fallback(params, opt_cfg):
    """Adam/AdamW/SGD from torch, with DeepSpeed's names (Adam decouples weight decay by default)."""
    kind = opt_cfg.type.lower()
    p = dict(opt_cfg.params)
    if kind == "sgd":
        return torch.optim.SGD(params, **p)
    if kind in ("adam", "adamw"):
        w_mode = p.pop("adam_w_mode", True)
        p.pop("torch_adam", None)
        cls = torch.optim.AdamW if (kind == "adamw" or w_mode) else torch.optim.Adam
        return cls(params, **p)
    raise ConfigError("optimizer.type", f"{opt_cfg.type} needs qcompress.optim, which is not available")


def accepts(builder, names) -> bool:
    params = inspect.signature(builder).parameters
    return any(p.kind == p.VAR_KEYWORD for p in params.values()) or all(n in params for n in names)


def build_optimizer(params, opt_cfg, group=None, **extra):
    """Build the optimizer named by the config; `extra` (e.g. shard_state) goes to qcompress.optim."""
    from .. import optim as qc_optim

    builder = getattr(qc_optim, "build_optimizer", None)
    if opt_cfg is None:
        raise ConfigError("optimizer", "initialize() needs an optimizer section (type and params)")
    if builder is None:
        if extra:
            raise ConfigError("optimizer.type", f"{opt_cfg.type}: qcompress.optim is not available")
        return _torch_fallback(params, opt_cfg)
    if extra and not accepts(builder, extra):
        raise ConfigError("optimizer.type", f"qcompress.optim.build_optimizer does not support {sorted(extra)}")
    return builder(params, opt_cfg, group=group, **extra)
