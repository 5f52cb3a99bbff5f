"""Static input ranges of fused experts (qcompress.nn.expert_ranges): one EMA range per expert over
the tokens routed to it, checked against a reference experts forward written from the routing
rule that keeps its own per-expert EMA (the oracle), in training (ranges move) and in eval
(frozen); the ranges travel in the scheduler state and average across data-parallel ranks."""

import copy

import pytest
import torch

import qcompress
from qcompress import ConfigError
from qcompress.quant import fake_quantize
from tests.helpers.moe_fixtures import make_moe, oracle_copy, reference_experts_forward, tokens

EXPERTS = r"mlp\.experts"
MOMENTUM = 0.9


def _cfg(sym=False, **aq_params):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"},
                        "modules": [EXPERTS],
                    }
                },
            },
            "activation_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "range_calibration": "static",
                    "schedule_offset": 0,
                    "momentum": MOMENTUM,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                },
                "different_groups": {"aq": {"params": {"bits": 8, **aq_params}, "modules": [EXPERTS]}},
            },
        }
    }


class _Ema:
    """The oracle's ranges: {(module, matrix, expert): [lo, hi]}, EMA in float32, frozen in eval."""

    def __init__(self):
        self.r = {}

    def quantize(self, key, x, training, sym):
        lo, hi = x.detach().amin().float(), x.detach().amax().float()
        if training:
            if key in self.r:
                plo, phi = self.r[key]
                lo, hi = MOMENTUM * plo + (1 - MOMENTUM) * lo, MOMENTUM * phi + (1 - MOMENTUM) * hi
            self.r[key] = [lo, hi]
        lo, hi = self.r[key]
        return fake_quantize(x, 8, symmetric=sym, min_val=lo, max_val=hi)


def _reference_forward(mod, name, ema, sym):
    return reference_experts_forward(mod, lambda which, e, x: ema.quantize((name, which, e), x, mod.training, sym))


def _pair(family, sym=False):
    model = make_moe(family)
    fp = copy.deepcopy(model)
    qcompress.init_compression(model, _cfg(sym))
    ref = oracle_copy(fp, lambda m: fake_quantize(m, 8, granularity="channel"))
    ema = _Ema()
    for name, mod in ref.named_modules():
        if type(mod).__name__.endswith("Experts"):
            mod.forward = _reference_forward(mod, name, ema, sym)
    return model, ref, ema


@pytest.mark.parametrize("family,sym", [("qwen3_moe", False), ("gpt_oss", True), ("mixtral", True)])
def test_per_expert_static_ranges_match_a_reference_with_its_own_ema(family, sym):
    model, ref, ema = _pair(family, sym)
    with torch.no_grad():
        for m in (model, ref):
            m.train()
        for seed in range(3):  # ranges move in training
            x = tokens(model, batch=2, seq=10, seed=seed)
            torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        for m in (model, ref):
            m.eval()
        x = tokens(model, batch=3, seq=7, seed=9)  # frozen in eval
        torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
    experts = model.model.layers[0].mlp.experts
    obs = experts._modules["gate_up_proj"].qc_aq.observer
    name = "model.layers.0.mlp.experts"
    seen = [e for e in range(4) if (name, "gu", e) in ema.r]
    assert len(seen) >= 2 and [e for e in range(4) if obs[e].initialized] == seen
    for e in seen:
        assert torch.equal(obs[e].min, ema.r[(name, "gu", e)][0]) and torch.equal(obs[e].max, ema.r[(name, "gu", e)][1])
    # one range per expert, not one for the layer (a token routed to two experts may set both)
    assert len({(float(obs[e].min), float(obs[e].max)) for e in seen}) > 1


def test_scheduler_state_carries_each_experts_range():
    model, _, _ = _pair("qwen3_moe")
    sched = qcompress.CompressionScheduler(model, _cfg())
    model.train()
    with torch.no_grad():
        model(tokens(model, seed=3))
    sd = sched.state_dict()
    other, _, _ = _pair("qwen3_moe")
    osched = qcompress.CompressionScheduler(other, _cfg())
    osched.load_state_dict(sd)
    for layer in range(2):
        a = model.model.layers[layer].mlp.experts._modules["down_proj"].qc_aq.observer
        b = other.model.layers[layer].mlp.experts._modules["down_proj"].qc_aq.observer
        for e in range(4):
            assert a[e].initialized == b[e].initialized
            if a[e].initialized:
                assert torch.equal(a[e].min, b[e].min) and torch.equal(a[e].max, b[e].max)
    model.eval(), other.eval()
    x = tokens(model, seed=4)
    with torch.no_grad():
        assert torch.equal(model(x).logits, other(x).logits)


def test_sync_averages_each_expert_over_the_ranks_that_routed_tokens_to_it():
    from qcompress.nn.expert_ranges import ExpertRanges

    ranks = [ExpertRanges(3), ExpertRanges(3)]
    ranks[0][0].update(torch.tensor(-1.0), torch.tensor(1.0))
    ranks[1][0].update(torch.tensor(-3.0), torch.tensor(5.0))
    ranks[1][1].update(torch.tensor(-2.0), torch.tensor(2.0))  # expert 1 only on rank 1
    summed = ranks[0].sync_tensor() + ranks[1].sync_tensor()  # what all_reduce(SUM) gives
    for r in ranks:
        r.sync_from(summed, 2)
        assert (float(r[0].min), float(r[0].max)) == (-2.0, 3.0)
        assert (float(r[1].min), float(r[1].max)) == (-2.0, 2.0)
        assert not r[2].initialized


def test_learned_static_expert_ranges_are_refused_by_name():
    model = make_moe("mixtral")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*range_learning"):
        qcompress.init_compression(model, _cfg(range_learning=True))
    assert not any(type(m).__name__ == "ExpertMatrix" for m in model.modules())


@pytest.mark.parametrize("family,sym", [("qwen3_moe", False), ("gpt_oss", True)])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_export_writes_one_input_scale_per_expert_and_reload_applies_them(tmp_path, family, sym, mode):
    from safetensors import safe_open
    from qcompress.quant import reference

    model, _, _ = _pair(family, sym)
    model.train()
    with torch.no_grad():
        for seed in range(3):
            model(tokens(model, batch=4, seq=16, seed=seed))
    model.eval()
    qcompress.export_quantized(model, tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    obs = model.model.layers[1].mlp.experts._modules["down_proj"].qc_aq.observer
    spec = reference.make_spec(8, symmetric=sym, granularity="tensor")
    for e in range(4):
        want, wz, _ = reference.qparams(
            torch.zeros(1, 1), torch.ones(1, dtype=torch.int64), spec, min_val=obs[e].min, max_val=obs[e].max
        )
        if family == "gpt_oss":  # the per-expert names vLLM's gpt-oss loader uses (w2 = down_proj)
            got = sd[f"model.layers.1.mlp.experts.{e}.w2_input_scale"]
        else:  # save_pretrained's per-expert Linear names
            got = sd[f"model.layers.1.mlp.experts.{e}.down_proj.input_scale"]
            assert torch.equal(
                sd[f"model.layers.1.mlp.experts.{e}.gate_proj.input_scale"],
                sd[f"model.layers.1.mlp.experts.{e}.up_proj.input_scale"],
            )
            assert sd[f"model.layers.1.mlp.experts.{e}.up_proj.input_zero_point"].dtype == torch.int8
        assert torch.equal(got.reshape(()), want.reshape(()).float()), e
    assert (
        len(
            {
                float(sd[f"model.layers.1.mlp.experts.{e}.w2_input_scale"])
                if family == "gpt_oss"
                else float(sd[f"model.layers.1.mlp.experts.{e}.down_proj.input_scale"])
                for e in range(4)
            }
        )
        > 1
    )
    loaded = qcompress.load_quantized(tmp_path / "q", make_moe(family, seed=5), mode=mode)
    x = tokens(model, batch=2, seq=9, seed=11)
    with torch.no_grad():
        want_logits = model(x).logits
        got_logits = loaded(x).logits
    if mode == "exact":
        assert torch.equal(got_logits, want_logits)
    else:
        # the low-bit kernels sum in another order; a static input scale is coarser than a per-token
        # one, so an input on a rounding boundary can move by one step: a small bound, and the
        # per-expert scales are in use (the kernels ran, and most logits agree to summation order)
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-3)
        assert ((got_logits - want_logits).abs() > 1e-4).float().mean() < 0.2
