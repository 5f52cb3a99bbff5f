"""Pipeline parallelism on torch.distributed.pipelining for transformers decoder LMs.

Each rank keeps the blocks of its stage (by layer, `pipeline.partition`) and drops the rest of
the model: the embeddings stay on the first stage, the final norm and lm_head on the last.
Compression state stays with the modules, so each stage carries its own (ranges, schedules,
masks); the engine steps the optimizer and the compression scheduler once per optimizer step
on every stage. Loss: the model's own loss_function, on the last stage, micro-batch by
micro-batch, gradients averaged over the micro-batches (scale_grads), as gradient accumulation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError


def split_blocks(sizes: List[int], stages: int, partition: str) -> List[Tuple[int, int]]:
    """[start, end) block ranges, one per stage: `uniform` counts blocks, `parameters` (and
    DeepSpeed's `best`) balances the blocks' parameter counts; every stage gets one block or more."""
    n = len(sizes)
    if stages > n:
        raise ConfigError(
            "pipeline.stages",
            f"{stages} stages but the model has {n} transformer blocks; each stage needs at least one",
        )
    if partition == "uniform":
        bounds = [round(i * n / stages) for i in range(stages + 1)]
    else:
        total, bounds, acc = sum(sizes), [0], 0
        for i, s in enumerate(sizes):
            acc += s
            left = stages - len(bounds)  # boundaries still to place after this block
            if left > 0 and (acc >= total * len(bounds) / stages or n - (i + 1) == left):
                bounds.append(i + 1)
        bounds.append(n)
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


def _decoder_parts(model: nn.Module):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or getattr(model, "lm_head", None) is None:
        raise ConfigError(
            "pipeline.stages",
            f"{type(model).__name__}: pipeline stages split transformers "
            "decoder LMs (model.model.layers and lm_head, e.g. Llama, Qwen, Mistral)",
        )
    return base, layers


class _StageBlocks(nn.ModuleList):
    """A stage's blocks under their indices in the whole model, so checkpoints and exports name
    them as the unsplit model does (stages' names never collide); iterates the blocks in order."""

    def __init__(self, blocks=None):
        nn.Module.__init__(self)
        items = blocks.items() if isinstance(blocks, dict) else enumerate(blocks or ())
        for i, block in items:
            self.add_module(str(i), block)


class _Stage(nn.Module):
    """The stage's forward: token ids (first stage) or hidden states in; hidden states or logits out."""

    def __init__(self, model: nn.Module, first: bool, last: bool, dtype: torch.dtype):
        super().__init__()
        self.lm = model
        self.first, self.last, self.dtype = first, last, dtype

    def forward(self, x):
        base = self.lm.model
        h = (
            base(input_ids=x, use_cache=False) if self.first else base(inputs_embeds=x, use_cache=False)
        ).last_hidden_state
        # under autocast (bf16 / fp16) too, stages exchange the dtype they were told of
        return (self.lm.lm_head(h) if self.last else h).to(self.dtype)


def _refuse_whole_forward(module, args, kwargs):
    """Forward pre-hook on the split model: the stages call its parts, never its own forward."""
    raise RuntimeError(
        "with pipeline.stages > 1 the model runs in stages: call engine.train_batch(data_iter) "
        "(engine(x) / backward / step run the whole model on one rank)"
    )


def dropped_parts(model: nn.Module, layers, lo: int, hi: int, first: bool, last: bool) -> dict:
    """The parts this stage drops, moved to the meta device (no memory): their structure and
    compression settings let an export rebuild the whole model from the stages' tensors
    (parallel/stage_export.py). A part sharing a Parameter with a kept one stays as it is."""
    parts = {f"model.layers.{i}": layers[i] for i in range(len(layers)) if not lo <= i < hi}
    if not first:
        parts["model.embed_tokens"] = model.model.embed_tokens
    if not last:
        parts["model.norm"], parts["lm_head"] = model.model.norm, model.lm_head
    kept = {
        id(p)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not any(n.startswith(k + ".") for k in parts)
    }
    for part in parts.values():
        if not any(id(p) in kept for p in part.parameters()):
            part.to("meta")
    return parts


@dataclass
class Pipeline:
    module: nn.Module  # this rank's stage (_Stage)
    make_schedule: object  # (micro-batch, sequence length) -> schedule, see build_pipeline
    index: int
    stages: int
    blocks: Tuple[int, int]
    group: object
    schedules: dict = None
    skeleton: dict = None  # the other stages' parts on the meta device: {name in model: module}
    loss_scale: float = 1.0  # fp16: the loss is multiplied by it before the backward (run_pipeline)

    def schedule_for(self, micro: int, seq: int):
        """The schedule for micro-batches of this shape (built on first use: stages are told their
        shapes, so torch does not infer them by running a stage on uninitialised memory)."""
        if self.schedules is None:
            self.schedules = {}
        if (micro, seq) not in self.schedules:
            self.schedules[(micro, seq)] = self.make_schedule(micro, seq)
        return self.schedules[(micro, seq)]

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def is_first(self) -> bool:
        return self.index == 0


def build_pipeline(model: nn.Module, pmesh, pipeline_cfg, micro_batches: int, device) -> Pipeline:
    """Keep this rank's stage of `model` (in place) and the schedule that runs it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages = pipeline_cfg.stages
    if pipeline_cfg.schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"{micro_batches} micro-batches per step for {stages} "
            "1F1B pipeline stages: use at least as many micro-batches as stages",
        )
    base, layers = _decoder_parts(model)
    sizes = [sum(p.numel() for p in block.parameters()) for block in layers]
    index = pmesh.mesh["pp"].get_local_rank()
    lo, hi = split_blocks(sizes, stages, pipeline_cfg.partition)[index]
    first, last = index == 0, index == stages - 1
    skeleton = dropped_parts(model, layers, lo, hi, first, last)
    base.layers = _StageBlocks({i: layers[i] for i in range(lo, hi)})
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        model.lm_head = None
    group = pmesh.mesh["pp"].get_group()
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    module = _Stage(model, first, last, dtype)

    def loss_fn(logits, labels):
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab) * pipe.loss_scale

    kind = Schedule1F1B if pipeline_cfg.schedule == "1f1b" else ScheduleGPipe

    def make_schedule(micro: int, seq: int):
        meta = dict(device="meta")
        x = (
            torch.empty(micro, seq, dtype=torch.long, **meta)
            if first
            else torch.empty(micro, seq, hidden, dtype=dtype, requires_grad=True, **meta)
        )  # grads flow back
        y = torch.empty(micro, seq, vocab if last else hidden, dtype=dtype, requires_grad=True, **meta)
        stage = PipelineStage(module, index, stages, device, input_args=(x,), output_args=(y,), group=group)
        # every stage gets loss_fn: without one a schedule runs forward only (the last calls it)
        return kind(stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    model.register_forward_pre_hook(_refuse_whole_forward, with_kwargs=True)
    pipe = Pipeline(module, make_schedule, index, stages, (lo, hi), group, skeleton=skeleton)
    return pipe


def run_pipeline(engine, batches: List[dict]) -> Optional[torch.Tensor]:
    """Forward and backward of the micro-batches through the stages; the mean loss on the last
    stage, None elsewhere. The engine then takes its optimizer step."""
    pipe = engine.pipeline
    for i, b in enumerate(batches):
        extra = sorted(set(b) - {"input_ids", "labels"})
        if extra:
            raise ValueError(
                f"train_batch with pipeline stages: micro-batch {i} has {extra}; the stages "
                "pass token ids and labels only"
            )
    ids = torch.cat([b["input_ids"] for b in batches]).to(engine.device)
    labels = torch.cat([b["labels"] for b in batches]).to(engine.device)
    losses: List[torch.Tensor] = []
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(
            f"train_batch with pipeline stages: the micro-batches' input_ids must share one "
            f"[batch, sequence] shape, got {sorted(shapes)}"
        )
    schedule = pipe.schedule_for(*next(iter(shapes)))
    pipe.loss_scale = engine.loss_scale
    with (
        torch.autocast(engine.device.type, dtype=engine._autocast)
        if engine._autocast is not None
        else contextlib.nullcontext()
    ):  # the precision engine(x) runs under
        if pipe.is_first:
            schedule.step(ids, target=labels if pipe.is_last else None, losses=losses)
        elif pipe.is_last:
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
    if not pipe.is_last:
        return None
    return torch.stack([l.detach().float() for l in losses]).mean() / pipe.loss_scale
