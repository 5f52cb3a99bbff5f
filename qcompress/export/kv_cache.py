"""KV-cache scales in an export, and back.

An export of a model with KV-cache quantization (qcompress/nn/kv_cache.py) carries what
compressed-tensors and vLLM read:
- `quantization_config.kv_cache_scheme`: the QuantizationArgs of the cache (8 bits, type float
  for fp8_e4m3 or int for int8, symmetric, static, strategy `tensor` or `attn_head`);
- per attention module `P`, the tensors `P.k_scale` and `P.v_scale` (float32, [1] per tensor or
  [kv heads, 1, 1] per head, the shapes compressed-tensors registers): the cache stores
  cast(clamp(K / k_scale)) and attention reads it back times k_scale.
The scales are exactly those forward used last in eval (the frozen static range, or the learned
scale as forward rounds it). `qcompress.kv_cache` in config.json lists the modules, which
load_quantized quantizes again with these scales, in training and eval alike.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..nn import kv_cache
from ..unwrap import unwrap
from .errors import CheckpointError, ExportError

STRATEGY = {"tensor": "tensor", "head": "attn_head"}  # qcompress -> compressed-tensors


def scheme(fmt: str, strategy: str) -> dict:
    """compressed-tensors' QuantizationArgs for the cache (the portable keys, as layout.input_args)."""
    return {
        "num_bits": 8,
        "type": "float" if fmt == "fp8_e4m3" else "int",
        "symmetric": True,
        "strategy": STRATEGY[strategy],
        "group_size": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": None,
    }


def layer_scales(model: nn.Module) -> List[Tuple[str, torch.Tensor, torch.Tensor, dict]]:
    """[(attention module name, k_scale, v_scale, kv_cache_scheme)] of the active KV quantizers of a
    model (trained or loaded): the scales forward quantizes with in eval now. ExportError for a
    module whose static range has seen no batch."""
    out = []
    for name, mod in kv_cache.quantized_modules(model):
        state = mod.__dict__[kv_cache.ATTR]
        if not state.active:
            continue
        k = kv_cache.current_scale(mod, state, "k")
        v = kv_cache.current_scale(mod, state, "v")
        if k is None or v is None:
            raise ExportError(
                f"{name}: its KV-cache range has seen no training batch, so it has no scale to "
                "export; run training (or a few calibration batches in train mode) first"
            )
        out.append((name, k, v, scheme(state.format, state.strategy)))
    return out


def add_kv_cache(model: nn.Module, tensors: Dict[str, torch.Tensor]) -> Optional[dict]:
    """Put each quantized attention module's k_scale / v_scale into `tensors` (replacing learned
    Parameters of the same names); returns the manifest record, or None without KV quantization."""
    layers = layer_scales(model)
    if not layers:
        return None
    schemes = {json.dumps(s, sort_keys=True) for _, _, _, s in layers}
    if len(schemes) > 1:
        raise ExportError(
            "the attention modules' KV caches are quantized differently; compressed-tensors' "
            "kv_cache_scheme describes one scheme for all of them"
        )
    for name, k, v, _ in layers:
        tensors[f"{name}.k_scale"] = k.detach().cpu().to(torch.float32).contiguous()
        tensors[f"{name}.v_scale"] = v.detach().cpu().to(torch.float32).contiguous()
    state = kv_cache.quantized_modules(model)[0][1].__dict__[kv_cache.ATTR]
    return {
        "format": state.format,
        "strategy": state.strategy,
        "modules": [n for n, _, _, _ in layers],
        "scheme": layers[0][3],
    }


def add_to_config(config: dict, record: Optional[dict]) -> None:
    if record is None:
        return
    config["quantization_config"]["kv_cache_scheme"] = record.pop("scheme")
    config["qcompress"]["kv_cache"] = record


# --- loading ----------------------------------------------------------------------------------


def _problem(rec) -> str:
    if not isinstance(rec, dict):
        return f"is {rec!r}, not an object"
    if rec.get("format") not in ("fp8_e4m3", "int8"):
        return f"format={rec.get('format')!r} (expected 'fp8_e4m3' or 'int8')"
    if rec.get("strategy") not in STRATEGY:
        return f"strategy={rec.get('strategy')!r} (expected 'tensor' or 'head')"
    mods = rec.get("modules")
    if not isinstance(mods, list) or not mods or not all(isinstance(n, str) for n in mods):
        return f"modules={mods!r} (expected a non-empty list of module names)"
    return ""


def load_kv_cache(
    root: nn.Module, config: dict, tensors: Dict[str, torch.Tensor], where: Dict[str, str], cfg_path: str
) -> None:
    """The export's KV-cache quantization onto `root` (a fresh model): checks config.json and the
    scales and installs fixed-scale quantizers (their k_scale / v_scale buffers load with the rest)
    (CheckpointError naming the file and tensor). Nothing when the export has no KV quantization."""
    rec = config.get("qcompress", {}).get("kv_cache")
    ct = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if rec is None:
        if ct is not None:
            raise CheckpointError(
                f"{cfg_path}: quantization_config.kv_cache_scheme is set, but the qcompress "
                "manifest has no kv_cache record"
            )
        return
    problem = _problem(rec)
    if problem:
        raise CheckpointError(f"{cfg_path}: qcompress.kv_cache {problem}")
    want = scheme(rec["format"], rec["strategy"])
    if not isinstance(ct, dict) or any(
        ct.get(k) != want[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")
    ):
        raise CheckpointError(
            f"{cfg_path}: quantization_config.kv_cache_scheme is {ct!r}, but the qcompress "
            f"manifest says {rec['format']} per {rec['strategy']}"
        )
    named = dict(root.named_modules())
    scales = {}
    for name in rec["modules"]:
        mod = named.get(name)
        if mod is None or not kv_cache.dispatches(mod):
            raise CheckpointError(
                f"{cfg_path}: KV-cache module {name!r} is "
                f"{'missing from' if mod is None else 'not an attention module of'} the given "
                "model (one whose attention dispatches through transformers' "
                "ALL_ATTENTION_FUNCTIONS)"
            )
        heads = kv_cache.kv_heads(mod) or 1
        shape = [1] if rec["strategy"] == "tensor" else [heads, 1, 1]
        pair = []
        for s in kv_cache.SCALES:
            key = f"{name}.{s}"
            t = tensors.get(key)
            if t is None:
                raise CheckpointError(
                    f"{cfg_path}: KV-cache module {name!r} needs tensor {key!r}, which no checkpoint file holds"
                )
            if t.dtype != torch.float32 or list(t.shape) != shape:
                raise CheckpointError(
                    f"{where.get(key, cfg_path)}: tensor {key!r} is {t.dtype} {list(t.shape)}, "
                    f"but config.json implies torch.float32 {shape}"
                )
            if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                raise CheckpointError(
                    f"{where.get(key, cfg_path)}: tensor {key!r} holds scales that are not finite and positive"
                )
            pair.append(t)
        scales[name] = tuple(pair)
    kv_cache.install_frozen(root, rec["format"], rec["strategy"], scales)


def report(source) -> List[Tuple[str, torch.Tensor, torch.Tensor, dict]]:
    """[(attention module, k_scale, v_scale, kv_cache_scheme)] of an export folder (what vLLM and
    compressed-tensors read from it) or of a model (trained or loaded); [] without KV quantization."""
    if isinstance(source, nn.Module):
        return layer_scales(unwrap(source))
    from . import safetensors_io as sio
    from .manifest import read_config

    folder = os.fspath(source)
    cfg_path, config, _, _ = read_config(folder)
    rec = config.get("qcompress", {}).get("kv_cache")
    if rec is None:
        return []
    problem = _problem(rec)
    if problem:
        raise CheckpointError(f"{cfg_path}: qcompress.kv_cache {problem}")
    tensors, _, _ = sio.read_checkpoint(folder)
    ct = config["quantization_config"].get("kv_cache_scheme")
    out = []
    for name in rec["modules"]:
        k, v = tensors.get(f"{name}.k_scale"), tensors.get(f"{name}.v_scale")
        if k is None or v is None:
            raise CheckpointError(f"{cfg_path}: KV-cache module {name!r} has no k_scale / v_scale tensor")
        out.append((name, k, v, ct))
    return out


def consumers(scheme_args: Optional[dict]) -> Dict[str, str]:
    """What each consumer does with an export's kv_cache_scheme, in words (for `qcompress verify`)."""
    if not scheme_args:
        return {}
    per = "per attention head" if scheme_args.get("strategy") == "attn_head" else "per tensor"
    fp8 = scheme_args.get("type") == "float" and scheme_args.get("num_bits") == 8
    if fp8:
        vllm = f"serves it with --kv-cache-dtype fp8, k_scale / v_scale {per}" + (
            " (the flash-attention backend only)" if per == "per attention head" else ""
        )
    else:
        vllm = "does not serve an int8 kv_cache_scheme (its compressed-tensors KV method takes FP8 only)"
    return {
        "load_quantized": f"quantizes K / V with the stored scales {per}, bit for bit as trained",
        "transformers": "plain from_pretrained applies compressed-tensors' QuantizedKVCache with the stored "
        "scales (CompressedTensorsConfig(dequantize=True) drops it)",
        "vllm": vllm,
    }
