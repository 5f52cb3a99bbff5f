"""qcompress.learn_ranges: post-training range learning on sklearn's digits (real data). Oracles:
the FP32 model's and the minmax PTQ model's losses on the same batches, the weights before."""

import pytest
import torch
import torch.nn.functional as F

import qcompress as qc
from qcompress.calibrate.learn_ranges import learn_ranges, range_parameters

pytest.importorskip("sklearn.datasets", reason="scikit-learn provides the digits data")
from tests.train.test_qat_train import digits_split, make_mlp, one_thread, train  # noqa: E402,F401  (fixture too)


def w3(range_learning=True):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "schedule_offset": 0,
                    "range_learning": range_learning,
                },
                "different_groups": {
                    "w3": {
                        "params": {
                            "start_bits": 3,
                            "target_bits": 3,
                            "quantization_period": 0,
                            "granularity": "group",
                            "group_size": 16,
                        }
                    }
                },
            }
        }
    }


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


@torch.no_grad()
def mean_loss(model, batches):
    model.eval()
    return sum(float(ce(model, b)) for b in batches) / len(batches)


def test_ranges_learn_the_loss_and_weights_stay(one_thread):
    xtr, ytr, xte, yte = digits_split()
    fp32 = train(make_mlp(), xtr, ytr, epochs=15)
    g = torch.Generator().manual_seed(2)
    batches = [(xtr[i], ytr[i]) for i in torch.randperm(len(ytr), generator=g).split(64)]
    held_out = [(xte, yte)]
    fp32_loss = mean_loss(fp32, held_out)
    import copy

    model = copy.deepcopy(fp32)
    qc.init_compression(model, w3())
    qc.CompressionScheduler(model, w3()).finish()
    ptq_loss = mean_loss(model, held_out)
    assert ptq_loss > fp32_loss * 1.05, "W3 PTQ should cost something for the test to mean anything"
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if not n.endswith("_scale")}
    scales = [p.detach().clone() for p in range_parameters(model)]
    assert len(scales) == 3
    model.train()
    out = learn_ranges(model, batches * 3, loss=ce, lr=1e-3)
    assert out["steps"] == 3 * len(batches)
    assert model.training  # the caller's mode is back
    learned_loss = mean_loss(model, held_out)
    # held-out: at least half of the PTQ excess over FP32 removed (it removes far more)
    assert learned_loss < ptq_loss - 0.5 * (ptq_loss - fp32_loss), (fp32_loss, ptq_loss, learned_loss)
    for n, p in model.named_parameters():  # weights bit-identical, every flag restored
        assert p.requires_grad
        if n in weights:
            assert torch.equal(p.detach(), weights[n]), n
    assert any(not torch.equal(a, b.detach()) for a, b in zip(scales, range_parameters(model)))


def test_refuses_a_model_without_learned_ranges():
    model = make_mlp()
    qc.init_compression(model, w3(range_learning=False))
    with pytest.raises(ValueError, match="range_learning: true"):
        learn_ranges(model, [(torch.zeros(2, 64), torch.zeros(2, dtype=torch.int64))], loss=ce)


def test_needs_a_loss_when_the_output_has_none():
    model = make_mlp()
    qc.init_compression(model, w3())
    frozen = model[0].bias
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="loss=lambda"):
        learn_ranges(model, [torch.zeros(2, 64)])
    assert not frozen.requires_grad and model[2].weight.requires_grad  # flags put back as they were


def test_hugging_face_output_loss_and_tied_scales_once():
    pytest.importorskip("transformers", reason="GPT-2 from transformers")
    from tests.helpers.tiny_models import make_gpt2

    m = make_gpt2()
    cfg = w3()
    qc.init_compression(m, cfg)
    qc.CompressionScheduler(m, cfg).finish()
    # wte and lm_head share one tensor and one learned scale: trained once, not twice per step
    assert m.transformer.wte.weight_scale is m.lm_head.weight_scale
    assert sum(p is m.lm_head.weight_scale for p in range_parameters(m)) == 1
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    before = m.lm_head.weight_scale.detach().clone()
    out = learn_ranges(m, [{"input_ids": ids, "labels": ids}] * 20, lr=1e-3)  # the output's own loss
    assert out["steps"] == 20 and out["last_loss"] < out["first_loss"]
    assert not torch.equal(before, m.lm_head.weight_scale.detach())


def _ranks(rank, world, _):
    import torch
    from qcompress.calibrate.learn_ranges import learn_ranges, range_parameters

    model = make_mlp()
    qc.init_compression(model, w3())
    qc.CompressionScheduler(model, w3()).finish()
    g = torch.Generator().manual_seed(20 + rank)  # each rank its own batches
    batches = [(torch.rand(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(3)]
    start = [p.detach().clone() for p in range_parameters(model)]
    learn_ranges(model, batches, loss=ce, lr=1e-3)
    return {"start": start, "end": [p.detach().clone() for p in range_parameters(model)], "batches": batches}


def test_ranks_average_their_gradients_and_keep_equal_ranges(tmp_path):
    from tests.helpers.dist_utils import run_ranks

    res = run_ranks(_ranks, 2, str(tmp_path), timeout=120)
    for a, b in zip(res[0]["end"], res[1]["end"]):
        assert torch.equal(a, b)
    # oracle: one process stepping on the mean of the two ranks' losses gives the same ranges
    model = make_mlp()
    qc.init_compression(model, w3())
    qc.CompressionScheduler(model, w3()).finish()
    pairs = list(zip(res[0]["batches"], res[1]["batches"]))
    learn_ranges(model, pairs, loss=lambda m, pr: (ce(m, pr[0]) + ce(m, pr[1])) / 2, lr=1e-3)
    for want, got in zip(range_parameters(model), res[0]["end"]):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(res[0]["start"], res[0]["end"]))


def _engine_cfg(stage):
    cfg = w3()
    cfg.update(
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
        }
    )
    return cfg


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _engine_ranks(rank, world, _):
    import torch
    from qcompress.calibrate.learn_ranges import learn_ranges

    out = {}
    for stage in (0, 1, 2, 3):
        model = make_mlp()
        qc.init_compression(model, w3())
        qc.CompressionScheduler(model, w3()).finish()
        engine = qc.initialize(model, _engine_cfg(stage))
        if stage == 3:  # as an engine stopped between accumulation micro-steps leaves it
            engine.module.set_requires_gradient_sync(False)
        g = torch.Generator().manual_seed(20 + rank)
        batches = [(torch.rand(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(3)]
        learn_ranges(engine, batches, loss=ce, lr=1e-3)  # the engine itself: unwrapped
        out[stage] = {n: _full(p) for n, p in engine.module.named_parameters()}
        out["batches"] = batches
    return out


def test_every_zero_stage_steps_on_the_mean_gradient(tmp_path):
    """Stages 2-3 shard the ranges (DTensors): FSDP2 reduces their gradients, our all-reduce must
    leave them alone (it cannot even run on them) and gradient sync must be on."""
    from tests.helpers.dist_utils import run_ranks

    res = run_ranks(_engine_ranks, 2, str(tmp_path), timeout=240)
    model = make_mlp()
    qc.init_compression(model, w3())
    qc.CompressionScheduler(model, w3()).finish()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    pairs = list(zip(res[0]["batches"], res[1]["batches"]))
    learn_ranges(model, pairs, loss=lambda m, pr: (ce(m, pr[0]) + ce(m, pr[1])) / 2, lr=1e-3)
    for stage in (0, 1, 2, 3):
        for n, want in model.named_parameters():
            assert torch.equal(res[0][stage][n], res[1][stage][n]), (stage, n)
            torch.testing.assert_close(
                res[0][stage][n], want.detach(), rtol=1e-5, atol=1e-7, msg=lambda m: f"stage {stage}, {n}: {m}"
            )
            if not n.endswith("_scale"):
                assert torch.equal(res[0][stage][n], start[n]), (stage, n)  # weights untouched
    assert any(not torch.equal(start[n], res[0][3][n]) for n in start if n.endswith("_scale"))


def w3_a4_static():
    cfg = w3()
    cfg["compression_training"]["activation_quantization"] = {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 0,
            "range_calibration": "static",
            "quantization_type": "asymmetric",
            "range_learning": True,
        },
        "different_groups": {"a4": {"params": {"bits": 4}}},
    }
    return cfg


def test_static_activation_ranges_of_a_ptq_model_learn_too(one_thread):
    """PTQ: finish(), then calibration batches in training mode (the observer's EMA). No scheduler
    step initialised the learned input ranges from it, so learn_ranges does, and trains them."""
    xtr, ytr, xte, yte = digits_split()
    fp32 = train(make_mlp(), xtr, ytr, epochs=15)
    import copy

    model = copy.deepcopy(fp32)
    qc.init_compression(model, w3_a4_static())
    qc.CompressionScheduler(model, w3_a4_static()).finish()
    model.train()
    with torch.no_grad():
        for xb in xtr[:512].split(64):  # calibration: the static ranges' EMA
            model(xb)
    layers = [m for m in model if hasattr(m, "qc_aq") and m.qc_aq is not None]
    assert layers and not any(m.qc_aq.learned_ready for m in layers)
    ptq_loss = mean_loss(model, [(xte, yte)])
    observed = [(m.qc_aq.observer.min.clone(), m.qc_aq.observer.max.clone()) for m in layers]
    g = torch.Generator().manual_seed(2)
    batches = [(xtr[i], ytr[i]) for i in torch.randperm(len(ytr), generator=g).split(64)]
    learn_ranges(model, batches[:1], loss=ce, lr=0.0)  # lr 0: only the start from the observer
    from qcompress.nn.ranges import input_spec
    from qcompress.quant.reference import int_params

    for m, (lo, hi) in zip(layers, observed):
        assert m.qc_aq.learned_ready
        s, z = int_params(lo.reshape(1).float(), hi.reshape(1).float(), input_spec(m.qc_aq))
        assert torch.equal(m.input_scale.detach().reshape(1), s) and torch.equal(
            m.input_zero_point.detach().reshape(1), z
        )
    start = [m.input_scale.detach().clone() for m in layers]
    assert mean_loss(model, [(xte, yte)]) == pytest.approx(ptq_loss, rel=1e-3)  # the same ranges, now learned
    learn_ranges(model, batches * 3, loss=ce, lr=1e-3)
    assert all(not torch.equal(a, m.input_scale.detach()) for a, m in zip(start, layers))
    assert mean_loss(model, [(xte, yte)]) < ptq_loss


def test_uncalibrated_static_ranges_are_named_in_a_warning():
    model = make_mlp()
    qc.init_compression(model, w3_a4_static())
    qc.CompressionScheduler(model, w3_a4_static()).finish()
    with pytest.warns(UserWarning, match=r"static activation ranges of 3 module\(s\) \(0, 2, 4\) have seen no batch"):
        learn_ranges(model, [(torch.rand(4, 64), torch.zeros(4, dtype=torch.int64))], loss=ce)
