"""qcompress.initialize: ZeRO stages, accumulation, fp16 overflow, clipping, checkpoints, memory.

The distributed checks share two spawned gloo groups (2 ranks, then 1 rank); the rank-side code
is in engine_workers.py. The model is a small MLP rewritten by init_compression with W8A8
(weights 10 -> 8 bits written at optimizer-step time, static 8-bit activation ranges).
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

import qcompress as qc
from qcompress.engine import estimate_memory, initialize
from qcompress.engine.batch import resolve_batch
from qcompress.engine.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from qcompress.engine.precision import LossScaler

from tests.helpers import engine_workers as W
from tests.helpers.dist_utils import run_ranks
from tests.helpers.shared_paths import DS_COMPRESSION
from tests.helpers.tiny_models import TinyResNet, make_bert, make_gpt2

STAGES = [s[0] for s in W.STAGES]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine_ckpt"))


@pytest.fixture(scope="module")
def two_rank(ckpt_root):
    return run_ranks(W.run_stages, 2, ckpt_root, timeout=200)


@pytest.fixture(scope="module")
def one_rank(two_rank, ckpt_root):
    return run_ranks(W.run_stage3_one_rank, 1, ckpt_root, timeout=100)[0]


def _close(a, b, tol=1e-5):
    return all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a) and a.keys() == b.keys()


# --- every stage trains like stage 0 -----------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES[1:])
def test_stage_matches_stage0(two_rank, stage):
    for rank in range(2):
        ref, got = two_rank[rank]["s0"], two_rank[rank][stage]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert _close(got["final"], ref["final"])
    first = two_rank[0]["s0"]["losses"]
    assert first[-1] != first[0]  # it does train
    # The compression schedule ran: 10 bits at start, 8 bits after 4 optimizer steps.
    assert set(two_rank[0][stage]["bits"].values()) == {8}
    assert two_rank[0][stage]["sched_steps"] == W.STEPS


def test_ranks_agree_after_training(two_rank):
    for stage in STAGES:
        a, b = two_rank[0][stage]["final"], two_rank[1][stage]["final"]
        assert all(torch.equal(a[k], b[k]) for k in a)


# --- memory ------------------------------------------------------------------------------------
def test_memory_report_falls_with_stage_and_matches_estimate(two_rank):
    totals = [two_rank[0][s]["memory"]["total"] for s in STAGES]
    assert all(x > y for x, y in zip(totals, totals[1:])), totals
    n = two_rank[0]["s0"]["num_params"]
    for label, stage, offload in W.STAGES:
        rep = two_rank[0][label]["memory"]
        est = estimate_memory(n, 2, stage, offload)
        # Adam's per-tensor step counters (4 bytes each) are not in the estimate; ZeRO-1's greedy
        # partition of 6 tensors is not an exact half.
        slack = 6 * 4 + (4 * 2 * 32 * 32 if stage == 1 else 0)
        for key in ("parameters", "gradients", "optimizer_state", "offloaded"):
            assert abs(rep[key] - est[key]) <= slack, (label, key, rep[key], est[key])
    assert two_rank[0]["s3off"]["memory"]["offloaded"] > 0


def test_estimate_memory_closed_form():
    P, Wd = 1000, 4
    assert estimate_memory(P, Wd, 0) == {
        "parameters": 4000,
        "gradients": 4000,
        "optimizer_state": 8000,
        "total": 16000,
        "offloaded": 0,
    }
    assert estimate_memory(P, Wd, 1)["optimizer_state"] == 2000
    assert estimate_memory(P, Wd, 2)["gradients"] == 1000 and estimate_memory(P, Wd, 2)["parameters"] == 4000
    assert estimate_memory(P, Wd, 3)["total"] == 1000 + 1000 + 2000
    off = estimate_memory(P, Wd, 3, offload=True)
    assert off["total"] == 0 and off["offloaded"] == 4000
    assert qc.estimate_memory is estimate_memory
    with pytest.raises(qc.ConfigError, match="stage"):
        estimate_memory(P, Wd, 5)


# --- accumulation, overflow, clipping ----------------------------------------------------------
def test_micro2_acc4_equals_micro8_acc1(two_rank):
    for rank in range(2):
        acc = two_rank[rank]["accum"]
        assert _close(acc["2x4"], acc["8x1"]), "accumulated gradients differ from one big batch"


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(two_rank, stage):
    for rank in range(2):
        r = two_rank[rank]["overflow"][stage]
        assert r["unchanged"], "parameters moved on an overflowed step"
        assert r["skipped"] == 1 and r["global_steps"] == 2
        assert r["sched"] == (1, 1), "compression schedule advanced on a skipped step"
        assert r["scale"] == (256.0, 128.0)  # hysteresis 1: halved at once
        assert r["lr_iter"] == 1  # LR schedule did not advance either
        assert r["sched_after_clean_step"] == 2


def test_clipping_uses_the_global_norm(two_rank):
    micro, gas, world = 4, 2, 2
    oracle = W.grad_norm_oracle(micro, gas, world, W.make_cfg())
    for stage in STAGES:
        for rank in range(2):
            got = two_rank[rank][stage]["norms"][0]
            assert got == pytest.approx(oracle, rel=1e-5), (stage, rank)
    # Clipping (0.5) was active on some steps, and the stages still agree (test_stage_matches_stage0).
    assert max(two_rank[0]["s0"]["norms"]) > 0.5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_scales_the_update(two_rank, stage):
    """SGD after clipping equals torch's clip_grad_norm_ on the unsharded averaged gradient."""
    want, norms = W.clipped_sgd_oracle(2)
    assert min(norms) > 2 * W.CLIP["max_norm"]  # clipping changes every step
    for rank in range(2):
        for got, ref in zip(two_rank[rank]["clip"][stage], want):
            assert _close(got, ref, tol=1e-6), (stage, rank)


# --- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_resume_is_bit_exact(two_rank, stage):
    for rank in range(2):
        r = two_rank[rank][stage]
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
        assert r["resumed_losses"] == r["tail_losses"]
        assert all(torch.equal(r["final"][k], r["resumed_final"][k]) for k in r["final"])
        assert r["client"] == {"epoch": 7}
        assert r["counters"]["global_steps"] == W.SAVE_AT and r["counters"]["micro_steps"] == 2 * W.SAVE_AT
        assert r["latest"] == f"global_step{W.SAVE_AT}"


def test_stage3_resumes_on_one_rank(two_rank, one_rank):
    ref = two_rank[0]["s3dyn"]
    assert all(torch.equal(ref["saved"][k], one_rank["loaded"][k]) for k in ref["saved"])
    assert one_rank["client"] == {"epoch": 7}
    saved_optim = ref["optim_state"]
    assert saved_optim and saved_optim.keys() == one_rank["optim_state"].keys()
    assert all(torch.equal(saved_optim[k], one_rank["optim_state"][k]) for k in saved_optim)
    # Same global batches: one rank runs blocks [r0m0, r0m1, r1m0, r1m1] per step, with the
    # same 1/4 weighting as 2 ranks × 2 micro-batches, so training continues identically.
    one = one_rank["losses"]
    for rank in range(2):
        tail = two_rank[rank]["s3dyn"]["tail_losses"]
        mine = [one[4 * s + 2 * rank + m] for s in range(len(tail) // 2) for m in range(2)]
        assert mine == pytest.approx(tail, rel=1e-5)
    assert _close(one_rank["final"], two_rank[0]["s3dyn"]["final"])


def test_sharded_onebit_state_at_another_world_size_is_refused_before_loading(two_rank, one_rank):
    # The refusal came after the weights were already overwritten (optimizer installed last).
    s1 = one_rank["s1"]
    assert s1["onebit_refused"] is not None
    kind, msg = s1["onebit_refused"]
    assert kind == "CheckpointError" and "onebit1" in msg and "shard_state=True" in msg
    assert s1["onebit_untouched"] and s1["onebit_steps"] == 0
    saved = two_rank[0]["onebit"]["s1"]["saved"]
    assert all(torch.equal(saved[k], s1["onebit_weights_only"][k]) for k in saved)


def test_checkpoint_dir_is_atomic(two_rank, ckpt_root):
    d = os.path.join(ckpt_root, "s0")
    names = sorted(os.listdir(d))
    assert names == ["global_step3", "latest"], names  # no temp dirs left behind
    files = os.listdir(os.path.join(d, "global_step3"))
    assert "engine.json" in files and not any(f.endswith((".pt", ".pkl", ".bin")) for f in files)


# --- single-process checks ---------------------------------------------------------------------
def test_batch_triple():
    assert resolve_batch(32, 4, None, 2) == (32, 4, 4)
    assert resolve_batch(32, None, 2, 2) == (32, 8, 2)
    assert resolve_batch(None, 4, 2, 2) == (16, 4, 2)
    with pytest.raises(qc.ConfigError, match=r"train_batch_size: 30 != .*4.*2.*2"):
        resolve_batch(30, 4, 2, 2)
    with pytest.raises(qc.ConfigError, match="not divisible"):
        resolve_batch(30, 4, None, 2)
    assert resolve_batch(32, None, None, 2) == (32, 16, 1)  # accumulation defaults to 1
    assert resolve_batch(None, 4, None, 2) == (8, 4, 1)
    with pytest.raises(
        qc.ConfigError,
        match=r"^train_batch_size: set train_batch_size or "
        r"train_micro_batch_size_per_gpu \(only gradient_accumulation_steps = 3",
    ):
        resolve_batch(None, None, 3, 2)
    with pytest.raises(qc.ConfigError, match="train_micro_batch_size_per_gpu"):
        resolve_batch(None, None, None, 1)


def test_initialize_rejects_impossible_configs():
    cfg = W.make_cfg(stage=0, world=1)
    model = W.make_model(cfg)  # rewritten: only the config can be wrong
    cfg["train_batch_size"] = 9
    with pytest.raises(qc.ConfigError, match="train_batch_size"):
        initialize(model, cfg)
    del cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]
    with pytest.raises(qc.ConfigError, match="only gradient_accumulation_steps"):
        initialize(model, cfg)
    cfg = W.make_cfg(stage=2, world=1)
    cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-3}}
    with pytest.raises(qc.ConfigError, match=r"zero_optimization.stage.*shards"):
        initialize(model, cfg)
    cfg = W.make_cfg(stage=0, world=1)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_steps": 3}}
    with pytest.raises(qc.ConfigError, match="warmup_steps"):
        initialize(model, cfg)


@pytest.mark.parametrize(
    "sched, path",
    [
        ({"type": "WarmupLR", "params": {"warmup_min_lr": -1.0}}, "warmup_min_lr"),  # trained with lr < 0
        ({"type": "WarmupLR", "params": {"warmup_max_lr": "3e-4"}}, "warmup_max_lr"),  # a bare ValueError
        ({"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}, "warmup_num_steps"),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10.7, "warmup_num_steps": 2}}, "total_num_steps"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ratio": "x"}}, "cos_min_ratio"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": [-0.1], "cycle_max_lr": 1.0}}, "cycle_min_lr"),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "decay_step_size": -1}},
            "decay_step_size",
        ),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentum": "no"}},
            "cycle_momentum",
        ),
    ],
)
def test_scheduler_values_are_checked_by_key(sched, path):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": sched}
    with pytest.raises(qc.ConfigError) as err:
        initialize(torch.nn.Linear(3, 2), cfg)
    assert err.value.path == f"scheduler.params.{path}"
    # the accepted forms of the same keys still build
    ok = {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": [0.1],
            "cycle_max_lr": 1,
            "cycle_first_step_size": 4.0,
            "cycle_second_step_size": None,
            "cycle_momentum": False,
        },
    }
    assert initialize(torch.nn.Linear(3, 2), dict(cfg, scheduler=ok)).get_lr() == [0.1]


def test_single_process_fp16_bf16_train():
    for prec in ("bf16", "fp16"):
        cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1, **{prec: {"enabled": True}})
        engine = initialize(W.make_model(cfg), cfg)
        losses, _ = W.train_steps(engine, 0, 8, 1, 4, 1, 0)
        assert all(math.isfinite(x) for x in losses[-4:]) and engine.global_steps == 8
        if prec == "bf16":
            assert engine.skipped_steps == 0
        else:
            # A 2^16 scale overflows fp16 weight gradients here; hysteresis 2: the first overflow
            # keeps the scale, each further one halves it, then steps go through.
            k = engine.skipped_steps
            assert 1 <= k < 8 and engine.loss_scale == 2.0 ** (16 - (k - 1))


class _Opt:
    def __init__(self, lr=0.1, n=1, betas=True):
        self.param_groups = [
            ({"lr": lr, "betas": (0.9, 0.999)} if betas else {"lr": lr, "momentum": 0.9}) for _ in range(n)
        ]


def test_warmup_schedules_closed_form():
    s = WarmupLR(_Opt(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="log")
    got = [s.get_last_lr()[0]] + [(s.step(), s.get_last_lr()[0])[1] for _ in range(11)]
    assert got[:10] == pytest.approx([math.log(k + 1) / math.log(10) for k in range(10)])
    assert got[10:] == [1.0, 1.0]
    s = WarmupDecayLR(_Opt(), total_num_steps=20, warmup_max_lr=2.0, warmup_num_steps=10, warmup_type="linear")
    lrs = [s.get_last_lr()[0]] + [(s.step(), s.get_last_lr()[0])[1] for _ in range(21)]
    assert lrs[5] == pytest.approx(1.0) and lrs[10] == pytest.approx(2.0)
    assert lrs[15] == pytest.approx(1.0) and lrs[20] == 0.0 and lrs[21] == 0.0
    opt = _Opt(lr=0.5)
    s = WarmupCosineLR(
        opt, total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=2, cos_min_ratio=0.01, warmup_type="linear"
    )
    lrs = [s.get_last_lr()[0]] + [(s.step(), s.get_last_lr()[0])[1] for _ in range(12)]
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == pytest.approx(0.5 * 0.55)
    for k in range(2, 13):
        done = min(k - 2 + 1, 10)
        want = 0.5 * (0.01 + 0.99 * (1 + math.cos(math.pi * done / 10)) / 2)
        assert lrs[k] == pytest.approx(want)
    sd = s.state_dict()
    s2 = WarmupCosineLR(
        _Opt(lr=0.5),
        total_num_steps=12,
        warmup_min_ratio=0.1,
        warmup_num_steps=2,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    s2.load_state_dict(sd)
    assert s2.get_last_lr() == s.get_last_lr()


def test_onecycle_closed_form():
    opt = _Opt()
    s = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=4,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    )
    lrs, moms = [], []
    for _ in range(12):
        lrs.append(s.get_last_lr()[0])
        moms.append(opt.param_groups[0]["betas"][0])
        s.step()
    assert lrs[:9] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0, 0.775, 0.55, 0.325, 0.1][:8] + [0.1 / 1.25])
    assert moms[4] == pytest.approx(0.8) and moms[0] == pytest.approx(0.9)
    assert lrs[9] == pytest.approx(0.1 / 1.5) and lrs[11] == pytest.approx(0.1 / 2.0)
    sgd = _Opt(betas=False)
    OneCycle(sgd, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.9)


def test_onecycle_cycles_only_momentum_the_optimizer_uses():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.9}, {"params": [b]}], lr=0.1)
    s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    moms = []
    for _ in range(4):
        opt.zero_grad()
        (a.sum() + b.sum()).backward()
        opt.step()
        s.step()
        moms.append([g["momentum"] for g in opt.param_groups])
    assert [m[0] for m in moms] == pytest.approx([0.85, 0.8, 0.85, 0.9])
    assert [m[1] for m in moms] == [0.0] * 4
    # plain SGD on b (gradient 1): minus the sum of the rates, no momentum carried over
    assert torch.allclose(b.detach(), torch.full((2,), 1.0 - (0.1 + 0.55 + 1.0 + 0.55)))
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 2},
        },
    }
    engine = initialize(torch.nn.Linear(2, 2), cfg)
    assert engine.optimizer.param_groups[0]["momentum"] == 0.0 and not engine.lr_scheduler.cycle_momentum


def test_loss_scaler_rules():
    s = LossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=4)
    trace = []
    for overflow in [True, True, False, False, False, True, True, True, True]:
        s.update(overflow)
        trace.append(s.scale)
    # first overflow uses up hysteresis, second halves; 3 clean steps double; then down to the floor
    assert trace == [16, 8, 8, 8, 16, 16, 8, 4, 4]
    static = LossScaler(loss_scale=128.0)
    static.update(True)
    assert static.scale == 128.0


# --- 1-bit optimizers --------------------------------------------------------------------------
def test_onebit_adam_stage0_trains_and_resumes_bit_exact(two_rank):
    a, b = two_rank[0]["onebit"]["s0"], two_rank[1]["onebit"]["s0"]
    assert all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])  # ranks agree
    assert a["losses"][-1] != a["losses"][0]
    for r in (a, b):
        assert r["resumed_losses"] == r["tail_losses"]
        assert all(torch.equal(r["final"][k], r["resumed_final"][k]) for k in r["final"])


def test_onebit_adam_stage1_matches_stage0_bit_for_bit(two_rank):
    ob = two_rank[0]["onebit"]
    for rank in range(2):
        s0, s1 = two_rank[rank]["onebit"]["s0"], two_rank[rank]["onebit"]["s1"]
        assert s1["losses"] == s0["losses"]
        assert all(torch.equal(s0["final"][k], s1["final"][k]) for k in s0["final"])
        assert s1["resumed_losses"] == s1["tail_losses"]
    # stage 1 keeps the momentum whole and the variance only for each rank's chunk: across the two
    # ranks, stage 1 saves exactly one rank's worth of variance, 4 bytes per parameter
    n = two_rank[0]["onebit"]["s0"]["num_params"]
    saved = sum(
        two_rank[r]["onebit"]["s0"]["memory"]["optimizer_state"]
        - two_rank[r]["onebit"]["s1"]["memory"]["optimizer_state"]
        for r in range(2)
    )
    assert two_rank[0]["onebit"]["s0"]["memory"]["optimizer_state"] == 8 * n
    assert saved == 4 * n
    for kind, msg in ob["refused"].items():
        assert msg is not None and "zero_optimization.stage" in msg and kind in msg, (kind, msg)


# --- communication -----------------------------------------------------------------------------
GRAD_COMM = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_gradient_communication_on_accumulation_micro_steps(two_rank, stage):
    first, boundary = two_rank[0]["comm"]["micro"][stage]
    assert not any(k in GRAD_COMM for phase in first.values() for k in phase), first
    assert any(k in GRAD_COMM for k in boundary["backward"]), boundary
    if stage in (0, 1):
        assert first == {"forward": {}, "backward": {}, "step": {}}
    if stage == 2:  # weights stay gathered between micro-steps: no second all-gather
        assert "all_gather_single" not in boundary["forward"]


@pytest.mark.parametrize("stage", [0, 2])
def test_communication_data_type_changes_the_reduction(two_rank, stage):
    finals = two_rank[0]["comm"]["dtype"][stage]
    for dtype in ("bf16", "fp16"):
        diff = max((finals[dtype][k] - finals["fp32"][k]).abs().max().item() for k in finals["fp32"])
        assert 0 < diff < 0.05, (dtype, diff)  # rounded in transit, still the same training
        a, b = two_rank[0]["comm"]["dtype"][stage][dtype], two_rank[1]["comm"]["dtype"][stage][dtype]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_wall_clock_breakdown_reports_each_phase(two_rank):
    t = two_rank[0]["comm"]["timings"]
    for stage in (0, 1):
        assert all(t[stage][k] > 0 for k in ("forward", "backward", "allreduce", "step")), t[stage]
    for stage in (2, 3):  # FSDP2's gradient reduce-scatter, timed through set_custom_reduce_scatter
        assert t[stage]["allreduce"] > 0 and t[stage]["backward"] > 0, t[stage]


def test_reduce_bucket_size_counts_elements(two_rank):
    # 1000 fp32 gradients per DDP bucket, also when they travel as fp16 (the bucket holds fp32)
    for dtype, cap in two_rank[0]["comm"]["bucket_bytes"].items():
        assert abs(cap - 1000 * 4) <= 1, (dtype, cap)


def test_stage1_resumes_on_one_rank(two_rank, one_rank):
    ref = two_rank[0]["s1"]
    got = one_rank["s1"]
    assert all(torch.equal(ref["saved"][k], got["loaded"][k]) for k in ref["saved"])
    # Each of the 2 ranks saved the Adam state of the parameters it owned; one rank now owns all.
    saved = {**two_rank[0]["s1"]["optim_state"], **two_rank[1]["s1"]["optim_state"]}
    assert set(two_rank[0]["s1"]["optim_state"]).isdisjoint(two_rank[1]["s1"]["optim_state"])
    assert saved.keys() == got["optim_state"].keys() and len(saved) == 3 * 6
    assert all(torch.equal(saved[k], got["optim_state"][k]) for k in saved)
    assert all(math.isfinite(x) for x in got["losses"])


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from qcompress.engine import checkpoint as ck

    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1)
    engine = initialize(W.make_model(cfg), cfg)
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    engine.save_checkpoint(tmp_path)
    before = W.full_params(engine)
    W.train_steps(engine, 2, 3, 1, 4, 1, 0)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step3").exists()
    fresh = initialize(W.make_model(cfg, seed=4), cfg)
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path.endswith("global_step2") and fresh.global_steps == 2
    after = W.full_params(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.save_checkpoint(tmp_path)  # the next save cleans the leftovers
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "global_step3", "latest"]
    with pytest.raises(FileNotFoundError, match="latest"):
        fresh.load_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("crash_at", ["park", "move_in", "cleanup"])
def test_crash_while_resaving_a_tag_keeps_it_loadable(tmp_path, monkeypatch, crash_at):
    """Re-saving tag "best": a crash at each step of the commit leaves a complete "best"."""
    import shutil

    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1)
    engine = initialize(W.make_model(cfg), cfg)
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    engine.save_checkpoint(tmp_path, tag="best")
    first = W.full_params(engine)
    W.train_steps(engine, 2, 3, 1, 4, 1, 0)
    second = W.full_params(engine)
    final, parked, tmp = (str(tmp_path / n) for n in ("best", ".best.old", ".best.tmp"))
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst):
        if (crash_at, os.fspath(src), os.fspath(dst)) in {("park", final, parked), ("move_in", tmp, final)}:
            raise OSError("killed")
        return real_replace(src, dst)

    def rmtree(path, *a, **k):
        if crash_at == "cleanup" and os.fspath(path) == parked and not os.path.exists(tmp):
            raise OSError("killed")  # the new copy is in place, the old one not gone
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(OSError, match="killed"):
        engine.save_checkpoint(tmp_path, tag="best")
    monkeypatch.undo()
    want = second if crash_at == "cleanup" else first
    for tag in (None, "best"):  # through `latest` and by name
        fresh = initialize(W.make_model(cfg, seed=4), cfg)
        fresh.load_checkpoint(tmp_path, tag=tag)
        got = W.full_params(fresh)
        assert all(torch.equal(want[k], got[k]) for k in want), (crash_at, tag)
    engine.save_checkpoint(tmp_path, tag="best")  # the next save repairs and cleans up
    assert sorted(os.listdir(tmp_path)) == ["best", "latest"]
    fresh.load_checkpoint(tmp_path)
    got = W.full_params(fresh)
    assert all(torch.equal(second[k], got[k]) for k in second)


def test_resume_restores_rng_states(tmp_path):
    import random
    import numpy as np

    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1)
    engine = initialize(W.make_model(cfg), cfg)
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    torch.manual_seed(77), random.seed(77), np.random.seed(77)
    engine.save_checkpoint(tmp_path)
    uninterrupted = (torch.rand(5), random.random(), np.random.rand(3))
    fresh = initialize(W.make_model(cfg, seed=4), cfg)
    torch.rand(9), random.random(), np.random.rand(2)  # the resumed process is elsewhere
    fresh.load_checkpoint(tmp_path)
    resumed = (torch.rand(5), random.random(), np.random.rand(3))
    assert torch.equal(uninterrupted[0], resumed[0])
    assert uninterrupted[1] == resumed[1] and np.array_equal(uninterrupted[2], resumed[2])


def test_resume_restores_loss_scaler_and_counters(tmp_path):
    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1, fp16={"enabled": True, "loss_scale_window": 2})
    engine = initialize(W.make_model(cfg), cfg)
    W.train_steps(engine, 0, 6, 1, 4, 1, 0)
    scaler = engine.loss_scaler.state_dict()
    skipped = engine.skipped_steps
    assert skipped >= 1 and scaler != LossScaler(initial_scale_power=16, loss_scale_window=2).state_dict()
    engine.save_checkpoint(tmp_path)
    fresh = initialize(W.make_model(cfg, seed=4), cfg)
    fresh.load_checkpoint(tmp_path)
    assert fresh.loss_scaler.state_dict() == scaler
    assert fresh.counters() == {"global_steps": 6, "micro_steps": 6, "global_samples": 6 * 4, "skipped_steps": skipped}
    # the scale, hysteresis and window position decide the next skips: both runs go on alike
    a, _ = W.train_steps(engine, 6, 10, 1, 4, 1, 0)
    b, _ = W.train_steps(fresh, 6, 10, 1, 4, 1, 0)
    assert a == b and engine.counters() == fresh.counters()
    assert engine.loss_scaler.state_dict() == fresh.loss_scaler.state_dict()


def test_offload_needs_a_zero_stage():
    cfg = W.make_cfg(stage=0, world=1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(qc.ConfigError, match="stage 1, 2 or 3"):
        initialize(torch.nn.Linear(4, 4), cfg)


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_start_from_rank0_model(two_rank, stage):
    a, b = two_rank[0]["comm"]["seeded"][stage], two_rank[1]["comm"]["seeded"][stage]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_uneven_shards_match_stage0(two_rank):
    for rank in range(2):
        (l0, p0), (l3, p3) = two_rank[rank]["comm"]["odd"][0], two_rank[rank]["comm"]["odd"][3]
        assert l3 == pytest.approx(l0, rel=1e-5)
        assert _close(p3, p0)


def test_train_ddp_example_under_torchrun(tmp_path):
    """model_zoo/train_ddp.py as a user runs it: torchrun, 2 processes, RANK/WORLD_SIZE from the env."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = tmp_path / "cfg.yaml"
    # train_batch_size and accumulation as a ds_config.json gives them: micro batch 16 is derived
    cfg.write_text(
        "zero_optimization: {stage: 2}\nbf16: {enabled: true}\ntrain_batch_size: 64\ngradient_accumulation_steps: 2\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(root, "model_zoo", "train_ddp.py"),
            "--config",
            str(cfg),
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("epoch 0:"))
    accuracy = float(line.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5, line  # 10 classes: chance is 0.1
    assert "stage 2, 2 ranks" in proc.stdout
    assert (tmp_path / "ck" / "latest").read_text() == "global_step21"


@pytest.mark.parametrize("stage", [0, 2])
def test_buffers_agree_across_ranks(two_rank, stage):
    a, b = two_rank[0]["comm"]["bn"][stage], two_rank[1]["comm"]["bn"][stage]
    assert set(a) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert int(a["1.num_batches_tracked"]) == 6  # 3 steps × 2 micro-batches


# --- a client optimizer (configs without an optimizer section, as DeepSpeed takes one) -----------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("client", ["factory", "instance"])
def test_client_optimizer_trains_like_a_plain_torch_loop(client):
    # oracle: the same model, data, clipping and optimizer in a plain PyTorch loop
    model, ref = _mlp(), _mlp()
    make = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    engine = initialize(
        model,
        {"train_batch_size": 4, "gradient_clipping": 0.5},
        optimizer=make if client == "factory" else make(model.parameters()),
    )
    ref_opt = make(ref.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    assert engine.global_steps == 5
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_client_optimizer_mistakes_are_named():
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with pytest.raises(qc.ConfigError, match="optimizer.*keep one"):
        initialize(_mlp(), cfg, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    model = _mlp()
    with pytest.raises(qc.ConfigError, match=r"zero_optimization.stage.*factory"):
        initialize(
            model,
            {"train_batch_size": 4, "zero_optimization": {"stage": 3}},
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        )
    with pytest.raises(ValueError, match="not parameters of this model"):
        initialize(model, {"train_batch_size": 4}, optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1))
    with pytest.raises(qc.ConfigError, match="declare it in the config"):
        initialize(model, {"train_batch_size": 4}, optimizer=lambda p: qc.optim.OneBitAdam(p, lr=1e-3))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        initialize(model, {"train_batch_size": 4}, optimizer="adam")


SHARED_CONFIGS = sorted(glob.glob(os.path.join(DS_COMPRESSION, "**", "*.json"), recursive=True))


def _model_for(path, raw):
    """(student, teacher or None, loss of a module on a fixed batch) for one shared config."""
    g = torch.Generator().manual_seed(2)
    if os.sep + "bert" + os.sep in path:
        lr_cfg = raw["compression_training"].get("layer_reduction", {})
        layers = lr_cfg["keep_number_layer"] if lr_cfg.get("enabled") else 2
        x, y = torch.randint(0, 96, (2, 16), generator=g), torch.tensor([0, 2])
        loss = lambda m: torch.nn.functional.cross_entropy(m(input_ids=x).logits, y)  # noqa: E731
        return make_bert(layers=layers), make_bert(seed=1, layers=12), loss
    if os.sep + "gpt2" + os.sep in path:
        x = torch.randint(0, 96, (2, 16), generator=g)
        return make_gpt2(), None, lambda m: m(input_ids=x, labels=x).loss
    x, y = torch.randn(2, 3, 8, 8, generator=g), torch.tensor([1, 7])
    return TinyResNet(), None, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def test_six_shared_configs_found():
    assert len(SHARED_CONFIGS) == 6, SHARED_CONFIGS


@pytest.mark.parametrize("path", SHARED_CONFIGS, ids=lambda p: os.path.basename(p))
def test_every_shared_ds_config_trains_under_initialize(path):
    # DeepSpeed's own example configs, as users run them: init_compression (with a teacher for
    # layer reduction), then initialize; the four BERT configs have no optimizer section, so they
    # take a client optimizer as DeepSpeed's examples do
    raw = json.load(open(path))
    cfg = qc.load_config(path)
    model, teacher, loss_of = _model_for(path, raw)
    qc.init_compression(model, cfg, teacher_model=teacher)
    client = None if cfg.optimizer is not None else (lambda p: torch.optim.AdamW(p, lr=1e-4))
    engine = initialize(model, cfg, optimizer=client)
    engine.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = 6
    for _ in range(steps * engine.gradient_accumulation_steps):  # micro-batches (gpt2: 8 = 4 x 2)
        loss = loss_of(engine)
        engine.backward(loss)
        engine.step()
        assert math.isfinite(loss.item())
    assert engine.global_steps == steps and engine.skipped_steps < steps  # fp16 may skip a few
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    applied = steps - engine.skipped_steps
    assert engine.compression_scheduler.training_steps == applied


# --- int8_forward under the engine --------------------------------------------------------------
def test_int8_forward_trains_under_zero3_like_stage0():
    """The fused forward on the int8 kernel inside the engine: stage 3 (FSDP2's unsharded weights)
    matches stage 0, the ranks agree, every quantized forward took the kernel, and the run follows
    the float forward's (they differ only by that GEMM's rounding)."""
    from qcompress.quant import lowbit

    if not lowbit.available():
        pytest.skip("the C++ extension with the low-bit kernels is not built")
    res = run_ranks(W.run_int8_forward, 2, timeout=200)
    for rank in range(2):
        r = res[rank]
        assert r[(True, 3)]["losses"] == pytest.approx(r[(True, 0)]["losses"], rel=1e-5, abs=1e-6)
        assert _close(r[(True, 3)]["final"], r[(True, 0)]["final"])
        # 3 quantized Linears x 2 micro-batches x STEPS steps, forward only
        assert r[(True, 0)]["int8_calls"] == r[(True, 3)]["int8_calls"] == 3 * 2 * W.STEPS
        assert r[(False, 0)]["int8_calls"] == 0
        assert r[(True, 0)]["losses"] == pytest.approx(r[(False, 0)]["losses"], rel=1e-3)
    a, b = res[0][(True, 3)]["final"], res[1][(True, 3)]["final"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- tied weights (GPT-2's lm_head / wte) under FSDP2 ---------------------------------------------
def test_tied_weights_train_at_every_stage_like_stage0():
    """GPT-2 ties lm_head to wte. Stages 2/3 used to fail in fully_shard ('shared with a parameter
    already managed by another FSDP group'); once sharded together, the optimizer-step quantization
    of the tied weight was overwritten by a second, stale whole copy. Oracle: a single-process
    torch AdamW loop on the global batch (uncompressed) and stage 0 (compressed)."""
    from tests.helpers.tiny_models import make_gpt2

    res = run_ranks(W.run_tied, 2, 1, timeout=300)
    model = make_gpt2().train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    x = torch.cat([W.tied_batch(0, r, 2, 2) for r in range(2)])
    model(input_ids=x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    oracle = {n: p.detach() for n, p in model.named_parameters()}
    for stage in (0, 2, 3):
        for compress in (False, True):
            got = res[0][(compress, stage)]
            assert got["tied"]
            assert _close(got["final"], res[1][(compress, stage)]["final"], tol=0)  # ranks agree
            assert _close(got["final"], res[0][(compress, 0)]["final"], tol=1e-6)
        assert _close(res[0][(False, stage)]["final"], oracle, tol=1e-4)

    # the tied weight is on its 8-bit grid after the step at stage 3 too (symmetric, per row:
    # w / (absmax / 127) is an integer); the uncompressed one is not
    def off_grid(w):
        codes = w / (w.abs().amax(dim=1, keepdim=True) / 127)
        return (codes - codes.round()).abs().max().item()

    assert off_grid(res[0][(True, 3)]["final"]["transformer.wte.weight"]) < 1e-3
    assert off_grid(res[0][(False, 3)]["final"]["transformer.wte.weight"]) > 0.1


def test_ddp_stages_refuse_a_step_with_unused_parameters():
    """A trainable parameter outside the loss kept DDP from averaging its bucket (step 1 applied
    this rank's own gradients) and step 2 failed telling the user to pass find_unused_parameters
    to a DDP the engine builds. Now the first step is refused, naming the parameters."""
    res = run_ranks(W.run_unused, 2, timeout=200)
    for rank in range(2):
        for stage in (0, 1):
            msg = res[rank][stage]
            assert msg is not None and "spare.weight, spare.bias" in msg and "requires_grad_(False)" in msg
            assert res[rank][f"untouched{stage}"]
    # frozen as advised, it trains, and both ranks hold the same weights
    for stage in (0, 1):
        a, b = res[0][f"frozen{stage}"], res[1][f"frozen{stage}"]
        assert torch.equal(a, b) and not torch.equal(a, W.WithUnused().body.weight.detach())


def test_channel_pruning_config_trains_at_stage3_like_stage0():
    """The BatchNorm hook of channel pruning reads its conv's scores outside the conv's forward;
    stage 3 failed there ('index_put_ ... placement (Shard(dim=0),)') until the two share one
    FSDP2 unit."""
    path = next(p for p in SHARED_CONFIGS if p.endswith("ds_config_channel_prune.json"))
    res = run_ranks(W.run_channel_prune, 2, path, timeout=300)
    for rank in range(2):
        s0, s3 = res[rank][0], res[rank][3]
        assert s3["applied"] == s0["applied"] >= 1
        assert _close(s3["final"], s0["final"], tol=1e-6)
    assert _close(res[0][3]["final"], res[1][3]["final"], tol=0)


def test_compression_parameters_unused_before_their_offset_train_under_ddp():
    """topk pruning scores and learned activation ranges join the graph at their schedule_offset
    (pruning's default is 1000); DDP was built expecting every parameter each step, so stage 0
    failed at the second step. Oracle: stage 3 (FSDP2 needs no such promise)."""
    res = run_ranks(W.run_scheduled_params, 2, timeout=200)
    for rank in range(2):
        s0, s3 = res[rank][0], res[rank][3]
        assert any(k.endswith("row_pruning_scores") for k in s0) and any(k.endswith("input_scale") for k in s0)
        assert _close(s0, s3, tol=1e-6)
    assert _close(res[0][0], res[1][0], tol=0)


def test_csv_monitor_after_resume_holds_each_step_once(tmp_path):
    """A run resumed from an earlier checkpoint appended its steps after the interrupted run's
    rows for the same steps (DeepSpeed does too): every step past the checkpoint appeared twice.
    Oracle: the uninterrupted run's rows (resume is bit-exact)."""
    import csv

    def rows(folder):
        with open(os.path.join(folder, "job", "Train_Samples_train_loss.csv"), newline="") as fh:
            return list(csv.reader(fh))

    def engine_in(folder):
        cfg = W.make_cfg(
            stage=0,
            micro=4,
            gas=1,
            world=1,
            csv_monitor={"enabled": True, "output_path": str(folder), "job_name": "job"},
        )
        return initialize(W.make_model(cfg), cfg)

    straight = engine_in(tmp_path / "straight")
    W.train_steps(straight, 0, 5, 1, 4, 1, 0)
    straight.monitor.close()
    run = engine_in(tmp_path / "run")
    W.train_steps(run, 0, 2, 1, 4, 1, 0)
    run.save_checkpoint(str(tmp_path / "ck"))
    W.train_steps(run, 2, 4, 1, 4, 1, 0)  # interrupted after step 4, resumed from step 2
    run.monitor.close()
    resumed = engine_in(tmp_path / "run")
    resumed.load_checkpoint(str(tmp_path / "ck"))
    W.train_steps(resumed, 2, 5, 1, 4, 1, 0)
    resumed.monitor.close()
    got, want = rows(tmp_path / "run"), rows(tmp_path / "straight")
    assert [r[0] for r in got] == ["step", "4", "8", "12", "16", "20"]
    assert got == want
