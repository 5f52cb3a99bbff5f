"""LoRA adapters on compress-aware layers (qcompress/nn/lora.py, nn/qlora.py): the merged weight the
quantizer sees (mode qat), the stored base (mode qlora), their gradients, against formulas written
here with the reference quantizer."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import qcompress as qc
from qcompress.nn import fused, lora
from qcompress.quant.api import fake_quantize

from tests.helpers.lora_fixtures import adapted, compressed, lora_cfg

SCALE = 8 / 4  # alpha / r of lora_cfg


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))


def _cfg(mode="qat", **lora_extra):
    return lora_cfg(mode, targets=["0", "2"], wq_modules=["0", "2"], lora_extra=lora_extra)


def _randomize_b(model):
    with torch.no_grad():
        for _, m in adapted(model):
            if "lora_B" in m._parameters:
                m.lora_B.normal_()


def _ref_fq(w):
    return fake_quantize(w, 4, symmetric=True, granularity="group", group_size=16, backend="reference")


def test_qat_quantizes_the_merged_weight():
    model = qc.init_compression(_mlp(), _cfg())
    _randomize_b(model)
    for layer in (model[0], model[2]):
        merged = layer.weight + (layer.lora_B @ layer.lora_A) * SCALE
        want = _ref_fq(merged.detach())
        assert torch.equal(layer.effective_weight().detach(), want)
        q, s, z, spec = layer.quantized_weight()
        assert torch.equal((q.float() * s.repeat_interleave(16, dim=1)), want)


def test_qat_adapters_start_as_the_base_and_only_they_train():
    model = qc.init_compression(_mlp(), _cfg())
    base = _mlp()
    for layer, plain in ((model[0], base[0]), (model[2], base[2])):
        assert torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B))  # B starts at zero
        assert torch.equal(layer.effective_weight().detach(), _ref_fq(plain.weight.detach()))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]


def test_qat_fused_and_composed_paths_agree_bit_for_bit():
    x = torch.randn(5, 32)
    got = {}
    for flag in (True, False):
        model = qc.init_compression(_mlp(), _cfg())
        _randomize_b(model)
        with fused.enabled(flag):
            y = model(x)
            y.square().sum().backward()
        got[flag] = (y.detach(), [p.grad for p in model.parameters() if p.requires_grad])
    assert torch.equal(got[True][0], got[False][0])
    for a, b in zip(got[True][1], got[False][1]):
        assert torch.equal(a, b)


def test_qat_gradients_follow_the_straight_through_estimator():
    """dL/dA = s B^T G and dL/dB = s G A^T, G the gradient of the quantized merged weight."""
    model = qc.init_compression(_mlp(), _cfg())
    _randomize_b(model)
    layer = model[0]
    x = torch.randn(6, 32)
    y = layer(x)
    g_out = torch.randn_like(y)
    y.backward(g_out)
    a, b = layer.lora_A.detach(), layer.lora_B.detach()
    wq = _ref_fq((layer.weight + (b @ a) * SCALE).detach())
    torch.testing.assert_close(y, x @ wq.t() + layer.bias)
    G = g_out.t() @ x  # dL/dWq
    torch.testing.assert_close(layer.lora_A.grad, SCALE * b.t() @ G)
    torch.testing.assert_close(layer.lora_B.grad, SCALE * G @ a.t())
    assert layer.weight.grad is None and not layer.weight.requires_grad


def test_qat_backward_keeps_no_float_copy_of_the_weight():
    """The fused path recomputes W + (B A) s and its quantization in backward: no [out, in] float
    tensor besides the Parameters is saved for backward."""
    model = qc.init_compression(nn.Sequential(nn.Linear(256, 256)), lora_cfg("qat", targets=["0"], wq_modules=["0"]))
    layer = model[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(4, 256)).sum().backward()
    held = {id(p) for p in layer.parameters()}
    big = [
        t
        for t in saved
        if t.numel() >= 256 * 256
        and id(t) not in held
        and t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()
    ]
    assert not big, [tuple(t.shape) for t in big]


def test_qlora_stores_codes_and_computes_pefts_forward():
    base = _mlp()
    model = qc.init_compression(_mlp(), _cfg("qlora"))
    _randomize_b(model)
    layer = model[0]
    assert "weight" not in layer._parameters
    assert layer.qlora_codes.dtype == torch.int8
    assert "0.weight" not in model.state_dict() and "0.qlora_codes" in model.state_dict()
    deq = _ref_fq(base[0].weight.detach())
    assert torch.equal(layer.weight, deq)  # the stored base is the quantized weight
    x = torch.randn(5, 32, requires_grad=True)
    y = layer(x)
    want = F.linear(x, deq, base[0].bias) + F.linear(F.linear(x, layer.lora_A), layer.lora_B) * SCALE
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    gx, ga, gb = torch.autograd.grad(y, (x, layer.lora_A, layer.lora_B), g)
    wx, wa, wb = torch.autograd.grad(want, (x, layer.lora_A, layer.lora_B), g)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(ga, wa)
    torch.testing.assert_close(gb, wb)


def test_qlora_dropout_is_on_the_adapter_input_only():
    model = qc.init_compression(_mlp(), _cfg("qlora", dropout=0.5))
    _randomize_b(model)
    layer = model[0]
    x = torch.randn(64, 32)
    model.train()
    torch.manual_seed(3)
    y = layer(x)
    torch.manual_seed(3)
    drop = F.dropout(x, 0.5, True)
    want = F.linear(x, layer.weight, layer.bias) + F.linear(F.linear(drop, layer.lora_A), layer.lora_B) * SCALE
    assert torch.equal(y, want)
    model.eval()
    assert torch.equal(
        layer(x), F.linear(x, layer.weight, layer.bias) + F.linear(F.linear(x, layer.lora_A), layer.lora_B) * SCALE
    )


def test_qlora_codes_follow_to_and_state_dict_round_trip():
    model = qc.init_compression(_mlp(), _cfg("qlora"))
    _randomize_b(model)
    x = torch.randn(3, 32)
    want = model(x)
    model.to(torch.float64).to(torch.float32)  # buffers are rebuilt; codes must follow
    assert torch.equal(model(x), want)
    other = qc.init_compression(_mlp(seed=5), _cfg("qlora"))
    other.load_state_dict(model.state_dict())
    assert torch.equal(other(x), want)
    assert torch.equal(other[0].quantized_weight()[0], model[0].qlora_codes)


def test_gpt2_conv1d_merges_in_its_layout():
    """transformers' Conv1D stores [in, out]: the merged weight is W + (B A)^T s (peft's fan_in_fan_out)."""
    from tests.helpers.tiny_models import make_gpt2

    model = make_gpt2()
    qc.init_compression(model, lora_cfg("qat", targets=["c_attn"], wq_modules=["c_attn"], group_size=32))
    _randomize_b(model)
    layer = model.transformer.h[0].attn.c_attn
    merged = layer.weight + (layer.lora_B @ layer.lora_A).t() * SCALE
    want = fake_quantize(
        merged.detach().t(), 4, symmetric=True, granularity="group", group_size=32, backend="reference"
    ).t()
    assert torch.equal(layer.effective_weight().detach(), want)


def test_llama_trains_in_both_modes():
    for mode in ("qat", "qlora"):
        model = compressed(mode)
        names = [n for n, _ in adapted(model)]
        assert len(names) == 6, names  # q, v, down of 2 blocks
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        x = torch.randint(0, 64, (2, 8))
        first = None
        for _ in range(4):
            loss = model(input_ids=x, labels=x).loss
            first = first if first is not None else loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert loss.item() < first, mode
        states = opt.state_dict()["state"]
        assert len(states) == 12  # A and B of 6 layers, nothing else


@pytest.mark.parametrize("mode", ["qat", "qlora"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    x = torch.randint(0, 64, (2, 8))
    grads = []
    for ckpt in (False, True):
        model = compressed(mode)
        for _, m in adapted(model):
            if "lora_B" in m._parameters:
                with torch.no_grad():
                    m.lora_B.normal_(generator=torch.Generator().manual_seed(1))
        model.train()
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=x, labels=x).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_qat_with_learned_ranges_trains_the_scales_too():
    model = qc.init_compression(
        _mlp(), lora_cfg("qat", targets=["0", "2"], wq_modules=["0", "2"], params_extra={"range_learning": True})
    )
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["0.lora_A", "0.lora_B", "0.weight_scale", "2.lora_A", "2.lora_B", "2.weight_scale"]
    _randomize_b(model)
    model(torch.randn(4, 32)).sum().backward()
    assert model[0].weight_scale.grad is not None and model[0].weight_scale.grad.abs().sum() > 0
    assert model[0].lora_B.grad.abs().sum() > 0


class _Layer:
    """What lora.merge and merge_grads read of a layer: its kind and its LoRA state."""

    def __init__(self, kind, scaling):
        self.qc_kind = kind
        self.__dict__["qc_lora"] = lora.LoraState(mode="qat", r=4, alpha=4 * scaling, scaling=scaling, dropout=0.0)


@pytest.mark.parametrize("kind", ["linear", "hf_conv1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "column_major"])
@pytest.mark.parametrize("need_w", [False, True])
def test_merge_grads_are_autograds_bit_for_bit(kind, dtype, layout, need_w):
    """lora.merge_grads (the fused backward's) against autograd through lora.merge itself: the same
    tensors, strides included, for both layouts, a low-precision base and column-major adapters."""
    g = torch.Generator().manual_seed(0)
    out_f, in_f, r = 48, 40, 4
    layer = _Layer(kind, 0.37)
    w = torch.randn((out_f, in_f) if kind == "linear" else (in_f, out_f), generator=g).to(dtype)
    a = torch.randn(r, in_f, generator=g)
    b = torch.randn(out_f, r, generator=g)
    if layout == "column_major":
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    w_in, a_in, b_in = w.clone().requires_grad_(need_w), a.clone().requires_grad_(), b.clone().requires_grad_()
    merged = lora.merge(layer, w_in, a_in, b_in)
    with torch.no_grad():
        assert torch.equal(merged, lora.merge(layer, w, a, b))  # the in-place scaling: the same values
    grad = torch.randn(merged.shape, generator=g).to(dtype)
    want = torch.autograd.grad(merged, [t for t in (w_in, a_in, b_in) if t.requires_grad], grad)
    for own in (False, True):
        got = lora.merge_grads(layer, grad.clone(), w, a, b, need_w=need_w, own_grad=own)
        got = [t for t in got if t is not None]
        assert len(got) == len(want)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.stride() == y.stride() and torch.equal(x, y)


class _WeightSized(TorchDispatchMode):
    """Counts the storages of at least `nbytes` that ops make and that are alive at once (the most
    seen after any op): a tensor stays counted until its last reference, autograd's included, goes."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.users, self.most = nbytes, {}, 0

    def _drop(self, key):
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.nbytes:
                key = t.untyped_storage().data_ptr()
                self.users[key] = self.users.get(key, 0) + 1
                weakref.finalize(t, self._drop, key)
        self.most = max(self.most, len(self.users))
        return out


def test_qat_makes_no_more_than_two_weight_size_tensors_at_once():
    """The fused LoRA layer merges and quantizes without a graph, scales in place and gives the
    merged weight's gradient the merge's own backward (lora.merge_grads): in forward the merged
    weight and w^, in backward w^ and its gradient are the only weight-size tensors alive at once
    (a recorded merge kept a third)."""
    n = 256
    model = qc.init_compression(
        nn.Sequential(nn.Linear(n, n, bias=False)), lora_cfg("qat", targets=["0"], wq_modules=["0"])
    )
    _randomize_b(model)
    x = torch.randn(3, n, requires_grad=True)
    with _WeightSized(n * n * 4) as fwd:
        y = model(x)
    with _WeightSized(n * n * 4) as bwd:
        y.square().sum().backward()
    assert (fwd.most, bwd.most) == (2, 2)
    assert model[0].lora_A.grad is not None and model[0].lora_B.grad is not None
