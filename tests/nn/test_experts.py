"""Fused mixture-of-experts Parameters as compress-aware weights (qcompress.nn.experts): each
expert's matrix is quantized as its own 2-D weight, checked against an untouched FP copy whose
expert matrices were replaced by qcompress.quant.fake_quantize of each matrix (the oracle)."""

import copy
import warnings

import pytest
import torch

import qcompress
from qcompress import ConfigError
from qcompress.quant import fake_quantize
from tests.helpers.moe_fixtures import (
    FAMILIES,
    experts_params,
    make_moe,
    oracle_copy,
    reference_experts_forward,
    tokens,
)

EXPERTS = r"mlp\.experts"


def cfg_w(bits=4, sym=True, gran="group", group_size=16, modules=(EXPERTS,), start=None, period=None, **params):
    p = {"start_bits": start or bits, "target_bits": bits, **params}
    if gran is not None:
        p["granularity"] = gran
    if gran == "group":
        p["group_size"] = group_size
    if period is not None:
        p["quantization_period"] = period
    group = {"params": p}
    if modules is not None:
        group["modules"] = list(modules)
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                    "quantize_weight_in_forward": True,
                },
                "different_groups": {"wq": group},
            }
        }
    }


CASES = [(4, True, "group"), (4, False, "group"), (8, False, "channel"), (3, True, "tensor")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits,sym,gran", CASES)
def test_logits_equal_the_per_expert_fake_quantize_oracle(family, bits, sym, gran):
    model = make_moe(family)
    fp = copy.deepcopy(model)
    qcompress.init_compression(model, cfg_w(bits, sym, gran))
    # per-tensor granularity is per expert: one scale for each expert's matrix
    ref = oracle_copy(
        fp,
        lambda m: fake_quantize(m, bits, symmetric=sym, granularity=gran, group_size=16 if gran == "group" else None),
    )
    x = tokens(model)
    with torch.no_grad():
        got, want, plain = model(x).logits, ref(x).logits, fp(x).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_reach_every_expert_parameter_straight_through(family):
    model = make_moe(family)
    fp = copy.deepcopy(model)
    qcompress.init_compression(model, cfg_w(4, True, "group"))
    ref = oracle_copy(fp, lambda m: fake_quantize(m, 4, granularity="group", group_size=16))
    x = tokens(model, batch=4, seq=16)
    for m in (model, ref):
        m.train()
        out = m(x, labels=x)
        out.loss.backward()
    ref_params = {n: p for n, (p, _) in experts_params(ref).items()}
    for name, (p, _) in experts_params(model).items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        # straight-through: d loss / d W equals d loss / d (quantized W) of the oracle
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-7)


def test_default_group_takes_experts_routers_stay_full_precision_shared_experts_are_linears():
    model = make_moe("deepseek_v3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stays full precision" report: the experts are covered
        qcompress.init_compression(model, cfg_w(8, True, "channel", modules=None))
    names = {n: type(m).__name__ for n, m in model.named_modules()}
    assert names["model.layers.1.mlp.experts.gate_up_proj"] == "ExpertMatrix"
    assert names["model.layers.1.mlp.experts.down_proj"] == "ExpertMatrix"
    assert names["model.layers.1.mlp.shared_experts.gate_proj"] == "CompressLinear"
    assert not hasattr(model.model.layers[1].mlp.gate, "qc_wq")  # the router
    gpt = make_moe("gpt_oss")
    qcompress.init_compression(gpt, cfg_w(8, True, "channel", modules=None))
    assert not hasattr(gpt.model.layers[0].mlp.router, "qc_wq")


class _Einsum(torch.nn.Module):
    """A 3-D Parameter whose forward is no experts forward (no routing arguments): not detected."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        return torch.einsum("bi,eoi->bo", x, self.w)


def test_uncompressible_report_counts_only_what_stays_full_precision():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Einsum())
    with pytest.warns(UserWarning, match=r"stay full precision: '1\.w' \(_Einsum, \[4, 8, 8\]\)"):
        qcompress.init_compression(model, cfg_w(8, True, "channel", modules=None))
    assert not isinstance(model[1], torch.nn.Linear) and not any(
        type(m).__name__ == "ExpertMatrix" for m in model.modules()
    )


def test_state_dict_keys_and_parameters_unchanged():
    model = make_moe("qwen3_moe")
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    qcompress.init_compression(model, cfg_w())
    assert list(model.state_dict()) == keys
    assert {n: p for n, p in model.named_parameters()} == params
    model.load_state_dict(copy.deepcopy(model.state_dict()))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_group_size_that_does_not_divide_an_experts_input_is_refused(family):
    model = make_moe(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cls = type(model.model.layers[0].mlp.experts)
    with pytest.raises(ConfigError) as err:
        qcompress.init_compression(model, cfg_w(4, True, "group", group_size=20))
    msg = str(err.value)
    assert "model.layers.0.mlp.experts.gate_up_proj" in msg and "group_size" in msg
    shape = list(model.model.layers[0].mlp.experts.gate_up_proj.shape)
    assert str(shape) in msg
    # nothing was left behind: classes, modules and weights as before
    assert type(model.model.layers[0].mlp.experts) is cls
    assert not any(type(m).__name__ == "ExpertMatrix" for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quantize_groups_chunks_are_refused_for_experts():
    model = make_moe("qwen3_moe")
    cfg = cfg_w(8, True, None)
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_groups"] = 4
    with pytest.raises(ConfigError, match=r"experts\.gate_up_proj.*granularity|granularity.*experts\.gate_up_proj"):
        qcompress.init_compression(model, cfg)


def test_pruning_that_names_experts_is_refused():
    model = make_moe("mixtral")
    cfg = {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": {"enabled": True, "method": "l1"},
                "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["experts"]}},
            }
        }
    }
    with pytest.raises(ConfigError, match="fused mixture-of-experts"):
        qcompress.init_compression(model, cfg)


def test_bit_schedule_reaches_the_target_per_expert():
    model = make_moe("mixtral")
    fp = copy.deepcopy(model)
    qcompress.init_compression(model, cfg_w(4, False, "group", start=8, period=2))
    sched = qcompress.CompressionScheduler(model)
    x = tokens(model)
    ref8 = oracle_copy(fp, lambda m: fake_quantize(m, 8, symmetric=False, granularity="group", group_size=16))
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref8(x).logits)
    for _ in range(40):
        sched.step()
    assert set(sched.current_bits().values()) == {4}
    ref4 = oracle_copy(fp, lambda m: fake_quantize(m, 4, symmetric=False, granularity="group", group_size=16))
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref4(x).logits)


def test_optimizer_step_mode_writes_quantized_experts_into_the_parameters():
    model = make_moe("qwen3_moe")
    fp = copy.deepcopy(model)
    cfg = cfg_w(4, True, "group")
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["quantize_weight_in_forward"] = False
    qcompress.init_compression(model, cfg)
    ref = oracle_copy(fp, lambda m: fake_quantize(m, 4, granularity="group", group_size=16))
    for name, (p, _) in experts_params(model).items():
        assert torch.equal(p, experts_params(ref)[name][0]), name


def test_mse_observer_and_learned_ranges_are_per_expert():
    model = make_moe("qwen3_moe")
    cfg = cfg_w(4, False, "group", observer="mse")
    qcompress.init_compression(model, cfg)
    part = model.model.layers[0].mlp.experts._modules["gate_up_proj"]
    e, out, inp = part.matrix_shape()
    assert part.qc_wq.shrink is not None and part.qc_wq.shrink.numel() == e * out * (inp // 16)
    learned = make_moe("gpt_oss")
    qcompress.init_compression(learned, cfg_w(4, True, "group", range_learning=True))
    part = learned.model.layers[0].mlp.experts._modules["down_proj"]
    e, out, inp = part.matrix_shape()
    assert part.weight_scale.shape[0] == e * out and part.weight_scale.numel() == e * out * (inp // 16)
    learned.train()
    x = tokens(learned)
    learned(x, labels=x).loss.backward()
    assert part.weight_scale.grad is not None and part.weight_scale.grad.abs().sum() > 0
    assert "model.layers.0.mlp.experts.down_proj.weight_scale" in learned.state_dict()


def _act_cfg(wbits=8, abits=8, calibration="dynamic"):
    cfg = cfg_w(wbits, True, "channel")
    cfg["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "range_calibration": calibration, "schedule_offset": 0},
        "different_groups": {"aq": {"params": {"bits": abits}, "modules": [EXPERTS]}},
    }
    return cfg


def _oracle_experts_forward(mod, abits):
    """Both matrix inputs fake-quantized per token (moe_fixtures.reference_experts_forward)."""
    return reference_experts_forward(mod, lambda which, e, x: fake_quantize(x, abits, granularity="token"))


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_inputs_quantized_per_token_match_a_reference_forward(family):
    model = make_moe(family)
    fp = copy.deepcopy(model)
    qcompress.init_compression(model, _act_cfg())
    ref = oracle_copy(fp, lambda m: fake_quantize(m, 8, granularity="channel"))
    for name, mod in ref.named_modules():
        if type(mod).__name__.endswith("Experts"):
            mod.forward = _oracle_experts_forward(mod, 8)
    x = tokens(model)
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
        weights_only = oracle_copy(fp, lambda m: fake_quantize(m, 8, granularity="channel"))(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, weights_only)  # the inputs were quantized


def test_batched_experts_implementation_quantizes_inputs_too():
    model = make_moe("qwen3_moe")
    qcompress.init_compression(model, _act_cfg())
    x = tokens(model)
    with torch.no_grad():
        eager = model(x).logits
        model.config._experts_implementation = "batched_mm"
        batched = model(x).logits
    torch.testing.assert_close(batched, eager, rtol=1e-5, atol=1e-5)


def test_int8_forward_on_experts_is_ignored_by_name():
    model = make_moe("qwen3_moe")
    fp = copy.deepcopy(model)
    cfg = _act_cfg()
    cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = True
    with pytest.warns(UserWarning, match=r"int8_forward.*model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        qcompress.init_compression(model, cfg)
    plain = copy.deepcopy(fp)
    qcompress.init_compression(plain, _act_cfg())
    x = tokens(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)


def test_a_whole_compressed_moe_model_pickles():
    # An in-memory round trip of the object just built (as multiprocessing and deepcopy-by-pickle
    # do); files are never loaded with pickle, so this goes through pickle itself, not torch.load.
    import pickle

    model = make_moe("gpt_oss")
    qcompress.init_compression(model, cfg_w(4, True, "group"))
    x = tokens(model)
    again = pickle.loads(pickle.dumps(model))
    experts = again.model.layers[0].mlp.experts
    assert experts._modules["gate_up_proj"].owner is experts  # the part follows its own owner
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def test_learned_static_ranges_of_the_default_group_leave_the_experts_out_with_a_warning():
    model = make_moe("qwen3_moe")
    cfg = _act_cfg(calibration="static")
    group = cfg["compression_training"]["activation_quantization"]["different_groups"]["aq"]
    del group["modules"]
    group["params"]["range_learning"] = True
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*left out"):
        qcompress.init_compression(model, cfg)
    part = model.model.layers[0].mlp.experts._modules["gate_up_proj"]
    assert part.qc_aq is None and part.qc_wq is not None
    assert model.model.layers[0].self_attn.q_proj.qc_aq.calibration == "static"
