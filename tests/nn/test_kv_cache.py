"""KV-cache quantization (qcompress/nn/kv_cache.py): the quantizer against compressed-tensors'
own, every family's attention reached through transformers' attention interface, static ranges
(EMA) and learned scales, the schedule, and the config errors raised before anything changes."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import qcompress as qc
from qcompress import ConfigError
from qcompress.nn import kv_cache

from tests.helpers.kv_fixtures import FAMILIES, ct_args, ct_oracle, kv_config, make_model, qc_scales, transformers

CASES = [("fp8_e4m3", "tensor"), ("fp8_e4m3", "head"), ("int8", "tensor"), ("int8", "head")]


def _kv(batch=2, heads=3, seq=7, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, seq, dim, generator=g)
    x[0, 1, 2, 3] = 9.0  # an outlier in one head
    x[1, 0, 0, 0] = -0.0
    return x


@pytest.mark.parametrize("fmt,strategy", CASES)
def test_fake_quantization_equals_compressed_tensors_quantizer(fmt, strategy):
    """The same K, the same scale: qcompress' x^ equals compressed-tensors' fake_quantize of the
    cache's QuantizationArgs (what its QuantizedKVCache applies); the FP8 scale from the range is
    compressed-tensors' calculate_qparams', the int8 one amax / 127 (qcompress' integer grid)."""
    ct = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is the oracle")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = _kv()
    state = kv_cache.KVQuant(format=fmt, strategy=strategy, heads=3, k=kv_cache.KVRange(per_head=strategy == "head"))
    lo, hi = state.k.observe(x)
    scale = kv_cache.scales_from_range(state, lo, hi)
    assert scale.shape == ((1,) if strategy == "tensor" else (3, 1, 1))
    args = ct_args(fmt, strategy)
    amax = torch.maximum(lo.abs(), hi.abs()).reshape(scale.shape)
    if fmt == "fp8_e4m3":
        ct_scale, _ = calculate_qparams(lo.reshape(scale.shape), hi.reshape(scale.shape), args)
        assert torch.equal(scale, ct_scale)
    else:
        assert torch.equal(scale, amax / 127.0)
    ours = kv_cache.fake_quantize_kv(x, state, scale)
    theirs = fake_quantize(x, scale, None, args)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, x)
    # on the grid: int8 codes are integers in range; FP8 codes are e4m3 values
    codes = x / scale
    if fmt == "int8":
        assert torch.equal(ours, torch.clamp(torch.round(codes), -128, 127) * scale)
    else:
        assert torch.equal(ours, torch.clamp(codes, -448, 448).to(torch.float8_e4m3fn).float() * scale)
    assert ct is not None


def _spy_attention(monkeypatch, model, seen):
    """Record the keys / values the model's own attention function receives (behind qcompress'
    wrapper): the registry entry of sdpa, or the family module's eager_attention_forward."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = next(m for _, m in kv_cache.quantized_modules(model))
    impl = kv_cache.original_implementation(mod)
    if impl == "eager":
        family = sys.modules[type(mod).__module__]
        real = family.eager_attention_forward

        def spy(module, q, k, v, *a, **kw):
            seen.append((module, k.detach().clone(), v.detach().clone()))
            return real(module, q, k, v, *a, **kw)

        monkeypatch.setattr(family, "eager_attention_forward", spy)
    else:
        real = ALL_ATTENTION_FUNCTIONS[impl]

        def spy(module, q, k, v, *a, **kw):
            seen.append((module, k.detach().clone(), v.detach().clone()))
            return real(module, q, k, v, *a, **kw)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, spy)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_attention_sees_quantized_kv_and_equals_compressed_tensors(family, monkeypatch):
    """Per family: init_compression reaches every self-attention module; after calibration the
    attention function is handed keys / values on the quantized grid of the scales qcompress
    exports, and the logits equal compressed-tensors' QuantizedKVCache on an untouched copy with
    those scales, bit for bit."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    fmt, strategy = CASES[FAMILIES.index(family) % len(CASES)]
    model = make_model(family)
    untouched = copy.deepcopy(model)
    qc.init_compression(model, kv_config(fmt, strategy))
    names = [n for n, _ in kv_cache.quantized_modules(model)]
    expected = [n for n, m in untouched.named_modules() if n and kv_cache.dispatches(m)]
    assert names == expected and len(names) == 2
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    model(x)  # one calibration batch
    model.eval()
    scales = qc_scales(model)
    seen = []
    _spy_attention(monkeypatch, model, seen)
    logits = model(x).logits
    assert len(seen) == 2
    named = dict(model.named_modules())
    for module, k, v in seen:
        name = next(n for n in names if named[n] is module)
        for t, s in zip((k, v), scales[name]):
            codes = t / s
            if fmt == "int8":
                assert torch.allclose(codes, torch.round(codes), atol=1e-3) and codes.abs().max() <= 128
            else:
                assert torch.allclose(codes, codes.to(torch.float8_e4m3fn).float(), rtol=1e-5, atol=0)
    monkeypatch.undo()
    oracle = ct_oracle(untouched, scales, fmt, strategy)
    assert torch.equal(logits, oracle(x).logits)
    assert not torch.equal(logits, untouched(x).logits)


def test_generation_with_a_cache_equals_compressed_tensors_cache():
    """Greedy generation with transformers' DynamicCache: every step's logits equal
    compressed-tensors' quantized cache (it stores quantized K / V; qcompress re-quantizes the
    cached entries with the same frozen scale, which gives them back unchanged)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    model = make_model("llama")
    untouched = copy.deepcopy(model)
    qc.init_compression(model, kv_config("int8", "head"))
    x = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    model.train()
    model(x)
    model.eval()
    oracle = ct_oracle(untouched, qc_scales(model), "int8", "head")
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    a, b = model.generate(x, **kw), oracle.generate(x, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(p, q) for p, q in zip(a.logits, b.logits))


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_static_ranges_are_an_ema_frozen_in_eval(strategy, monkeypatch):
    """Two training batches: each layer's K / V range is momentum * first + (1 - momentum) * second
    of the ranges of the keys / values handed to qcompress' wrapper (unquantized); eval neither
    moves it nor uses the batch's own range."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = make_model("llama")
    qc.init_compression(model, kv_config("fp8_e4m3", strategy, momentum=0.8))
    name = model.config._attn_implementation
    assert name == kv_cache.PREFIX + "sdpa"
    wrapper = ALL_ATTENTION_FUNCTIONS[name]
    seen = []

    def spy(module, q, k, v, *a, **kw):
        seen.append((k.detach().clone(), v.detach().clone()))
        return wrapper(module, q, k, v, *a, **kw)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, spy)

    def rng(t):
        if strategy == "head":
            t = t.transpose(0, 1).reshape(t.shape[1], -1)
            return t.amin(1), t.amax(1)
        return t.amin(), t.amax()

    model.train()
    for seed in (3, 4):
        model(torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed)))
    model.eval()
    mods = [m for _, m in kv_cache.quantized_modules(model)]
    frozen = [(m.__dict__[kv_cache.ATTR].k.min.clone(), m.__dict__[kv_cache.ATTR].v.max.clone()) for m in mods]
    model(torch.randint(0, 96, (1, 5)) * 0 + 7)
    for i, m in enumerate(mods):
        state = m.__dict__[kv_cache.ATTR]
        assert torch.equal(state.k.min, frozen[i][0]) and torch.equal(state.v.max, frozen[i][1])
        for which, idx in (("k", 0), ("v", 1)):
            (lo1, hi1), (lo2, hi2) = rng(seen[i][idx]), rng(seen[2 + i][idx])
            obs = getattr(state, which)
            assert torch.allclose(obs.min, 0.8 * lo1 + 0.2 * lo2, rtol=0, atol=1e-7)
            assert torch.allclose(obs.max, 0.8 * hi1 + 0.2 * hi2, rtol=0, atol=1e-7)


@pytest.mark.parametrize("fmt,strategy", [("fp8_e4m3", "tensor"), ("int8", "head")])
def test_mse_observer_shrinks_the_range_to_a_smaller_error(fmt, strategy, monkeypatch):
    """observer: mse: each layer's K / V range after one batch lies inside the batch's min / max
    (per head), and quantizing the raw keys / values with its scales errs no more than with the
    min / max scales (the sum of squared errors the search minimises, on the whole batch)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = make_model("llama")
    qc.init_compression(model, kv_config(fmt, strategy, observer="mse"))
    name = model.config._attn_implementation
    wrapper = ALL_ATTENTION_FUNCTIONS[name]
    seen = []

    def spy(module, q, k, v, *a, **kw):
        seen.append((module, k.detach().clone(), v.detach().clone()))
        return wrapper(module, q, k, v, *a, **kw)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, spy)
    model.train()
    model(torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5)))
    shrunk = 0
    for module, k, v in seen:
        state = module.__dict__[kv_cache.ATTR]
        for which, t in (("k", k), ("v", v)):
            obs = getattr(state, which)
            plain = kv_cache.KVRange(per_head=strategy == "head")
            lo, hi = plain.observe(t)
            assert bool((obs.min >= lo).all()) and bool((obs.max <= hi).all())
            shrunk += int((obs.max < hi).sum())
            mse = kv_cache.fake_quantize_kv(t, state, kv_cache.scales_from_range(state, obs.min, obs.max))
            mm = kv_cache.fake_quantize_kv(t, state, kv_cache.scales_from_range(state, lo, hi))
            assert float((mse - t).double().square().sum()) <= float((mm - t).double().square().sum()) * (1 + 1e-6)
    assert shrunk > 0 and "mse" in qc.summary(model)


def test_schedule_offset_and_learned_scales_start_from_the_range():
    """Off before schedule_offset; with range_learning the k_scale / v_scale Parameters (the shape
    compressed-tensors registers) are set from the static range at the first scheduler step after
    it saw a batch, then receive LSQ gradients."""
    model = make_model("qwen3")
    cfg = kv_config("int8", "head", range_learning=True, schedule_offset=1)
    qc.init_compression(model, cfg)
    sched = qc.CompressionScheduler(model, cfg)
    attn = model.model.layers[0].self_attn
    state = attn.__dict__[kv_cache.ATTR]
    assert attn.k_scale.shape == (2, 1, 1) and attn.v_scale.requires_grad
    x = torch.randint(0, 96, (2, 8))
    model.train()
    before = model(x).logits
    assert not state.active and not state.k.initialized  # off: the range not observed either
    sched.step()
    assert state.active and not state.learned_ready
    model(x, labels=x).loss.backward()  # observes; learned scales not used yet
    assert attn.k_scale.grad is not None and float(attn.k_scale.grad.abs().sum()) == 0.0
    sched.step()
    assert state.learned_ready
    expect = kv_cache.scales_from_range(state, state.k.min, state.k.max)
    assert torch.equal(attn.k_scale.detach(), expect)
    attn.k_scale.grad = None
    model(x, labels=x).loss.backward()
    assert float(attn.k_scale.grad.abs().sum()) > 0
    assert attn.k_scale.shape == (2, 1, 1)
    assert not torch.equal(before, model(x).logits)


def test_learned_scales_get_range_optimizer_groups():
    """The learned KV scales are learned ranges: qcompress' range optimizer groups (and
    learn_ranges) take them."""
    from qcompress.nn.range_groups import range_parameter_ids

    model = make_model("llama")
    qc.init_compression(model, kv_config("fp8_e4m3", "tensor", range_learning=True))
    ids = range_parameter_ids(model)
    want = {id(getattr(model.model.layers[i].self_attn, s)) for i in range(2) for s in ("k_scale", "v_scale")}
    assert ids == want


def test_scheduler_state_round_trips():
    model = make_model("mistral")
    cfg = kv_config("int8", "tensor")
    qc.init_compression(model, cfg)
    sched = qc.CompressionScheduler(model, cfg)
    model.train()
    model(torch.randint(0, 96, (2, 8)))
    sd = sched.state_dict()
    other = make_model("mistral", seed=5)
    qc.init_compression(other, cfg)
    sched2 = qc.CompressionScheduler(other, cfg)
    sched2.load_state_dict(sd)
    for (_, a), (_, b) in zip(kv_cache.quantized_modules(model), kv_cache.quantized_modules(other)):
        sa, sb = a.__dict__[kv_cache.ATTR], b.__dict__[kv_cache.ATTR]
        assert torch.equal(sa.k.min, sb.k.min) and torch.equal(sa.v.max, sb.v.max)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("format", "fp16", "kv_cache_quantization.format: 'fp16' is not allowed"),
        ("strategy", "channel", "kv_cache_quantization.strategy: 'channel' is not allowed"),
        ("range_calibration", "dynamic", "kv_cache_quantization.range_calibration: 'dynamic' is not allowed"),
        ("momentum", 1.0, "kv_cache_quantization.momentum"),
        ("formt", "int8", "did you mean 'format'"),
    ],
)
def test_bad_keys_are_config_errors(key, value, match):
    raw = kv_config()
    raw["compression_training"]["kv_cache_quantization"][key] = value
    with pytest.raises(ConfigError, match=match):
        qc.load_config(raw)


def _unchanged(model, impl):
    assert not kv_cache.quantized_modules(model)
    assert not any(n.endswith(("k_scale", "v_scale")) for n, _ in model.named_parameters())
    cfg = getattr(model, "config", None)
    assert cfg is None or cfg._attn_implementation == impl


def test_attention_that_cannot_be_reached_is_refused_before_anything_changes():
    """nn.MultiheadAttention computes attention in its own code: no wrapper can see its K / V."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(self.attn(x, x, x)[0])

    model = Block()
    with pytest.raises(
        ConfigError,
        match=r"kv_cache_quantization\.enabled: Block's attention cannot be reached.*"
        r"'attn'.*set enabled: false",
    ):
        qc.init_compression(model, kv_config())
    _unchanged(model, None)


def test_encoder_and_latent_attention_are_refused():
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
        )
    )
    with pytest.raises(ConfigError, match="bidirectional.*encoder keeps no KV cache"):
        qc.init_compression(bert, kv_config())
    _unchanged(bert, "sdpa")
    from tests.helpers.moe_fixtures import make_moe

    ds = make_moe("deepseek_v3")
    impl = ds.config._attn_implementation
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        qc.init_compression(ds, kv_config())
    _unchanged(ds, impl)


def test_modules_that_match_nothing_and_upcast_gpt2_are_refused():
    model = make_model("llama")
    with pytest.raises(ConfigError, match=r"kv_cache_quantization\.modules: \['cross'\] matches none"):
        qc.init_compression(model, kv_config(modules=["cross"]))
    _unchanged(model, "sdpa")
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, reorder_and_upcast_attn=True)
    gpt2 = transformers.GPT2LMHeadModel(cfg)
    gpt2.set_attn_implementation("eager")
    with pytest.raises(ConfigError, match="reorder_and_upcast_attn"):
        qc.init_compression(gpt2, kv_config())
    _unchanged(gpt2, "eager")


def test_modules_select_layers_and_a_second_install_is_refused():
    model = make_model("llama")
    qc.init_compression(model, kv_config(modules=[r"layers\.1\."]))
    assert [n for n, _ in kv_cache.quantized_modules(model)] == ["model.layers.1.self_attn"]
    with pytest.raises(ValueError, match="already installed"):
        qc.init_compression(model, kv_config())


def test_a_failed_rewrite_leaves_the_attention_as_it_was(monkeypatch):
    """An error after the KV install (here: the scheduler's first step) undoes it: implementation,
    state and learned Parameters."""
    import qcompress.rewrite as rewrite

    def fail(root):
        raise RuntimeError("stop")

    monkeypatch.setattr(rewrite, "CompressionScheduler", fail)
    model = make_model("llama")
    with pytest.raises(RuntimeError, match="stop"):
        qc.init_compression(model, kv_config("fp8_e4m3", "tensor", range_learning=True))
    _unchanged(model, "sdpa")


def test_a_pickled_model_registers_its_implementation_again(monkeypatch):
    """A model saved whole and loaded where qcompress never installed anything (another process)
    finds `qcompress_kv_<impl>` registered again, and computes the same logits."""
    import io

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = make_model("llama")
    qc.init_compression(model, kv_config("int8", "head"))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    model(x)
    model.eval()
    ref = model(x).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    name = kv_cache.PREFIX + "sdpa"
    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name)
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # a whole-model pickle the user made (torch.save(model)) needs it
    assert name in ALL_ATTENTION_FUNCTIONS._global_mapping
    assert torch.equal(loaded(x).logits, ref)
