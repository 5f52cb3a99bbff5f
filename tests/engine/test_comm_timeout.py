"""A stalled rank ends the job instead of hanging it: two gloo ranks launched as torchrun would (the engine
creates the process group with comm_timeout_s); rank 1 stops itself with SIGSTOP after a
step; rank 0 must fail within the timeout with an error naming the collective and the timeout."""

import socket
import subprocess
import sys
import textwrap
import time

from tests.helpers.child_env import child_env

RANK = textwrap.dedent("""
    import os, signal, time
    import torch, torch.nn as nn
    torch.set_num_threads(1)
    import qcompress as qc
    cfg = {{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
           "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}}, "comm_timeout_s": {timeout}}}
    torch.manual_seed(0)
    engine = qc.initialize(nn.Linear(8, 2), cfg)
    rank = engine.rank
    def step():
        loss = engine(torch.randn(4, 8)).square().mean()
        engine.backward(loss)
        engine.step()
    step()
    step()         # DDP broadcasts its rebuilt bucket order in the 2nd forward: past that, the
    print("stepped", flush=True)   # next collective is the backward's gradient all-reduce
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)      # stalled: alive, never answers
    t0 = time.monotonic()
    try:
        step()
        print("NO ERROR", flush=True)
    except Exception as exc:
        print(f"RAISED after {{time.monotonic() - t0:.1f}} s: {{type(exc).__name__}}: {{exc}}", flush=True)
""")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stalled_rank_ends_the_job_with_a_named_timeout():
    timeout = 3
    code = RANK.format(timeout=timeout)
    port = _port()
    procs = []
    for rank in (0, 1):
        env = child_env(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    t0 = time.monotonic()
    try:
        out, _ = procs[0].communicate(timeout=50)  # bounded: never a hung test
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait(timeout=30)
    assert "stepped" in out, out[-3000:]
    line = next((ln for ln in out.splitlines() if ln.startswith(("RAISED", "NO ERROR"))), out[-3000:])
    assert line.startswith("RAISED"), line
    assert "CommTimeoutError" in line and "engine.backward" in line and "all-reduce" in line, line
    assert f"comm_timeout_s={timeout} s" in line, line
    waited = float(line.split()[2])
    assert timeout - 0.5 <= waited < timeout + 15, line
    assert time.monotonic() - t0 < 50
