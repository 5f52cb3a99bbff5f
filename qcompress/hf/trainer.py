"""CompressionTrainer: a transformers Trainer whose default optimizer keeps learned ranges in their
own groups; DistillationTrainer: the same, whose training loss adds knowledge distillation from a
frozen teacher (`compression_training.distillation`), for quantization-aware distillation.

    trainer = DistillationTrainer(model, args, compression_config=cfg, train_dataset=...,
                                  callbacks=[CompressionCallback(cfg)])

The teacher "self" is copied from `model` here, before CompressionCallback rewrites it; a folder
teacher is loaded with the student's own class (`type(model).from_pretrained`). Logs
`task_loss` and `distill_loss` (means over the logging interval) beside `loss`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn
import transformers
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..config import as_config
from ..nn.range_groups import RANGE_LR_FACTOR, range_parameter_ids, split_range_groups_
from ..unwrap import unwrap
from ..train.distill import IGNORE_INDEX, KEY, Distiller, causal_lm_mask, load_teacher

log = logging.getLogger("qcompress.hf")


def _is_causal_lm(model: nn.Module) -> bool:
    root = unwrap(model)
    return type(root).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def distill_mask(
    logits: torch.Tensor, labels: Optional[torch.Tensor], causal: bool, attention_mask: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """Which logits rows the distillation loss averages over. [B, C] logits: every sample (None).
    [B, L, V]: with labels, the positions that have a target (causal LM: shifted labels != -100,
    see causal_lm_mask; otherwise labels != -100); without labels, the attention mask."""
    if logits.dim() < 3:
        return None
    if labels is not None and labels.shape == logits.shape[:-1]:
        return causal_lm_mask(labels) if causal else labels != IGNORE_INDEX
    if attention_mask is not None and attention_mask.shape == logits.shape[:-1]:
        return attention_mask.bool()
    return None


def _load_folder_teacher(student: nn.Module, path: str) -> nn.Module:
    """`type(student).from_pretrained(path)`, refused when the folder lacks weights the class
    needs (another architecture, or a checkpoint without the task's head): from_pretrained would
    start them random, so the teacher's logits would be noise, or it would fail at the first step."""
    student_type = getattr(getattr(unwrap(student), "config", None), "model_type", None)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{KEY}.teacher: {path} is not a transformers model folder ({str(err).splitlines()[0]})"
        ) from None
    if student_type is not None and getattr(config, "model_type", None) != student_type:
        raise ValueError(
            f"{KEY}.teacher: {path} holds a {config.model_type!r} model, the student is "
            f"{student_type!r}; pass teacher= to distil from another architecture"
        )
    cls = type(unwrap(student))
    teacher, info = cls.from_pretrained(path, output_loading_info=True)
    fresh = sorted(
        set(info.get("missing_keys") or ())
        | {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()}
    )
    if fresh:
        raise ValueError(
            f"{KEY}.teacher: {path} has no weights for {len(fresh)} tensors of "
            f"{cls.__name__} ({', '.join(fresh[:3])}{', ...' if len(fresh) > 3 else ''}): "
            "they would start random and the teacher's logits would be noise; use a model "
            "fine-tuned for this task, or pass teacher="
        )
    return teacher


class CompressionTrainer(Trainer):
    """A Trainer whose default optimizer gives learned ranges (`range_learning`: the scales and
    zero points) groups of their own, at RANGE_LR_FACTOR x the learning rate without weight decay,
    as `qcompress train` does (in the weights' group they random-walk: see
    qcompress/nn/range_groups.py). Use it with CompressionCallback like a plain Trainer; an
    optimizer given in `optimizers=` is used as given."""

    def create_optimizer(self, model=None):
        built_here = self.optimizer is None
        optimizer = super().create_optimizer() if model is None else super().create_optimizer(model)
        if built_here:
            moved = split_range_groups_(optimizer, range_parameter_ids(self.model if model is None else model))
            if moved:
                log.info(
                    "qcompress: %d learned-range parameters in their own optimizer groups (lr x %g, no weight decay)",
                    moved,
                    RANGE_LR_FACTOR,
                )
        return optimizer


class DistillationTrainer(CompressionTrainer):
    """Trainer with loss (1 - alpha) * task + alpha * (T^2 KL + hidden_mse * hidden MSE).

    `compression_config`: the qcompress config (Config, dict or path) whose
    `compression_training.distillation` section is used; `teacher`: a model that overrides the
    section's `teacher`. With distillation disabled it trains like a plain Trainer.
    Both losses are per-batch means, so the Trainer divides them by the accumulation steps.
    """

    def __init__(
        self,
        model=None,
        args=None,
        *trainer_args,
        compression_config=None,
        teacher: Optional[nn.Module] = None,
        **trainer_kwargs,
    ):
        if compression_config is None:
            raise ValueError(
                f"DistillationTrainer needs compression_config= (the qcompress config with a {KEY} section)"
            )
        cfg = as_config(compression_config)
        kd = cfg.compression.distillation
        self.distiller: Optional[Distiller] = None
        if kd.enabled:
            if teacher is None:
                if model is None:
                    raise ValueError(
                        "DistillationTrainer: model_init is not supported with distillation; pass the model"
                    )
                teacher = load_teacher(kd.teacher, model, lambda path: _load_folder_teacher(model, path))
            self.distiller = Distiller.from_config(cfg, teacher)
        elif teacher is not None:
            raise ValueError(f"DistillationTrainer got teacher= but {KEY}.enabled is false")
        self._reset_kd_logs()
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if self.distiller is not None:
            # our losses are per-batch means: the Trainer must divide them by the accumulation
            # steps. Without distillation the Trainer's own rule stands (a causal LM's loss is
            # already normalised over the accumulated batch by num_items_in_batch; dividing it
            # again shrank loss and gradients by gradient_accumulation_steps). Older
            # transformers read only model_accepts_loss_kwargs for that decision.
            self.loss_is_scaled_for_ga = False
            self.model_accepts_loss_kwargs = False

    def _reset_kd_logs(self):
        self._kd_sums = {"task_loss": 0.0, "distill_loss": 0.0}
        self._kd_count = 0

    def train(self, *args, **kwargs):
        self._reset_kd_logs()  # losses computed outside training do not enter the logs
        return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.distiller is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        kd = self.distiller
        labels = inputs.get("labels")
        student_in = dict(inputs)
        if kd.needs_hidden_states:
            student_in["output_hidden_states"] = True
        if labels is not None:
            # the Trainer's own task loss (label_smoothing_factor, compute_loss_func), a per-batch
            # mean: model_accepts_loss_kwargs is off while distilling, so no num_items_in_batch
            task, outputs = super().compute_loss(model, student_in, return_outputs=True)
        else:
            outputs, task = model(**student_in), None
        teacher_out = kd.teacher_outputs(inputs)
        logits = outputs.logits
        mask = distill_mask(logits, labels, _is_causal_lm(model), inputs.get("attention_mask"))
        total, task, distill = kd.loss(outputs, teacher_out, task, mask)
        self._kd_sums["task_loss"] += float(task.detach())
        self._kd_sums["distill_loss"] += float(distill.detach())
        self._kd_count += 1
        return (total, outputs) if return_outputs else total

    def log(self, logs, *args, **kwargs):
        if self._kd_count and "loss" in logs:
            logs.update({key: value / self._kd_count for key, value in self._kd_sums.items()})
            self._reset_kd_logs()
        return super().log(logs, *args, **kwargs)
