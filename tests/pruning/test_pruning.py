"""Pruning (sparse/row/head/channel), redundancy_clean slicing and scheduler state."""

import copy
import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.errors import ConfigError
from qcompress.pruning.masks import keep_count, topk_mask
from tests.helpers.shared_paths import DS_COMPRESSION
from tests.helpers.tiny_models import TinyResNet

CIFAR = os.path.join(DS_COMPRESSION, "cifar", "config", "ds_config_channel_prune.json")


def prune_cfg(tech, method="l1", ratio=0.5, offset=0, modules=("^0$",), related=None, **shared):
    group = {"params": {"dense_ratio": ratio}, "modules": list(modules)}
    if related is not None:
        group["related_modules"] = related
    sp = {"enabled": True, "schedule_offset": offset, "method": method, **shared}
    return {"compression_training": {tech: {"shared_parameters": sp, "different_groups": {"g1": {**group}}}}}


def mlp(seed=0, d_in=6, hidden=10, d_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


# --- mask oracles ------------------------------------------------------------------------------


def test_topk_mask_count_and_choice():
    rng = np.random.default_rng(0)
    for numel, ratio in [(30, 0.1), (30, 0.37), (7, 0.5), (12, 1.0), (5, 0.01)]:
        s = rng.permutation(numel).astype(np.float32).reshape(-1)
        mask = topk_mask(torch.from_numpy(s), ratio).numpy()
        k = math.ceil(round(ratio * numel, 6))
        assert mask.sum() == k
        assert set(np.nonzero(mask)[0]) == set(np.argsort(-s)[:k])
    assert keep_count(0.1, 30) == 3  # 0.1*30 = 3.0000000000000004 must not give 4


def test_l1_masks_pick_largest():
    m = mlp()
    w = m[0].weight.detach().numpy().copy()
    qc.init_compression(m, prune_cfg("row_pruning", ratio=0.3))
    mask = m[0].qc_pruning["row_pruning"].mask(m[0]).reshape(-1).numpy()
    k = math.ceil(0.3 * 10)
    assert set(np.nonzero(mask)[0]) == set(np.argsort(-np.abs(w).sum(1))[:k])
    # forward uses the masked rows and bias
    x = torch.randn(5, 6)
    ref = x @ (m[0].weight * torch.tensor(mask)[:, None]).T + m[0].bias * torch.tensor(mask)
    torch.testing.assert_close(m[0](x), ref)

    m = mlp()
    w = m[0].weight.detach().numpy().copy()
    qc.init_compression(m, prune_cfg("sparse_pruning", ratio=0.25))
    eff = m[0].effective_weight().detach().numpy()
    k = math.ceil(0.25 * w.size)
    keep = np.zeros(w.size, bool)
    keep[np.argsort(-np.abs(w).ravel())[:k]] = True
    np.testing.assert_array_equal(eff.ravel(), np.where(keep, w.ravel(), 0))

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3))
    w = conv[0].weight.detach().numpy().copy()
    qc.init_compression(conv, prune_cfg("channel_pruning", ratio=0.5))
    mask = conv[0].qc_pruning["channel_pruning"].mask(conv[0]).reshape(-1).numpy()
    assert set(np.nonzero(mask)[0]) == set(np.argsort(-np.abs(w).sum((1, 2, 3)))[:4])
    # l1 masks are not module buffers: state_dict keys unchanged
    assert set(conv.state_dict()) == {"0.weight", "0.bias"}


def test_topk_scores_shapes_keys_and_straight_through_grad():
    m = mlp()
    qc.init_compression(m, prune_cfg("row_pruning", method="topk", ratio=0.4))
    scores = m[0].row_pruning_scores
    assert scores.shape == (10, 1) and "0.row_pruning_scores" in m.state_dict()
    x = torch.randn(5, 6)
    m(x).square().sum().backward()
    # oracle: gradient of the loss w.r.t. a row mask used as a plain multiplier
    mask = topk_mask(scores.detach(), 0.4).clone().requires_grad_(True)
    assert mask.sum() == 4
    w, b = m[0].weight.detach(), m[0].bias.detach()
    h = torch.relu(x @ (w * mask).T + b * mask.reshape(-1))
    (h @ m[2].weight.detach().T + m[2].bias.detach()).square().sum().backward()
    torch.testing.assert_close(scores.grad, mask.grad)
    assert scores.grad.abs().sum() > 0

    for tech, mod, shape, extra in [
        ("sparse_pruning", nn.Linear(6, 4), (4, 6), {}),
        ("head_pruning", nn.Linear(8, 4), (1, 4), {"num_heads": 4}),
        ("channel_pruning", nn.Conv2d(2, 6, 3), (6, 1, 1, 1), {}),
    ]:
        net = nn.Sequential(mod)
        qc.init_compression(net, prune_cfg(tech, method="topk", **extra))
        assert getattr(net[0], f"{tech}_scores").shape == shape


def test_head_mask_zeroes_input_columns():
    lin = nn.Sequential(nn.Linear(8, 3))
    qc.init_compression(lin, prune_cfg("head_pruning", method="topk", ratio=0.5, num_heads=4))
    with torch.no_grad():
        lin[0].head_pruning_scores.copy_(torch.tensor([[0.1, 0.9, -1.0, 0.5]]))
    eff = lin[0].effective_weight().detach()
    w = lin[0].weight.detach()
    keep_cols = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)  # heads 1 and 3 kept
    torch.testing.assert_close(eff, w * keep_cols)


def test_snip_momentum_is_a_config_error():
    with pytest.raises(ConfigError, match=r"sparse_pruning\.shared_parameters\.method.*Neural Compressor"):
        qc.init_compression(mlp(), prune_cfg("sparse_pruning", method="snip_momentum"))


# --- schedule ----------------------------------------------------------------------------------


def test_offset_respected_and_state_round_trip():
    m = mlp()
    ref = copy.deepcopy(m)
    qc.init_compression(m, prune_cfg("row_pruning", method="topk", offset=3))
    sched = qc.CompressionScheduler(m)
    x = torch.randn(4, 6)
    for step in range(5):
        st = m[0].qc_pruning["row_pruning"]
        assert st.active == (step >= 3)
        same = torch.equal(m(x), ref(x))
        assert same == (step < 3)
        sched.step()
    # sparse l1 with the (optional) end: kept ratio ramps 1 -> dense_ratio over [offset, end]
    m = mlp()
    qc.init_compression(m, prune_cfg("sparse_pruning", ratio=0.2, offset=2, schedule_offset_end=6))
    sched = qc.CompressionScheduler(m)
    kept = []
    for _ in range(8):
        kept.append(int((m[0].effective_weight() != 0).sum()))
        sched.step()
    assert kept == [60, 60, 60, keep_count(0.8, 60), keep_count(0.6, 60), keep_count(0.4, 60), 12, 12]
    sd = sched.state_dict()
    assert "scores" in sd["modules"]["0"]["prune.sparse_pruning"]
    # round trip into a fresh model whose weights differ: the saved init-time scores win
    m2 = mlp(seed=1)
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        m2[0].weight.mul_(-1).add_(torch.randn_like(m2[0].weight))
    qc.init_compression(m2, prune_cfg("sparse_pruning", ratio=0.2, offset=2, schedule_offset_end=6))
    with torch.no_grad():
        m2[0].weight.copy_(m[0].weight)
    s2 = qc.CompressionScheduler(m2)
    s2.load_state_dict(sd)
    assert s2.training_steps == 8
    torch.testing.assert_close(m2(torch.ones(2, 6)), m(torch.ones(2, 6)))


def test_l1_mask_round_trip_without_ramp():
    m = mlp()
    qc.init_compression(m, prune_cfg("row_pruning", offset=0))
    sd = qc.CompressionScheduler(m).state_dict()
    m2 = mlp(seed=5)
    qc.init_compression(m2, prune_cfg("row_pruning", offset=0))
    qc.CompressionScheduler(m2).load_state_dict(sd)
    torch.testing.assert_close(m2[0].qc_pruning["row_pruning"].l1_mask, m[0].qc_pruning["row_pruning"].l1_mask)


# --- redundancy_clean --------------------------------------------------------------------------


def test_row_clean_slices_mlp():
    m = mlp(hidden=12)
    cfg = prune_cfg("row_pruning", method="topk", ratio=0.5, related=[["^2$"]])
    qc.init_compression(m, cfg)
    x = torch.randn(7, 6)
    y = m(x).detach()
    qc.redundancy_clean(m, cfg)
    assert (m[0].out_features, m[0].weight.shape, m[0].bias.shape) == (6, (6, 6), (6,))
    assert (m[2].in_features, m[2].weight.shape) == (6, (3, 6))
    assert "0.row_pruning_scores" not in m.state_dict() and not m[0].qc_pruning
    torch.testing.assert_close(m(x), y)


def test_row_clean_without_related_only_zeroes():
    m = mlp()
    cfg = prune_cfg("row_pruning", ratio=0.5)
    qc.init_compression(m, cfg)
    x = torch.randn(3, 6)
    y = m(x).detach()
    qc.redundancy_clean(m, cfg)
    assert m[0].weight.shape == (10, 6) and int((m[0].weight.abs().sum(1) == 0).sum()) == 5
    torch.testing.assert_close(m(x), y)


def test_related_count_mismatch_names_group_and_regexes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    cfg = prune_cfg("row_pruning", related=[["^[24]$"]])
    pattern = r"row_pruning\.different_groups\.g1\.related_modules.*'\^\[24\]\$' matches 2.*'\^0\$' matched 1"
    with pytest.raises(ConfigError, match=pattern):  # found at init already
        qc.init_compression(copy.deepcopy(m), cfg)
    ok = prune_cfg("row_pruning", related=[["^2$"]])
    qc.init_compression(m, ok)
    with pytest.raises(ConfigError, match=pattern):  # and at clean with another config
        qc.redundancy_clean(m, cfg)


def _bert(layers, heads=4, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    conf = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=40,
        max_position_embeddings=32,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(conf).eval()


def test_head_clean_bert_matches_masked_model():
    model = _bert(2)
    cfg = {
        "compression_training": {
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": 4},
                "different_groups": {
                    "hp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["attention.output.dense"],
                        "related_modules": [["self.query", "self.key", "self.value"]],
                    }
                },
            },
            "row_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
                "different_groups": {
                    "rp1": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["intermediate.dense"],
                        "related_modules": [["layer.\\w+.output.dense"]],
                    }
                },
            },
        }
    }
    qc.init_compression(model, cfg)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    qc.redundancy_clean(model, cfg)
    att = model.bert.encoder.layer[0].attention
    assert att.self.query.weight.shape == (16, 32) and att.self.value.bias.shape == (16,)
    assert att.output.dense.weight.shape == (32, 16)
    assert att.self.num_attention_heads == 2 and att.self.all_head_size == 16
    assert model.bert.encoder.layer[1].intermediate.dense.out_features == 20
    assert model.bert.encoder.layer[1].output.dense.in_features == 20
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)


def test_cifar_channel_prune_config_end_to_end():
    torch.manual_seed(0)
    model = TinyResNet()
    for mod in model.modules():  # non-trivial BN statistics
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
            nn.init.uniform_(mod.weight, 0.5, 1.5)
            nn.init.uniform_(mod.bias, -0.5, 0.5)
    cfg = qc.load_config(CIFAR)
    qc.init_compression(model, cfg)
    sched = qc.CompressionScheduler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 8, 8)
    for _ in range(2):  # scores train
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        y = model(x)
    twin = copy.deepcopy(model)  # the BN hooks follow the copy's own convs
    qc.redundancy_clean(twin, cfg)
    assert model.layer1[0].bn1._forward_hooks and model.layer1[0].conv1.weight.shape[0] == 8
    qc.redundancy_clean(model, cfg)
    for blk in (model.layer1[0], model.layer1[1], model.layer2[0]):
        assert blk.conv1.weight.shape == (4, 8, 3, 3) and blk.conv1.out_channels == 4
        assert blk.conv2.weight.shape == (8, 4, 3, 3) and blk.conv2.in_channels == 4
        assert blk.bn1.num_features == 4 and blk.bn1.running_var.shape == (4,)
        assert not blk.bn1._forward_hooks
    assert model.conv1.weight.shape == (8, 3, 3, 3)  # "layer....conv1" does not match it
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twin(x), y, rtol=1e-5, atol=1e-5)


def test_clean_with_weight_quant_keeps_codes_consistent():
    from qcompress.quant.api import dequantize

    m = mlp(hidden=8)
    cfg = prune_cfg("row_pruning", ratio=0.5, related=[["^2$"]])
    cfg["compression_training"]["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
        "different_groups": {
            "wq": {"params": {"start_bits": 8, "target_bits": 8, "granularity": "channel"}, "modules": ["^[02]$"]}
        },
    }
    qc.init_compression(m, cfg)
    x = torch.randn(5, 6)
    y = m(x).detach()
    qc.redundancy_clean(m, cfg)
    assert m[0].weight.shape == (4, 6) and m[2].weight.shape == (3, 4)
    for mod in (m[0], m[2]):
        q, s, z = mod.qc_wq.codes
        assert q.shape == mod.weight.shape
        torch.testing.assert_close(dequantize(q, s, z), mod.weight.detach())
    torch.testing.assert_close(m(x), y)


@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
def test_sparse_clean_zeroes_baked_codes(qtype):
    from qcompress.quant.api import dequantize

    m = mlp()
    cfg = prune_cfg("sparse_pruning", ratio=0.3)
    cfg["compression_training"]["weight_quantization"] = {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 0,
            "quantize_weight_in_forward": True,
            "quantization_type": qtype,
        },
        "different_groups": {
            "wq": {"params": {"start_bits": 4, "target_bits": 4, "granularity": "channel"}, "modules": ["^0$"]}
        },
    }
    qc.init_compression(m, cfg)
    x = torch.randn(5, 6)
    y = m(x).detach()
    qc.redundancy_clean(m, cfg)
    q, s, z = m[0].qc_wq.codes
    torch.testing.assert_close(dequantize(q, s, z), m[0].weight.detach())
    assert int((m[0].weight == 0).sum()) >= 60 - keep_count(0.3, 60)
    torch.testing.assert_close(m(x), y)


def test_row_clean_hf_conv1d():
    pu = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    m = nn.Sequential(pu.Conv1D(12, 6), nn.GELU(), pu.Conv1D(3, 12))  # Conv1D(nf, nx): weight [nx, nf]
    cfg = prune_cfg("row_pruning", method="topk", ratio=0.5, related=[["^2$"]])
    qc.init_compression(m, cfg)
    assert m[0].row_pruning_scores.shape == (12, 1)
    x = torch.randn(2, 4, 6)
    y = m(x).detach()
    qc.redundancy_clean(m, cfg)
    assert m[0].weight.shape == (6, 6) and m[0].nf == 6 and m[2].weight.shape == (6, 3) and m[2].nx == 6
    torch.testing.assert_close(m(x), y)


def head_pruning_cfg(output: str, related=None) -> dict:
    """topk head pruning of 4 heads to half on the `output` projection(s), with `related` modules."""
    group = {"params": {"dense_ratio": 0.5}, "modules": [output]}
    if related is not None:
        group["related_modules"] = [list(related)]
    return {
        "compression_training": {
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": 4},
                "different_groups": {"hp": group},
            }
        }
    }


def test_head_clean_gpt2_fused_c_attn():
    """GPT-2's c_attn is Q, K and V side by side: each kept head keeps its block in all three
    sections, and the attention's split_size follows (it used to slice h blocks of 3d rows and
    the cleaned model failed to unpack Q, K, V)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(conf).eval()
    cfg = head_pruning_cfg("attn.c_proj", ["attn.c_attn"])
    qc.init_compression(model, cfg)
    attn = model.transformer.h[0].attn
    kept = attn.c_proj.qc_pruning["head_pruning"].final_mask(attn.c_proj).flatten().nonzero().flatten()
    w0, b0 = attn.c_attn.weight.detach().clone(), attn.c_attn.bias.detach().clone()  # [32, 96]
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    qc.redundancy_clean(model, cfg)
    # oracle: the kept heads' 8 columns of each of the Q, K, V sections, in order
    cols = [s * 32 + h * 8 + i for s in range(3) for h in kept.tolist() for i in range(8)]
    assert attn.c_attn.weight.shape == (32, 48) and attn.c_proj.weight.shape == (16, 32)
    torch.testing.assert_close(attn.c_attn.weight, w0[:, cols], rtol=0, atol=0)
    torch.testing.assert_close(attn.c_attn.bias, b0[cols], rtol=0, atol=0)
    assert (attn.num_heads, attn.split_size, attn.head_dim) == (2, 16, 8)
    assert (attn.c_attn.nf, attn.c_attn.nx, attn.c_proj.nf, attn.c_proj.nx) == (48, 32, 32, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)


def _llama(kv_heads):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(conf).eval()


LLAMA_HEADS = head_pruning_cfg("o_proj", ["q_proj", "k_proj", "v_proj"])


def test_head_clean_llama_matches_masked_model():
    model = _llama(kv_heads=4)
    qc.init_compression(model, LLAMA_HEADS)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    qc.redundancy_clean(model, LLAMA_HEADS)
    att = model.model.layers[0].self_attn
    assert att.k_proj.weight.shape == (16, 32) and att.o_proj.weight.shape == (32, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)


def test_head_pruning_grouped_query_kv_is_refused_at_init():
    """2 K/V heads serve 4 query heads: slicing k_proj per query head changed the logits (0.14)."""
    model = _llama(kv_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=r"head_pruning\.different_groups\.hp\.related_modules: "
        r"'model\.layers\.0\.self_attn\.k_proj' has 16 outputs.*grouped-query",
    ):
        qc.init_compression(model, LLAMA_HEADS)
    assert set(model.state_dict()) == set(before)  # the failed rewrite left the model as it was
    ok = copy.deepcopy(LLAMA_HEADS)
    del ok["compression_training"]["head_pruning"]["different_groups"]["hp"]["related_modules"]
    qc.init_compression(model, ok)  # without slicing: masked, then zeroed
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    qc.redundancy_clean(model, ok)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)


def _sparse_l1_cfg(ratio, end=None):
    sp = {"enabled": True, "schedule_offset": 0, "method": "l1"}
    if end is not None:
        sp["schedule_offset_end"] = end
    return {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": sp,
                "different_groups": {"g": {"params": {"dense_ratio": ratio}, "modules": ["^0$"]}},
            }
        }
    }


def _saved_sparse_run(cfg, steps=2):
    m = mlp(seed=0, d_in=8, hidden=8)
    w0 = m[0].weight.detach().clone()
    qc.init_compression(m, cfg)
    sched = qc.CompressionScheduler(m)
    for _ in range(steps):
        sched.step()
    return w0, copy.deepcopy(m.state_dict()), sched.state_dict()


def _resumed(cfg, model_sd, sched_sd):
    m = mlp(seed=1, d_in=8, hidden=8)  # other weights: only the checkpoint may decide
    qc.init_compression(m, cfg)
    sched = qc.CompressionScheduler(m)
    m.load_state_dict(model_sd)
    sched.load_state_dict(sched_sd)
    return m


def test_resume_with_another_dense_ratio_or_ramp_is_refused_naming_the_key():
    """A checkpoint holding only the final l1 mask kept its own ratio silently (0.5 where the
    config said 0.25), and a ramp resumed from it ramped over the fresh model's weights."""
    _, msd, ssd = _saved_sparse_run(_sparse_l1_cfg(0.5))
    with pytest.raises(
        ConfigError,
        match=r"sparse_pruning\.different_groups\.g\.params\.dense_ratio: "
        r"0\.25 keeps 16 of 64, but the checkpoint's l1 mask keeps 32",
    ):
        _resumed(_sparse_l1_cfg(0.25), msd, ssd)
    with pytest.raises(ConfigError, match=r"sparse_pruning\.shared_parameters\.schedule_offset_end: "):
        _resumed(_sparse_l1_cfg(0.5, end=4), msd, ssd)
    with pytest.raises(ConfigError, match="keeps 29 of 64"):  # ceil(0.45 * 64) = 29
        _resumed(_sparse_l1_cfg(0.45), msd, ssd)
    m = _resumed(_sparse_l1_cfg(0.49), msd, ssd)  # ceil(0.49 * 64) = 32: that mask
    assert int(m[0].qc_pruning["sparse_pruning"].final_mask(m[0]).sum()) == 32


def test_resume_from_ramped_l1_scores_uses_the_saved_importance():
    """Ramped checkpoints hold the init-time scores; a config without the ramp (or another ratio)
    builds its mask from them, not from the weights of the model it was resumed into."""
    w0, msd, ssd = _saved_sparse_run(_sparse_l1_cfg(0.5, end=4))
    m = _resumed(_sparse_l1_cfg(0.25), msd, ssd)
    st = m[0].qc_pruning["sparse_pruning"]
    want = torch.zeros(64)
    want[w0.abs().flatten().topk(16).indices] = 1  # oracle: the original |W|
    torch.testing.assert_close(st.mask(m[0]).flatten(), want, rtol=0, atol=0)
    assert st.ratio == 0.25 and int(st.final_mask(m[0]).sum()) == 16


def test_head_clean_keeps_group_codes_that_align_with_heads(tmp_path):
    """Heads 8 inputs wide, scales every 4 inputs: the kept heads' groups keep their scales, so the
    codes still dequantize to the cleaned weight and an asymmetric export succeeds (the codes were
    dropped, and re-quantizing the baked weight missed 49 of 512 elements)."""
    model = _bert(2)
    cfg = {
        "compression_training": {
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": 4},
                "different_groups": {
                    "hp": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["attention.output.dense"],
                        "related_modules": [["self.query", "self.key", "self.value"]],
                    }
                },
            },
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": 0,
                    "quantize_weight_in_forward": True,
                    "quantization_type": "asymmetric",
                },
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": 4, "target_bits": 4, "granularity": "group", "group_size": 4},
                        "modules": ["attention"],
                    }
                },
            },
        }
    }
    qc.init_compression(model, cfg)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "integer codes dropped"
        qc.redundancy_clean(model, cfg)
    o = model.bert.encoder.layer[0].attention.output.dense
    q, s, z = o.qc_wq.codes
    assert q.shape == (32, 16) and s.shape == (32, 4)
    g = s.repeat_interleave(4, dim=1), z.repeat_interleave(4, dim=1)  # oracle: per-element scales
    torch.testing.assert_close((q.float() - g[1].float()) * g[0], o.weight.detach(), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)
    qc.export_quantized(model, tmp_path / "out")


def test_row_clean_of_a_group_quantized_related_module_warns_that_export_will_refuse_it(tmp_path):
    """Kept rows split the related module's input groups: the codes cannot follow; the warning
    names the key to change, and the export indeed refuses (per-channel scales export)."""
    for gran, exports in (({"granularity": "group", "group_size": 4}, False), ({"granularity": "channel"}, True)):
        m = mlp(hidden=12)
        cfg = prune_cfg("row_pruning", ratio=0.5, related=[["^2$"]])
        cfg["compression_training"]["weight_quantization"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
            "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4, **gran}, "modules": ["^2$"]}},
        }
        qc.init_compression(m, cfg)
        w = m[0].weight.detach().abs().sum(1)
        if exports:
            qc.redundancy_clean(m, cfg)
            qc.export_quantized(m, tmp_path / "channel")
            continue
        with pytest.warns(
            UserWarning,
            match=r"'2': integer codes dropped.*weight_quantization\.different_groups"
            r"\.wq\.params\.granularity",
        ):
            qc.redundancy_clean(m, cfg)
        assert sorted(w.topk(6).indices.tolist()) != [0, 1, 2, 3, 4, 5]  # the kept rows split groups
        with pytest.raises(Exception, match="'2'"):
            qc.export_quantized(m, tmp_path / "group")


def test_ramped_l1_mask_is_computed_once_per_ratio(monkeypatch):
    """The ramped l1 mask was a fresh top-k over every weight at each forward (1.3 s per forward
    for a 4096x4096 layer on CPU); it is now computed when the ratio changes, and still equals
    the top-k of the init-time |W| at every step."""
    import qcompress.pruning.state as state_mod

    calls = []
    real = state_mod.topk_mask
    monkeypatch.setattr(state_mod, "topk_mask", lambda s, r: calls.append(r) or real(s, r))
    m = mlp(seed=0, d_in=8, hidden=8)
    w0 = m[0].weight.detach().abs().clone()
    sp = {"enabled": True, "schedule_offset": 1, "schedule_offset_end": 5, "method": "l1", "schedule_offset_stride": 2}
    qc.init_compression(
        m,
        {
            "compression_training": {
                "sparse_pruning": {
                    "shared_parameters": sp,
                    "different_groups": {"g": {"params": {"dense_ratio": 0.25}, "modules": ["^0$"]}},
                }
            }
        },
    )
    sched = qc.CompressionScheduler(m)
    x = torch.randn(3, 8)
    st = m[0].qc_pruning["sparse_pruning"]
    ratios = []
    for _ in range(8):
        for _ in range(3):  # three forwards (micro-batches) per step
            m(x)
        if st.active:
            ratios.append(st.ratio)
            kept = keep_count(st.ratio, 64)
            want = torch.zeros(64)
            want[w0.flatten().topk(kept).indices] = 1
            torch.testing.assert_close(st.mask(m[0]).flatten(), want, rtol=0, atol=0)
        sched.step()
    assert sorted(set(ratios)) == [0.25, 0.625, 1.0] and sorted(set(calls)) == [0.25, 0.625, 1.0]
    assert len(calls) == 3  # one top-k per ratio, not one per forward


def test_head_clean_gpt_neox_fused_head_major_query_key_value():
    """GPT-NeoX's fused query_key_value (an nn.Linear) is laid out [heads, 3, d], unlike GPT-2's
    section-major Conv1D c_attn: each kept head keeps its 3d consecutive rows."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        max_position_embeddings=32,
    )
    model = transformers.GPTNeoXForCausalLM(conf).eval()
    cfg = head_pruning_cfg("attention.dense", ["query_key_value"])
    qc.init_compression(model, cfg)
    att = model.gpt_neox.layers[0].attention
    kept = att.dense.qc_pruning["head_pruning"].final_mask(att.dense).flatten().nonzero().flatten()
    w0 = att.query_key_value.weight.detach().clone()  # [96, 32]
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        y = model(input_ids=ids).logits
    qc.redundancy_clean(model, cfg)
    rows = [h * 24 + i for h in kept.tolist() for i in range(24)]  # oracle: head h's [q; k; v] rows
    torch.testing.assert_close(att.query_key_value.weight, w0[rows], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, y, rtol=1e-5, atol=1e-5)


def test_head_slicing_of_alibi_attention_is_refused_at_init():
    """Bloom builds its ALiBi slopes for the config's head count in every layer: a head-cleaned
    Bloom failed in its first forward after training. Slicing is refused at init, naming
    related_modules; zeroing the heads (no related_modules) still works."""
    transformers = pytest.importorskip("transformers")

    def bloom():
        torch.manual_seed(0)
        return transformers.BloomForCausalLM(
            transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
        ).eval()

    cfg = head_pruning_cfg(r"self_attention\.dense", [r"self_attention\.query_key_value"])
    with pytest.raises(
        ConfigError,
        match=r"head_pruning\.different_groups\.hp\.related_modules: .*BloomAttention"
        r".*ALiBi",
    ):
        qc.init_compression(bloom(), cfg)
    cfg = head_pruning_cfg(r"self_attention\.dense")
    model = qc.init_compression(bloom(), cfg)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(qc.redundancy_clean(model, cfg)(ids).logits).all()


def test_density_column_is_what_the_masks_keep():
    """metrics.csv's density.<group> reported the scheduled ratio: 4 of 12 heads kept at
    dense_ratio 0.3 showed 0.3. The oracle is the mask itself (its share of ones)."""
    from qcompress.train.loop import group_columns

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 10))
    cfg = {
        "compression_training": {
            "head_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk", "num_heads": 12},
                "different_groups": {"hp": {"params": {"dense_ratio": 0.3}, "modules": ["^0$"]}},
            },
            "row_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
                "different_groups": {"rp": {"params": {"dense_ratio": 0.25}, "modules": ["^2$"]}},
            },
        }
    }
    qc.init_compression(model, cfg)
    cols = group_columns(model)
    for mod, key in ((model[0], "density.hp"), (model[2], "density.rp")):
        st = next(iter(mod.qc_pruning.values()))
        with torch.no_grad():
            share = float(st.mask(mod).double().mean())
        assert cols[key] == pytest.approx(share, abs=1e-9)
    assert cols["density.hp"] == pytest.approx(4 / 12)  # ceil(0.3 * 12) heads
