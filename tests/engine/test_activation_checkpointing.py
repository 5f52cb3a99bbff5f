"""Activation checkpointing recomputes the blocks in the backward and changes no gradient: the
oracle is the same model and batch trained without checkpointing (fp32, bit for bit), with
fused QAT layers and static activation ranges, W4 g32, dropout, progressive layer drop and a
Hugging Face GPT-2 through its own switch."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress
from tests.helpers.tiny_models import make_gpt2

D = 64


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList(Blk() for _ in range(n))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def w8a8_static():
    return {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "symmetric",
                "schedule_offset": 0,
                "quantize_weight_in_forward": True,
            },
            "different_groups": {
                "w8": {
                    "params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0, "granularity": "channel"}
                }
            },
        },
        "activation_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "asymmetric",
                "range_calibration": "static",
                "schedule_offset": 0,
            },
            "different_groups": {"a8": {"params": {"bits": 8}}},
        },
    }


def w4_g32(group=32):
    return {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "symmetric",
                "schedule_offset": 0,
                "quantize_weight_in_forward": True,
            },
            "different_groups": {
                "w4": {
                    "params": {
                        "start_bits": 4,
                        "target_bits": 4,
                        "quantization_period": 0,
                        "granularity": "group",
                        "group_size": group,
                    }
                }
            },
        }
    }


def pld():
    return {"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.5}}


def _doc(compression, checkpointing, extra=None):
    doc = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if compression:
        doc["compression_training"] = compression
    if checkpointing is not None:
        doc["activation_checkpointing"] = checkpointing
    doc.update(extra or {})
    return doc


def _engine(model, doc):
    if "compression_training" in doc:
        qcompress.init_compression(model, doc)
    return qcompress.initialize(model, doc)


def _grads_per_step(engine, batches, loss_fn):
    """The gradients of every step (before the optimizer applies them) and the final weights."""
    out = []
    for batch in batches:
        torch.manual_seed(11)  # dropout masks: the same stream in both runs
        loss = loss_fn(engine, batch)
        engine.backward(loss)
        out.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        engine.step()
    return out


def _stack_loss(engine, batch):
    x, y = batch
    return F.cross_entropy(engine(x), y)


def _stack_batches(n=3):
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(4, 8, 16, generator=g).reshape(4, 8, 16), torch.randint(0, 4, (4, 8), generator=g))
        for _ in range(n)
    ]


def _ce(engine, batch):
    x, y = batch
    logits = engine(x)
    return F.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))


def _observer_ranges(model):
    return {
        n: (m.qc_aq.observer.min.clone(), m.qc_aq.observer.max.clone())
        for n, m in model.named_modules()
        if getattr(m, "qc_aq", None) is not None and m.qc_aq.observer.initialized
    }


def _compare(compression, checkpointing, extra=None, make=Stack, batches=None, loss_fn=_ce):
    torch.manual_seed(0)
    base = make()
    twin = copy.deepcopy(base)
    batches = batches or _stack_batches()
    plain = _engine(base, _doc(compression, None, extra))
    ckpt = _engine(twin, _doc(compression, checkpointing, extra))
    assert ckpt.checkpointed_blocks > 0 and plain.checkpointed_blocks == 0
    a = _grads_per_step(plain, batches, loss_fn)
    b = _grads_per_step(ckpt, batches, loss_fn)
    for step, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), (step, name)
    ra, rb = _observer_ranges(plain.module), _observer_ranges(ckpt.module)
    assert ra.keys() == rb.keys()
    for name in ra:  # each batch folded into the static ranges once, not again in the recompute
        assert torch.equal(ra[name][0], rb[name][0]) and torch.equal(ra[name][1], rb[name][1]), name
    for (n, p), q in zip(plain.module.named_parameters(), ckpt.module.parameters()):
        assert torch.equal(p, q), n
    return plain, ckpt


@pytest.mark.parametrize("compression", [None, "w8a8_static", "w4_g32"])
def test_checkpointed_gradients_equal_plain_ones_bit_for_bit(compression):
    cc = {"w8a8_static": w8a8_static, "w4_g32": w4_g32}.get(compression, lambda: None)()
    _, ckpt = _compare(cc, {})
    assert ckpt.checkpointed_blocks == 4
    if compression == "w8a8_static":
        assert _observer_ranges(ckpt.module)  # the static ranges were really in play


def test_with_progressive_layer_drop_and_cpu_checkpointing():
    _compare(w8a8_static(), {"cpu_checkpointing": True}, pld())


def _count_block_calls(model):
    calls = [0] * len(model.blocks)
    for i, b in enumerate(model.blocks):
        b.fc1.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("number", [None, 1, 3])
def test_number_checkpoints_recomputes_that_many_blocks(number):
    torch.manual_seed(0)
    model = Stack()
    calls = _count_block_calls(model)
    section = {} if number is None else {"number_checkpoints": number}
    engine = _engine(model, _doc(None, section))
    loss = _ce(engine, _stack_batches(1)[0])
    assert calls == [1, 1, 1, 1]
    engine.backward(loss)
    n = 4 if number is None else number
    assert calls == [2] * n + [1] * (4 - n)  # the recompute runs in the backward
    with torch.no_grad():
        engine.eval()
        engine(_stack_batches(1)[0][0])
    assert calls == [3] * n + [2] * (4 - n)  # evaluation is not checkpointed


def test_a_model_without_blocks_is_refused_by_key():
    with pytest.raises(qcompress.ConfigError, match="activation_checkpointing"):
        qcompress.initialize(nn.Linear(4, 4), _doc(None, {}))


def test_disabled_section_checkpoints_nothing():
    engine = _engine(Stack(), _doc(None, {"enabled": False}))
    assert engine.checkpointed_blocks == 0


def _gpt2_batches(n=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (4, 16), generator=g) for _ in range(n)]


def _lm_loss(engine, ids):
    return engine(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("section", [{}, {"number_checkpoints": 1, "cpu_checkpointing": True}])
def test_hf_gpt2_uses_its_own_switch_and_keeps_gradients(section):
    def make():
        return make_gpt2().train()

    plain, ckpt = _compare(w8a8_static(), section, make=make, batches=_gpt2_batches(), loss_fn=_lm_loss)
    flags = [layer.gradient_checkpointing for layer in ckpt.module.transformer.h]
    assert flags == ([True, True] if not section else [True, False])


def test_tiny_moe_keeps_gradients_and_router_loss():
    """Qwen3-MoE with quantized experts (W4 g16 on every expert matrix: 48 inputs), its router's auxiliary
    loss in the training loss: checkpointed gradients equal plain ones."""
    from tests.helpers.moe_fixtures import make_moe

    def make():
        model = make_moe("qwen3_moe").train()
        model.config.output_router_logits = True
        return model

    def loss_fn(engine, ids):
        out = engine(input_ids=ids, labels=ids, output_router_logits=True)
        assert out.aux_loss is not None and out.aux_loss > 0
        return out.loss

    _compare(w4_g32(16), {}, make=make, batches=_gpt2_batches(2), loss_fn=loss_fn)


def test_zero3_fsdp2_trains_to_the_same_weights():
    """FSDP2 (ZeRO-3, one process): the blocks' recompute gathers their shards again; the weights
    after two steps equal those of the run without checkpointing."""
    runs = []
    for section in (None, {}):
        torch.manual_seed(0)
        model = Stack()
        doc = _doc(w8a8_static(), section, {"zero_optimization": {"stage": 3}})
        engine = _engine(model, doc)
        for batch in _stack_batches(2):
            torch.manual_seed(11)
            engine.backward(_ce(engine, batch))
            engine.step()
        runs.append({n: p.full_tensor().clone() for n, p in engine.module.named_parameters()})
        import torch.distributed as dist

        dist.destroy_process_group()
    assert runs[0].keys() == runs[1].keys()
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


def test_distillation_student_checkpointed_teacher_not():
    """A distillation step (the teacher runs under no_grad, outside any checkpoint) gives the
    student the gradients it gets without checkpointing."""
    from qcompress.train.distill import logit_kl

    torch.manual_seed(0)
    teacher = Stack().eval()

    def loss_fn(engine, batch):
        x, y = batch
        with torch.no_grad():
            t = teacher(x)
        s = engine(x)
        return F.cross_entropy(s.reshape(-1, 4), y.reshape(-1)) + logit_kl(s.reshape(-1, 4), t.reshape(-1, 4), 2.0)

    _compare(w8a8_static(), {}, loss_fn=loss_fn)
