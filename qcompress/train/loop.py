"""One training phase (the FP32 baseline or the compressed run) through a qcompress engine:
micro-batches, optional distillation, per-step metrics, checkpoints that resume exactly."""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import NonFiniteError
from .batches import micro_batches, to_device
from .errors import JobError
from .report import METRIC_COLUMNS, MetricsLog

_TAG = re.compile(r"^step(\d+)$")


def group_columns(model: nn.Module) -> Dict[str, float]:
    """Bits of every weight / activation group, kept density of every pruning group and the
    share of blocks progressive layer drop ran, as now."""
    out: Dict[str, float] = {}
    kept: Dict[str, List[float]] = {}
    for _, m in model.named_modules():
        wq, aq = getattr(m, "qc_wq", None), getattr(m, "qc_aq", None)
        if wq is not None:
            out[f"bits.{wq.group}"] = wq.bits if wq.active else 32
        if aq is not None:
            out[f"act_bits.{aq.group}"] = aq.bits if aq.active else 32
        for st in (getattr(m, "qc_pruning", None) or {}).values():
            kept.setdefault(f"density.{st.group}", []).append(st.kept_fraction(m))
    for key, shares in kept.items():  # what the masks keep (whole units), not the scheduled ratio
        out[key] = sum(shares) / len(shares)
    from ..nn.pld import pld_schedule

    pld = pld_schedule(model)
    if pld is not None:  # progressive layer drop: share of block calls run in the last step
        out["pld.blocks_run"] = pld.last_share
    return out


def final_bits(model: nn.Module) -> Dict[str, dict]:
    """{'weight:<group>' / 'activation:<group>': {'bits', 'modules'}} at the end of training."""
    out: Dict[str, dict] = {}
    for _, m in model.named_modules():
        for kind, q in (("weight", getattr(m, "qc_wq", None)), ("activation", getattr(m, "qc_aq", None))):
            if q is None:
                continue
            rec = out.setdefault(f"{kind}:{q.group}", {"bits": set(), "modules": 0})
            rec["bits"].add(q.bits if q.active else 32)
            rec["modules"] += 1
    return {
        k: {"bits": min(v["bits"]) if len(v["bits"]) == 1 else sorted(v["bits"]), "modules": v["modules"]}
        for k, v in sorted(out.items())
    }


def schedule_shortfalls(model: nn.Module) -> list:
    """One line per weight group whose schedule had not reached target_bits (or had not started)
    when training ended: the export holds what the model has now, not the recipe's target."""
    now: Dict[str, tuple] = {}
    for _, m in model.named_modules():
        wq = getattr(m, "qc_wq", None)
        if wq is not None and not getattr(wq, "baked", False):
            now.setdefault(wq.group, (wq.bits if wq.active else None, wq.target_bits, wq.offset))
    lines = []
    for group, (bits, target, offset) in sorted(now.items()):
        if bits is None:
            lines.append(
                f"weight group {group!r} was never quantized: its schedule starts at step {offset}, "
                "after the last step; it is exported unquantized"
            )
        elif bits != target:
            lines.append(
                f"weight group {group!r} ended training at {bits} bits, not its target_bits {target}: "
                "the schedule needs more steps; the qat row and the export are at "
                f"{bits} bits (the ptq row is at {target})"
            )
    return lines


@dataclass
class Phase:
    name: str  # "qat" or "fp32_finetuned"
    engine: object  # qcompress Engine
    dataset: object
    task: str
    steps: int
    seed: int
    pad_id: int
    ckpt_dir: str
    save_steps: int
    metrics: Optional[MetricsLog]  # rank 0 only
    distiller: object = None
    progress: bool = True
    prior_seconds: float = 0.0  # training time of earlier attempts (from the resumed checkpoint)
    keep_all: bool = False  # --keep-checkpoints all: older tags stay

    @property
    def rank(self) -> int:
        return self.engine.rank


def latest_step(ckpt_dir: str) -> Optional[int]:
    """The step of the checkpoint `latest` names in ckpt_dir, or None."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        m = _TAG.match(fh.read().strip())
    return int(m.group(1)) if m else None


def _prune_old_tags(ckpt_dir: str, keep: str) -> None:
    for name in os.listdir(ckpt_dir):
        if _TAG.match(name) and name != keep:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def save(phase: Phase, step: int, seconds: float = 0.0) -> None:
    """Collective: every rank saves its part; rank 0 then drops the older tags. `seconds`: the
    phase's training time so far, all attempts (a resumed run's report adds it up)."""
    tag = f"step{step}"
    phase.engine.save_checkpoint(phase.ckpt_dir, tag=tag, client_state={"step": step, "seconds": round(seconds, 3)})
    if phase.rank == 0 and not phase.keep_all:
        _prune_old_tags(phase.ckpt_dir, tag)


def resume(phase: Phase) -> int:
    """Load the phase's latest checkpoint (collective); returns the step to continue from."""
    if latest_step(phase.ckpt_dir) is None:
        return 0
    _, client = phase.engine.load_checkpoint(phase.ckpt_dir)
    phase.prior_seconds = float(client.get("seconds", 0.0))
    return int(client["step"])


def _mean_across_ranks(values, engine):
    if engine.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / engine.world_size).tolist()


def _forward_loss(phase: Phase, batch: dict):
    """(total loss, task loss, distillation loss or None) of one micro-batch."""
    from .distill import causal_lm_mask

    eng, distiller = phase.engine, phase.distiller
    batch = to_device(batch, eng.device)
    kwargs = dict(batch)
    if phase.task == "causal-lm":  # a MoE model's loss includes its router's load-balancing loss
        from ..nn.experts import router_aux_kwargs

        kwargs.update(router_aux_kwargs(eng.module))
    teacher_out = None
    if distiller is not None:
        teacher_out = distiller.teacher_outputs({k: v for k, v in batch.items() if k != "labels"})
        if distiller.needs_hidden_states:
            kwargs["output_hidden_states"] = True
    out = eng(**kwargs)
    task_loss = out.loss
    if distiller is None:
        return task_loss, task_loss, None
    mask = causal_lm_mask(batch["labels"]) if phase.task == "causal-lm" else None
    return distiller.loss(out, teacher_out, task_loss, mask)


def run(phase: Phase, start_step: int = 0) -> None:
    """Train from start_step to phase.steps, writing a metrics row per optimizer step (rank 0)."""
    eng = phase.engine
    eng.train()
    bar = None
    if phase.progress and phase.rank == 0:
        from .progress import StepProgress

        every = getattr(getattr(eng, "config", None), "steps_per_print", 10)
        bar = StepProgress(phase.name, phase.steps, start_step, every)
    acc = eng.gradient_accumulation_steps
    t_run = time.perf_counter()
    try:
        for step in range(start_step, phase.steps):
            t0 = time.perf_counter()
            lr = eng.get_lr()[0]
            sums = [0.0, 0.0, 0.0]
            has_kd = False
            # each data-parallel replica its share; the ranks of one replica (TP / PP) the same
            batches = micro_batches(
                phase.dataset,
                step,
                seed=phase.seed,
                train_batch_size=eng.train_batch_size,
                micro=eng.train_micro_batch_size_per_gpu,
                accumulation=acc,
                rank=eng.data_parallel_rank,
                world=eng.data_parallel_world_size,
                pad_id=phase.pad_id,
            )
            staged = getattr(eng, "pipeline", None) is not None
            if staged:  # the stages run inside train_batch
                sums = [_pipeline_step(phase, step, batches)] * 2 + [0.0]
                batches = ()
            for batch in batches:
                try:
                    total, task, kd = _forward_loss(phase, batch)
                    eng.backward(total)
                    eng.step()
                except NonFiniteError as err:  # a quantizer met NaN / Inf: the run has diverged
                    raise _diverged(phase, step, str(err)) from None
                sums[0] += float(total.detach()) / acc
                sums[1] += float(task.detach()) / acc
                if kd is not None:
                    has_kd = True
                    sums[2] += float(kd.detach()) / acc
            loss, task_loss, kd_loss = sums if staged else _mean_across_ranks(sums, eng)
            elapsed = time.perf_counter() - t0
            if phase.rank == 0 and phase.metrics is not None:
                row = dict(
                    step=step + 1,
                    loss=loss,
                    task_loss=task_loss,
                    distill_loss=kd_loss if has_kd else None,
                    lr=lr,
                    samples_per_s=eng.train_batch_size / elapsed,
                )
                row.update(group_columns(eng.module))
                phase.metrics.write(row)
                monitor = getattr(eng, "monitor", None)
                if monitor is not None and monitor.enabled:
                    monitor.write_events(
                        [
                            (f"Train/Steps/{k}", float(v), step + 1)
                            for k, v in row.items()
                            if k != "step" and v is not None
                        ]
                    )
            # fp16 skips overflowing steps by design; elsewhere a non-finite loss means every later
            # step, evaluation and the export would be NaN: stop here, after its metrics row
            if not math.isfinite(loss) and eng.precision != "fp16":
                raise _diverged(phase, step, f"the loss is {loss}")
            if bar is not None:
                bar.update(loss, eng.train_batch_size / elapsed)
            done = step + 1
            if done == phase.steps or (phase.save_steps > 0 and done % phase.save_steps == 0):
                save(phase, done, phase.prior_seconds + time.perf_counter() - t_run)
    finally:
        if bar is not None:
            bar.close()
        if phase.metrics is not None:
            phase.metrics.close()
        monitor = getattr(eng, "monitor", None)
        if monitor is not None:
            monitor.close()


def _pipeline_step(phase: Phase, step: int, batches) -> float:
    """One optimizer step through engine.train_batch (pipeline stages): the model's own loss, the
    mean over micro-batches and replicas, the same on every rank."""
    if phase.distiller is not None:
        raise JobError(
            "compression_training.distillation with pipeline.stages > 1: the teacher's outputs "
            "do not reach the stages' loss; train without distillation or with pipeline.stages 1"
        )

    def plain():
        for batch in batches:
            mask = batch.pop("attention_mask", None)
            if mask is not None and not bool(mask.all()):
                raise JobError(
                    "pipeline.stages > 1 passes token ids and labels only: this data has padded "
                    "micro-batches (attention_mask with zeros); use --task causal-lm's token blocks"
                )
            yield batch

    try:
        return float(phase.engine.train_batch(plain()))
    except NonFiniteError as err:
        raise _diverged(phase, step, str(err)) from None


def _diverged(phase: Phase, step: int, what: str) -> JobError:
    return JobError(
        f"[{phase.name}] training diverged at step {step + 1}: {what}; lower the learning rate "
        f"(--lr, or the config's optimizer lr) and start again with --overwrite",
        code=1,
    )


def metric_columns(model: nn.Module):
    return METRIC_COLUMNS + sorted(group_columns(model))
