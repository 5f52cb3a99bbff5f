"""export_quantized from a pipeline-split engine (PP2, PP2 x TP2 on gloo ranks) equals, tensor for
tensor and in config.json, the single-process export of the same trained weights and compression
state (static activation ranges included)."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers import parallel_io_workers as iow
from tests.helpers.dist_utils import run_ranks


def _same_export(folder):
    a = load_file(os.path.join(folder, "split", "model.safetensors"))
    b = load_file(os.path.join(folder, "single", "model.safetensors"))
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:8]
    assert any(k.endswith("layers.1.mlp.down_proj.weight_packed") for k in a), sorted(a)[:8]
    assert any("input_scale" in k for k in a), "static activation ranges are exported"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:8]
    configs = []
    for name in ("split", "single"):
        with open(os.path.join(folder, name, "config.json")) as fh:
            cfg = json.load(fh)
        # each write's own: a random generation id and the file digests, whose safetensors header
        # lists the same metadata in a per-process order
        del cfg["qcompress"]["generation"], cfg["qcompress"]["files"]
        with safe_open(os.path.join(folder, name, "model.safetensors"), "pt") as fh:
            configs.append((cfg, fh.metadata()))
    assert configs[0] == configs[1]


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2), (4, 1)], ids=["pp2", "pp2_x_tp2", "pp2_x_dp2"])
def test_export_from_pipeline_stages_equals_single_process_export(tmp_path, world, tp):
    results = run_ranks(iow.stage_export, world, str(tmp_path), tp, 2, timeout=300)
    # the stages hold disjoint blocks: the oracle needs every rank's share
    assert "lm_head.weight" not in results[0][0] and "lm_head.weight" in results[-1][0]
    iow.single_export(results, str(tmp_path), iow.config(tp=tp, pp=2))
    _same_export(str(tmp_path))


def test_export_of_stages_sharing_tied_embeddings_is_refused(tmp_path):
    first, last = run_ranks(iow.tied_export, 2, str(tmp_path), timeout=300)
    assert first[0] == "NotImplementedError" and "lm_head" in first[1] and "tied" in first[1], first
    assert last[0] == "RuntimeError" and "rank 0 failed" in last[1], last
    assert not os.path.exists(os.path.join(str(tmp_path), "tied", "model.safetensors"))
