"""The main job: fine-tune a local Hugging Face model with compression on the user's data, evaluate
every stage, export a quantized checkpoint, and report what compression cost.

Stages (report.json "stages"): fp32 (the starting model), fp32_finetuned (--baseline: the same
budget without compression), ptq (quantized without training), qat (the compressed run after
training), exported (the export reloaded by load_quantized; equals qat), transformers (the export
loaded by transformers, where it can load that scheme). Every rank trains and evaluates; rank 0
alone writes files. A run interrupted at any point continues with --resume.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..config import as_config, load_config
from ..config.training import take_auto
from ..engine.engine import resolve_device
from ..nn import int8_forward
from . import loop
from .batches import device_of, to_device
from .data import DataError, prepare_data
from .errors import JobError
from .evaluate import evaluate, max_logit_difference, max_weight_difference, metric_name
from .outdir import LOCK_NAME, Progress, check_out, prepare_out  # noqa: F401  (LOCK_NAME: tests import it here)
from .models import check_max_length, describe, fp32_bytes, fresh_model, load_model, load_tokenizer
from .report import MetricsLog, plot_bits, plot_loss, read_metrics, stage_table, write_report
from ..nn.range_groups import range_parameter_ids, split_range_groups
from .stages import calibrate_static_ranges, export_model, quantize_without_training, transformers_attempts

log = logging.getLogger("qcompress.train")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class JobOptions:
    configs: List[str]
    model: str
    data: str
    task: str
    out: str
    eval_data: Optional[str] = None
    eval_fraction: float = 0.2
    text_column: str = "text"
    label_column: str = "label"
    max_length: int = 128
    epochs: float = 1.0
    max_steps: Optional[int] = None
    seed: int = 0
    baseline: bool = False
    resume: bool = False
    overwrite: bool = False
    lr: float = 1e-4
    batch_size: int = 32
    eval_batch_size: int = 64
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    save_steps: int = 50
    baseline_from: Optional[str] = None
    device: str = "auto"            # auto | cpu | cuda | cuda:N (where, not what: not in the fingerprint)
    ptq_range_steps: int = 0        # the ptq_learned stage (qcompress.learn_ranges); 0: none
    progress: bool = True
    notes: List[str] = field(default_factory=list)

    def fingerprint(self, data_digest: Optional[str] = None) -> str:
        """What a resumed run must share with the interrupted one (not out/resume/progress): files by
        absolute path and configs by content (`./a.yaml` from another folder is the same run), and
        the data by what was read from it (an edited data file is other data)."""
        keep = {k: v for k, v in asdict(self).items()
                if k not in ("out", "resume", "overwrite", "progress", "save_steps", "notes", "baseline_from",
                             "configs", "device")}
        if not self.ptq_range_steps:
            keep.pop("ptq_range_steps")     # runs without the stage keep their earlier fingerprint
        keep["model"], keep["data"] = os.path.abspath(self.model), os.path.abspath(self.data)
        keep["eval_data"] = self.eval_data and os.path.abspath(self.eval_data)
        keep["config_text"] = [_file_hex(c) for c in self.configs]
        keep["data_digest"] = data_digest
        return _digest(keep)

    def baseline_fingerprint(self, plain_doc: dict, data_digest: Optional[str] = None) -> str:
        """What decides the FP32 fine-tune: an earlier run with the same one can lend its baseline."""
        keep = {k: v for k, v in asdict(self).items()
                if k in ("model", "data", "task", "eval_data", "eval_fraction", "text_column", "label_column",
                         "max_length", "epochs", "max_steps", "seed", "lr", "batch_size", "eval_batch_size",
                         "max_train_samples", "max_eval_samples")}
        keep["model"], keep["data"] = os.path.abspath(self.model), os.path.abspath(self.data)
        keep["eval_data"] = self.eval_data and os.path.abspath(self.eval_data)   # same file, any cwd
        keep["plain_config"] = plain_doc
        keep["data_digest"] = data_digest
        return _digest(keep)


def _file_hex(path: str) -> str:
    if not os.path.isfile(path):
        return path
    with open(path, "rb") as fh:
        return fh.read().hex()


def data_digest(data) -> str:
    """A digest of the tokenized train and eval sets and the label names: the data a run saw."""
    h = hashlib.sha256(json.dumps(data.labels).encode())
    for part in (data.train, data.eval):
        h.update(b"|%d|" % len(part))
        for item in part.items:
            for key in sorted(item):
                h.update(key.encode())
                h.update(item[key].numpy().tobytes())
    return h.hexdigest()[:16]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --- set-up ------------------------------------------------------------------------------------

# scheduler values "auto" the job fills: rates from --lr, no warmup (the Trainer's default warmup_steps
# 0); the total step count it refuses, as it is not known before the data loads
_AUTO_SCHEDULER = {"warmup_max_lr": "lr", "cycle_max_lr": "lr", "warmup_min_lr": 0.0, "cycle_min_lr": 0.0,
                   "warmup_num_steps": 0}


def fill_auto(doc: dict, auto_keys, opts: JobOptions) -> dict:
    """The document with its "auto" values (transformers' DeepSpeed integration) filled as the Trainer
    fills them from its arguments, here from the job's: batch keys by --batch-size (as if absent),
    optimizer / scheduler learning rates by --lr, warmup steps 0; everything else "auto" takes
    qcompress's default (no clipping, fp32, the optimizer's own defaults, the ZeRO sizes)."""
    doc = take_auto(doc)[0]
    for key in auto_keys:
        if key == "optimizer.params.lr":
            doc["optimizer"]["params"]["lr"] = opts.lr
        elif key.startswith("scheduler.params."):
            name = key.rsplit(".", 1)[1]
            if name not in _AUTO_SCHEDULER:
                raise JobError(f"config key {key} is \"auto\": qcompress train fills in batch sizes, "
                               "learning rates and warmup steps; give it a number (the run's step count follows from "
                               "--max-steps or --epochs)")
            value = _AUTO_SCHEDULER[name]
            doc["scheduler"]["params"][name] = opts.lr if value == "lr" else value
    if auto_keys:
        log.info("qcompress train: \"auto\" config values filled from the job's options: %s",
                 ", ".join(auto_keys))
    return doc


def job_config(opts: JobOptions) -> dict:
    """The merged config document, with the job's defaults where the configs say nothing."""
    cfg = load_config(*opts.configs) if opts.configs else None
    doc = copy.deepcopy(cfg.raw) if cfg is not None else {}
    if cfg is not None and cfg.auto_keys:
        doc = fill_auto(doc, cfg.auto_keys, opts)
    if not any(k in doc for k in BATCH_KEYS):
        doc["train_batch_size"] = opts.batch_size
    cc = doc.get("compression_training") or {}
    if not isinstance(cc, dict) or not cc:
        raise JobError(f"the configs {opts.configs} have no compression_training section: nothing to "
                       "compress (see schedules/ for ready recipes)")
    as_config(doc)          # a ConfigError names the key before anything runs
    return doc


def plain_config(doc: dict) -> dict:
    """The same training without compression: the FP32 baseline's config."""
    return {k: v for k, v in doc.items() if k != "compression_training"}


def with_tensorboard(doc: dict, out: str, name: str) -> dict:
    """The engine's config for one training phase: TensorBoard events under out/tensorboard/<name>
    when tensorboard is installed and the configs do not set up their own monitor."""
    if "tensorboard" in doc:
        return doc
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        return doc
    return dict(doc, tensorboard={"enabled": True, "output_path": os.path.join(out, "tensorboard"),
                                  "job_name": name})


def client_optimizer(doc: dict, lr: float, model: Optional[torch.nn.Module] = None):
    """A default AdamW when the config has no optimizer section (initialize takes a factory), with
    learned ranges in groups of their own (qcompress/nn/range_groups.py: RANGE_LR_FACTOR x lr, no
    weight decay)."""
    if doc.get("optimizer"):
        return None

    def make(params):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        return torch.optim.AdamW(split_range_groups(groups, range_parameter_ids(model), lr),
                                 lr=lr, weight_decay=0.01)
    return make


def job_device(name: str) -> torch.device:
    """--device: auto is the GPU of this rank (cuda:LOCAL_RANK) when torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return resolve_device(name)
    except ValueError as err:
        raise JobError(f"--{err}") from None


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# --- the job -----------------------------------------------------------------------------------

class Job:
    def __init__(self, opts: JobOptions):
        self.opts = opts
        self.rank = _rank()
        self.say = print if self.rank == 0 else (lambda *a, **k: None)

    # one timed, resumable stage
    def stage(self, name: str, fn):
        if self.progress.done(name):
            self.say(f"[{name}] done in an earlier run: {self.progress.data['stages'][name]}")
            return self.progress.data["stages"][name]
        t0 = time.perf_counter()
        self.prior_seconds = 0.0        # set by train_phase when fn resumes a training phase
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
            if self._out_lock is not None:    # released now, not when the Job is collected
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
            check_out(o)        # cheap: before the model loads (prepare_out checks again)
        self.device = job_device(o.device)
        doc = job_config(o)
        cfg = as_config(doc)
        kd = cfg.compression.distillation
        if kd.enabled and kd.teacher == "baseline" and not (o.baseline or o.baseline_from):
            raise JobError("compression_training.distillation.teacher: 'baseline' is the FP32 fine-tune "
                           "of this run: add --baseline (or --baseline-from RUN)")
        from .models import check_model_folder
        check_model_folder(o.model)
        if kd.enabled and kd.teacher not in ("self", "baseline"):
            # a teacher folder is loaded only for the compressed run, after the FP32 stages: check it now
            folder = os.path.expanduser(kd.teacher)
            if not (os.path.isdir(folder) and os.path.isfile(os.path.join(folder, "config.json"))):
                raise JobError(f"compression_training.distillation.teacher in {' + '.join(o.configs)}: "
                               f"{kd.teacher!r} is not 'self', 'baseline' or a model folder with a config.json")
        tok = load_tokenizer(o.model)
        try:
            data = prepare_data(o.task, o.data, tok, eval_data=o.eval_data, eval_fraction=o.eval_fraction,
                                seed=o.seed, max_length=o.max_length, text_column=o.text_column,
                                label_column=o.label_column, max_train_samples=o.max_train_samples,
                                max_eval_samples=o.max_eval_samples)
        except DataError as err:
            raise JobError(str(err)) from None
        self.say(f"data: {data.summary}")
        if o.eval_data is not None and os.path.realpath(o.eval_data) == os.path.realpath(o.data):
            msg = (f"--eval-data is --data ({o.data}): every stage is measured on the training data, "
                   "so the metrics say nothing about unseen text")
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        # The model loads and --baseline-from / --resume are checked before --out is touched:
        # --overwrite deletes the previous run, which a bad input must not cost.
        model = load_model(o.model, o.task, data.labels, o.seed, tok.pad_token_id)
        check_max_length(model, o.model, o.max_length)     # else an IndexError in the first forward
        check_compression(model, doc, o.configs, self.planned_steps(cfg, len(data.train)), o.ptq_range_steps)
        self.data_digest = data_digest(data)
        if o.baseline_from:
            baseline_source(o, plain_config(doc), self.data_digest)
        self.progress = Progress(o.out, o.fingerprint(self.data_digest), o.resume, self.rank, _world())
        self.earlier_seconds = sum(self.progress.data["wall_time_s"].values())
        if self.progress.world_note:
            self.say(f"warning: {self.progress.world_note}")
        o.notes.extend(self.progress.data.get("notes", []))
        self._out_lock = prepare_out(o, self.rank)
        _barrier()
        self.metric = metric_name(o.task)
        self.tok, self.data, self.doc, self.cfg = tok, data, doc, cfg
        cls_name, n_params = describe(model)
        size_fp32 = fp32_bytes(model)
        self.say(f"model: {cls_name}, {n_params:,} parameters, {size_fp32 / 2**20:.1f} MiB in FP32; "
                 f"training on {_device_name(self.device)}")
        model.to(self.device)

        stages: Dict[str, Optional[dict]] = {}
        ev = self.evaluator()
        stages["fp32"] = self.stage("fp32", lambda: ev(model))
        self.finetuned = None          # the FP32 fine-tune: PTQ source and `teacher: baseline`
        if o.baseline or o.baseline_from:
            self.finetuned, stages["fp32_finetuned"] = self.baseline(model, doc)
        ptq_models = []

        def ptq_model():
            if not ptq_models:
                ptq_models.append(quantize_without_training(
                    model if self.finetuned is None else self.finetuned, cfg, self.calibrate))
            return ptq_models[0]
        stages["ptq"] = self.stage("ptq", lambda: ev(ptq_model()))
        if o.ptq_range_steps:
            stages["ptq_learned"] = self.stage("ptq_learned", lambda: ev(self.learned_ranges(ptq_model())))
        ptq_models.clear()

        engine, train_info = self.compressed_run(model, doc)
        stages["qat"] = self.stage("qat", lambda: ev(engine.module, forward=None))
        report_bits = loop.final_bits(engine.module)
        for line in loop.schedule_shortfalls(engine.module):
            self.say(f"warning: {line}")
            o.notes.append(line)
        trained = self.release_ranks(engine, own_group)
        if self.rank != 0:
            return {}
        export_dir = os.path.join(o.out, "export")
        stages["exported"], export_bytes = self.exported(trained, export_dir)
        stages["transformers"] = self.stage("transformers", lambda: self.transformers_stage(trained, export_dir))
        report = dict(
            task=o.task, model=os.path.abspath(o.model), model_class=cls_name, parameters=n_params,
            configs=list(o.configs), config=doc, metric=self.metric,
            data=dict(summary=data.summary, train=len(data.train), eval=len(data.eval),
                      labels=data.labels, path=os.path.abspath(o.data),
                      eval_data=o.eval_data and os.path.abspath(o.eval_data)),
            training=train_info, stages=stages,
            sizes=dict(fp32_bytes=size_fp32, export_bytes=export_bytes,
                       compression_ratio=(size_fp32 / export_bytes) if export_bytes else None),
            wall_time_s=dict(self.progress.data["wall_time_s"]), final_bits=report_bits,
            notes=list(o.notes))
        # this attempt, plus the stages and the partial training earlier attempts recorded
        report["wall_time_s"]["total"] = round(time.perf_counter() - t_start + self.earlier_seconds, 3)
        self.finish(report)
        return report

    # --- pieces -----------------------------------------------------------------------------
    def evaluator(self):
        o = self.opts

        def ev(model, forward=None):
            return evaluate(model, self.data.eval, o.task, o.eval_batch_size, self.tok.pad_token_id,
                            forward=forward)
        return ev

    def calibration_batches(self, device=None, n: int = 8):
        """A few training batches for static activation ranges (PTQ has no training to set them)
        and input-weighted weight ranges (observer_kwargs.weight_by: inputs)."""
        from .batches import eval_batches
        for i, b in enumerate(eval_batches(self.data.train, self.opts.eval_batch_size, self.tok.pad_token_id)):
            if i >= n:
                break
            b.pop("labels")
            yield b if device is None else to_device(b, device)

    def calibrate(self, model) -> None:
        """PTQ's calibration: static activation ranges (training mode), then the input moments of
        input-weighted weight ranges (eval mode, static ranges set)."""
        import qcompress
        calibrate_static_ranges(model, self.calibration_batches())
        qcompress.calibrate_weight_ranges(model, self.calibration_batches(device_of(model)))

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
        self.say(f"[ptq_learned] {out['steps']} steps on the learned ranges, loss {out['first_loss']:.4f} -> "
                 f"{out['last_loss']:.4f}")
        return model

    def planned_steps(self, cfg, n_train: int) -> int:
        """The optimizer steps each phase will take, from the configs before any engine exists (a
        batch size that does not fit the world size is a ConfigError here, not after the FP32 stages)."""
        from ..engine.batch import resolve_batch
        from .batches import steps_per_epoch
        world = _world()
        tbs, _, _ = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                  cfg.gradient_accumulation_steps, world)
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
        return loop.Phase(name=name, engine=engine, dataset=self.data.train, task=o.task,
                          steps=self.steps(engine), seed=o.seed, pad_id=self.tok.pad_token_id,
                          ckpt_dir=os.path.join(o.out, "checkpoints", ckpt), save_steps=o.save_steps,
                          metrics=metrics, distiller=distiller, progress=o.progress)

    def train_phase(self, phase) -> None:
        start = loop.resume(phase) if self.opts.resume else 0
        if phase.metrics is not None:
            phase.metrics.resume_at(start if start else None)
        if start:
            self.say(f"[{phase.name}] resuming at step {start} of {phase.steps}")
        loop.run(phase, start)
        self.prior_seconds = phase.prior_seconds     # its earlier attempts' training time
        self.earlier_seconds += phase.prior_seconds

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
            copy_.load_state_dict(load_file(source), strict=False)   # tied weights are saved once
            return copy_, self.progress.data["stages"]["fp32_finetuned"]

        trained = {"model": copy_}

        def train_and_eval():
            plain = plain_config(doc)
            engine = qcompress.initialize(copy_, with_tensorboard(plain, o.out, "fp32_finetuned"),
                                          optimizer=client_optimizer(plain, o.lr), device=self.device)
            self.train_phase(self.make_phase("fp32_finetuned", engine, "fp32", "metrics_fp32.csv"))
            result = self.evaluator()(engine.module)
            sd = _full_state_dict(engine.module)     # collective under ZeRO 2/3: every rank calls it
            if engine.sharded:
                # FSDP2 sharded copy_ in place: PTQ deep-copies the fine-tune and the teacher runs it
                # on every rank, so they get a whole, unsharded model (deepcopy of FSDP raised)
                whole = fresh_model(copy_, o.task)
                whole.load_state_dict(sd, strict=False)
                trained["model"] = whole.to(self.device).eval()
            if self.rank == 0:
                _drop_shared(sd)
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
            for src_file, dst in ((theirs, weights), (os.path.join(src, "metrics_fp32.csv"),
                                                      os.path.join(self.opts.out, "metrics_fp32.csv"))):
                if os.path.isfile(src_file):
                    shutil.copyfile(src_file, dst + ".tmp")
                    os.replace(dst + ".tmp", dst)
        _barrier()
        self.progress.record("fp32_finetuned", saved["stages"]["fp32_finetuned"],
                             (saved.get("wall_time_s") or {}).get("fp32_finetuned", 0.0))
        self.opts.notes.append(f"fp32_finetuned was trained by the run in {src} (--baseline-from)")
        return theirs

    def teacher(self, spec: str, model, load_teacher):
        """The distillation teacher: 'baseline' (our job's extension) is this run's FP32 fine-tune;
        'self' the starting model (a fresh classification head teaches noise: say so); else a folder."""
        o = self.opts
        if spec == "baseline":
            if self.finetuned is None:
                raise JobError("compression_training.distillation.teacher: 'baseline' is the FP32 fine-tune "
                               "of this run: add --baseline (or --baseline-from RUN)")
            return load_teacher("self", self.finetuned, None)
        if spec == "self" and getattr(model, "qc_fresh_head", False):
            msg = ("compression_training.distillation.teacher is 'self', but the starting model's "
                   "classification head is freshly initialised, so its logits are noise; use "
                   "`teacher: baseline` with --baseline, or a fine-tuned model folder")
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        teacher = load_teacher(spec, model, lambda p: load_model(p, o.task, self.data.labels, o.seed,
                                                                          self.tok.pad_token_id))
        if spec != "self" and getattr(teacher, "qc_fresh_head", False):
            head = (f"classification head for these {len(self.data.labels)} labels" if self.data.labels
                    else "language-model head")
            msg = (f"compression_training.distillation.teacher {spec!r} has no {head}, so it got a fresh one "
                   "and its logits are noise; use a model fine-tuned for this task, or `teacher: baseline` "
                   "with --baseline")
            self.say(f"warning: {msg}")
            o.notes.append(msg)
        return teacher

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
        weighted = qcompress.calibrate_weight_ranges(model, self.calibration_batches(device_of(model)))
        if weighted:
            self.say(f"[qat] weight ranges of {weighted} module(s) weighted by their inputs on "
                     "8 calibration batches (observer_kwargs.weight_by)")
        forward_note = int8_forward.describe(model)
        if forward_note:
            self.say(f"[qat] {forward_note}")
        engine = qcompress.initialize(model, with_tensorboard(doc, o.out, "qat"),
                                      optimizer=client_optimizer(doc, o.lr, model), device=self.device)
        distiller = Distiller.from_config(self.cfg, teacher) if teacher is not None else None
        phase = self.make_phase("qat", engine, "qat", "metrics.csv", distiller)
        t0 = time.perf_counter()
        if self.progress.done("qat_train"):
            loop.resume(phase)            # the trained weights and compression state
        else:
            self.train_phase(phase)
            self.progress.record("qat_train", {"steps": phase.steps}, time.perf_counter() - t0 + phase.prior_seconds)
        info = dict(steps=phase.steps, train_batch_size=engine.train_batch_size,
                    micro_batch_size=engine.train_micro_batch_size_per_gpu,
                    gradient_accumulation_steps=engine.gradient_accumulation_steps,
                    world_size=engine.world_size, precision=engine.precision,
                    zero_stage=engine.stage, optimizer=(doc.get("optimizer") or {}).get("type", "AdamW (default)"),
                    distillation=distiller is not None, seed=o.seed, max_length=o.max_length)
        return engine, info

    def release_ranks(self, engine, own_group: bool):
        """After training and the qat stage, export and reloading are rank 0's alone: end the process
        group we created (transformers' compressed-tensors loader runs collectives of its own when
        one exists) and return the trained model unsharded. Sharded (ZeRO 2/3) weights come back
        whole from the final engine checkpoint through a one-process engine."""
        if not (dist.is_available() and dist.is_initialized()):
            return engine.module
        _barrier()
        if own_group:
            dist.destroy_process_group()
        if self.rank != 0 or not engine.sharded:
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

    def exported(self, model, export_dir):
        """Export (atomically: a complete folder replaces the old one) and reload with load_quantized."""
        o = self.opts

        def export_and_reload():
            nbytes = export_model(model, self.doc, self.tok, export_dir)
            fresh, mode = self.reload(model, export_dir)
            result = self.evaluator()(fresh)
            result["reload_mode"] = mode
            result["max_logit_diff_vs_qat"] = max_logit_difference(model, fresh, self.data.eval,
                                                                   o.eval_batch_size, self.tok.pad_token_id)
            result["export_bytes"] = nbytes
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
        fresh = qcompress.load_quantized(export_dir, fresh_model(model, self.opts.task), mode=mode,
                                         fuse_activations=False)
        return fresh.to(device_of(model)), mode

    def transformers_stage(self, model, export_dir):
        o = self.opts
        reference = getattr(self, "_exported_model", None)
        if reference is None:       # 'exported' finished in an earlier run (--resume): reload it here
            reference = self.reload(model, export_dir)[0]

        def run(model):
            result = self.evaluator()(model)
            if reference is not None:
                result["max_logit_diff_vs_exported"] = max_logit_difference(
                    reference, model, self.data.eval, o.eval_batch_size, self.tok.pad_token_id)
                result["max_weight_diff_vs_exported"] = max_weight_difference(reference, model)
            return result
        result = transformers_attempts(export_dir, o.task, run)
        result.setdefault(self.metric, None)
        diff, wdiff = result.get("max_logit_diff_vs_exported"), result.get("max_weight_diff_vs_exported")
        if diff is not None and diff > 1e-3:
            why = ("the same weights (every dequantized weight equal), but its decompressed layers run "
                   "activations unquantized" if wdiff == 0.0 else f"other weights (max |difference| {wdiff:.3g})")
            self.opts.notes.append(
                f"transformers' {result['loaded_with']} gives other logits than qcompress.load_quantized "
                f"(max |difference| {diff:.3g}): {why}; the 'exported' row is the trained model")
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
        write_report(o.out, report)     # last: a folder with report.json holds a finished run
        self.say("")
        self.say(stage_table(report))
        sz = report["sizes"]
        if sz.get("export_bytes"):
            self.say(f"\nexport: {sz['export_bytes'] / 2**20:.2f} MiB vs {sz['fp32_bytes'] / 2**20:.2f} MiB FP32 "
                     f"({sz['compression_ratio']:.2f}x smaller), in {os.path.join(o.out, 'export')}")
        for note in report.get("notes") or []:
            self.say(f"note: {note}")
        self.say(f"report: {os.path.join(o.out, 'report.md')} (and report.json, metrics.csv)")
        if plots:
            self.say("plots: " + ", ".join(os.path.join(o.out, p) for p in plots))
        else:
            self.say("plots: not drawn (matplotlib is not installed: pip install 'qcompress[plot]')")


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return f"the CPU ({torch.get_num_threads()} threads)"


def check_compression(model: torch.nn.Module, doc: dict, configs: List[str], steps: int,
                      ptq_range_steps: int = 0) -> None:
    """Apply the configs to a throwaway copy of the model, so the mistakes only the model reveals (a
    module claimed by two groups, tied weights quantized unalike, a regex selecting only attention
    internals) stop the job before anything is written or trained, not after the FP32 stages; so
    does a run that would have nothing quantized to export after its last step (`steps`)."""
    import logging
    import warnings

    import qcompress
    from ..errors import ConfigError
    probe = copy.deepcopy(model)
    teacher = copy.deepcopy(model) if as_config(doc).compression.layer_reduction.enabled else None
    logger = logging.getLogger("qcompress")
    level = logger.level
    logger.setLevel(logging.ERROR)          # warnings (a group matching nothing) come once, later
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qcompress.init_compression(probe, doc, teacher_model=teacher)
    except ConfigError as err:
        raise JobError(f"config error in {' + '.join(configs)} for this model: {err}") from None
    finally:
        logger.setLevel(level)
    offsets = [q.offset for m in probe.modules() for q in (getattr(m, "qc_wq", None), getattr(m, "qc_aq", None))
               if q is not None]
    from ..learn_ranges import range_parameters
    learned = bool(range_parameters(probe))
    del probe, teacher
    if ptq_range_steps and not learned:
        raise JobError(f"--ptq-range-steps {ptq_range_steps} trains learned ranges, but no group of "
                       f"{' + '.join(configs)} has them: set range_learning: true in the weight (or static "
                       "activation) quantization groups, or leave --ptq-range-steps out")
    if not offsets:
        raise JobError(f"the configs {' + '.join(configs)} quantize no module of this model (no weight_quantization "
                       "or activation_quantization group matches one): qcompress train exports a quantized "
                       "checkpoint; see schedules/ for recipes")
    if min(offsets) > steps:
        raise JobError(f"quantization starts at step {min(offsets)} (schedule_offset in {' + '.join(configs)}) but "
                       f"the run ends at step {steps}: nothing would be quantized to export; lower schedule_offset "
                       "or train longer (--max-steps / --epochs)")


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
        raise JobError(f"--baseline-from {src}: no FP32 baseline there (run it with --baseline first)")
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as err:
        raise JobError(f"--baseline-from {src}: cannot read {path} ({err})") from None
    mine = opts.baseline_fingerprint(plain_doc, digest)
    if not isinstance(saved, dict) or saved.get("baseline_fingerprint") != mine \
            or "fp32_finetuned" not in (saved.get("stages") or {}):
        raise JobError(f"--baseline-from {src}: its FP32 baseline was trained with another model, data, "
                       "budget or training config; run --baseline instead")
    return saved


def _full_state_dict(model: torch.nn.Module) -> dict:
    """The model's state_dict as whole CPU tensors; a sharded (FSDP2 DTensor) entry is gathered,
    collectively, so every rank must call this in the same order."""
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().cpu().contiguous()
    return out


def _drop_shared(sd: dict) -> None:
    """safetensors refuses tensors sharing storage (tied embeddings): keep the first of each."""
    seen = set()
    for k in list(sd):
        ptr = (sd[k].data_ptr(), sd[k].numel())
        if ptr in seen and sd[k].numel():
            del sd[k]
        seen.add(ptr)


def run_job(opts: JobOptions) -> dict:
    return Job(opts).run()
