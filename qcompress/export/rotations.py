"""Rotations in an export: R4 as compressed-tensors' `transform_config`, and loading it back.

R1 and R2 are in the weights (and the norms' weights, now 1); nothing else describes them. The
online R4 is one `TransformScheme` named "R4" with one `input` entry over every rotated
down_proj, its block as `head_dim` when it is smaller than the width, and the block stored
unnormalized under `{module}.R4_input.weight` (compressed-tensors and vLLM divide by sqrt(b)).
type `hadamard` (Sylvester blocks, which vLLM runs with its Hadamard kernel) or, for signed or
learned blocks, `random-hadamard`, which both readers take from the stored tensor (a dense
product). config.json's `qcompress.rotation` records what was rotated, and whether the head was
untied from the embedding (config.tie_word_embeddings is then false).

transformers 5 drops `transform_config` on load: `apply_to_transformers` applies it with
compressed-tensors' `apply_transform_config` and loads the stored blocks into its modules.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from .errors import CheckpointError
from ..transforms import online, record_of

SCHEME = online.SCHEME


def transform_config(root: nn.Module) -> dict:
    """compressed-tensors' TransformConfig (as config.json holds it) of root's online rotations."""
    found = list(online.online_rotations(root))
    if not found:
        return {}
    kinds = {rot.kind for _, rot in found}
    blocks = {rot.weight.shape[0] for _, rot in found}
    widths = {root.get_submodule(name).in_features for name, _ in found}
    if len(kinds) != 1 or len(blocks) != 1:
        raise ValueError(f"online rotations of several kinds / blocks ({kinds}, {blocks}) cannot share one scheme")
    block = blocks.pop()
    scheme = {
        "type": kinds.pop(),
        "apply": [
            {"targets": [name for name, _ in found], "location": online.LOCATION, "inverse": False, "ignore": []}
        ],
        "randomize": False,
        "requires_grad": False,
        "head_dim": block if any(w != block for w in widths) else None,
        "precision": "float32",
    }
    return {"config_groups": {SCHEME: scheme}}


def add_to_config(config: dict, root: nn.Module) -> None:
    """Write the transform_config and the rotation record into an export's config.json."""
    rec = record_of(root)
    if rec is None:
        return
    config["quantization_config"]["transform_config"] = transform_config(root)
    config["qcompress"]["rotation"] = {k: v for k, v in rec.items()}


def prepare_load(root: nn.Module, config: dict, cfg_path: str) -> None:
    """Give a fresh model what a rotated export's tensors need before they load: the head untied
    from the embedding when the export untied it, and an online rotation (its block loaded with
    the other tensors) on every module the transform_config names."""
    rec = (config.get("qcompress") or {}).get("rotation")
    tc = (config.get("quantization_config") or {}).get("transform_config") or {}
    if rec and rec.get("untied"):
        head = rec["untied"]["head"]
        try:
            mod = root.get_submodule(head)
        except AttributeError:
            raise CheckpointError(
                f"{cfg_path}: the export's head {head!r} (untied by its rotations) does not exist in the given model"
            ) from None
        w = mod._parameters.get("weight")
        if w is not None and any(
            p is w for n, p in root.named_parameters(remove_duplicate=False) if not n.startswith(head + ".")
        ):
            mod._parameters["weight"] = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
        cfg = getattr(root, "config", None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
    for gname, scheme in (tc.get("config_groups") or {}).items():
        for entry in scheme.get("apply", []):
            if entry.get("location") != online.LOCATION or gname != SCHEME:
                raise CheckpointError(
                    f"{cfg_path}: transform_config group {gname!r} ({entry.get('location')}) is "
                    "not one qcompress writes; load this export with compressed-tensors"
                )
            for name in entry.get("targets", []):
                try:
                    lin = root.get_submodule(name)
                except AttributeError:
                    raise CheckpointError(
                        f"{cfg_path}: transform_config names module {name!r}, which does not exist in the given model"
                    ) from None
                if online.CHILD in lin._modules:
                    continue
                b = scheme.get("head_dim") or lin.in_features
                online.attach(lin, torch.zeros(b, b), scheme.get("type", "hadamard"))


def stored_blocks(folder: str) -> dict:
    """{tensor name: tensor} of the online rotation blocks an export holds."""
    from . import safetensors_io as sio

    tensors, _, _ = sio.read_checkpoint(folder)
    suffix = f".{online.CHILD}.weight"
    return {k: v for k, v in tensors.items() if k.endswith(suffix)}


def apply_to_transformers(model: nn.Module, folder: str, load_stored: bool = True) -> Optional[object]:
    """Apply an export's transform_config to a model transformers loaded (it drops it), with
    compressed-tensors, and load the stored blocks into the transforms it creates. Returns the
    TransformConfig applied, or None when the export has none."""
    import json

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        tc = (json.load(fh).get("quantization_config") or {}).get("transform_config") or {}
    if not tc.get("config_groups"):
        return None
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    parsed = TransformConfig.model_validate(tc)
    apply_transform_config(model, parsed)
    if load_stored:
        params = dict(model.named_parameters(remove_duplicate=False))  # one weight per scheme and size
        with torch.no_grad():
            for key, value in stored_blocks(folder).items():
                target = params.get(key)
                if target is None:
                    raise CheckpointError(f"{folder}: compressed-tensors made no transform weight for {key!r}")
                target.copy_(value.to(target.dtype))
    return parsed
