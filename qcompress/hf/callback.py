"""CompressionCallback: compression training inside a transformers Trainer.

    cb = CompressionCallback(cfg, export_dir="out/export")
    trainer = Trainer(model, args, train_dataset=..., processing_class=tok, callbacks=[cb])
    trainer.train()                            # or train(resume_from_checkpoint=True)

What it does at each Trainer event:
  on_init_end    init_compression(model, cfg) unless the model is already rewritten, before the
                 Trainer builds its optimizer (topk scores get trained); builds the scheduler
  on_train_begin resuming (global_step > 0): reloads the scheduler state from
                 <output_dir>/checkpoint-<global_step>/ (the folder the Trainer resumes from),
                 or from the folder given to resume_from()
  on_step_end    one scheduler step per optimizer step (gradient accumulation counts once)
  on_save        writes the scheduler state into the checkpoint folder the Trainer just wrote
  on_train_end   with load_best_model_at_end: the best checkpoint's compression state, to go with
                 the weights the Trainer has just loaded from it; then export_quantized(model,
                 export_dir) plus the tokenizer files
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import uuid
import warnings
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import TrainerCallback

from ..config import as_config
from ..errors import ConfigError
from ..serialize import flatten, tensor_keys, unflatten
from ..export import export_quantized
from ..calibrate.input_moments import calibrate_weight_ranges, needs_calibration
from ..export.safetensors_io import existing_outputs
from ..rewrite import init_compression
from ..nn.pld import pld_schedule
from ..schedule import REWRITTEN, CompressionScheduler
from ..unwrap import unwrap

log = logging.getLogger("qcompress.hf")
CALIBRATION_BATCHES = 8  # observer_kwargs.weight_by: inputs (as qcompress train)

STATE_JSON = "qcompress_compression.json"  # skeleton + step; written last
STATE_TENSORS = "qcompress_compression.safetensors"  # masters, observer ranges, masks
STATE_FORMAT = "qcompress-compression-state"
CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR


def _root(model):
    return unwrap(model)


def _write_atomic(folder: str, name: str, write) -> None:
    """write(tmp_path) into a temporary file beside `name`, fsync, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_compression_state(scheduler: CompressionScheduler, folder: str) -> None:
    """Write the scheduler state into `folder`: tensors in safetensors, the rest in JSON, each
    file atomically (temporary file + rename), the JSON last. A token binds the pair."""
    tensors: dict = {}
    skeleton = flatten(scheduler.state_dict(), "compression", tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    token = uuid.uuid4().hex
    meta = {"training_steps": str(scheduler.training_steps), "token": token}
    _write_atomic(folder, STATE_TENSORS, lambda path: save_file(tensors, path, metadata=meta))
    doc = {
        "format": STATE_FORMAT,
        "version": 1,
        "training_steps": scheduler.training_steps,
        "token": token,
        "state": skeleton,
    }

    def write_json(path):
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)

    _write_atomic(folder, STATE_JSON, write_json)


def load_compression_state(scheduler: CompressionScheduler, folder: str) -> None:
    """Restore what save_compression_state wrote (no pickle: JSON + safetensors)."""
    jpath, tpath = os.path.join(folder, STATE_JSON), os.path.join(folder, STATE_TENSORS)
    for path in (jpath, tpath):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path}: no qcompress compression state here (was the checkpoint "
                "written by a Trainer with a CompressionCallback? A run killed while "
                "saving leaves the Trainer's files without it: resume from the "
                "checkpoint before)"
            )
    try:
        with open(jpath, "r", encoding="utf-8") as fh:
            doc = json.load(fh)
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}")
        skeleton, token = doc["state"], doc["token"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{jpath}: not a qcompress compression state ({err})") from None
    try:
        with safe_open(tpath, framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"{tpath}: unreadable safetensors file ({err})") from None
    if meta.get("token") != token:
        raise ValueError(
            f"{tpath} does not belong to {STATE_JSON} in the same folder (written by "
            "another save; an interrupted checkpoint?)"
        )
    missing = [k for k in tensor_keys(skeleton) if k not in tensors]
    if missing:
        raise ValueError(f"{tpath}: tensor {missing[0]!r} is missing")
    scheduler.load_state_dict(unflatten(skeleton, tensors))


def _check_same_checkpoint(folder: str, state) -> None:
    """Refuse `folder` when its trainer_state.json is not the one the Trainer resumed from: a
    checkpoint of another run under output_dir with the same step number (train() given a folder
    elsewhere without resume_from), or resume_from() given another folder than train(). The two
    records are equal when they come from one file (JSON floats round-trip exactly)."""
    path = os.path.join(folder, "trainer_state.json")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError):
        return  # not a Trainer checkpoint folder: nothing to compare
    ours = {"global_step": state.global_step, "total_flos": state.total_flos, "log_history": state.log_history}
    if any(saved.get(key) != value for key, value in ours.items()):
        raise ValueError(
            f"{folder} is not the checkpoint the Trainer resumed from (its trainer_state.json "
            "differs from the one loaded): for train(resume_from_checkpoint=PATH) call "
            "callback.resume_from(PATH) with the same folder first"
        )


def check_training_args(cfg, args) -> None:
    """Refuse a config whose training keys disagree with the TrainingArguments: the Trainer trains
    by its arguments and would ignore the config's values silently (as transformers' DeepSpeed
    integration, which refuses such mismatches too). Keys the config leaves unset are not compared."""
    world = max(int(getattr(args, "world_size", 1) or 1), 1)
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    raw = cfg.raw if isinstance(cfg.raw, dict) else {}
    wrong = []
    for key, ours, theirs, name in (
        ("fp16.enabled", cfg.fp16.enabled, bool(args.fp16), "fp16"),
        ("bf16.enabled", cfg.bf16.enabled, bool(args.bf16), "bf16"),
    ):
        if ours and not theirs:  # the config asks for a precision the Trainer will not use
            wrong.append((key, ours, f"TrainingArguments.{name}", theirs))
    for key, theirs, name in (
        ("gradient_accumulation_steps", ga, "TrainingArguments.gradient_accumulation_steps"),
        ("train_micro_batch_size_per_gpu", micro, "TrainingArguments.per_device_train_batch_size"),
        (
            "train_batch_size",
            micro * ga * world,
            f"per_device_train_batch_size x gradient_accumulation_steps x world size ({micro} x {ga} x {world})",
        ),
    ):
        ours = getattr(cfg, key)
        if ours is not None and ours != theirs:
            wrong.append((key, ours, name, theirs))
    if cfg.seed is not None and getattr(args, "seed", None) is not None and cfg.seed != args.seed:
        wrong.append(("seed", cfg.seed, "TrainingArguments.seed", args.seed))
    if (
        "gradient_clipping" in raw
        and "gradient_clipping" not in cfg.auto_keys
        and float(cfg.gradient_clipping) != float(args.max_grad_norm or 0.0)
    ):
        wrong.append(
            ("gradient_clipping", cfg.gradient_clipping, "TrainingArguments.max_grad_norm", args.max_grad_norm)
        )
    if wrong:
        lines = "; ".join(f"{key} is {ours!r} but {name} is {theirs!r}" for key, ours, name, theirs in wrong)
        raise ConfigError(
            wrong[0][0],
            f"the config disagrees with the Trainer's arguments, which decide "
            f"how it trains: {lines}; make them agree (or drop the keys from the config)",
        )
    if getattr(args, "deepspeed", None) is None:
        unused = [key for key in ("optimizer", "scheduler") if getattr(cfg, key) is not None]
        if cfg.zero_optimization.stage > 0:
            unused.append("zero_optimization")
        if unused:
            warnings.warn(
                f"CompressionCallback: the config's {', '.join(unused)} section(s) are not used: "
                "the Trainer builds its optimizer and schedule from its TrainingArguments "
                "(learning_rate, lr_scheduler_type, ...)",
                stacklevel=3,
            )


class CompressionCallback(TrainerCallback):
    """Applies a qcompress config to the Trainer's model and drives its compression schedule;
    see the module docstring. `force` lets the final export overwrite `export_dir`."""

    def __init__(self, cfg, export_dir: Optional[str] = None, *, force: bool = False):
        self.cfg = as_config(cfg)
        self.export_dir = os.fspath(export_dir) if export_dir is not None else None
        self.force = force
        self.scheduler: Optional[CompressionScheduler] = None
        self.model = None
        self._resume_folder: Optional[str] = None

    # --- setup ----------------------------------------------------------------------------------
    def _setup(self, model) -> None:
        if model is None:
            raise ValueError(
                "CompressionCallback: the Trainer has no model (model_init is not supported: build the model first)"
            )
        if self.scheduler is not None and model is self.model:
            return
        if not getattr(_root(model), REWRITTEN, False):
            init_compression(model, self.cfg)
            # the config's activation_checkpointing section, as qcompress.initialize applies it
            # (the Trainer's own gradient_checkpointing argument works too)
            from ..engine.activation_checkpointing import from_config

            from_config(_root(model), self.cfg)
        self.model = model
        self.scheduler = CompressionScheduler(model, self.cfg)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        check_training_args(self.cfg, args)
        self._setup(model)
        if self.export_dir and not self.force and args.should_save:
            old = existing_outputs(self.export_dir)
            if old:  # fail now, not after training
                raise FileExistsError(
                    f"{os.path.join(self.export_dir, old[0])} already exists; pass "
                    "CompressionCallback(..., force=True) to overwrite it"
                )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The Trainer has loaded the checkpoint's model weights by now; that load drops the master
        # copies (nn/layers.py), so the compression state must be restored after it, here.
        self._setup(model)
        sched = self.scheduler
        folder, self._resume_folder = self._resume_folder, None
        if folder is None and state.global_step > 0 and sched.training_steps != state.global_step:
            # Trainer resumes from <output_dir>/checkpoint-<global_step> (it read that folder's
            # trainer_state.json); callbacks are not told the path, so rebuild it
            folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
            if not os.path.isdir(folder):
                raise FileNotFoundError(
                    f"resuming at step {state.global_step}, but {folder} does not exist: the compression "
                    "state is read from the checkpoint folder under args.output_dir; call "
                    "callback.resume_from(checkpoint_folder) before trainer.train() for a checkpoint "
                    "kept elsewhere"
                )
        if folder is not None:
            _check_same_checkpoint(folder, state)
            load_compression_state(sched, folder)
            if sched.training_steps != state.global_step:
                raise ValueError(
                    f"{folder}: compression state of step {sched.training_steps}, but the "
                    f"Trainer resumes at step {state.global_step}"
                )
            log.info("qcompress: compression state restored from %s (step %d)", folder, sched.training_steps)
        elif state.global_step == 0 and sched.training_steps > 0:
            log.warning(
                "qcompress: a new training run starts while the compression schedule is at "
                "step %d; it continues from there",
                sched.training_steps,
            )
        elif state.global_step == 0:
            self._calibrate(model, kwargs.get("train_dataloader"))
        pld = pld_schedule(_root(model))
        if pld is not None:  # progressive layer drop follows the step count alone
            pld.start_step(state.global_step, resumed=True)

    def _calibrate(self, model, loader) -> None:
        """observer_kwargs.weight_by: inputs: the input moments, and observer gptq: the solved
        weights, from the first CALIBRATION_BATCHES batches of the training dataloader, before the
        first step (a resumed run has them in its compression state)."""
        if loader is None or not needs_calibration(_root(model)):
            return
        dev = next(model.parameters()).device

        def forward(m, batch):
            return m(**{k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()})

        n = calibrate_weight_ranges(_root(model), itertools.islice(loader, CALIBRATION_BATCHES), forward)
        log.info(
            "qcompress: %d module(s) calibrated on %d training batches (input-weighted ranges, GPTQ solutions)",
            n,
            CALIBRATION_BATCHES,
        )

    def resume_from(self, folder: str) -> None:
        """Restore the compression state from `folder` (a checkpoint written by on_save) when
        train() starts: for train(resume_from_checkpoint=folder) with a folder outside
        args.output_dir."""
        self._resume_folder = os.fspath(folder)

    # --- training -------------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        # called once per optimizer step, after the update (not on accumulation micro-steps)
        self.scheduler.step()
        pld = pld_schedule(_root(self.model))
        if pld is not None:
            pld.start_step(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"the Trainer saved a checkpoint, but {folder} does not exist "
                "(hyper-parameter search runs are not supported)"
            )
        save_compression_state(self.scheduler, folder)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            # The Trainer has just loaded the best checkpoint's weights, which drops the master
            # copies; without its compression state the model would be those weights at the last
            # step's bits (never evaluated), and baking would fail in optimizer-step mode
            load_compression_state(self.scheduler, state.best_model_checkpoint)
            log.info(
                "qcompress: compression state of the best checkpoint %s (step %d) restored",
                state.best_model_checkpoint,
                self.scheduler.training_steps,
            )
        if not self.export_dir or not args.should_save:
            return
        export_quantized(self.model, self.export_dir, self.cfg, force=self.force)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(self.export_dir)
        log.info("qcompress: exported the quantized model to %s", self.export_dir)
