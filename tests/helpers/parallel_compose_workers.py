"""Rank functions of the data-parallel composition tests (tests/parallel/test_dp_compose.py).

Each builds a qcompress engine on a (pp, dp, tp) mesh over the spawned ranks, runs train_batch
on its replica's share of one global batch stream and returns what the test compares against
one process fed the whole global batch: the loss, the gradient the optimizer stepped with
(whole tensors, named as in the unsplit model) and the weights after the step.
"""

from __future__ import annotations

import torch

import qcompress as qc
from tests.helpers.parallel_workers import compression, tiny_llama
from qcompress.comm import Compressor, register_compressor

MICRO, SEQ = 2, 12


def config(tp=1, pp=1, gas=2, optimizer=None, **extra):
    """The composition tests' config: W8 channel weights and dynamic 8-bit inputs in forward."""
    doc = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer or {"type": "SGD", "params": {"lr": 0.5}},
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pp},
        "compression_training": compression(bits=8, granularity="channel", act="dynamic"),
    }
    doc.update(extra)
    return doc


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def global_stream(steps: int, micro_batches: int, seed: int = 7):
    """The global stream of micro-batches (token ids, labels the same) all runs draw from."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (steps * micro_batches * MICRO, SEQ), generator=g)


def replica_batches(data: torch.Tensor, dp_rank: int, dp_world: int):
    """Micro-batch i of the global stream goes to replica i % dp_world (so a run of dp x gas
    micro-batches per step takes the same samples as one process at dp x gas)."""
    for i in range(dp_rank, data.shape[0] // MICRO, dp_world):
        ids = data[i * MICRO : (i + 1) * MICRO]
        yield {"input_ids": ids, "labels": ids}


def train(doc, steps: int = 1, seed: int = 7):
    """initialize on the current ranks (or one process) and run `steps` train_batch calls.
    Returns (losses, gradients of the last step, weights after it, grad norms, (dp rank, dp size))."""
    if (doc.get("optimizer") or {}).get("params", {}).get("compressor") == ElementwiseFp16.name:
        # registered only where it is used: the pytest process's registry stays the library's
        register_compressor(ElementwiseFp16.name, ElementwiseFp16)
    engine = qc.initialize(qc.init_compression(tiny_llama(), qc.load_config(doc)), doc)
    grads = {}

    def keep_grads(opt, args, kwargs):
        # the gradient the optimizer steps with: averaged over replicas and micro-batches, clipped
        grads.clear()
        grads.update({n: _whole(p.grad) for n, p in engine.module.named_parameters() if p.grad is not None})

    opt = getattr(engine.optimizer, "optim", engine.optimizer)
    opt.register_step_pre_hook(keep_grads)
    dp_rank, dp_world = engine.data_parallel_rank, engine.data_parallel_world_size
    micro_batches = engine.gradient_accumulation_steps * dp_world
    it = replica_batches(global_stream(steps, micro_batches, seed), dp_rank, dp_world)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(it)))
        norms.append(engine.get_global_grad_norm())
    weights = {n: _whole(p) for n, p in engine.module.named_parameters()}
    return losses, grads, weights, norms, (dp_rank, dp_world)


def single(doc, dp: int, steps: int = 1, seed: int = 7):
    """The oracle: one process, gradient_accumulation_steps x dp micro-batches per step (the
    same global batch), no tensor / pipeline split."""
    one = dict(
        doc,
        gradient_accumulation_steps=doc["gradient_accumulation_steps"] * dp,
        tensor_parallel={"autotp_size": 1},
        pipeline={"stages": 1},
    )
    return train(one, steps, seed)


def meshes(rank, world, cases, steps=1):
    """train(config(**kw), steps) for each case on these ranks: {name: result}."""
    return {name: train(config(**kw), steps) for name, kw in cases}


def _poison_backward(module, args, out):
    """Forward hook: the gradient flowing back into this module's output becomes inf."""
    out.register_hook(lambda g: torch.full_like(g, float("inf")))


def overflow_agreed(doc):
    """An fp16 overflow on rank 0 only (its first block's backward turns inf): every rank must
    skip the step. Returns (skipped_steps, loss scale after, weights unchanged, steps taken)."""
    engine = qc.initialize(qc.init_compression(tiny_llama(), qc.load_config(doc)), doc)
    before = {n: _whole(p) for n, p in engine.module.named_parameters()}
    if torch.distributed.get_rank() == 0:
        engine.module.get_submodule("model.layers.0.mlp").register_forward_hook(_poison_backward)
    dp_rank, dp_world = engine.data_parallel_rank, engine.data_parallel_world_size
    data = global_stream(1, engine.gradient_accumulation_steps * dp_world)
    engine.train_batch(replica_batches(data, dp_rank, dp_world))
    after = {n: _whole(p) for n, p in engine.module.named_parameters()}
    same = all(torch.equal(before[n], after[n]) for n in before)
    return engine.skipped_steps, engine.loss_scale, same, engine.global_steps


def clip_and_fp16(rank, world, cases, overflow_doc):
    """meshes(cases) and overflow_agreed(overflow_doc) in one spawn of the ranks."""
    return meshes(rank, world, cases), overflow_agreed(overflow_doc)


class ElementwiseFp16(Compressor):
    """A compressor whose result for each element depends on that element alone (fp16 rounding
    with error feedback): a tensor-parallel shard compressed on its own then gives exactly what
    the whole tensor does, so a TP run can be compared with an unsplit one. 1-bit scales span a
    whole tensor (a shard has its own), so the real 1-bit compressor cannot be compared so."""

    name = "elementwise-fp16"

    def payload_nbytes(self, numel):
        return 2 * numel

    def compress(self, x, error, chunks):
        y = x.reshape(-1).to(torch.float32) + error.reshape(-1).to(torch.float32)
        h = y.to(torch.float16)
        return h.reshape(chunks, -1).contiguous().view(torch.uint8), y - h.to(torch.float32)

    def decompress(self, payload, numel):
        return payload[:, : 2 * numel].contiguous().view(torch.float16).to(torch.float32)
