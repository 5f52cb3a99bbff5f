"""Fused compress-aware Linear / Conv (qcompress.nn.fused): int8 codes saved for backward, the
same gradients bit for bit as the unfused path, one quantization of a shared input."""

import copy
import itertools

import pytest
import torch
import torch.nn as nn

from qcompress import init_compression
from qcompress.nn import fused
from qcompress.quant import kernels

pytestmark = pytest.mark.filterwarnings("ignore:qcompress kernels are not built")
GRANULARITIES = ("tensor", "channel", "group", "groups")


@pytest.fixture(params=["kernel", "reference"])
def backend(request, monkeypatch):
    if request.param == "kernel":
        if not kernels.available():
            pytest.skip(f"the C++ kernels are not built: {kernels.load_error()}")
    else:
        monkeypatch.setattr(kernels, "_error", "forced off by the test: reference backend")
    return request.param


def make_cfg(
    granularity="channel",
    ste="identity",
    calibration="dynamic",
    in_forward=True,
    learn=False,
    symmetric=True,
    wbits=8,
    abits=8,
    share=True,
):
    qtype = "symmetric" if symmetric else "asymmetric"
    params = {"start_bits": wbits, "target_bits": wbits, "quantization_period": 0}
    shared_w = {
        "enabled": True,
        "quantize_weight_in_forward": in_forward,
        "schedule_offset": 0,
        "ste": ste,
        "quantization_type": qtype,
        "range_learning": learn,
    }
    if granularity == "groups":
        shared_w["quantize_groups"] = 4
    elif granularity == "group":
        params["group_size"] = 16
    else:
        params["granularity"] = granularity
    return {
        "compression_training": {
            "weight_quantization": {"shared_parameters": shared_w, "different_groups": {"w": {"params": params}}},
            "activation_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "range_calibration": calibration,
                    "schedule_offset": 0,
                    "quantization_type": qtype,
                    "share_input": share,
                },
                "different_groups": {"a": {"params": {"bits": abits}}},
            },
        }
    }


def make_model(kind):
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32))
    if kind == "hf_conv1d":  # GPT-2's Linear, weight stored [in, out]
        from transformers.pytorch_utils import Conv1D

        model = nn.Sequential(Conv1D(64, 48), nn.GELU(), Conv1D(32, 64))
        with torch.no_grad():
            for m in model[::2]:
                m.bias.normal_()
        return model
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1))


def make_input(kind):
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, 9, 9) if kind == "conv" else (3, 7, 48)
    return (torch.randn(shape, generator=g) * 2 + 0.3).requires_grad_(True)


def step(model, x, use_fused, autocast=None):
    """Outputs and every gradient (input, parameters) of one forward/backward, both on copies."""
    model = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_(True)
    with fused.enabled(use_fused), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = model(x)
    g = torch.Generator().manual_seed(2)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads["input"] = x.grad
    return out, grads


def assert_same(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    assert out_a.dtype == out_b.dtype and torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        ga, gb = grads_a[name], grads_b[name]
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert ga.dtype == gb.dtype and torch.equal(ga, gb), name


def fused_plans(model, x):
    """How many compress-aware modules would take the fused path now (checked on the first)."""
    first = [m for m in model.modules() if hasattr(m, "qc_aq")][0]
    return fused.plan(first, x, first.qc_kind) is not None


CASES = [
    c
    for c in itertools.product(
        ("linear", "conv"), GRANULARITIES, ("identity", "clip"), ("dynamic", "static"), (True, False), (False, True)
    )
    if not (c[5] and not c[4])
]  # range learning needs quantize_weight_in_forward


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,granularity,ste,calibration,in_forward,learn", CASES)
def test_fused_gradients_equal_unfused_bit_for_bit(
    backend, kind, granularity, ste, calibration, in_forward, learn, dtype
):
    model = make_model(kind)
    init_compression(model, make_cfg(granularity, ste, calibration, in_forward, learn))
    x = make_input(kind)
    assert fused_plans(model, x)
    if learn:
        assert model[0].weight_scale.requires_grad
    a, b = step(model, x, True, dtype), step(model, x, False, dtype)
    assert_same(a, b)
    if learn:
        assert a[1]["0.weight_scale"] is not None and a[1]["0.weight_scale"].abs().sum() > 0


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("calibration", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_asymmetric_and_4bit_weights(backend, kind, calibration, dtype):
    for cfg in (
        make_cfg("channel", "clip", calibration, True, True, symmetric=False),
        make_cfg("group", "identity", calibration, True, False, wbits=4, abits=6),
    ):
        model = make_model(kind)
        init_compression(model, cfg)
        x = make_input(kind)
        assert fused_plans(model, x)
        assert_same(step(model, x, True, dtype), step(model, x, False, dtype))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("in_forward,learn", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fused_transformers_conv1d(backend, granularity, in_forward, learn, dtype):
    pytest.importorskip("transformers", reason="transformers provides GPT-2's Conv1D")
    model = make_model("hf_conv1d")
    init_compression(model, make_cfg(granularity, "clip", "dynamic", in_forward, learn, symmetric=False))
    x = make_input("hf_conv1d")
    assert fused_plans(model, x)
    assert_same(step(model, x, True, dtype), step(model, x, False, dtype))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_fused_fp16_autocast(backend, kind):
    for cfg in (make_cfg("channel", "clip", "dynamic", True, True), make_cfg("tensor", "identity", "static", False)):
        model = make_model(kind)
        init_compression(model, cfg)
        x = make_input(kind)
        assert fused_plans(model, x)
        assert_same(step(model, x, True, torch.float16), step(model, x, False, torch.float16))


def test_fused_bf16_inputs_and_weights(backend):
    """bf16 model and input (no autocast): codes dequantize to the fake quantizer's bf16 values."""
    model = make_model("linear").to(torch.bfloat16)
    init_compression(model, make_cfg("channel", "clip", "dynamic", True, False, symmetric=False))
    x = make_input("linear").detach().to(torch.bfloat16).requires_grad_(True)
    assert fused_plans(model, x)
    assert_same(step(model, x, True), step(model, x, False))


def weight_only_cfg(granularity, ste, learn, wbits=4, symmetric=True):
    cfg = make_cfg(granularity, ste, "dynamic", True, learn, symmetric=symmetric, wbits=wbits)
    del cfg["compression_training"]["activation_quantization"]
    return cfg


WEIGHT_ONLY = [
    c
    for c in itertools.product(
        ("linear", "conv", "hf_conv1d"), GRANULARITIES, ("identity", "clip"), (False, True), (True, False)
    )
]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,granularity,ste,learn,symmetric", WEIGHT_ONLY)
def test_fused_weight_only_gradients_equal_unfused_bit_for_bit(
    backend, kind, granularity, ste, learn, symmetric, dtype
):
    # no activation quantization: the Function keeps the input itself and recomputes w^
    if kind == "hf_conv1d":
        pytest.importorskip("transformers", reason="transformers provides GPT-2's Conv1D")
    model = make_model(kind)
    init_compression(model, weight_only_cfg(granularity, ste, learn, symmetric=symmetric))
    x = make_input(kind)
    first = model[0]
    assert first.qc_aq is None or not first.qc_aq.active
    assert fused.plan(first, x, first.qc_kind) is not None
    assert_same(step(model, x, True, dtype), step(model, x, False, dtype))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only_keeps_what_fp32_keeps(backend, dtype):
    # saved for backward: the input, cast as autocast casts it, and nothing weight-sized: the
    # plain Linear's bytes in fp32, fewer under autocast (where it also keeps the weight's bf16
    # cast); unfused QAT also keeps w^ (a float copy of the weight)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 192))
    model = copy.deepcopy(plain)
    init_compression(model, weight_only_cfg("group", "clip", False))
    x = (torch.randn(4, 64, 256) * 3).requires_grad_(True)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    kept, fp32 = saved_tensors(model, x, True, dtype), saved_tensors(plain, x, True, dtype)
    assert nbytes(kept) == x.numel() * (2 if dtype else 4)
    assert nbytes(kept) == nbytes(fp32) if dtype is None else nbytes(kept) < nbytes(fp32)
    assert not any(t.numel() == model[0].weight.numel() for t in kept)
    unfused = saved_tensors(model, x, False, dtype)
    assert any(t.numel() == model[0].weight.numel() and t.is_floating_point() for t in unfused)
    assert nbytes(unfused) >= nbytes(kept) + model[0].weight.numel() * (2 if dtype else 4)


# --- what backward keeps ---------------------------------------------------------------------------


def saved_tensors(model, x, use_fused, autocast=None):
    """Every tensor autograd packs for backward during one forward, and the parameters' storages."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with (
        fused.enabled(use_fused),
        torch.autocast("cpu", dtype=autocast, enabled=autocast is not None),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return [t for t in packed if t.untyped_storage().data_ptr() not in params]


@pytest.mark.parametrize("in_forward", [True, False], ids=["quantize_in_forward", "optimizer_step"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_tensors_are_the_integer_codes(backend, in_forward, dtype):
    from qcompress.quant import reference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192))
    init_compression(model, make_cfg("channel", "clip", "dynamic", in_forward, False, symmetric=False))
    x = (torch.randn(4, 64, 256) * 3).requires_grad_(True)
    kept = saved_tensors(model, x, True, dtype)
    # the input's int8 codes (the reference quantizer's, an independent oracle), its per-token
    # scale and zero point; nothing weight-sized (the weight is recomputed from the Parameter)
    codes = [t for t in kept if t.dtype == torch.int8]
    assert len(codes) == 1 and codes[0].shape == x.shape
    want, _, _ = reference.quantize(x, model[0].input_spec())
    assert torch.equal(codes[0], want)
    assert all(t.numel() <= x.shape[0] * x.shape[1] for t in kept if t is not codes[0])
    fused_bytes = sum(t.numel() * t.element_size() for t in kept)
    float_input = x.numel() * x.element_size()
    assert fused_bytes < float_input / 3
    # the unfused path keeps a float copy of the input (and, in forward mode, of the weight)
    unfused = saved_tensors(model, x, False, dtype)
    assert any(t.numel() == x.numel() and t.is_floating_point() for t in unfused)
    assert sum(t.numel() * t.element_size() for t in unfused) > fused_bytes


def test_falls_back_where_the_codes_do_not_suffice():
    """Learned activation ranges (LSQ needs x / s) and pruning masks keep the composed path."""
    model = nn.Sequential(nn.Linear(16, 8))
    cfg = make_cfg("channel", "identity", "static")
    cfg["compression_training"]["activation_quantization"]["shared_parameters"]["range_learning"] = True
    init_compression(model, cfg)
    x = torch.randn(2, 3, 16)
    model[0].qc_aq.learned_ready = True
    assert fused.plan(model[0], x, "linear") is None
    model2 = nn.Sequential(nn.Linear(16, 8))
    cfg = make_cfg("channel")
    cfg["compression_training"]["activation_quantization"]["shared_parameters"]["fused_backward"] = False
    init_compression(model2, cfg)
    assert fused.plan(model2[0], x, "linear") is None


# --- one quantization of a shared input ------------------------------------------------------------


class Attention(nn.Module):
    """Q, K, V as separate Linears over the same hidden states (BERT / GPT-2 style)."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        return x + self.o(att @ v)


def make_attention(share=True, calibration="dynamic"):
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), Attention())
    init_compression(model, make_cfg("channel", "clip", calibration, True, False, share=share))
    return model


def count_quantize(monkeypatch):
    """Every pass of an activation quantizer over an input (codes, and values with them or not)."""
    calls = []
    real = fused._quantize

    def counting(x, spec, lo, hi, values):
        out = real(x, spec, lo, hi, values)
        calls.append((x, out))
        return out

    monkeypatch.setattr(fused, "_quantize", counting)
    return calls


def test_qkv_quantize_their_shared_input_once(backend, monkeypatch):
    from qcompress.quant import reference

    x = make_input("linear")[..., :32].detach().requires_grad_(True)
    seen = {}
    real_codes = fused._input_codes

    def spy(mod, t, spec, values=False):
        out = real_codes(mod, t, spec, values)
        seen[mod.qc_name] = (t, out[:3])
        return out

    monkeypatch.setattr(fused, "_input_codes", spy)
    calls = count_quantize(monkeypatch)
    shared = step(make_attention(True), x, True)
    # per block: one quantization for Q/K/V, one for the output projection
    assert len(calls) == 4
    for block in ("0", "1"):
        hq, codes = seen[f"{block}.q"]
        assert all(a is b for m in "kv" for a, b in zip(seen[f"{block}.{m}"][1], codes))
        want = reference.quantize(hq, fused.plan(make_attention()[0].q, hq, "linear").spec)
        assert torch.equal(codes[0], want[0]) and torch.equal(codes[1], want[1])
    calls.clear()
    separate = step(make_attention(False), x, True)
    assert len(calls) == 8
    assert_same(shared, separate)
    assert_same(shared, step(make_attention(True), x, False))


@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_float_forward_takes_the_values_from_the_quantizer_pass(monkeypatch, calibration):
    """The float forward multiplies the x^ the quantizer wrote with the codes (quantize_values): it
    dequantizes only for siblings that reuse shared codes; backward dequantizes once per module."""
    if not kernels.available():
        pytest.skip(f"the C++ kernels are not built: {kernels.load_error()}")
    deq = []
    real = fused._dequantize
    monkeypatch.setattr(fused, "_dequantize", lambda *a, **k: deq.append(1) or real(*a, **k))
    calls = count_quantize(monkeypatch)
    model = make_attention(True, calibration)
    x = make_input("linear")[..., :32].detach().requires_grad_(True)
    out = model(x)
    shared = calibration == "dynamic"  # Q/K/V share one quantization of their input
    assert len(calls) == (4 if shared else 8) and all(o[3] is not None for _, o in calls)
    assert len(deq) == (4 if shared else 0)  # K and V of each block: the codes only
    deq.clear()
    out.sum().backward()
    assert len(deq) == 8  # every module's weight gradient needs x^
    assert_same(step(make_attention(True, calibration), x, True), step(make_attention(True, calibration), x, False))


def test_static_ranges_are_not_shared(monkeypatch):
    calls = count_quantize(monkeypatch)
    x = make_input("linear")[..., :32].detach().requires_grad_(True)
    model = make_attention(True, "static")
    a = step(model, x, True)
    assert len(calls) == 8  # every module's observer sees its input
    assert_same(a, step(model, x, False))


@pytest.mark.parametrize("reentrant", [False, True])
def test_shared_input_under_activation_checkpointing(backend, monkeypatch, reentrant):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            for block in self.inner:
                x = checkpoint(block, x, use_reentrant=reentrant)
            return x

    x = make_input("linear")[..., :32].detach().requires_grad_(True)
    model = make_attention(True)
    plain = step(model, x, True)
    calls = count_quantize(monkeypatch)
    ckpt = step(Checkpointed(model), x, True)
    assert len(calls) == 8  # forward (4) and the recompute in backward (4)
    out, grads = ckpt
    assert_same(plain, (out, {k.replace("inner.", "", 1): v for k, v in grads.items()}))


def test_shared_input_with_hooks_that_change_the_input(backend):
    """A pre-hook returning a new tensor (K) and one changing the input in place (V): those
    modules quantize what they are given, as with sharing off and as unfused."""

    def new_tensor(mod, args):
        return (args[0] * 1.5,)

    def in_place(mod, args):
        args[0].add_(0.25)

    x = make_input("linear")[..., :32].detach().requires_grad_(True)
    runs = []
    for share, use_fused in ((True, True), (False, True), (True, False)):
        model = make_attention(share)
        model[0].k.register_forward_pre_hook(new_tensor)
        model[1].v.register_forward_pre_hook(in_place)
        runs.append(step(model, x, use_fused))
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])


@pytest.mark.parametrize("kind", ["linear", "conv", "hf_conv1d"])
@pytest.mark.parametrize("frozen", ["weights", "first_layer", "input"])
def test_fused_partial_gradients(backend, kind, frozen):
    """Only some gradients asked for (frozen weights, a frozen first layer, an input without
    gradient): the same ones as unfused, and nothing for the rest."""
    if kind == "hf_conv1d":
        pytest.importorskip("transformers", reason="transformers provides GPT-2's Conv1D")
    model = make_model(kind)
    init_compression(model, make_cfg("channel", "clip", "dynamic", True, False))
    if frozen == "weights":
        for m in model[::2]:
            m.weight.requires_grad_(False)
    elif frozen == "first_layer":
        model[0].requires_grad_(False)
    x = make_input(kind)
    if frozen == "input":
        x = x.detach()
    runs = []
    for use_fused in (True, False):
        m = copy.deepcopy(model)
        xi = x.detach().clone().requires_grad_(frozen != "input")
        with fused.enabled(use_fused):
            out = m(xi)
        out.square().sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        grads["input"] = xi.grad
        runs.append((out, grads))
    assert_same(*runs)
