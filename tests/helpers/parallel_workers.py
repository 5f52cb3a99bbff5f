"""Rank functions of the tensor-parallel tests (tests/parallel/): importable by spawned ranks.

Each one builds the same model on every rank from one seed, runs it once unsplit (the oracle:
the single-process numbers) and once split by qcompress.parallel, and returns what the test
compares: gathered codes, outputs, losses and gradients.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import qcompress as qc


def compression(bits=8, granularity="channel", group_size=None, symmetric=True, act=None):
    """A compression_training section: weights in forward at `bits`, inputs at 8 bits (`act`:
    None, "dynamic" or "static")."""
    params = {"start_bits": bits, "target_bits": bits, "quantization_period": 1, "granularity": granularity}
    if group_size:
        params["group_size"] = group_size
    out = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantize_weight_in_forward": True,
                "quantization_type": "symmetric" if symmetric else "asymmetric",
            },
            "different_groups": {"wq": {"params": params, "modules": ["proj", "fc"]}},
        }
    }
    if act:
        out["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "range_calibration": act,
                "quantization_type": "symmetric" if symmetric else "asymmetric",
            },
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["proj", "fc"]}},
        }
    return out


def tiny_llama(seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).float()


class MLP(nn.Module):
    def __init__(self, seed=0, d=64, h=128):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


MLP_PLAN = {"tensor_parallel": {"autotp_size": 2, "tp_plan": {r"fc1$": "colwise", r"fc2$": "rowwise"}}}


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _codes_dim(style, spec, which):
    """The dim along which the shards of q (which=0) or of the scale / zero point (1) concatenate;
    None when every rank holds the whole tensor."""
    if which == 0:
        return 0 if style == "colwise" else 1
    if spec.granularity == "tensor":
        return None
    if style == "colwise":
        return 0
    return 1 if spec.granularity == "group" else None


def gathered_codes(mod, style):
    from qcompress.nn.sharded import weight_codes

    spec = mod.qc_wq.spec()
    out = []
    for i, t in enumerate(weight_codes(mod, spec)):
        if t is None:
            out.append(None)
            continue
        dim = _codes_dim(style, spec, 0 if i == 0 else 1)
        out.append(t if dim is None else _gather(t, dim))
    return out


def codes_match(rank, world, cases):
    """For each (name, compression kwargs): the MLP split colwise / rowwise over the ranks. Returns
    {name: (codes equal, fake-quantized weights equal, max |output diff|)} against the unsplit model."""
    from qcompress.parallel import apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, kw in cases:
        cfg = qc.load_config(dict(MLP_PLAN, compression_training=compression(**kw)))
        ref = qc.init_compression(MLP(), cfg)
        tp = copy.deepcopy(ref)
        qc.CompressionScheduler(ref, cfg)
        qc.CompressionScheduler(tp, cfg)
        apply_tensor_parallel(tp, mesh, cfg.tensor_parallel)
        torch.manual_seed(1)
        x = torch.randn(3, 5, 64)
        ok_codes, ok_w = True, True
        for mname, style in (("fc1", "colwise"), ("fc2", "rowwise")):
            want = ref.get_submodule(mname).quantized_weight()[:3]
            got = gathered_codes(tp.get_submodule(mname), style)
            for w, g in zip(want, got):
                if w is None or g is None:
                    ok_codes &= w is None and g is None
                else:
                    ok_codes &= torch.equal(w, g.reshape(w.shape))
            ok_w &= torch.equal(
                ref.get_submodule(mname).effective_weight().detach(),
                tp.get_submodule(mname).effective_weight().full_tensor().detach(),
            )
        ref.train(), tp.train()
        for _ in range(2):  # twice: static ranges fold a second batch into their EMA
            y_ref, y_tp = ref(x), tp(x)
        results[name] = (ok_codes, ok_w, float((y_ref - y_tp).detach().abs().max()))
    return results


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def llama_step(rank, world, comp):
    """One forward / backward of a tiny Llama, split by its own base_model_tp_plan, against the
    unsplit model: (loss, reference loss, max relative gradient error, names compared)."""
    from qcompress.parallel import apply_tensor_parallel
    from qcompress.config.parallel import TensorParallel
    from torch.distributed.device_mesh import init_device_mesh

    cfg = qc.load_config({"compression_training": comp})
    ref = qc.init_compression(tiny_llama(), cfg)
    tp = copy.deepcopy(ref)
    qc.CompressionScheduler(ref, cfg)
    qc.CompressionScheduler(tp, cfg)
    apply_tensor_parallel(tp, init_device_mesh("cpu", (world,)), TensorParallel(autotp_size=world))
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2, 12))
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    loss = tp(input_ids=ids, labels=ids).loss
    loss.backward()
    g_ref, g_tp = _grads(ref), _grads(tp)
    worst = max(float((g_tp[n] - g_ref[n]).norm() / g_ref[n].norm().clamp(min=1e-30)) for n in g_ref)
    return float(loss.detach()), float(loss_ref.detach()), worst, sorted(g_ref) == sorted(g_tp)


def engine_train_batch(rank, world, tp_size, gas, steps=3, pp=1):
    """qcompress.initialize on all ranks with tensor_parallel.autotp_size = tp_size; `steps`
    train_batch calls on a tiny Llama. Each data-parallel replica reads its own share of one global
    micro-batch stream (micro-batch i to replica i % replicas), so runs whose replicas x gas agree
    take the same samples in every step. `pp` pipeline stages: each rank returns its stage's
    weights (named as in the unsplit model). Returns (losses, data_parallel_rank,
    data_parallel_world_size, full weights)."""
    comp = compression(bits=8, granularity="channel", act="dynamic")
    doc = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "tensor_parallel": {"autotp_size": tp_size},
        "pipeline": {"stages": pp},
        "compression_training": comp,
    }
    model = qc.init_compression(tiny_llama(), qc.load_config(doc))
    engine = qc.initialize(model, doc)
    dp_rank, dp_world = engine.data_parallel_rank, engine.data_parallel_world_size
    micro = engine.train_micro_batch_size_per_gpu
    # DeepSpeed's meaning: micro-batch x accumulation x data-parallel replicas (not x world)
    assert engine.train_batch_size == micro * gas * dp_world, engine.train_batch_size
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 64, (steps * gas * micro * dp_world, 12), generator=g)

    def batches():
        # micro-batch i of the global stream goes to replica i % dp_world
        for i in range(dp_rank, data.shape[0] // micro, dp_world):
            ids = data[i * micro : (i + 1) * micro]
            yield {"input_ids": ids, "labels": ids}

    it = batches()
    losses = [float(engine.train_batch(it)) for _ in range(steps)]
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    return losses, dp_rank, dp_world, weights


def export_matches(rank, world, folder):
    """Train 2 steps at TP = world, export from every rank (rank 0 writes), then on rank 0 load
    the gathered trained weights into an unsplit model and export that: {tensor name: equal}."""
    import os
    from safetensors.torch import load_file

    comp = compression(bits=4, granularity="group", group_size=16, symmetric=False, act="dynamic")
    doc = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "tensor_parallel": {"autotp_size": world},
        "compression_training": comp,
    }
    engine = qc.initialize(qc.init_compression(tiny_llama(), qc.load_config(doc)), doc)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    it = iter([{"input_ids": ids, "labels": ids}] * 2)
    engine.train_batch(it), engine.train_batch(it)
    whole = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    split_dir = os.path.join(folder, "split")
    qc.export_quantized(engine, split_dir)
    if rank != 0:
        return None
    single = qc.init_compression(tiny_llama(seed=1), qc.load_config(doc))
    single.load_state_dict(whole, strict=False)
    qc.CompressionScheduler(single, qc.load_config(doc))
    qc.export_quantized(single, os.path.join(folder, "single"))
    a = load_file(os.path.join(split_dir, "model.safetensors"))
    b = load_file(os.path.join(folder, "single", "model.safetensors"))
    return {k: (k in a and torch.equal(a[k], b[k])) for k in b} | {k: False for k in a if k not in b}


def resume_matches(rank, world, folder, pp=1):
    """Train 2 steps at TP (or PP), save a checkpoint, train a third; a fresh engine loads the
    checkpoint and trains the third step again. Returns (third loss, third loss after resume)."""
    comp = compression(bits=8, granularity="channel", act="dynamic")
    doc = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "tensor_parallel": {"autotp_size": world // pp},
        "pipeline": {"stages": pp},
        "compression_training": comp,
    }
    ids = torch.randint(0, 64, (12, 12), generator=torch.Generator().manual_seed(5))
    batches = [{"input_ids": ids[i : i + 2], "labels": ids[i : i + 2]} for i in range(0, 12, 2)]
    engine = qc.initialize(qc.init_compression(tiny_llama(), qc.load_config(doc)), doc)
    it = iter(batches)
    engine.train_batch(it), engine.train_batch(it)
    engine.save_checkpoint(folder)
    third = float(engine.train_batch(it))
    again = qc.initialize(qc.init_compression(tiny_llama(seed=2), qc.load_config(doc)), doc)
    again.load_checkpoint(folder)
    return third, float(again.train_batch(iter(batches[4:])))
