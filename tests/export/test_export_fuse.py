"""Activations fused into the layer before them by load_quantized(mode="fast") (qcompress/export/fuse.py).

Oracle: the same export loaded with fuse_activations=False (the unfused fast model: layer, then
torch's activation module). The fused call is the same kernel call with the activation applied in
its store, so per layer the two differ only by the kernel's GELU against torch's (within
2e-6 |y| + 1e-6 |gelu(y)|, tests/quant/test_lowbit_kernels.py) and ReLU outputs are equal bit for bit.
"""

import copy
import io

import pytest
import torch
import torch.nn as nn

import qcompress
from qcompress.export import export_quantized, fuse, load_quantized, pickle_globals
from qcompress.quant import lowbit
from tests.export.test_export_fast import cfg_for

pytestmark = pytest.mark.skipif(not lowbit.available(), reason="the qcompress C++ extension is not built")


def w4(modules):
    return cfg_for(4, True, "group", 32, modules=modules)


def export_both(tmp_path, make, cfg, calib):
    trained = make()
    qcompress.init_compression(trained, cfg)
    with torch.no_grad():
        trained(*calib)
    export_quantized(trained.eval(), tmp_path / "ck")
    fused = load_quantized(tmp_path / "ck", make(), mode="fast")
    plain = load_quantized(tmp_path / "ck", make(), mode="fast", fuse_activations=False)
    return fused, plain


def tiny_bert(act="gelu"):
    from transformers import BertConfig, BertModel

    conf = BertConfig(
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=160,
        max_position_embeddings=40,
        hidden_act=act,
    )
    torch.manual_seed(0)
    return BertModel(conf).eval()


def mixins(model, only=None):
    return {
        name: type(m).__mro__[1].__name__
        for name, m in model.named_modules()
        if type(m).__module__ == fuse.__name__ and (only is None or type(m).__mro__[1].__name__ == only)
    }


def test_bert_feed_forward_gelu_is_fused(tmp_path):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 99, (2, 33), generator=torch.Generator().manual_seed(1))
    fused, plain = export_both(tmp_path, tiny_bert, w4(["encoder"]), (ids,))
    assert mixins(fused) == {
        **{f"encoder.layer.{i}.intermediate": "FusedActMixin" for i in range(2)},
        **{f"encoder.layer.{i}.attention.output": "FusedResidualMixin" for i in range(2)},
        **{f"encoder.layer.{i}.output": "FusedResidualMixin" for i in range(2)},
    }
    assert mixins(plain) == {}
    inter = fused.encoder.layer[0].intermediate
    assert "fused: dense + intermediate_act_fn (gelu)" in repr(inter)
    with torch.no_grad():
        for tokens in (1, 5, 33):  # the GEMV below 16 tokens, AMX tiles / vector kernels above
            x = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(tokens))
            got, want = inter(x), plain.encoder.layer[0].intermediate(x)
            h = plain.encoder.layer[0].intermediate.dense(x)
            assert torch.equal(want, torch.nn.functional.gelu(h))
            bound = 2e-6 * h.abs() + 1e-6 * want.abs() + 1e-30
            assert bool(((got - want).abs() <= bound).all()), tokens
            # the layer itself is untouched: called directly it gives the pre-activation output
            assert torch.equal(inter.dense(x), h)
        a, b = fused(input_ids=ids).last_hidden_state, plain(input_ids=ids).last_hidden_state
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
        # a hook on the first layer's activation (registered after loading) makes that layer run
        # unfused, so the hook sees the dense output, as in the unfused model
        calls = []
        for m in (fused, plain):
            m.encoder.layer[0].intermediate.intermediate_act_fn.register_forward_pre_hook(
                lambda mod, args: calls.append(args[0].clone())
            )
            m(input_ids=ids)
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])


def test_changed_forward_activation_kind_or_plan_is_not_fused(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertIntermediate

    class Doubled(BertIntermediate):  # same attributes, another forward
        def forward(self, hidden_states):
            return 2 * self.intermediate_act_fn(self.dense(hidden_states))

    def make_doubled():
        m = tiny_bert()
        m.encoder.layer[0].intermediate.__class__ = Doubled
        return m

    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    fused, _ = export_both(tmp_path / "a", make_doubled, w4(["encoder"]), (ids,))
    assert mixins(fused, "FusedActMixin") == {"encoder.layer.1.intermediate": "FusedActMixin"}
    fused, _ = export_both(tmp_path / "b", lambda: tiny_bert("quick_gelu"), w4(["encoder"]), (ids,))
    assert mixins(fused, "FusedActMixin") == {}  # x * sigmoid(1.702 x): no kernel epilogue for it
    fused, _ = export_both(tmp_path / "c", tiny_bert, w4(["attention"]), (ids,))
    assert mixins(fused) == {f"encoder.layer.{i}.attention.output": "FusedResidualMixin" for i in range(2)}
    assert transformers


def test_sequential_neighbours_and_pickle(tmp_path):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(64, 96),
            nn.ReLU(),
            nn.Linear(96, 96),
            nn.GELU(approximate="tanh"),
            nn.Linear(96, 64),
            nn.GELU(),
            nn.Linear(64, 8),
            nn.SiLU(),
        ).eval()

    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(3))
    fused, plain = export_both(tmp_path, make, w4(["."]), (x,))
    assert mixins(fused) == {"": "FusedSequentialMixin"}
    assert fuse.fuse_activations(plain) == {"0": "relu", "2": "gelu_tanh", "4": "gelu", "6": "silu"}
    plain = load_quantized(tmp_path / "ck", make(), mode="fast", fuse_activations=False)
    with torch.no_grad():
        h = fused[1](fused[0](x))
        assert torch.equal(h, plain[1](plain[0](x)))  # children unchanged
        y, want = fused(x), plain(x)
        assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        # ReLU: the fused call equals layer then torch.relu bit for bit
        assert torch.equal(fuse.fused_call(fused[0], fused[1], x), plain[1](plain[0](x)))
        buf = io.BytesIO()
        torch.save(fused, buf)
        buf.seek(0)
        with torch.serialization.safe_globals(pickle_globals() + [nn.Sequential, nn.Linear, nn.ReLU, nn.GELU, nn.SiLU]):
            back = torch.load(buf, weights_only=True)
        for other in (back, copy.deepcopy(fused)):
            assert mixins(other) == mixins(fused)
            assert torch.equal(other(x), y)
        # an edited container keeps working (deleting renumbers the rest: "1" is now a Linear)
        del fused[1]
        want = plain[7](plain[6](plain[5](plain[4](plain[3](plain[2](plain[0](x)))))))
        assert (fused(x) - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # autograd: the kernels have no backward, the two modules run with gradients
    xg = x.clone().requires_grad_()
    back(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("act,kind", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_gpt2_mlp_gelu_is_fused(tmp_path, act, kind):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    def make():
        torch.manual_seed(0)
        conf = GPT2Config(vocab_size=50, n_positions=32, n_embd=64, n_layer=2, n_head=2, activation_function=act)
        return GPT2LMHeadModel(conf).eval()

    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    cfg = w4(["transformer.h"])
    if act == "gelu_new":  # W8A8 with dynamic per-token codes: the lowbit_a8 plan fuses too
        cfg = cfg_for(8, True, "channel", act=("dynamic", False), modules=["transformer.h"])
    fused, plain = export_both(tmp_path, make, cfg, (ids,))
    assert mixins(fused) == {f"transformer.h.{i}.mlp": "FusedActMixin" for i in range(2)}
    assert fused.transformer.h[0].mlp.c_fc.qx_plan == ("lowbit_a8" if act == "gelu_new" else "lowbit")
    assert fuse.act_kind(fused.transformer.h[0].mlp.act) == kind
    assert f"({kind})" in repr(fused.transformer.h[0].mlp)
    with torch.no_grad():
        for tokens in (1, 20):  # decode steps and the prompt
            x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
            mlp, want_mlp = fused.transformer.h[0].mlp, plain.transformer.h[0].mlp
            h = want_mlp.c_fc(x)
            got, want = mlp.c_proj(fuse.fused_call(mlp.c_fc, mlp.act, x)), want_mlp.c_proj(want_mlp.act(h))
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), tokens
        a, b = fused(ids).logits, plain(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


@pytest.mark.parametrize("scheme", ["w4", "w8a8"])
def test_bert_skip_connection_in_the_store_changes_nothing(tmp_path, scheme):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    cfg = (
        w4(["encoder"]) if scheme == "w4" else cfg_for(8, True, "channel", act=("dynamic", False), modules=["encoder"])
    )
    fused, plain = export_both(tmp_path, tiny_bert, cfg, (ids,))
    out, want_mod = fused.encoder.layer[1].output, plain.encoder.layer[1].output
    assert out.dense.qx_plan == ("lowbit" if scheme == "w4" else "lowbit_a8")
    assert "fused: dense + the skip connection" in repr(out)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tokens in (1, 5, 33):
            h, r = torch.randn(2, tokens, 160, generator=g), torch.randn(2, tokens, 64, generator=g)
            assert torch.equal(out(h, r), want_mod(h, r))
            # not fused where the add would differ: dropout active, another residual dtype or shape
            out.train()
            torch.manual_seed(0)
            a = out(h, r)
            torch.manual_seed(0)
            want_mod.train()
            assert torch.equal(a, want_mod(h, r))
            out.eval(), want_mod.eval()
            rb = r.bfloat16()  # h + rb promotes to float32; in place it would not
            assert torch.equal(out(h, rb), want_mod(h, rb))
            assert torch.equal(out(h, r[:, :1]), want_mod(h, r[:, :1]))  # broadcast residual
    # a residual that needs a gradient: the kernel has no backward, so the add stays torch's
    r = torch.randn(2, 5, 64, generator=g, requires_grad=True)
    h = torch.randn(2, 5, 160, generator=g)
    out(h, r).square().sum().backward()
    got, r.grad = r.grad, None
    want_mod(h, r).square().sum().backward()
    assert got is not None and torch.equal(got, r.grad)


@pytest.mark.parametrize("scheme", ["w4", "w8a8"])
def test_llama_gated_mlp_runs_its_gate_and_silu_as_one_call(tmp_path, scheme):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    def make():
        torch.manual_seed(0)
        conf = LlamaConfig(
            vocab_size=60,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        return LlamaForCausalLM(conf).eval()

    ids = torch.randint(0, 60, (2, 20), generator=torch.Generator().manual_seed(1))
    cfg = (
        w4(["model.layers"])
        if scheme == "w4"
        else cfg_for(8, True, "channel", act=("dynamic", False), modules=["model.layers"])
    )
    fused, plain = export_both(tmp_path, make, cfg, (ids,))
    assert mixins(fused) == {f"model.layers.{i}.mlp": "FusedActMixin" for i in range(2)}
    mlp, want_mlp = fused.model.layers[0].mlp, plain.model.layers[0].mlp
    assert "fused: gate_proj + act_fn (silu)" in repr(mlp)
    with torch.no_grad():
        for tokens in (1, 20):  # decode steps and the prompt
            x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
            got, want = mlp(x), want_mlp(x)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), tokens
        a, b = fused(ids).logits, plain(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
