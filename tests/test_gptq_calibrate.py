"""observer: gptq on models: qcompress.calibrate_weight_ranges solves each module with the Hessian of
its own inputs, and the model then computes, exports and resumes what the solve gave.

Oracles written here: each module's inputs recorded by hooks on an untouched FP copy of the model
(for sequential calibration: the whole copy run again after each block's solution is written into
it, so block i sees the outputs of the quantized blocks before it), the Hessian E[u u^T] summed
from them, and tests/helpers/gptq_reference.py's GPTQ; for fused experts each expert's routed tokens taken
from the model's own router output; load_quantized of the export against the trained model's
effective weights; an uninterrupted engine run against one resumed from a checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qcompress as qc
from qcompress.errors import ConfigError
from tests.helpers.gptq_reference import int_fit, int_quant, reference

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread; on a shared machine threads mostly wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def gptq_doc(group_size=32, sym=True, in_forward=True, modules=("proj",), **kwargs):
    params = {"start_bits": 4, "target_bits": 4, "group_size": group_size, "observer": "gptq"}
    if kwargs:
        params["observer_kwargs"] = kwargs
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": in_forward,
                    "quantization_type": "symmetric" if sym else "asymmetric",
                },
                "different_groups": {"g": {"params": params, "modules": list(modules)}},
            }
        }
    }


def batches(n=3, seed=1, vocab=64, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


def record_inputs(model, names, data):
    """{name: Hessian E[u u^T] (float64)} of the named Linear modules' inputs over `data`."""
    mods = dict(model.named_modules())
    sums, counts, handles = {}, {}, []
    for n in names:

        def hook(mod, args, n=n):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[n] = sums.get(n, 0) + x.T @ x
            counts[n] = counts.get(n, 0) + x.shape[0]

        handles.append(mods[n].register_forward_pre_hook(hook))
    with torch.no_grad():
        for b in data:
            model(b)
    for h in handles:
        h.remove()
    return {n: sums[n] / counts[n] for n in names}


def oracle_solve(W, H, gs=32, sym=True, act_order=True):
    """GPTQ of W as the reference computes it (act_order: the default of observer_kwargs)."""
    return reference(
        W, H, lambda X: int_fit(X, 4, sym), lambda w, p: int_quant(w, p, 4), gs, upfront=act_order, act_order=act_order
    )


def oracle_model(model_fp, data, sequential, sym=True, act_order=True):
    """{module name: (compensated weights, Q)}: GPTQ of every projection of a copy of model_fp, with
    the Hessians of its inputs recorded on the copy (sequential: block by block, the blocks before
    already quantized in the copy)."""
    ref = copy.deepcopy(model_fp)
    layers = ref.model.layers
    names = [
        [f"model.layers.{i}.{part}.{p}" for p in PROJ for part in (("self_attn",) if p in PROJ[:4] else ("mlp",))]
        for i in range(len(layers))
    ]
    out = {}
    stages = names if sequential else [sum(names, [])]
    mods = dict(ref.named_modules())
    for stage in stages:
        hs = record_inputs(ref, stage, data)
        for n in stage:
            Wc, Q, _ = oracle_solve(mods[n].weight.detach(), hs[n], sym=sym, act_order=act_order)
            out[n] = (Wc, Q)
        with torch.no_grad():
            for n in stage:
                mods[n].weight.copy_(out[n][1])
    return out


@pytest.mark.parametrize("sequential,act_order", [(True, True), (False, True), (True, False)])
def test_dense_model_matches_the_oracle(sequential, act_order):
    fp = tiny_llama()
    data = batches()
    model = copy.deepcopy(fp)
    qc.init_compression(model, gptq_doc(sequential=sequential, act_order=act_order))
    assert qc.calibrate_weight_ranges(model, data) == 14
    want = oracle_model(fp, data, sequential, act_order=act_order)
    mods = dict(model.named_modules())
    for n, (Wc, Q) in want.items():
        m = mods[n]
        assert (m.weight.detach() - Wc).abs().max() < 1e-6, n  # compensated weights replace the FP ones
        assert (m.effective_weight().detach() - Q).abs().max() < 1e-6, n  # and quantize to GPTQ's Q
    # sequential calibration sees the quantized first block: the second block's solution differs
    other = copy.deepcopy(fp)
    qc.init_compression(other, gptq_doc(sequential=not sequential, act_order=act_order))
    qc.calibrate_weight_ranges(other, data)
    a, b = (m.model.layers[1].mlp.down_proj.effective_weight() for m in (model, other))
    assert torch.equal(
        model.model.layers[0].mlp.down_proj.effective_weight(), other.model.layers[0].mlp.down_proj.effective_weight()
    )
    assert not torch.allclose(a, b)


def test_partial_groups_and_asymmetric():
    # width 64 in groups of 48: every row ends in a partial group of 16, its scales chosen in the loop
    fp = tiny_llama(seed=2)
    data = batches(seed=4)
    model = copy.deepcopy(fp)
    qc.init_compression(
        model, gptq_doc(group_size=48, sym=False, modules=("q_proj",), sequential=False, act_order=False)
    )
    qc.calibrate_weight_ranges(model, data)
    hs = record_inputs(fp, ["model.layers.0.self_attn.q_proj"], data)
    m = model.model.layers[0].self_attn.q_proj
    Wc, Q, _ = reference(
        fp.model.layers[0].self_attn.q_proj.weight.detach(),
        hs["model.layers.0.self_attn.q_proj"],
        lambda X: int_fit(X, 4, False),
        lambda w, p: int_quant(w, p, 4),
        48,
        upfront=False,
    )
    assert (m.weight.detach() - Wc).abs().max() < 1e-6
    assert (m.effective_weight().detach() - Q).abs().max() < 1e-6


def test_gpt2_conv1d_blocks():
    """transformers' GPT-2: Conv1D weights stored [in, out], blocks called with positional cache
    arguments (dropped when the blocks run one at a time)."""
    from tests.helpers.tiny_models import make_gpt2

    fp = make_gpt2(seed=0).eval()
    data = batches(vocab=fp.config.vocab_size)
    model = copy.deepcopy(fp)
    qc.init_compression(model, gptq_doc(modules=("attn.c_attn", "mlp.c_fc")))
    assert qc.calibrate_weight_ranges(model, data) == 2 * len(fp.transformer.h)
    ref = copy.deepcopy(fp)
    for i, block in enumerate(ref.transformer.h):  # block by block on the quantized copy
        names = [f"transformer.h.{i}.attn.c_attn", f"transformer.h.{i}.mlp.c_fc"]
        hs = record_inputs(ref, names, data)
        for n in names:
            conv = dict(ref.named_modules())[n]
            Wc, Q, _ = oracle_solve(conv.weight.detach().t(), hs[n])
            got = dict(model.named_modules())[n]
            assert (got.weight.detach().t() - Wc).abs().max() < 1e-6
            assert (got.effective_weight().detach().t() - Q).abs().max() < 1e-6
            with torch.no_grad():
                conv.weight.copy_(Q.t())


def test_moe_experts_are_solved_per_expert():
    from tests.helpers.moe_fixtures import make_moe

    fp = make_moe("qwen3_moe", seed=0)
    data = batches(n=4, vocab=fp.config.vocab_size, seq=24)
    model = copy.deepcopy(fp)
    qc.init_compression(model, gptq_doc(group_size=16, modules=("experts",), sequential=False))
    qc.calibrate_weight_ranges(model, data)
    # the oracle: each expert's tokens from the FP model's own router, its down_proj input by hand
    for i, layer in enumerate(fp.model.layers):
        moe = layer.mlp
        seen = {}
        h1 = moe.experts.register_forward_pre_hook(lambda m, a: seen.setdefault("x", []).append(a[0].detach()))
        h2 = moe.gate.register_forward_hook(lambda m, a, o: seen.setdefault("idx", []).append(o[2].detach()))
        with torch.no_grad():
            for b in data:
                fp(b)
        h1.remove()
        h2.remove()
        x, idx = torch.cat(seen["x"]), torch.cat(seen["idx"])
        got = model.model.layers[i].mlp.experts
        for e in range(fp.config.num_experts):
            xe = x[(idx == e).any(-1)].double()
            wgu, wd = moe.experts.gate_up_proj[e].detach(), moe.experts.down_proj[e].detach()
            g, u = (xe.float() @ wgu.t()).chunk(2, dim=-1)
            de = (F.silu(g) * u).double()
            for w, u_in, name in ((wgu, xe, "gate_up_proj"), (wd, de, "down_proj")):
                Wc, Q, _ = oracle_solve(w, u_in.T @ u_in / u_in.shape[0], gs=16)
                mine = getattr(got, name)[e].detach()
                assert (mine - Wc).abs().max() < 1e-5, (i, e, name)
        # the fused module's forward uses each expert's own solved scales
        part = got._modules["gate_up_proj"]
        eff = part.effective_weight().detach()
        for e in range(fp.config.num_experts):
            wgu = moe.experts.gate_up_proj[e].detach()
            xe = x[(idx == e).any(-1)].double()
            _, Q, _ = oracle_solve(wgu, xe.T @ xe / xe.shape[0], gs=16)
            assert (eff[e] - Q).abs().max() < 1e-5


@pytest.mark.parametrize("kwargs", [{}, {"act_order": False, "scale_observer": "mse"}])
def test_export_is_exact_after_gptq_and_training(tmp_path, kwargs):
    model = tiny_llama()
    data = batches()
    doc = dict(
        gptq_doc(sym=not kwargs, **kwargs), train_batch_size=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}}
    )
    qc.init_compression(model, doc)
    qc.calibrate_weight_ranges(model, data)
    engine = qc.initialize(model, doc, device="cpu")
    for b in data:
        loss = engine(b, labels=b).loss
        engine.backward(loss)
        engine.step()
    trained = {
        n: m.effective_weight().detach().clone()
        for n, m in model.named_modules()
        if getattr(m, "qc_wq", None) is not None
    }
    qc.export_quantized(model, tmp_path / "out", doc)
    back = qc.load_quantized(tmp_path / "out", tiny_llama(seed=5))
    mods = dict(back.named_modules())
    for n, w in trained.items():
        assert torch.equal(mods[n].weight.detach(), w), n


@pytest.mark.parametrize("in_forward", [True, False])
def test_resume_after_gptq_is_bit_exact(tmp_path, in_forward):
    data = batches(n=4)
    doc = dict(gptq_doc(in_forward=in_forward), train_batch_size=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}})

    def run(engine, steps):
        for b in steps:
            engine.backward(engine(b, labels=b).loss)
            engine.step()

    model = tiny_llama()
    qc.init_compression(model, doc)
    qc.calibrate_weight_ranges(model, data[:2])
    engine = qc.initialize(model, doc, device="cpu")
    run(engine, data[:2])
    engine.save_checkpoint(tmp_path)
    run(engine, data[2:])
    # a fresh model, never calibrated: the checkpoint brings GPTQ's weights and scales
    fresh = tiny_llama(seed=7)
    qc.init_compression(fresh, doc)
    engine2 = qc.initialize(fresh, doc, device="cpu")
    engine2.load_checkpoint(tmp_path)
    run(engine2, data[2:])
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    assert torch.equal(
        model.model.layers[1].mlp.down_proj.effective_weight(), fresh.model.layers[1].mlp.down_proj.effective_weight()
    )


# --- bad input -----------------------------------------------------------------------------------


def test_no_calibration_batches_is_a_config_error_before_anything_changes():
    model = tiny_llama()
    qc.init_compression(model, gptq_doc())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=r"different_groups\.g\.params\.observer: module 'model\.layers\.0\.self_attn"
        r"\.q_proj' and 13 more use observer gptq.*no batches",
    ):
        qc.calibrate_weight_ranges(model, iter(()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_modules_the_batches_never_reach_are_named_before_anything_changes():
    model = tiny_llama()
    qc.init_compression(model, gptq_doc())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer = model.model.layers[1]
    layer.forward = lambda hidden_states, *a, **k: hidden_states  # the batches skip the second block
    with pytest.raises(ConfigError, match=r"never reached module\(s\) \['model\.layers\.1\.self_attn\.q_proj'"):
        qc.calibrate_weight_ranges(model, batches())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_an_uncalibrated_gptq_group_refuses_to_train_or_export(tmp_path):
    model = tiny_llama()
    qc.init_compression(model, gptq_doc())
    with pytest.raises(ConfigError, match="uses observer gptq but its weights were never solved"):
        model(batches()[0])
    with pytest.raises(ConfigError, match="never solved"):
        qc.export_quantized(model, tmp_path / "x", gptq_doc())
    # optimizer-step mode: the first scheduler step says so
    model = tiny_llama()
    doc = dict(gptq_doc(in_forward=False), train_batch_size=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    qc.init_compression(model, doc)
    engine = qc.initialize(model, doc, device="cpu")
    b = batches()[0]
    engine.backward(engine(b, labels=b).loss)
    with pytest.raises(ConfigError, match="never solved"):
        engine.step()


@pytest.mark.parametrize(
    "params,shared,match",
    [
        ({"start_bits": 8}, {}, r"params\.start_bits: GPTQ solves the weights once for one width"),
        ({}, {"rounding": "stochastic"}, r"shared_parameters\.rounding: .*round-to-nearest"),
        ({"observer_kwargs": {"weight_by": "inputs"}}, {}, r"observer_kwargs\.weight_by"),
        (
            {"observer": "mse", "observer_kwargs": {"act_order": False}},
            {},
            r"observer_kwargs\.act_order: is a setting of observer 'gptq'",
        ),
        ({"target_bits": 2, "start_bits": 2}, {}, r"params\.target_bits: 2-bit weights are binary / ternary"),
    ],
)
def test_config_errors(params, shared, match):
    doc = gptq_doc()
    doc["compression_training"]["weight_quantization"]["different_groups"]["g"]["params"].update(params)
    doc["compression_training"]["weight_quantization"]["shared_parameters"].update(shared)
    with pytest.raises(ConfigError, match=match):
        qc.load_config(doc)


def test_modules_gptq_cannot_solve_are_named():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"module 'model\.embed_tokens' is an Embedding; observer gptq"):
        qc.init_compression(model, gptq_doc(modules=("embed_tokens",)))


# --- float formats, range learning ------------------------------------------------------------------


def output_error(model_fp, model_q, data, name):
    """sum over the calibration inputs of |(W - W^) u|^2 for module `name`: what GPTQ minimises."""
    H = record_inputs(model_fp, [name], data)[name]
    W = dict(model_fp.named_modules())[name].weight.detach().double()
    Q = dict(model_q.named_modules())[name].effective_weight().detach().double()
    return float(((W - Q) @ H * (W - Q)).sum())


@pytest.mark.parametrize("fmt,gran", [("nvfp4", None), ("mxfp4", None), ("fp8_e4m3", "channel")])
def test_float_formats_on_a_model(tmp_path, fmt, gran):
    from qcompress.quant import floats

    fp = tiny_llama()
    data = batches()

    def doc(observer):
        p = {"start_bits": floats.WIDTH[fmt], "target_bits": floats.WIDTH[fmt], "format": fmt, "observer": observer}
        if gran:
            p["granularity"] = gran
        if observer == "gptq":
            p["observer_kwargs"] = {"sequential": False}
        return {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                    "different_groups": {"g": {"params": p, "modules": ["proj"]}},
                }
            }
        }

    model, rtn = copy.deepcopy(fp), copy.deepcopy(fp)
    qc.init_compression(model, doc("gptq"))
    qc.init_compression(rtn, doc("minmax"))
    qc.calibrate_weight_ranges(model, data)
    m = model.model.layers[1].mlp.down_proj
    s, g = m.qc_wq.solved
    assert torch.equal(m.effective_weight(), floats.fake_quantize_float(m.weight, m.qc_wq.spec(), scale=s, gscale=g))
    n = "model.layers.0.mlp.down_proj"
    assert output_error(fp, model, data, n) < output_error(fp, rtn, data, n)
    qc.export_quantized(model, tmp_path / "out", doc("gptq"))
    back = dict(qc.load_quantized(tmp_path / "out", tiny_llama(seed=3)).named_modules())
    for name, mod in model.named_modules():
        if getattr(mod, "qc_wq", None) is not None:
            assert torch.equal(back[name].weight.detach(), mod.effective_weight().detach()), name


def test_moe_float_experts_keep_each_experts_scales(tmp_path):
    from tests.helpers.moe_fixtures import make_moe

    model = make_moe("qwen3_moe", seed=1)
    data = batches(n=3, vocab=model.config.vocab_size)
    doc = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                "different_groups": {
                    "g": {
                        "params": {"start_bits": 4, "target_bits": 4, "format": "nvfp4", "observer": "gptq"},
                        "modules": ["experts"],
                    }
                },
            }
        }
    }
    qc.init_compression(model, doc)
    qc.calibrate_weight_ranges(model, data)
    part = model.model.layers[0].mlp.experts._modules["down_proj"]
    s, g = part.qc_wq.solved
    assert g.shape == (part.matrix_shape()[0],)
    eff = part.effective_weight().detach()
    view = part.weight_matrix_view(part.weight.detach())
    spec = part.qc_wq.spec()
    from qcompress.quant import floats

    for e, (v, se) in enumerate(zip(view.chunk(4), s.chunk(4))):
        assert torch.equal(
            floats.fake_quantize_float(v, spec, scale=se, gscale=g[e].reshape(1)),
            part.weight_matrix_view(eff).chunk(4)[e],
        )
    qc.export_quantized(model, tmp_path / "out", doc)
    back = qc.load_quantized(tmp_path / "out", make_moe("qwen3_moe", seed=5))
    got = back.model.layers[0].mlp.experts.down_proj.detach()
    assert torch.equal(got, eff)


def test_range_learning_starts_from_gptqs_scales():
    fp = tiny_llama()
    data = batches()
    doc = gptq_doc(sym=False, sequential=False)
    doc["compression_training"]["weight_quantization"]["different_groups"]["g"]["params"]["range_learning"] = True
    model = copy.deepcopy(fp)
    qc.init_compression(model, doc)
    qc.calibrate_weight_ranges(model, data)
    plain = copy.deepcopy(fp)
    qc.init_compression(plain, gptq_doc(sym=False, sequential=False))
    qc.calibrate_weight_ranges(plain, data)
    a, b = model.model.layers[0].self_attn.k_proj, plain.model.layers[0].self_attn.k_proj
    assert a.qc_wq.solved == ()
    assert torch.equal(a.weight_scale.detach().reshape(-1), b.qc_wq.solved[0])
    assert torch.equal(a.effective_weight().detach(), b.effective_weight())
    loss = model(data[0], labels=data[0]).loss
    loss.backward()
    assert a.weight_scale.grad is not None and a.weight_scale.grad.abs().sum() > 0


def test_qcompress_export_from_a_checkpoint_is_exact_and_from_weights_refused(tmp_path, monkeypatch, capsys):
    import json
    from safetensors.torch import save_file
    from qcompress.cli import main as cli_main

    (tmp_path / "tinyfactory.py").write_text(
        "import torch, transformers\n"
        "def build():\n"
        "    torch.manual_seed(9)\n"
        "    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,\n"
        "                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)\n"
        "    return transformers.AutoModelForCausalLM.from_config(cfg).eval()\n"
    )
    monkeypatch.chdir(tmp_path)
    doc = dict(gptq_doc(), train_batch_size=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    model = tiny_llama()
    data = batches()
    qc.init_compression(model, doc)
    qc.calibrate_weight_ranges(model, data)
    engine = qc.initialize(model, doc, device="cpu")
    for b in data:
        engine.backward(engine(b, labels=b).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    assert (
        cli_main(
            [
                "export",
                "--model",
                "tinyfactory:build",
                "--config",
                "cfg.json",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    back = dict(qc.load_quantized(tmp_path / "out", tiny_llama(seed=4)).named_modules())
    for n, m in model.named_modules():
        if getattr(m, "qc_wq", None) is not None:
            assert torch.equal(back[n].weight.detach(), m.effective_weight().detach()), n
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    capsys.readouterr()
    code = cli_main(
        [
            "export",
            "--model",
            "tinyfactory:build",
            "--config",
            "cfg.json",
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--out",
            str(tmp_path / "out2"),
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and "never solved" in err and "--weights" in err
    assert not (tmp_path / "out2" / "config.json").exists()


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_moe_families_export_exactly(tmp_path, family):
    """gpt-oss stores each expert transposed ([in, out], with biases); Mixtral as Linear does."""
    from tests.helpers.moe_fixtures import make_moe

    fp = make_moe(family, seed=2)
    data = batches(n=3, vocab=fp.config.vocab_size)
    model = copy.deepcopy(fp)
    doc = gptq_doc(group_size=16, modules=("experts",))
    qc.init_compression(model, doc)
    assert qc.calibrate_weight_ranges(model, data) == 2 * fp.config.num_hidden_layers
    n = "model.layers.0.mlp.experts.down_proj"
    eff = {k: m.effective_weight().detach().clone() for k, m in model.named_modules() if getattr(m, "qc_wq", None)}
    assert not torch.equal(eff[n], dict(fp.named_parameters())[n].detach())
    qc.export_quantized(model, tmp_path / "out", doc)
    back = qc.load_quantized(tmp_path / "out", make_moe(family, seed=6))
    params = dict(back.named_parameters())
    for k, w in eff.items():
        assert torch.equal(params[k].detach(), w), k


def test_a_model_that_changes_the_hidden_state_between_blocks_is_refused_for_sequential():
    model = tiny_llama()
    qc.init_compression(model, gptq_doc())
    model.model.layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 2.0,) + tuple(args[1:]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"observer_kwargs\.sequential: model\.layers\[1\] is not fed the output"):
        qc.calibrate_weight_ranges(model, batches())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    other = tiny_llama()  # the way out the message gives works
    qc.init_compression(other, gptq_doc(sequential=False))
    other.model.layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 2.0,) + tuple(args[1:]))
    assert qc.calibrate_weight_ranges(other, batches()) == 14


def test_static_activation_ranges_calibrate_before_gptq_on_full_precision_weights():
    """PTQ calibrates static activation ranges before GPTQ solves the weights (qcompress train's
    order): the modules still to solve run their full-precision weights meanwhile, so the ranges are
    those of the same model with activation quantization only (the oracle); GPTQ then solves, and
    the model runs."""
    from qcompress.train.stages import calibrate_static_ranges

    acts = {
        "shared_parameters": {"enabled": True, "range_calibration": "static", "schedule_offset": 0},
        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["proj"]}},
    }
    doc = gptq_doc()
    doc["compression_training"]["activation_quantization"] = acts
    model = tiny_llama()
    qc.init_compression(model, doc)
    oracle = tiny_llama()
    qc.init_compression(oracle, {"compression_training": {"activation_quantization": acts}})
    data = [{"input_ids": b} for b in batches()]
    calibrate_static_ranges(model, data)
    calibrate_static_ranges(oracle, data)
    got = {n: (m.qc_aq.observer.min, m.qc_aq.observer.max) for n, m in model.named_modules() if hasattr(m, "qc_aq")}
    want = {n: (m.qc_aq.observer.min, m.qc_aq.observer.max) for n, m in oracle.named_modules() if hasattr(m, "qc_aq")}
    assert got.keys() == want.keys() and len(got) == 2 * len(PROJ)
    for n in got:
        assert torch.equal(torch.as_tensor(got[n][0]), torch.as_tensor(want[n][0])), n
        assert torch.equal(torch.as_tensor(got[n][1]), torch.as_tensor(want[n][1])), n
    assert qc.calibrate_weight_ranges(model, [b["input_ids"] for b in data]) == 2 * len(PROJ)
    calibrate_static_ranges(model, data)  # the ranges the solved weights give
    with torch.no_grad():
        assert torch.isfinite(model(data[0]["input_ids"]).logits).all()
