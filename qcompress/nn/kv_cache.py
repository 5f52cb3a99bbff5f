"""KV-cache quantization: the keys (after RoPE) and values each attention layer caches, fake-quantized
to FP8 (e4m3) or int8 with one scale per tensor or per key/value head.

transformers' attention modules call the function `ALL_ATTENTION_FUNCTIONS` holds under the
model's `_attn_implementation`, with the keys and values the cache holds (RoPE applied, the past
entries concatenated). `install` registers, for the implementation the model uses (eager, sdpa,
flash, flex), one more implementation `qcompress_kv_<name>` that quantizes K and V and calls the
original function with everything else unchanged, and switches the model to it; no attention code
is copied. Re-quantizing cached entries with the same frozen scale gives them back unchanged, so
what attention sees equals a cache that stores the quantized values, which is what a serving
engine keeps.

Ranges are static, as static activation ranges (calibration.StaticRange): an EMA of min / max in
training (per tensor, or per key/value head), frozen in eval, averaged over data-parallel ranks by
the engine once per step (`observers`). The scale follows from the range as the other quantizers
compute it: fp8_e4m3 amax / 448 (compressed-tensors' calculate_qparams), int8 amax / 127 (qcompress'
integer grid, quant/reference.py). With `range_learning` the scales are Parameters of the attention
module, `k_scale` and `v_scale`, shaped as compressed-tensors registers them ([1] per tensor,
[heads, 1, 1] per head): set from the synchronised EMA at the first scheduler step after it saw a
batch, then trained by LSQ. Export writes exactly the scales forward uses (export/kv_cache.py).
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..quant.static_range import StaticRange
from ..errors import ConfigError
from ..quant import floats, float_observers
from ..quant.api import fake_quantize_learned, fake_quantize_spec, learned_params, lsq_grad_scale
from ..quant.observers import activation_range
from ..quant.reference import int_params, make_spec
from ..unwrap import unwrap

ATTR = "qc_kv"  # the KVQuant state on an attention module
PREFIX = "qcompress_kv_"  # registered implementation: PREFIX + the model's own
SCALES = ("k_scale", "v_scale")  # compressed-tensors' / vLLM's names, on the attention module
KEY = "compression_training.kv_cache_quantization"


class KVRange(StaticRange):
    """StaticRange over a whole tensor or per key/value head (dim 1 of [batch, heads, seq, dim])."""

    def __init__(self, momentum: float = 0.95, per_head: bool = False):
        super().__init__(momentum)
        self.per_head = per_head

    def observe(self, x: torch.Tensor, choose: Optional[Callable] = None):
        """Fold x's range (per head: of each head's slice) into the EMA; `choose(t)` -> (lo, hi)
        picks a slice's range instead of its min / max (the mse observer)."""
        with torch.no_grad():
            x = x.detach()
            if not self.per_head:
                return self.update(*(choose(x) if choose else (x.amin(), x.amax())))
            if choose is None:
                t = x.transpose(0, 1).reshape(x.shape[1], -1)
                return self.update(t.amin(dim=1), t.amax(dim=1))
            lo, hi = zip(*(choose(x[:, h]) for h in range(x.shape[1])))
            return self.update(torch.stack(lo), torch.stack(hi))

    def sync_tensor(self) -> torch.Tensor:
        return torch.cat([self.min.float().reshape(-1), self.max.float().reshape(-1)])

    def sync_from(self, summed: torch.Tensor, world: int) -> None:
        summed = summed / world
        n = summed.numel() // 2
        shape = self.min.shape
        self.min, self.max = summed[:n].reshape(shape).clone(), summed[n:].reshape(shape).clone()


@dataclass
class KVQuant:
    """KV-cache quantization state of one attention module."""

    format: str  # fp8_e4m3 | int8
    strategy: str  # tensor | head
    heads: int  # key/value heads (the scales' count per head)
    offset: int = 0
    observer: str = "minmax"  # minmax | mse
    range_learning: bool = False
    active: bool = False
    learned_ready: bool = False  # the learned scales were set from the observer
    frozen: bool = False  # a loaded export: the scales are fixed buffers
    k: KVRange = field(default_factory=KVRange)
    v: KVRange = field(default_factory=KVRange)
    original: str = "sdpa"  # the model's own attention implementation, wrapped

    def __setstate__(self, state):
        # an unpickled or copied model (another process, spawn) finds its implementation registered
        self.__dict__.update(state)
        register(self.original)

    @property
    def scale_shape(self) -> Tuple[int, ...]:
        return (1,) if self.strategy == "tensor" else (self.heads, 1, 1)

    def spec(self):
        gran = "tensor" if self.strategy == "tensor" else "channel"
        if self.format == "fp8_e4m3":
            return floats.float_spec("fp8_e4m3", gran)
        return make_spec(8, symmetric=True, granularity=gran)

    def describe(self) -> str:
        return (
            f"{self.format} per {self.strategy}"
            + (f", {self.observer}" if self.observer != "minmax" else "")
            + (", learned scales" if self.range_learning else "")
        )


# --- which modules are attention, and can be reached ------------------------------------------


def dispatches(module: nn.Module) -> bool:
    """Whether the module's forward calls the function transformers' attention interface holds."""
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _looks_like_attention(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return True
    name = type(module).__name__.lower()
    return "attention" in name and any(
        hasattr(module, p)
        for p in ("k_proj", "v_proj", "qkv_proj", "c_attn", "key", "value", "in_proj_weight", "kv_b_proj")
    )


def _is_cross(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or "cross" in type(module).__name__.lower()


def _is_latent(module: nn.Module) -> bool:
    """Multi-head latent attention (DeepSeek): serving caches the compressed latent, not K and V."""
    return hasattr(module, "kv_a_proj_with_mqa") or hasattr(module, "kv_b_proj")


def eager_function(module: nn.Module) -> Optional[Callable]:
    """The family's own eager attention function: the default its forward passes to
    ALL_ATTENTION_FUNCTIONS.get_interface, defined beside the class (or a base class)."""
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(fn):
            return fn
    return None


def kv_heads(module: nn.Module) -> Optional[int]:
    cfg = getattr(module, "config", None)
    for key in ("num_key_value_heads", "num_attention_heads"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _describe(names: List[str]) -> str:
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def plan(model: nn.Module, kv) -> List[str]:
    """Names of the attention modules `kv` (a KVCacheQuantization) quantizes; ConfigError naming the
    key and what to do when the model's attention cannot be reached. Changes nothing."""
    if not kv.enabled:
        return []
    root = unwrap(model)
    installed = [n for n, m in root.named_modules() if ATTR in m.__dict__]
    if installed:
        raise ValueError(
            f"init_compression: KV-cache quantization is already installed on {installed[0]!r}; "
            "apply the config to a freshly built model instead"
        )
    reached, unreached = [], []
    for name, mod in root.named_modules():
        if not name:
            continue
        if dispatches(mod):
            if not _is_cross(mod):
                reached.append((name, mod))
        elif _looks_like_attention(mod) and not any(name.startswith(r + ".") for r, _ in reached):
            unreached.append(name)
    where = f"{KEY}.enabled"
    if kv.modules is not None:
        every = [n for n, _ in reached] + unreached
        reached = [(n, m) for n, m in reached if any(re.search(p, n) for p in kv.modules)]
        unreached = [n for n in unreached if any(re.search(p, n) for p in kv.modules)]
        if not reached and not unreached:
            raise ConfigError(
                f"{KEY}.modules",
                f"{list(kv.modules)} matches none of the attention modules "
                f"({_describe(every) or 'none found'}); fix the regexes or drop "
                "the key (all of them)",
            )
    if not reached:
        found = (
            f"; its attention modules ({_describe(unreached)}) compute attention in their own code"
            if unreached
            else "; it has no attention module"
        )
        raise ConfigError(
            where,
            f"{type(root).__name__}'s attention cannot be reached: KV-cache quantization "
            "wraps the function transformers' attention modules call through "
            f"ALL_ATTENTION_FUNCTIONS{found}. Use a transformers model whose attention "
            "dispatches that way (Llama, Qwen3, Mistral, Mixtral, gpt-oss, GPT-2 ...), "
            "or set enabled: false",
        )
    impls = set()
    for name, mod in reached:
        _check_module(name, mod, kv, where)
        impls.add(original_implementation(mod))
    if len(impls) > 1:
        raise ConfigError(
            where,
            f"the attention modules use different implementations {sorted(impls)}; "
            "set one with model.set_attn_implementation(...) first",
        )
    impl = impls.pop()
    _check_implementation(impl, reached[0][1], where)
    if unreached:
        raise ConfigError(
            where,
            f"attention modules {_describe(unreached)} compute attention in their own code, "
            "so their keys and values cannot be quantized; quantize only the others with "
            f"{KEY}.modules, or set enabled: false",
        )
    return [n for n, _ in reached]


def _check_module(name: str, mod: nn.Module, kv, where: str) -> None:
    cfg = getattr(mod, "config", None)
    if cfg is None or not isinstance(getattr(cfg, "_attn_implementation", None), str):
        raise ConfigError(
            where,
            f"attention module {name!r} has no config._attn_implementation to dispatch "
            "on: its attention cannot be reached; set enabled: false",
        )
    if getattr(mod, "is_causal", True) is False:
        raise ConfigError(
            where,
            f"attention module {name!r} ({type(mod).__name__}) is bidirectional "
            "(is_causal false): an encoder keeps no KV cache to quantize; leave it out with "
            f"{KEY}.modules (the decoder's attention only), or set enabled: false",
        )
    if _is_latent(mod):
        raise ConfigError(
            where,
            f"attention module {name!r} ({type(mod).__name__}) is multi-head latent "
            "attention: serving engines cache its compressed latent, not the keys and values "
            "this quantizes; set enabled: false",
        )
    if getattr(mod, "reorder_and_upcast_attn", False) and cfg._attn_implementation == "eager":
        raise ConfigError(
            where,
            f"attention module {name!r} runs its own upcast attention "
            "(config.reorder_and_upcast_attn with eager attention), past the attention "
            "interface; set reorder_and_upcast_attn: false or use attn_implementation 'sdpa'",
        )
    if kv.strategy == "head" and kv_heads(mod) is None:
        raise ConfigError(
            f"{KEY}.strategy",
            f"'head' needs the number of key/value heads of {name!r}, and "
            "its config names none (num_key_value_heads / "
            "num_attention_heads); use strategy: tensor",
        )


def original_implementation(mod: nn.Module) -> str:
    """The implementation the module's config names, under the wrapping one (a model built from a
    config object another model already switched shares it)."""
    impl = mod.config._attn_implementation
    return impl[len(PREFIX) :] if impl.startswith(PREFIX) else impl


def _check_implementation(impl: str, mod: nn.Module, where: str) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ConfigError(
            where,
            f"the model's attention implementation {impl!r} builds no attention mask "
            "qcompress can keep; use 'sdpa' or 'eager'",
        )
    if impl == "eager":
        if eager_function(mod) is None:
            raise ConfigError(
                where,
                f"{type(mod).__name__}'s module defines no eager_attention_forward to "
                "wrap; use attn_implementation 'sdpa'",
            )
    elif impl not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(
            where,
            f"attention implementation {impl!r} is not registered in transformers' "
            "ALL_ATTENTION_FUNCTIONS; use 'sdpa' or 'eager'",
        )


# --- installing -------------------------------------------------------------------------------


def _wrapper(original: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, *args, **kwargs):
        state = module.__dict__.get(ATTR)
        if state is not None and state.active:
            key, value = quantize_kv(module, state, key, value)
        fn = eager_function(module) if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
        return fn(module, query, key, value, *args, **kwargs)

    attention.__qualname__ = attention.__name__ = f"{PREFIX}{original}".replace("|", "_")
    return attention


def register(original: str) -> str:
    """The implementation name that quantizes K / V before `original`, registered once."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(name, _wrapper(original))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def _switch(root: nn.Module, mods: List[nn.Module], name: str) -> None:
    if hasattr(root, "set_attn_implementation"):
        root.set_attn_implementation(name)
    for mod in mods:  # a sub-config set_attn_implementation did not reach
        if mod.config._attn_implementation != name:
            mod.config._attn_implementation = name


def install(model: nn.Module, kv, names: List[str]) -> None:
    """Attach the KV quantizer to the attention modules `plan` chose and switch the model to the
    wrapping implementation; learned scales become Parameters (k_scale, v_scale) of each module."""
    if not names:
        return
    root = unwrap(model)
    named = dict(root.named_modules())
    mods = [named[n] for n in names]
    original = original_implementation(mods[0])
    for n, mod in zip(names, mods):
        if kv.range_learning:
            for s in SCALES:
                if s in mod._parameters or s in mod._buffers or s in mod.__dict__ or s in mod._modules:
                    raise ConfigError(
                        f"{KEY}.range_learning",
                        f"module {n!r} already has an attribute {s!r}, "
                        "where the learned scale goes; set range_learning: false",
                    )
    try:
        for mod in mods:
            heads = kv_heads(mod) or 1
            per_head = kv.strategy == "head"
            state = KVQuant(
                format=kv.format,
                strategy=kv.strategy,
                heads=heads,
                offset=kv.schedule_offset,
                observer=kv.observer,
                range_learning=kv.range_learning,
                k=KVRange(kv.momentum, per_head),
                v=KVRange(kv.momentum, per_head),
                original=original,
            )
            mod.__dict__[ATTR] = state
            if kv.range_learning:
                dev = next((p.device for p in mod.parameters()), None)
                for s in SCALES:
                    mod.register_parameter(
                        s, nn.Parameter(torch.ones(state.scale_shape, dtype=torch.float32, device=dev))
                    )
    except BaseException:
        uninstall(root)
        raise
    _switch(root, mods, register(original))
    root.__dict__["_qc_kv_original"] = original


def uninstall(model: nn.Module) -> None:
    """Undo install (a failed init_compression): states, learned Parameters, the implementation."""
    root = unwrap(model)
    original = root.__dict__.pop("_qc_kv_original", None)
    mods = []
    for mod in root.modules():
        state = mod.__dict__.pop(ATTR, None)
        if state is None:
            continue
        mods.append(mod)
        if state.range_learning or state.frozen:
            for s in SCALES:
                mod._parameters.pop(s, None)
                mod._buffers.pop(s, None)
    if original is not None and mods:
        _switch(root, mods, original)


def quantized_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in unwrap(model).named_modules() if ATTR in m.__dict__]


def observers(model: nn.Module) -> List[KVRange]:
    """The static ranges the engine averages over data-parallel ranks (as activation ranges)."""
    out = []
    for _, mod in quantized_modules(model):
        state = mod.__dict__[ATTR]
        if not state.frozen:
            out += [state.k, state.v]
    return out


def learned_parameter_ids(model: nn.Module) -> set:
    return {
        id(mod._parameters[s])
        for _, mod in quantized_modules(model)
        if mod.__dict__[ATTR].range_learning
        for s in SCALES
        if mod._parameters.get(s) is not None
    }


# --- quantizing -------------------------------------------------------------------------------


def scales_from_range(state: KVQuant, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float32 scales (shape state.scale_shape) of the symmetric grid for ranges [lo, hi]."""
    lo, hi = lo.detach().float().reshape(-1), hi.detach().float().reshape(-1)
    if state.format == "fp8_e4m3":
        s = floats.scales_from_range(lo, hi, floats.float_spec("fp8_e4m3", "tensor"))
    else:
        s, _ = int_params(lo, hi, make_spec(8, symmetric=True))
    return s.reshape(state.scale_shape)


def _view(x: torch.Tensor, state: KVQuant) -> torch.Tensor:
    """x as the quantizer groups it: whole, or heads first ([heads, batch, seq, dim])."""
    return x if state.strategy == "tensor" else x.transpose(0, 1)


def _unview(y: torch.Tensor, state: KVQuant) -> torch.Tensor:
    return y if state.strategy == "tensor" else y.transpose(0, 1)


def fake_quantize_kv(x: torch.Tensor, state: KVQuant, scale: torch.Tensor) -> torch.Tensor:
    """x (a [batch, heads, seq, dim] key or value tensor) quantized with the given scales and back,
    straight-through gradient to x: x / s rounded to the grid (clamped), times s."""
    spec = state.spec()
    v = _view(x, state)
    if state.format == "fp8_e4m3":
        y = floats.fake_quantize_float(
            v, spec, scale=scale.reshape(-1, 1) if state.strategy == "head" else scale.reshape(1)
        )
    else:
        y = fake_quantize_spec(v, spec, scale=scale.reshape(-1))
    return _unview(y, state)


def _learned(x: torch.Tensor, state: KVQuant, param: torch.Tensor) -> torch.Tensor:
    spec = state.spec()
    v = _view(x, state)
    per = v.numel() // max(1, param.numel())
    if state.format == "fp8_e4m3":  # in float32 with a float32 scale, as the static and loaded paths
        y = float_observers.fake_quantize_learned(
            v.float(), spec, param, grad_scale=float_observers.lsq_grad_scale(per, spec)
        ).to(v.dtype)
    else:
        y = fake_quantize_learned(v, spec, param, None, grad_scale=lsq_grad_scale(per, spec))
    return _unview(y, state)


def current_scale(module: nn.Module, state: KVQuant, which: str) -> Optional[torch.Tensor]:
    """The scale (float32, state.scale_shape) forward quantizes `which` ('k' or 'v') with in eval now,
    or None while a static range has seen no batch."""
    name = f"{which}_scale"
    if state.frozen:
        return module._buffers[name].detach().float().reshape(state.scale_shape)
    if state.range_learning and state.learned_ready:
        p = module._parameters[name]
        if hasattr(p, "full_tensor"):  # an FSDP2 shard outside forward (collective)
            p = p.full_tensor()
        if state.format == "fp8_e4m3":
            s = float_observers.learned_scales(torch.empty(0), state.spec(), p)[0]
            return s.float().reshape(state.scale_shape)
        return learned_params(p, None, state.spec())[0].reshape(state.scale_shape)
    obs = getattr(state, which)
    if not obs.initialized:
        return None
    return scales_from_range(state, obs.min, obs.max)


def _check_heads(module: nn.Module, state: KVQuant, x: torch.Tensor) -> None:
    if state.strategy == "head" and (x.dim() != 4 or x.shape[1] != state.heads):
        raise ValueError(
            f"{KEY}.strategy 'head': {type(module).__name__} passed keys/values of shape "
            f"{tuple(x.shape)} to attention, not [batch, {state.heads} heads, seq, dim]; use strategy: tensor"
        )


def _one(module: nn.Module, state: KVQuant, which: str, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x) or x.numel() == 0:
        return x
    _check_heads(module, state, x)
    name = f"{which}_scale"
    if state.frozen:
        return fake_quantize_kv(x, state, module._buffers[name])
    if state.range_learning and state.learned_ready:
        return _learned(x, state, module._parameters[name])
    obs: KVRange = getattr(state, which)
    from .layers import _recomputing

    if module.training and not (obs.initialized and _recomputing()):
        # activation checkpointing's recompute folds nothing in twice
        lo, hi = obs.observe(x, _mse_range(state) if state.observer == "mse" else None)
    elif obs.initialized:
        lo, hi = obs.min, obs.max
    else:
        _warn_uncalibrated(module)
        lo, hi = KVRange(per_head=obs.per_head).observe(x)
    y = fake_quantize_kv(x, state, scales_from_range(state, lo.to(x.device), hi.to(x.device)))
    if state.range_learning:
        from .ranges import attach_unused

        y = attach_unused(y, module, (name,))
    return y


def _mse_range(state: KVQuant) -> Callable:
    """The mse observer of static activation ranges (quant/observers.py, quant/float_observers.py)
    for one slice: its range shrunk by the factor whose error on it is least."""
    if state.format == "fp8_e4m3":
        spec = floats.float_spec("fp8_e4m3", "tensor")
        return lambda t: float_observers.activation_range(t, spec, "mse")
    spec = make_spec(8, symmetric=True)
    return lambda t: activation_range(t, spec, "mse")


def quantize_kv(module: nn.Module, state: KVQuant, key: torch.Tensor, value: torch.Tensor):
    return _one(module, state, "k", key), _one(module, state, "v", value)


_warned = set()


def _warn_uncalibrated(module: nn.Module) -> None:
    if id(module) not in _warned:
        _warned.add(id(module))
        warnings.warn(
            f"{type(module).__name__}: KV-cache range used in eval before any training batch calibrated "
            "it; quantizing with this batch's own range",
            stacklevel=5,
        )


# --- the schedule and checkpoints --------------------------------------------------------------


@torch.no_grad()
def _init_learned(module: nn.Module, state: KVQuant) -> None:
    """Learned scales from the (synchronised) EMA ranges, once both have seen a batch."""
    if state.learned_ready or not (state.k.initialized and state.v.initialized):
        return
    for which in ("k", "v"):
        obs = getattr(state, which)
        p = module._parameters[f"{which}_scale"]
        s = scales_from_range(state, obs.min, obs.max).to(device=p.device, dtype=p.dtype)
        if hasattr(p, "full_tensor"):  # an FSDP2 shard (ZeRO 2 / 3): the same value on every rank
            from torch.distributed.tensor import distribute_tensor

            s = distribute_tensor(s, p.device_mesh, p.placements)
        p.copy_(s)
    state.learned_ready = True


def schedule(model: nn.Module, step: int) -> None:
    """The scheduler's step: on at schedule_offset; learned scales start from the observed ranges."""
    for _, mod in quantized_modules(model):
        state = mod.__dict__[ATTR]
        if state.frozen:
            continue
        state.active = step >= state.offset
        if state.active and state.range_learning:
            _init_learned(mod, state)


def state_dict(model: nn.Module) -> Dict[str, dict]:
    out = {}
    for name, mod in quantized_modules(model):
        state = mod.__dict__[ATTR]
        if state.frozen:
            continue
        out[name] = {"k": state.k.state_dict(), "v": state.v.state_dict(), "learned_ready": state.learned_ready}
    return out


def load_state_dict(model: nn.Module, sd: Dict[str, dict], step: int) -> None:
    mods = dict(quantized_modules(model))
    for name, entry in (sd or {}).items():
        mod = mods.get(name)
        if mod is None:
            raise KeyError(
                f"compression state names attention module {name!r}, which has no KV-cache quantization in this model"
            )
        state = mod.__dict__[ATTR]
        state.k.load_state_dict(entry.get("k", {}))
        state.v.load_state_dict(entry.get("v", {}))
        state.learned_ready = bool(entry.get("learned_ready", False))
    for mod in mods.values():
        state = mod.__dict__[ATTR]
        if not state.frozen:
            state.active = step >= state.offset


# --- loaded exports ---------------------------------------------------------------------------


def install_frozen(
    model: nn.Module, fmt: str, strategy: str, scales: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """A loaded export's KV quantization: fixed scales (buffers k_scale / v_scale) on the named
    attention modules ({name: (k_scale, v_scale)}), quantizing in training and eval alike."""
    root = unwrap(model)
    named = dict(root.named_modules())
    mods = [named[n] for n in scales]
    original = original_implementation(mods[0])
    try:
        for name, mod in zip(scales, mods):
            state = KVQuant(
                format=fmt, strategy=strategy, heads=kv_heads(mod) or 1, active=True, frozen=True, original=original
            )
            mod.__dict__[ATTR] = state
            for s, t in zip(SCALES, scales[name]):
                mod.register_buffer(s, t.detach().to(torch.float32).reshape(state.scale_shape).clone())
    except BaseException:
        uninstall(root)
        raise
    _switch(root, mods, register(original))
    root.__dict__["_qc_kv_original"] = original
