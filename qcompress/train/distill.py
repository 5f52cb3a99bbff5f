"""Quantization-aware distillation (QAD): the student trains compressed against a frozen teacher.

Works in any training loop (plain PyTorch, `qcompress.initialize`, the transformers Trainer via
`qcompress.hf.DistillationTrainer`):

    teacher = load_teacher(cfg.compression.distillation.teacher, model, load_folder)  # before init_compression
    model = qc.init_compression(model, cfg)
    kd = Distiller.from_config(cfg, teacher)
    out = model(**batch, output_hidden_states=kd.needs_hidden_states)
    total, task, distill = kd.loss(out, kd.teacher_outputs(batch), out.loss, mask)

Outputs may be Hugging Face ModelOutputs (`.logits`, `.hidden_states`) or plain logits tensors.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import as_config
from ..config.compression import Distillation
from ..pruning.distill import hidden_state_mse
from ..schedule import REWRITTEN

KEY = "compression_training.distillation"
IGNORE_INDEX = -100  # label value that marks a position without a target (transformers' convention)


def logit_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), summed over the last (class / vocab)
    dimension and averaged over samples ([B, C]) or positions ([B, L, V]); with `mask` (shape of
    the logits without the last dimension) only where it is true. float32; teacher detached.
    The T^2 keeps the gradient scale independent of T (Hinton et al.)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape (same head and vocabulary?)"
        )
    log_t = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_row = (log_t.exp() * (log_t - log_s)).sum(-1)
    if mask is not None:
        if mask.shape != per_row.shape:
            raise ValueError(
                f"mask has shape {tuple(mask.shape)}, expected {tuple(per_row.shape)} "
                "(the logits without their last dimension)"
            )
        mask = mask.to(device=per_row.device, dtype=torch.bool)
        if not bool(mask.any()):
            return per_row.sum() * 0.0  # nothing to distill; still attached to the student graph
        per_row = per_row[mask]
    return temperature**2 * per_row.mean()


def causal_lm_mask(labels: torch.Tensor) -> torch.Tensor:
    """Positions [B, L] of causal-LM logits that have a target: logits at i predict labels[i + 1],
    so position i counts when labels[:, i + 1] != -100; the last position never counts."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    if logits is None:
        raise TypeError(
            f"cannot find logits in a model output of type {type(out).__name__} "
            "(expected a tensor or an object with .logits)"
        )
    return logits


def _hidden_of(out: Any, who: str) -> Sequence[torch.Tensor]:
    hidden = getattr(out, "hidden_states", None)
    if hidden is None and isinstance(out, Mapping):
        hidden = out.get("hidden_states")
    if hidden is None:
        raise ValueError(
            f"{KEY}.hidden_mse is > 0 but the {who} output has no hidden_states: run its "
            "forward with output_hidden_states=True (a Hugging Face model), or set "
            "hidden_mse: 0"
        )
    return hidden


def _freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_teacher(spec: str, start_model: nn.Module, load_folder: Callable[[str], nn.Module]) -> nn.Module:
    """The teacher named by `compression_training.distillation.teacher`, frozen and in eval mode.

    "self": a deep copy of `start_model`, so call this BEFORE init_compression (the copy must be
    the full-precision model). Anything else is a model folder read with `load_folder(path)`."""
    if spec == "self":
        root = start_model.module if isinstance(getattr(start_model, "module", None), nn.Module) else start_model
        if getattr(root, REWRITTEN, False):
            raise ValueError(
                f"{KEY}.teacher is 'self', but the model was already rewritten by "
                "init_compression, so its copy would be compressed too: load the teacher "
                "before init_compression, or pass the teacher model explicitly"
            )
        return _freeze(copy.deepcopy(root))
    path = os.path.expanduser(spec)
    if spec == "baseline" and not os.path.isdir(path):
        # schedules/with_qad_range_learning.yaml says `baseline`: only `qcompress train` makes one
        raise ValueError(
            f"{KEY}.teacher: 'baseline' is the FP32 fine-tune that `qcompress train "
            "--baseline` trains first; here there is none: set teacher to the folder of a "
            "model fine-tuned for this task (or pass that model as the teacher)"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{KEY}.teacher: {spec!r} is not 'self' and no such model folder exists")
    return _freeze(load_folder(path))


class Distiller:
    """Distillation loss of one student against a frozen teacher (see the module docstring)."""

    def __init__(self, teacher: nn.Module, cfg: Distillation, teacher_layer: Optional[Sequence[int]] = None):
        if not isinstance(cfg, Distillation):
            raise TypeError(
                f"Distiller needs the parsed {KEY} section (a Distillation), got "
                f"{type(cfg).__name__}; use Distiller.from_config for a whole config"
            )
        self.teacher = _freeze(teacher)
        self.cfg = cfg
        self.temperature = cfg.temperature
        self.alpha = cfg.alpha
        self.hidden_weight = cfg.hidden_mse
        mapping = teacher_layer if teacher_layer is not None else cfg.teacher_layer
        self.teacher_layer = tuple(mapping) if mapping is not None else None  # None: identity

    @classmethod
    def from_config(cls, cfg, teacher: nn.Module) -> Optional["Distiller"]:
        """A Distiller for `cfg` (Config, dict or path), or None when distillation is not enabled.
        Hidden states map by `distillation.teacher_layer`, else `layer_reduction.teacher_layer`
        when layer reduction is on, else layer i to layer i."""
        cc = as_config(cfg).compression
        kd = cc.distillation
        if not kd.enabled:
            return None
        mapping = kd.teacher_layer
        if mapping is None and cc.layer_reduction.enabled:
            mapping = cc.layer_reduction.teacher_layer
        return cls(teacher, kd, mapping)

    @property
    def needs_hidden_states(self) -> bool:
        """Whether the student (and teacher) forward must pass output_hidden_states=True."""
        return self.hidden_weight > 0

    @torch.no_grad()
    def teacher_outputs(self, batch: Any):
        """The teacher's forward on `batch` (a dict of model inputs, or a tensor / tuple of
        positional inputs) under no_grad in eval mode; labels are not passed."""
        self.teacher.eval()
        self._follow_device(batch)
        if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch")}
            if self.needs_hidden_states:
                inputs["output_hidden_states"] = True
            return self.teacher(**inputs)
        if isinstance(batch, (tuple, list)):
            return self.teacher(*batch)
        return self.teacher(batch)

    def _follow_device(self, batch: Any) -> None:
        """Move the teacher to the device of the batch (a Trainer moves only the student)."""
        tensors = (
            batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
        )
        dev = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
        p = next(self.teacher.parameters(), None)
        if dev is not None and p is not None and p.device != dev:
            self.teacher.to(dev)

    def distill_loss(self, student_out, teacher_out, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """logit_kl + hidden_mse * hidden_state_mse(student hidden, teacher hidden, mapping)."""
        loss = logit_kl(logits_of(student_out), logits_of(teacher_out), self.temperature, mask)
        if self.needs_hidden_states:
            s_hidden = _hidden_of(student_out, "student")
            t_hidden = _hidden_of(teacher_out, "teacher")
            mapping = self.teacher_layer
            if mapping is None:
                if len(s_hidden) != len(t_hidden):
                    raise ValueError(
                        f"{KEY}.teacher_layer is not set and the student has "
                        f"{len(s_hidden) - 1} layers but the teacher {len(t_hidden) - 1}; "
                        "identity mapping needs equal depth: set teacher_layer"
                    )
                mapping = range(len(s_hidden) - 1)
            loss = loss + self.hidden_weight * hidden_state_mse(s_hidden, t_hidden, list(mapping))
        return loss

    def loss(
        self, student_out, teacher_out, task_loss: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(total, task, distill) with total = (1 - alpha) * task + alpha * distill.
        `task_loss` may be None only when alpha is 1 (it then counts as 0)."""
        distill = self.distill_loss(student_out, teacher_out, mask)
        if task_loss is None:
            if self.alpha != 1.0:
                raise ValueError(
                    f"no task loss (did the batch carry labels?) but {KEY}.alpha is "
                    f"{self.alpha}: the task loss has weight {1 - self.alpha}"
                )
            task_loss = torch.zeros((), device=distill.device)
        total = (1.0 - self.alpha) * task_loss.float() + self.alpha * distill
        return total, task_loss, distill
