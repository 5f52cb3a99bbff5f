"""Progressive layer drop: DeepSpeed's `progressive_layer_drop` section, applied by the
rewrite pass to the repeated blocks of Hugging Face models. Oracles: the schedule formula written
out here, the plain model's blocks run by hand, a binomial bound on drop counts, and the same run
without interruption / on the other rank / at another ZeRO stage."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
import torch.nn as nn

import qcompress as qc
from qcompress.nn import pld as P

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install -e ".[hf]" in the checkout)'
)

from tests.helpers.dist_utils import run_ranks  # noqa: E402

THETA, GAMMA = 0.3, 0.4


def gpt2(seed=0, layers=4, dropout=0.0, tied=True):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=tied,
    )
    return transformers.GPT2LMHeadModel(cfg)


def bert(seed=0, layers=3):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(cfg)


def ds_config(stage=0, world=1, theta=THETA, gamma=GAMMA, micro=2, gas=1, compression=True, **pld):
    cfg = {
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
        "progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": gamma, **pld},
    }
    if compression:
        cfg["compression_training"] = {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {
                    "w8": {"params": {"start_bits": 8, "target_bits": 8}, "modules": [r"attn\.c_attn", r"mlp\.c_fc"]}
                },
            }
        }
    return cfg


def batch(step, micro_idx, rank=0, world=1, micro=2, gas=1):
    g = torch.Generator().manual_seed(7919 * step + 31 * (rank * gas + micro_idx))
    return torch.randint(0, 64, (micro, 8), generator=g)


def step_with_drops(sched, blocks=4):
    """The first step >= 2 at which the first calls of the blocks see both a drop and a keep."""
    for step in range(2, 1000):
        sched.start_step(step)
        keeps = [P.uniform(sched.seed, step, i, 0) < b.keep_probability() for i, b in enumerate(sched.blocks)]
        if any(keeps) and not all(keeps):
            return step
    raise AssertionError("no step with drops")


def record_decisions(sched):
    """Wrap sched.decide to log (step, block, keep probability or 0)."""
    log = []
    inner = sched.decide

    def decide(block):
        keep = inner(block)
        log.append((sched.step, block.index, keep))
        return keep

    sched.decide = decide
    return log


def train(engine, first, last, rank=0, world=1):
    engine.train()
    gas, micro = engine.gradient_accumulation_steps, engine.train_micro_batch_size_per_gpu
    losses = []
    for step in range(first, last):
        for m in range(gas):
            x = batch(step, m, rank, world, micro, gas)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().double().item())
    return losses


def full_params(model):
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().clone().cpu()
    return out


# --- config --------------------------------------------------------------------------------------
def test_deepspeed_config_with_the_key_loads(tmp_path):
    """A DeepSpeed config (the PLD tutorial's keys) loads unchanged; defaults are DeepSpeed's."""
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001},
            }
        )
    )
    cfg = qc.load_config(str(path))
    assert (cfg.progressive_layer_drop.enabled, cfg.progressive_layer_drop.theta, cfg.progressive_layer_drop.gamma) == (
        True,
        0.5,
        0.001,
    )
    default = qc.load_config({"progressive_layer_drop": {}}).progressive_layer_drop
    assert (default.enabled, default.theta, default.gamma, default.modules) == (False, 1.0, 0.001, None)


@pytest.mark.parametrize(
    "section, path, words",
    [
        ({"enabled": True, "theta": 0.0}, "progressive_layer_drop.theta", "> 0"),
        ({"enabled": True, "theta": 1.5}, "progressive_layer_drop.theta", "<= 1"),
        ({"enabled": True, "gamma": -1}, "progressive_layer_drop.gamma", ">= 0"),
        ({"enabled": True, "gama": 0.1}, "progressive_layer_drop.gama", "did you mean 'gamma'"),
        ({"enabled": True, "modules": ["("]}, "progressive_layer_drop.modules[0]", "not a valid regex"),
    ],
)
def test_bad_values_name_the_key(section, path, words):
    with pytest.raises(qc.ConfigError) as err:
        qc.load_config({"progressive_layer_drop": section})
    assert err.value.path == path and words in str(err.value)


# --- the schedule ------------------------------------------------------------------------------
def test_keep_probabilities_follow_the_formula_over_steps_and_depth():
    """Step g trains with theta(g-1) (DeepSpeed updates it at each boundary with the count before it
    moves); block l of L keeps with 1 - l/L (1 - theta)."""
    model = gpt2(layers=4)
    cfg = ds_config(compression=False)
    qc.init_compression(model, cfg)
    engine = qc.initialize(model, cfg)
    sched = engine.pld
    seen = {}
    for g in range(7):
        seen[g] = dict(sched.keep_probabilities())
        engine.step()  # an optimizer boundary (no gradients needed)
    for g, probs in seen.items():
        theta = (1 - THETA) * math.exp(-GAMMA * max(g - 1, 0)) + THETA
        want = {f"transformer.h.{i}": 1 - (i + 1) / 4 * (1 - theta) for i in range(4)}
        assert probs.keys() == want.keys()
        for k in want:
            assert probs[k] == pytest.approx(want[k], rel=1e-12), (g, k)
    assert seen[0] == seen[1] == {f"transformer.h.{i}": 1.0 for i in range(4)}
    # DeepSpeed's own API on the same object
    sched.update_state(9)
    assert sched.get_theta() == pytest.approx((1 - THETA) * math.exp(-GAMMA * 9) + THETA)


def test_drop_counts_match_the_keep_probabilities():
    """Over many calls each block runs in a share within 5 sigma of its keep probability."""
    sched = P.PLDSchedule(theta=0.2, gamma=60.0, seed=3)  # theta(t >= 1) = 0.2 to 1e-26
    blocks = [P.PLDState(sched, f"b{i}", i, i + 1, 4) for i in range(4)]
    kept = [0] * 4
    steps, calls = 1000, 4
    for step in range(2, 2 + steps):
        sched.start_step(step)
        for _ in range(calls):
            for b in blocks:
                kept[b.index] += sched.decide(b) > 0
    n = steps * calls
    for b in blocks:
        p = 1 - (b.depth / 4) * 0.8
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(kept[b.index] - n * p) < 5 * sigma, (b.name, kept[b.index], n * p)


# --- what a block computes -----------------------------------------------------------------------
def test_eval_output_is_unchanged_and_state_dict_loads_into_the_plain_model():
    plain, model = gpt2(), gpt2()
    ids_before = {n: id(p) for n, p in model.named_parameters()}
    qc.init_compression(model, ds_config(compression=False))
    assert {n: id(p) for n, p in model.named_parameters()} == ids_before
    sched = P.pld_schedule(model)
    sched.start_step(50)  # theta far below 1: training would drop blocks
    x = batch(0, 0)
    plain.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
    assert sched._run == 0  # no decision drawn in eval
    assert list(model.state_dict()) == list(plain.state_dict())
    fresh = gpt2(seed=5).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, plain(input_ids=x).logits)
    # the model still pickles / deep-copies as its own classes
    twin = copy.deepcopy(model)
    assert type(twin.transformer.h[0]) is type(model.transformer.h[0])
    P.remove_pld(model)
    assert type(model.transformer.h[0]) is transformers.models.gpt2.modeling_gpt2.GPT2Block


def test_dropped_block_passes_input_through_and_kept_block_is_rescaled():
    """In training: a dropped block's output is its input; a kept one's is x + (f(x) - x) / p,
    with f the plain block (run here by hand on the same input)."""
    model = gpt2(layers=4)
    plain = copy.deepcopy(model).train()
    qc.init_compression(model, ds_config(compression=False, theta=0.1, gamma=5.0))
    sched = P.pld_schedule(model)
    sched.start_step(step_with_drops(sched))
    seen = []
    for i, blk in enumerate(model.transformer.h):
        blk.register_forward_hook(lambda m, a, out, i=i: seen.append((i, a[0].detach(), out.detach())))
    log = record_decisions(sched)
    model.train()
    model(input_ids=batch(0, 0))
    assert len(seen) == 4 and {k for _, _, k in log} - {0.0}, log
    assert any(k == 0.0 for _, _, k in log)
    for (i, x, y), (_, _, keep) in zip(seen, log):
        if keep == 0.0:
            assert torch.equal(y, x)
        else:
            f = plain.transformer.h[i](x)
            assert torch.allclose(y, x + (f - x) / keep, atol=1e-6)
    assert sched._kept == sum(k > 0 for _, _, k in log) and sched._run == 4


def test_blocks_are_found_in_bert_roberta_gpt2_llama_and_by_regex():
    llama_cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    roberta_cfg = transformers.RobertaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
    )
    cases = [
        (bert(), [f"bert.encoder.layer.{i}" for i in range(3)]),
        (transformers.RobertaModel(roberta_cfg), [f"encoder.layer.{i}" for i in range(2)]),
        (gpt2(layers=2), ["transformer.h.0", "transformer.h.1"]),
        (transformers.LlamaForCausalLM(llama_cfg), [f"model.layers.{i}" for i in range(3)]),
    ]
    on = {"progressive_layer_drop": {"enabled": True, "theta": 0.5}}
    for model, names in cases:
        qc.init_compression(model, on)
        assert [b.name for b in P.pld_schedule(model).blocks] == names
        assert [(b.depth, b.stack_size) for b in P.pld_schedule(model).blocks] == [
            (i + 1, len(names)) for i in range(len(names))
        ]
    model = bert()
    qc.init_compression(model, {"progressive_layer_drop": {"enabled": True, "modules": [r"layer\.[12]$"]}})
    assert [(b.name, b.depth, b.stack_size) for b in P.pld_schedule(model).blocks] == [
        ("bert.encoder.layer.1", 1, 2),
        ("bert.encoder.layer.2", 2, 2),
    ]
    with pytest.raises(qc.ConfigError, match="matches no module") as err:
        qc.init_compression(bert(), {"progressive_layer_drop": {"enabled": True, "modules": ["decoder"]}})
    assert err.value.path == "progressive_layer_drop.modules[0]"
    with pytest.raises(qc.ConfigError, match="inside"):
        qc.init_compression(bert(), {"progressive_layer_drop": {"enabled": True, "modules": [r"layer\.0"]}})
    with pytest.raises(qc.ConfigError, match="no repeated blocks") as err:
        qc.init_compression(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), {"progressive_layer_drop": {"enabled": True}})
    assert err.value.path == "progressive_layer_drop.modules"


def test_decisions_are_replayed_under_activation_checkpointing():
    """Hugging Face checkpoints a block's forward and reruns it in backward: the decision is drawn
    once, outside, so gradients equal those of the same step without checkpointing."""
    grads = []
    for ckpt in (False, True):
        model = gpt2(layers=4)
        qc.init_compression(model, ds_config(compression=False, theta=0.2, gamma=5.0))
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sched = P.pld_schedule(model)
        sched.start_step(step_with_drops(sched))
        log = record_decisions(sched)
        model.train()
        x = batch(1, 0)
        model(input_ids=x, labels=x).loss.backward()
        grads.append(({n: p.grad for n, p in model.named_parameters()}, log))
    (g0, log0), (g1, log1) = grads
    assert log0 == log1 and any(k == 0.0 for *_, k in log0) and len(log1) == 4
    assert g0.keys() == g1.keys()
    for n in g0:
        assert (g0[n] is None) == (g1[n] is None), n
        if g0[n] is not None:
            assert torch.allclose(g0[n], g1[n], atol=1e-6), n


# --- the engine ------------------------------------------------------------------------------------
def test_resume_is_exact(tmp_path):
    """Save after 3 steps, finish; a fresh engine from another seed loads and finishes with the same
    decisions, losses and weights, bit for bit (dropout on: RNG states come back too)."""
    cfg = ds_config()

    def build(seed):
        model = gpt2(seed=seed, dropout=0.1)
        qc.init_compression(model, cfg)
        eng = qc.initialize(model, cfg)
        return eng, record_decisions(eng.pld)

    eng, log = build(0)
    train(eng, 0, 3)
    eng.save_checkpoint(str(tmp_path))
    ref_losses = train(eng, 3, 7)
    ref_log = [d for d in log if d[0] >= 3]
    ref = full_params(eng.module)
    eng2, log2 = build(1)
    eng2.load_checkpoint(str(tmp_path))
    assert eng2.pld.step == 3 and eng2.pld.theta == pytest.approx((1 - THETA) * math.exp(-GAMMA * 2) + THETA)
    losses = train(eng2, 3, 7)
    assert log2 == ref_log and any(k == 0.0 for *_, k in ref_log)
    assert losses == ref_losses
    got = full_params(eng2.module)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_wall_clock_breakdown_and_main_job_metrics_show_the_share_of_blocks_run(caplog):
    from qcompress.train.loop import group_columns, metric_columns

    model = gpt2(layers=4)
    cfg = dict(ds_config(compression=False, theta=0.1, gamma=5.0), wall_clock_breakdown=True)
    engine = qc.initialize(model, cfg)  # not rewritten first: the engine applies PLD itself
    assert engine.pld is not None and "pld.blocks_run" in metric_columns(model)
    assert group_columns(model)["pld.blocks_run"] == 1.0
    log = record_decisions(engine.pld)
    with caplog.at_level(logging.INFO, logger="qcompress.engine"):
        train(engine, 0, 4)
    last = [k for s, _, k in log if s == 3]
    share = sum(k > 0 for k in last) / len(last)
    assert share < 1.0
    assert group_columns(model)["pld.blocks_run"] == pytest.approx(share)
    assert f"blocks run {100 * share:.1f}%" in caplog.records[-1].getMessage()


# --- ranks, ZeRO stages, 1-bit Adam (2 spawned gloo ranks) ------------------------------------------
RANK_CASES = [
    ("s0", 0, "AdamW"),
    ("s1", 1, "AdamW"),
    ("s2", 2, "AdamW"),
    ("s3", 3, "AdamW"),
    ("onebit", 0, "OneBitAdam"),
]


def run_stages_with_pld(rank, world):
    out = {}
    for label, stage, opt in RANK_CASES:
        cfg = ds_config(stage=stage, world=world, theta=0.2, gamma=2.0, micro=1, gas=2)
        if opt == "OneBitAdam":
            cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 2}}
        model = gpt2(layers=3, tied=False)  # the engine's FSDP2 wrapping shards modules one by one
        qc.init_compression(model, cfg)
        eng = qc.initialize(model, cfg)
        log = record_decisions(eng.pld)
        losses = train(eng, 0, 4, rank, world)
        out[label] = {"log": log, "losses": losses, "final": full_params(eng.module)}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(run_stages_with_pld, 2, timeout=300)


def test_ranks_agree_at_every_stage_and_with_onebit_adam(two_ranks):
    r0, r1 = two_ranks
    ref_log = r0["s0"]["log"]
    assert any(k == 0.0 for *_, k in ref_log) and any(k > 0 for *_, k in ref_log)
    for label, *_ in RANK_CASES:
        assert r0[label]["log"] == r1[label]["log"] == ref_log, label  # same drops everywhere
        a, b = r0[label]["final"], r1[label]["final"]
        assert all(torch.equal(a[k], b[k]) for k in a), label
    for label in ("s1", "s2", "s3"):  # sharding changes nothing but the arithmetic order
        for rank in (0, 1):
            assert two_ranks[rank][label]["losses"] == pytest.approx(two_ranks[rank]["s0"]["losses"], rel=1e-4)
    assert r0["onebit"]["losses"][-1] != r0["onebit"]["losses"][0]


def test_hf_trainer_callback_advances_the_schedule(tmp_path):
    """qcompress.hf.CompressionCallback steps PLD with the Trainer's optimizer steps."""
    from qcompress.hf import CompressionCallback

    model = gpt2(layers=4)
    data = [{"input_ids": batch(i, 0, micro=1)[0], "labels": batch(i, 0, micro=1)[0]} for i in range(12)]
    cb = CompressionCallback({"progressive_layer_drop": {"enabled": True, "theta": 0.2, "gamma": 2.0}})
    args = transformers.TrainingArguments(
        str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=6,
        per_device_train_batch_size=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        logging_steps=100,
    )
    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[cb])
    sched = P.pld_schedule(model)
    log = record_decisions(sched)
    trainer.train()
    assert sched.step == 6
    assert [s for s, _, _ in log] == [s for s in range(6) for _ in range(4)]
    assert any(k == 0.0 for *_, k in log)
    for s, i, k in log:
        theta = (1 - 0.2) * math.exp(-2.0 * max(s - 1, 0)) + 0.2
        assert k in (0.0, pytest.approx(1 - (i + 1) / 4 * (1 - theta)))
