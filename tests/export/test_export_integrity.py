"""Export reliability: a forced overwrite is atomic as a whole (crash injected at every
rename and removal of the commit, as an exception and as a kill), a mixed set of files never
loads, index entries cannot escape the folder, temporaries of dead writers are cleaned (never a
live writer's), and files get the mode of a plain write.

The oracle for "exactly the old or exactly the new export" is a clean export of each model,
loaded once: every tensor of the model loaded after a crash must equal one of the two."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress import atomic
from qcompress.export import CheckpointError, export_quantized, load_quantized
from qcompress.export import safetensors_io as sio
from tests.helpers.child_env import child_env

CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 32},
                    "modules": ["0", "2"],
                }
            },
        }
    }
}


def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def compressed(seed):
    return qcompress.init_compression(make_net(seed), qcompress.load_config(CFG)).eval()


def state_of(folder):
    """Every tensor of the model load_quantized rebuilds from `folder`."""
    return {k: v.clone() for k, v in load_quantized(folder, make_net()).state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hidden(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("."))


class Crash(Exception):
    pass


class Inject:
    """Make the k-th rename/removal of atomic's hooks raise; with dead=True every later one too
    (the process is gone: nothing after the crash point happens, no cleanup either)."""

    def __init__(self, k, dead):
        self.k, self.dead, self.calls = k, dead, 0
        self.saved = {n: getattr(atomic, n) for n in ("fs_replace", "fs_remove", "fs_rmtree")}

    def __enter__(self):
        for name, real in self.saved.items():
            setattr(atomic, name, self._wrap(real))
        return self

    def _wrap(self, real):
        def hook(*args):
            self.calls += 1
            if self.calls == self.k or (self.dead and self.calls > self.k):
                raise Crash(f"injected crash at rename/remove {self.calls}")
            return real(*args)

        return hook

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(atomic, name, real)
        return False


@pytest.fixture(scope="module")
def models():
    return {seed: compressed(seed) for seed in (0, 1, 2)}


def _export(model, out, sharded, force=True):
    export_quantized(model, out, max_shard_size="2KB" if sharded else "2GB", force=force)


LAYOUTS = [(False, False), (True, True), (False, True), (True, False)]


@pytest.mark.parametrize(
    "old_sharded,new_sharded", LAYOUTS, ids=["single-single", "sharded-sharded", "single-sharded", "sharded-single"]
)
@pytest.mark.parametrize("dead", [False, True], ids=["exception", "kill"])
def test_overwrite_is_atomic_at_every_rename_and_remove(tmp_path, models, old_sharded, new_sharded, dead):
    template = tmp_path / "template"
    _export(models[0], template, old_sharded, force=False)
    old = state_of(template)
    _export(models[1], tmp_path / "clean_new", new_sharded, force=False)
    new = state_of(tmp_path / "clean_new")
    assert not same(old, new)
    outcomes = []
    for k in range(1, 50):
        out = tmp_path / f"k{k}"
        shutil.copytree(template, out)
        with Inject(k, dead) as inj:
            try:
                _export(models[1], out, new_sharded)
                crashed = False
            except Crash:
                crashed = True
        got = state_of(out)
        if not crashed:  # k is past the last rename/removal: a complete export
            assert same(got, new)
            assert not hidden(out)
            break
        assert same(got, old) or same(got, new), f"crash at rename/remove {k}: neither model"
        outcomes.append("old" if same(got, old) else "new")
        # the next writer finishes or discards what the crashed one left, and leaves nothing behind
        _export(models[2], out, new_sharded)
        assert same(state_of(out), state_of_clean(tmp_path, models[2], new_sharded))
        assert not hidden(out), f"leftovers after crash {k}: {hidden(out)}"
    else:
        pytest.fail("the export never finished")
    n_new = 2 if new_sharded else 1
    assert inj.calls >= n_new + 1  # config.json + every data file renamed in
    # the first rename is config.json's (the commit): failing it keeps the old export; from
    # then on the folder is the new one
    assert outcomes[0] == "old" and outcomes[1:] and set(outcomes[1:]) == {"new"}, outcomes


_CLEAN = {}


def state_of_clean(tmp_path, model, sharded):
    key = (id(model), sharded)
    if key not in _CLEAN:
        out = tmp_path / f"clean_{len(_CLEAN)}"
        _export(model, out, sharded, force=False)
        _CLEAN[key] = state_of(out)
    return _CLEAN[key]


def test_crash_while_recovering_a_crashed_export(tmp_path, models):
    # a writer killed after its commit leaves staged files; a second writer killed at any point
    # of recovering them or of its own commit still leaves exactly one of the two exports
    base = tmp_path / "base"
    _export(models[0], base, True, force=False)
    with Inject(2, dead=True):  # config.json renamed in, then the process died
        with pytest.raises(Crash):
            _export(models[1], base, True)
    assert hidden(base), "expected staged files of the committed export"
    mid = state_of(base)
    assert same(mid, state_of_clean(tmp_path, models[1], True))
    final = state_of_clean(tmp_path, models[2], False)
    for k in range(1, 50):
        out = tmp_path / f"r{k}"
        shutil.copytree(base, out)
        with Inject(k, dead=True):
            try:
                _export(models[2], out, False)
                crashed = False
            except Crash:
                crashed = True
        got = state_of(out)
        assert same(got, mid) or same(got, final), f"crash at rename/remove {k}"
        if not crashed:
            assert same(got, final) and not hidden(out)
            break


def test_mixed_shards_never_load(tmp_path, models):
    a, b = tmp_path / "a", tmp_path / "b"
    _export(models[0], a, True, force=False)
    _export(models[1], b, True, force=False)
    shards = sorted(f for f in os.listdir(a) if f.startswith("model-"))
    assert len(shards) >= 3 and shards == sorted(f for f in os.listdir(b) if f.startswith("model-"))
    shutil.copy(b / shards[1], a / shards[1])  # every per-tensor CRC of the copy passes
    with pytest.raises(CheckpointError, match=rf"{shards[1]}: does not belong to this export"):
        load_quantized(a, make_net())
    for f in shards + [sio.INDEX]:  # all of b's files under a's config.json
        shutil.copy(b / f, a / f)
    with pytest.raises(CheckpointError, match=r"does not belong to this export"):
        load_quantized(a, make_net())


def test_single_file_from_another_export_never_loads(tmp_path, models):
    a, b = tmp_path / "a", tmp_path / "b"
    _export(models[0], a, False, force=False)
    _export(models[1], b, False, force=False)
    shutil.copy(b / sio.SINGLE, a / sio.SINGLE)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not belong to this export"):
        load_quantized(a, make_net())


def _drop_manifest(folder):
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("files", "generation"):
        cfg["qcompress"].pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("legacy", [False, True], ids=["bound", "legacy-export"])
@pytest.mark.parametrize(
    "bad", ["../outside/x.safetensors", "ABS", "sub/x.safetensors", "..", ".hidden.safetensors", "a\\..\\x.safetensors"]
)
def test_index_entries_cannot_escape_the_folder(tmp_path, models, legacy, bad):
    out = tmp_path / "exp" / "out"
    _export(models[0], out, True, force=False)
    outside = tmp_path / "exp" / "outside"
    outside.mkdir()
    index = json.loads((out / sio.INDEX).read_text())
    key, fn = next(iter(index["weight_map"].items()))
    # a valid shard outside the folder: opening it would load without complaint
    shutil.copy(out / fn, outside / "x.safetensors")
    bad = str(outside / "x.safetensors") if bad == "ABS" else bad
    index["weight_map"][key] = bad
    (out / sio.INDEX).write_text(json.dumps(index))
    if legacy:
        _drop_manifest(out)
    opened = []
    real_open = sio.safe_open

    def spy(path, *a, **kw):
        opened.append(os.path.abspath(path))
        return real_open(path, *a, **kw)

    sio.safe_open = spy
    try:
        with pytest.raises(CheckpointError) as err:
            load_quantized(out, make_net())
    finally:
        sio.safe_open = real_open
    msg = str(err.value)
    assert "index.json" in msg and repr(key) in msg and repr(bad) in msg and "plain file name" in msg
    assert all(os.path.dirname(p) == str(out) for p in opened), opened


def test_manifest_entries_cannot_escape_the_folder(tmp_path, models):
    out = tmp_path / "out"
    _export(models[0], out, False, force=False)
    cfg = json.loads((out / "config.json").read_text())
    digest = cfg["qcompress"]["files"].pop(sio.SINGLE)
    cfg["qcompress"]["files"]["../model.safetensors"] = digest
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: qcompress\.files names '\.\./model"):
        load_quantized(out, make_net())


def test_bit_flip_in_a_tensor_name_names_the_damaged_file(tmp_path, models):
    for legacy in (False, True):
        out = tmp_path / f"out{legacy}"
        _export(models[0], out, True, force=False)
        if legacy:
            _drop_manifest(out)
        shard = sorted(f for f in os.listdir(out) if f.startswith("model-"))[1]
        data = bytearray((out / shard).read_bytes())
        hlen = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + hlen]))
        name = next(k for k in header if k != "__metadata__")
        pos = data.index(json.dumps(name).encode(), 8)  # the first occurrence: the tensor entry
        data[pos + 1] ^= 0x01  # '2' -> '3', '0' -> '1': still valid JSON
        (out / shard).write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=rf"{shard}: corrupted header: tensor '.*' has no CRC32"):
            load_quantized(out, make_net())


def test_failed_write_leaves_the_old_export_and_no_temporaries(tmp_path, models, monkeypatch):
    out = tmp_path / "out"
    _export(models[0], out, True, force=False)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    real = sio.save_file
    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(sio, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        _export(models[1], out, True)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


# --- temporaries of dead and live writers ---------------------------------------------------------

_STALL = textwrap.dedent("""
    import time, torch, torch.nn as nn
    import qcompress
    from qcompress.export import export_quantized
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    cfg = qcompress.load_config({cfg!r})
    m = qcompress.init_compression(net, cfg).eval()
    from qcompress.export import commit
    def stall(*a):
        print("staged", flush=True)
        time.sleep(600)
    commit.commit_lock = stall        # every file staged; stop before the commit (and its folder lock)
    export_quantized(m, {out!r}, cfg, max_shard_size="2KB", force=True)
""")


def _stalled_writer(out):
    code = _STALL.format(cfg=CFG, out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    line = proc.stdout.readline()
    assert line.strip() == "staged", line
    return proc


def test_live_writer_temporaries_are_kept_dead_ones_removed(tmp_path, models):
    out = tmp_path / "out"
    _export(models[0], out, False, force=False)
    proc = _stalled_writer(out)
    try:
        theirs = hidden(out)
        assert any(f.endswith(".lock") for f in theirs) and any(f.endswith(".tmp") for f in theirs)
        _export(models[2], out, False)  # a second writer while the first lives
        assert set(theirs) <= set(hidden(out)), "a live writer's temporaries were deleted"
        assert same(state_of(out), state_of_clean(tmp_path, models[2], False))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert hidden(out) == theirs  # killed: everything it had is left over
    _export(models[0], out, False)  # the next write cleans it
    assert hidden(out) == []
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_in_process_live_writer_is_respected(tmp_path, models):
    from qcompress.export.commit import ExportWriter

    out = tmp_path / "out"
    _export(models[0], out, False, force=False)
    with ExportWriter(str(out)) as live:
        live.stage_text("notes.txt", "x")
        mine = hidden(out)
        _export(models[1], out, False)
        assert set(mine) <= set(hidden(out))
    assert hidden(out) == []  # not committed: it removed its own files


# --- file modes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exported_files_honour_the_umask(tmp_path, models, umask):
    old = os.umask(umask)
    try:
        for sharded in (False, True):
            out = tmp_path / f"out{sharded}"
            _export(models[0], out, sharded, force=False)
            for f in os.listdir(out):
                mode = os.stat(out / f).st_mode & 0o777
                assert mode == 0o666 & ~umask, (f, oct(mode))
            # a plain write is the oracle
            with open(tmp_path / f"plain{sharded}", "w") as fh:
                fh.write("x")
            assert os.stat(tmp_path / f"plain{sharded}").st_mode & 0o777 == 0o666 & ~umask
    finally:
        os.umask(old)


def test_full_disk_keeps_the_old_export(tmp_path):
    # a write that runs out of space (here: RLIMIT_FSIZE, EFBIG) was safetensors' own error
    # without the file; it is an OSError naming the file, the old export untouched, no temporaries
    out = tmp_path / "out"
    export_quantized(compressed(0), out)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    child = textwrap.dedent(f"""
        import resource, signal, torch.nn as nn, torch
        import qcompress
        from qcompress.export import export_quantized
        cfg = qcompress.load_config({CFG!r})
        torch.manual_seed(1)
        big = nn.Sequential(nn.Linear(128, 4096), nn.ReLU(), nn.Linear(4096, 32), nn.ReLU(), nn.Linear(32, 8))
        big = qcompress.init_compression(big, cfg).eval()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
        try:
            export_quantized(big, {str(out)!r}, cfg, force=True)
        except OSError as e:
            print("OSError:", e)
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=child_env())
    assert "OSError:" in run.stdout and "cannot write the export file" in run.stdout, run.stdout + run.stderr
    assert str(out) in run.stdout
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    load_quantized(out, make_net())


def test_two_writers_committing_at_once_leave_the_last_export(tmp_path, monkeypatch):
    # two exports into one folder (every rank exporting, say): the first writer's roll-forward
    # ran after the second had committed, leaving its files under the second's config.json, a
    # folder that loaded as neither. Commits now take turns; the last one is the export.
    import threading

    out = tmp_path / "out"
    ref = tmp_path / "ref"
    export_quantized(compressed(2), ref)
    want = state_of(ref)
    first_rolls = threading.Event()
    real = atomic.fs_replace

    def slow_first(src, dst):
        if threading.current_thread().name == "first" and not dst.endswith(sio.CONFIG):
            first_rolls.set()  # the first writer has renamed its config.json in
            time.sleep(1.0)  # ... and is slow to rename its files
        real(src, dst)

    monkeypatch.setattr(atomic, "fs_replace", slow_first)
    errors = []

    def run(seed):
        try:
            export_quantized(compressed(seed), out, force=True)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    os.makedirs(out)
    first = threading.Thread(target=run, args=(1,), name="first")
    first.start()
    assert first_rolls.wait(30)
    run(2)  # the second writer commits while the first rolls forward
    first.join(60)
    assert not errors and not first.is_alive()
    assert same(state_of(out), want)
    assert hidden(out) == []
