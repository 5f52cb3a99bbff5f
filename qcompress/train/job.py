"""The main job: fine-tune a local Hugging Face model with compression on the user's data, evaluate
every stage, export a quantized checkpoint, and report what compression cost.

Stages (report.json "stages"): fp32 (the starting model), fp32_finetuned (--baseline: the same
budget without compression), ptq (quantized without training), qat (the compressed run after
training), exported (the export reloaded by load_quantized; equals qat), transformers (the export
loaded by transformers, where it can load that scheme). Every rank trains and evaluates; rank 0
alone writes files. A run interrupted at any point continues with --resume.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..config import as_config
from ..nn import int8_forward
from . import loop
from .baseline import BaselineMixin, baseline_source
from .batches import device_of
from .data import DataError, prepare_data
from .errors import JobError
from .evaluate import max_logit_difference, max_weight_difference, metric_name

# names tests, benchmarks and the CLI import from here, kept after the split
from .jobconfig import (  # noqa: F401
    BATCH_KEYS,
    check_compression,
    client_optimizer,
    fill_auto,
    job_config,
    job_device,
    plain_config,
    with_tensorboard,
)
from .models import check_max_length, describe, fp32_bytes, fresh_model, load_model, load_tokenizer
from .options import JobOptions, data_digest  # noqa: F401
from .outdir import LOCK_NAME, Progress, check_out, prepare_out  # noqa: F401  (LOCK_NAME: tests import it here)
from .phases import PhasesMixin
from .ranks import barrier, rank, world
from .report import plot_bits, plot_loss, read_metrics, stage_table, write_report
from ..verify.offline import offline_verify
from .stages import export_model, float_embeddings, quantize_without_training, transformers_attempts, why_logits_differ

log = logging.getLogger("qcompress.train")


class Job(BaselineMixin, PhasesMixin):
    def __init__(self, opts: JobOptions):
        self.opts = opts
        self.rank = rank()
        self.say = print if self.rank == 0 else (lambda *a, **k: None)

    # one timed, resumable stage
    def stage(self, name: str, fn):
        if self.progress.done(name):
            self.say(f"[{name}] done in an earlier run: {self.progress.data['stages'][name]}")
            return self.progress.data["stages"][name]
        t0 = time.perf_counter()
        self.prior_seconds = 0.0  # set by train_phase when fn resumes a training phase
        result = fn()
        self.progress.record(name, result, time.perf_counter() - t0 + self.prior_seconds)
        if isinstance(result, dict) and result.get(self.metric) is not None:
            self.say(f"[{name}] {self.metric} {result[self.metric]:.4f}")
        elif isinstance(result, dict) and result.get("reason"):
            self.say(f"[{name}] not measured: {result['reason']}")
        return result

    def run(self) -> dict:
        self._out_lock = None
        try:
            return self._run()
        finally:
            if self._out_lock is not None:  # released now, not when the Job is collected
                self._out_lock.close()

    def _run(self) -> dict:
        o = self.opts
        t_start = time.perf_counter()
        own_group = not (dist.is_available() and dist.is_initialized())
        if o.task not in ("text-classification", "causal-lm"):
            raise JobError(f"--task {o.task!r}: choose text-classification or causal-lm")
        if o.max_steps is not None and o.max_steps < 1:
            raise JobError(f"--max-steps must be >= 1, got {o.max_steps}")
        if not o.epochs > 0:
            raise JobError(f"--epochs must be > 0, got {o.epochs}")
        if self.rank == 0:
            check_out(o)  # cheap: before the model loads (prepare_out checks again)
        self.device = job_device(o.device)
        doc = job_config(o)
        cfg = as_config(doc)
        kd = cfg.compression.distillation
        if kd.enabled and kd.teacher == "baseline" and not (o.baseline or o.baseline_from):
            raise JobError(
                "compression_training.distillation.teacher: 'baseline' is the FP32 fine-tune "
                "of this run: add --baseline (or --baseline-from RUN)"
            )
        from .models import check_model_folder

        check_model_folder(o.model)
        if kd.enabled and kd.teacher not in ("self", "baseline"):
            # a teacher folder is loaded only for the compressed run, after the FP32 stages: check it now
            folder = os.path.expanduser(kd.teacher)
            if not (os.path.isdir(folder) and os.path.isfile(os.path.join(folder, "config.json"))):
                raise JobError(
                    f"compression_training.distillation.teacher in {' + '.join(o.configs)}: "
                    f"{kd.teacher!r} is not 'self', 'baseline' or a model folder with a config.json"
                )
        tok = load_tokenizer(o.model)
        try:
            data = prepare_data(
                o.task,
                o.data,
                tok,
                eval_data=o.eval_data,
                eval_fraction=o.eval_fraction,
                seed=o.seed,
                max_length=o.max_length,
                text_column=o.text_column,
                label_column=o.label_column,
                max_train_samples=o.max_train_samples,
                max_eval_samples=o.max_eval_samples,
            )
        except DataError as err:
            raise JobError(str(err)) from None
        self.say(f"data: {data.summary}")
        if o.eval_data is not None and os.path.realpath(o.eval_data) == os.path.realpath(o.data):
            msg = (
                f"--eval-data is --data ({o.data}): every stage is measured on the training data, "
                "so the metrics say nothing about unseen text"
            )
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        # The model loads and --baseline-from / --resume are checked before --out is touched:
        # --overwrite deletes the previous run, which a bad input must not cost.
        model = load_model(o.model, o.task, data.labels, o.seed, tok.pad_token_id, o.dtype)
        check_max_length(model, o.model, o.max_length)  # else an IndexError in the first forward
        check_compression(model, doc, o.configs, self.planned_steps(cfg, len(data.train)), o.ptq_range_steps)
        self.data_digest = data_digest(data)
        if o.baseline_from:
            baseline_source(o, plain_config(doc), self.data_digest)
        self.progress = Progress(o.out, o.fingerprint(self.data_digest), o.resume, self.rank, world())
        self.earlier_seconds = sum(self.progress.data["wall_time_s"].values())
        if self.progress.world_note:
            self.say(f"warning: {self.progress.world_note}")
        o.notes.extend(self.progress.data.get("notes", []))
        self._out_lock = prepare_out(o, self.rank)
        barrier()
        self.metric = metric_name(o.task)
        self.tok, self.data, self.doc, self.cfg = tok, data, doc, cfg
        cls_name, n_params = describe(model)
        size_fp32 = fp32_bytes(model)
        self.say(
            f"model: {cls_name}, {n_params:,} parameters, {size_fp32 / 2**20:.1f} MiB in FP32; "
            f"training on {_device_name(self.device)}"
        )
        model.to(self.device)

        stages: Dict[str, Optional[dict]] = {}
        ev = self.evaluator()
        stages["fp32"] = self.stage("fp32", lambda: ev(model))
        self.finetuned = None  # the FP32 fine-tune: PTQ source and `teacher: baseline`
        if o.baseline or o.baseline_from:
            self.finetuned, stages["fp32_finetuned"] = self.baseline(model, doc)
        ptq_models = []

        def ptq_model():
            if not ptq_models:
                ptq_models.append(
                    quantize_without_training(model if self.finetuned is None else self.finetuned, cfg, self.calibrate)
                )
            return ptq_models[0]

        stages["ptq"] = self.stage("ptq", lambda: ev(ptq_model()))
        if o.ptq_range_steps:
            stages["ptq_learned"] = self.stage("ptq_learned", lambda: ev(self.learned_ranges(ptq_model())))
        ptq_models.clear()

        engine, train_info = self.compressed_run(model, doc)
        # split over ranks (tensor / pipeline parallel): rank 0 measures the whole model, rebuilt
        # from the final checkpoint by release_ranks
        split = engine.parallel.mesh is not None
        if not split:
            stages["qat"] = self.stage("qat", lambda: ev(engine.module, forward=None))
        trained = self.release_ranks(engine, own_group)
        if self.rank != 0:
            return {}
        if split:
            stages["qat"] = self.stage("qat", lambda: ev(trained))
        report_bits = loop.final_bits(trained)
        rotation = rotation_report(trained)
        if rotation:
            o.notes.append(rotation["summary"])
        for line in loop.schedule_shortfalls(trained):
            self.say(f"warning: {line}")
            o.notes.append(line)
        export_dir = os.path.join(o.out, "export")
        stages["exported"], export_bytes = self.exported(trained, export_dir)
        float_emb = float_embeddings(trained, export_dir)
        note = float_embedding_note(float_emb, export_bytes)
        if note:
            o.notes.append(note)
        stages["transformers"] = self.stage("transformers", lambda: self.transformers_stage(trained, export_dir))
        report = dict(
            task=o.task,
            model=os.path.abspath(o.model),
            model_class=cls_name,
            parameters=n_params,
            configs=list(o.configs),
            config=doc,
            metric=self.metric,
            data=dict(
                summary=data.summary,
                train=len(data.train),
                eval=len(data.eval),
                labels=data.labels,
                path=os.path.abspath(o.data),
                eval_data=o.eval_data and os.path.abspath(o.eval_data),
            ),
            training=train_info,
            stages=stages,
            sizes=dict(
                fp32_bytes=size_fp32,
                export_bytes=export_bytes,
                compression_ratio=(size_fp32 / export_bytes) if export_bytes else None,
                float_embedding_bytes=sum(float_emb.values()),
            ),
            wall_time_s=dict(self.progress.data["wall_time_s"]),
            final_bits=report_bits,
            rotation=rotation,
            notes=list(o.notes),
        )
        # this attempt, plus the stages and the partial training earlier attempts recorded
        report["wall_time_s"]["total"] = round(time.perf_counter() - t_start + self.earlier_seconds, 3)
        self.finish(report)
        return report

    def exported(self, model, export_dir):
        """Export (atomically: a complete folder replaces the old one) and reload with load_quantized."""
        o = self.opts

        def export_and_reload():
            nbytes = export_model(model, self.doc, self.tok, export_dir)
            fresh, mode = self.reload(model, export_dir)
            result = self.evaluator()(fresh)
            result["reload_mode"] = mode
            result["max_logit_diff_vs_qat"] = max_logit_difference(
                model, fresh, self.data.eval, o.eval_batch_size, self.tok.pad_token_id
            )
            result["export_bytes"] = nbytes
            result["verify"] = offline_verify(export_dir)  # qcompress verify's offline part
            for line in result["verify"]["problems"]:
                self.say(f"[verify] {line}")
            self._exported_model = fresh
            return result

        result = self.stage("exported", export_and_reload)
        return result, result["export_bytes"]

    def reload(self, model, export_dir):
        """(the export loaded by load_quantized into a fresh model, the mode used). A model whose
        eval-mode forward runs the integer kernel (`int8_forward: true`) computes what the fast
        kernels compute: it is compared with that reload (the exact one differs by the float GEMM's
        rounding), without fused epilogues (their GELU is the kernels', not the one training ran).
        `auto` evaluates with the float forward: the exact reload. The reload runs where the
        trained model runs (the same kernels: equal logits)."""
        import qcompress

        mode = int8_forward.reload_mode(model)
        fresh = qcompress.load_quantized(
            export_dir, fresh_model(model, self.opts.task), mode=mode, fuse_activations=False
        )
        from ..export.lora import with_adapter

        fresh = with_adapter(fresh, export_dir)  # mode qlora: peft loads the adapter beside the base
        return fresh.to(device_of(model)), mode

    def transformers_stage(self, model, export_dir):
        o = self.opts
        reference = getattr(self, "_exported_model", None)
        if reference is None:  # 'exported' finished in an earlier run (--resume): reload it here
            reference = self.reload(model, export_dir)[0]

        def run(model):
            result = self.evaluator()(model)
            if reference is not None:
                result["max_logit_diff_vs_exported"] = max_logit_difference(
                    reference, model, self.data.eval, o.eval_batch_size, self.tok.pad_token_id
                )
                result["max_weight_diff_vs_exported"] = max_weight_difference(reference, model)
            return result

        result = transformers_attempts(export_dir, o.task, run, o.dtype)
        result.setdefault(self.metric, None)
        diff, wdiff = result.get("max_logit_diff_vs_exported"), result.get("max_weight_diff_vs_exported")
        if diff is not None and diff > 1e-3:
            why = (
                why_logits_differ(export_dir, result["loaded_with"])
                if wdiff == 0.0
                else f"other weights (max |difference| {wdiff:.3g})"
            )
            self.opts.notes.append(
                f"transformers' {result['loaded_with']} gives other logits than qcompress.load_quantized "
                f"(max |difference| {diff:.3g}): {why}; the 'exported' row is the trained model"
            )
        return result

    def finish(self, report: dict) -> None:
        o = self.opts
        plots = []
        runs = {"compressed": read_metrics(os.path.join(o.out, "metrics.csv"))}
        if os.path.isfile(os.path.join(o.out, "metrics_fp32.csv")):
            runs["FP32 fine-tune"] = read_metrics(os.path.join(o.out, "metrics_fp32.csv"))
        if plot_loss(os.path.join(o.out, "plots", "loss.png"), runs):
            plots.append("plots/loss.png")
        if plot_bits(os.path.join(o.out, "plots", "bits.png"), runs["compressed"]):
            plots.append("plots/bits.png")
        write_report(o.out, report)  # last: a folder with report.json holds a finished run
        kept = settle_checkpoints(o.out, o.keep_checkpoints)
        self.say("")
        self.say(stage_table(report))
        sz = report["sizes"]
        if sz.get("export_bytes"):
            self.say(
                f"\nexport: {sz['export_bytes'] / 2**20:.2f} MiB vs {sz['fp32_bytes'] / 2**20:.2f} MiB FP32 "
                f"({sz['compression_ratio']:.2f}x smaller), in {os.path.join(o.out, 'export')}"
            )
        for note in report.get("notes") or []:
            self.say(f"note: {note}")
        self.say(f"report: {os.path.join(o.out, 'report.md')} (and report.json, metrics.csv)")
        if o.keep_checkpoints == "none":
            self.say(
                "checkpoints: removed (--keep-checkpoints none); the run cannot lend its baseline (--baseline-from)"
            )
        else:
            self.say(
                f"checkpoints: {kept / 2**20:.1f} MiB in {os.path.join(o.out, 'checkpoints')} "
                f"(--keep-checkpoints {o.keep_checkpoints}; `none` removes them once a run is finished)"
            )
        if plots:
            self.say("plots: " + ", ".join(os.path.join(o.out, p) for p in plots))
        else:
            from ..errors import install_hint

            self.say(f"plots: not drawn (matplotlib is not installed: {install_hint('plot')})")


def float_embedding_note(found: dict, export_bytes: int, share: float = 0.1) -> str:
    """The report's note when full-precision embedding tables are at least `share` of the export."""
    total = sum(found.values())
    if not export_bytes or total < share * export_bytes:
        return ""
    names = ", ".join(sorted(found, key=found.get, reverse=True)[:3]) + (" ..." if len(found) > 3 else "")
    return (
        f"{total / 2**20:.1f} MiB of the {export_bytes / 2**20:.1f} MiB export ({100 * total / export_bytes:.0f} %) "
        f"are embedding tables kept in full precision ({names}): the recipes quantize the Linear layers "
        "only, the ones compressed-tensors' loaders (transformers, vLLM) read. Adding the with_embeddings "
        "fragment (qcompress train w8a8 with_embeddings ...) stores them in 8 bits, an export only "
        "qcompress.load_quantized reads"
    )


def settle_checkpoints(out: str, keep: str) -> int:
    """What a finished run keeps of --out/checkpoints (--keep-checkpoints): `none` removes the engine
    checkpoints and the baseline's weights (progress.json stays: the stages' results). Returns the
    bytes left there."""
    import shutil

    folder = os.path.join(out, "checkpoints")
    if keep == "none" and os.path.isdir(folder):
        for name in os.listdir(folder):
            if name == "progress.json":
                continue
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
    total = 0
    for base, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(base, f)) for f in files)
    return total


def rotation_report(model) -> Optional[dict]:
    """What init_compression rotated (the record transforms/ keeps on the model), with its summary
    line: rotations, blocks, and a head untied from its embedding."""
    from ..transforms import describe, record_of
    from ..unwrap import unwrap

    rec = record_of(unwrap(model))
    return None if rec is None else {**rec, "summary": describe(rec)}


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return f"the CPU ({torch.get_num_threads()} threads)"


def run_job(opts: JobOptions) -> dict:
    return Job(opts).run()
