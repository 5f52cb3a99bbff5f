"""The library's exceptions: they cross process boundaries intact, and one CheckpointError class
covers export folders and engine checkpoints."""

import multiprocessing as mp
import pickle

import pytest

import qcompress
from qcompress.errors import CheckpointError, ConfigError


def _raise_config_error(queue):
    try:
        qcompress.load_config({"train_batch_size": -3})
    except ConfigError as err:
        queue.put(err)


def test_config_error_survives_pickling():
    err = pickle.loads(pickle.dumps(ConfigError("compression_training.x.bits", "must be 1-8, got 9")))
    assert type(err) is ConfigError
    assert err.path == "compression_training.x.bits"
    assert str(err) == "compression_training.x.bits: must be 1-8, got 9"
    assert str(pickle.loads(pickle.dumps(ConfigError("", "no path")))) == "no path"


def test_config_error_from_a_spawned_process_keeps_its_message():
    """A rank started with spawn hands its ConfigError back through a queue (pickle): the parent
    sees the child's key path and message, not an unpickling TypeError."""
    try:
        qcompress.load_config({"train_batch_size": -3})
    except ConfigError as err:
        expected = str(err)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_raise_config_error, args=(queue,))
    proc.start()
    got = queue.get(timeout=120)
    proc.join(timeout=60)
    assert type(got) is ConfigError and str(got) == expected and "train_batch_size" in got.path


def test_one_checkpoint_error_class():
    from qcompress.engine import CheckpointError as EngineError
    from qcompress.export import CheckpointError as ExportCheckpointError

    assert EngineError is ExportCheckpointError is CheckpointError is qcompress.CheckpointError
    with pytest.raises(ValueError):  # still a ValueError, as both were
        raise EngineError("x")
