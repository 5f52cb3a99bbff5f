"""Task metrics of a model on a tokenized dataset: accuracy (classification), perplexity (causal LM)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant import kernels
from .batches import device_of, eval_batches, to_device


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset, task: str, batch_size: int, pad_id: int, forward: Optional[Callable] = None
) -> Dict[str, float]:
    """{'accuracy', 'loss'} or {'perplexity', 'loss'}; the model is put in eval mode and left there.
    `forward(batch)` overrides model(**batch) (e.g. an engine's autocast)."""
    model.eval()
    run = forward or (lambda b: model(**b))
    dev = device_of(model)
    loss_sum, count, correct = 0.0, 0, 0
    for batch in eval_batches(dataset, batch_size, pad_id):
        batch = to_device(batch, dev)
        labels = batch.pop("labels")
        logits = _logits(run(batch)).float()
        if task == "text-classification":
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == labels).sum())
            count += labels.numel()
        else:
            shift, target = logits[:, :-1], labels[:, 1:]
            loss_sum += F.cross_entropy(
                shift.reshape(-1, shift.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
            count += int((target != -100).sum())
    kernels.check_nonfinite()  # a NaN the CUDA quantizers counted: raised here, as on the CPU
    if count == 0:
        raise ValueError("the evaluation set is empty")
    loss = loss_sum / count
    if task == "text-classification":
        return {"accuracy": correct / count, "loss": loss}
    return {"perplexity": math.exp(min(loss, 700.0)), "loss": loss}


def metric_name(task: str) -> str:
    return "accuracy" if task == "text-classification" else "perplexity"


@torch.no_grad()
def max_logit_difference(a: nn.Module, b: nn.Module, dataset, batch_size: int, pad_id: int, batches: int = 2) -> float:
    """Largest |logit_a - logit_b| over the first batches of the dataset (both in eval mode; each
    runs where its parameters are, the logits are compared on the CPU)."""
    a.eval(), b.eval()
    worst = 0.0
    for i, batch in enumerate(eval_batches(dataset, batch_size, pad_id)):
        if i >= batches:
            break
        batch.pop("labels")
        la = _logits(a(**to_device(batch, device_of(a)))).float().cpu()
        lb = _logits(b(**to_device(batch, device_of(b)))).float().cpu()
        worst = max(worst, (la - lb).abs().max().item())
    return worst


@torch.no_grad()
def max_weight_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest |difference| between the `weight` tensors the two models' modules of the same name and
    shape use now (a compressed module's is its dequantized weight); float weights only."""
    theirs = dict(b.named_modules())
    worst = 0.0
    for name, m in a.named_modules():
        w, other = getattr(m, "weight", None), getattr(theirs.get(name), "weight", None)
        if not (isinstance(w, torch.Tensor) and isinstance(other, torch.Tensor)):
            continue
        if w.shape == other.shape and w.is_floating_point() and other.is_floating_point():
            worst = max(worst, (w.detach().float().cpu() - other.detach().float().cpu()).abs().max().item())
    return worst
