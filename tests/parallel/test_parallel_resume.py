"""Checkpoints resumed into another mesh shape (gloo ranks): what the engine loads at the new
shape equals exactly what the saving engine held (whole weights, AdamW moments, compression
state with static activation ranges, LR schedule, counters), and the next step's loss follows
the saving run's within float reduction-order noise. A checkpoint the new mesh cannot read is
refused naming the folder and both meshes."""

import pytest
import torch

from tests.helpers import parallel_io_workers as iow
import qcompress as qc
from tests.helpers.dist_utils import run_ranks
from qcompress.errors import CheckpointError


def _at(folder, world, tp, pp, save):
    """mesh_resume on `world` ranks, its per-rank results merged into one snapshot."""
    if world == 1:
        results = [iow.mesh_resume(0, 1, folder, tp, pp, save)]
    else:
        results = run_ranks(iow.mesh_resume, world, folder, tp, pp, save, timeout=300)
    merged = {}
    for state, _ in results:
        for key, value in state.items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                assert merged.setdefault(key, value) == value, key
    losses = {loss for _, loss in results}
    assert len(losses) == 1, losses  # the mean loss is the same on every rank
    return merged, losses.pop()


def _same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (path, sorted(set(a) ^ set(b))[:6])
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


MESHES = {"one process": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "pp2 x dp2": (4, 1, 2)}


@pytest.mark.parametrize(
    "saved,loaded",
    [
        ("tp2", "one process"),
        ("one process", "tp2"),
        ("pp2", "one process"),
        ("one process", "pp2"),
        ("pp2 x dp2", "one process"),
    ],
)
def test_resume_into_another_mesh_shape_carries_every_state_exactly(tmp_path, saved, loaded):
    before, third = _at(str(tmp_path), *MESHES[saved], save=True)
    after, resumed = _at(str(tmp_path), *MESHES[loaded], save=False)
    assert any(k.endswith("exp_avg_sq") for k in after["optim"])
    assert any("aq" in e for e in after["compression"].values()), "static activation ranges carried"
    assert after["counters"]["global_steps"] == 2
    _same(before, after)
    assert resumed == pytest.approx(third, rel=1e-5)


def _refused(engine, folder, **kw):
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(folder, **kw)
    msg = str(err.value)
    assert folder in msg and "saved on the mesh pp2 x dp1 x tp1, loading into pp1 x dp1 x tp1" in msg, msg
    return msg


def test_checkpoint_another_mesh_cannot_read_is_refused_naming_folder_and_meshes(tmp_path):
    folder = str(tmp_path)
    doc = run_ranks(iow.onebit_save, 2, folder, timeout=300)[0]
    one = dict(doc, pipeline={"stages": 1})
    # 1-bit Adam's state is saved rank by rank: each stage's belongs to its own blocks
    assert "1-bit optimizer state" in _refused(iow.engine_for(one), folder)
    # one block fewer: the stages saved tensors this model has no place for
    small = qc.initialize(qc.init_compression(iow.pw.tiny_llama(layers=1), qc.load_config(one)), one)
    assert "model.layers.1." in _refused(small, folder, load_optimizer_states=False)
    # the weights and schedules alone load into the same model in one process
    engine = iow.engine_for(one)
    engine.load_checkpoint(folder, load_optimizer_states=False)
    assert engine.global_steps == 2
