"""Activation checkpointing under the pipeline schedules with static activation ranges: GPipe and
1F1B run several micro-batches forward before their backwards, and every recompute must use the
range its own forward used. Oracle: the same 2-stage run without checkpointing; with plain SGD
(no normalisation) equal gradients give equal weights bit for bit."""

import pytest
import torch

from tests.helpers import checkpointing_pipeline_workers as cw
from tests.helpers.dist_utils import run_ranks


@pytest.mark.parametrize("schedule,fmt", [("gpipe", "int8"), ("1f1b", "nvfp4")])
def test_pipeline_with_checkpointing_trains_as_without(schedule, fmt):
    plain = run_ranks(cw.train_pipeline, 2, schedule, False, fmt, timeout=400)
    ckpt = run_ranks(cw.train_pipeline, 2, schedule, True, fmt, timeout=400)
    for stage, ((wa, ra), (wb, rb)) in enumerate(zip(plain, ckpt)):
        assert wa.keys() == wb.keys() and ra.keys() == rb.keys() and ra, stage
        differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
        assert not differ, (stage, differ)
        for n in ra:
            assert torch.equal(ra[n][0], rb[n][0]) and torch.equal(ra[n][1], rb[n][1]), (stage, n)
