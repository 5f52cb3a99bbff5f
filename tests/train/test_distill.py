"""Quantization-aware distillation: the `compression_training.distillation` config section and
qcompress.train.distill (logit_kl, causal_lm_mask, Distiller, load_teacher).

Oracles: the KL written out with explicit exp/log sums in float64, hidden-state MSE written out
pair by pair, and the closed form (1 - alpha) * task + alpha * KD."""

import copy
import math
import os
import types
import warnings

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.config import to_dict
from qcompress.config.compression import Distillation
from qcompress.train.distill import Distiller, causal_lm_mask, load_teacher, logit_kl

WQ = {
    "shared_parameters": {"enabled": True},
    "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}}},
}


def kd_cfg(**kd):
    return qc.load_config({"compression_training": {"distillation": {"enabled": True, **kd}}})


# --- config ------------------------------------------------------------------------------------


def test_config_defaults_and_round_trip():
    kd = qc.load_config({}).compression.distillation
    assert kd == Distillation()
    assert (kd.enabled, kd.teacher, kd.temperature, kd.alpha, kd.hidden_mse, kd.teacher_layer) == (
        False,
        "self",
        1.0,
        0.5,
        0.0,
        None,
    )
    doc = {
        "enabled": True,
        "teacher": "/models/teacher",
        "temperature": 2,
        "alpha": 0.25,
        "hidden_mse": 0.5,
        "teacher_layer": [1, 3],
    }
    parsed = qc.load_config({"compression_training": {"distillation": doc}}).compression.distillation
    assert parsed.temperature == 2.0 and parsed.teacher_layer == (1, 3)
    assert to_dict(parsed) == {**doc, "temperature": 2.0}
    again = qc.load_config({"compression_training": {"distillation": to_dict(parsed)}})
    assert again.compression.distillation == parsed


@pytest.mark.parametrize(
    "kd, path, words",
    [
        ({"alpha": 1.5}, "compression_training.distillation.alpha", "<= 1.0"),
        ({"alpha": -0.1}, "compression_training.distillation.alpha", ">= 0.0"),
        ({"temperature": 0}, "compression_training.distillation.temperature", "> 0.0"),
        ({"hidden_mse": -1}, "compression_training.distillation.hidden_mse", ">= 0.0"),
        ({"teacher": ""}, "compression_training.distillation.teacher", "'self' or the path"),
        ({"teacher": 3}, "compression_training.distillation.teacher", "'self' or the path"),
        ({"teacher_layer": [0, -2]}, "compression_training.distillation.teacher_layer[1]", ">= 0"),
        ({"teacher_layer": 2}, "compression_training.distillation.teacher_layer", "list"),
        ({"enabled": "yes"}, "compression_training.distillation.enabled", "true or false"),
        ({"temprature": 2}, "compression_training.distillation.temprature", "did you mean 'temperature'"),
    ],
)
def test_config_errors_name_the_key_path(kd, path, words):
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config({"compression_training": {"distillation": kd}})
    assert err.value.path == path
    assert words in str(err.value)


def test_config_teacher_layer_must_match_layer_reduction():
    lr = {"enabled": True, "module_name_prefix": "layers", "teacher_layer": [1, 3]}
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config({"compression_training": {"layer_reduction": lr, "distillation": {"teacher_layer": [0]}}})
    assert err.value.path == "compression_training.distillation.teacher_layer"
    assert "layer_reduction" in str(err.value)


def test_init_compression_ignores_the_section():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    cfg = qc.load_config(
        {
            "compression_training": {
                "weight_quantization": WQ,
                "distillation": {"enabled": True, "alpha": 1.0, "hidden_mse": 0.5, "teacher_layer": [0, 1]},
            }
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qc.init_compression(model, cfg)
        sched = qc.CompressionScheduler(model, cfg)
    assert sched.current_bits() == {"0": 8, "2": 8}


# --- logit_kl: explicit formula ------------------------------------------------------------------


def _kl_rows(student, teacher, T):
    """[(row index, T^2 * sum_c p_t (log p_t - log p_s))] with explicit exp / log in float64."""
    out = []
    s, t = student.double().reshape(-1, student.shape[-1]), teacher.double().reshape(-1, teacher.shape[-1])
    for r in range(s.shape[0]):
        zs = [math.exp(v / T) for v in s[r].tolist()]
        zt = [math.exp(v / T) for v in t[r].tolist()]
        ps = [v / sum(zs) for v in zs]
        pt = [v / sum(zt) for v in zt]
        out.append(T * T * sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, ps)))
    return out


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0, 4.0])
def test_logit_kl_classification_matches_formula(T):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 4, generator=g) * 2, torch.randn(5, 4, generator=g) * 2
    rows = _kl_rows(s, t, T)
    assert logit_kl(s, t, T).item() == pytest.approx(sum(rows) / len(rows), rel=1e-5)


@pytest.mark.parametrize("T", [0.5, 1.0, 3.0])
def test_logit_kl_causal_lm_with_label_mask_matches_formula(T):
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g)
    labels = torch.tensor([[7, 1, 2, -100, -100], [-100, 4, 5, 0, 3]])
    mask = causal_lm_mask(labels)
    # logits at position i predict labels[i + 1]: counted where that label is not -100
    assert mask.tolist() == [[True, True, False, False, False], [True, True, True, True, False]]
    rows = _kl_rows(s, t, T)
    kept = [rows[b * 5 + i] for b in range(2) for i in range(4) if labels[b, i + 1] != -100]
    assert len(kept) == 6
    assert logit_kl(s, t, T, mask).item() == pytest.approx(sum(kept) / len(kept), rel=1e-5)
    # without a mask every position counts
    assert logit_kl(s, t, T).item() == pytest.approx(sum(rows) / len(rows), rel=1e-5)


def test_logit_kl_edge_cases():
    s = torch.randn(2, 3, 4, requires_grad=True)
    none = logit_kl(s, s.detach() + 1, 1.0, torch.zeros(2, 3, dtype=torch.bool))
    assert none.item() == 0.0
    none.backward()  # still differentiable, gradient zero
    assert s.grad.abs().max().item() == 0.0
    half = logit_kl(s.half(), s.detach().half(), 2.0)
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        logit_kl(s, s, 0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        logit_kl(s, s[:, :2], 1.0)
    with pytest.raises(ValueError, match="mask has shape"):
        logit_kl(s, s, 1.0, torch.ones(2, 4, dtype=torch.bool))


# --- Distiller ---------------------------------------------------------------------------------


def _out(logits, hidden=None):
    return types.SimpleNamespace(logits=logits, hidden_states=hidden)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_total_is_the_weighted_sum(alpha):
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(4, 3, generator=g)
    task = torch.tensor(1.7)
    kd = Distiller(nn.Identity(), Distillation(enabled=True, temperature=2.0, alpha=alpha))
    total, task_out, distill = kd.loss(_out(s), t, task)  # teacher as a plain logits tensor
    want_kd = sum(_kl_rows(s.detach(), t, 2.0)) / 4
    assert distill.item() == pytest.approx(want_kd, rel=1e-5)
    assert task_out is task
    assert total.item() == pytest.approx((1 - alpha) * 1.7 + alpha * want_kd, rel=1e-5)


def test_task_loss_missing_needs_alpha_one():
    s = torch.randn(2, 3)
    kd = Distiller(nn.Identity(), Distillation(enabled=True, alpha=1.0))
    total, task, distill = kd.loss(s, s + 1, None)
    assert task.item() == 0.0 and total.item() == pytest.approx(distill.item())
    with pytest.raises(ValueError, match="alpha"):
        Distiller(nn.Identity(), Distillation(enabled=True, alpha=0.5)).loss(s, s, None)


def _hidden(seed, n, shape=(2, 3, 4)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(n))


@pytest.mark.parametrize(
    "mapping, teacher_depth, pairs",
    [
        ((1, 3), 4, [(0, 0), (1, 2), (2, 4)]),  # layer reduction: embeddings, then teacher_layer + 1
        ((0, 1), 2, [(0, 0), (1, 1), (2, 2)]),
        (None, 2, [(0, 0), (1, 1), (2, 2)]),  # identity when nothing is set
    ],
)
def test_hidden_mse_follows_the_mapping(mapping, teacher_depth, pairs):
    sh, th = _hidden(4, 3), _hidden(5, teacher_depth + 1)
    logits_s, logits_t = torch.randn(2, 3), torch.randn(2, 3)
    kd = Distiller(nn.Identity(), Distillation(enabled=True, temperature=1.5, hidden_mse=0.25), mapping)
    assert kd.needs_hidden_states
    got = kd.distill_loss(_out(logits_s, sh), _out(logits_t, th))
    mse = sum(((sh[i] - th[j]) ** 2).mean().item() for i, j in pairs)
    kl = sum(_kl_rows(logits_s, logits_t, 1.5)) / 2
    assert got.item() == pytest.approx(kl + 0.25 * mse, rel=1e-5)


def test_hidden_mse_errors():
    kd = Distiller(nn.Identity(), Distillation(enabled=True, hidden_mse=1.0))
    s = torch.randn(2, 3)
    with pytest.raises(ValueError, match="equal depth"):
        kd.distill_loss(_out(s, _hidden(0, 3)), _out(s, _hidden(1, 5)))
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        kd.distill_loss(s, _out(s, _hidden(1, 3)))


def test_from_config_picks_the_mapping():
    teacher = nn.Linear(2, 2)
    assert Distiller.from_config({}, teacher) is None
    assert Distiller.from_config(kd_cfg(), teacher).teacher_layer is None
    assert Distiller.from_config(kd_cfg(teacher_layer=[2, 5]), teacher).teacher_layer == (2, 5)
    lr = {"enabled": True, "module_name_prefix": "layers", "teacher_layer": [1, 3]}
    cfg = qc.load_config({"compression_training": {"layer_reduction": lr, "distillation": {"enabled": True}}})
    assert Distiller.from_config(cfg, teacher).teacher_layer == (1, 3)
    with pytest.raises(TypeError, match="Distillation"):
        Distiller(teacher, kd_cfg())


class Recorder(nn.Module):
    """Records how it was called; returns logits and hidden states like a HF model."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = []

    def forward(self, x, output_hidden_states=False, **kw):
        self.calls.append(
            dict(kw, training=self.training, output_hidden_states=output_hidden_states, grad=torch.is_grad_enabled())
        )
        return _out(self.lin(x), (x, x) if output_hidden_states else None)


def test_teacher_outputs_eval_no_grad_no_labels():
    teacher = Recorder()
    kd = Distiller(teacher, Distillation(enabled=True, hidden_mse=0.1))
    assert all(not p.requires_grad for p in teacher.parameters())
    teacher.train()
    out = kd.teacher_outputs({"x": torch.randn(4, 3), "labels": torch.zeros(4), "attention_mask": 1})
    assert teacher.calls == [{"attention_mask": 1, "training": False, "output_hidden_states": True, "grad": False}]
    assert not out.logits.requires_grad
    kd_plain = Distiller(Recorder(), Distillation(enabled=True))
    kd_plain.teacher_outputs(torch.randn(1, 3))  # a positional tensor batch
    assert kd_plain.teacher.calls[0]["output_hidden_states"] is False


# --- gradients ---------------------------------------------------------------------------------


def _tiny_bert(seed=0):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(cfg)


def test_alpha_one_and_teacher_equal_to_student_gives_zero_gradient():
    student = _tiny_bert()
    cfg = qc.load_config(
        {
            "compression_training": {
                "weight_quantization": WQ,
                "distillation": {"enabled": True, "alpha": 1.0, "temperature": 2.0, "hidden_mse": 0.5},
            }
        }
    )
    teacher = load_teacher("self", student, lambda p: None)
    qc.init_compression(student, cfg)
    qc.init_compression(teacher, cfg)  # the same compressed function as the student
    kd = Distiller.from_config(cfg, teacher)
    batch = {
        "input_ids": torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(0)),
        "labels": torch.tensor([0, 1, 2, 1]),
    }

    def grads(distiller):
        student.zero_grad()
        student.eval()  # no dropout: the two forwards are identical
        out = student(**batch, output_hidden_states=True)
        total, _, _ = distiller.loss(out, distiller.teacher_outputs(batch), out.loss)
        total.backward()
        return {n: p.grad.abs().max().item() for n, p in student.named_parameters() if p.requires_grad}

    same = grads(kd)
    assert len(same) == sum(1 for p in student.parameters())
    assert max(same.values()) < 1e-7, max(same.items(), key=lambda kv: kv[1])
    # control: a different teacher moves every layer of the student
    other = _tiny_bert(seed=1)
    qc.init_compression(other, cfg)
    moved = grads(Distiller.from_config(cfg, other))
    assert max(moved.values()) > 1e-3


# --- load_teacher ------------------------------------------------------------------------------


def test_load_teacher_self_is_a_frozen_full_precision_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    teacher = load_teacher("self", model, lambda p: pytest.fail("no folder to load"))
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    assert all(p.requires_grad for p in model.parameters()) and model.training
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(teacher.parameters(), model.parameters()))
    before = copy.deepcopy(teacher.state_dict())
    cfg = qc.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"g": {"params": {"start_bits": 2, "target_bits": 2}}},
                }
            }
        }
    )
    qc.init_compression(model, cfg)  # the student is quantized, the teacher is not
    assert type(teacher[0]) is nn.Linear
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert not torch.equal(model[0].weight, teacher[0].weight)
    with pytest.raises(ValueError, match="before init_compression"):
        load_teacher("self", model, lambda p: None)


def test_load_teacher_folder(tmp_path):
    seen = []

    def load(path):
        seen.append(path)
        return nn.Linear(2, 2)

    teacher = load_teacher(str(tmp_path), nn.Linear(2, 2), load)
    assert seen == [str(tmp_path)] and not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    missing = os.path.join(str(tmp_path), "nope")
    with pytest.raises(FileNotFoundError) as err:
        load_teacher(missing, nn.Linear(2, 2), load)
    assert missing in str(err.value) and "compression_training.distillation.teacher" in str(err.value)


def test_load_teacher_baseline_outside_qcompress_train_says_what_it_is(tmp_path, monkeypatch):
    """`teacher: baseline` (schedules/with_qad_range_learning.yaml) names qcompress train's FP32
    fine-tune; in another loop it was reported as a missing folder called 'baseline'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        load_teacher("baseline", nn.Linear(2, 2), lambda p: pytest.fail("nothing to load"))
    assert not isinstance(err.value, FileNotFoundError)
    assert "qcompress train" in str(err.value) and "--baseline" in str(err.value)
    assert "compression_training.distillation.teacher" in str(err.value)
    (tmp_path / "baseline").mkdir()  # a model folder really named so is still read
    teacher = load_teacher("baseline", nn.Linear(2, 2), lambda p: nn.Linear(2, 3))
    assert teacher.out_features == 3
