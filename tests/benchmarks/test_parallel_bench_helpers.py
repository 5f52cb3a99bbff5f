"""benchmarks/collective_bytes.py and the helpers of benchmarks/parallel.py.
Oracles: closed-form byte counts of collectives on 4 gloo ranks (ring all-reduce 2(P-1)B/P, ...),
the collectives' own results, torch.nextafter, and F.linear on the halves computed here."""

import importlib.util
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"qc_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cb = _load("collective_bytes")
pb = _load("parallel")

B = 1000 * 4  # bytes of the float32 payload every collective below moves


def _collectives(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    count = cb.CollectiveBytes({dist.group.WORLD.group_name: "world", pair.group_name: "pair"})
    with count:
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)  # world sum: 1 + 2 + 3 + 4
        u = funcol.wait_tensor(funcol.all_reduce(torch.ones(1000), "sum", pair))  # DTensor's kind
        b = torch.full((1000,), float(rank))
        dist.broadcast(b, src=0)
        if rank in (0, 1):
            p = torch.full((1000,), 7.0) if rank == 0 else torch.zeros(1000)
            (dist.send if rank == 0 else dist.recv)(p, 1 - rank)
        else:
            p = torch.full((1000,), 7.0)
        g = torch.empty(4000)
        dist.all_gather_into_tensor(g, torch.full((1000,), float(rank)))
        r = torch.empty(1000)
        dist.reduce_scatter_tensor(r, torch.ones(4000))
        dist.all_to_all_single(torch.empty(4), torch.ones(4))  # a collective the counter does not size
    return (
        dict(count.sent),
        dict(count.unknown),
        float(t[0]),
        float(u[0]),
        float(b[0]),
        float(p[0]),
        g[::1000].tolist(),
        float(r[0]),
    )


def test_bytes_per_group_match_the_closed_forms():
    out = run_ranks(_collectives, 4, timeout=120)
    for rank, (sent, unknown, t, u, b, p, g, r) in enumerate(out):
        assert (t, u, b, p, g, r) == (10.0, 2.0, 0.0, 7.0, [0.0, 1.0, 2.0, 3.0], 4.0)  # the collectives ran
        world = 2 * 3 * B // 4  # all-reduce, ring volume
        world += 3 * B if rank == 0 else 0  # broadcast: the root sends to the 3 others
        world += 3 * B  # all-gather of a chunk of B bytes
        world += 3 * (4 * B) // 4  # reduce-scatter of an input of 4B bytes
        world += B if rank == 0 else 0  # the send (the default group); a receive sends nothing
        assert sent == {"world": world, "pair": 2 * 1 * B // 2}  # functional all-reduce over 2 ranks
        assert unknown == {"c10d.alltoall_base_": 1}


def test_nudge_one_ulp_moves_half_the_elements_by_one_ulp():
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    before = [p.detach().clone() for p in m.parameters()]
    pb.nudge_one_ulp(m, seed=3)
    for old, new in zip(before, m.parameters()):
        up = torch.nextafter(old, torch.full_like(old, math.inf))
        moved = new != old
        assert torch.equal(new[moved], up[moved])
        assert 0.4 < moved.float().mean() < 0.6


def test_sum_in_tp_order_adds_the_two_halves_of_the_row_parallel_matmul():
    torch.manual_seed(0)
    model = nn.ModuleDict({"o_proj": nn.Linear(128, 64, bias=False), "q_proj": nn.Linear(128, 64)})
    x = torch.randn(3, 5, 128)
    whole = model["o_proj"](x)
    assert pb.sum_in_tp_order(model) == 1  # q_proj is column-parallel: left alone
    w = model["o_proj"].weight
    expect = F.linear(x[..., :64], w[:, :64]) + F.linear(x[..., 64:], w[:, 64:])
    got = model["o_proj"](x)
    assert torch.equal(got, expect)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


def test_state_bytes_counts_parameters_gradients_and_adamw_state():
    m = nn.Linear(4, 3)  # 15 float32 parameters
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    # parameters + one gradient each: 2 x 60 B; AdamW: exp_avg and exp_avg_sq (60 B each) and a
    # float32 step counter per tensor (2 x 4 B)
    assert pb.state_bytes(opt) == 2 * 60 + 2 * 60 + 2 * 4


pf = _load("parallel_flips")


def test_flip_compare_joins_shards_along_the_split_and_counts_by_hand():
    # one column-parallel (rows split) and one row-parallel (columns split) layer, 4 x 4 codes each
    full = {"q_proj": torch.arange(16).reshape(4, 4), "o_proj": torch.arange(16).reshape(4, 4)}
    base = ({1: {n: (q, -2.0, 4.0) for n, q in full.items()}}, [3.0])
    ranks = []
    for r in range(2):
        q = full["q_proj"][2 * r : 2 * r + 2].clone()
        o = full["o_proj"][:, 2 * r : 2 * r + 2].clone()
        if r == 1:
            o[0, 0] += 1  # one code differs on rank 1's columns
        ranks.append(({1: {"q_proj": (q, -2.0, 4.0), "o_proj": (o, -2.0, 5.0)}}, [3.5]))
    differ, total, worst, dloss = pf.compare(base, ranks, 1)
    assert (differ, total, dloss) == (1, 32, 0.5)
    assert worst == pytest.approx(0.25)  # max 5 against 4
