"""export_quantized: write a model as a compressed-tensors checkpoint (see README "Export")."""

from __future__ import annotations

import json
import os
import warnings
from typing import Dict, List

import torch
import torch.nn as nn

from . import experts, kv_cache, layout, rotations
from . import lora as export_lora
from . import saved_names
from . import safetensors_io as sio
from .codes import act_entry, weight_entry
from .commit import ExportWriter, dumps_config
from .errors import ExportError
from ..quant import kernels as _kernels
from ..transforms import materialized
from ..unwrap import unwrap


def _version():
    from .. import __version__

    return __version__


def _raw_config(cfg, model) -> dict:
    if cfg is None:  # the config document init_compression applied, when there was one
        from ..schedule import CONFIG

        return dict(unwrap(model).__dict__.get(CONFIG) or {})
    from ..config import as_config

    raw = getattr(as_config(cfg), "raw", None)
    return raw if isinstance(raw, dict) else {}


def collect(model: nn.Module):
    """(tensors to write, manifest modules, names of plain nn.Linear modules)."""
    from ..nn.layers import CompressMixin
    from ..nn.ranges import range_parameter_names

    root = unwrap(model)
    sd = root.state_dict()
    tensors: Dict[str, torch.Tensor] = {}
    modules: Dict[str, dict] = {}
    plain_linears: List[str] = []
    replaced = {}
    users: Dict[int, List[str]] = {}  # id(weight Parameter) -> quantized modules that use it
    entries = {}
    for name, mod in root.named_modules():
        if not name:
            continue
        if not isinstance(mod, CompressMixin):
            if isinstance(mod, nn.Linear):
                plain_linears.append(name)
            continue
        if mod.qc_kind == "experts":
            continue  # fused expert matrices: written by experts.add_experts
        for k in range_parameter_names(mod):  # learned ranges: written as the codes' scales, if at all
            replaced[f"{name}.{k}"] = True
        for k, v in export_lora.replaced(mod).items():  # LoRA: adapters out, merged weights in
            replaced[f"{name}.{k}"] = v
        wq = mod.qc_wq
        entry = weight_entry(mod) if wq is not None and wq.active else None
        act = act_entry(mod)
        if entry is None and act is None:
            if mod.qc_kind == "linear":
                plain_linears.append(name)
            continue
        if mod.qc_kind == "batchnorm":
            continue
        act_args, act_tensors = act if act is not None else (None, {})
        group = wq.group if entry is not None else mod.qc_aq.group
        modules[name] = layout.module_record(mod.qc_kind, group, entry, act_args)
        local = dict(act_tensors)
        if entry is not None:
            local.update(entry.tensors)
            replaced[f"{name}.weight"] = True
            users.setdefault(id(mod.weight), []).append(name)
            entries[name] = entry
        for k, v in local.items():
            replaced[f"{name}.{k}"] = v
    _store_tied_once(users, entries, modules, replaced)
    for k, v in sd.items():
        if k not in replaced:
            tensors[k] = v.detach().cpu().contiguous()
    for k, v in replaced.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v.detach().cpu().contiguous()
    # Tied weights (GPT-2's wte / lm_head) give one tensor under two names, and after
    # redundancy_clean their codes and scales are one tensor too: safetensors refuses shared
    # storage. A full-precision tensor is written once, as save_pretrained does, and the later
    # names are recorded in `tied` for the reload; quantized ones get their own copy.
    seen: Dict[tuple, str] = {}
    tied: Dict[str, str] = {}
    for k in list(tensors):
        v = tensors[k]
        view = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        first = seen.get(view)
        if first is not None and v.numel() and k not in replaced and first not in replaced:
            del tensors[k]
            tied[k] = first
            continue
        if any(view[0] == other[0] for other in seen) and v.numel():
            tensors[k] = v = v.clone()
            view = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        seen[view] = k
    return tensors, modules, plain_linears, tied


def _store_tied_once(users, entries, modules, replaced) -> None:
    """Tied weights (GPT-2's wte / lm_head) quantize one Parameter to one set of codes: write them
    once, under a Linear's name where there is one (the name compressed-tensors describes), and
    mark the other modules `tied_to` it; load_quantized reads them from there."""
    for names in users.values():
        if len(names) < 2:
            continue
        keep = next((n for n in names if modules[n]["kind"] == "linear"), names[0])
        kept = entries[keep].tensors
        for n in names:
            own = entries[n].tensors
            same = (
                n != keep
                and modules[n]["weights"] == modules[keep]["weights"]
                and modules[n]["format"] == modules[keep]["format"]
                and list(modules[n]["weight_shape"]) == list(modules[keep]["weight_shape"])
                and own.keys() == kept.keys()
                and all(torch.equal(own[k], kept[k]) for k in own)
            )
            if not same:  # never expected (tied modules share one quantizer): keep both
                continue
            modules[n]["tied_to"] = keep
            for k in own:  # written under `keep` only; the module's own state_dict entries
                replaced[f"{n}.{k}"] = True  # (float weight, learned scales) stay out too


def build_config(model, modules, plain_linears, expert_records=None) -> dict:
    root = unwrap(model)
    base = {}
    hf_cfg = getattr(root, "config", None)
    if hf_cfg is not None and hasattr(hf_cfg, "to_dict"):
        base = hf_cfg.to_dict()
        base.pop("quantization_config", None)
        # the class exported, as save_pretrained writes it: a BertForSequenceClassification
        # fine-tuned from a BertModel checkpoint must not reload as BertModel
        # FSDP2's fully_shard / replicate swap a model's class for one they derive from it
        # (FSDPLlamaForCausalLM): record the model's own
        own = next(c for c in type(root).__mro__ if not c.__module__.startswith("torch.distributed"))
        base["architectures"] = [own.__name__]
        # the dtype trained in, as save_pretrained records it: a model cast with .to(bfloat16)
        # keeps "float32" in its config, and transformers' default dtype="auto" reads this key
        dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), None)
        if dtype is not None:
            base["dtype"] = str(dtype).replace("torch.", "")
            base.pop("torch_dtype", None)
    base["quantization_config"] = layout.quantization_config(modules, plain_linears, expert_records)
    base["qcompress"] = {"version": _version(), "manifest_version": layout.MANIFEST_VERSION, "modules": modules}
    return base


def export_quantized(model: nn.Module, out_dir, cfg=None, *, max_shard_size="2GB", force: bool = False) -> str:
    """Write `model` (compress-aware, e.g. after redundancy_clean) to `out_dir`; returns out_dir.

    Files: model.safetensors (or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    above max_shard_size) and config.json. Raises FileExistsError if out_dir already holds a
    checkpoint and force is False; ExportError when a module cannot be exported exactly.
    Overwriting is atomic as a whole: interrupted at any point, out_dir holds the previous export
    or this one, never a mix; temporaries of earlier interrupted writers are removed.
    """
    out_dir = os.fspath(out_dir)
    with export_lora.plain_view(model) as inner:  # a peft-wrapped model: under its own names
        if inner is not None:
            return export_quantized(inner, out_dir, cfg, max_shard_size=max_shard_size, force=force)
    from ..parallel.gather import export_split, needs_gather

    if needs_gather(model):  # tensor / pipeline parallel: every rank gathers, rank 0 writes
        return export_split(
            export_quantized, unwrap(model), out_dir, engine=model, cfg=cfg, max_shard_size=max_shard_size, force=force
        )
    limit = sio.parse_size(max_shard_size)
    _kernels.check_nonfinite()  # a NaN a CUDA quantizer counted is not exported silently
    old = sio.existing_outputs(out_dir)
    if old and not force:
        raise FileExistsError(
            f"{os.path.join(out_dir, old[0])} already exists; pass force=True (CLI: --force) to overwrite"
        )
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if unwrap(model).__dict__.get("_qc_ranks_differ"):
        raise ExportError(
            "the ranks hold different weights (0/1 Adam's local steps since its last "
            "synchronization): call engine.synchronize_ranks() on every rank (engine.eval() "
            "and engine.save_checkpoint() do) before exporting"
        )
    with materialized(unwrap(model)):  # learned rotations: the rotated tensors, their factors left out
        tensors, modules, plain_linears, tied = collect(model)
        expert_records = experts.add_experts(model, tensors)
        kv_record = kv_cache.add_kv_cache(model, tensors)
        renamed = saved_names.rename_plain(unwrap(model), tensors, list(modules) + list(expert_records))
    if not modules and not expert_records and kv_record is None:
        raise ExportError(
            "nothing to export: no module has active weight, activation or KV-cache "
            "quantization (call init_compression and train/schedule first)"
        )
    config = build_config(model, modules, plain_linears, expert_records)
    kv_cache.add_to_config(config, kv_record)
    if tied:
        config["qcompress"]["tied_tensors"] = tied
    if renamed:
        config["qcompress"]["saved_names"] = renamed
    experts.add_to_config(config, expert_records, modules)
    rotations.add_to_config(config, unwrap(model))  # R4's transform_config, what was rotated
    local_only = [n for n, r in modules.items() if not layout.portable(r)]
    if local_only:
        warnings.warn(
            f"{len(local_only)} quantized modules ({', '.join(local_only[:4])}"
            f"{', ...' if len(local_only) > 4 else ''}) are not nn.Linear layers with whole "
            "groups; only qcompress.load_quantized reads them, transformers refuses the export "
            "(see docs/export.md)",
            stacklevel=2,
        )
    caveat = layout.transformers_caveat(config["quantization_config"])
    if caveat:
        warnings.warn(f"{caveat}; qcompress.load_quantized reads it exactly (see docs/export.md)", stacklevel=2)
    metadata = {
        "format": "pt",
        "qcompress_version": _version(),
        "qcompress_config": json.dumps(_raw_config(cfg, model), sort_keys=True, default=str),
    }
    os.makedirs(out_dir, exist_ok=True)
    shards = sio.plan_shards(tensors, limit)
    n = len(shards)
    # All files go to hidden temporaries; config.json, which binds them by digest, is renamed
    # in first, so a crash anywhere leaves the old export or the new one (export/commit.py).
    with ExportWriter(out_dir) as writer:
        weight_map = {}
        for i, names in enumerate(shards):
            final = sio.SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            writer.stage_safetensors(final, {k: tensors[k] for k in names}, metadata)
            weight_map.update({k: final for k in names})
        if n > 1:
            index = {
                "metadata": {"total_size": sum(sio.nbytes(t) for t in tensors.values())},
                "weight_map": dict(sorted(weight_map.items())),
            }
            writer.stage_text(sio.INDEX, json.dumps(index, indent=2))
        export_lora.stage_adapter(writer, model)  # qlora: peft's adapter files beside the base
        config["qcompress"].update(writer.manifest())
        writer.commit(dumps_config(config))
    if export_lora.wants_merged(model):
        export_lora.write_merged(export_quantized, model, out_dir, cfg=cfg, max_shard_size=max_shard_size, force=force)
    return out_dir
