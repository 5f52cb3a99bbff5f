"""KV-cache quantization under the engine: static ranges averaged over data-parallel ranks (as
static activation ranges are), learned KV scales trained and resumed from a checkpoint exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from tests.helpers import kv_workers as KW  # noqa: E402


def test_ranges_are_averaged_over_data_parallel_ranks_and_resume_under_zero3(tmp_path):
    """2 ranks (gloo), each its own batch: after the step every rank holds the mean of the two
    ranks' EMA ranges, per head, for every layer's K and V. Then ZeRO-3 (FSDP2-sharded learned
    scales): checkpoint after 3 steps and resume a fresh engine: the same losses and parameters."""
    from tests.helpers.dist_utils import run_ranks

    res = run_ranks(KW.run_ranks_checks, 2, str(tmp_path), timeout=600)
    for rank in (0, 1):
        z = res[rank]["zero3"]
        assert z["tail"] == z["resumed"]
        sd, sd2 = z["final"][0], z["resumed_final"][0]
        assert sd["model.layers.1.self_attn.v_scale"].shape == (2, 1, 1)
        assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert all(torch.equal(v, res[1]["zero3"]["final"][0][k]) for k, v in res[0]["zero3"]["final"][0].items())
    a, b = res[0]["sync"], res[1]["sync"]
    assert set(a["local"]) == set(a["synced"]) and len(a["local"]) == 4
    for key in a["local"]:
        assert not torch.equal(a["local"][key][0], b["local"][key][0])  # the ranks saw different data
        for i in (0, 1):
            mean = (a["local"][key][i] + b["local"][key][i]) / 2
            assert torch.equal(a["synced"][key][i], b["synced"][key][i])
            assert torch.allclose(a["synced"][key][i], mean, rtol=0, atol=1e-7)
            assert a["synced"][key][i].shape == (2,)  # per key/value head


def test_learned_kv_scales_resume_exactly(tmp_path):
    """One process: 3 steps (the learned scales start from the range after the first), checkpoint,
    2 more; a fresh engine from another seed resumes the checkpoint: the same losses, parameters
    (k_scale / v_scale included) and ranges, bit for bit."""
    out = KW.run_resume(0, 1, str(tmp_path))
    assert out["tail"] == out["resumed"]
    sd, rng = out["final"]
    sd2, rng2 = out["resumed_final"]
    assert "model.layers.0.self_attn.k_scale" in sd and sd["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert all(torch.equal(rng[k][i], rng2[k][i]) for k in rng for i in (0, 1))
