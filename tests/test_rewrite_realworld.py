"""init_compression as a user applies it to transformers models (random weights, no download):
module outputs against a closed-form fake-quant oracle, generate(), activation checkpointing with
static ranges, tied weights, a failed rewrite leaving the model as it was, NaN/Inf naming the module."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import qcompress as qc
from safetensors import safe_open
from qcompress import ConfigError, NonFiniteError, init_compression
from qcompress.nn import fused

transformers = pytest.importorskip("transformers", reason="transformers is needed for the real architectures")


# --- an oracle written from the README's formulas, not from qcompress.quant --------------------------


def fq_rows(a: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric fake quantization of each row of a 2-D tensor: scale = absmax / (2^(b-1) - 1),
    round half to even, clamp to [-2^(b-1), 2^(b-1) - 1]; a zero row gets scale 2^-100 (a
    left-padded token's attention output is all zeros)."""
    qmax = 2 ** (bits - 1) - 1
    s = a.float().abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s == 0, torch.full_like(s, 2.0**-100), s)
    return torch.clamp(torch.round(a.float() / s), -qmax - 1, qmax) * s


def oracle_linear(x, w, b, wbits, group_size, abits):
    """F.linear of the per-token fake-quantized input and the per-group (or per-row) weight."""
    out_f, in_f = w.shape
    wq = fq_rows(w.reshape(-1, group_size) if group_size else w, wbits).reshape(out_f, in_f)
    xq = fq_rows(x.reshape(-1, x.shape[-1]), abits).reshape(x.shape)
    return F.linear(xq, wq, b)


def wa_cfg(wbits, group_size=None, abits=8, **act_shared):
    params = dict(start_bits=wbits, target_bits=wbits, quantization_period=0)
    params.update(group_size=group_size) if group_size else params.update(granularity="channel")
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
                "different_groups": {"w": {"params": params}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, **act_shared},
                "different_groups": {"a": {"params": {"bits": abits}}},
            },
        }
    }


def llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()


def gpt2(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=2
        )
    ).eval()


def falcon(seed=0):
    torch.manual_seed(seed)  # FalconLinear: a Linear subclass with its own forward (composed path)
    return transformers.FalconForCausalLM(
        transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    ).eval()


def record_linears(model):
    """Each activation-quantized Linear / Conv1D's (input, output), cloned: some models add to a
    module's output in place afterwards (Falcon's mlp_output += attention_output)."""
    recs, handles = {}, []
    for name, mod in model.named_modules():
        if getattr(mod, "qc_aq", None) is not None and mod.qc_kind in ("linear", "hf_conv1d"):
            handles.append(
                mod.register_forward_hook(
                    lambda m, a, o, name=name: recs.__setitem__(name, (a[0].detach().clone(), o.detach().clone()))
                )
            )
    return recs, handles


@pytest.mark.parametrize("build", [llama, gpt2, falcon], ids=["llama", "gpt2", "falcon"])
@pytest.mark.parametrize("wbits,group_size", [(8, None), (4, 32)], ids=["w8ch", "w4g32"])
def test_every_linear_equals_the_closed_form_oracle_and_generate_runs(build, wbits, group_size):
    model = build()
    init_compression(model, wa_cfg(wbits, group_size))
    mods = dict(model.named_modules())
    recs, handles = record_linears(model)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    linears = [n for n, m in mods.items() if isinstance(m, nn.Linear) or m.__class__.__name__.endswith("Conv1D")]
    assert sorted(recs) == sorted(linears) and len(recs) >= 7  # every Linear, lm_head included
    for name, (x, out) in recs.items():
        mod = mods[name]
        w = mod.weight.detach().t() if mod.qc_kind == "hf_conv1d" else mod.weight.detach()
        ref = oracle_linear(x, w, None if mod.bias is None else mod.bias.detach(), wbits, group_size, 8)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        cached = model.generate(input_ids=ids[1:], max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = model.generate(input_ids=ids[1:], max_new_tokens=4, do_sample=False, use_cache=False)
    assert cached.shape == (1, 13) and torch.equal(cached, uncached)


# --- static ranges under activation checkpointing ---------------------------------------------------

STATIC = {
    "compression_training": {
        "activation_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": "static",
                "quantization_type": "asymmetric",
                "momentum": 0.5,
            },
            "different_groups": {"a": {"params": {"bits": 8}}},
        }
    }
}


class Stack(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_static_ranges_fold_each_batch_once_under_activation_checkpointing(reentrant):
    """The recompute in backward must neither fold the batch into the EMA a second time nor quantize
    with another range than the forward did (it did both: gradients of a different function)."""
    plain, ckpt = Stack(), Stack(ckpt=reentrant)
    init_compression(plain, STATIC)
    init_compression(ckpt, STATIC)
    g = torch.Generator().manual_seed(0)
    lo = hi = None
    for step in range(3):
        x = torch.randn(4, 5, 16, generator=g) * (step + 1)
        lo = x.amin() if lo is None else 0.5 * lo + 0.5 * x.amin()  # the documented EMA, by hand
        hi = x.amax() if hi is None else 0.5 * hi + 0.5 * x.amax()
        for model in (plain, ckpt):
            model.zero_grad()
            model(x.requires_grad_(reentrant)).pow(2).sum().backward()
        for a, b in zip(plain.parameters(), ckpt.parameters()):
            assert torch.equal(a.grad, b.grad)
        for model in (plain, ckpt):
            obs = model.blocks[0][0].qc_aq.observer
            assert torch.allclose(obs.min, lo) and torch.allclose(obs.max, hi)
        assert torch.equal(plain.blocks[1][0].qc_aq.observer.max, ckpt.blocks[1][0].qc_aq.observer.max)


def test_static_ranges_with_transformers_gradient_checkpointing():
    plain, ckpt = llama(), llama()
    for model in (plain, ckpt):
        init_compression(model, STATIC)
        model.train()
    (getattr(ckpt, "activation_checkpointing_enable", None) or ckpt.gradient_checkpointing_enable)()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 10), generator=g)
        for model in (plain, ckpt):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad), name
    down = (plain.model.layers[1].mlp.down_proj, ckpt.model.layers[1].mlp.down_proj)
    assert torch.equal(down[0].qc_aq.observer.min, down[1].qc_aq.observer.min)


# --- a rewrite either happens whole or not at all; never twice --------------------------------------


def _moq(shared=None, **groups):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": False, **(shared or {})},
                "different_groups": groups or {"w": {"params": {"start_bits": 4, "target_bits": 4}}},
            }
        }
    }


def _snapshot(model):
    return (
        {n: type(m) for n, m in model.named_modules()},
        {k: v.clone() for k, v in model.state_dict().items()},
        [(n, p) for n, p in model.named_parameters()],
    )


def _assert_untouched(model, snap):
    classes, sd, params = snap
    assert {n: type(m) for n, m in model.named_modules()} == classes
    now = model.state_dict()
    assert list(now) == list(sd)
    for k, v in sd.items():
        assert torch.equal(now[k], v) or (v.isnan().any() and torch.equal(now[k].isnan(), v.isnan())), k
    assert [(n, p) for n, p in model.named_parameters()] == params


def test_config_error_found_while_rewriting_leaves_the_model_as_it_was():
    model = gpt2()
    snap = _snapshot(model)
    # the Embeddings (per row) pass, then c_attn's 12288 weights are not divisible by 7
    with pytest.raises(ConfigError, match="quantize_groups: 7 does not divide"):
        init_compression(model, _moq({"quantize_groups": 7}))
    _assert_untouched(model, snap)
    init_compression(model, _moq())  # the corrected config applies
    assert model.transformer.h[0].attn.c_attn.qc_wq.bits == 4


def test_nonfinite_weight_at_step_zero_restores_the_weights_already_quantized():
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.weight[0, 0] = float("nan")
    snap = _snapshot(model)
    with pytest.raises(NonFiniteError):
        init_compression(model, _moq())  # optimizer-step mode writes wte, c_attn ... before c_proj
    _assert_untouched(model, snap)


def test_tied_range_learning_with_the_head_group_listed_first():
    """lm_head's group before wte's: the learned scale was registered on lm_head, the tied weight's
    owner is wte, which then had none (AttributeError at the first quantization)."""
    model = gpt2()
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "range_learning": True},
                "different_groups": {
                    "head": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["lm_head"]},
                    "emb": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["wte"]},
                },
            }
        }
    }
    init_compression(model, cfg)
    wte, head = model.transformer.wte, model.lm_head
    assert wte.weight_scale is head.weight_scale
    w = wte.weight.detach()
    assert torch.equal(wte.weight_scale.detach(), w.abs().amax(1, keepdim=True) / 127)  # per-row minmax
    assert torch.equal(head.effective_weight(), fq_rows(w, 8))
    ids = torch.randint(0, 128, (1, 6))
    model(ids).logits.sum().backward()
    assert wte.weight_scale.grad is not None and wte.weight_scale.grad.abs().sum() > 0


def test_second_init_compression_is_refused_and_keeps_the_master():
    model = nn.Sequential(nn.Linear(16, 16))
    w0 = model[0].weight.detach().clone()
    init_compression(model, _moq())
    with pytest.raises(ValueError, match="already rewritten by init_compression.*'0'"):
        init_compression(model, _moq())
    assert torch.equal(model[0].qc_wq.master, w0)  # the full-precision weights are still there


def test_tied_module_no_group_selects_is_reported_in_optimizer_step_mode():
    model = gpt2()
    with pytest.warns(UserWarning, match="'transformer.wte' shares its weight Parameter with 'lm_head'"):
        init_compression(model, _moq(w={"params": {"start_bits": 4, "target_bits": 4}, "modules": ["lm_head"]}))
    # in forward mode the Parameter is never written: nothing to report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = _moq(
            {"quantize_weight_in_forward": True},
            w={"params": {"start_bits": 4, "target_bits": 4}, "modules": ["lm_head"]},
        )
        init_compression(gpt2(), cfg)


# --- NaN / Inf: say which module and which tensor ---------------------------------------------------


@pytest.mark.parametrize("fused_on", [True, False], ids=["fused", "unfused"])
def test_nonfinite_error_names_the_module_and_tensor(fused_on):
    model = llama()
    init_compression(model, wa_cfg(8))
    ids = torch.randint(0, 128, (1, 5))
    up = model.model.layers[1].mlp.up_proj
    with fused.enabled(fused_on):
        with torch.no_grad():
            up.weight[3, 3] = float("inf")
        with pytest.raises(
            NonFiniteError,
            match=r"module 'model.layers.1.mlp.up_proj' \(Linear\), its weight: "
            r"1 of 128 quantization groups contain NaN or Inf",
        ):
            model(ids)
        with torch.no_grad():
            up.weight[3, 3] = 0.0
            model.model.layers[0].input_layernorm.weight[0] = float("nan")
        with pytest.raises(NonFiniteError, match=r"module 'model.layers.0.self_attn.q_proj' \(Linear\), its input"):
            model(ids)


def test_config_error_with_layer_reduction_leaves_the_student_weights_alone():
    """The claims are checked before layer reduction copies the teacher's layers in (it copied
    first, so a config error left a half-initialised student behind)."""

    def bert(layers, seed):
        torch.manual_seed(seed)
        return transformers.BertModel(
            transformers.BertConfig(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=32,
            )
        )

    student, teacher = bert(2, 1), bert(4, 0)
    snap = _snapshot(student)
    cfg = {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": 2,
                "module_name_prefix": "encoder.layer",
                "teacher_layer": [1, 3],
                "other_module_name": ["embeddings"],
            },
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {
                    "a": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["query"]},
                    "b": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["attention.self"]},
                },
            },
        }
    }
    with pytest.raises(ConfigError, match="already claimed by group 'a'"):
        init_compression(student, cfg, teacher_model=teacher)
    _assert_untouched(student, snap)


def test_errors_found_at_rewrite_time_name_the_file_the_key_came_from(tmp_path):
    base = tmp_path / "ds_config.json"
    base.write_text(
        '{"train_batch_size": 8, "compression_training": {"weight_quantization": {'
        '"shared_parameters": {"enabled": true, "quantize_weight_in_forward": true}, '
        '"different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}}}}}}'
    )
    frag = tmp_path / "groups7.yaml"
    frag.write_text("compression_training:\n  weight_quantization:\n    shared_parameters:\n      quantize_groups: 7\n")
    with pytest.raises(ConfigError, match=r"quantize_groups: 7 does not divide .*\(in .*groups7\.yaml\)$"):
        init_compression(gpt2(), qc.load_config(str(base), str(frag)))
    whole = tmp_path / "whole.yaml"
    whole.write_text(
        "compression_training:\n  weight_quantization:\n    shared_parameters: "
        "{enabled: true, quantize_groups: 7}\n    different_groups:\n"
        "      w: {params: {start_bits: 8, target_bits: 8}}\n"
    )
    with pytest.raises(ConfigError, match=r"quantize_groups: 7 does not divide .*\(in .*whole\.yaml\)$"):
        init_compression(gpt2(), str(whole))  # a path given to init_compression itself
    none = tmp_path / "none.yaml"
    none.write_text(
        "compression_training:\n  weight_quantization:\n    different_groups:\n"
        "      w: {modules: [nothing_has_this_name]}\n"
    )
    with pytest.warns(UserWarning, match=r"group 'w' matches no compressible module .*\(in .*none\.yaml\)"):
        init_compression(gpt2(), qc.load_config(str(base), str(none)))
    # a single dict has no file to name: the message is as before
    with pytest.raises(ConfigError) as info:
        init_compression(gpt2(), _moq({"quantize_groups": 7}))
    assert "(in " not in str(info.value)


def test_group_matching_nothing_says_why():
    def act(modules):
        return {
            "compression_training": {
                "activation_quantization": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"a": {"params": {"bits": 8}, "modules": modules}},
                }
            }
        }

    # an empty list selects nothing; it is not 'all' (the warning said "patterns all")
    model = gpt2()
    with pytest.warns(UserWarning, match=r"group 'a' matches no compressible module \(patterns \[\]\)$"):
        init_compression(model, act([]))
    assert qc.summary(model).count("\n") == 1  # header and rule only: nothing was rewritten
    # the regex selects the embeddings, which activation quantization does not act on
    with pytest.warns(
        UserWarning,
        match=r"\(patterns \['wte'\]\); it selects 'transformer.wte' \(Embedding\), "
        r"but activation_quantization acts on Linear, Conv, transformers Conv1D, fused experts only",
    ):
        init_compression(gpt2(), act(["wte"]))


def test_compressed_layers_keep_their_forward_argument_names():
    """`linear(input=x)` works on a torch Linear; the rewrite renamed the argument to x."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    plain = nn.ModuleDict(
        {"lin": nn.Linear(4, 4), "conv": nn.Conv1d(4, 4, 1), "emb": nn.Embedding(5, 4), "c1d": Conv1D(4, 4)}
    )
    model = copy.deepcopy(plain)
    init_compression(model, wa_cfg(8))
    calls = {
        "lin": ("input", torch.randn(2, 4)),
        "conv": ("input", torch.randn(2, 4, 3)),
        "emb": ("input", torch.tensor([1, 2])),
        "c1d": ("x", torch.randn(2, 4)),
    }
    for name, (kw, x) in calls.items():
        assert isinstance(model[name], qc.nn.CompressMixin), name
        assert torch.equal(model[name](**{kw: x}), model[name](x)), name
        plain[name](**{kw: x})  # the same keyword the library class takes


def test_modules_hooked_by_accelerate_are_compressed():
    """accelerate's hooks (device_map / offloading) replace `module.forward` on the instance with a
    wrapper calling the forward bound before the rewrite: every Linear ran in float, silently."""
    hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")
    model = llama()
    hooks.attach_align_device_hook(model, execution_device=torch.device("cpu"))
    assert "_old_forward" in model.model.layers[0].mlp.up_proj.__dict__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accelerate's own convention: nothing to report
        init_compression(model, wa_cfg(4, 32))
    recs, handles = record_linears(model)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 7)))
    assert len(recs) == 15
    for name, (x, out) in recs.items():
        mod = dict(model.named_modules())[name]
        ref = oracle_linear(x, mod.weight.detach(), None if mod.bias is None else mod.bias.detach(), 4, 32, 8)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=name)
    hooks.remove_hook_from_submodules(model)  # the forward left behind is still the compressed one
    up = model.model.layers[0].mlp.up_proj
    x = torch.randn(1, 3, 64)
    torch.testing.assert_close(up(x), oracle_linear(x, up.weight.detach(), None, 4, 32, 8), rtol=1e-5, atol=1e-6)


def test_other_instance_forwards_are_reported():
    model = nn.Sequential(nn.Linear(8, 8))
    old = model[0].forward
    model[0].forward = lambda x: old(x)
    with pytest.warns(UserWarning, match=r"^0: its forward was replaced on the instance"):
        init_compression(model, wa_cfg(4))


def test_progressive_layer_drop_error_leaves_the_model_as_it_was():
    model = gpt2()
    snap = _snapshot(model)
    cfg = {**wa_cfg(8), "progressive_layer_drop": {"enabled": True, "modules": ["no_such_block"]}}
    with pytest.raises(ConfigError, match=r"progressive_layer_drop.modules\[0\]: 'no_such_block' matches no module"):
        init_compression(model, cfg)
    _assert_untouched(model, snap)
    cfg["progressive_layer_drop"]["modules"] = [r"h\.\d+$"]
    init_compression(model, cfg)  # the corrected config applies
    assert model.transformer.h[1].qc_pld.depth == 2 and model.lm_head.qc_aq.active


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_embedding_with_max_norm(sparse):
    """F.embedding(max_norm=...) renormalizes rows of the weight it gets in place; given the
    fake-quantized copy (an autograd view) that raised a RuntimeError about views."""
    torch.manual_seed(0)
    plain = nn.Embedding(10, 4, max_norm=1.0, padding_idx=0, sparse=sparse)
    with torch.no_grad():
        plain.weight.mul_(3)  # most rows above max_norm
    model = nn.Sequential(copy.deepcopy(plain))
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8}}},
            }
        }
    }
    init_compression(model, cfg)
    idx = torch.tensor([0, 3, 5, 3])
    ref_out = plain(idx)  # renorms rows 0, 3, 5 of plain.weight in place
    out = model(idx)
    assert torch.equal(model[0].weight, plain.weight)  # renormed as the library class does
    assert torch.equal(out, fq_rows(plain.weight.detach(), 8)[idx])  # then quantized per row
    assert not torch.equal(out, ref_out)
    out.sum().backward()
    grad = model[0].weight.grad.to_dense()
    assert torch.equal(grad[0], torch.zeros(4)) and grad[3].eq(2).all()  # padding row; row 3 twice


class _BackboneAndHead(nn.Module):
    """A model whose backbone attribute happens to be called `module` (not a DDP wrapper)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.module(x))


def test_a_child_named_module_is_not_taken_for_a_wrapper():
    """init_compression unwrapped `model.module` as if the model were DDP: the head stayed float,
    the backbone's names lost their prefix, and the summary listed the backbone only."""
    model = _BackboneAndHead()
    init_compression(model, wa_cfg(4))
    assert [line.split()[0] for line in qc.summary(model).splitlines()[2:]] == ["module.0", "head"]
    x = torch.randn(3, 8)
    h = model.module(x)
    torch.testing.assert_close(
        model(x),
        oracle_linear(h, model.head.weight.detach(), model.head.bias.detach(), 4, None, 8),
        rtol=1e-5,
        atol=1e-6,
    )
    # a real wrapper (nothing but `module`) is still looked through
    wrapped = nn.parallel.DataParallel(_BackboneAndHead())
    init_compression(wrapped, wa_cfg(4))
    assert [line.split()[0] for line in qc.summary(wrapped).splitlines()[2:]] == ["module.0", "head"]


def test_weights_no_group_can_compress_are_reported():
    """transformers 5 keeps a mixture-of-experts block's experts as 3-D Parameters of one module:
    'every compressible module' quantized 17 % of a Mixtral's matrices and said nothing."""
    torch.manual_seed(0)
    moe = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    experts = 2 * (4 * 256 * 64 + 4 * 64 * 128)
    routers = 2 * 4 * 64
    matrices = sum(p.numel() for p in moe.parameters() if p.dim() >= 2)
    assert (experts + routers) / matrices > 0.8  # most of the model is experts
    # the experts are compressible now (qcompress/nn/experts.py): only the routers (<5 %) stay FP32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_compression(moe, wa_cfg(4, 32))
    assert type(moe.model.layers[0].mlp.experts._modules["gate_up_proj"]).__name__ == "ExpertMatrix"
    # the usual architectures have nothing (or next to nothing) outside compressible layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_compression(llama(), wa_cfg(4, 32))
        vit = transformers.ViTModel(
            transformers.ViTConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=32,
                patch_size=8,
            )
        )
        init_compression(vit, wa_cfg(8))  # cls token and position embeddings: about 1 %
    # named groups choose their modules themselves: nothing to add
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = wa_cfg(4, 32)
        cfg["compression_training"]["weight_quantization"]["different_groups"]["w"]["modules"] = ["self_attn"]
        cfg["compression_training"]["activation_quantization"]["different_groups"]["a"]["modules"] = ["self_attn"]
        init_compression(transformers.MixtralForCausalLM(moe.config), cfg)


def test_failed_rewrite_removes_the_hooks_it_put_on_related_modules():
    """Channel pruning hooks the BatchNorm after the pruned conv; when a later step of the rewrite
    failed, the hook stayed and every forward then raised AttributeError (qc_pruning was gone)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2)
    )
    with torch.no_grad():
        model[4].weight[0, 0] = float("nan")
    snap = _snapshot(model)
    hooks = (dict(model[1]._forward_hooks), dict(model[1]._forward_pre_hooks))
    cfg = _moq()
    cfg["compression_training"]["channel_pruning"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {"c": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^1$"]]}},
    }
    with pytest.raises(NonFiniteError, match=r"module '4' \(Linear\)|NaN"):
        init_compression(model, cfg)  # optimizer-step quantization of '4' at step 0
    _assert_untouched(model, snap)
    assert (dict(model[1]._forward_hooks), dict(model[1]._forward_pre_hooks)) == hooks
    model.eval()(torch.randn(2, 3, 4, 4))


def _ranges_cfg(observer, learned, in_forward=True):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": in_forward,
                    "range_learning": learned,
                    "observer": observer,
                },
                "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4, "group_size": 32}}},
            }
        }
    }


@pytest.mark.parametrize(
    "observer,learned,in_forward",
    [("mse", False, True), ("mse", False, False), ("minmax", True, True), ("mse", True, True)],
    ids=["mse", "mse_optimizer_step", "learned", "learned_mse"],
)
def test_weights_loaded_after_the_rewrite_get_their_own_ranges(observer, learned, in_forward):
    """A plain checkpoint loaded into a compressed model (pretrained weights after compressing a
    randomly initialised one): the learned scales and mse shrink factors stayed those observed on
    the weights it replaced (learned scales 3x too small: a 0.17 error in each weight)."""
    cfg = _ranges_cfg(observer, learned, in_forward)
    pretrained = llama(seed=5)
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(3)
    late = init_compression(llama(seed=0), cfg)
    late.load_state_dict(pretrained.state_dict(), strict=not learned)  # no scales in the file
    early = llama(seed=0)
    early.load_state_dict(pretrained.state_dict())
    init_compression(early, cfg)
    for model in (late, early):
        qc.CompressionScheduler(model, cfg).step()
    for name in ("model.embed_tokens", "model.layers.0.mlp.up_proj", "lm_head"):
        a, b = late.get_submodule(name), early.get_submodule(name)
        assert torch.equal(a.effective_weight(), b.effective_weight()), name


def test_meta_device_init_then_weights():
    """Build on the meta device, compress, materialize, load the checkpoint: the flow for models
    too big to initialise twice. Range learning crashed (Tensor.item() on meta tensors)."""
    reference = llama(seed=3)
    for cfg in (wa_cfg(4, 32), _ranges_cfg("minmax", False, in_forward=False), _ranges_cfg("mse", True)):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(reference.config)
        init_compression(model, cfg)
        model.to_empty(device="cpu")
        model.load_state_dict(reference.state_dict(), strict=False)
        for name, buf in reference.named_buffers():  # rotary frequencies are not in state_dict
            model.get_buffer(name).copy_(buf)
        direct = init_compression(copy.deepcopy(reference), cfg)
        for model_ in (model, direct):
            qc.CompressionScheduler(model_, cfg)
        ids = torch.randint(0, 128, (1, 6))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, direct(ids).logits)


def test_a_child_named_module_is_exported_and_loaded_whole(tmp_path):
    """export_quantized / load_quantized / the scheduler used to look through any `model.module`:
    the export held the backbone only, without its prefix, and the reloaded model's head was its
    fresh random one. The oracle is the trained model itself."""
    model = _BackboneAndHead()
    cfg = wa_cfg(4)
    init_compression(model, cfg)
    qc.CompressionScheduler(model, cfg)  # accepts the model as rewritten
    model.eval()
    qc.export_quantized(model, tmp_path / "out", cfg)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("module.0.") for n in names) and any(n.startswith("head.") for n in names)
    fresh = _BackboneAndHead()
    with torch.no_grad():
        fresh.head.weight.add_(1.0)  # not the trained head: loading must replace it
    loaded = qc.load_quantized(tmp_path / "out", fresh)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_nonfinite_master_in_optimizer_step_mode_names_the_module():
    """Optimizer-step mode requantizes each weight from its master in the scheduler's step: a
    diverged update (NaN) used to surface as a NonFiniteError naming no module."""
    model = gpt2()
    cfg = _moq()
    init_compression(model, cfg)
    sched = qc.CompressionScheduler(model, cfg)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.weight[0, 0] = float("nan")  # what a bad step writes
    with pytest.raises(
        NonFiniteError,
        match=r"module 'transformer\.h\.0\.mlp\.c_proj' \(Conv1D\), its weight's "
        r"full-precision master: .*NaN",
    ):
        sched.step()
