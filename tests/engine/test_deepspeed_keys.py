"""DeepSpeed keys the engine acts on: seed, offload_optimizer (stage 1, ratio, pin_memory) and the
consolidated 16-bit save. Oracles: Python / NumPy / torch seeded directly, parameter sizes counted
here, a run without offload, the model's own state_dict cast."""

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import qcompress
from tests.helpers.dist_utils import run_ranks


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _cfg(**extra):
    doc = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    doc.update(extra)
    return doc


def _train(engine, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def _seeded_rank(rank, world):
    random.seed(99)  # every rank disturbed differently before initialize
    torch.manual_seed(1000 + rank)
    engine = qcompress.initialize(_mlp(), _cfg(seed=7))
    draws = _draws()
    late = nn.Linear(4, 4)  # initialised after initialize: the seeded generator
    order = torch.randperm(10)  # a shuffle's first batch
    return draws, late.weight.detach().clone(), order, engine.world_size


def test_seed_gives_every_rank_the_same_draws_and_init():
    out = run_ranks(_seeded_rank, 2)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    late, order = nn.Linear(4, 4).weight.detach(), torch.randperm(10)
    for draws, weight, perm, world in out:
        assert world == 2
        assert draws[0] == expected[0] and draws[1] == expected[1] and torch.equal(draws[2], expected[2])
        assert torch.equal(weight, late) and torch.equal(perm, order)


def _offload_zero(ratio):
    return {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": ratio}}


@pytest.mark.parametrize("ratio", [0.3, 0.7, 1.0])
def test_stage1_cpu_offload_ratio_counts_that_share_and_trains_alike(ratio):
    plain = qcompress.initialize(_mlp(), _cfg())
    _train(plain)
    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=_offload_zero(ratio)))
    _train(engine)
    for a, b in zip(plain.module.parameters(), engine.module.parameters()):
        assert torch.equal(a, b)  # the update is the optimizer's own arithmetic
    # oracle: the leading parameters, in module order, within ratio of the bytes; AdamW's
    # per-parameter state is two moments shaped like the parameter plus a scalar step
    params = list(engine.module.parameters())
    total = sum(p.numel() * 4 for p in params)
    chosen, taken = [], 0
    for p in params:
        if taken + p.numel() * 4 > ratio * total:
            break
        chosen.append(p)
        taken += p.numel() * 4
    step_bytes = engine.optimizer.state[params[0]]["step"].numel() * 4
    want = sum(2 * p.numel() * 4 + step_bytes for p in chosen)
    report = engine.memory_report()
    assert report["offloaded"] == want
    all_state = sum(2 * p.numel() * 4 + step_bytes for p in params)
    assert report["optimizer_state"] == all_state - want
    assert 0 < want <= ratio * all_state + len(chosen) * step_bytes


def test_stage0_cpu_offload_is_still_refused_by_name():
    with pytest.raises(qcompress.ConfigError, match="zero_optimization.stage"):
        qcompress.initialize(_mlp(), _cfg(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}))


def test_pin_memory_on_cpu_training_warns_and_stays_pageable(caplog):
    zero = {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    with caplog.at_level("WARNING", logger="qcompress.engine"):
        engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=zero))
    assert "pin_memory" in caplog.text
    assert engine.optimizer_offload.pin is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")
@pytest.mark.parametrize("pin", [True, False])
def test_pin_memory_on_cuda_pins_the_offloaded_state(pin):
    zero = {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": pin, "ratio": 0.5}}
    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=zero), device="cuda")
    _train(engine, steps=2, seed=3)
    off = engine.optimizer_offload
    assert off.pin is pin and off.params
    for p in engine.module.parameters():
        moments = [v for k, v in engine.optimizer.state[p].items() if k != "step"]
        where = {v.device.type for v in moments}
        if id(p) in off.ids:
            assert where == {"cpu"} and p.device.type == "cuda"
        else:
            assert where == {"cuda"}


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_save_16bit_model_is_the_state_dict_cast(tmp_path, precision, dtype):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine = qcompress.initialize(_mlp(), _cfg(**extra))
    _train(engine, steps=1)
    assert engine.save_16bit_model(str(tmp_path), "m.safetensors")
    saved = load_file(str(tmp_path / "m.safetensors"))
    want = engine.module.state_dict()
    assert saved.keys() == want.keys()
    for k, v in want.items():
        assert saved[k].dtype == dtype and torch.equal(saved[k], v.to(dtype))
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary left


def _stage3_save(rank, world, folder, gather):
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather}
    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=zero))
    _train(engine, steps=2)
    ok = engine.save_16bit_model(folder)
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in engine.module.state_dict().items()
    }
    return ok, full


def test_stage3_16bit_save_gathers_the_shards_only_when_asked(tmp_path):
    out = run_ranks(_stage3_save, 2, str(tmp_path / "on"), True, timeout=240)
    assert all(ok for ok, _ in out)
    saved = load_file(str(tmp_path / "on" / "model.safetensors"))
    for k, v in out[0][1].items():
        assert torch.equal(saved[k], v)
    out = run_ranks(_stage3_save, 2, str(tmp_path / "off"), False, timeout=240)
    assert not any(ok for ok, _ in out) and not (tmp_path / "off").exists()


def _train_full_weights(doc_zero, steps=3):
    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=doc_zero))
    _train(engine, steps)
    weights = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in engine.module.parameters()
    ]
    return engine, weights


def test_stage3_ratio_offloads_the_leading_modules_and_trains_alike():
    import torch.distributed as dist

    _, plain = _train_full_weights({"stage": 3})
    dist.destroy_process_group()
    engine, part = _train_full_weights({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    for a, b in zip(plain, part):
        assert torch.equal(a, b)
    # oracle: modules in order (Linear 8x32+32, 32x16+16, 16x4+4), the leading ones within half the bytes
    sizes = [8 * 32 + 32, 32 * 16 + 16, 16 * 4 + 4]
    chosen, taken = [], 0
    for i, s in enumerate(sizes):
        if taken + s > 0.5 * sum(sizes):
            break
        chosen.append(i)
        taken += s
    assert chosen == [0]
    linears = [m for m in engine.module if isinstance(m, nn.Linear)]
    want_ids = {id(p) for i in chosen for p in linears[i].parameters()}
    assert engine._offloaded_ids == want_ids
    report = engine.memory_report()
    state = {
        id(p): sum(
            v.numel() * v.element_size()
            for v in ((t.to_local() if hasattr(t, "to_local") else t) for t in engine.optimizer.state[p].values())
        )
        for p in engine.module.parameters()
    }
    moved_params = sum(p.to_local().numel() * 4 for p in engine.module.parameters() if id(p) in want_ids)
    assert report["offloaded"] == sum(state[i] for i in want_ids) + 2 * moved_params


def _zero1_offload(rank, world, ratio):
    zero = {"stage": 1, **({"offload_optimizer": {"device": "cpu", "ratio": ratio}} if ratio else {})}
    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=zero))
    _train(engine, steps=3, seed=1 + rank)
    offloaded = engine.optimizer_offload.state_bytes() if engine.optimizer_offload else 0
    local = engine.optimizer.optim  # this rank's partition (ZeroRedundancyOptimizer)
    total = sum(v.numel() * v.element_size() for s in local.state.values() for k, v in s.items() if k != "step")
    return [p.detach().clone() for p in engine.module.parameters()], (offloaded, total, len(local.state))


def test_zero1_on_two_ranks_with_cpu_offload_equals_without():
    plain = run_ranks(_zero1_offload, 2, None, timeout=240)
    offl = run_ranks(_zero1_offload, 2, 0.9, timeout=240)
    for (wa, _), (wb, _) in zip(plain, offl):
        assert all(torch.equal(a, b) for a, b in zip(wa, wb))
    # each rank offloads at most the ratio of its own partition's state (moments; plus a 4-byte step
    # per parameter), and the ranks together offload something
    for _, (off, total, n) in offl:
        assert off <= 0.9 * total + 4 * n
    assert sum(off for _, (off, _, _) in offl) > 0
    assert all(torch.equal(a, b) for a, b in zip(offl[0][0], offl[1][0]))  # ranks agree


def test_stage1_offload_estimate_matches_the_measured_report():
    """estimate_memory's stage-1 CPU offload (closed form: the optimizer state kP/W moves to CPU
    memory) equals what the engine measures on one process (W = 1, whole offload)."""
    from qcompress.engine import estimate_memory

    engine = qcompress.initialize(_mlp(), _cfg(zero_optimization=_offload_zero(1.0)))
    _train(engine, steps=1)
    n = sum(p.numel() for p in engine.module.parameters())
    est = estimate_memory(n, 1, 1, offload="cpu")
    got = engine.memory_report()
    steps = 4 * len(list(engine.module.parameters()))  # AdamW's scalar step per parameter
    assert est["optimizer_state"] == got["optimizer_state"] == 0
    assert est["offloaded"] == 8 * n == got["offloaded"] - steps
    assert est["parameters"] == got["parameters"] and est["gradients"] == got["gradients"]


def test_steps_per_print_logs_every_n_steps(caplog):
    engine = qcompress.initialize(_mlp(), _cfg(steps_per_print=2))
    with caplog.at_level("INFO", logger="qcompress.engine"):
        _train(engine, steps=5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert [line.split(",")[0] for line in lines] == ["step=2", "step=4"]
    assert "lr=[0.01]" in lines[0]
