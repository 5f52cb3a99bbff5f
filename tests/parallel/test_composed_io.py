"""Checkpoints and export of a tensor-parallel model with data-parallel replicas (TP2 x DP2 on 4
gloo ranks, ZeRO stage 0: FSDP2 replicate over dp; stage 3: a 2-D (dp, tp) DTensor per weight).

- Resume on the same mesh is exact: a fresh engine loading the checkpoint holds what the saving
  engine held, and its next steps' losses and weights equal bit for bit those of the run that
  never stopped.
- The checkpoint loads into one process: weights, AdamW moments, compression state (static
  activation ranges), LR schedule and counters equal the saved ones exactly. (Its next step is not
  compared: static ranges observe each replica's micro-batches apart, then average them, so one
  process fed the global batch follows within 1e-4, not float noise.)
- export_quantized equals, tensor for tensor, the single-process export of the same weights.
- ZeRO-2/3 CPU offload with the split steps as one process does.
All cases run in one spawn of the ranks (each 4-rank start costs tens of seconds here)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import parallel_composed_io_workers as ciow
from tests.helpers import parallel_io_workers as iow
from tests.train import test_train_parallel as tt
from tests.helpers.dist_utils import free_port, run_ranks
from qcompress.cli import main as cli_main
from tests.parallel.test_parallel_export import _same_export
from tests.parallel.test_parallel_resume import _same
from tests.train.test_train_parallel import llama  # noqa: F401  (the fixture: a tiny Llama and its corpus)

ZERO = {"tp2 x dp2": None, "tp2 x dp2 zero-3": {"stage": 3}}
OFFLOAD = {
    "zero-3 offload param + optimizer": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
    "zero-2 offload optimizer": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}
REL = 1e-5


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("composed_io"))
    return folder, run_ranks(ciow.composed_io, 4, folder, ZERO, OFFLOAD, timeout=500)


def _merged(results, name, key):
    """One snapshot from every rank's (the replicas hold the same whole tensors: they must agree)."""
    merged = {}
    for result in results:
        for k, value in result[name][key].items():
            if isinstance(value, dict):
                for n, v in value.items():
                    if n in merged.setdefault(k, {}):
                        _same(merged[k][n], v, f"{k}.{n}")
                    merged[k][n] = v
            else:
                assert merged.setdefault(k, value) == value, k
    return merged


def _one_process(seed, act="static"):
    """The unsplit engine fed the global batch: the replicas' micro-batches of a step, 2 x 2."""
    doc = iow.config(act=act)
    return iow.engine_for(dict(doc, gradient_accumulation_steps=2 * doc["gradient_accumulation_steps"]), seed=seed)


@pytest.mark.parametrize("name", list(ZERO))
def test_same_mesh_resume_is_bit_exact(composed, name):
    _, results = composed
    for rank, result in enumerate(results):
        r = result[name]
        _same(r["saved"], r["loaded"], f"rank {rank}")
        (losses, weights), (again, resumed) = r["continued"], r["resumed"]
        assert losses == again, f"rank {rank}: {losses} != {again}"
        _same(weights, resumed, f"rank {rank} weights after {ciow.MORE} more steps")
    assert results[0][name]["continued"][0] == results[3][name]["continued"][0], "every rank's mean loss"


@pytest.mark.parametrize("name", list(ZERO))
def test_checkpoint_loads_into_one_process_exactly(composed, name):
    folder, results = composed
    saved = _merged(results, name, "saved")
    assert any(k.endswith("exp_avg_sq") for k in saved["optim"])
    assert any("aq" in e for e in saved["compression"].values()), "static activation ranges carried"
    engine = _one_process(seed=2)  # other initial weights: the checkpoint replaces them
    engine.load_checkpoint(os.path.join(folder, name))
    _same(saved, iow.snapshot(engine))


@pytest.mark.parametrize("name", list(ZERO))
def test_export_equals_single_process_export(composed, name):
    folder, results = composed
    folder = os.path.join(folder, name)
    iow.single_export([r[name]["export"] for r in results], folder, ciow.composed_config(ZERO[name]))
    _same_export(folder)


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_cpu_offload_with_the_split_steps_as_one_process(composed, name):
    _, results = composed
    engine = _one_process(seed=0, act="dynamic")  # the initial weights of the ranks
    gas = engine.gradient_accumulation_steps
    loss = float(engine.train_batch(iter(iow.batches(gas))))  # the replicas' micro-batches
    want = iow.whole_weights(engine)
    for rank, result in enumerate(results):
        losses, weights, offloaded = result[name]
        assert offloaded > 0, f"rank {rank}: no parameter was offloaded"
        assert losses[0] == pytest.approx(loss, rel=REL), f"rank {rank}"
        for n, w in weights.items():
            err = float((w - want[n]).norm() / want[n].norm().clamp(min=1e-30))
            assert err < REL, f"rank {rank}: {n} differs by {err}"


def test_train_under_torchrun_at_tp2_x_dp2_follows_one_process(llama, tmp_path):
    """`qcompress train` on 4 ranks at TP2 x DP2: each replica reads its share of a step's samples,
    so with half the accumulation steps of one process it takes the same samples and losses."""
    model, corpus = llama
    one = str(tmp_path / "one")
    assert (
        cli_main(
            [
                "train",
                tt._config(tmp_path / "one.yaml", gradient_accumulation_steps=4),
                "--model",
                model,
                "--data",
                corpus,
                "--out",
                one,
                *tt.FAST,
            ]
        )
        == 0
    )
    out = str(tmp_path / "split")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tt.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "qcompress",
        "train",
        tt._config(tmp_path / "split.yaml", tensor_parallel={"autotp_size": 2}),
        "--model",
        model,
        "--data",
        corpus,
        "--out",
        out,
        *tt.FAST,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "report.json")) as fh:
        rep = json.load(fh)
    assert rep["training"]["mesh"] == {"pp": 1, "dp": 2, "tp": 2} and rep["training"]["world_size"] == 4
    assert rep["training"]["train_batch_size"] == 8
    assert tt._losses(out) == pytest.approx(tt._losses(one), rel=1e-5)
    st = rep["stages"]
    assert st["exported"]["perplexity"] == st["qat"]["perplexity"]
    assert st["exported"]["max_logit_diff_vs_qat"] == 0.0


def test_zero3_tp2_x_dp2_checkpoint_resumes_at_tp2_without_replicas(composed):
    """Another mesh shape: the ZeRO-3 TP2 x DP2 checkpoint (2-D DTensors) into TP2 on 2 ranks at
    stage 0; DCP reshards every tensor, and what loads equals what was saved."""
    folder, results = composed
    name = "tp2 x dp2 zero-3"
    loaded = run_ranks(iow.mesh_resume, 2, os.path.join(folder, name), 2, 1, False, timeout=300)
    saved = _merged(results, name, "saved")
    for rank, (state, _) in enumerate(loaded):
        _same(saved, state, f"rank {rank}")
