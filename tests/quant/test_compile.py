"""torch.compile of compressed models: whole graphs (no breaks) in training and eval, the compiled
step equal to the eager one, one graph per schedule state (not per step), NaN still reported.

Oracle: the same model run eagerly (the fused eager path, itself bit for bit the unfused one), and
torch._dynamo's own counters (explain's graph breaks, a counting backend's compiled frames)."""

import copy

import pytest
import torch

import qcompress as qc
from qcompress.errors import NonFiniteError
from qcompress.quant import kernels

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def make_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def make_bert(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(cfg)


def make_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=64, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"bert": make_bert, "llama": make_llama, "gpt2": make_gpt2}


def recipe(wbits=4, abits=8, group=32, start=None, period=0, act_offset=0, rounding="nearest"):
    params = {
        "start_bits": start or wbits,
        "target_bits": wbits,
        "quantization_period": period,
        "period_growth": "linear",
    }
    if group:
        params["group_size"] = group
    else:
        params["granularity"] = "channel"
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": 0,
                    "quantize_weight_in_forward": True,
                    "rounding": rounding,
                },
                "different_groups": {"w": {"params": params}},
            }
        }
    }
    if abits:
        doc["compression_training"]["activation_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": act_offset, "range_calibration": "dynamic"},
            "different_groups": {"a": {"params": {"bits": abits}}},
        }
    return qc.load_config(doc)


RECIPES = {
    "w8a8": dict(wbits=8, abits=8, group=None),
    "w4a8_g32": dict(wbits=4, abits=8, group=32),
    "w4_g32": dict(wbits=4, abits=0, group=32),
}


def compressed(kind, **kw):
    model = MODELS[kind]()
    cfg = recipe(**kw)
    qc.init_compression(model, cfg)
    return model, cfg


def ids(batch=2, seq=16, seed=1):
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model, x):
    # the loss here, not transformers' loss_function: GPT-2's logs a warning inside it, a graph break
    # of the uncompressed model too
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def train_step(model, x, fn=None):
    """(loss, {name: grad}) of one forward and backward."""
    loss = (fn or loss_of)(model, x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def eager_and_compiled(kind, name, backend):
    """(loss, grads) of one eager training step and of the same step compiled, on twin models."""
    model, _ = compressed(kind, **RECIPES[name])
    model.train()
    twin = copy.deepcopy(model)
    x = ids()
    eager = train_step(model, x)
    torch._dynamo.reset()
    return eager, train_step(twin, x, torch.compile(loss_of, backend=backend, fullgraph=True))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_training_and_eval_forwards_have_no_graph_break(kind):
    model, _ = compressed(kind, **RECIPES["w4a8_g32"])
    x = ids()
    model.train()
    torch._dynamo.reset()
    ex = torch._dynamo.explain(loss_of)(model, x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [b.reason for b in ex.break_reasons]
    model.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(loss_of)(model, x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [b.reason for b in ex.break_reasons]


@pytest.mark.parametrize(
    "kind,name", [("llama", "w4_g32"), ("llama", "w4a8_g32"), ("bert", "w8a8"), ("gpt2", "w4a8_g32")]
)
def test_compiled_training_step_equals_eager_bit_for_bit(kind, name):
    # aot_eager runs the graph AOTAutograd traced (the composed quantizer path, the same kernels):
    # every value and gradient has the eager fused path's bits
    (loss_e, grads_e), (loss_c, grads_c) = eager_and_compiled(kind, name, "aot_eager")
    assert torch.equal(loss_c, loss_e)
    assert grads_c.keys() == grads_e.keys() and len(grads_e) > 5
    for n in grads_e:
        assert torch.equal(grads_c[n], grads_e[n]), n


def test_compiled_eval_forward_equals_eager():
    model, _ = compressed("llama", **RECIPES["w4a8_g32"])
    model.eval()
    x = ids()
    with torch.no_grad():
        want = model(input_ids=x).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=x).logits
    assert torch.equal(got, want)


def test_inductor_step_matches_eager_within_float_tolerance():
    # inductor fuses the float ops around the quantizer ops (other summation orders); the quantizer
    # ops themselves stay the same opaque kernels
    (loss_e, grads_e), (loss_c, grads_c) = eager_and_compiled("llama", "w4a8_g32", "inductor")
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for n in grads_e:
        scale = grads_e[n].abs().max().clamp(min=1e-12)
        err = (grads_c[n] - grads_e[n]).abs().max() / scale
        assert err < 2e-3, (n, float(err))  # relative to the tensor's largest gradient


def run_schedule(model, cfg, steps, compiled):
    sched = qc.CompressionScheduler(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    states = []
    for _ in range(steps):
        wq = model.model.layers[0].mlp.down_proj.qc_wq
        aq = model.model.layers[0].mlp.down_proj.qc_aq
        states.append((wq.active, wq.bits, aq.active))
        compiled(model, ids()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return states


def test_bit_schedule_compiles_once_per_schedule_state():
    # 8 -> 4 bits, one bit every 2 steps, activations on from step 3: 6 states over 14 steps
    model = make_llama()
    cfg = recipe(wbits=4, start=8, period=2, act_offset=3)
    qc.init_compression(model, cfg)
    model.train()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    states = run_schedule(model, cfg, 14, torch.compile(loss_of, backend=counter, fullgraph=True))
    assert len(set(states)) >= 5 and states[-1] == states[-2] == (True, 4, True), states
    assert counter.frame_count == len(set(states)), (counter.frame_count, states)


@pytest.mark.skipif(not kernels.available(), reason="the NaN report under test is the C++ kernels' own")
def test_nan_input_still_raises_under_compile():
    model, _ = compressed("llama", **RECIPES["w4a8_g32"])
    model.train()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    torch._dynamo.reset()
    step = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    with pytest.raises((NonFiniteError, RuntimeError), match="NaN"):
        step(model, ids())


@pytest.mark.skipif(not kernels.available(), reason=f"the C++ kernels are not built: {kernels.load_error()}")
@pytest.mark.parametrize("rows,cols,group", [(6, 64, 32), (5, 40, 16), (3, 7, 7)])
def test_group_layout_ops_pass_opcheck(rows, cols, group):
    # schema, fake kernel (the shapes fake-tensor propagation sees) and dispatch of the ops the
    # group-granularity paths call, with a last group shorter than the others where cols % group != 0
    ops = torch.ops.qcompress
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    groups = rows * -(-cols // group)
    scale = torch.rand(groups, generator=g) * 0.1 + 0.01
    zp = torch.randint(-3, 3, (groups,), generator=g).float()
    for z in (None, zp):
        torch.library.opcheck(ops.fake_quant_params, (x, scale, z, rows, cols, group, 4, 0, 0, True))
        torch.library.opcheck(
            ops.lsq_backward, (torch.randn(rows, cols, generator=g), x, scale, z, rows, cols, group, 4, 0, 0)
        )
    torch.library.opcheck(ops.quantize, (x, None, rows, cols, group, 4, 0, True, False, 0, 0))
    torch.library.opcheck(ops.quantize_values, (x.bfloat16(), None, rows, cols, group, 4, 0, False, False, 0, 0))
    torch.library.opcheck(ops.mse_errors, (x, scale.repeat(3, 1), None, rows, cols, group, 4))
    torch.library.opcheck(ops.mse_refine_terms, (x, scale, rows, cols, group, 4))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_weight_only_moe_training_forward_has_no_graph_break(family):
    # fused 3-D expert Parameters quantized per expert (qcompress/nn/experts.py) inside the model's
    # own experts implementation
    from tests.helpers.moe_fixtures import make_moe

    model = make_moe(family).train()
    qc.init_compression(model, recipe(wbits=4, abits=0, group=16))
    torch._dynamo.reset()
    ex = torch._dynamo.explain(loss_of)(model, ids(seq=12))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [b.reason for b in ex.break_reasons]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("name", ["w8a8", "w4a8_g16"])
def test_per_token_input_quantized_moe_compiles_whole_and_equals_the_eager_loop(family, name, impl):
    # dynamic per-token input quantization of the experts: under compile the hidden states are
    # quantized once before transformers' own batched / grouped forward and the down input in its
    # gate, instead of the per-expert eager loop the eager mode runs (the oracle here)
    from tests.helpers.moe_fixtures import make_moe
    from qcompress.nn.experts import ExpertMatrix

    kw = dict(RECIPES["w8a8"]) if name == "w8a8" else dict(wbits=4, abits=8, group=16)
    model = make_moe(family).train()
    model.config._experts_implementation = impl
    qc.init_compression(model, recipe(**kw))
    experts_unquantized = copy.deepcopy(model)  # the same model, its expert inputs left as they are
    for m in experts_unquantized.modules():
        if isinstance(m, ExpertMatrix):
            m.qc_aq = None
    x = ids(seq=12)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(loss_of)(model, x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [b.reason for b in ex.break_reasons]
    twin = copy.deepcopy(model)
    (loss, grads), (_, plain) = train_step(model, x), train_step(experts_unquantized, x)
    torch._dynamo.reset()
    c_loss, c_grads = train_step(twin, x, torch.compile(loss_of, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=1e-6)
    assert c_grads.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(c_grads[n], grads[n], rtol=1e-4, atol=1e-6, msg=n)
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # the compiled graph quantized their inputs
            assert not torch.allclose(c_grads[n], plain[n], rtol=1e-2, atol=1e-6), n
