"""Engine checkpoint reliability: a crash at every rename and removal of a save
(as an exception and as a kill) leaves `latest` loading exactly the previous or exactly the new
checkpoint; temporaries of dead savers are removed by the next save (never a live saver's);
checkpoint files get the mode of a plain write.

Oracle: the engine's full parameters right after each save (W.full_params)."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import engine_workers as W
from qcompress.engine import initialize
from tests.export.test_export_integrity import Crash, Inject
from tests.helpers.child_env import child_env


def _engine():
    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1)
    return cfg, initialize(W.make_model(cfg), cfg)


def _loaded(cfg, folder, tag=None):
    fresh = initialize(W.make_model(cfg, seed=4), cfg)
    fresh.load_checkpoint(str(folder), tag=tag)
    return W.full_params(fresh)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _listing(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("same_tag", [False, True], ids=["new-tag", "same-tag"])
@pytest.mark.parametrize("dead", [False, True], ids=["exception", "kill"])
def test_save_is_atomic_at_every_rename_and_remove(tmp_path, same_tag, dead):
    cfg, engine = _engine()
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    tag_old, tag_new = ("best", "best") if same_tag else ("global_step2", "global_step3")
    base = tmp_path / "base"
    engine.save_checkpoint(str(base), tag=tag_old)
    old = W.full_params(engine)
    W.train_steps(engine, 2, 3, 1, 4, 1, 0)
    new = W.full_params(engine)
    assert not _same(old, new)
    outcomes = []
    for k in range(1, 40):
        d = tmp_path / f"k{k}"
        shutil.copytree(base, d)
        with Inject(k, dead):
            try:
                engine.save_checkpoint(str(d), tag=tag_new)
                crashed = False
            except Crash:
                crashed = True
        got = _loaded(cfg, d)  # through `latest`
        if not crashed:
            assert _same(got, new)
            assert _listing(d) == sorted({tag_old, tag_new, "latest"})
            break
        assert _same(got, old) or _same(got, new), f"crash at rename/remove {k}: neither"
        outcomes.append("old" if _same(got, old) else "new")
        if same_tag:  # by name too
            by_name = _loaded(cfg, d, tag=tag_new)
            assert _same(by_name, old) or _same(by_name, new)
        engine.save_checkpoint(str(d), tag=tag_new)  # the next save repairs and cleans up
        assert _same(_loaded(cfg, d), new)
        assert _listing(d) == sorted({tag_old, tag_new, "latest"}), (k, _listing(d))
    else:
        pytest.fail("the save never finished")
    # nothing is committed before `latest` (new tag) or the parked copy's removal (same tag)
    # names the new checkpoint; from then on it stays the new one
    assert outcomes[0] == "old" and outcomes == sorted(outcomes, key=lambda o: o == "new"), outcomes


def test_leftovers_of_killed_saves_are_removed(tmp_path, monkeypatch):
    # 12 saves of growing step numbers killed after writing everything: the next save removes
    # all they left (each killed save would clean its predecessor; switched off to pile them up)
    from qcompress.engine import checkpoint as ck

    cfg, engine = _engine()
    W.train_steps(engine, 0, 1, 1, 4, 1, 0)
    d = str(tmp_path)
    engine.save_checkpoint(d, tag="good")
    monkeypatch.setattr(ck, "clean_leftovers", lambda *a, **k: None)
    for step in range(12):
        with Inject(3, dead=True):  # dies at the commit rename
            with pytest.raises(Crash):
                engine.save_checkpoint(d, tag=f"global_step{step}")
    monkeypatch.undo()
    left = [f for f in _listing(d) if f.startswith(".")]
    assert sum(f.endswith(".tmp") for f in left) == 12 and sum(f.endswith(".lock") for f in left) == 12
    assert all(os.path.isfile(os.path.join(d, f".global_step{i}.tmp", "engine.json")) for i in range(12))
    assert _same(_loaded(cfg, d), W.full_params(engine))  # `latest` still names "good"
    engine.save_checkpoint(d, tag="global_step99")
    assert _listing(d) == ["global_step99", "good", "latest"]


_LIVE = textwrap.dedent("""
    import time
    from tests.helpers import engine_workers as W
    from qcompress import atomic
    from qcompress.engine import initialize
    cfg = W.make_cfg(stage=0, micro=4, gas=1, world=1)
    engine = initialize(W.make_model(cfg), cfg)
    def stall(*a):
        print("written", flush=True)
        time.sleep(600)
    atomic.fs_replace = stall            # every file written; stop before the commit
    engine.save_checkpoint({d!r}, tag="slow")
""")


def test_live_saver_is_not_cleaned_and_cannot_be_doubled(tmp_path):
    d = str(tmp_path)
    code = _LIVE.format(d=d)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert proc.stdout.readline().strip() == "written"
        theirs = [f for f in _listing(d) if f.startswith(".slow.")]
        assert sorted(theirs) == [".slow.lock", ".slow.tmp"]
        cfg, engine = _engine()
        engine.save_checkpoint(d, tag="other")  # cleans leftovers, not a live saver's
        assert set(theirs) <= set(_listing(d))
        with pytest.raises(RuntimeError, match="another process is saving checkpoint tag 'slow'"):
            engine.save_checkpoint(d, tag="slow")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    engine.save_checkpoint(d, tag="other")
    assert _listing(d) == ["latest", "other"]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_checkpoint_files_honour_the_umask(tmp_path, umask):
    cfg, engine = _engine()
    old = os.umask(umask)
    try:
        engine.save_checkpoint(str(tmp_path))
    finally:
        os.umask(old)
    for root, dirs, files in os.walk(tmp_path):
        for f in files:
            mode = os.stat(os.path.join(root, f)).st_mode & 0o777
            assert mode == 0o666 & ~umask, (f, oct(mode))
        for dname in dirs:
            mode = os.stat(os.path.join(root, dname)).st_mode & 0o777
            assert mode == 0o777 & ~umask, (dname, oct(mode))


def _damage(kind, ck):
    """Damage the checkpoint folder `ck` one way; returns the path the error must name."""

    def truncate(path, size):
        with open(path, "r+b") as fh:
            fh.truncate(size)
        return path

    distcp = sorted(f for f in os.listdir(ck) if f.endswith(".distcp"))[0]
    if kind == "engine.json truncated":
        return truncate(os.path.join(ck, "engine.json"), 40)
    if kind == "engine.json not an object":
        with open(os.path.join(ck, "engine.json"), "w") as fh:
            fh.write("[]")
        return os.path.join(ck, "engine.json")
    if kind == "rank file missing":
        os.remove(os.path.join(ck, "ranks", "rank0.json"))
        return os.path.join(ck, "ranks", "rank0.json")
    if kind == ".metadata truncated":
        return truncate(os.path.join(ck, ".metadata"), os.path.getsize(os.path.join(ck, ".metadata")) // 2)
    if kind == "tensor file truncated":
        truncate(os.path.join(ck, distcp), os.path.getsize(os.path.join(ck, distcp)) // 2)
        return ck
    if kind == "tensor file missing":
        os.remove(os.path.join(ck, distcp))
        return ck
    if kind == "tensor bytes flipped":  # same size, still unpickles: loaded garbage silently
        path = os.path.join(ck, distcp)
        data = bytearray(open(path, "rb").read())
        for frac in (0.5, 0.6, 0.7, 0.8):
            for j in range(int(len(data) * frac), int(len(data) * frac) + 8):
                data[j] ^= 0x55
        with open(path, "wb") as fh:
            fh.write(bytes(data))
        return path
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "engine.json truncated",
        "engine.json not an object",
        "rank file missing",
        ".metadata truncated",
        "tensor file truncated",
        "tensor file missing",
        "tensor bytes flipped",
    ],
)
def test_damaged_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path, kind):
    # Damage used to surface as a bare JSONDecodeError / AttributeError / UnpicklingError, or as
    # DCP's CheckpointException, a BaseException that `except Exception` does not catch.
    from qcompress.engine import CheckpointError

    cfg, engine = _engine()
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    d = str(tmp_path)
    engine.save_checkpoint(d, tag="good")
    shutil.copytree(os.path.join(d, "good"), os.path.join(d, "bad"))
    named = _damage(kind, os.path.join(d, "bad"))
    fresh = initialize(W.make_model(cfg, seed=4), cfg)
    before = W.full_params(fresh)
    with pytest.raises(CheckpointError) as err:
        fresh.load_checkpoint(d, tag="bad")
    assert isinstance(err.value, ValueError) and named in str(err.value)
    assert _same(W.full_params(fresh), before)  # nothing was half-loaded
    assert fresh.global_steps == 0
    fresh.load_checkpoint(d, tag="good")  # the engine is still usable
    assert _same(W.full_params(fresh), W.full_params(engine))


def test_checkpoint_of_another_model_or_optimizer_is_refused(tmp_path):
    # Saved weights the model lacks were dropped silently, and another optimizer's state loaded
    # silently (SGD took AdamW's betas and eps into its param groups).
    from qcompress.engine import CheckpointError

    cfg, engine = _engine()
    W.train_steps(engine, 0, 2, 1, 4, 1, 0)
    d = str(tmp_path)
    engine.save_checkpoint(d, tag="t")
    plain = dict(cfg, compression_training={})
    smaller = torch.nn.Sequential(torch.nn.Linear(W.IN, W.HID), torch.nn.ReLU(), torch.nn.Linear(W.HID, W.HID))
    with pytest.raises(CheckpointError, match=r"weights this model does not have: 4\.bias, 4\.weight"):
        initialize(smaller, plain).load_checkpoint(d, tag="t")
    sgd_cfg = dict(cfg, optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    sgd = initialize(W.make_model(cfg, seed=4), sgd_cfg)
    with pytest.raises(CheckpointError, match="saved by AdamW, this engine runs SGD"):
        sgd.load_checkpoint(d, tag="t")
    assert "betas" not in sgd.optimizer.param_groups[0]
    sgd.load_checkpoint(d, tag="t", load_optimizer_states=False)  # the weights alone
    assert _same(W.full_params(sgd), W.full_params(engine))


def test_an_owner_lock_is_held_from_the_moment_its_name_appears(tmp_path, monkeypatch):
    """OwnerLock.create locks the file under a private name and hard-links it into place, so a
    cleaner looking at that instant finds a live owner (before, a window between the exclusive
    create and the flock let a cleaner take the lock of a live writer)."""
    from qcompress import atomic

    if not atomic.claims_supported():
        pytest.skip("no flock here: owner locks are not used")
    path = str(tmp_path / "x.lock")
    real_link, seen = os.link, []

    def link(src, dst):
        real_link(src, dst)
        seen.append(atomic.OwnerLock.claim(dst))  # a cleaner, right as the name appears

    monkeypatch.setattr(os, "link", link)
    lock = atomic.OwnerLock.create(path)
    assert seen == [None]
    assert os.listdir(tmp_path) == ["x.lock"]  # the private name is gone
    with pytest.raises(FileExistsError):
        atomic.OwnerLock.create(path)
    assert os.listdir(tmp_path) == ["x.lock"]
    lock.release()
    assert atomic.OwnerLock.claim(path) is not None  # released: a dead owner's (missing file)

    def no_links(src, dst):
        raise PermissionError(1, "hard links are not supported here")

    monkeypatch.setattr(os, "link", no_links)  # the fallback: created in place, then locked
    lock = atomic.OwnerLock.create(path)
    assert atomic.OwnerLock.claim(path) is None
    assert os.listdir(tmp_path) == ["x.lock"]
    lock.release()
