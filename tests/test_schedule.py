"""Bit schedules, fp16_mixed_quantize, optimizer-step mode and checkpoint round trips."""

import copy

import pytest
import torch
import torch.nn as nn

from qcompress import CompressionScheduler, init_compression, load_config
from qcompress.quant import fake_quantize
from qcompress.schedule import bits_at, change_points


def deepspeed_moq_bits(start, target, period, n_calls):
    """DeepSpeed's MoQ rule, simulated: a quantize() call counter qsteps; whenever
    qsteps >= q_period (and start != target) drop one bit and double q_period.
    Returns the bits in force after 0..n_calls calls."""
    bits, q_period, out = start, period, [start]
    for qsteps in range(1, n_calls + 1):
        if bits != target and qsteps >= q_period:
            bits -= 1
            q_period *= 2
        out.append(bits)
    return out


def wq_cfg(
    start,
    target,
    period,
    *,
    offset=0,
    growth=None,
    in_forward=True,
    mixed=None,
    rounding="nearest",
    extra_params=None,
    act=None,
):
    params = {"start_bits": start, "target_bits": target, "quantization_period": period, **(extra_params or {})}
    if growth:
        params["period_growth"] = growth
    shared = {
        "enabled": True,
        "schedule_offset": offset,
        "quantize_weight_in_forward": in_forward,
        "rounding": rounding,
    }
    if mixed is not None:
        shared["fp16_mixed_quantize"] = {"enabled": True, "quantize_change_ratio": mixed}
    ct = {
        "weight_quantization": {
            "shared_parameters": shared,
            "different_groups": {"wq1": {"params": params, "modules": ["fc"]}},
        }
    }
    if act:
        ct["activation_quantization"] = act
    return load_config({"compression_training": ct})


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_documented_example():
    got = {s: bits_at(s, start=12, target=8, period=50) for s in (0, 49, 50, 99, 100, 199, 200, 399, 400, 10_000)}
    assert got == {0: 12, 49: 12, 50: 11, 99: 11, 100: 10, 199: 10, 200: 9, 399: 9, 400: 8, 10_000: 8}
    assert change_points(12, 8, 50) == [(0, 12), (50, 11), (100, 10), (200, 9), (400, 8)]


@pytest.mark.parametrize(
    "start,target,period", [(12, 8, 50), (8, 4, 3), (6, 1, 1), (4, 2, 7), (8, 8, 5), (8, 4, 0), (6, 1, 0), (8, 8, 0)]
)
def test_exponential_rule_matches_deepspeed_simulation(start, target, period):
    ds = deepspeed_moq_bits(start, target, period, 1200)
    ours = [bits_at(t, start=start, target=target, period=period) for t in range(1201)]
    assert ours == ds


def test_linear_growth_offset_and_period_zero():
    lin = [bits_at(t, start=12, target=8, period=50, growth="linear") for t in (49, 50, 100, 149, 150, 200, 500)]
    assert lin == [12, 11, 10, 10, 9, 8, 8]
    off = {t: bits_at(t, start=12, target=8, period=50, offset=10) for t in (0, 59, 60, 110, 209, 210, 410)}
    assert off == {0: 12, 59: 12, 60: 11, 110: 10, 209: 10, 210: 9, 410: 8}
    # period 0: DeepSpeed's `qsteps >= q_period` always holds, so one bit goes at every step
    assert [bits_at(t, start=12, target=8, period=0, offset=5) for t in range(4, 11)] == [12, 12, 11, 10, 9, 8, 8]
    assert [bits_at(t, start=12, target=8, period=0, growth="linear") for t in range(6)] == [12, 11, 10, 9, 8, 8]
    assert change_points(12, 8, 0, offset=5) == [(5, 12), (6, 11), (7, 10), (8, 9), (9, 8)]


@pytest.mark.parametrize("growth,offset", [("exponential", 0), ("exponential", 3), ("linear", 2)])
def test_scheduler_bits_around_every_drop_in_forward(growth, offset):
    model = Net()
    cfg = wq_cfg(8, 4, 5, offset=offset, growth=growth)
    init_compression(model, cfg)
    sched = CompressionScheduler(model, cfg)
    dues = [5 * 2**k if growth == "exponential" else 5 * (k + 1) for k in range(4)]
    checks = {offset - 1, offset} | {offset + d + e for d in dues for e in (-1, 0)}
    for t in range(0, max(checks) + 2):
        if t > 0:
            sched.step()
        want = None if t < offset else 8 - sum(t - offset >= d for d in dues)
        for name in ("fc1", "fc2"):
            m = getattr(model, name)
            assert sched.current_bits()[name] == (want or 0)
            if want is None:
                assert not m.qc_wq.active and torch.equal(m.effective_weight(), m.weight)
            elif t in checks:
                assert torch.equal(m.effective_weight(), fake_quantize(m.weight, want))
        assert sched.training_steps == t


def _train_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_optimizer_step_mode_keeps_full_precision_master():
    model = Net()
    cfg = wq_cfg(8, 4, 4, in_forward=False)
    init_compression(model, cfg)
    sched = CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_master = {n: copy.deepcopy(getattr(model, n).qc_wq.master) for n in ("fc1", "fc2")}
    x, y = _data()
    for t in range(1, 20):
        before = {n: getattr(model, n).weight.detach().clone() for n in ("fc1", "fc2")}
        _train_step(model, opt, x, y)
        grads = {n: getattr(model, n).weight.grad.clone() for n in ("fc1", "fc2")}
        after = {n: getattr(model, n).weight.detach().clone() for n in ("fc1", "fc2")}
        sched.step()
        bits = bits_at(t, start=8, target=4, period=4)
        for n in ("fc1", "fc2"):
            m = getattr(model, n)
            # exactly the step the optimizer applied to the (quantized) weight goes to the master
            assert torch.equal(m.qc_wq.master, ref_master[n] + (after[n] - before[n]))
            # which is SGD's update (up to fp32 rounding of the weight)
            torch.testing.assert_close(m.qc_wq.master, ref_master[n] - 0.05 * grads[n], rtol=0, atol=1e-6)
            assert m.qc_wq.bits == bits
            # the weight forward sees is the master quantized once, at this step's bits
            assert torch.equal(m.weight.detach(), fake_quantize(m.qc_wq.master, bits))
            assert torch.equal(m.effective_weight(), m.weight)
            ref_master[n] = m.qc_wq.master.clone()  # follow the master (no drift build-up)


def test_fp16_mixed_quantize_anneal_restarts_at_each_drop():
    model = Net()
    cr = 0.25
    cfg = wq_cfg(6, 4, 8, mixed=cr)  # drops at 8 and 16
    init_compression(model, cfg)
    sched = CompressionScheduler(model, cfg)
    for t in range(0, 30):
        if t:
            sched.step()
        last_drop = max(d for d in (0, 8, 16) if d <= t)
        r = max(0.0, 1.0 - (t - last_drop) * cr)
        m = model.fc1
        assert m.qc_wq.mix_ratio == pytest.approx(r), t
        bits = bits_at(t, start=6, target=4, period=8)
        w = m.weight
        want = r * w + (1 - r) * fake_quantize(w, bits) if r > 0 else fake_quantize(w, bits)
        torch.testing.assert_close(m.effective_weight(), want, rtol=0, atol=1e-7)


def test_fp16_mixed_quantize_in_optimizer_step_mode():
    model = Net()
    cfg = wq_cfg(6, 5, 3, in_forward=False, mixed=0.5)  # drop at 3
    init_compression(model, cfg)
    sched = CompressionScheduler(model, cfg)
    for t in range(1, 7):
        sched.step()  # no optimizer updates: master fixed
        r = max(0.0, 1.0 - (t - (3 if t >= 3 else 0)) * 0.5)
        m = model.fc2
        master = m.qc_wq.master
        q = fake_quantize(master, bits_at(t, start=6, target=5, period=3))
        torch.testing.assert_close(m.weight.detach(), r * master + (1 - r) * q, rtol=0, atol=1e-7)


ACT_STATIC = {
    "shared_parameters": {"enabled": True, "range_calibration": "static", "schedule_offset": 2},
    "different_groups": {"a": {"params": {"bits": 8}, "modules": ["fc"]}},
}


@pytest.mark.parametrize("in_forward,order", [(True, "sched_first"), (False, "sched_first"), (False, "model_first")])
def test_checkpoint_round_trip_continues_bit_for_bit(tmp_path, in_forward, order):
    cfg = wq_cfg(8, 4, 3, in_forward=in_forward, rounding="stochastic", mixed=0.3, act=ACT_STATIC)
    x, y = _data(64)

    def fresh(state=None):
        model = init_compression(Net(seed=1), cfg)
        if state is not None and order == "model_first":  # weights loaded before the scheduler exists
            model.load_state_dict(state)
        sched = CompressionScheduler(model, cfg)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, sched, opt

    def run(model, sched, opt, steps, start=0):
        losses = []
        for i in range(start, start + steps):
            xb, yb = x[(i % 4) * 16 : (i % 4 + 1) * 16], y[(i % 4) * 16 : (i % 4 + 1) * 16]
            losses.append(_train_step(model, opt, xb, yb))
            sched.step()
        return losses

    ref_model, ref_sched, ref_opt = fresh()
    ref_losses = run(ref_model, ref_sched, ref_opt, 26)

    model, sched, opt = fresh()
    first = run(model, sched, opt, 9)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "sched": sched.state_dict(), "opt": opt.state_dict()}, path)
    del model, sched, opt
    ck = torch.load(path, weights_only=True)
    model, sched, opt = fresh(ck["model"])
    if order == "sched_first":
        model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    assert sched.training_steps == 9 and sched.current_bits() == {"fc1": 6, "fc2": 6}  # drops at 3, 6
    rest = run(model, sched, opt, 17, start=9)  # crosses the drops at 12 and 24
    assert torch.equal(torch.stack(first + rest), torch.stack(ref_losses))
    for (n, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), n
    assert sched.current_bits() == ref_sched.current_bits() == {"fc1": 4, "fc2": 4}
    assert torch.equal(model.fc1.qc_aq.observer.min, ref_model.fc1.qc_aq.observer.min)
    xe = torch.randn(4, 8)
    model.eval(), ref_model.eval()
    assert torch.equal(model(xe), ref_model(xe))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_forward", [True, False])
def test_low_precision_weights(dtype, in_forward):
    model = Net().to(dtype)
    cfg = wq_cfg(8, 6, 2, in_forward=in_forward)
    init_compression(model, cfg)
    sched = CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    x = x.to(dtype)
    for t in range(1, 6):
        loss = _train_step(model, opt, x, y)
        sched.step()
        assert torch.isfinite(loss)
        bits = bits_at(t, start=8, target=6, period=2)
        m = model.fc1
        assert m.weight.dtype == dtype and m.qc_wq.bits == bits
        eff = m.effective_weight()
        assert eff.dtype == dtype
        if in_forward:
            assert torch.equal(eff, fake_quantize(m.weight, bits))
        else:
            assert m.qc_wq.master.dtype == torch.float32
            assert torch.equal(eff, fake_quantize(m.qc_wq.master, bits).to(dtype))


# --- optimizer-step state: devices, dtypes, loaded weights, the scheduler's config -----------------


def _moq_model(cfg, seed=0):
    return init_compression(Net(seed=seed), cfg)


def test_optimizer_step_state_follows_the_module_to_meta_and_back():
    cfg = wq_cfg(8, 4, 4, in_forward=False)
    model = _moq_model(cfg)
    keys = list(Net().state_dict())
    model.to("meta")
    for m in (model.fc1, model.fc2):
        assert m.qc_wq.master.is_meta and m.qc_wq.applied.is_meta
        assert all(t.is_meta for t in m.qc_wq.codes if t is not None)
    sched = CompressionScheduler(model, cfg)  # used to crash: master on cpu, weight on meta
    sched.step()
    assert list(model.state_dict()) == keys
    # materialize, then load real weights: they become the master and are quantized once
    model.to_empty(device="cpu")
    src = Net(seed=3)
    model.load_state_dict(src.state_dict())
    sched.step()
    for n in ("fc1", "fc2"):
        m, ref = getattr(model, n), getattr(src, n)
        assert torch.equal(m.qc_wq.master, ref.weight)
        assert torch.equal(m.weight.detach(), fake_quantize(ref.weight.detach(), m.qc_wq.bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_optimizer_step_state_follows_a_dtype_change(dtype):
    cfg = wq_cfg(8, 8, 0, in_forward=False)
    model = _moq_model(cfg)
    sched = CompressionScheduler(model, cfg)
    master = model.fc1.qc_wq.master.clone()
    model.to(dtype)
    wq = model.fc1.qc_wq
    assert wq.master.dtype == torch.float32 and torch.equal(wq.master, master)
    assert wq.applied.dtype == dtype and torch.equal(wq.applied, model.fc1.weight.detach())
    for _ in range(3):
        sched.step()  # no optimizer update: the cast is not an update of the master
    assert torch.equal(wq.master, master)
    assert torch.equal(model.fc1.weight.detach(), fake_quantize(master, 8).to(dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_optimizer_step_state_follows_the_module_to_cuda():
    cfg = wq_cfg(8, 4, 2, in_forward=False)
    model = _moq_model(cfg).cuda()
    sched = CompressionScheduler(model, cfg)
    assert model.fc1.qc_wq.master.is_cuda and model.fc1.qc_wq.codes[0].is_cuda
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    for t in range(1, 5):
        _train_step(model, opt, x.cuda(), y.cuda())
        sched.step()
        m = model.fc1
        assert torch.equal(m.weight.detach(), fake_quantize(m.qc_wq.master, bits_at(t, start=8, target=4, period=2)))
    model.cpu()
    assert model.fc1.qc_wq.master.device.type == "cpu" and model.fc1.qc_wq.codes[1].device.type == "cpu"
    sched.step()


@pytest.mark.parametrize("existing_scheduler", [False, True])
def test_loaded_weights_become_the_master(existing_scheduler):
    cfg = wq_cfg(4, 4, 0, in_forward=False)
    a, b = _moq_model(cfg, seed=0), Net(seed=1)
    sched = CompressionScheduler(a, cfg) if existing_scheduler else None
    a.load_state_dict(b.state_dict())
    if existing_scheduler:
        sched.step()
    else:
        CompressionScheduler(a, cfg)
    for n in ("fc1", "fc2"):
        m, ref = getattr(a, n), getattr(b, n).weight.detach()
        assert torch.equal(m.qc_wq.master, ref)  # not B + A's old rounding error
        assert torch.equal(m.weight.detach(), fake_quantize(ref, 4))
        q, s, z, spec = m.quantized_weight()
        assert torch.equal((q.float() * s), m.weight.detach())  # codes describe the new weight
    # and the model's state_dict still loads into the original architecture
    Net().load_state_dict(a.state_dict(), strict=True)


def test_scheduler_checkpoint_restores_codes_of_the_master():
    cfg = wq_cfg(8, 4, 2, in_forward=False)
    model = _moq_model(cfg)
    sched = CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    for _ in range(5):
        _train_step(model, opt, x, y)
        sched.step()
    state, sd = model.state_dict(), sched.state_dict()
    model2 = _moq_model(cfg, seed=4)
    sched2 = CompressionScheduler(model2, cfg)
    model2.load_state_dict(state)
    sched2.load_state_dict(sd)
    for n in ("fc1", "fc2"):
        m, ref = getattr(model2, n), getattr(model, n)
        assert torch.equal(m.qc_wq.master, ref.qc_wq.master)
        for got, want in zip(m.quantized_weight()[:3], ref.quantized_weight()[:3]):
            assert (got is None and want is None) or torch.equal(got, want)


def test_scheduler_validates_its_config_and_the_rewrite():
    from qcompress import ConfigError

    cfg = wq_cfg(8, 8, 0)
    with pytest.raises(ValueError, match="init_compression"):
        CompressionScheduler(Net(), cfg)  # DeepSpeed did nothing, silently
    with pytest.raises(ConfigError, match="bogus"):
        CompressionScheduler(_moq_model(cfg), {"bogus": 1})
    CompressionScheduler(Net(), {"train_batch_size": 4})  # nothing to compress: fine
    CompressionScheduler(Net())  # no config: nothing to check
