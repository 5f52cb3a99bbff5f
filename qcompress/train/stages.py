"""The model-building steps between training and the report: PTQ, export, reloading by transformers."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from typing import Callable, Iterable

import torch
import torch.nn as nn

from .batches import device_of, to_device


def has_static_ranges(model: nn.Module) -> bool:
    from ..nn.kv_cache import observers

    return any(getattr(getattr(m, "qc_aq", None), "calibration", None) == "static" for m in model.modules()) or bool(
        observers(model)
    )  # KV-cache ranges


@torch.no_grad()
def calibrate_static_ranges(model: nn.Module, batches: Iterable[dict]) -> None:
    """Static activation ranges learn in training mode; PTQ has no training, so run a few batches
    (dropout off: every Dropout module is put in eval mode meanwhile). Modules whose GPTQ solve is
    still to come run their full-precision weights meanwhile, as GPTQ's own calibration does; run
    this again after calibrate_weight_ranges for the ranges the solved weights give."""
    from ..calibrate.gptq import inactive, unsolved

    if not has_static_ranges(model):
        return
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    dev = device_of(model)
    with inactive(unsolved(model)):
        for b in batches:
            model(**to_device(b, dev))
    model.eval()


def quantize_without_training(source: nn.Module, cfg, calibrate: Callable[[nn.Module], None]) -> nn.Module:
    """A compressed copy of `source` at the end of its schedules (target bits), no training."""
    import qcompress

    model = copy.deepcopy(source)
    raw = cfg.raw
    lr_on = cfg.compression.layer_reduction.enabled
    qcompress.init_compression(model, raw, teacher_model=copy.deepcopy(source) if lr_on else None)
    qcompress.CompressionScheduler(model, raw).finish()
    calibrate(model)
    model.eval()
    return model


def export_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def float_embeddings(model: nn.Module, folder: str) -> dict:
    """{tensor name: bytes} of the embedding tables the export holds in floating point (read from
    the files' headers): the recipes leave embeddings unquantized, so on a small model they are
    most of the export."""
    from safetensors import safe_open

    wanted = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    out = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, f), "pt") as fh:
            for key in fh.keys():
                if key in wanted:
                    t = fh.get_slice(key)
                    dtype = getattr(
                        torch,
                        {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(
                            t.get_dtype(), "int8"
                        ),
                    )
                    if dtype.is_floating_point:
                        n = 1
                        for d in t.get_shape():
                            n *= d
                        out[key] = n * dtype.itemsize
    return out


def export_model(model: nn.Module, doc: dict, tokenizer, export_dir: str) -> int:
    """Write the export (quantized safetensors + config.json + tokenizer files) into a fresh folder
    beside export_dir, then swap it in, so export_dir is always a whole export. Returns its bytes."""
    import warnings

    import qcompress

    parent = os.path.dirname(os.path.abspath(export_dir))
    base = os.path.basename(export_dir)
    tmp = os.path.join(parent, f".{base}.tmp{os.getpid()}")
    old = os.path.join(parent, f".{base}.old{os.getpid()}")
    # a run killed while exporting left its folders under its own pid: the resumed run (another
    # pid) would otherwise keep a whole stale export copy per interruption
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        if name.startswith((f".{base}.tmp", f".{base}.old")):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the transformers caveat is reported by the stage
            qcompress.export_quantized(model, tmp, doc)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(export_dir):
            os.replace(export_dir, old)
        os.replace(tmp, export_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return export_bytes(export_dir)


def why_logits_differ(export_dir: str, loaded_with: str) -> str:
    """Why transformers' logits differ from load_quantized's when every weight is equal: what the
    load did with the input activations (docs/export.md, docs/formats.md)."""
    import json

    with open(os.path.join(export_dir, "config.json"), encoding="utf-8") as fh:
        groups = (json.load(fh).get("quantization_config") or {}).get("config_groups") or {}
    kinds = {(g.get("input_activations") or {}).get("type") for g in groups.values() if isinstance(g, dict)}
    kinds.discard(None)
    same = "the same weights (every dequantized weight equal), but "
    if not kinds or "dequantize=True" in loaded_with:
        return same + "its decompressed layers run the activations unquantized"
    if kinds == {"int"}:
        return same + (
            "compressed-tensors quantizes the activations itself, dividing absmax by 127.5 where "
            "qcompress and vLLM divide by 127"
        )
    if kinds == {"float"}:
        return same + (
            "compressed-tensors quantizes the activations itself: FP8 per token takes one scale "
            "for a whole 2-D input (a pooler's [batch, hidden]) where qcompress and vLLM take "
            "one per row"
        )
    return same + "compressed-tensors quantizes the activations itself, not bit for bit as qcompress does"


@contextlib.contextmanager
def library_bars_off():
    """compressed-tensors draws tqdm bars while transformers loads a compressed model (applying the
    config, compressing, dispatching, decompressing): in a log every frame is another line. They
    are off while the stage loads (tqdm has no switch once imported; its __init__ is wrapped here
    for that time only); the stage prints its own result."""
    try:
        from tqdm import std
    except ImportError:
        yield
        return
    saved = std.tqdm.__dict__["__init__"]
    init = std.tqdm.__init__

    def quiet(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    std.tqdm.__init__ = quiet
    try:
        yield
    finally:
        std.tqdm.__init__ = saved


def transformers_attempts(export_dir: str, task: str, run: Callable[[nn.Module], dict], dtype: str = "float32") -> dict:
    """Load the export with transformers and run `run(model)` on it: plain from_pretrained first,
    then with compressed-tensors decompressing on load. The first that loads and runs wins; the
    result says which call it was, or (metric None) why none worked."""
    import json

    from ..export.layout import REFUSAL_GROUP, REFUSAL_KEY
    from .models import auto_class

    with open(os.path.join(export_dir, "config.json"), encoding="utf-8") as fh:
        groups = (json.load(fh).get("quantization_config") or {}).get("config_groups") or {}
    if REFUSAL_GROUP in groups:  # the export itself says why transformers must not load it
        return {"reason": f"the export refuses transformers: {groups[REFUSAL_GROUP].get(REFUSAL_KEY)}"}
    cls = auto_class(task)
    errors = []
    attempts = [("from_pretrained", {})]
    from ..export.errors import ExportError

    try:
        from ..export.hf_compat import dequantize_config, transformers_kwargs

        if transformers_kwargs(export_dir, dtype):  # {}: float activations, which dequantize=True drops
            attempts.append(
                (
                    "from_pretrained(quantization_config=CompressedTensorsConfig(dequantize=True))",
                    {"quantization_config": dequantize_config()},
                )
            )
    except ImportError as err:
        errors.append(f"CompressedTensorsConfig unavailable ({err})")
    except ExportError as err:
        return {"reason": str(err)}
    for how, kwargs in attempts:
        try:
            with library_bars_off():
                model = cls.from_pretrained(export_dir, local_files_only=True, dtype=getattr(torch, dtype), **kwargs)
            # transformers drops transform_config (online rotations): compressed-tensors applies it
            from ..export.rotations import apply_to_transformers

            if apply_to_transformers(model, export_dir) is not None:
                how += " + compressed_tensors.apply_transform_config"
            result = run(model.eval())
        except Exception as err:  # noqa: BLE001 — any failure is a reason for the report
            errors.append(f"{how}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
            continue
        result["loaded_with"] = how
        if errors:
            result["failed_first"] = errors
        return result
    return {"reason": "; ".join(errors)}
