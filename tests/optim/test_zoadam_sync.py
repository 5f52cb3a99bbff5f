"""0/1 Adam's local steps leave each rank its own weights between synchronizations:
the engine gives every rank the same weights at every evaluation (engine.eval()) and
checkpoint, and refuses an eval-mode forward or an export while they differ."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from tests.helpers.dist_utils import run_ranks

W8 = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
        "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}}},
    }
}


def _cfg():
    # variance frozen after 2 steps; local-step interval 1 -> 2 -> 4 (doubling every 2 local steps)
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "ZeroOneAdam",
            "params": {
                "lr": 0.01,
                "var_freeze_step": 2,
                "var_update_scaler": 1,
                "local_step_scaler": 2,
                "local_step_clipper": 4,
            },
        },
        "compression_training": W8,
    }


def _full(engine):
    return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])


def _same_everywhere(t):
    import torch.distributed as dist

    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return all(torch.equal(got[0], g) for g in got)


def _step(engine, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    x, y = torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()


def sync_worker(rank, world, root):
    from qcompress.export.errors import ExportError

    torch.manual_seed(0)
    model = qc.init_compression(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)), _cfg())
    engine = qc.initialize(model, _cfg())
    out = {"diverged_at": [], "eval_refused": False, "export_refused": False}
    step = 0
    # train until a step leaves the ranks apart (a local step that is not a sync step)
    while engine.ranks_in_sync and step < 20:
        _step(engine, rank, step)
        step += 1
    out["diverged_at"] = step
    out["apart"] = not _same_everywhere(_full(engine))
    try:  # eval-mode forward without synchronizing: refused
        engine.module.eval()
        engine.module(torch.randn(2, 12))
    except RuntimeError as err:
        out["eval_refused"] = "synchronize_ranks" in str(err)
    engine.module.train()
    try:  # export without synchronizing: refused (every rank checks)
        qc.export_quantized(engine.module, os.path.join(root, f"refused{rank}"))
    except ExportError as err:
        out["export_refused"] = "synchronize_ranks" in str(err)
    engine.eval()  # synchronizes
    out["same_after_eval"] = _same_everywhere(_full(engine))
    with torch.no_grad():
        out["eval_ok"] = bool(torch.isfinite(engine.module(torch.randn(2, 12))).all())
    engine.train()
    while engine.ranks_in_sync and step < 40:
        _step(engine, rank, step)
        step += 1
    out["apart_again"] = not _same_everywhere(_full(engine))
    engine.save_checkpoint(os.path.join(root, "ck"))
    out["same_after_checkpoint"] = _same_everywhere(_full(engine))
    saved = _full(engine)
    while engine.ranks_in_sync and step < 60:
        _step(engine, rank, step)
        step += 1
    engine.synchronize_ranks()
    out["same_after_sync"] = _same_everywhere(_full(engine))
    if rank == 0:
        qc.export_quantized(engine.module, os.path.join(root, "export"))
    out["exported"] = rank != 0 or os.path.isfile(os.path.join(root, "export", "config.json"))
    # resume from the checkpoint: every rank gets the synchronized weights that were saved
    torch.manual_seed(5)
    model2 = qc.init_compression(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)), _cfg())
    engine2 = qc.initialize(model2, _cfg())
    engine2.load_checkpoint(os.path.join(root, "ck"))
    out["resumed_equal"] = torch.equal(_full(engine2), saved)
    return out


def test_ranks_hold_identical_weights_at_every_evaluation_checkpoint_and_export(tmp_path):
    res = run_ranks(sync_worker, 2, str(tmp_path), timeout=180)
    for r in res:
        assert r["diverged_at"] < 20 and r["apart"]  # the situation is real
        assert r["eval_refused"] and r["export_refused"]
        assert r["same_after_eval"] and r["eval_ok"]
        assert r["apart_again"] and r["same_after_checkpoint"]
        assert r["same_after_sync"] and r["exported"] and r["resumed_equal"]


def test_synchronize_is_the_scheduled_sync_run_early():
    """One rank: synchronize() applies the accumulated update from the last sync point exactly as
    the scheduled sync step does (the average over one rank is exact), and is a no-op when in sync."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(6, 5))]
    opt = qc.optim.ZeroOneAdam(
        ps, lr=0.05, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1, local_step_clipper=4
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ps[0].grad = torch.randn(6, 5, generator=g)
        opt.step()
    assert opt.counters["local_step_interval"] >= 2
    while opt.ranks_in_sync:
        ps[0].grad = torch.randn(6, 5, generator=g)
        opt.step()
    st = opt.state[ps[0]]
    acc, sync, lrs = st["update_acc"].clone(), st["sync_param"].clone(), list(opt.counters["lrs"])
    t = opt.counters["step"]
    bc1, bc2 = opt.bias_corrections(opt.param_groups[0], t, opt.counters["var_steps"])
    denom = opt.frozen_denom(ps[0], st["exp_avg_sq"], bc2, opt.param_groups[0]["eps"])
    opt.synchronize()
    assert opt.ranks_in_sync
    assert torch.equal(ps[0].detach(), sync - acc / denom)  # weight decay 0: p = p_sync - a / denom
    assert torch.equal(st["exp_avg"], acc * (bc1 / lrs[0]))
    before = ps[0].detach().clone()
    opt.synchronize()
    assert torch.equal(ps[0].detach(), before)
