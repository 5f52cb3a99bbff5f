"""The FP32 baseline of a job (--baseline, or borrowed with --baseline-from) and the distillation
teacher, which may be that baseline."""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Optional

from .errors import JobError
from .jobconfig import client_optimizer, plain_config, with_tensorboard
from .models import fresh_model, load_model
from .options import JobOptions
from .ranks import barrier, drop_shared, full_state_dict


class BaselineMixin:
    """Job methods for the FP32 fine-tune and the teacher (Job supplies opts, progress, stage ...)."""

    def baseline(self, model, doc):
        """FP32 fine-tune of a copy with the same budget; its weights stay in checkpoints/ for PTQ."""
        import qcompress
        from safetensors.torch import load_file, save_file

        o = self.opts
        weights = os.path.join(o.out, "checkpoints", "fp32_finetuned.safetensors")
        copy_ = copy.deepcopy(model)
        self.progress.data["baseline_fingerprint"] = o.baseline_fingerprint(plain_config(doc), self.data_digest)
        source = weights
        if o.baseline_from and not self.progress.done("fp32_finetuned"):
            # every rank reads RUN's own file: rank 0's copy into --out may not be there yet (no
            # process group, so no barrier, before the first engine exists)
            source = self.borrow_baseline(weights)
        if self.progress.done("fp32_finetuned"):
            copy_.load_state_dict(load_file(source), strict=False)  # tied weights are saved once
            return copy_, self.progress.data["stages"]["fp32_finetuned"]

        trained = {"model": copy_}

        def train_and_eval():
            plain = plain_config(doc)
            engine = qcompress.initialize(
                copy_,
                with_tensorboard(plain, o.out, "fp32_finetuned"),
                optimizer=client_optimizer(plain, o.lr),
                device=self.device,
            )
            self.train_phase(self.make_phase("fp32_finetuned", engine, "fp32", "metrics_fp32.csv"))
            result = self.evaluator()(engine.module)
            sd = full_state_dict(engine.module)  # collective under ZeRO 2/3: every rank calls it
            if engine.sharded:
                # FSDP2 sharded copy_ in place: PTQ deep-copies the fine-tune and the teacher runs it
                # on every rank, so they get a whole, unsharded model (deepcopy of FSDP raised)
                whole = fresh_model(copy_, o.task)
                whole.load_state_dict(sd, strict=False)
                trained["model"] = whole.to(self.device).eval()
            if self.rank == 0:
                drop_shared(sd)
                tmp = weights + ".tmp"
                save_file(sd, tmp)
                os.replace(tmp, weights)
            return result

        result = self.stage("fp32_finetuned", train_and_eval)
        return trained["model"], result

    def borrow_baseline(self, weights: str) -> str:
        """--baseline-from RUN: take RUN's FP32 fine-tune (weights and metrics) when it was trained
        with the same model, data, budget and training config. Returns RUN's weights file."""
        src = self.opts.baseline_from
        saved = baseline_source(self.opts, plain_config(self.doc), self.data_digest)
        theirs = os.path.join(src, "checkpoints", "fp32_finetuned.safetensors")
        if self.rank == 0:
            for src_file, dst in (
                (theirs, weights),
                (os.path.join(src, "metrics_fp32.csv"), os.path.join(self.opts.out, "metrics_fp32.csv")),
            ):
                if os.path.isfile(src_file):
                    shutil.copyfile(src_file, dst + ".tmp")
                    os.replace(dst + ".tmp", dst)
        barrier()
        self.progress.record(
            "fp32_finetuned",
            saved["stages"]["fp32_finetuned"],
            (saved.get("wall_time_s") or {}).get("fp32_finetuned", 0.0),
        )
        self.opts.notes.append(f"fp32_finetuned was trained by the run in {src} (--baseline-from)")
        return theirs

    def teacher(self, spec: str, model, load_teacher):
        """The distillation teacher: 'baseline' (our job's extension) is this run's FP32 fine-tune;
        'self' the starting model (a fresh classification head teaches noise: say so); else a folder."""
        o = self.opts
        if spec == "baseline":
            if self.finetuned is None:
                raise JobError(
                    "compression_training.distillation.teacher: 'baseline' is the FP32 fine-tune "
                    "of this run: add --baseline (or --baseline-from RUN)"
                )
            return load_teacher("self", self.finetuned, None)
        if spec == "self" and getattr(model, "qc_fresh_head", False):
            msg = (
                "compression_training.distillation.teacher is 'self', but the starting model's "
                "classification head is freshly initialised, so its logits are noise; use "
                "`teacher: baseline` with --baseline, or a fine-tuned model folder"
            )
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        teacher = load_teacher(
            spec, model, lambda p: load_model(p, o.task, self.data.labels, o.seed, self.tok.pad_token_id, o.dtype)
        )
        if spec != "self" and getattr(teacher, "qc_fresh_head", False):
            head = (
                f"classification head for these {len(self.data.labels)} labels"
                if self.data.labels
                else "language-model head"
            )
            msg = (
                f"compression_training.distillation.teacher {spec!r} has no {head}, so it got a fresh one "
                "and its logits are noise; use a model fine-tuned for this task, or `teacher: baseline` "
                "with --baseline"
            )
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        return teacher


def baseline_source(opts: JobOptions, plain_doc: dict, digest: Optional[str] = None) -> dict:
    """--baseline-from RUN: RUN's progress.json when RUN holds an FP32 fine-tune trained with the
    same model, data, budget and training config (else a JobError naming what is wrong)."""
    src = opts.baseline_from
    if os.path.realpath(src) == os.path.realpath(opts.out):
        # --overwrite would delete the very baseline it is asked to reuse
        raise JobError(f"--baseline-from {src} is the --out folder itself; name the earlier run's folder")
    path = os.path.join(src, "checkpoints", "progress.json")
    theirs = os.path.join(src, "checkpoints", "fp32_finetuned.safetensors")
    if not (os.path.isfile(path) and os.path.isfile(theirs)):
        doc = _read_json(path) if os.path.isfile(path) else None
        if isinstance(doc, dict) and "fp32_finetuned" in (doc.get("stages") or {}):
            raise JobError(
                f"--baseline-from {src}: its FP32 baseline was trained, but its weights were removed "
                f"with its checkpoints (--keep-checkpoints none); run --baseline instead"
            )
        raise JobError(f"--baseline-from {src}: no FP32 baseline there (run it with --baseline first)")
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as err:
        raise JobError(f"--baseline-from {src}: cannot read {path} ({err})") from None
    mine = opts.baseline_fingerprint(plain_doc, digest)
    if (
        not isinstance(saved, dict)
        or saved.get("baseline_fingerprint") != mine
        or "fp32_finetuned" not in (saved.get("stages") or {})
    ):
        raise JobError(
            f"--baseline-from {src}: its FP32 baseline was trained with another model, data, "
            "budget or training config; run --baseline instead"
        )
    return saved


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
