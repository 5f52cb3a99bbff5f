"""Checkpoints written by an earlier engine keep loading, and new ones keep their layout.

The fixtures under tests/fixtures/engine_checkpoints/ were written by the engine as it was before
the placements (single process, DDP, ZeRO-1, FSDP2, mesh replicas under a tensor / pipeline
split, 1-bit local shards) became classes, one case per placement (see
checkpoint_compat_workers.py). For each case the current engine must
- run to the save point holding the same state, bit for bit, as the earlier engine did;
- save the same layout (engine.json's structure, the stored tensors' names, shapes and dtypes,
  the per-rank JSON keys);
- load the stored checkpoint into a fresh engine with other initial weights, hold exactly the
  saved state, and take the next two optimizer steps exactly as the saving engine took them.
"""

import json
import os

import pytest

from tests.helpers import checkpoint_compat_workers as w
from tests.helpers.dist_utils import run_ranks

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "engine_checkpoints")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{case: [each rank's check() result]}; the 2-rank cases share one spawn (one process group)."""
    scratch = str(tmp_path_factory.mktemp("compat"))
    out = {}
    by_world = {}
    for case, (world, _, _) in w.CASES.items():
        by_world.setdefault(world, []).append(case)
    for world, cases in sorted(by_world.items()):
        if world == 1:
            per_rank = [w.check_all(0, 1, cases, FIXTURES, scratch)]
        else:
            per_rank = run_ranks(w.check_all, world, cases, FIXTURES, scratch, timeout=900)
        for case in cases:
            out[case] = [r[case] for r in per_rank]
    return out


def _mismatch(got, want):
    return [k for k in sorted(set(got) | set(want)) if got.get(k, "<missing>") != want.get(k, "<missing>")]


@pytest.mark.parametrize("case", sorted(w.CASES))
def test_checkpoint_of_the_earlier_engine_loads_and_layout_is_unchanged(results, case):
    ranks = results[case]
    with open(os.path.join(FIXTURES, case, "layout.json"), encoding="utf-8") as fh:
        want_layout = json.load(fh)
    got_layout = json.loads(json.dumps(ranks[0]["layout"]))  # tuples as JSON lists
    for part in ("engine.json", "tensors", "ranks"):
        assert got_layout[part] == want_layout[part], f"{case}: the checkpoint's {part} changed"
    for rank, res in enumerate(ranks):
        exp = res["expected"]
        for what, got, want in (
            ("state at the save", res["fresh_saved"], exp["saved"]),
            ("state loaded from the stored checkpoint", res["loaded"], exp["saved"]),
            ("state two steps after the load", res["after"], exp["after"]),
        ):
            bad = _mismatch(json.loads(json.dumps(got)), want)
            assert not bad, f"{case} rank {rank}: {what} differs at {bad[:6]} (+{max(0, len(bad) - 6)})"
        assert res["losses"] == exp["losses"], f"{case} rank {rank}: losses after the load"
