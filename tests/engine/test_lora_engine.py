"""LoRA through qcompress.initialize on two gloo ranks at ZeRO stages 0-3 (tests/helpers/lora_workers.py):
only the adapters are in the optimizer, the frozen base never moves, every stage trains as stage 0,
and a checkpoint resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import lora_workers as W
from tests.helpers.dist_utils import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(W.run, 2, str(tmp_path_factory.mktemp("lora_ckpt")), timeout=400)


def _is_adapter(name):
    return name.endswith(("lora_A", "lora_B"))


@pytest.mark.parametrize("mode", ["qat", "qlora"])
@pytest.mark.parametrize("stage", W.STAGES)
def test_only_adapters_train(ranks, mode, stage):
    r = ranks[0][f"{mode}-{stage}"]
    held = set(r["optimizer"]) | set(ranks[1][f"{mode}-{stage}"]["optimizer"])  # ZeRO-1: split over ranks
    assert held and all(_is_adapter(n) for n in held), held
    assert len(held) == 6
    for name, t in r["final"].items():
        moved = not torch.equal(t, r["start"][name])
        assert moved == _is_adapter(name), name  # the adapters train, nothing else changes
    if mode == "qlora":
        assert not [n for n in r["final"] if n.endswith(".weight")]  # bases stored as codes
        assert any(n.endswith("qlora_codes") for n in r["final"])


@pytest.mark.parametrize("mode", ["qat", "qlora"])
@pytest.mark.parametrize("stage", W.STAGES[1:])
def test_every_stage_trains_as_stage_0(ranks, mode, stage):
    for rank in (0, 1):
        ref, got = ranks[rank][f"{mode}-0"], ranks[rank][f"{mode}-{stage}"]
        for name in ref["final"]:
            torch.testing.assert_close(got["final"][name], ref["final"][name], rtol=1e-5, atol=1e-6)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.parametrize("mode", ["qat", "qlora"])
@pytest.mark.parametrize("stage", W.STAGES)
def test_resume_is_exact(ranks, mode, stage):
    for rank in (0, 1):
        r = ranks[rank][f"{mode}-{stage}"]
        assert r["resumed_losses"] == r["losses"][W.SAVE_AT :]
        for name, t in r["final"].items():
            assert torch.equal(r["resumed_final"][name], t), name
