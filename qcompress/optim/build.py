"""build_optimizer: the `optimizer` section of a config -> a torch optimizer.

Type names follow DeepSpeed, case-insensitively. As in DeepSpeed's engine, type "Adam" means
AdamW (decoupled weight decay) unless params say "adam_w_mode": false, which gives torch.optim.Adam;
"AdamW" is always torch.optim.AdamW.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping

import torch

from ..config.schema import did_you_mean
from ..errors import ConfigError
from .lamb import Lamb
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLamb
from .zoadam import ZeroOneAdam

_PATH = "optimizer.params"
_ONEBIT = {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb}
_NAMES = "Adam, AdamW, Lamb, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb"
# Why stage 1 (shard_state) is not offered; each optimizer's constructor raises the same reason.
_NO_SHARD = {"zerooneadam": ZeroOneAdam.NO_SHARD, "onebitlamb": OneBitLamb.NO_SHARD}
# Keys DeepSpeed accepts for Adam that steer its own kernel choice; nothing to do for us.
_ADAM_IGNORED = ("torch_adam", "fused")


def _accepted(cls, drop=("self", "params", "deepspeed", "group", "ddp_hook_state", "shard_state")):
    sig = inspect.signature(cls.__init__)
    return [
        n for n, p in sig.parameters.items() if n not in drop and p.kind != p.VAR_KEYWORD and p.kind != p.VAR_POSITIONAL
    ]


def _split(cfg):
    if isinstance(cfg, Mapping):
        unknown = set(cfg) - {"type", "params"}
        if unknown:
            key = sorted(unknown)[0]
            raise ConfigError(
                f"optimizer.{key}",
                f"unknown key{did_you_mean(key, ['type', 'params'])}; an optimizer section has 'type' and 'params'",
            )
        kind, params = cfg.get("type"), cfg.get("params", {})
    else:
        kind, params = getattr(cfg, "type", None), getattr(cfg, "params", None)
    if not isinstance(kind, str):
        raise ConfigError("optimizer.type", f"expected an optimizer name ({_NAMES}), got {kind!r}")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(_PATH, f"expected a mapping of optimizer parameters, got {type(params).__name__}")
    return kind, dict(params)


def _check_keys(params: dict, allowed, kind):
    for key in params:
        if key == "max_grad_norm":
            raise ConfigError(
                f"{_PATH}.max_grad_norm",
                "is not an optimizer parameter; use the top-level "
                "'gradient_clipping' setting (DeepSpeed rejects it too)",
            )
        if key not in allowed:
            allowed = [a for a in allowed if a != "max_grad_norm"]
            raise ConfigError(
                f"{_PATH}.{key}",
                f"unknown parameter for optimizer {kind!r}"
                f"{did_you_mean(key, allowed)}; allowed: {', '.join(sorted(allowed))}",
            )


_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "dampening")
_FLAGS = ("amsgrad", "nesterov")


def _check_torch_params(params: dict) -> None:
    """Types of torch.optim's arguments, checked here: torch compares them without looking (a string
    lr fails with "'<=' not supported", a one-value betas with an IndexError, amsgrad "yes" passes)."""

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in _NUMBERS:
        if key in params and not number(params[key]):
            raise ConfigError(f"{_PATH}.{key}", f"expected a finite number, got {params[key]!r}")
    for key in _FLAGS:
        if key in params and not isinstance(params[key], bool):
            raise ConfigError(f"{_PATH}.{key}", f"expected true or false, got {params[key]!r}")
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(number(x) for x in b)):
            raise ConfigError(f"{_PATH}.betas", f"expected two numbers [beta1, beta2], got {b!r}")


# torch's messages name the argument in words; map them back to the key
_TORCH_WORDS = {
    "learning rate": "lr",
    "epsilon": "eps",
    "beta": "betas",
    "momentum": "momentum",
    "weight_decay": "weight_decay",
    "dampening": "dampening",
    "nesterov": "nesterov",
}


def _construct(cls, model_params, params, **extra):
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    try:
        return cls(model_params, **params, **extra)
    except (ValueError, TypeError) as e:
        msg = str(e)
        low = msg.lower()
        key = (
            next((k for k in params if msg.startswith(k) or f"'{k}'" in msg), None)
            or next((k for k in params if k.rstrip("s") in low), None)
            or next((k for w, k in _TORCH_WORDS.items() if w in low and k in params), None)
        )
        raise ConfigError(f"{_PATH}.{key}" if key else _PATH, msg) from None


def build_optimizer(params, optimizer_cfg: Any, *, group=None, shard_state: bool = False) -> torch.optim.Optimizer:
    """Build the optimizer named by `optimizer_cfg` (a qcompress.config.Optimizer or {"type", "params"}).

    `group` is the process group of the 1-bit optimizers (None: the default group). shard_state=True
    (the engine's ZeRO stage 1 for 1-bit optimizers) shards OneBitAdam's state by the compressed
    all-reduce's chunks; any other type raises a ConfigError on zero_optimization.stage saying why."""
    kind, p = _split(optimizer_cfg)
    name = kind.lower()
    if shard_state and name != "onebitadam":
        why = _NO_SHARD.get(name, "plain optimizers are sharded by ZeroRedundancyOptimizer, not shard_state")
        raise ConfigError(
            "zero_optimization.stage", f"{kind} cannot shard its state for stage 1: {why}. Use stage 0 (or OneBitAdam)"
        )
    if name in _ONEBIT:
        cls = _ONEBIT[name]
        _check_keys(p, _accepted(cls), kind)
        extra = {"shard_state": True} if shard_state else {}
        return _construct(cls, params, p, group=group, **extra)
    if name in ("adam", "adamw"):
        allowed = ["lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", *_ADAM_IGNORED]
        _check_keys(p, allowed, kind)
        for k in _ADAM_IGNORED:
            p.pop(k, None)
        w_mode = p.pop("adam_w_mode", True)
        if not isinstance(w_mode, bool):
            raise ConfigError(f"{_PATH}.adam_w_mode", f"expected true or false, got {w_mode!r}")
        if not p.pop("bias_correction", True):
            raise ConfigError(
                f"{_PATH}.bias_correction",
                "false is not supported for Adam/AdamW (torch.optim.Adam always corrects); remove it or use true",
            )
        _check_torch_params(p)
        cls = torch.optim.AdamW if (name == "adamw" or w_mode) else torch.optim.Adam
        p.setdefault("weight_decay", 0.0)  # DeepSpeed's default; torch.optim.AdamW's own is 0.01
        return _construct(cls, params, p)
    if name == "lamb":
        _check_keys(p, _accepted(Lamb), kind)
        return _construct(Lamb, params, p)
    if name == "sgd":
        _check_keys(p, ["lr", "momentum", "dampening", "weight_decay", "nesterov"], kind)
        p.setdefault("lr", 1e-3)
        _check_torch_params(p)
        return _construct(torch.optim.SGD, params, p)
    raise ConfigError(
        "optimizer.type",
        f"{kind!r} is not a known optimizer; choose one of {_NAMES}"
        f"{did_you_mean(name, ['adam', 'adamw', 'lamb', 'sgd', *_ONEBIT])}",
    )
