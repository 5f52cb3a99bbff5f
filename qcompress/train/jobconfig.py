"""The job's configuration: the merged config document with the job's defaults and "auto" values
filled, the default optimizer, the device, and a dry run of the compression config on the model."""

from __future__ import annotations

import copy
import logging
import os
from typing import List, Optional

import torch

from ..config import as_config, load_config
from ..config.training import take_auto
from ..engine.engine import resolve_device
from ..nn.range_groups import range_parameter_ids, split_range_groups
from .errors import JobError
from .options import JobOptions

log = logging.getLogger("qcompress.train")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# scheduler values "auto" the job fills: rates from --lr, no warmup (the Trainer's default warmup_steps
# 0); the total step count it refuses, as it is not known before the data loads
_AUTO_SCHEDULER = {
    "warmup_max_lr": "lr",
    "cycle_max_lr": "lr",
    "warmup_min_lr": 0.0,
    "cycle_min_lr": 0.0,
    "warmup_num_steps": 0,
}


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
                raise JobError(
                    f'config key {key} is "auto": qcompress train fills in batch sizes, '
                    "learning rates and warmup steps; give it a number (the run's step count follows from "
                    "--max-steps or --epochs)"
                )
            value = _AUTO_SCHEDULER[name]
            doc["scheduler"]["params"][name] = opts.lr if value == "lr" else value
    if auto_keys:
        log.info('qcompress train: "auto" config values filled from the job\'s options: %s', ", ".join(auto_keys))
    return doc


def job_config(opts: JobOptions) -> dict:
    """The merged config document, with the job's defaults where the configs say nothing."""
    cfg = load_config(*opts.configs) if opts.configs else None
    doc = copy.deepcopy(cfg.raw) if cfg is not None else {}
    if cfg is not None and cfg.auto_keys:
        doc = fill_auto(doc, cfg.auto_keys, opts)
    if not any(k in doc for k in BATCH_KEYS):
        doc["train_batch_size"] = opts.batch_size
    if opts.seed is None:  # no --seed: the config's (DeepSpeed's `seed`) orders the data too
        seed = doc.get("seed", 0)
        opts.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
    if opts.gradient_checkpointing and doc.get("activation_checkpointing") is None:
        doc["activation_checkpointing"] = {}
    if opts.compile:  # --compile: the config's compile section, switched on
        section = doc.get("compile")
        doc["compile"] = dict(section if isinstance(section, dict) else {}, enabled=True)
    if opts.lora_r is not None:  # --lora-r: the config's lora section, switched on at that rank
        cc = doc.get("compression_training")
        if isinstance(cc, dict):
            section = cc.get("lora")
            cc["lora"] = dict(section if isinstance(section, dict) else {}, enabled=True, r=opts.lora_r)
    cc = doc.get("compression_training") or {}
    if not isinstance(cc, dict) or not cc:
        raise JobError(
            f"the configs {opts.configs} have no compression_training section: nothing to "
            "compress (see schedules/ for ready recipes)"
        )
    if opts.calibrate is not None:
        doc = with_calibration(doc, opts)
    as_config(doc)  # a ConfigError names the key before anything runs
    return doc


def with_calibration(doc: dict, opts: JobOptions) -> dict:
    """--calibrate gptq: observer gptq as the weight groups' shared default (schedules/with_gptq.yaml);
    a JobError when no weight group would then use it."""
    from ..config.loader import deep_merge

    doc = deep_merge(
        doc, {"compression_training": {"weight_quantization": {"shared_parameters": {"observer": opts.calibrate}}}}
    )
    wq = as_config(doc).compression.weight_quantization
    if not (wq.enabled and any(g.settings.observer == opts.calibrate for g in wq.groups)):
        raise JobError(
            f"--calibrate {opts.calibrate}: no weight quantization group of {' + '.join(opts.configs)} "
            "would use it (weight quantization is off, or every group sets its own observer)"
        )
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
    return dict(doc, tensorboard={"enabled": True, "output_path": os.path.join(out, "tensorboard"), "job_name": name})


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
        return torch.optim.AdamW(split_range_groups(groups, range_parameter_ids(model), lr), lr=lr, weight_decay=0.01)

    return make


def job_device(name: str) -> torch.device:
    """--device: auto is the GPU of this rank (cuda:LOCAL_RANK) when torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return resolve_device(name)
    except ValueError as err:
        raise JobError(f"--{err}") from None


def check_compression(
    model: torch.nn.Module, doc: dict, configs: List[str], steps: int, ptq_range_steps: int = 0
) -> None:
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
    logger.setLevel(logging.ERROR)  # warnings (a group matching nothing) come once, later
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qcompress.init_compression(probe, doc, teacher_model=teacher)
    except ConfigError as err:
        raise JobError(f"config error in {' + '.join(configs)} for this model: {err}") from None
    finally:
        logger.setLevel(level)
    offsets = [
        q.offset
        for m in probe.modules()
        for q in (getattr(m, "qc_wq", None), getattr(m, "qc_aq", None))
        if q is not None
    ]
    from ..calibrate.learn_ranges import range_parameters

    learned = bool(range_parameters(probe))
    from ..export import reach

    unread = reach.unreadable(probe)
    wide = too_wide_for_export(probe, steps)
    del probe, teacher
    if ptq_range_steps and not learned:
        raise JobError(
            f"--ptq-range-steps {ptq_range_steps} trains learned ranges, but no group of "
            f"{' + '.join(configs)} has them: set range_learning: true in the weight (or static "
            "activation) quantization groups, or leave --ptq-range-steps out"
        )
    if not offsets:
        raise JobError(
            f"the configs {' + '.join(configs)} quantize no module of this model (no weight_quantization "
            "or activation_quantization group matches one): qcompress train exports a quantized "
            "checkpoint; see schedules/ for recipes"
        )
    if min(offsets) > steps:
        raise JobError(
            f"quantization starts at step {min(offsets)} (schedule_offset in {' + '.join(configs)}) but "
            f"the run ends at step {steps}: nothing would be quantized to export; lower schedule_offset "
            "or train longer (--max-steps / --epochs)"
        )
    if wide:
        (bits, group), names = next(iter(wide.items()))
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise JobError(
            f"weight group {group!r} of {' + '.join(configs)} would hold {bits}-bit weights at the "
            f"run's last step (step {steps}; modules {shown}), and the export stores at most 8-bit "
            f"integer codes: set its target_bits <= 8 and train until the schedule reaches 8 bits "
            "(--max-steps / --epochs), or quantize these modules in another group"
        )
    reach.warn(unread, f"the weight groups of {' + '.join(configs)}")  # before training, not after export


def too_wide_for_export(model: torch.nn.Module, steps: int) -> dict:
    """{(bits, group): module names} of the integer weight groups that would be above 8 bits at step
    `steps` (the export's int8 container refuses them: export/codes.py), in module order."""
    from ..config.formats import format_at
    from ..schedule import bits_at

    out: dict = {}
    for name, m in model.named_modules():
        wq = getattr(m, "qc_wq", None)
        if wq is None or steps < wq.offset:
            continue
        bits = bits_at(
            steps, start=wq.start_bits, target=wq.target_bits, period=wq.period, offset=wq.offset, growth=wq.growth
        )
        if bits > 8 and format_at(wq.format, bits) == "int":
            out.setdefault((bits, wq.group), []).append(name)
    return out
