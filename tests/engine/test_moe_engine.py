"""Mixture-of-experts training through the engine: FSDP2 (ZeRO-3) at 2 gloo ranks trains the 3-D
expert Parameters as DDP (stage 0) does, the 1-bit optimizers train them, and --resume continues
exactly (same losses, same weights)."""

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers import moe_workers as W


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ck")
    return {stage: run_ranks(W.run, 2, str(root / f"s{stage}"), stage, timeout=400) for stage in (0, 3)}


def test_zero3_trains_the_experts_as_stage0(runs):
    for rank in range(2):
        s0, s3 = runs[0][rank], runs[3][rank]
        assert s0["bits"] == s3["bits"] and set(s0["bits"].values()) == {5}  # 8 bits, drops after 1, 2, 4 steps
        assert s3["losses"] == pytest.approx(s0["losses"], rel=1e-4)
        for k in s0["final"]:
            # gradients summed in another order; Adam's normalisation turns that into ~1e-5 on a
            # few weights after four steps of lr 0.01
            torch.testing.assert_close(s3["final"][k], s0["final"][k], rtol=1e-3, atol=1e-4)
        moved = [k for k in s0["final"] if "experts" in k and not torch.equal(s0["final"][k], s0["saved"][k])]
        assert len(moved) == 4  # both experts tensors of both layers were trained


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_is_exact(runs, stage):
    for rank in range(2):
        r = runs[stage][rank]
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
        assert r["resumed"] == r["tail"]
        assert all(torch.equal(r["final"][k], r["resumed_final"][k]) for k in r["final"])


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_onebit_optimizers_train_the_experts_and_resume_exactly(tmp_path, optimizer):
    ranks = run_ranks(W.run, 2, str(tmp_path / "ck"), 0, optimizer, timeout=400)
    for r in ranks:
        assert all(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"])
        assert r["resumed"] == r["tail"]
        assert all(torch.equal(r["final"][k], r["resumed_final"][k]) for k in r["final"])
        moved = [k for k in r["final"] if "experts" in k and not torch.equal(r["final"][k], r["saved"][k])]
        assert len(moved) == 4  # the compressed phase updated every fused expert tensor


@pytest.mark.parametrize("optimizer,act", [("AdamW", "static"), ("OneBitAdam", "static"), ("ZeroOneAdam", "dynamic")])
def test_activation_quantized_experts_train_sync_and_resume_exactly(tmp_path, optimizer, act):
    ranks = run_ranks(W.run, 2, str(tmp_path / "ck"), 0, optimizer, act, timeout=400)
    for r in ranks:
        assert r["resumed"] == r["tail"]
        assert all(torch.equal(r["final"][k], r["resumed_final"][k]) for k in r["final"])
        assert r["resumed_ranges"] == r["ranges"]  # the per-expert ranges resumed too
    if act == "static":
        got = ranks[0]["ranges"]
        assert len(got) == 4 and all(any(v is not None for v in per) for per in got.values())
        # averaged every optimizer step: both ranks quantize each expert's tokens with one range
        assert ranks[1]["ranges"] == got
        assert len({v for per in got.values() for v in per if v is not None}) > 4  # per expert, not per layer
