"""Optimizer state on NVMe: `offload_optimizer: {device: nvme, nvme_path, ...}` at ZeRO
stages 1-3. Oracles: the same training with the state in memory (CPU offload at stages 2/3, none at
stage 1), bit for bit; the process's resident memory from /proc; an uninterrupted run for resume
after a kill; the closed-form memory estimate."""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress.engine import estimate_memory, initialize
from qcompress.engine import nvme as N

from tests.helpers.child_env import child_env
from tests.helpers.dist_utils import run_ranks

IN, HID, OUT = 24, 48, 6


def mlp(seed=0, width=HID, depth=3):
    torch.manual_seed(seed)
    layers, d = [], IN
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, OUT))


def cfg(stage, device="none", path=None, world=1, gas=2, chunk=1500, buffers=2, opt=None, **offload):
    """chunk 1500 elements: the 3-layer MLP's state streams in 5 chunks through 2 buffers."""
    off = {"device": device, "buffer_count": buffers, **offload}
    if path is not None:
        off["nvme_path"] = str(path)
    return {
        "train_batch_size": 4 * gas * world,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": opt or {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 3},
        },
        "zero_optimization": {"stage": stage, "offload_optimizer": off, "sub_group_size": chunk},
    }


def reference(stage):
    """The same run with the state in memory: CPU offload (FSDP2's policy) at stages 2/3."""
    return "cpu" if stage >= 2 else "none"


def train(engine, first, last, rank=0, world=1):
    gas = engine.gradient_accumulation_steps
    losses = []
    for step in range(first, last):
        for m in range(gas):
            g = torch.Generator().manual_seed(1000 * step + 10 * (rank * gas + m))
            x, y = torch.randn(4, IN, generator=g), torch.randint(0, OUT, (4,), generator=g)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def full(engine):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- training matches the state in memory -----------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_matches_cpu_offload_bit_for_bit(tmp_path, stage):
    ref = initialize(mlp(), cfg(stage, reference(stage)))
    ref_losses = train(ref, 0, 5)
    eng = initialize(mlp(), cfg(stage, "nvme", tmp_path))
    losses = train(eng, 0, 5)
    assert losses == ref_losses and same(full(eng), full(ref))
    nv = eng.nvme
    assert len(nv.chunks) == 5 and nv.stats["steps"] == 5
    assert nv.stats["bytes_read"] > 0 and nv.stats["bytes_written"] > nv.stats["bytes_read"]
    # on disk: Adam's two fp32 moments per parameter (64-byte aligned slots), nothing in memory
    n = sum(p.numel() for p in mlp().parameters())
    assert 8 * n <= nv.disk_bytes() <= 8 * n + 64 * 2 * 8
    local = getattr(eng.optimizer, "optim", eng.optimizer)
    assert all(set(s) == {"step"} for s in local.state.values())
    rep = eng.memory_report()
    assert rep["nvme"] == nv.disk_bytes() and rep["optimizer_state"] == 0 and rep["offloaded"] > 0


def test_sgd_with_momentum_and_lamb_stream_too(tmp_path):
    # (Lamb at stage 1: the engine's Lamb does not run under FSDP2's DTensor parameters)
    for stage, opt in (
        (2, {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}),
        (1, {"type": "Lamb", "params": {"lr": 0.01}}),
    ):
        ref = initialize(mlp(), cfg(stage, reference(stage), opt=opt))
        train(ref, 0, 3)
        eng = initialize(mlp(), cfg(stage, "nvme", tmp_path, opt=opt))
        train(eng, 0, 3)
        assert same(full(eng), full(ref)), opt["type"]
        assert eng.nvme.disk_bytes() > 0


def test_reads_of_the_next_chunk_overlap_the_update(tmp_path):
    """With pipeline_read (our default) chunk i+1's read is issued before chunk i's update ends;
    with pipeline_read/pipeline_write false everything is sequential."""
    for pipelined in (True, False):
        eng = initialize(mlp(), cfg(1, "nvme", tmp_path, buffers=3, pipeline_read=pipelined, pipeline_write=pipelined))
        train(eng, 0, 1)  # the first step lays the files out
        events = []
        nv = eng.nvme
        real_read, real_update = nv._read, nv._update

        issued = threading.Event()  # read 1 was issued: set by the I/O thread

        def read(chunk, buf, real=real_read):
            events.append(("read", chunk.index))
            if chunk.index == 1:
                issued.set()
            real(chunk, buf)

        def update(chunk, buf, real=real_update):
            events.append(("update", chunk.index))
            if pipelined and chunk.index == 0:
                # On a loaded machine the I/O thread may not be scheduled before a short update
                # ends; a pipelined read is issued without waiting for it, so wait (bounded) for it.
                issued.wait(timeout=30)
            real(chunk, buf)
            events.append(("updated", chunk.index))

        nv._read, nv._update = read, update
        train(eng, 1, 2)
        reads_before = [e for e in events[: events.index(("updated", 0))] if e[0] == "read"]
        if pipelined:
            assert ("read", 1) in reads_before, events
        else:
            assert reads_before == [("read", 0)], events


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_and_resume_are_bit_exact(tmp_path, stage):
    ck, swap = tmp_path / "ck", tmp_path / "swap"
    eng = initialize(mlp(), cfg(stage, "nvme", swap))
    train(eng, 0, 2)
    eng.save_checkpoint(str(ck))
    tail = train(eng, 2, 5)
    want = full(eng)
    resumed = initialize(mlp(seed=9), cfg(stage, "nvme", swap))
    resumed.load_checkpoint(str(ck))
    assert train(resumed, 2, 5) == tail and same(full(resumed), want)
    # the checkpoint is the usual format: it loads into an engine with the state in memory
    plain = initialize(mlp(seed=9), cfg(stage, reference(stage)))
    plain.load_checkpoint(str(ck))
    assert train(plain, 2, 5) == tail and same(full(plain), want)


# --- ranks (2 spawned gloo ranks): ZeRO-1's optimizer shards and FSDP2 shards ------------------------
def run_two_ranks(rank, world, root):
    out = {}
    for stage in (1, 3):
        ref = initialize(mlp(), cfg(stage, reference(stage), world=world))
        train(ref, 0, 3, rank, world)
        eng = initialize(mlp(), cfg(stage, "nvme", os.path.join(root, "swap"), world=world))
        train(eng, 0, 2, rank, world)
        eng.save_checkpoint(os.path.join(root, f"ck{stage}"))
        train(eng, 2, 3, rank, world)
        again = initialize(mlp(seed=3), cfg(stage, "nvme", os.path.join(root, "swap"), world=world))
        again.load_checkpoint(os.path.join(root, f"ck{stage}"))
        train(again, 2, 3, rank, world)
        out[stage] = {"ref": full(ref), "nvme": full(eng), "resumed": full(again), "disk": eng.nvme.disk_bytes()}
    return out


def test_two_ranks_match_and_resume(tmp_path):
    results = run_ranks(run_two_ranks, 2, str(tmp_path), timeout=300)
    n = sum(p.numel() for p in mlp().parameters())
    for stage in (1, 3):
        for r in results:
            assert same(r[stage]["nvme"], r[stage]["ref"]), stage
            assert same(r[stage]["resumed"], r[stage]["ref"]), stage
        # each rank keeps the state of its shard only
        assert sum(r[stage]["disk"] for r in results) < 8 * n + 2 * 64 * 16
        assert all(r[stage]["disk"] < 8 * n * 0.75 for r in results)


# --- resident memory -------------------------------------------------------------------------------
_MEMORY = textwrap.dedent("""
    import json
    import torch, torch.nn as nn, torch.nn.functional as F
    from qcompress.engine import initialize
    torch.set_num_threads(1)

    def status():
        d = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {{k: int(d[k].split()[0]) * 1024 for k in ("VmHWM", "RssAnon", "RssFile", "RssShmem")}}

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])     # 4.2M parameters
    off = {offload}
    cfg = {{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4}}}},
           "zero_optimization": {{"stage": 1, "offload_optimizer": off, "sub_group_size": 300000}}}}
    engine = initialize(model, cfg)
    x = torch.randn(8, 512)
    before = status()["RssAnon"]
    peaks, after = [], []
    for step in range(4):
        loss = engine(x).square().mean()
        engine.backward(loss)
        open("/proc/self/clear_refs", "w").write("5")    # reset the peak (VmHWM)
        engine.step()                                    # frees the gradients at its end
        s = status()
        # anonymous memory only: shared-library pages that first calls load are not ours
        peaks.append(s["VmHWM"] - s["RssFile"] - s["RssShmem"] - before)
        after.append(s["RssAnon"] - before)
    print(json.dumps({{"peaks": peaks, "after": after,
                       "params": sum(p.numel() for p in model.parameters())}}))
""")


def _measure(offload):
    code = _MEMORY.format(offload=offload)
    # a fixed mmap threshold: glibc returns every freed gradient to the system at once (its
    # adaptive threshold would keep freed 1 MB blocks in the heap and blur the measurement)
    env = child_env(MALLOC_MMAP_THRESHOLD_="131072")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_resident_memory_stays_under_the_buffer_bound(tmp_path):
    """4.2M parameters, Adam: 33.6 MB of state. Streamed through 2 buffers of one 512x512 layer
    (weight + bias, 2.1 MB of state each) the process holds at most the bound (plus the gradients
    during the step and Adam's per-tensor temporaries), in memory the state stays resident."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident size")
    nv = _measure({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    mem = _measure({"device": "none"})
    state = 8 * nv["params"]
    grads = 4 * nv["params"]
    chunk_state = 8 * (512 * 512 + 512)
    bound = 2 * chunk_state
    slack = 3 * 2**20 + 4 * (512 * 512 + 512)  # allocator noise + one Adam temporary
    # steady state (steps 2-4): between steps only the buffers remain
    assert max(nv["after"][1:]) <= bound + slack, nv
    assert min(mem["after"][1:]) >= state - slack, mem
    # within a step: the gradients (freed at its end) plus at most the buffers
    assert max(nv["peaks"][1:]) <= grads + bound + slack, nv
    assert min(mem["peaks"][1:]) >= state - slack, mem


# --- crashes, bad paths, cleanup -------------------------------------------------------------------
_KILLED = textwrap.dedent("""
    import os, signal
    from tests.engine import test_nvme_offload as T
    from qcompress import atomic
    from qcompress.engine import initialize
    engine = initialize(T.mlp(), T.cfg(1, "nvme", {swap!r}))
    T.train(engine, 0, 2)
    engine.save_checkpoint({ck!r}, tag="step2")
    T.train(engine, 2, 4)
    print(engine.nvme.folder, flush=True)
    atomic.fs_replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)   # dies at the commit
    engine.save_checkpoint({ck!r}, tag="step4")
""")


def test_kill_mid_save_leaves_the_previous_checkpoint_and_no_swap_files(tmp_path):
    ck, swap = tmp_path / "ck", tmp_path / "swap"
    code = _KILLED.format(swap=str(swap), ck=str(ck))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env())
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    dead_folder = res.stdout.strip().splitlines()[-1]
    assert os.path.isdir(dead_folder) and os.listdir(dead_folder)  # a kill cleans nothing
    assert (ck / "latest").read_text() == "step2" and (ck / ".step4.tmp").is_dir()
    # the next run on the same nvme_path removes the dead run's files; `latest` resumes exactly
    resumed = initialize(mlp(seed=5), cfg(1, "nvme", swap))
    assert not os.path.exists(dead_folder)
    resumed.load_checkpoint(str(ck))
    train(resumed, 2, 4)
    oracle = initialize(mlp(), cfg(1, "none"))
    train(oracle, 0, 4)
    assert same(full(resumed), full(oracle))


def test_swap_files_are_removed_at_exit(tmp_path):
    eng = initialize(mlp(), cfg(2, "nvme", tmp_path))
    train(eng, 0, 1)
    folder = eng.nvme.folder
    assert len([f for f in os.listdir(folder) if f.startswith("chunk")]) == 5
    del eng
    gc.collect()
    assert not os.path.exists(folder)
    code = textwrap.dedent(f"""
        from tests.engine import test_nvme_offload as T
        from qcompress.engine import initialize
        engine = initialize(T.mlp(), T.cfg(1, "nvme", {str(tmp_path)!r}))
        T.train(engine, 0, 1)
        print(engine.nvme.folder)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert not os.path.exists(res.stdout.strip().splitlines()[-1])  # interpreter exit removed it
    assert os.listdir(tmp_path) == []


def test_unwritable_or_missing_path_is_a_config_error_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(qc.ConfigError, match="cannot create") as err:
        initialize(mlp(), cfg(1, "nvme", blocker / "swap"))
    assert err.value.path == N.KEY and str(blocker / "swap") in str(err.value)
    with pytest.raises(qc.ConfigError, match="is not a folder"):
        initialize(mlp(), cfg(1, "nvme", blocker))
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(qc.ConfigError, match="not writable"):
            initialize(mlp(), cfg(1, "nvme", ro))
    with pytest.raises(qc.ConfigError, match="required") as err:
        qc.load_config(cfg(1, "nvme"))
    assert err.value.path == "zero_optimization.offload_optimizer.nvme_path"


def test_full_disk_is_a_config_error_before_training(tmp_path, monkeypatch):
    real = N.shutil.disk_usage

    def nearly_full(path):
        u = real(path)
        return type(u)(u.total, u.total - 1000, 1000)

    monkeypatch.setattr(N.shutil, "disk_usage", nearly_full)
    with pytest.raises(qc.ConfigError, match="free") as err:
        initialize(mlp(), cfg(1, "nvme", tmp_path))
    assert err.value.path == N.KEY
    n = sum(p.numel() for p in mlp().parameters())
    assert f"({8 * n} bytes)" in str(err.value) and "(1000 bytes) free" in str(err.value)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_disk_filling_up_later_names_the_file(tmp_path, monkeypatch):
    eng = initialize(mlp(), cfg(1, "nvme", tmp_path))

    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(N.os, "posix_fallocate", enospc)
    with pytest.raises(OSError, match="cannot reserve .*/chunk00000.bin: No space left on device"):
        train(eng, 0, 1)


def test_unsupported_combinations_are_config_errors(tmp_path):
    doc = cfg(3, "none")
    doc["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(qc.ConfigError, match="not supported yet.*offload_param.device: cpu") as err:
        qc.load_config(doc)
    assert err.value.path == "zero_optimization.offload_param.device"
    with pytest.raises(qc.ConfigError, match="stage 1, 2 or 3") as err:
        qc.load_config(cfg(0, "nvme", tmp_path))
    assert err.value.path == "zero_optimization.stage"
    onebit = cfg(1, "nvme", tmp_path, opt={"type": "OneBitAdam", "params": {"lr": 1e-3}})
    with pytest.raises(qc.ConfigError, match="OneBitAdam") as err:
        initialize(mlp(), onebit)
    assert err.value.path == "zero_optimization.offload_optimizer.device"


def test_estimate_memory_knows_the_nvme_placement():
    P, W = 10_000, 2
    shard = 5_000
    s1 = estimate_memory(P, W, 1, "nvme", sub_group_size=1_000, buffer_count=3)
    assert s1 == {
        "parameters": 4 * P,
        "gradients": 4 * P,
        "optimizer_state": 0,
        "total": 8 * P,
        "offloaded": 3 * 1_000 * 8,
        "nvme": 8 * shard,
    }
    s3 = estimate_memory(P, W, 3, "nvme", sub_group_size=1_000, buffer_count=3)
    cpu3 = estimate_memory(P, W, 3, "cpu")
    assert s3["total"] == cpu3["total"] == 0
    assert s3["offloaded"] == cpu3["offloaded"] - 8 * shard + 3 * 1_000 * 8 and s3["nvme"] == 8 * shard
    # DeepSpeed's default sub_group_size (1e9): one chunk, one buffer, no saving in memory
    assert estimate_memory(P, W, 2, "nvme")["offloaded"] == estimate_memory(P, W, 2, "cpu")["offloaded"]
    assert estimate_memory(P, W, 2, True) == {**cpu3, "parameters": 4 * P, "total": 4 * P}
    with pytest.raises(qc.ConfigError, match="stage 1, 2 or 3"):
        estimate_memory(P, W, 0, "nvme")


def test_a_cleaner_running_while_the_swap_folder_is_set_up_leaves_it(tmp_path, monkeypatch):
    """Ranks on one host share nvme_path, and each one's set-up removes the swap folders of dead
    runs (those whose lock it can take; a missing lock file counts as dead). Another rank's cleaner
    running between the folder's mkdir and its lock file deleted a live rank's folder: 'not
    writable: No such file or directory' (once in a full CI run, at 2 ranks). Here the cleaner runs at
    exactly that moment."""
    from qcompress import atomic
    from qcompress.engine import nvme

    real = atomic.OwnerLock.create

    def create_after_a_cleaner(cls, path):
        nvme.remove_stale_folders(str(tmp_path))
        return real(path)

    monkeypatch.setattr(atomic.OwnerLock, "create", classmethod(create_after_a_cleaner))
    folder, lock = nvme.make_swap_folder(str(tmp_path), 1)
    monkeypatch.undo()
    try:
        assert os.path.isdir(folder) and os.path.basename(folder).startswith(nvme._PREFIX)
        assert os.path.isfile(lock.path) and os.path.dirname(lock.path) == folder
        assert nvme.remove_stale_folders(str(tmp_path)) == []  # its lock is held: kept
        assert os.listdir(tmp_path) == [os.path.basename(folder)]  # no set-up folder left behind
    finally:
        lock.release(unlink=False)
    assert nvme.remove_stale_folders(str(tmp_path)) == [folder]  # once released, it is stale
