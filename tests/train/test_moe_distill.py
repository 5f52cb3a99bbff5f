"""Distillation with mixture-of-experts students and teachers (qcompress.train.distill): the
teacher "self" stays the full-precision MoE while the student's experts are quantized (weights
and per-expert static input ranges), a separate FP MoE teacher works the same way, and the loss
is the closed-form KL of the two models' logits (distill.logit_kl's formula written out here)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import qcompress as qc
from qcompress.train.distill import Distiller, load_teacher
from tests.helpers.moe_fixtures import make_moe, tokens

T = 2.0


def _cfg():
    return qc.load_config(
        {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {
                        "wq": {
                            "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 16},
                            "modules": [r"mlp\.experts"],
                        }
                    },
                },
                "activation_quantization": {
                    "shared_parameters": {"enabled": True, "range_calibration": "static", "schedule_offset": 0},
                    "different_groups": {"aq": {"params": {"bits": 8}, "modules": [r"mlp\.experts"]}},
                },
                "distillation": {"enabled": True, "alpha": 1.0, "temperature": T, "hidden_mse": 0.0},
            }
        }
    )


def _kl(student_logits, teacher_logits):
    """T^2 * KL(p_teacher || p_student) per position, averaged (every position has a target here)."""
    p = F.softmax(teacher_logits.double() / T, -1)
    return T**2 * (p * (p.log() - F.log_softmax(student_logits.double() / T, -1))).sum(-1).mean()


def _sharp(model):
    """Random-init logits are nearly uniform (a KL near float32 noise): scale the head up."""
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def _expert_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "experts" in n}


@pytest.mark.parametrize("teacher_kind", ["self", "fp_moe"])
def test_moe_student_distils_from_a_full_precision_moe_teacher(tmp_path, teacher_kind):
    student = _sharp(make_moe("qwen3_moe"))
    fp_copy = copy.deepcopy(student)
    if teacher_kind == "self":
        teacher = load_teacher("self", student, lambda p: pytest.fail("no folder"))
        reference_teacher = fp_copy
    else:  # another FP MoE (other family, other weights) with the same vocabulary
        reference_teacher = _sharp(make_moe("mixtral", seed=3))
        reference_teacher.save_pretrained(tmp_path / "teacher")
        from transformers import AutoModelForCausalLM

        teacher = load_teacher(str(tmp_path / "teacher"), student, AutoModelForCausalLM.from_pretrained)
    cfg = _cfg()
    qc.init_compression(student, cfg)
    kd = Distiller.from_config(cfg, teacher)
    assert not any(type(m).__name__ == "ExpertMatrix" for m in teacher.modules())  # teacher stays FP
    x = tokens(student, batch=2, seq=10)
    student.train()
    out = student(input_ids=x)
    t_out = kd.teacher_outputs({"input_ids": x, "labels": x})
    with torch.no_grad():
        want_t = reference_teacher.eval()(input_ids=x).logits
    assert torch.equal(t_out.logits, want_t)  # the teacher ran in full precision
    total, _, distill = kd.loss(out, t_out, None)
    torch.testing.assert_close(distill.double(), _kl(out.logits.detach(), want_t), rtol=1e-5, atol=1e-7)
    total.backward()
    grads = _expert_grads(student)
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for p in teacher.parameters())
    # the student's experts are quantized, so it differs from the FP teacher "self"
    assert float(distill) > 1e-4
    parts = [m for m in student.modules() if type(m).__name__ == "ExpertMatrix"]
    assert all(m.qc_aq.observer.initialized for m in parts)  # the per-expert ranges saw the tokens
