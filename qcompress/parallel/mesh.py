"""The engine's DeviceMesh (pp, dp, tp), built from the config's sizes and the world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..config.parallel import MeshShape, check_model_sizes, mesh_shape, model_sizes
from ..errors import ConfigError


@dataclass
class ParallelMesh:
    """The mesh and this rank's place in it; `mesh` is None when nothing is split (tp = pp = 1)."""

    shape: MeshShape
    mesh: object = None

    @property
    def tp_group(self):
        return None if self.mesh is None else self.mesh["tp"].get_group()

    @property
    def dp_mesh(self):
        """The 1-D sub-mesh of this rank's replicas (data-parallel wrappers shard / reduce over it)."""
        return None if self.mesh is None else self.mesh["dp"]

    @property
    def dp_group(self):
        return None if self.mesh is None else self.mesh["dp"].get_group()

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return dist.get_rank() if dist.is_initialized() else 0
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_src(self) -> int:
        """The global rank of the first replica in this rank's dp group (a broadcast's source)."""
        if self.mesh is None:
            return 0
        return int(self.mesh["dp"].mesh.reshape(-1)[0])

    @property
    def tp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["tp"].get_local_rank()

    def describe(self) -> dict:
        """What a report records: the sizes and this rank's coordinates."""
        return dict(self.shape.as_dict(), dp_rank=self.dp_rank, tp_rank=self.tp_rank)


def _blocks(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "num_hidden_layers", None)


def build_mesh(cfg, world: int, model, device_type: str) -> ParallelMesh:
    """ConfigError for sizes the world or the model cannot take; the mesh when tp or pp > 1."""
    tp, pp = cfg.tensor_parallel.autotp_size, cfg.pipeline.stages
    shape = mesh_shape(tp, pp, world)
    heads, kv, hidden = model_sizes(model)
    check_model_sizes(tp, pp, heads, kv, hidden, _blocks(model))
    if tp == 1 and pp == 1:
        return ParallelMesh(shape)
    _refuse_with_split(cfg, tp, pp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelMesh(shape, mesh)


def _refuse_with_split(cfg, tp: int, pp: int) -> None:
    """Settings the tensor / pipeline engine does not run yet, refused by key before anything starts."""
    opt = cfg.optimizer.type.lower() if cfg.optimizer is not None else ""
    if opt == "onebitlamb" and tp > 1:
        raise ConfigError(
            "optimizer.type",
            f"{cfg.optimizer.type} with tensor_parallel.autotp_size {tp}: LAMB's "
            "trust ratio is the norm of each whole tensor, and a tensor-parallel rank holds a shard "
            "of it; use OneBitAdam or ZeroOneAdam, or pipeline stages without tensor parallelism",
        )
