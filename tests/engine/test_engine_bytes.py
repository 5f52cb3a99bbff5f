"""Engine.comm_bytes(): every byte the engine moves, DDP's own traffic included,
against closed forms for a known model on 2 gloo ranks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from tests.helpers.dist_utils import run_ranks

STEPS = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))  # 259 float32 parameters


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)


def _cfg(opt):
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "optimizer": opt}


def bytes_worker(rank, world):
    import qcompress.comm as qcomm

    out = {}
    adamw = {"type": "AdamW", "params": {"lr": 0.01}}
    for name, opt, stage in (
        ("adamw", adamw, 0),
        ("onebit", {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}}, 0),
        ("zero1", adamw, 1),
        ("zero2", adamw, 2),
    ):
        engine = qc.initialize(_model(), {**_cfg(opt), "zero_optimization": {"stage": stage}})
        qcomm.reset_stats()  # must not disturb the engine's counter
        for step in range(STEPS):
            x, y = _batch(rank, step)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        out[name] = engine.comm_bytes()
        if name == "adamw":
            out["adamw_weights"] = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return out


def _adamw_reference():
    """One process, the two ranks' batches at once: the mean loss has the averaged gradient."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(r, step) for r in range(2)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


_RES: list = []


def _results():
    if not _RES:
        _RES.extend(run_ranks(bytes_worker, 2, timeout=300))
    return _RES


def test_engine_counts_ddp_and_compressed_bytes_on_two_ranks():
    res = _results()
    P = 2
    state = 259 * 4  # bytes of the model's parameters (no buffers)
    ring = 2 * (P - 1) * state // P  # one fp32 gradient all-reduce, ring volume
    # 1-bit all-reduce, one scale per tensor (192, 16, 48 and 3 elements): each padded to a multiple of
    # 8P = 16, cut in P chunks; a row is the chunk's sign bits + one float32 scale; all_to_all and
    # all_gather each move (P-1) rows of every tensor each way
    row = sum(-(-n // 16) * 16 // P // 8 + 4 for n in (192, 16, 48, 3))
    onebit_call = 2 * (P - 1) * row
    hosts = (P - 1) * 32  # once: the all-gather of hostname digests that looks for nodes
    for rank, r in enumerate(res):
        root = rank == 0
        # rank 0's model reaches the other rank twice: the engine's broadcast and DDP's own
        bsent, brecv = (2 * (P - 1) * state, 0) if root else (0, 2 * state)
        a = r["adamw"]
        assert a["by_kind"]["ddp"] == {"bytes_sent": STEPS * ring, "bytes_received": STEPS * ring}
        assert a["by_kind"]["broadcast"] == {"bytes_sent": bsent, "bytes_received": brecv}
        assert a["by_kind"]["optimizer"] == {"bytes_sent": 0, "bytes_received": 0}
        assert a["bytes_sent"] == STEPS * ring + bsent and a["bytes_received"] == STEPS * ring + brecv
        o = r["onebit"]
        # freeze_step 2: two DDP all-reduces, then two 1-bit compressed all-reduces of the momentum
        assert o["by_kind"]["ddp"] == {"bytes_sent": 2 * ring, "bytes_received": 2 * ring}
        opt_bytes = 2 * onebit_call + hosts
        assert o["by_kind"]["optimizer"] == {"bytes_sent": opt_bytes, "bytes_received": opt_bytes}
        assert o["bytes_sent"] == 2 * ring + opt_bytes + bsent
    # the counting hook averages as DDP does: the weights equal one process on both batches
    ref = _adamw_reference()
    for r in res:
        torch.testing.assert_close(r["adamw_weights"], ref, rtol=1e-5, atol=1e-6)


def test_engine_counts_zero_stage_1_and_fsdp_bytes_on_two_ranks():
    res = _results()
    P, state = 2, 259 * 4
    for rank, r in enumerate(res):
        bsent, brecv = ((P - 1) * state, 0) if rank == 0 else (0, state)  # the engine's broadcast only
        z1 = r["zero1"]
        assert z1["by_kind"]["ddp"]["bytes_sent"] == STEPS * 2 * (P - 1) * state // P
        assert z1["by_kind"]["broadcast"] == {"bytes_sent": 2 * bsent, "bytes_received": 2 * brecv}
        # after each step every rank sends the partition it updated and receives the rest
        mine = z1["by_kind"]["zero1"]["bytes_sent"] // (STEPS * (P - 1))
        assert mine + z1["by_kind"]["zero1"]["bytes_received"] // STEPS == state
        assert 0 < mine < state
        # FSDP2 pads dim 0 of each parameter to a multiple of P: Linear(12, 16) holds 16*12 + 16
        # elements, Linear(16, 3) 4*16 + 4. Per step, each module's gradients are reduce-scattered
        # ((P-1)/P of them each way) and its weights all-gathered once (ZeRO-2 keeps them through backward)
        padded = 4 * ((16 * 12 + 16) + (4 * 16 + 4))
        per_step = 2 * (P - 1) * padded // P
        z2 = r["zero2"]
        assert z2["by_kind"]["fsdp"] == {"bytes_sent": STEPS * per_step, "bytes_received": STEPS * per_step}
        assert z2["by_kind"]["broadcast"] == {"bytes_sent": bsent, "bytes_received": brecv}
        assert z2["by_kind"]["ddp"] == {"bytes_sent": 0, "bytes_received": 0}
    sent0, recv1 = res[0]["zero1"]["by_kind"]["zero1"], res[1]["zero1"]["by_kind"]["zero1"]
    assert sent0["bytes_sent"] == recv1["bytes_received"] and sent0["bytes_received"] == recv1["bytes_sent"]
