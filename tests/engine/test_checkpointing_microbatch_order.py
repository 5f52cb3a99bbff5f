"""Activation checkpointing with static activation ranges when several micro-batches run forward
before their backwards, as pipeline schedules order them (GPipe: F0 F1 B0 B1; 1F1B's warm-up:
F0 F1 B0 F2 B1 B2). Each recompute must quantize with the range its own forward used, not the EMA
range a later micro-batch has moved since. The oracle: the same model and micro-batches in the same
order without checkpointing (autograd keeps each forward's quantized values), gradients bit for bit."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress

D = 64


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList(Blk() for _ in range(n))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _compression(fmt):
    if fmt == "int8":
        w = {"start_bits": 8, "target_bits": 8, "granularity": "channel"}
        a = {"bits": 8}
        shared_a = {"quantization_type": "asymmetric"}
    else:  # NVFP4: the static range sets the activations' global scale
        w = {"start_bits": 4, "target_bits": 4, "format": "nvfp4"}
        a = {"bits": 4, "format": "nvfp4"}
        shared_a = {}
    return {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
            "different_groups": {"w": {"params": w}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "range_calibration": "static", "schedule_offset": 0, **shared_a},
            "different_groups": {"a": {"params": a}},
        },
    }


def _model(fmt, checkpointing):
    torch.manual_seed(0)
    model = Stack()
    doc = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "compression_training": _compression(fmt),
    }
    if checkpointing:
        doc["activation_checkpointing"] = {}
    qcompress.init_compression(model, doc)
    engine = qcompress.initialize(model, doc)
    assert engine.checkpointed_blocks == (3 if checkpointing else 0)
    return engine.module


def _micro_batches(n):
    g = torch.Generator().manual_seed(7)
    # different scales per micro-batch: each one moves the EMA range visibly
    return [
        (torch.randn(2, 8, 16, generator=g) * (1.0 + 2 * i), torch.randint(0, 4, (2, 8), generator=g)) for i in range(n)
    ]


ORDERS = {"gpipe": "F0 F1 B0 B1", "1f1b": "F0 F1 B0 F2 B1 B2"}


def _run(model, order):
    """Gradients after each backward (they accumulate, as in one optimizer step) and the ranges."""
    batches = _micro_batches(1 + max(int(op[1]) for op in order.split()))
    losses, grads = {}, []
    for op in order.split():
        i = int(op[1])
        if op[0] == "F":
            x, y = batches[i]
            losses[i] = F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))
        else:
            losses.pop(i).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    ranges = {
        n: (m.qc_aq.observer.min.clone(), m.qc_aq.observer.max.clone())
        for n, m in model.named_modules()
        if getattr(m, "qc_aq", None) is not None
    }
    return grads, ranges


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
@pytest.mark.parametrize("schedule", sorted(ORDERS))
def test_each_recompute_uses_its_own_forwards_range(fmt, schedule):
    plain, ckpt = _model(fmt, False), _model(fmt, True)
    ga, ra = _run(plain, ORDERS[schedule])
    gb, rb = _run(ckpt, ORDERS[schedule])
    assert len(ga) == len(gb) and ga[0]
    for k, (a, b) in enumerate(zip(ga, gb)):
        assert a.keys() == b.keys()
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, (k, differ)
    assert ra.keys() == rb.keys() and ra
    for n in ra:  # each micro-batch folded into the EMA once, not again in its recompute
        assert torch.equal(ra[n][0], rb[n][0]) and torch.equal(ra[n][1], rb[n][1]), n


def test_recompute_after_a_retained_graph_replays_the_same_ranges():
    """A second backward through the same graph (retain_graph) recomputes again: it replays the
    same ranges, so it gives the same gradients a second time."""
    model = _model("int8", True)
    (x0, y0), (x1, y1) = _micro_batches(2)
    loss0 = F.cross_entropy(model(x0).reshape(-1, 4), y0.reshape(-1))
    F.cross_entropy(model(x1).reshape(-1, 4), y1.reshape(-1))  # moves the ranges
    loss0.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss0.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, first[n]), n
