"""engine.train_batch(data_iter): DeepSpeed's pipeline-engine call, for every mesh.

One optimizer step over gradient_accumulation_steps micro-batches, each a dict of the model's
keyword inputs (labels included: the loss is the model's own). Returns the mean loss over the
micro-batches and the data-parallel replicas, the same number on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def model_loss(out) -> torch.Tensor:
    """The loss a model returned: .loss (transformers), ["loss"], the first element, or itself."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    if loss is None and isinstance(out, torch.Tensor):
        loss = out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "train_batch: the model returned no scalar loss; each micro-batch must hold the "
            "model's keyword inputs with `labels` so the model computes its own loss"
        )
    return loss.reshape(())


def _to(batch, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train_batch(engine, data_iter) -> torch.Tensor:
    """See the module docstring; `engine` is a qcompress Engine."""
    if engine._accumulated:
        raise RuntimeError(
            f"train_batch: {engine._accumulated} micro-batches were run with engine.step since "
            "the last optimizer step; finish that step before calling train_batch"
        )
    steps = engine.gradient_accumulation_steps
    batches = [_to(b, engine.device) for b in _draw(data_iter, steps)]
    if engine.pipeline is not None:
        from .pipeline import run_pipeline

        mean = run_pipeline(engine, batches)
        engine._accumulated = steps - 1  # the micro-batches ran inside the schedule
        engine.micro_steps += steps - 1
        engine.step()
        holders = engine.world_size // engine.pipeline.stages  # the ranks of the last stage
        mean = torch.zeros((), device=engine.device) if mean is None else mean / holders
    else:
        losses = []
        for batch in batches:
            loss = model_loss(engine(**batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean() / engine.world_size
    if engine.world_size > 1:
        # the ranks of one replica (or of the last stage) hold the same loss: the sum over the world
        # of each rank's share is the replicas' mean
        dist.all_reduce(mean)
        engine.traffic.all_reduce("engine", mean.element_size())
    return mean


def _draw(data_iter, steps: int):
    for i in range(steps):
        try:
            batch = next(data_iter)
        except StopIteration:
            raise ValueError(
                f"train_batch: data_iter ended after {i} of gradient_accumulation_steps = {steps} micro-batches"
            ) from None
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"train_batch: micro-batch {i} is a {type(batch).__name__}; each must be a dict "
                "of the model's keyword inputs (labels included)"
            )
        yield batch
