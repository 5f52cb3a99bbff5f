"""qcompress.comm on gloo with 2 and 4 spawned ranks, checked against simulations written here.

The simulations follow the formulas (RMS scale in float64 rounded to float32, sign with zero
positive, server average sum_j sign_j * (s_j / P) in rank order, server error, recompression) on
plain sign tensors: they never pack bits and never call qcompress code.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist_utils import run_ranks  # noqa: E402

import qcompress.comm as qcomm  # noqa: E402

TIMEOUT = 150  # one spawned job per world size runs every multi-rank check


# ---------------------------------------------------------------- inputs and simulations


def make_input(seed: int, rank: int, call: int, shape=(17, 59)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + call)
    return torch.randn(shape, generator=g) * (1.0 + rank)


def _rms(v: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(v.to(torch.float64).square().sum() / v.numel()).to(torch.float32)


def _sign(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0, 1.0, -1.0)


class OneBitSim:
    """The two-phase 1-bit algorithm for P simulated ranks, from the formulas."""

    def __init__(self, p: int, n: int):
        self.p, self.n = p, n
        self.padded = math.ceil(n / (8 * p)) * 8 * p
        self.c = self.padded // p
        self.ew = [torch.zeros(self.padded) for _ in range(p)]
        self.es = [torch.zeros(self.c) for _ in range(p)]

    def step(self, xs):
        p, c = self.p, self.c
        signs, scales = [], []
        for r in range(p):
            y = torch.zeros(self.padded)
            y[: self.n] = xs[r].reshape(-1).float()
            y = y + self.ew[r]
            s = _rms(y)
            sg = _sign(y)
            self.ew[r] = y - s * sg
            signs.append(sg)
            scales.append(s)
        out = torch.empty(self.padded)
        for r in range(p):
            z = torch.zeros(c)
            for j in range(p):
                z = z + signs[j][r * c : (r + 1) * c] * (scales[j] / float(p))
            z = z + self.es[r]
            t = _rms(z)
            sg = _sign(z)
            self.es[r] = z - t * sg
            out[r * c : (r + 1) * c] = sg * t
        return out[: self.n]


class Int8Sim:
    """The two-phase algorithm with symmetric int8 per chunk (scale = absmax / 127, round half even)."""

    def __init__(self, p: int, n: int):
        self.p, self.n = p, n
        self.padded = math.ceil(n / p) * p
        self.c = self.padded // p
        self.ew = [torch.zeros(self.padded) for _ in range(p)]
        self.es = [torch.zeros(self.c) for _ in range(p)]

    @staticmethod
    def _q(y):
        s = y.abs().max() / 127.0
        q = torch.clamp(torch.round(y / s), -127, 127) if s > 0 else torch.zeros_like(y)
        return q, s

    def step(self, xs):
        p, c = self.p, self.c
        parts = []  # parts[r][k] = decoded chunk k of rank r
        for r in range(p):
            y = torch.zeros(self.padded)
            y[: self.n] = xs[r].reshape(-1).float()
            y = y + self.ew[r]
            dec = []
            for k in range(p):
                q, s = self._q(y[k * c : (k + 1) * c])
                dec.append(q * s)
            self.ew[r] = y - torch.cat(dec)
            parts.append(dec)
        out = torch.empty(self.padded)
        for r in range(p):
            acc = torch.zeros(c)
            for j in range(p):
                acc = acc + parts[j][r]
            z = acc / float(p) + self.es[r]
            q, s = self._q(z)
            self.es[r] = z - q * s
            out[r * c : (r + 1) * c] = q * s
        return out[: self.n]


# ---------------------------------------------------------------- rank functions (run in children)


def _rank_calls(rank, world, seed, calls, compressor):
    state = qcomm.OneBitState()
    outs, sent = [], []
    for k in range(calls):
        x = make_input(seed, rank, k)
        before = qcomm.stats()["bytes_sent"]
        y = qcomm.compressed_allreduce(x, state, compressor=compressor)
        sent.append(qcomm.stats()["bytes_sent"] - before)
        assert y.shape == x.shape and y.dtype == x.dtype
        outs.append(y)
    return {"outs": outs, "sent": sent, "stats": qcomm.stats(), "errors": state.state_dict()}


def _rank_converge(rank, world, iters, n):
    x = make_input(7, rank, 0, shape=(n,))
    state = qcomm.OneBitState()
    acc = torch.zeros(n, dtype=torch.float64)
    for _ in range(iters):
        acc += qcomm.compressed_allreduce(x, state).double()
    return {"x": x, "avg": (acc / iters).float()}


def _rank_bytes(rank, world, n):
    state = qcomm.OneBitState()
    x = make_input(3, rank, 0, shape=(n,))
    qcomm.reset_stats()
    qcomm.compressed_allreduce(x, state)
    return qcomm.stats()


def _rank_hierarchy(rank, world, seed, calls):
    import qcompress.comm.hierarchy as hmod

    explicit = qcomm.Hierarchy([[0, 1], [2, 3]])
    st_explicit, st_auto, st_flat = qcomm.OneBitState(), qcomm.OneBitState(), qcomm.OneBitState()
    # Simulated hosts for the automatic detection: ranks 0,1 on "hostA", 2,3 on "hostB".
    real_gethostname = hmod.socket.gethostname
    hmod.socket.gethostname = lambda: "hostA" if rank < 2 else "hostB"
    hmod._AUTO_CACHE.clear()  # earlier calls in this process detected one host
    out = {"explicit": [], "auto": [], "flat": []}
    try:
        for k in range(calls):
            x = make_input(seed, rank, k)
            out["explicit"].append(qcomm.compressed_allreduce(x, st_explicit, hierarchy=explicit))
            out["auto"].append(qcomm.compressed_allreduce(x, st_auto, hierarchy="auto"))
            out["flat"].append(qcomm.compressed_allreduce(x, st_flat, hierarchy="flat"))
    finally:
        hmod.socket.gethostname = real_gethostname
        hmod._AUTO_CACHE.clear()
    out["leader_has_errors"] = st_explicit.initialized
    return out


def dyadic_input(rank: int, call: int) -> torch.Tensor:
    """Multiples of 1/64: sums of a few of them, and their quarter, are exact in float32."""
    return torch.round(make_input(21, rank, call) * 64) / 64


def _rank_node_single(rank, world):
    """hierarchy="node" on this single host, and an explicit one-node Hierarchy: nothing crosses nodes."""
    import qcompress.comm.hierarchy as hmod

    hmod._AUTO_CACHE.clear()  # the first "node" call detects the hosts (counted below)
    one_node = qcomm.Hierarchy([list(range(world))])
    states = {"node": qcomm.OneBitState(), "explicit": qcomm.OneBitState()}
    out = {"node": [], "explicit": [], "bytes": []}
    for k in range(2):
        x = dyadic_input(rank, k)
        before = qcomm.stats()
        out["node"].append(qcomm.compressed_allreduce(x, states["node"], hierarchy="node"))
        after = qcomm.stats()
        out["bytes"].append(
            (after["bytes_sent"] - before["bytes_sent"], after["bytes_received"] - before["bytes_received"])
        )
        out["explicit"].append(qcomm.compressed_allreduce(x, states["explicit"], hierarchy=one_node))
    out["errors_kept"] = [st.initialized for st in states.values()]
    return out


def _rank_buckets(rank, world, bucket_size):
    shapes = [(5, 7), (300,), (2, 3, 4), (1000,), (1,)]
    tensors = [make_input(11, rank, i, shape=s) for i, s in enumerate(shapes)]
    bc = qcomm.BucketedCompressor(bucket_size=bucket_size)
    calls_before = qcomm.stats()["bytes_sent"]
    first = bc.allreduce(tensors)
    n_buckets = len(bc.states)
    sd = bc.state_dict()
    second = bc.allreduce(tensors)
    resumed = qcomm.BucketedCompressor(bucket_size=bucket_size)
    resumed.load_state_dict(sd)
    second_resumed = resumed.allreduce(tensors)
    return {
        "inputs": tensors,
        "first": first,
        "second": second,
        "second_resumed": second_resumed,
        "buckets": n_buckets,
        "bytes": qcomm.stats()["bytes_sent"] - calls_before,
    }


class ExactCompressor(qcomm.Compressor):
    """A lossless test compressor: the raw float32 bytes (error stays zero)."""

    name = "exact-test"
    elem_multiple = 1

    def payload_nbytes(self, numel):
        return 4 * numel

    def compress(self, x, error, chunks):
        y = x.float() + error.float()
        return y.reshape(chunks, -1).contiguous().view(torch.uint8), y - y

    def decompress(self, payload, numel):
        return payload.contiguous().view(torch.float32).reshape(payload.shape[0], numel)


def _rank_custom(rank, world):
    qcomm.register_compressor("exact-test", ExactCompressor)
    x = make_input(5, rank, 0)
    return {"x": x, "y": qcomm.compressed_allreduce(x, qcomm.OneBitState(), compressor="exact-test")}


def _rank_ddp_hook(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    ddp = DDP(model)
    hook_state = qcomm.OneBitDDPHookState()
    ddp.register_comm_hook(hook_state, qcomm.onebit_ddp_hook)
    g = torch.Generator().manual_seed(100 + rank)
    x, t = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)

    def grads_of(module):
        module.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(module(x), t).backward()
        return [p.grad.clone() for p in module.parameters()]

    local = grads_of(model)  # the plain module: no DDP reduction
    result = {"local": local}
    for stage in ("warmup", "warmup2", "compression"):
        hook_state.compression_stage = stage == "compression"
        before = qcomm.stats()
        result[stage] = grads_of(ddp)
        after = qcomm.stats()
        result[stage + "_bytes"] = after["bytes_sent"] - before["bytes_sent"]
    result["numel"] = sum(p.numel() for p in model.parameters())
    dist.barrier()
    return result


def _rank_nonfinite(rank, world):
    """Rank 1 sends NaN on the second call: every rank must raise, keep its errors, and go on."""
    from qcompress import NonFiniteError

    state = qcomm.OneBitState()
    qcomm.compressed_allreduce(make_input(6, rank, 0), state)
    before = state.state_dict()
    bad = make_input(6, rank, 1)
    if rank == 1:
        bad[0, 3] = float("nan")
    try:
        qcomm.compressed_allreduce(bad, state)
        raised = False
    except NonFiniteError:
        raised = True
    kept = all(torch.equal(before[k], v) for k, v in state.state_dict().items())
    after = qcomm.compressed_allreduce(make_input(6, rank, 2), state)
    # Buckets: NaN only in the second of two buckets; the first bucket's errors must not advance.
    bc = qcomm.BucketedCompressor(bucket_size=600)
    bc.allreduce([make_input(6, rank, 3)])
    bucket_before = bc.state_dict()
    bad2 = make_input(6, rank, 4)
    if rank == 1:
        bad2.view(-1)[900] = float("inf")  # in the second bucket
    try:
        bc.allreduce([bad2])
        bucket_raised = False
    except NonFiniteError:
        bucket_raised = True
    bucket_kept = all(torch.equal(bucket_before[k], v) for k, v in bc.state_dict().items())
    return {"raised": raised, "kept": kept, "after": after, "bucket_raised": bucket_raised, "bucket_kept": bucket_kept}


def _rank_many(rank, world):
    """flat_compressed_allreduce_many (the per-tensor buckets' path) on buffers of 5, 64 and 131
    elements over 3 calls, beside one flat_compressed_allreduce per buffer with its own state; then
    a NaN in the last buffer on rank 1: every rank reports non-finite and keeps all its errors."""
    from qcompress.comm.allreduce import flat_compressed_allreduce, flat_compressed_allreduce_many
    from qcompress.comm.compressors import get_compressor

    comp = get_compressor("onebit")
    sizes = (5, 64, 131)
    many, single = [qcomm.OneBitState() for _ in sizes], [qcomm.OneBitState() for _ in sizes]
    out = {"many": [], "single": [], "bytes_many": [], "bytes_single": []}
    for call in range(3):
        xs = [make_input(40 + i, rank, call, shape=(n,)) for i, n in enumerate(sizes)]
        before = qcomm.stats()["bytes_sent"]
        got, finite = flat_compressed_allreduce_many(xs, many, None, comp)
        out["bytes_many"].append(qcomm.stats()["bytes_sent"] - before)
        assert finite
        out["many"].append(got)
        before = qcomm.stats()["bytes_sent"]
        out["single"].append([flat_compressed_allreduce(x, st, None, comp)[0] for x, st in zip(xs, single)])
        out["bytes_single"].append(qcomm.stats()["bytes_sent"] - before)
    kept = [st.state_dict() for st in many]
    bad = [make_input(50 + i, rank, 9, shape=(n,)) for i, n in enumerate(sizes)]
    if rank == 1:
        bad[2][7] = float("nan")
    _, out["finite_with_nan"] = flat_compressed_allreduce_many(bad, many, None, comp)
    out["kept"] = all(torch.equal(a[k], st.state_dict()[k]) for a, st in zip(kept, many) for k in a)
    return out


def _rank_subgroup(rank, world):
    """Two independent pairs {0, 2} and {1, 3}, each averaging over its own subgroup."""
    import torch.distributed as dist

    mine, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    state = qcomm.OneBitState()
    return [qcomm.compressed_allreduce(make_input(12, rank, k), state, mine) for k in range(3)]


def _rank_all(rank, world):
    """Everything the multi-rank tests check, in one spawned job per world size (spawning is the
    expensive part on a 2-core machine)."""
    out = {
        "onebit": _rank_calls(rank, world, 1, 12, "onebit"),
        "int8": _rank_calls(rank, world, 4, 4, "int8"),
        "converge": _rank_converge(rank, world, 800, 1024),
        "bytes": _rank_bytes(rank, world, 1 << 16),
    }
    if world == 2:
        out["buckets"] = _rank_buckets(rank, world, 700)
        out["custom"] = _rank_custom(rank, world)
        out["ddp"] = _rank_ddp_hook(rank, world)
        out["nonfinite"] = _rank_nonfinite(rank, world)
    out["many"] = _rank_many(rank, world)
    if world == 4:
        out["subgroup"] = _rank_subgroup(rank, world)
        out["node_single"] = _rank_node_single(rank, world)
        out["hierarchy"] = _rank_hierarchy(rank, world, 3, 4)  # last: it fakes hostnames
    return out


_RESULTS: dict = {}


def results(world: int, part: str) -> list:
    """Per-rank results of `part` from the (cached) spawned run at `world` ranks."""
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_rank_all, world, timeout=TIMEOUT)
    return [r[part] for r in _RESULTS[world]]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_onebit_matches_simulation_bit_for_bit(world):
    calls = 12
    res = results(world, "onebit")
    sim = OneBitSim(world, 17 * 59)
    for k in range(calls):
        expect = sim.step([make_input(1, r, k) for r in range(world)]).reshape(17, 59)
        for r in range(world):
            assert torch.equal(res[r]["outs"][k], expect), f"call {k}, rank {r} differs from the simulation"
            assert torch.equal(res[r]["outs"][k], res[0]["outs"][k])
    # The ranks' errors are the simulation's errors, bit for bit.
    for r in range(world):
        assert torch.equal(res[r]["errors"]["worker_error"], sim.ew[r])
        assert torch.equal(res[r]["errors"]["server_error"], sim.es[r])
    # Exact byte count per call: two collectives, (P-1) payload rows of C/8 + 4 bytes each; the first
    # call (hierarchy "auto") also detects the hosts: one all-gather of a 32-byte digest per rank.
    row = sim.c // 8 + 4
    hosts = (world - 1) * 32
    assert res[0]["sent"] == [2 * (world - 1) * row + hosts] + [2 * (world - 1) * row] * (calls - 1)
    assert res[0]["stats"]["bytes_received"] == res[0]["stats"]["bytes_sent"]


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_telescopes(world):
    """sum_k out_k = sum_k mean_r x_r,k - mean_r e_w,r - e_s (all errors start at zero)."""
    calls = 12
    res = results(world, "onebit")
    n = 17 * 59
    sum_out = torch.stack([o.reshape(-1).double() for o in res[0]["outs"]]).sum(0)
    sum_in = sum(make_input(1, r, k).reshape(-1).double() for r in range(world) for k in range(calls)) / world
    ew = torch.stack([res[r]["errors"]["worker_error"].double() for r in range(world)]).mean(0)
    es = torch.cat([res[r]["errors"]["server_error"].double() for r in range(world)])
    residual = sum_out - (sum_in - ew[:n] - es[:n])
    assert residual.abs().max() < 1e-4, residual.abs().max()
    assert ew[:n].abs().max() > 1e-2  # the errors are real, so the identity is not trivially 0 = 0


@pytest.mark.parametrize("world", [2, 4])
def test_repeated_average_converges_to_mean(world):
    n = 1024
    res = results(world, "converge")
    true_mean = torch.stack([res[r]["x"] for r in range(world)]).double().mean(0)
    rel = (res[0]["avg"].double() - true_mean).norm() / true_mean.norm()
    assert rel < 1e-2, rel
    single = OneBitSim(world, n).step([res[r]["x"] for r in range(world)])
    assert (single.double() - true_mean).norm() / true_mean.norm() > 0.1  # one call alone is far off


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_call_within_bound(world):
    n = 1 << 16
    res = results(world, "bytes")
    padded = math.ceil(n / (8 * world)) * 8 * world
    bound = 1.05 * (world - 1) / world * padded / 4
    for r in range(world):
        assert 0 < res[r]["bytes_sent"] <= bound
        assert 0 < res[r]["bytes_received"] <= bound
        assert res[r]["bytes_sent"] == 2 * (world - 1) * (padded // world // 8 + 4)


def test_hierarchy_simulated_nodes_matches_simulation():
    calls = 4
    res = results(4, "hierarchy")
    sim = OneBitSim(2, 17 * 59)  # the two node leaders
    flat = OneBitSim(4, 17 * 59)  # the flat algorithm over all four ranks
    for k in range(calls):
        xs = [make_input(3, r, k).reshape(-1) for r in range(4)]
        node_means = [(xs[0] + xs[1]) * 0.5, (xs[2] + xs[3]) * 0.5]
        expect = sim.step(node_means).reshape(17, 59)
        expect_flat = flat.step(xs).reshape(17, 59)
        for r in range(4):
            assert torch.equal(res[r]["explicit"][k], expect), f"call {k} rank {r}"
            assert torch.equal(res[r]["auto"][k], expect), f"auto-detected hosts, call {k} rank {r}"
            assert torch.equal(res[r]["flat"][k], expect_flat)
    assert [res[r]["leader_has_errors"] for r in range(4)] == [True, False, True, False]


def test_node_hierarchy_on_one_host_is_the_exact_average():
    """One node: nothing crosses nodes, so nothing is compressed and no error is kept."""
    world = 4
    res = results(world, "node_single")
    nbytes = 17 * 59 * 4
    for k in range(2):
        expect = sum(dyadic_input(r, k) for r in range(world)) / world  # exact: multiples of 1/256
        for r in range(world):
            assert torch.equal(res[r]["node"][k], expect), f"call {k} rank {r}"
            assert torch.equal(res[r]["explicit"][k], expect), f"explicit Hierarchy, call {k} rank {r}"
    for r in range(world):
        assert res[r]["errors_kept"] == [False, False]
        # reduce to the leader and broadcast back; the first call also exchanges 32-byte host digests
        moved = (world - 1) * nbytes if r == 0 else nbytes
        hosts = (world - 1) * 32
        assert res[r]["bytes"] == [(moved + hosts, moved + hosts), (moved, moved)], r


def test_subgroups_average_independently():
    res = results(4, "subgroup")
    for pair in ([0, 2], [1, 3]):
        sim = OneBitSim(2, 17 * 59)
        for k in range(3):
            expect = sim.step([make_input(12, r, k) for r in pair]).reshape(17, 59)
            for r in pair:
                assert torch.equal(res[r][k], expect), f"pair {pair}, call {k}, rank {r}"


@pytest.mark.parametrize("world", [2, 4])
def test_int8_matches_simulation(world):
    calls = 4
    res = results(world, "int8")
    sim = Int8Sim(world, 17 * 59)
    for k in range(calls):
        expect = sim.step([make_input(4, r, k) for r in range(world)]).reshape(17, 59)
        for r in range(world):
            assert torch.equal(res[r]["outs"][k], expect), f"call {k}, rank {r}"
    mean = torch.stack([make_input(4, r, calls - 1) for r in range(world)]).mean(0)
    assert (res[0]["outs"][-1] - mean).norm() / mean.norm() < 0.05  # 8 bits: close in one call
    row = sim.c + 4
    assert all(s == 2 * (world - 1) * row for s in res[0]["sent"])


def test_buckets_equal_per_bucket_simulation_and_resume():
    world, bucket = 2, 700
    res = results(world, "buckets")
    flat_in = [torch.cat([t.reshape(-1) for t in res[r]["inputs"]]) for r in range(world)]
    total = flat_in[0].numel()
    assert res[0]["buckets"] == math.ceil(total / bucket)
    sims = [OneBitSim(world, min(bucket, total - s)) for s in range(0, total, bucket)]
    for name in ("first", "second"):
        expect = torch.cat(
            [sim.step([f[i * bucket : (i + 1) * bucket] for f in flat_in]) for i, sim in enumerate(sims)]
        )
        for r in range(world):
            got = torch.cat([t.reshape(-1) for t in res[r][name]])
            assert torch.equal(got, expect), f"{name} call, rank {r}"
            assert [t.shape for t in res[r][name]] == [t.shape for t in res[r]["inputs"]]
    for r in range(world):  # errors restored from state_dict continue exactly
        for a, b in zip(res[r]["second"], res[r]["second_resumed"]):
            assert torch.equal(a, b)


def test_registered_compressor_is_used():
    res = results(2, "custom")
    mean = (res[0]["x"] + res[1]["x"]) / 2
    for r in range(2):
        assert torch.equal(res[r]["y"], mean)  # lossless compressor: exactly the average


def test_ddp_hook_allreduces_in_warmup_and_sends_nothing_after():
    res = results(2, "ddp")
    for r in range(2):
        mean = [(a + b) / 2 for a, b in zip(res[0]["local"], res[1]["local"])]
        for stage in ("warmup", "warmup2"):
            for g, m in zip(res[r][stage], mean):
                torch.testing.assert_close(g, m, rtol=1e-6, atol=1e-7)
            assert res[r][stage + "_bytes"] == 2 * 1 * res[r]["numel"] * 4 // 2
        for g, loc in zip(res[r]["compression"], res[r]["local"]):
            assert torch.equal(g, loc)  # the rank's own gradient, untouched
        assert res[r]["compression_bytes"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(res[0]["compression"], res[1]["compression"]))


def test_nan_on_one_rank_raises_on_every_rank_and_keeps_errors():
    res = results(2, "nonfinite")
    assert [r["raised"] for r in res] == [True, True]
    assert [r["kept"] for r in res] == [True, True]
    assert [r["bucket_raised"] for r in res] == [True, True]
    assert [r["bucket_kept"] for r in res] == [True, True]
    sim = OneBitSim(2, 17 * 59)  # the failed call left no trace: calls 0 and 2 only
    sim.step([make_input(6, r, 0) for r in range(2)])
    expect = sim.step([make_input(6, r, 2) for r in range(2)]).reshape(17, 59)
    assert all(torch.equal(r["after"], expect) for r in res)


# ---------------------------------------------------------------- single process (no spawn)


def test_world_size_one_applies_the_same_math():
    """Without torch.distributed the call is the P = 1 formula: worker then server compression."""
    st = qcomm.OneBitState()
    sim = OneBitSim(1, 17 * 59)
    before = qcomm.stats()
    for k in range(3):
        x = make_input(9, 0, k)
        assert torch.equal(qcomm.compressed_allreduce(x, st), sim.step([x]).reshape(17, 59))
    assert qcomm.stats() == before  # nothing travels
    assert torch.equal(st.worker_error, sim.ew[0]) and torch.equal(st.server_error, sim.es[0])


def _reference_row_decode(payload):
    """A decoder as compressors._onebit_decode_op returns one, built on the reference onebit.decode."""
    from qcompress.quant import onebit

    return lambda signs, scales: torch.stack([onebit.decode(signs[r], scales[r]) for r in range(signs.shape[0])])


def _no_kernels():
    raise AssertionError("a fused kernel ran on the reference path")


def test_reference_and_kernel_ops_give_the_simulated_bits(monkeypatch):
    """The 1-bit compressor uses the fused kernels when built; every path must give the same bits.
    "reference" runs no kernel at all (compress, server average and the final decode)."""
    import qcompress.comm.compressors as cmod
    from qcompress.quant import kernels, onebit

    reference_ops = lambda: (onebit.compress, onebit.decode_average)  # noqa: E731
    paths = {
        "reference": (reference_ops, _reference_row_decode, True),
        "table-lookup decode": (reference_ops, lambda payload: None, True),
    }
    if cmod._onebit_ops()[0] is not onebit.compress:
        paths["kernels"] = (cmod._onebit_ops, cmod._onebit_decode_op, False)
    print("1-bit op paths checked:", sorted(paths))
    real_ops = kernels._ops
    for name, (ops, decode_op, forbid_kernels) in paths.items():
        monkeypatch.setattr(cmod, "_onebit_ops", ops)
        monkeypatch.setattr(cmod, "_onebit_decode_op", decode_op)
        monkeypatch.setattr(kernels, "_ops", _no_kernels if forbid_kernels else real_ops)
        st, sim = qcomm.OneBitState(), OneBitSim(1, 4000)
        for k in range(3):
            x = make_input(13, 0, k, shape=(4000,))
            assert torch.equal(qcomm.compressed_allreduce(x, st), sim.step([x])), name


def test_bf16_input_keeps_dtype_and_fp32_errors():
    st = qcomm.OneBitState()
    x = make_input(9, 0, 0).to(torch.bfloat16)
    y = qcomm.compressed_allreduce(x, st)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, OneBitSim(1, x.numel()).step([x.float()]).reshape(x.shape).to(torch.bfloat16))
    assert st.worker_error.dtype == torch.float32


def test_fp16_average_that_overflows_fp16_raises_and_keeps_the_errors():
    """Finite fp16 inputs near 65504 can average (with error feedback) past fp16's range: the cast
    back returned inf silently and advanced the errors. Oracle: OneBitSim in float32."""
    from qcompress import NonFiniteError

    g = torch.Generator().manual_seed(0)
    st, sim = qcomm.OneBitState(), OneBitSim(1, 64)
    raised = returned = 0
    for k in range(30):
        x = (torch.randn(64, generator=g) * 3e4).clamp(-65504, 65504).to(torch.float16)
        x[:4] = 65504
        before = st.state_dict()
        ew, es = list(sim.ew), list(sim.es)
        want = sim.step([x.float()])
        if torch.isinf(want.to(torch.float16)).any():
            with pytest.raises(NonFiniteError, match="overflows torch.float16"):
                qcomm.compressed_allreduce(x, st)
            after = st.state_dict()
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), (
                "errors advanced"
            )
            sim.ew, sim.es = ew, es  # the caller skips the call: the simulation forgets it too
            raised += 1
        else:
            assert torch.equal(qcomm.compressed_allreduce(x, st), want.to(torch.float16))
            returned += 1
    assert raised and returned, (raised, returned)


def test_bucketed_fp16_average_that_overflows_fp16_raises_and_keeps_the_errors():
    from qcompress import NonFiniteError

    g = torch.Generator().manual_seed(0)
    bc, sim = qcomm.BucketedCompressor(bucket_size=1000), OneBitSim(1, 64 + 8)
    raised = 0
    for k in range(30):
        small = torch.randn(8, generator=g)  # float32 beside the fp16 tensor, in the same bucket
        x = (torch.randn(64, generator=g) * 3e4).clamp(-65504, 65504).to(torch.float16)
        x[:4] = 65504
        before = bc.state_dict()
        ew, es = list(sim.ew), list(sim.es)
        want = sim.step([torch.cat([small, x.float()])])
        if torch.isinf(want[8:].to(torch.float16)).any():
            with pytest.raises(NonFiniteError, match=r"tensor 1 \(torch.float16, shape \(64,\)\) overflows"):
                bc.allreduce([small, x])
            after = bc.state_dict()
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), (
                "errors advanced"
            )
            sim.ew, sim.es = ew, es
            raised += 1
        else:
            a, b = bc.allreduce([small, x])
            assert torch.equal(a, want[:8]) and torch.equal(b, want[8:].to(torch.float16))
    assert raised


def test_state_dict_roundtrip_and_mismatch():
    st = qcomm.OneBitState()
    assert st.state_dict() == {}
    x = make_input(8, 0, 0)
    qcomm.compressed_allreduce(x, st)
    sd = st.state_dict()
    assert set(sd) == {"worker_error", "server_error"}
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    a = qcomm.compressed_allreduce(x, st)
    st2 = qcomm.OneBitState()
    st2.load_state_dict(sd)
    assert torch.equal(qcomm.compressed_allreduce(x, st2), a)
    with pytest.raises(ValueError, match="padded length"):
        qcomm.compressed_allreduce(torch.ones(5000), st2)
    with pytest.raises(ValueError, match="compressor"):
        qcomm.compressed_allreduce(x, st, compressor="int8")
    assert st2.matches(17 * 59, 1) and not st2.matches(17 * 59, 2) and not st2.matches(5000, 1)
    st.reset()
    assert not st.initialized and st.matches(5000, 3)
    qcomm.compressed_allreduce(x, st, compressor="int8")


def test_unknown_compressor_and_bad_inputs():
    with pytest.raises(ValueError) as info:
        qcomm.get_compressor("twobit")
    assert "twobit" in str(info.value) and "int8" in str(info.value) and "onebit" in str(info.value)
    with pytest.raises(ValueError, match="unknown compressor"):
        qcomm.compressed_allreduce(torch.ones(8), qcomm.OneBitState(), compressor="nope")
    with pytest.raises(TypeError, match="floating-point"):
        qcomm.compressed_allreduce(torch.ones(8, dtype=torch.int32), qcomm.OneBitState())
    with pytest.raises(TypeError, match="OneBitState"):
        qcomm.compressed_allreduce(torch.ones(8), {})
    with pytest.raises(ValueError, match="hierarchy"):
        qcomm.compressed_allreduce(torch.ones(8), qcomm.OneBitState(), hierarchy="rack")
    with pytest.raises(ValueError, match="bucket_size"):
        qcomm.BucketedCompressor(bucket_size=0)
    assert qcomm.get_compressor("ONEBIT") is qcomm.get_compressor("onebit")


def test_padding_is_a_multiple_of_8_world_only():
    assert qcomm.padded_length(1003, 4) == 1024  # 8 * 4 = 32; not P * lcm(8, P)
    assert qcomm.padded_length(1024, 4) == 1024
    assert qcomm.padded_length(1003, 3) == 1008
    assert qcomm.padded_length(1003, 3, "int8") == 1005


@pytest.mark.parametrize("world", [2, 4])
def test_many_buffers_in_two_collectives_equal_one_call_each(world):
    for r in results(world, "many"):
        for got, want in zip(r["many"], r["single"]):
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        assert r["bytes_many"] == r["bytes_single"]
        assert not r["finite_with_nan"] and r["kept"]
    first = results(world, "many")[0]["many"]
    for other in results(world, "many")[1:]:  # bit-identical on every rank
        assert all(torch.equal(a, b) for x, y in zip(first, other["many"]) for a, b in zip(x, y))
