"""The placement table picks, for every (split, optimizer, ZeRO stage, world size), the class whose
wrapper, sharding and checkpoint layout are those the engine ran before placements were classes:
the oracle is that engine's own conditions, restated here from its code."""

import itertools
from types import SimpleNamespace

import pytest
import torch

import qcompress as qc
from qcompress.engine.placement import (
    DDP,
    FSDP2,
    PLACEMENTS,
    MeshReplicas,
    MeshSharded,
    OneBitLocalShards,
    SingleProcess,
    ZeRO1,
    choose,
    place,
)


def _cfg(opt, stage):
    return qc.load_config({"optimizer": {"type": opt, "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}})


def _parallel(split, world):
    shape = SimpleNamespace(pp=2 if split else 1, dp=world // 2 if split else world, tp=1)
    return SimpleNamespace(mesh=object() if split else None, shape=shape, dp_group=None, dp_mesh=None)


def _old_engine(split, onebit, stage, world):
    """What the engine's if-chains chose: (sharded, wrapper, optimizer layout)."""
    sharded = stage >= 2 or (stage == 1 and split and not onebit)
    dp = world // 2 if split else world
    if split and not sharded:
        wrapper = "none" if onebit or dp == 1 else "replicate"
    elif sharded:
        wrapper = "fully_shard"
    elif dp > 1:
        wrapper = "ddp"
    else:
        wrapper = "none"
    layout = "per_rank" if onebit else ("zero1" if stage == 1 and world > 1 and not sharded else "dcp")
    return sharded, wrapper, layout


WRAPPER = {
    SingleProcess: "none",
    DDP: "ddp",
    ZeRO1: "ddp",
    FSDP2: "fully_shard",
    MeshSharded: "fully_shard",
    OneBitLocalShards: "none",
}

CASES = [
    c
    for c in itertools.product([False, True], ["AdamW", "OneBitAdam"], [0, 1, 2, 3], [1, 2, 4])
    if not (c[0] and c[3] == 1)  # a split needs two ranks
    and not (c[1] == "OneBitAdam" and c[2] >= 2)
]  # refused when the config loads


@pytest.mark.parametrize("split,opt,stage,world", CASES)
def test_table_matches_the_engine_it_replaced(split, opt, stage, world):
    cfg = _cfg(opt, stage)
    parallel = _parallel(split, world)
    cls = choose(cfg, world, parallel)
    p = place(cfg, 0, world, torch.device("cpu"), parallel, traffic=None)
    assert type(p) is cls
    sharded, wrapper, layout = _old_engine(split, opt == "OneBitAdam", stage, world)
    assert p.sharded == sharded
    assert p.optimizer_layout == layout
    want = WRAPPER.get(cls)
    if cls is MeshReplicas:
        want = "none" if parallel.shape.dp == 1 else "replicate"
    assert want == wrapper, (cls.__name__, wrapper)


def test_every_row_is_reachable():
    chosen = {choose(_cfg(opt, stage), world, _parallel(split, world)) for split, opt, stage, world in CASES}
    assert chosen == {cls for _, cls in PLACEMENTS}
