"""How the model lives on the ranks, chosen once per engine: see placement/base.py.

PLACEMENTS is read top to bottom; the first row whose test holds for the run's facts names the
class. A new placement is a Placement subclass and one row here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Tuple, Type

from ...config.onebit import is_onebit
from .base import Placement, Ranks, check_client_optimizer, local_optimizer
from .ddp import DDP, ZeRO1
from .fsdp import FSDP2
from .mesh import MeshReplicas, MeshSharded, OneBitLocalShards


class Facts(NamedTuple):
    """What the choice depends on."""

    split: bool  # tensor or pipeline parallel: the model is split over a (pp, dp, tp) mesh
    onebit: bool  # the config's optimizer is a 1-bit one (they exchange gradients themselves)
    stage: int  # zero_optimization.stage
    world: int  # ranks


class SingleProcess(Placement):
    """One rank (ZeRO stages 0 / 1): the model itself."""


PLACEMENTS: Tuple[Tuple[Callable[[Facts], bool], Type[Placement]], ...] = (
    (lambda f: f.split and f.onebit, OneBitLocalShards),
    (lambda f: f.split and f.stage == 0, MeshReplicas),
    (lambda f: f.split, MeshSharded),
    (lambda f: f.stage >= 2, FSDP2),
    (lambda f: f.stage == 1 and f.world > 1, ZeRO1),
    (lambda f: f.world > 1, DDP),
    (lambda f: True, SingleProcess),
)


def choose(cfg, world_size: int, parallel) -> Type[Placement]:
    """The placement class for this config on `world_size` ranks with mesh `parallel`."""
    facts = Facts(parallel.mesh is not None, is_onebit(cfg.optimizer), cfg.zero_optimization.stage, world_size)
    return next(cls for test, cls in PLACEMENTS if test(facts))


def place(cfg, rank: int, world_size: int, device, parallel, traffic) -> Placement:
    """The engine's placement, built (nothing is wrapped or split yet)."""
    return choose(cfg, world_size, parallel)(Ranks(cfg, rank, world_size, device, parallel, traffic))


__all__ = [
    "PLACEMENTS",
    "Facts",
    "Placement",
    "Ranks",
    "SingleProcess",
    "DDP",
    "ZeRO1",
    "FSDP2",
    "MeshReplicas",
    "MeshSharded",
    "OneBitLocalShards",
    "choose",
    "place",
    "check_client_optimizer",
    "local_optimizer",
]
