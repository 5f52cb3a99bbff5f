"""Rank-side code for tests/engine/test_engine.py (spawned by tests/helpers/dist_utils.run_ranks).

Each worker runs many checks inside one process group and returns plain data; the assertions
live in test_engine.py. No test functions here.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc
from qcompress.engine import initialize

IN, HID, OUT = 16, 32, 8
STEPS = 6
SAVE_AT = 3

# W8A8: weights 10 -> 8 bits (drops after 2 and 4 optimizer steps, written at step time),
# activations 8 bits with static (EMA) ranges from step 0.
COMPRESSION = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantization_type": "symmetric"},
        "different_groups": {
            "wq": {"params": {"start_bits": 10, "target_bits": 8, "quantization_period": 2}, "modules": ["*"]}
        },
    },
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["*"]}},
    },
}


def make_cfg(stage=0, micro=4, gas=2, world=2, offload=False, static_ranges=True, **extra):
    compression = copy.deepcopy(COMPRESSION)
    if not static_ranges:  # per-token ranges do not depend on how samples are grouped
        compression["activation_quantization"]["shared_parameters"]["range_calibration"] = "dynamic"
    cfg = {
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 3, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "compression_training": compression,
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg.update(extra)
    return cfg


def make_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, OUT))
    return qc.init_compression(model, qc.load_config(cfg))


def global_batch(step, tbs):
    """The same global batch of `tbs` samples for a step, whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(tbs, IN, generator=g)
    y = torch.randint(0, OUT, (tbs,), generator=g)
    return x, y


def micro_batch(step, micro_idx, rank, world, micro, gas):
    """Rank r's micro-batch m of a step; sample order: [rank][micro] blocks."""
    x, y = global_batch(step, micro * gas * world)
    start = (rank * gas + micro_idx) * micro
    return x[start : start + micro], y[start : start + micro]


def train_steps(engine, first, last, world, micro, gas, rank, hook=None):
    """Optimizer steps first..last-1; returns per-micro-batch losses and grad norms."""
    losses, norms = [], []
    for step in range(first, last):
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, micro, gas)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            if hook is not None:
                hook(engine, step, m)
            engine.step()
            losses.append(loss.detach().double().item())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def full_params(engine):
    """Whole (unsharded) parameters by name, identical on every rank."""
    out = {}
    for name, p in engine.module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone().cpu()
    return out


def full_optim_state(engine):
    out = {}
    opt = engine.optimizer
    states = getattr(opt, "optim", opt).state
    for p, st in states.items():
        name = engine.param_names[p]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().cpu()
    return out


STAGES = [("s0", 0, False), ("s1", 1, False), ("s2", 2, False), ("s3", 3, False), ("s3off", 3, True)]


def run_with_resume(rank, world, cfg, ckdir, micro, gas, keep_optim=False):
    """Train, checkpoint after SAVE_AT steps, finish; then resume a fresh engine and finish again."""
    engine = initialize(make_model(cfg), cfg)
    losses, norms = train_steps(engine, 0, SAVE_AT, world, micro, gas, rank)
    engine.save_checkpoint(ckdir, client_state={"epoch": 7})
    saved = full_params(engine)
    saved_optim = full_optim_state(engine) if keep_optim else None
    more, more_norms = train_steps(engine, SAVE_AT, STEPS, world, micro, gas, rank)
    out = {
        "losses": losses + more,
        "norms": norms + more_norms,
        "final": full_params(engine),
        "memory": engine.memory_report(),
        "bits": engine.compression_scheduler.current_bits(),
        "sched_steps": engine.compression_scheduler.training_steps,
        "saved": saved,
        "tail_losses": more,
        "optim_state": saved_optim,
        "num_params": sum(p.numel() for p in engine.module.parameters()),
        "latest": open(os.path.join(ckdir, "latest")).read(),
    }
    del engine
    # Resume: a model built from another seed, then the checkpoint.
    engine2 = initialize(make_model(cfg, seed=123), cfg)
    path, client = engine2.load_checkpoint(ckdir)
    out.update(loaded=full_params(engine2), counters=engine2.counters(), client=client, lr=engine2.get_lr())
    out["resumed_losses"], _ = train_steps(engine2, SAVE_AT, STEPS, world, micro, gas, rank)
    out["resumed_final"] = full_params(engine2)
    return out


def run_stages(rank, world, ckpt_root):
    """Every stage: train, checkpoint mid-way, resume into a fresh engine; plus the memory report,
    gradient accumulation and fp16 overflow checks, all in one process group."""
    micro, gas = 4, 2
    results = {}
    for label, stage, offload in STAGES:
        cfg = make_cfg(stage, micro, gas, world, offload)
        results[label] = run_with_resume(
            rank, world, cfg, os.path.join(ckpt_root, label), micro, gas, keep_optim=label == "s1"
        )
    # Stage 3 with per-token activation ranges, whose results do not depend on the world size:
    # the checkpoint run_stage3_one_rank resumes from.
    cfg = make_cfg(3, micro, gas, world, static_ranges=False)
    results["s3dyn"] = run_with_resume(rank, world, cfg, os.path.join(ckpt_root, "s3dyn"), micro, gas, keep_optim=True)
    results["accum"] = run_accumulation(rank, world)
    results["overflow"] = run_overflow(rank, world)
    results["onebit"] = run_onebit(rank, world, ckpt_root)
    results["comm"] = run_comm_checks(rank, world)
    results["clip"] = run_clipping(rank, world)
    return results


def run_accumulation(rank, world):
    """micro 2 × accumulation 4 vs micro 8 × accumulation 1, same global batches (stage 0)."""
    out = {}
    for micro, gas in ((2, 4), (8, 1)):
        cfg = make_cfg(0, micro, gas, world, static_ranges=False)
        engine = initialize(make_model(cfg), cfg)
        # Rank r holds the same 8 samples in both layouts ([rank][micro] ordering).
        train_steps(engine, 0, 3, world, micro, gas, rank)
        out[f"{micro}x{gas}"] = full_params(engine)
    return out


def run_overflow(rank, world):
    """fp16, stage 0 and stage 2: rank 1 alone gets an inf gradient at step 1."""
    out = {}
    for stage in (0, 2):
        cfg = make_cfg(stage, 4, 2, world, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})

        def poison(engine, step, m):
            if step == 1 and m == 1 and rank == 1:
                p = next(iter(engine.module.parameters()))
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = float("inf")

        engine = initialize(make_model(cfg), cfg)
        train_steps(engine, 0, 1, world, 4, 2, rank)
        before = full_params(engine)
        scale_before = engine.loss_scale
        sched_before = engine.compression_scheduler.training_steps
        train_steps(engine, 1, 2, world, 4, 2, rank, hook=poison)
        after = full_params(engine)
        out[stage] = {
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "skipped": engine.skipped_steps,
            "global_steps": engine.global_steps,
            "sched": (sched_before, engine.compression_scheduler.training_steps),
            "scale": (scale_before, engine.loss_scale),
            "lr_iter": engine.lr_scheduler.last_batch_iteration,
        }
        train_steps(engine, 2, 3, world, 4, 2, rank)
        out[stage]["sched_after_clean_step"] = engine.compression_scheduler.training_steps
    return out


def run_stage3_one_rank(rank, world, ckpt_root):
    """Load the 2-rank stage-3 checkpoint on a single rank and keep training on the same batches."""
    cfg1 = make_cfg(3, 4, 4, 1, static_ranges=False)  # same 16-sample global batch and blocks
    engine = initialize(make_model(cfg1, seed=5), cfg1)
    path, client = engine.load_checkpoint(os.path.join(ckpt_root, "s3dyn"))
    loaded = full_params(engine)
    optim_state = full_optim_state(engine)
    losses, _ = train_steps(engine, SAVE_AT, STEPS, 1, 4, 4, rank)
    # ZeRO-1 (each rank saved the state of the parameters it owned) onto one rank.
    cfg_s1 = make_cfg(1, 4, 4, 1)
    engine_s1 = initialize(make_model(cfg_s1, seed=9), cfg_s1)
    engine_s1.load_checkpoint(os.path.join(ckpt_root, "s1"))
    s1 = {"loaded": full_params(engine_s1), "optim_state": full_optim_state(engine_s1)}
    s1["losses"], _ = train_steps(engine_s1, SAVE_AT, STEPS, 1, 4, 4, rank)
    # OneBitAdam's sharded (stage 1) state resumes only at its world size: refused, model untouched
    cfg_ob = onebit_cfg(1)
    cfg_ob.update(train_batch_size=8, gradient_accumulation_steps=2)
    engine_ob = initialize(make_model(cfg_ob, seed=9), cfg_ob)
    before = full_params(engine_ob)
    try:
        engine_ob.load_checkpoint(os.path.join(ckpt_root, "onebit1"))
        s1["onebit_refused"] = None
    except ValueError as e:
        s1["onebit_refused"] = (type(e).__name__, str(e))
    s1["onebit_untouched"] = all(torch.equal(before[k], v) for k, v in full_params(engine_ob).items())
    s1["onebit_steps"] = engine_ob.global_steps
    engine_ob.load_checkpoint(os.path.join(ckpt_root, "onebit1"), load_optimizer_states=False)
    s1["onebit_weights_only"] = full_params(engine_ob)
    return {
        "s1": s1,
        "loaded": loaded,
        "optim_state": optim_state,
        "losses": losses,
        "final": full_params(engine),
        "client": client,
    }


def grad_norm_oracle(micro, gas, world, cfg):
    """Unsharded single-process global norm of the first step's averaged gradient.

    One fresh model copy per simulated rank (each rank's static activation ranges start from its
    own first batch), gradients summed with the engine's 1/(world·accumulation) weighting."""
    total = None
    for r in range(world):
        model = make_model(cfg)
        for m in range(gas):
            x, y = micro_batch(0, m, r, world, micro, gas)
            (F.cross_entropy(model(x), y) / (world * gas)).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        total = g if total is None else total + g
    return total.norm().item()


def onebit_cfg(stage):
    cfg = make_cfg(stage, 4, 2, 2)
    cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}}
    cfg["gradient_clipping"] = 0.0
    return cfg


def run_onebit(rank, world, ckpt_root):
    """1-bit Adam under stage 0 (warmup 2 steps, then compressed) and stage 1, with resume."""
    out = {"s0": run_with_resume(rank, world, onebit_cfg(0), os.path.join(ckpt_root, "onebit0"), 4, 2)}
    out["s1"] = run_with_resume(rank, world, onebit_cfg(1), os.path.join(ckpt_root, "onebit1"), 4, 2)
    # 0/1 Adam and 1-bit LAMB cannot shard their state: stage 1 must be a ConfigError saying why
    out["refused"] = {}
    for kind in ("ZeroOneAdam", "OneBitLamb"):
        cfg = onebit_cfg(1)
        cfg["optimizer"] = {"type": kind, "params": {"lr": 0.01}}
        try:
            initialize(make_model(cfg), cfg)
            out["refused"][kind] = None
        except qc.ConfigError as e:
            out["refused"][kind] = str(e)
    return out


CLIP = {"max_norm": 0.05, "lr": 0.5, "steps": 2}


def plain_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def clip_cfg(stage, world):
    """Plain SGD, no schedule, no compression: the update is -lr × the clipped gradient, so
    whether clipping scaled the gradients shows in the parameters."""
    cfg = make_cfg(
        stage, 4, 2, world, gradient_clipping=CLIP["max_norm"], optimizer={"type": "SGD", "params": {"lr": CLIP["lr"]}}
    )
    del cfg["scheduler"], cfg["compression_training"]
    return cfg


def run_clipping(rank, world):
    """Parameters after each of CLIP["steps"] clipped SGD steps, per stage."""
    out = {}
    for stage in (0, 1, 2, 3):
        engine = initialize(plain_model(), clip_cfg(stage, world))
        out[stage] = []
        for step in range(CLIP["steps"]):
            train_steps(engine, step, step + 1, world, 4, 2, rank)
            out[stage].append(full_params(engine))
    return out


def clipped_sgd_oracle(world):
    """Single-process reference for run_clipping: the averaged gradient of the global batch,
    torch.nn.utils.clip_grad_norm_, then p -= lr·g. Returns (params per step, norms per step)."""
    model = plain_model()
    params, norms = [], []
    for step in range(CLIP["steps"]):
        model.zero_grad()
        for r in range(world):
            for m in range(2):
                x, y = micro_batch(step, m, r, world, 4, 2)
                (F.cross_entropy(model(x), y) / (world * 2)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP["max_norm"]).item())
        with torch.no_grad():
            for p in model.parameters():
                p -= CLIP["lr"] * p.grad
        params.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return params, norms


_COUNTED = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_single",
    "all_gather_into_tensor",
    "broadcast",
    "all_to_all_single",
)


class CollectiveCounter:
    """Counts torch.distributed collectives issued from Python (FSDP2's and our DDP hook's)."""

    def __init__(self):
        self.counts = {}
        self._orig = {}

    def __enter__(self):
        for name in _COUNTED:
            if hasattr(dist, name):
                orig = getattr(dist, name)
                self._orig[name] = orig

                def wrapped(*a, _orig=orig, _name=name, **k):
                    self.counts[_name] = self.counts.get(_name, 0) + 1
                    return _orig(*a, **k)

                setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)

    def take(self):
        out, self.counts = self.counts, {}
        return out


def run_comm_checks(rank, world):
    """Collectives per micro-step (accumulation 2) and fp16/bf16 gradient communication."""
    out = {"micro": {}, "dtype": {}}
    for stage in (0, 1, 2, 3):
        # wall_clock_breakdown routes DDP's all-reduce through our Python hook, so it is counted.
        cfg = make_cfg(stage, 4, 2, world, wall_clock_breakdown=True, static_ranges=False)
        engine = initialize(make_model(cfg), cfg)
        train_steps(engine, 0, 1, world, 4, 2, rank)  # buckets and state settle
        per_micro = []
        with CollectiveCounter() as cc:
            for m in range(2):
                x, y = micro_batch(1, m, rank, world, 4, 2)
                loss = F.cross_entropy(engine(x), y)
                fwd = cc.take()
                engine.backward(loss)
                bwd = cc.take()
                engine.step()
                per_micro.append({"forward": fwd, "backward": bwd, "step": cc.take()})
        out["micro"][stage] = per_micro
        out.setdefault("timings", {})[stage] = dict(engine.last_timings)
    for stage in (0, 3):  # odd row counts: FSDP2's uneven shards, weights rewritten at step time
        cfg = make_cfg(stage, 4, 2, world)
        torch.manual_seed(3)
        model = qc.init_compression(
            nn.Sequential(
                nn.Linear(IN, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1), nn.ReLU(), nn.Linear(1, OUT)
            ),
            qc.load_config(cfg),
        )
        engine = initialize(model, cfg)
        losses, _ = train_steps(engine, 0, 3, world, 4, 2, rank)
        out.setdefault("odd", {})[stage] = (losses, full_params(engine))
    for stage in (0, 2):  # buffers of two dtypes (BatchNorm): synced from rank 0 at each step
        cfg = make_cfg(stage, 4, 2, world)
        torch.manual_seed(0)
        model = qc.init_compression(
            nn.Sequential(nn.Linear(IN, HID), nn.BatchNorm1d(HID), nn.ReLU(), nn.Linear(HID, OUT)), qc.load_config(cfg)
        )
        engine = initialize(model, cfg)
        train_steps(engine, 0, 3, world, 4, 2, rank)
        out.setdefault("bn", {})[stage] = {
            k: v.clone() for k, v in engine.module.state_dict().items() if "running" in k or "num_batches" in k
        }
    for stage in (0, 3):  # ranks built from different seeds start from rank 0's model
        cfg = make_cfg(stage, 4, 2, world)
        engine = initialize(make_model(cfg, seed=11 + rank), cfg)
        train_steps(engine, 0, 2, world, 4, 2, rank)
        out.setdefault("seeded", {})[stage] = full_params(engine)
    out["bucket_bytes"] = {}
    for dtype in ("fp32", "fp16"):  # reduce_bucket_size counts elements, whatever is sent
        cfg = make_cfg(0, 4, 2, world, communication_data_type=dtype)
        cfg["zero_optimization"]["reduce_bucket_size"] = 1000
        out["bucket_bytes"][dtype] = initialize(make_model(cfg), cfg).wrapped.bucket_bytes_cap
    for stage in (0, 2):
        finals = {}
        for dtype in ("fp32", "bf16", "fp16"):
            cfg = make_cfg(stage, 4, 2, world, communication_data_type=dtype, static_ranges=False)
            engine = initialize(make_model(cfg), cfg)
            train_steps(engine, 0, 3, world, 4, 2, rank)
            finals[dtype] = full_params(engine)
        out["dtype"][stage] = finals
    return out


def run_int8_forward(rank, world):
    """W8A8 with weights quantized in forward and per-token activations, int8_forward on and off,
    at stage 0 and stage 3 (FSDP2): losses, final parameters and how many forwards ran on the
    int8 kernel."""
    from qcompress.quant import lowbit

    calls = [0]
    real = lowbit.linear_a8

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    lowbit.linear_a8 = counted
    out = {}
    try:
        for int8 in (False, True):
            for stage in (0, 3):
                cfg = make_cfg(stage, 4, 2, world, static_ranges=False)
                wq = cfg["compression_training"]["weight_quantization"]
                wq["shared_parameters"]["quantize_weight_in_forward"] = True
                wq["different_groups"]["wq"]["params"].update(start_bits=8, target_bits=8)
                cfg["compression_training"]["activation_quantization"]["shared_parameters"]["int8_forward"] = int8
                calls[0] = 0
                engine = initialize(make_model(cfg), cfg)
                losses, _ = train_steps(engine, 0, STEPS, world, 4, 2, rank)
                out[(int8, stage)] = {"losses": losses, "final": full_params(engine), "int8_calls": calls[0]}
    finally:
        lowbit.linear_a8 = real
    return out


def tied_cfg(stage, compress):
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if compress:  # weights written at optimizer-step time: the engine gathers the tied weight whole
        cfg["compression_training"] = {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": False},
                "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8}}},
            }
        }
    return cfg


def tied_batch(step, rank, micro, world):
    """Rank r's slice of the step's global batch of token ids (GPT-2 of tiny_models: vocab 96)."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, 96, (micro * world, 12), generator=g)
    return x[rank * micro : (rank + 1) * micro]


def run_tied(rank, world, steps=1):
    """GPT-2 with its tied lm_head / wte at every stage (FSDP2 needs them in one group)."""
    from tests.helpers.tiny_models import make_gpt2

    out = {}
    for compress in (False, True):
        for stage in (0, 2, 3):
            cfg = tied_cfg(stage, compress)
            model = make_gpt2()
            if compress:
                qc.init_compression(model, qc.load_config(cfg))
            engine = initialize(model.train(), cfg)
            micro = engine.train_micro_batch_size_per_gpu
            for step in range(steps):
                x = tied_batch(step, rank, micro, world)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            params = full_params(engine)
            out[(compress, stage)] = {
                "final": params,
                "tied": engine.module.lm_head.weight is engine.module.transformer.wte.weight,
            }
    return out


class WithUnused(nn.Module):
    """A model whose `spare` Linear never takes part in the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN, OUT)
        self.spare = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.body(x)


def run_unused(rank, world):
    """Stages 0/1 (DDP) with a parameter the loss does not use: the step is refused, naming it."""
    out = {}
    for stage in (0, 1):
        cfg = {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
        }
        model = WithUnused()
        engine = initialize(model, cfg)
        before = full_params(engine)
        x, y = micro_batch(0, 0, rank, world, 4, 1)
        engine.backward(F.cross_entropy(engine(x), y))
        try:
            engine.step()
            out[stage] = None
        except RuntimeError as e:
            out[stage] = str(e)
        out[f"untouched{stage}"] = all(torch.equal(before[k], v) for k, v in full_params(engine).items())
        frozen = WithUnused()
        frozen.spare.requires_grad_(False)  # the advice in the message: then it trains
        engine = initialize(frozen, cfg)
        for step in range(2):
            x, y = micro_batch(step, 0, rank, world, 4, 1)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        out[f"frozen{stage}"] = full_params(engine)["body.weight"]
    return out


def run_channel_prune(rank, world, path):
    """DeepSpeed's CIFAR channel-pruning config at stages 0 and 3: the BatchNorm after each pruned
    conv masks its output from the conv's topk scores, which stage 3 had resharded by then."""
    import json
    from tests.helpers.tiny_models import TinyResNet

    out = {}
    for stage in (0, 3):
        raw = json.load(open(path))
        raw.update(train_batch_size=4, train_micro_batch_size_per_gpu=2, zero_optimization={"stage": stage})
        raw.pop("gradient_accumulation_steps", None)
        cfg = qc.load_config(raw)
        torch.manual_seed(0)
        model = qc.init_compression(TinyResNet().train(), cfg)
        engine = initialize(model, cfg)
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(2, 3, 8, 8, generator=g), torch.tensor([1, 7])
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        out[stage] = {"final": full_params(engine), "applied": engine.global_steps - engine.skipped_steps}
    return out


SCHEDULED = {  # Parameters that join the graph at step 2: topk row scores, learned input ranges
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 2, "method": "topk"},
        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"]}},
    },
    "activation_quantization": {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 2,
            "range_calibration": "static",
            "range_learning": True,
        },
        "different_groups": {"aq": {"params": {"bits": 8}}},
    },
}


def run_scheduled_params(rank, world):
    """Stage 0 (DDP) and stage 3 on a model whose compression Parameters are unused before step 2."""
    out = {}
    for stage in (0, 3):
        cfg = {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "compression_training": SCHEDULED,
        }
        model = plain_model()
        qc.init_compression(model, qc.load_config(cfg))
        engine = initialize(model, cfg)
        train_steps(engine, 0, 4, world, 4, 1, rank)
        out[stage] = full_params(engine)
    return out
