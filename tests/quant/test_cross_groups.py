"""observer_kwargs.cross_groups: the groups of a row chosen together against the whole E[u u^T].

Oracles: the row's output error d^T M d computed here in float64 from the quantized weight (not
through cross_groups' incremental sums), brute force over each group's candidates, and the layer's
own output error on the calibration inputs (which is N x sum over rows of d^T M d exactly).
"""

import copy

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.quant import cross_groups, observers
from qcompress.quant.reference import make_spec

SPEC = make_spec(4, symmetric=True, granularity="group", group_size=8)
GRID = observers.shrink_grid(None, observers.Search(grid=20, maxshrink=0.5))  # 1.00 .. 0.55


def correlated(n, cols, seed=0):
    """Inputs whose columns move together across groups (a shared factor, as after a LayerNorm)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, cols, generator=g)
    shared = torch.randn(n, 3, generator=g) @ torch.randn(3, cols, generator=g)
    return (0.3 * z + shared) * torch.linspace(0.2, 1.5, cols)


def weight(rows, cols, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, ::7] *= 4.0  # a few large weights per group: clipping matters
    return w


def quantized(w, p, spec=SPEC):
    s, z = observers.weight_params(w, spec, "mse", shrink=p)
    return qc.quant.api.fake_quantize_spec(w, spec, scale=s, zero_point=z).double()


def row_error(w, p, M, spec=SPEC):
    d = quantized(w, p, spec) - w.double()
    return ((d @ M) * d).sum(dim=1)


def moments(u):
    u = u.double()
    return u.T @ u / u.shape[0]


@pytest.mark.parametrize("cols", [32, 44])  # 44: a ragged last group (4 of 8 columns)
def test_the_result_is_a_coordinate_minimum_never_worse_than_its_start(cols):
    w, M = weight(6, cols), moments(correlated(400, cols))
    start = observers.mse_shrink(w, SPEC, search=observers.Search(grid=20, maxshrink=0.5), moments=None)
    got = cross_groups.descend(w, SPEC, start, M, GRID, sweeps=100)
    G = -(-cols // 8)
    e = row_error(w, got, M)
    assert torch.all(e <= row_error(w, start, M) * (1 + 1e-12))
    assert bool((e < row_error(w, start, M) * (1 - 1e-6)).any())  # correlated inputs: some row gains
    # no single group's move to any grid factor lowers its row's error (brute force, float64)
    for j in range(G):
        for c in GRID:
            trial = got.clone().reshape(6, G)
            trial[:, j] = c
            assert torch.all(row_error(w, trial.reshape(-1), M) >= e * (1 - 1e-9)), (j, float(c))


def test_block_diagonal_moments_leave_the_per_group_choice():
    """Without cross terms each group's own best (the per-group search, refined) already minimises
    the row's error: nothing moves."""
    cols = 32
    full = moments(correlated(400, cols))
    blocks = torch.block_diag(*[full[i : i + 8, i : i + 8] for i in range(0, cols, 8)])
    w = weight(5, cols)
    search = observers.Search(grid=20, maxshrink=0.5)
    per_group = observers.mse_shrink(
        w, SPEC, search=search, moments=torch.stack([full[i : i + 8, i : i + 8] for i in range(0, cols, 8)])
    )
    got = observers.mse_shrink(
        w,
        SPEC,
        search=search,
        moments=torch.stack([full[i : i + 8, i : i + 8] for i in range(0, cols, 8)]),
        cross=blocks,
    )
    assert torch.equal(got, per_group)


def test_moments_that_do_not_fit_are_refused():
    w = weight(4, 32)
    with pytest.raises(ValueError, match=r"cross-group moments of shape \(16, 16\) do not fit .* \(4, 32\)"):
        cross_groups.descend(w, SPEC, torch.ones(16), torch.eye(16, dtype=torch.float64), GRID)
    with pytest.raises(ValueError, match=r"per channel"):
        cross_groups.descend(
            w, make_spec(4, granularity="channel"), torch.ones(4), torch.eye(32, dtype=torch.float64), GRID
        )


# --- through calibrate_weight_ranges --------------------------------------------------------------


def doc(**kw):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "observer": "mse",
                    "observer_kwargs": {"weight_by": "inputs", **kw},
                },
                "different_groups": {
                    "w": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 8}}
                },
            }
        }
    }


def layer(seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(40, 24)
    with torch.no_grad():
        lin.weight.copy_(weight(24, 40, seed=3))
    return nn.Sequential(lin)


def test_calibration_output_error_drops_below_each_group_alone():
    """The layer's squared output error on the calibration inputs is N x sum over rows of d^T M d,
    the quantity the descent lowers: with cross_groups it is below cross_groups: false's (same
    per-group start), and cross_groups: false keeps no whole moments."""
    u = correlated(256, 40, seed=5)
    bs = list(u.split(64))
    ref = layer()
    out = {}
    for cg in (False, True):
        m = layer()
        qc.init_compression(m, doc(cross_groups=cg))
        qc.calibrate_weight_ranges(m, bs)
        assert (m[0].qc_wq.store.input_cross is not None) == cg
        with torch.no_grad():
            d = nn.functional.linear(u, m[0].effective_weight()) - nn.functional.linear(u, ref[0].weight)
        out[cg] = float(d.double().square().sum())
        if cg:
            M = m[0].qc_wq.store.input_cross.double()
            closed = float(row_error(ref[0].weight.detach(), m[0].qc_wq.shrink, M).sum()) * u.shape[0]
            assert closed == pytest.approx(out[cg], rel=1e-4)
    assert out[True] < 0.9 * out[False]


def test_scheduler_state_carries_the_whole_moments_once_for_tied_weights():
    pytest.importorskip("transformers", reason="GPT-2 from transformers")
    from tests.helpers.tiny_models import make_gpt2

    m = make_gpt2()
    cfg = copy.deepcopy(doc())
    cfg["compression_training"]["weight_quantization"]["different_groups"]["w"]["params"]["group_size"] = 16
    qc.init_compression(m, cfg)
    g = torch.Generator().manual_seed(0)
    qc.calibrate_weight_ranges(m, [torch.randint(0, m.config.vocab_size, (2, 12), generator=g) for _ in range(2)])
    wte, head = m.transformer.wte, m.lm_head
    assert wte.qc_wq.store.input_cross is head.qc_wq.store.input_cross
    assert torch.equal(wte.qc_wq.shrink, head.qc_wq.shrink)  # one tensor, one choice
    sd = qc.CompressionScheduler(m, cfg).state_dict()["modules"]
    tied = [n for n in ("transformer.wte", "lm_head") if "input_cross" in sd[n]["wq"]]
    assert len(tied) == 1


def test_whole_moments_that_would_not_fit_in_memory_are_refused_up_front(monkeypatch):
    """40 x 40 float64 sums + the float32 copy kept: 19,200 bytes; with 30,000 free (half: 15,000)
    calibration refuses before any batch runs, naming the key that avoids it; cross_groups: false
    (no whole moments) runs."""
    from qcompress.calibrate import input_moments

    monkeypatch.setattr(input_moments, "free_memory", lambda: 30_000)
    drawn = []

    def bs():
        for b in correlated(64, 40).split(32):
            drawn.append(1)
            yield b

    m = layer()
    qc.init_compression(m, doc())
    with pytest.raises(MemoryError, match=r"cross_groups: the whole input moments of 1 module.*cross_groups: false"):
        qc.calibrate_weight_ranges(m, bs())
    assert not drawn
    m = layer()
    qc.init_compression(m, doc(cross_groups=False))
    assert qc.calibrate_weight_ranges(m, bs()) == 1
