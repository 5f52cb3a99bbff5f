"""The job's training phases: evaluation and calibration batches, step counts, one resumable
training phase, the compressed run, and handing the trained model back from the ranks."""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch.distributed as dist

from ..nn import int8_forward
from . import loop
from .batches import device_of, to_device
from .evaluate import evaluate
from .jobconfig import client_optimizer, with_tensorboard
from .models import fresh_model
from .report import MetricsLog
from .ranks import barrier, world
from .stages import calibrate_static_ranges


class PhasesMixin:
    """Job methods that train (Job supplies opts, data, tok, doc, cfg, rank, say, progress)."""

    def evaluator(self):
        o = self.opts

        def ev(model, forward=None):
            return evaluate(model, self.data.eval, o.task, o.eval_batch_size, self.tok.pad_token_id, forward=forward)

        return ev

    def calibration_batches(self, device=None, n: Optional[int] = None):
        """--calib-batches training batches (n: another count) for static activation ranges (PTQ
        has no training to set them), input-weighted weight ranges and GPTQ."""
        from .batches import eval_batches

        n = self.opts.calib_batches if n is None else n
        for i, b in enumerate(eval_batches(self.data.train, self.opts.eval_batch_size, self.tok.pad_token_id)):
            if i >= n:
                break
            b.pop("labels")
            yield b if device is None else to_device(b, device)

    def calibrate(self, model) -> None:
        """PTQ's calibration: static activation ranges (training mode), then the input moments of
        input-weighted weight ranges (eval mode, static ranges set); after GPTQ has changed weights,
        the static ranges once more, for the activations the solved weights give."""
        import qcompress
        from ..calibrate.gptq import unsolved

        calibrate_static_ranges(model, self.calibration_batches())
        solving = len(unsolved(model))
        qcompress.calibrate_weight_ranges(model, self.calibration_batches(device_of(model)))
        if solving:
            calibrate_static_ranges(model, self.calibration_batches())

    def learned_ranges(self, model):
        """The ptq_learned stage: the PTQ model's learned ranges trained on the loss for
        --ptq-range-steps batches of --batch-size in the job's data order, every weight frozen
        (qcompress.learn_ranges, lr = --lr x RANGE_LR_FACTOR, as training gives learned ranges)."""
        import qcompress
        from ..nn.range_groups import RANGE_LR_FACTOR
        from .batches import step_indices
        from .data import collate

        o, data = self.opts, self.data.train
        device = device_of(model)

        def batches():
            for step in range(o.ptq_range_steps):
                rows = [data[i] for i in step_indices(len(data), o.batch_size, o.seed, step)]
                yield to_device(collate(rows, self.tok.pad_token_id), device)

        out = qcompress.learn_ranges(model, batches(), lr=o.lr * RANGE_LR_FACTOR)
        self.say(
            f"[ptq_learned] {out['steps']} steps on the learned ranges, loss {out['first_loss']:.4f} -> "
            f"{out['last_loss']:.4f}"
        )
        return model

    def planned_steps(self, cfg, n_train: int) -> int:
        """The optimizer steps each phase will take, from the configs before any engine exists (a
        batch size that does not fit the world size is a ConfigError here, not after the FP32 stages)."""
        from ..engine.batch import resolve_batch
        from .batches import steps_per_epoch

        tbs, _, _ = resolve_batch(
            cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, world()
        )
        if self.opts.max_steps is not None:
            return self.opts.max_steps
        return max(1, math.ceil(self.opts.epochs * steps_per_epoch(n_train, tbs)))

    def steps(self, engine) -> int:
        from .batches import steps_per_epoch

        if self.opts.max_steps is not None:
            return self.opts.max_steps
        return max(1, math.ceil(self.opts.epochs * steps_per_epoch(len(self.data.train), engine.train_batch_size)))

    def make_phase(self, name, engine, ckpt, metrics_file, distiller=None):
        o = self.opts
        metrics = None
        if self.rank == 0:
            metrics = MetricsLog(os.path.join(o.out, metrics_file), loop.metric_columns(engine.module))
        return loop.Phase(
            name=name,
            engine=engine,
            dataset=self.data.train,
            task=o.task,
            steps=self.steps(engine),
            seed=o.seed,
            pad_id=self.tok.pad_token_id,
            ckpt_dir=os.path.join(o.out, "checkpoints", ckpt),
            save_steps=o.save_steps,
            metrics=metrics,
            distiller=distiller,
            progress=o.progress,
            keep_all=o.keep_checkpoints == "all",
        )

    def train_phase(self, phase) -> None:
        start = loop.resume(phase) if self.opts.resume else 0
        if phase.metrics is not None:
            phase.metrics.resume_at(start if start else None)
        if start:
            self.say(f"[{phase.name}] resuming at step {start} of {phase.steps}")
        loop.run(phase, start)
        self.prior_seconds = phase.prior_seconds  # its earlier attempts' training time
        self.earlier_seconds += phase.prior_seconds

    def compressed_run(self, model, doc):
        import qcompress
        from .distill import Distiller, load_teacher

        o = self.opts
        cc = self.cfg.compression
        dcfg = getattr(cc, "distillation", None)
        teacher = None
        if dcfg is not None and dcfg.enabled:
            teacher = self.teacher(dcfg.teacher, model, load_teacher)
        self.finetuned = None
        lr_teacher = teacher if cc.layer_reduction.enabled else None
        qcompress.init_compression(model, doc, teacher_model=lr_teacher)
        from ..calibrate.gptq import unsolved

        solving = len(unsolved(model))
        if self.progress.done("qat_train") or (
            o.resume and loop.latest_step(os.path.join(o.out, "checkpoints", "qat")) is not None
        ):
            solving = 0  # the checkpoint brings the input moments and GPTQ's weights and scales
        else:
            seen = [0]  # the batches the data had (up to --calib-batches), for the messages

            def counted():
                for b in self.calibration_batches(device_of(model)):
                    seen[0] += 1
                    yield b

            weighted = qcompress.calibrate_weight_ranges(model, counted()) - solving
            if weighted:
                self.say(
                    f"[qat] weight ranges of {weighted} module(s) weighted by their inputs on "
                    f"{seen[0]} calibration batches (observer_kwargs.weight_by)"
                )
            if solving:
                self.say(
                    f"[qat] weights of {solving} module(s) solved by GPTQ on {seen[0]} calibration "
                    "batches (observer gptq)"
                )
        forward_note = int8_forward.describe(model)
        if forward_note:
            self.say(f"[qat] {forward_note}")
        engine = qcompress.initialize(
            model, with_tensorboard(doc, o.out, "qat"), optimizer=client_optimizer(doc, o.lr, model), device=self.device
        )
        distiller = Distiller.from_config(self.cfg, teacher) if teacher is not None else None
        phase = self.make_phase("qat", engine, "qat", "metrics.csv", distiller)
        t0 = time.perf_counter()
        if self.progress.done("qat_train"):
            loop.resume(phase)  # the trained weights and compression state
        else:
            self.train_phase(phase)
            self.progress.record("qat_train", {"steps": phase.steps}, time.perf_counter() - t0 + phase.prior_seconds)
        info = dict(
            steps=phase.steps,
            train_batch_size=engine.train_batch_size,
            micro_batch_size=engine.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=engine.gradient_accumulation_steps,
            world_size=engine.world_size,
            mesh=engine.parallel.shape.as_dict(),
            precision=engine.precision,
            zero_stage=engine.stage,
            optimizer=(doc.get("optimizer") or {}).get("type", "AdamW (default)"),
            distillation=distiller is not None,
            seed=o.seed,
            max_length=o.max_length,
        )
        return engine, info

    def release_ranks(self, engine, own_group: bool):
        """After training and the qat stage, export and reloading are rank 0's alone: end the process
        group we created (transformers' compressed-tensors loader runs collectives of its own when
        one exists) and return the trained model unsharded. Sharded (ZeRO 2/3) and split (tensor /
        pipeline parallel) weights come back whole from the final engine checkpoint through a
        one-process engine."""
        if not (dist.is_available() and dist.is_initialized()):
            return engine.module
        barrier()
        if own_group:
            dist.destroy_process_group()
        if self.rank != 0 or not (engine.sharded or engine.parallel.mesh is not None):
            return engine.module
        from ..export.cli import _load_engine_checkpoint

        model = fresh_model(engine.module, self.opts.task)
        import qcompress

        qcompress.init_compression(model, self.doc)
        saved = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = "1"
        try:
            _load_engine_checkpoint(model, self.cfg, os.path.join(self.opts.out, "checkpoints", "qat"), None)
        finally:
            if saved is not None:
                os.environ["WORLD_SIZE"] = saved
        return model.to(self.device).eval()
