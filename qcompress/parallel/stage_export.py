"""The whole model of a pipeline-split engine on global rank 0, for one export.

Each stage keeps its own blocks; the parts it dropped stay as a skeleton on the meta device
(pipeline.dropped_parts), so rank 0 still knows every module's class and compression settings.
The first tensor-parallel rank of each later stage sends its parts' tensors and its compression
state (parallel/transfer.py); rank 0 fills its skeleton with them, loads the compression state
through a CompressionScheduler of those parts, and puts them in the model for the write. After
it the parts go back to the meta device, so the export costs memory only while it runs.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch.distributed as dist
import torch.nn as nn

from .transfer import recv_state, send_state

_COMP = "qc_compression"  # key prefix of the compression state's tensors (no model key starts so)


def stage_leaders(engine) -> List[int]:
    """Global rank of each stage's first data- and tensor-parallel rank (stage 0's is rank 0)."""
    grid = engine.parallel.mesh.mesh  # [pp, dp, tp] global ranks
    return [int(grid[s, 0, 0]) for s in range(engine.pipeline.stages)]


def _own_parts(pipe) -> List[str]:
    lo, hi = pipe.blocks
    names = [f"model.layers.{i}" for i in range(lo, hi)]
    if pipe.is_first:
        names.append("model.embed_tokens")
    if pipe.is_last:
        names += ["model.norm", "lm_head"]
    return names


def _stage_state(engine):
    """(this stage's parts' tensors and compression tensors, compression skeleton or None)."""
    from ..serialize import flatten

    own = _own_parts(engine.pipeline)
    tensors = {k: v for k, v in engine.module.state_dict().items() if any(k.startswith(p + ".") for p in own)}
    skel = None
    if engine.compression_scheduler is not None:
        skel = flatten(engine.compression_scheduler.state_dict(), _COMP, tensors)
    return tensors, skel


def _holder(parts: Dict[str, nn.Module]) -> nn.Module:
    """A module tree that names each part as the whole model does (for a CompressionScheduler)."""
    root = nn.Module()
    for name, part in parts.items():
        node = root
        *path, leaf = name.split(".")
        for piece in path:
            if not hasattr(node, piece):
                node.add_module(piece, nn.Module())
            node = getattr(node, piece)
        node.add_module(leaf, part)
    return root


def _fill(parts: Dict[str, nn.Module], received, device) -> None:
    """Materialize the skeleton parts with the stages' tensors and compression state."""
    from ..serialize import unflatten
    from ..schedule import CompressionScheduler

    state, modules, steps = {}, {}, 0
    for tensors, doc in received:
        state.update({k: v for k, v in tensors.items() if not k.startswith(_COMP + ".")})
        if doc["compression"] is not None:
            comp = unflatten(doc["compression"], tensors)
            modules.update(comp["modules"])
            steps = comp["training_steps"]
    for name, part in parts.items():
        part.to_empty(device=device)
        prefix = name + "."
        part.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    if modules:
        # built over the filled parts only: its step-0 state is then replaced by the stages' own
        CompressionScheduler(_holder(parts)).load_state_dict({"training_steps": steps, "modules": modules})


@contextlib.contextmanager
def whole_stages(engine):
    """Collective, inside parallel.gather.whole_parameters (tensor-parallel parts already whole):
    yields the model, on global rank 0 with every stage's parts in place, elsewhere as it is."""
    pipe, model = engine.pipeline, engine.module
    leaders, rank, device = stage_leaders(engine), dist.get_rank(), engine.device
    if rank != 0:
        if rank in leaders:
            tensors, skel = _stage_state(engine)
            send_state(tensors, {"compression": skel}, 0, device)
        yield model
        return
    received = [recv_state(src, device) for src in leaders[1:]]  # all of it first: senders never wait
    parts = pipe.skeleton
    shared = [n for n, p in parts.items() if not any(t.is_meta for t in p.parameters())]
    if shared:
        raise NotImplementedError(
            f"export_quantized of pipeline stages: {', '.join(shared)} shares a "
            "Parameter with another stage's part (tied embeddings), which each stage "
            "trains on its own; save a checkpoint and export it from one process"
        )
    base = model.model
    saved = {"layers": base.layers, "embed_tokens": base.embed_tokens, "norm": base.norm}, model.lm_head
    try:
        _fill(parts, received, device)
        own = dict(base.layers.named_children())
        base.layers = nn.ModuleList(
            [
                own[str(i)] if str(i) in own else parts[f"model.layers.{i}"]
                for i in range(model.config.num_hidden_layers)
            ]
        )
        for key in ("embed_tokens", "norm"):
            if f"model.{key}" in parts:
                setattr(base, key, parts[f"model.{key}"])
        if "lm_head" in parts:
            model.lm_head = parts["lm_head"]
        yield model
    finally:
        for key, mod in saved[0].items():
            setattr(base, key, mod)
        model.lm_head = saved[1]
        for part in parts.values():
            part.to("meta")
