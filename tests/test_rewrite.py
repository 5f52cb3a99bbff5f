"""init_compression / redundancy_clean / summary on real transformers models (random weights)."""

import copy
import glob
import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress
from qcompress import ConfigError, init_compression, load_config, redundancy_clean, summary
from qcompress.quant import fake_quantize
from tests.helpers.shared_paths import DS_COMPRESSION
from tests.helpers.tiny_models import make_bert, make_gpt2

transformers = pytest.importorskip("transformers", reason="transformers is needed for the BERT/GPT-2 models")

DS = DS_COMPRESSION
BERT_QUANT_CONFIGS = sorted(
    p
    for p in glob.glob(f"{DS}/bert/**/*.json", recursive=True)
    if json.load(open(p))["compression_training"]
    .get("weight_quantization", {})
    .get("shared_parameters", {})
    .get("enabled")
)
GPT2_CONFIG = f"{DS}/gpt2/config/ds_config_W4or8A8_Qgroup64_fp16.json"
NO_LAYER_REDUCTION = {"compression_training": {"layer_reduction": {"enabled": False}}}


def bert_input():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (2, 16), generator=g)


def expected_claims(model, technique_json, kinds):
    """{module name: group name} by re.search over named_modules, from the raw JSON."""
    out = {}
    for gname, group in technique_json["different_groups"].items():
        for name, mod in model.named_modules():
            if name and isinstance(mod, kinds) and any(re.search(p, name) for p in group["modules"]):
                assert name not in out, "the DeepSpeed configs never claim a module twice"
                out[name] = gname
    return out


def test_four_bert_configs_found():
    assert len(BERT_QUANT_CONFIGS) == 4, BERT_QUANT_CONFIGS


@pytest.mark.parametrize("path", BERT_QUANT_CONFIGS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_ds_config_quantizes_exactly_selected_modules(path):
    raw = json.load(open(path))
    model = make_bert()
    orig = copy.deepcopy(model)
    params_before = {n: (p, p.device, p.dtype) for n, p in model.named_parameters()}
    keys_before = list(model.state_dict().keys())
    cfg = load_config(path, NO_LAYER_REDUCTION)  # layer reduction needs a teacher: tested by its owner
    assert init_compression(model, cfg) is model

    wq_json = raw["compression_training"]["weight_quantization"]
    want_w = expected_claims(model, wq_json, (nn.Linear, nn.Embedding, nn.Conv2d))
    got_w = {n: m.qc_wq.group for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert got_w == want_w
    groups = wq_json["groups"] if "groups" in wq_json else wq_json["different_groups"]
    shared = wq_json["shared_parameters"]
    mods = dict(model.named_modules())
    origs = dict(orig.named_modules())
    for name, gname in want_w.items():
        wq = mods[name].qc_wq
        assert wq.active and wq.bits == groups[gname]["params"]["target_bits"]
        # the weight forward uses equals fake_quantize with the group's settings
        bits = wq.bits
        w0 = origs[name].weight.detach()
        kw = dict(ternary=True) if bits == 2 else {}
        if isinstance(mods[name], nn.Embedding):
            ref = fake_quantize(w0, bits, granularity="channel", **kw)  # one group per vocab row
        else:
            ref = fake_quantize(w0, bits, num_groups=shared["quantize_groups"], **kw)
        assert torch.equal(mods[name].effective_weight().detach(), ref), name

    aq_json = raw["compression_training"]["activation_quantization"]
    want_a = expected_claims(model, aq_json, (nn.Linear, nn.Conv2d))
    got_a = {n: m.qc_aq.group for n, m in model.named_modules() if getattr(m, "qc_aq", None) is not None}
    assert got_a == want_a
    assert all(mods[n].qc_aq.bits == 8 and mods[n].qc_aq.active for n in want_a)

    # parameters keep identity, device, dtype; state_dict keys unchanged
    for n, p in model.named_parameters():
        assert params_before[n][0] is p and p.device == params_before[n][1] and p.dtype == params_before[n][2]
    assert list(model.state_dict().keys()) == keys_before
    # modules stay instances of their original classes
    assert all(isinstance(mods[n], type(origs[n])) for n in want_w)

    out = model(bert_input()).logits
    assert torch.isfinite(out).all()
    text = summary(model)
    for name, gname in want_w.items():
        line = next(l for l in text.splitlines() if l.startswith(name + " "))
        assert f"W{groups[gname]['params']['target_bits']} " in line


def test_state_dict_roundtrip_with_original_model():
    cfg = load_config(f"{DS}/bert/config/ZeroQuant/ds_config_W48A8_Qgroup48_lkd_fp32.json")
    model = init_compression(make_bert(0), cfg)
    fresh = make_bert(7)
    fresh.load_state_dict(model.state_dict(), strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    other = make_bert(9)
    model.load_state_dict(other.state_dict(), strict=True)
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    # the compressed forward now uses the loaded weights
    name = "bert.encoder.layer.0.attention.self.query"
    m = dict(model.named_modules())[name]
    assert torch.equal(m.effective_weight().detach(), fake_quantize(m.weight.detach(), 8, num_groups=48))


def _two_groups(a, b):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "g1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": a},
                    "g2": {"params": {"start_bits": 4, "target_bits": 4}, "modules": b},
                },
            }
        }
    }


def test_module_claimed_twice_is_config_error():
    with pytest.raises(ConfigError) as info:
        init_compression(make_bert(), _two_groups(["attention.self"], ["query"]))
    assert info.value.path == "compression_training.weight_quantization.different_groups.g2.modules"
    assert "attention.self.query" in str(info.value)


def test_group_matching_nothing_warns():
    with pytest.warns(UserWarning, match="g2.*matches no compressible module"):
        init_compression(make_bert(), _two_groups(["attention.self"], ["no_such_module"]))


def test_missing_modules_means_every_compressible_module():
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}}},
            }
        }
    }
    model = init_compression(make_bert(), cfg)
    want = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    got = {n for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert got == want and len(want) == 2 * 6 + 3 + 2


def _count_weight_fake_quant(model, monkeypatch):
    import qcompress.nn.fused as fused
    import qcompress.nn.layers as layers

    ptrs = {p.data_ptr() for p in model.parameters()}
    calls = {"weight": 0, "other": 0}
    real = layers.fake_quantize_spec

    def spy(x, *a, **k):
        calls["weight" if x.data_ptr() in ptrs else "other"] += 1
        return real(x, *a, **k)

    monkeypatch.setattr(layers, "fake_quantize_spec", spy)
    real_prepared = fused.kernels.fake_quantize_prepared  # the fused path's weight quantizer call

    def spy_prepared(x, *a, **k):
        calls["weight" if x.data_ptr() in ptrs else "other"] += 1
        return real_prepared(x, *a, **k)

    monkeypatch.setattr(fused.kernels, "fake_quantize_prepared", spy_prepared)
    real_codes = fused._quantize  # the fused path quantizes activations to int8 codes

    def spy_codes(x, *a, **k):
        calls["weight" if x.data_ptr() in ptrs else "other"] += 1
        return real_codes(x, *a, **k)

    monkeypatch.setattr(fused, "_quantize", spy_codes)
    return calls


def test_redundancy_clean_keeps_eval_forward_and_stops_weight_fake_quant(monkeypatch):
    cfg = load_config(f"{DS}/bert/config/ZeroQuant/ds_config_W48A8_Qgroup48_lkd_fp32.json")
    model = init_compression(make_bert(), cfg)
    x = bert_input()
    calls = _count_weight_fake_quant(model, monkeypatch)
    with torch.no_grad():
        before = model(x).logits
    assert calls["weight"] == 12 and calls["other"] > 0  # per layer: 4 wq1 + 2 wq2 modules
    assert redundancy_clean(model, cfg) is model
    calls.update(weight=0, other=0)
    with torch.no_grad():
        after = model(x).logits
    assert torch.equal(before, after)
    assert calls["weight"] == 0 and calls["other"] > 0  # activation quant stays
    m = dict(model.named_modules())["bert.encoder.layer.1.intermediate.dense"]
    q, s, z, spec = m.quantized_weight()
    assert spec.bits == 4
    assert torch.equal(qcompress.quant.dequantize(q, s, z, num_groups=48), m.weight.detach())
    assert "baked" in summary(model)


def test_gpt2_conv1d_quantized_along_output_dim():
    model = make_gpt2()
    orig = copy.deepcopy(model)
    raw = json.load(open(GPT2_CONFIG))
    cfg = load_config(GPT2_CONFIG)
    init_compression(model, cfg)
    Conv1D = transformers.pytorch_utils.Conv1D
    want = expected_claims(model, raw["compression_training"]["weight_quantization"], (Conv1D,))
    got = {n: m.qc_wq.group for n, m in model.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert got == want and len(want) == 8
    origs = dict(orig.named_modules())
    for name, mod in model.named_modules():
        if name in want:
            bits = 4 if "mlp" in name else 8
            assert mod.qc_wq.bits == bits
            # fp16 config: optimizer-step mode writes the quantized weight in at step 0;
            # DeepSpeed's 64 chunks are taken over the [out, in] matrix
            w0 = origs[name].weight.detach()
            ref = fake_quantize(w0.t().contiguous(), bits, num_groups=64).t()
            assert torch.equal(mod.weight.detach(), ref), name
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()


def test_gpt2_conv1d_channel_granularity_is_per_output():
    model = make_gpt2()
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "g": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "channel"}, "modules": ["c_fc"]}
                },
            }
        }
    }
    init_compression(model, cfg)
    m = dict(model.named_modules())["transformer.h.0.mlp.c_fc"]
    w = m.weight.detach()  # [in=96, out=384]
    eff = m.effective_weight().detach()
    assert eff.shape == w.shape
    assert torch.equal(eff, fake_quantize(w.t(), 4, granularity="channel").t())
    scales = eff.abs().amax(dim=0)  # one grid per output column
    assert torch.allclose(scales, w.abs().amax(dim=0))
    x = torch.randn(2, 5, 96)
    torch.testing.assert_close(m(x), x @ eff + m.bias)


def _static_cfg(momentum=None, bits=8):
    shared = {"enabled": True, "range_calibration": "static", "schedule_offset": 0}
    if momentum is not None:
        shared["momentum"] = momentum
    return {
        "compression_training": {
            "activation_quantization": {
                "shared_parameters": shared,
                "different_groups": {"a": {"params": {"bits": bits}, "modules": ["0"]}},
            }
        }
    }


@pytest.mark.parametrize("momentum", [None, 0.8])
def test_static_activation_ema_and_frozen_in_eval(momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU())
    init_compression(model, _static_cfg(momentum))
    lin = model[0]
    m = 0.95 if momentum is None else momentum
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(5, 6, generator=g) * (i + 1) for i in range(4)]
    lo = hi = None
    model.train()
    for x in batches:
        cur_lo, cur_hi = x.min().item(), x.max().item()
        if lo is None:
            lo, hi = cur_lo, cur_hi  # first batch initialises
        else:
            lo, hi = m * lo + (1 - m) * cur_lo, m * hi + (1 - m) * cur_hi
        y = model(x)
        ref = F.relu(F.linear(fake_quantize(x, 8, min_val=lo, max_val=hi), lin.weight, lin.bias))
        torch.testing.assert_close(y, ref)
    obs = lin.qc_aq.observer
    assert obs.min.item() == pytest.approx(lo, rel=1e-6) and obs.max.item() == pytest.approx(hi, rel=1e-6)
    model.eval()
    x = torch.randn(5, 6, generator=g) * 10
    y = model(x)
    assert obs.min.item() == pytest.approx(lo, rel=1e-6)  # frozen
    ref = F.relu(F.linear(fake_quantize(x, 8, min_val=lo, max_val=hi), lin.weight, lin.bias))
    torch.testing.assert_close(y, ref)


def test_dynamic_activation_per_token_and_per_sample():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 4))
    cfg = {
        "compression_training": {
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantization_type": "asymmetric"},
                "different_groups": {"a": {"params": {"bits": 4}, "modules": ["0", "2"]}},
            }
        }
    }
    init_compression(model, cfg)
    x = torch.randn(5, 2, 4, 4)
    conv, lin = model[0], model[2]
    h = F.conv2d(fake_quantize(x, 4, symmetric=False, granularity="channel"), conv.weight, conv.bias)
    ref = F.linear(fake_quantize(h.flatten(1), 4, symmetric=False, granularity="token"), lin.weight, lin.bias)
    torch.testing.assert_close(model(x), ref)


def test_activation_offset_default_1000():
    model = nn.Sequential(nn.Linear(6, 4))
    cfg = {
        "compression_training": {
            "activation_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"a": {"params": {"bits": 4}, "modules": ["0"]}},
            }
        }
    }
    init_compression(model, cfg)
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
    assert not model[0].qc_aq.active


def test_rewrite_time_config_errors():
    bad_groups = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_groups": 7},
                "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["query"]}},
            }
        }
    }
    with pytest.raises(ConfigError) as info:
        init_compression(make_bert(), bad_groups)
    assert info.value.path == "compression_training.weight_quantization.shared_parameters.quantize_groups"
    assert "9216" in str(info.value)  # 96 x 96 weights
    asym_ternary = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantization_type": "asymmetric"},
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 2}, "modules": ["query"]}},
            }
        }
    }
    with pytest.raises(ConfigError) as info:
        init_compression(make_bert(), asym_ternary)
    assert info.value.path == "compression_training.weight_quantization.different_groups.g.params.target_bits"


# --- tied weights, attention internals, group_size alone, pickling --------------------------------


def _moq(groups, **shared):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": False, **shared},
                "different_groups": groups,
            }
        }
    }


class TiedNet(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_tied_weights_share_one_master_and_do_not_drift():
    cfg = _moq({"g": {"params": {"start_bits": 4, "target_bits": 4}}})
    model = init_compression(TiedNet(), cfg)
    sched = qcompress.CompressionScheduler(model, cfg)
    assert model.emb.qc_wq.master is model.head.qc_wq.master
    assert model.head.qc_wq.granularity == model.emb.qc_wq.granularity == "channel"  # one vocabulary table
    w0, master0 = model.emb.weight.detach().clone(), model.emb.qc_wq.master.clone()
    for _ in range(20):
        sched.step()  # no optimizer update: nothing may move
    assert torch.equal(model.emb.weight.detach(), w0) and torch.equal(model.emb.qc_wq.master, master0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randint(0, 32, (8, 5))
    before = model.emb.weight.detach().clone()
    F.cross_entropy(model(x).reshape(-1, 32), x.reshape(-1)).backward()
    opt.step()
    update = model.emb.weight.detach() - before
    sched.step()  # the update reaches the master once, not twice
    assert torch.equal(model.emb.qc_wq.master, master0 + update)
    assert torch.equal(model.emb.weight.detach(), fake_quantize(master0 + update, 4, granularity="channel"))
    # one master in the scheduler's checkpoint, restored for both modules
    sd = sched.state_dict()
    model2 = init_compression(TiedNet(seed=1), cfg)
    model2.load_state_dict(model.state_dict())
    qcompress.CompressionScheduler(model2, cfg).load_state_dict(sd)
    assert torch.equal(model2.head.qc_wq.master, model.emb.qc_wq.master)
    assert model2.head.qc_wq.master is model2.emb.qc_wq.master


def test_tied_weights_quantized_differently_is_config_error():
    cfg = _moq(
        {
            "a": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["emb"]},
            "b": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["head"]},
        }
    )
    with pytest.raises(ConfigError) as info:
        init_compression(TiedNet(), cfg)
    msg = str(info.value)
    assert "'emb'" in msg and "'head'" in msg and "start_bits 8 vs 4" in msg
    assert info.value.path == "compression_training.weight_quantization.different_groups.b"
    same = _moq(
        {
            "a": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["emb"]},
            "b": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["head"]},
        }
    )
    model = init_compression(TiedNet(), same)
    assert model.emb.qc_wq.master is model.head.qc_wq.master


def test_gpt2_tied_lm_head_and_wte_share_one_master():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=96, n_positions=32, n_embd=64, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0
        )
    ).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    cfg = _moq({"g": {"params": {"start_bits": 8, "target_bits": 8}}})  # no `modules`: both claimed
    init_compression(model, cfg)
    sched = qcompress.CompressionScheduler(model, cfg)
    head, wte = model.lm_head.qc_wq, model.transformer.wte.qc_wq
    assert head.master is wte.master
    w0 = model.lm_head.weight.detach().clone()
    for _ in range(30):
        sched.step()
    assert torch.equal(model.lm_head.weight.detach(), w0)
    assert torch.equal(w0, fake_quantize(head.master, 8, granularity="channel"))


def test_multihead_attention_projection_is_not_claimed():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"g": {"params": {"start_bits": 2, "target_bits": 2}}},
            }
        }
    }
    orig, plain = copy.deepcopy(layer), copy.deepcopy(layer)
    init_compression(layer, cfg)
    claimed = {n for n, m in layer.named_modules() if getattr(m, "qc_wq", None) is not None}
    assert claimed == {"linear1", "linear2"}  # not self_attn.out_proj: MHA never calls it
    # the fused inference path would skip linear1/linear2 too: the compressed layer must not take it
    for name in ("linear1", "linear2"):
        w = getattr(plain, name).weight
        w.data.copy_(fake_quantize(w.detach(), 2, ternary=True))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(layer(x), orig(x), atol=1e-2)  # the 2 bits do show
    named = copy.deepcopy(cfg)
    named["compression_training"]["weight_quantization"]["different_groups"]["g"]["modules"] = ["out_proj"]
    with pytest.raises(ConfigError) as info:
        init_compression(copy.deepcopy(orig), named)
    assert info.value.path.endswith("different_groups.g.modules[0]")
    assert "MultiheadAttention" in str(info.value) and "self_attn.out_proj" in str(info.value)
    broad = copy.deepcopy(cfg)
    broad["compression_training"]["weight_quantization"]["different_groups"]["g"]["modules"] = ["."]
    with pytest.warns(UserWarning, match="self_attn.out_proj"):  # a broad regex skips it, reported
        broad_model = init_compression(copy.deepcopy(orig), broad)
    assert {n for n, m in broad_model.named_modules() if getattr(m, "qc_wq", None)} == {"linear1", "linear2"}


def test_group_size_alone_means_group_granularity():
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 4},
                "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 16}}},
            }
        }
    }
    model = init_compression(nn.Sequential(nn.Linear(64, 8)), cfg)
    wq = model[0].qc_wq
    assert (wq.granularity, wq.group_size, wq.num_groups) == ("group", 16, None)
    w = model[0].weight.detach()
    assert torch.equal(model[0].effective_weight().detach(), fake_quantize(w, 4, granularity="group", group_size=16))
    assert "group16" in summary(model)


@pytest.mark.parametrize("in_forward", [True, False])
def test_whole_model_pickles(tmp_path, in_forward):
    import io

    cfg = _moq({"g": {"params": {"start_bits": 4, "target_bits": 4}}}, quantize_weight_in_forward=in_forward)
    model = init_compression(TiedNet(), cfg)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    # no arbitrary code: only the model's own classes and qcompress's state classes are needed
    from qcompress.nn.layers import _new_compress_aware
    from qcompress.nn.state import MasterState, WeightQuant
    from qcompress.quant.reference import Spec

    allowed = [_new_compress_aware, WeightQuant, MasterState, Spec, nn.Linear, nn.Embedding]
    with torch.serialization.safe_globals(allowed + [type(m) for m in model.modules()]):
        back = torch.load(buf, weights_only=True)
    assert type(back.head) is type(model.head) and isinstance(back.head, nn.Linear)
    assert back.head.weight is back.emb.weight and back.head.qc_wq.store is back.emb.qc_wq.store
    x = torch.randint(0, 32, (3, 4))
    assert torch.equal(back(x), model(x))
