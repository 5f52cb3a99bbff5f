"""Learned rotations: orthogonal factors (1e-5) trained with the model, their gradient equal to
finite differences, fused / exported at the end, and resumed bit for bit from a checkpoint."""

import copy
import json
import os
import warnings

import pytest
import torch

import qcompress as qc
from tests.helpers.rotation_fixtures import logits, make_dense, rotation_doc, tokens, transformers
from qcompress.transforms.learned import Cayley


def qat_doc(lr=1e-2, act=True, **rot):
    doc = rotation_doc(learned=True, **rot)
    doc["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {
            "w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 32}, "modules": ["layers"]}
        },
    }
    if act:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"a": {"params": {"bits": 8}, "modules": ["layers"]}},
        }
    doc.update(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        }
    )
    return doc


def _model(seed=0, dtype=torch.float32):
    return make_dense("llama", seed=seed, hidden=64, heads=4, kv=2, head_dim=16, inter=96, dtype=dtype)


def _batch(step):
    ids = tokens(64, batch=2, seq=12, seed=100 + step)
    return ids


def _train(engine, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        ids = _batch(s)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _factors(model):
    return {n: m for n, m in model.qc_rotations.named_modules() if isinstance(m, Cayley)}


def test_cayley_factor_is_orthogonal_for_any_parameter():
    c = Cayley(24)
    with torch.no_grad():
        c.skew.normal_(0, 3.0)
    m = c.matrix().detach()
    assert float((m.T @ m - torch.eye(24, dtype=torch.float64)).abs().max()) < 1e-12
    assert float((m.float().T @ m.float() - torch.eye(24)).abs().max()) < 1e-5


def test_learned_rotations_train_with_the_model_and_stay_orthogonal():
    model = _model()
    doc = qat_doc(lr=5e-2)
    qc.init_compression(model, doc)
    engine = qc.initialize(model, doc)
    names = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    factors = _factors(model)
    assert sorted(factors) == ["R1", "R2.0", "R2.1", "R4"]
    assert all(id(f.skew) in names for f in factors.values())  # in the optimizer with the model
    losses = _train(engine, 4)
    assert all(torch.isfinite(torch.tensor(losses)))
    for name, f in factors.items():
        assert float(f.skew.detach().abs().max()) > 1e-3, name  # they moved
        m = f.matrix().detach()
        eye = torch.eye(m.shape[0], dtype=torch.float64)
        assert float((m.T @ m - eye).abs().max()) < 1e-5, name
        assert float((m - eye).abs().max()) > 1e-3, name
    # the weights the quantizers see are W C: rotating the embedding's stored weight gives it back
    from qcompress.transforms import materialized

    e = model.model.embed_tokens.weight.detach().clone()
    with materialized(model):
        seen = model.model.embed_tokens.weight
        assert torch.allclose(seen, e @ factors["R1"].matrix().float(), atol=1e-6)
        assert float((seen.norm(dim=1) - e.norm(dim=1)).abs().max()) < 1e-4  # a rotation keeps lengths


def _rms_norm_in_its_dtype(self, x):
    # LlamaRMSNorm normalises in float32 whatever the model's dtype; finite differences of 1e-6
    # need the whole forward in float64
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_gradient_of_the_factors_matches_finite_differences(monkeypatch):
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)
    model = _model(dtype=torch.float64)
    qc.apply_rotations(model, rotation_doc(learned=True))
    model.double()
    seen = []

    def grab_weight(mod, args):  # registered after the rotation's hooks: sees W C
        seen.append(mod.weight)

    def grab_input(mod, args):  # after R4's online rotation: the input down_proj sees
        seen.append(args[0])

    layer = model.model.layers[1]
    for mod in (layer.self_attn.v_proj, layer.self_attn.o_proj, model.model.embed_tokens):
        mod.register_forward_pre_hook(grab_weight)
    layer.mlp.down_proj.register_forward_pre_hook(grab_input)
    layer.mlp.down_proj.register_forward_pre_hook(grab_weight)
    ids = tokens(64, seq=6)
    probe = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def loss():  # not rotation-invariant: fourth powers of the rotated weights and inputs
        seen.clear()
        out = model(ids).logits
        return (out * probe).sum() + sum((t**4).sum() for t in seen)

    with torch.no_grad():
        for f in _factors(model).values():
            f.skew.normal_(0, 0.05)
    model.zero_grad()
    loss().backward()
    g = torch.Generator().manual_seed(2)
    eps = 1e-6
    for name, f in _factors(model).items():
        for _ in range(3):
            i, j = (int(v) for v in torch.randint(0, f.skew.shape[0], (2,), generator=g))
            with torch.no_grad():
                f.skew[i, j] += eps
                up = float(loss())
                f.skew[i, j] -= 2 * eps
                down = float(loss())
                f.skew[i, j] += eps
            fd = (up - down) / (2 * eps)
            assert fd == pytest.approx(float(f.skew.grad[i, j]), rel=1e-5, abs=1e-7), (name, i, j)


def test_trained_rotations_export_fused_and_as_a_transform(tmp_path):
    warnings.simplefilter("ignore")
    model = _model(seed=1)
    fresh = copy.deepcopy(model)
    doc = qat_doc(lr=5e-2)
    qc.init_compression(model, doc)
    engine = qc.initialize(model, doc)
    _train(engine, 3)
    model.eval()
    ids = tokens(64)
    trained = logits(model, ids)
    assert torch.equal(logits(copy.deepcopy(model), ids), trained)  # a copy carries its factors
    out = str(tmp_path / "out")
    qc.export_quantized(model, out)
    config = json.load(open(os.path.join(out, "config.json")))
    scheme = config["quantization_config"]["transform_config"]["config_groups"]["R4"]
    assert scheme["type"] == "random-hadamard" and scheme["head_dim"] == 32
    from safetensors.torch import load_file

    stored = load_file(os.path.join(out, "model.safetensors"))
    assert not any(k.startswith("qc_rotations") for k in stored)
    block = stored["model.layers.0.mlp.down_proj.R4_input.weight"]
    q = block.double() / 32**0.5  # unnormalized: an orthogonal matrix once divided by sqrt(32)
    assert float((q.T @ q - torch.eye(32, dtype=torch.float64)).abs().max()) < 1e-5
    assert not torch.allclose(block.abs(), torch.ones_like(block))  # no longer a +-1 Hadamard block
    loaded = qc.load_quantized(out, copy.deepcopy(fresh))
    assert torch.allclose(logits(loaded, ids), trained, atol=1e-5, rtol=0)
    # redundancy_clean writes the rotations into the weights: the same function, no factors left
    qc.redundancy_clean(model)
    assert "qc_rotations" not in dict(model.named_children())
    assert torch.allclose(logits(model, ids), trained, atol=1e-5, rtol=0)
    out2 = str(tmp_path / "clean")
    qc.export_quantized(model, out2)
    assert torch.allclose(logits(qc.load_quantized(out2, copy.deepcopy(fresh)), ids), trained, atol=1e-5, rtol=0)


def test_trained_rotations_read_back_by_transformers_and_compressed_tensors(tmp_path):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from qcompress.export.hf_compat import dequantize_config
    from qcompress.export.rotations import apply_to_transformers

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    model = _model(seed=1)
    fresh = copy.deepcopy(model)
    doc = qat_doc(lr=5e-2, act=False)  # transformers runs activations unquantized: weights only
    qc.init_compression(model, doc)
    _train(qc.initialize(model, doc), 2)
    out = str(tmp_path / "out")
    qc.export_quantized(model, out)
    ids = tokens(64)
    ref = logits(qc.load_quantized(out, fresh), ids)
    assert torch.allclose(ref, logits(model.eval(), ids), atol=1e-5, rtol=0)
    tm = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=dequantize_config()
    ).eval()
    apply_to_transformers(tm, out)
    assert torch.allclose(logits(tm, ids), ref, atol=1e-6, rtol=0)


def test_resume_with_learned_rotations_is_bit_exact(tmp_path):
    warnings.simplefilter("ignore")
    doc = qat_doc()
    doc["seed"] = 0

    def build():
        model = _model(seed=2)
        qc.init_compression(model, doc)
        return qc.initialize(model, doc)

    engine = build()
    _train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    _train(engine, 2, start=2)
    want = {k: v.clone() for k, v in engine.module.state_dict().items()}
    fresh = build()
    fresh.load_checkpoint(str(tmp_path))
    _train(fresh, 2, start=2)
    got = fresh.module.state_dict()
    assert want.keys() == got.keys() and any(k.startswith("qc_rotations") for k in want)
    for k, v in want.items():
        assert torch.equal(v, got[k]), k
