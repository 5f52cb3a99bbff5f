"""Rank code for tests/engine/test_checkpoint_compat.py: checkpoints written by an earlier engine
(committed under tests/fixtures/engine_checkpoints/) must keep loading, and a checkpoint written
now must keep their layout.

One case per way the engine places a model on its ranks. `write` runs a case and stores the
checkpoint plus what the saving engine held (at the save, and two optimizer steps after it);
the fixtures were made by running it with the engine as it was before its placements became
classes (`python -m tests.helpers.checkpoint_compat_workers OUT_DIR`, tests/fixtures/engine_checkpoints/
README.md says how). `check` runs the same case with the current engine: a fresh run to the save
point must hold the same state bit for bit and save the same layout, and a fresh engine that loads
the stored checkpoint must continue exactly as the saving engine did.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompress as qc

SAVE_AT, AFTER = 3, 2  # optimizer steps before the save, and after it
MICRO, GAS = 4, 2
IN, HID, OUT = 8, 16, 4

_W8 = {
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

_LLAMA_W4 = {
    "weight_quantization": {
        "shared_parameters": {
            "enabled": True,
            "schedule_offset": 0,
            "quantize_weight_in_forward": True,
            "quantization_type": "asymmetric",
        },
        "different_groups": {
            "wq": {
                "params": {
                    "start_bits": 4,
                    "target_bits": 4,
                    "quantization_period": 1,
                    "granularity": "group",
                    "group_size": 8,
                },
                "modules": ["proj"],
            }
        },
    },
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["proj"]}},
    },
}


def _mlp_doc(world, stage=0, optimizer=None):
    return {
        "train_batch_size": MICRO * GAS * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 3},
        },
        "zero_optimization": {"stage": stage},
        "compression_training": _W8,
    }


def _llama_doc(tp=1, pp=1, optimizer=None):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp},
        "compression_training": _LLAMA_W4,
    }


_ONEBIT = {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}}

# name -> (world size, model kind, config)
CASES = {
    "single": (1, "mlp", _mlp_doc(1)),
    "ddp": (2, "mlp", _mlp_doc(2, stage=0)),
    "zero1": (2, "mlp", _mlp_doc(2, stage=1)),
    "fsdp3": (2, "mlp", _mlp_doc(2, stage=3)),
    "onebit_ddp": (2, "mlp", _mlp_doc(2, stage=1, optimizer=_ONEBIT)),
    "tp2": (2, "llama", _llama_doc(tp=2)),
    "pp2_zero1": (2, "llama", dict(_llama_doc(pp=2), zero_optimization={"stage": 1})),
    "onebit_pp2": (2, "llama", _llama_doc(pp=2, optimizer=_ONEBIT)),
}


def _model(kind, doc, seed=0):
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=16,
                attn_implementation="eager",
            )
        ).float()
    return qc.init_compression(model, qc.load_config(doc))


def _steps(engine, kind, first, last):
    """Optimizer steps first..last-1 on data fixed by (step, data-parallel replica); returns the
    losses."""
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + engine.data_parallel_rank)
        if kind == "llama":
            ids = torch.randint(0, 32, (GAS, 2, 10), generator=g)
            it = iter({"input_ids": b, "labels": b} for b in ids)
            losses.append(float(engine.train_batch(it)))
            continue
        for _ in range(GAS):
            x, y = torch.randn(MICRO, IN, generator=g), torch.randint(0, OUT, (MICRO,), generator=g)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(engine):
    """What a resume carries, on this rank: whole weights, optimizer state (by parameter-group and
    position), compression state, LR schedule, counters."""
    opt = getattr(engine.optimizer, "optim", engine.optimizer)
    optim = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for k, v in opt.state.get(p, {}).items():
                optim[f"{gi}.{pi}.{k}"] = _whole(v) if torch.is_tensor(v) else v
    model = {n: _whole(t) for n, t in engine.module.state_dict().items()}
    comp = engine.compression_scheduler.state_dict()
    return {"model": model, "optim": optim, "compression": comp, "lr": engine.get_lr(), "counters": engine.counters()}


def digest(state, prefix=""):
    """{dotted key: sha256 of dtype, shape and bytes} for tensors; other leaves as they are (the
    fixtures store digests, so each case's expectations take a few kilobytes)."""
    if torch.is_tensor(state):
        t = state.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {prefix: h.hexdigest()}
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            out.update(digest(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(digest(v, f"{prefix}[{i}]"))
        return out
    return {prefix: state}


def layout(folder):
    """A checkpoint folder's layout: engine.json without the values of training (counters,
    checksums), this rank's JSON keys, and the name, shape and dtype of every stored tensor."""
    import torch.distributed.checkpoint as dcp
    from qcompress.engine.checkpoint import resolve

    path = resolve(folder, None)
    with open(os.path.join(path, "engine.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    meta["files"] = sorted(meta.get("files", {}))
    meta.pop("counters", None)
    md = dcp.FileSystemReader(path).read_metadata()
    tensors = {
        k: [list(v.size), str(v.properties.dtype)] for k, v in md.state_dict_metadata.items() if hasattr(v, "size")
    }
    ranks = {}
    for name in sorted(os.listdir(os.path.join(path, "ranks"))):
        with open(os.path.join(path, "ranks", name), encoding="utf-8") as fh:
            ranks[name] = sorted(dict(json.load(fh)["__dict__"]))
    return {"engine.json": meta, "tensors": tensors, "ranks": ranks}


def write(rank, world, case, folder):
    """The stored fixture: checkpoint at SAVE_AT, snapshots at the save and AFTER steps later."""
    _, kind, doc = CASES[case]
    engine = qc.initialize(_model(kind, doc), doc)
    _steps(engine, kind, 0, SAVE_AT)
    engine.save_checkpoint(os.path.join(folder, "checkpoint"), tag="saved")
    saved = snapshot(engine)
    losses = _steps(engine, kind, SAVE_AT, SAVE_AT + AFTER)
    with open(os.path.join(folder, f"expected_rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump({"saved": digest(saved), "after": digest(snapshot(engine)), "losses": losses}, fh, indent=0)
    if rank == 0:
        with open(os.path.join(folder, "layout.json"), "w", encoding="utf-8") as fh:
            json.dump(layout(os.path.join(folder, "checkpoint")), fh, indent=1, sort_keys=True)


def check(rank, world, case, fixture, scratch):
    """(this engine's snapshot at the save, its layout, the resumed engine's snapshot after AFTER
    steps and losses, the fixture's expectations for this rank)."""
    _, kind, doc = CASES[case]
    engine = qc.initialize(_model(kind, doc), doc)
    _steps(engine, kind, 0, SAVE_AT)
    engine.save_checkpoint(scratch, tag="saved")
    fresh_saved = snapshot(engine)
    fresh_layout = layout(scratch) if rank == 0 else None
    resumed = qc.initialize(_model(kind, doc, seed=7), doc)  # other initial weights
    resumed.load_checkpoint(os.path.join(fixture, "checkpoint"))
    loaded = snapshot(resumed)
    losses = _steps(resumed, kind, SAVE_AT, SAVE_AT + AFTER)
    with open(os.path.join(fixture, f"expected_rank{rank}.json"), encoding="utf-8") as fh:
        expected = json.load(fh)
    return {
        "fresh_saved": digest(fresh_saved),
        "layout": fresh_layout,
        "loaded": digest(loaded),
        "after": digest(snapshot(resumed)),
        "losses": losses,
        "expected": expected,
    }


def check_all(rank, world, cases, fixtures, scratch):
    """check() for each case in `cases` (all on this world size), one process group for all."""
    return {case: check(rank, world, case, os.path.join(fixtures, case), os.path.join(scratch, case)) for case in cases}


if __name__ == "__main__":  # regenerate: python -m tests.helpers.checkpoint_compat_workers OUT_DIR [CASE...]
    from tests.helpers import checkpoint_compat_workers as workers  # by name, so spawned ranks import it
    import qcompress.engine
    from tests.helpers.dist_utils import run_ranks

    print("engine:", qcompress.engine.__file__, flush=True)
    out = sys.argv[1]
    for name in sys.argv[2:] or CASES:
        target = os.path.join(out, name)
        os.makedirs(target, exist_ok=False)
        ranks = CASES[name][0]
        if ranks == 1:
            workers.write(0, 1, name, target)
        else:
            run_ranks(workers.write, ranks, name, target, timeout=600)
        print("wrote", target, flush=True)
