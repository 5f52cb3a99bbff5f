"""Tensor and pipeline parallelism with compression on 2 gloo ranks against the unsplit model (the oracle).

Codes of a column- and a row-parallel quantized Linear gathered from the shards equal the
unsplit module's exactly; a tiny Llama split by its own base_model_tp_plan gives the same loss
and gradients; engine.train_batch at TP2, DP2 and PP2 follows the single process.
"""

import pytest

from tests.helpers import parallel_workers as pw
from tests.helpers.dist_utils import run_ranks

CASES = [
    ("channel sym, no activations", dict(bits=8)),
    ("channel asym, static activations", dict(bits=4, symmetric=False, act="static")),
    (
        "group 32 asym, dynamic activations",
        dict(bits=4, granularity="group", group_size=32, symmetric=False, act="dynamic"),
    ),
    ("group 16 sym, static activations", dict(bits=8, granularity="group", group_size=16, act="static")),
    ("tensor sym, dynamic activations", dict(bits=8, granularity="tensor", act="dynamic")),
    ("tensor asym, static activations", dict(bits=6, granularity="tensor", symmetric=False, act="static")),
]


def test_codes_equal_unsplit_column_and_row_parallel():
    results = run_ranks(pw.codes_match, 2, CASES, timeout=300)
    for rank_result in results:
        for name, _ in CASES:
            codes, weights, out_diff = rank_result[name]
            assert codes, f"{name}: codes gathered from the shards differ from the unsplit module's"
            assert weights, f"{name}: fake-quantized weights differ"
            # only the row-parallel all-reduce's summation order differs
            assert out_diff < 1e-5, f"{name}: outputs differ by {out_diff}"


def test_llama_step_loss_and_grads_equal_single_process():
    comp = pw.compression(bits=4, granularity="group", group_size=16, symmetric=False, act="dynamic")
    for loss, loss_ref, worst, same_names in run_ranks(pw.llama_step, 2, comp, timeout=300):
        assert same_names
        assert loss == pytest.approx(loss_ref, rel=1e-5)
        assert worst < 1e-5, f"gradient relative error {worst}"


def _close_weights(a, b, rel=1e-3):
    # after 3 AdamW steps: Adam divides reduction-order noise by tiny second moments, so the
    # weights agree less tightly than one step's loss and gradients (1e-5 above)
    assert set(a) <= set(b), sorted(set(a) - set(b))
    for name in a:
        err = float((a[name] - b[name]).norm() / b[name].norm())
        assert err < rel, f"{name}: relative difference {err}"


def test_train_batch_tp2_and_dp2_follow_single_process():
    single = pw.engine_train_batch(0, 1, 1, 4)
    assert single[1:3] == (0, 1)
    tp = run_ranks(pw.engine_train_batch, 2, 2, 4, timeout=300)
    for losses, dp_rank, dp_world, weights in tp:
        assert (dp_rank, dp_world) == (0, 1)  # both ranks are one replica
        assert losses == pytest.approx(single[0], rel=1e-5)
        _close_weights(weights, single[3])
    dp = run_ranks(pw.engine_train_batch, 2, 1, 2, timeout=300)
    assert [r[1:3] for r in dp] == [(0, 2), (1, 2)]
    assert dp[0][0] == dp[1][0]  # the mean loss is the same on every rank
    assert dp[0][0] == pytest.approx(single[0], rel=1e-5)
    _close_weights(dp[0][3], single[3])


def test_train_batch_pipeline_pp2_and_pp2_x_tp2_equal_single_process():
    single = pw.engine_train_batch(0, 1, 1, 4)
    stages = run_ranks(pw.engine_train_batch, 2, 1, 4, 3, 2, timeout=300)
    for losses, dp_rank, dp_world, weights in stages:
        assert (dp_rank, dp_world) == (0, 1)
        assert losses == pytest.approx(single[0], rel=1e-5)
        _close_weights(weights, single[3], 1e-5)
    # the first stage holds the embeddings and block 0, the last block 1, the norm and lm_head
    assert "model.embed_tokens.weight" in stages[0][3] and "lm_head.weight" not in stages[0][3]
    assert "lm_head.weight" in stages[1][3] and not any(".layers.0." in n for n in stages[1][3])
    # 4 ranks: ranks 0, 1 are stage 0 split over 2 tensor-parallel ranks, ranks 2, 3 stage 1
    grid = run_ranks(pw.engine_train_batch, 4, 2, 4, 3, 2, timeout=500)
    for rank, (losses, dp_rank, dp_world, weights) in enumerate(grid):
        assert (dp_rank, dp_world) == (0, 1)
        assert losses == pytest.approx(single[0], rel=1e-5)
        _close_weights(weights, single[3])
        assert ("lm_head.weight" in weights) == (rank >= 2)


def test_export_from_tp2_equals_single_process_export_of_the_same_weights(tmp_path):
    equal = run_ranks(pw.export_matches, 2, str(tmp_path), timeout=300)[0]
    assert any(k.endswith("q_proj.weight_packed") for k in equal), sorted(equal)[:8]
    assert all(equal.values()), [k for k, ok in equal.items() if not ok]


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_sharded_checkpoint_resumes_exactly(tmp_path, pp):
    for third, resumed in run_ranks(pw.resume_matches, 2, str(tmp_path), pp, timeout=300):
        assert resumed == third  # the same loss, bit for bit, after loading into a fresh engine
