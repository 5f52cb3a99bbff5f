"""Typed schema of the top-level training keys of a DeepSpeed-style config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..errors import ConfigError
from .compile import Compile
from .compression import CompressionConfig
from .deepspeed_keys import TOP_LEVEL, drop_unhonoured, warn_dropped, warn_unused
from .onebit import refuse_onebit_placements
from .parallel import Pipeline, TensorParallel, warn_pipeline_keys, warn_zero1_split
from .pld import ProgressiveLayerDrop
from .schema import field, join, parse

OPTIMIZER_TYPES = ("adam", "adamw", "lamb", "sgd", "onebitadam", "zerooneadam", "onebitlamb")
SCHEDULER_TYPES = ("warmuplr", "warmupdecaylr", "warmupcosinelr", "onecycle")

# DeepSpeed sections and keys with no use here: accepted, warned about once (deepspeed_keys.py)
IGNORED_DEEPSPEED_KEYS = tuple(TOP_LEVEL)


# Keys that transformers' DeepSpeed integration lets a config leave as "auto" (it fills them from
# the TrainingArguments), besides every optimizer.params / scheduler.params value. parse_config
# takes them out of the document (the field keeps its default) and lists them in Config.auto_keys:
# the Trainer callback then compares nothing for them, `qcompress train` fills them from its
# options, and the engine refuses them except the ZeRO sizes, which keep their defaults (bucket
# sizes FSDP2 / DDP treat as hints; transformers derives them from the hidden size).
AUTO_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16.enabled",
    "bf16.enabled",
)
AUTO_ZERO_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
)
AUTO = "auto"


def take_auto(doc: dict):
    """(a copy of doc without its "auto" values where they are allowed, their dotted paths)."""
    out, found = dict(doc), []

    def drop(section: dict, keys, prefix: str) -> dict:
        section = dict(section)
        for key in list(section):
            if (keys is None or key in keys) and section[key] == AUTO:
                del section[key]
                found.append(prefix + key)
        return section

    out = drop(out, AUTO_KEYS[:4], "")
    for name in ("fp16", "bf16"):
        if isinstance(out.get(name), dict):
            out[name] = drop(out[name], ("enabled",), name + ".")
    if isinstance(out.get("zero_optimization"), dict):
        out["zero_optimization"] = drop(out["zero_optimization"], AUTO_ZERO_KEYS, "zero_optimization.")
    for name in ("optimizer", "scheduler"):
        sec = out.get(name)
        if isinstance(sec, dict) and isinstance(sec.get("params"), dict):
            out[name] = dict(sec, params=drop(sec["params"], None, name + ".params."))
    return out, tuple(found)


@dataclass(frozen=True)
class FP16:
    enabled: bool = field(False)
    loss_scale: float = field(
        0.0,
        ge=0.0,
        le=2.0**64,
        doc="0 means dynamic loss scaling; at most 2^64 "
        "(initial_scale_power's limit): larger static scales overflow every step",
    )
    initial_scale_power: int = field(16, ge=0, le=64)
    loss_scale_window: int = field(1000, ge=1)
    hysteresis: int = field(2, ge=1)
    min_loss_scale: float = field(1.0, gt=0.0, le=2.0**64)
    consecutive_hysteresis: bool = field(False)
    auto_cast: bool = field(False)


@dataclass(frozen=True)
class BF16:
    enabled: bool = field(False)


def _named_type(choices):
    def check(value, path):
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a type name string, got {value!r}")
        return value

    return check


@dataclass(frozen=True)
class Optimizer:
    type: str = field(parse=_named_type(OPTIMIZER_TYPES))
    params: Dict[str, Any] = field({})

    def _validate(self, path):
        if self.type.lower() not in OPTIMIZER_TYPES:
            from .schema import did_you_mean

            raise ConfigError(
                join(path, "type"),
                f"{self.type!r} is not a known optimizer; choose one of "
                "Adam, AdamW, Lamb, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb"
                f"{did_you_mean(self.type.lower(), OPTIMIZER_TYPES)}",
            )


@dataclass(frozen=True)
class Scheduler:
    type: str = field(parse=_named_type(SCHEDULER_TYPES))
    params: Dict[str, Any] = field({})

    def _validate(self, path):
        if self.type.lower() not in SCHEDULER_TYPES:
            from .schema import did_you_mean

            raise ConfigError(
                join(path, "type"),
                f"{self.type!r} is not a known LR scheduler; choose one of "
                "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"
                f"{did_you_mean(self.type.lower(), SCHEDULER_TYPES)}",
            )


@dataclass(frozen=True)
class Offload:
    device: str = field("none", choices=("none", "cpu", "nvme"), lower=True)
    nvme_path: Optional[str] = field(None, doc="folder for the swap files of device: nvme")
    pin_memory: bool = field(False)
    buffer_count: int = field(4, ge=1)
    pipeline_read: bool = field(True, doc="nvme: read the next chunks during an update (DeepSpeed: false)")
    pipeline_write: bool = field(True, doc="nvme: write a chunk during the next updates (DeepSpeed: false)")
    fast_init: bool = field(False)
    ratio: float = field(
        1.0,
        gt=0.0,
        le=1.0,
        doc="offload_optimizer: the share of the optimizer state "
        "offloaded (by parameter size, in module order); the rest stays on the training device",
    )
    buffer_size: int = field(100_000_000, ge=1, doc="offload_param only (DeepSpeed's key; unused)")
    max_in_cpu: int = field(1_000_000_000, ge=0, doc="offload_param only (DeepSpeed's key; unused)")


@dataclass(frozen=True)
class ZeroOptimization:
    stage: int = field(0, choices=(0, 1, 2, 3))
    offload_optimizer: Offload = field(Offload())
    offload_param: Offload = field(Offload())
    reduce_bucket_size: int = field(500_000_000, ge=1)
    allgather_bucket_size: int = field(500_000_000, ge=1)
    overlap_comm: bool = field(False)
    contiguous_gradients: bool = field(True)
    reduce_scatter: bool = field(True)
    allgather_partitions: bool = field(True)
    round_robin_gradients: bool = field(False)
    stage3_prefetch_bucket_size: int = field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = field(100_000, ge=0)
    stage3_max_live_parameters: int = field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = field(
        False, doc="stage 3: engine.save_16bit_model gathers the shards and writes the whole model"
    )
    sub_group_size: int = field(1_000_000_000, ge=1)

    def _validate(self, path):
        if self.offload_param.device == "nvme":
            raise ConfigError(
                join(path, "offload_param.device"),
                "'nvme' (ZeRO-Infinity parameter offload) is not supported yet; use "
                "offload_param.device: cpu (FSDP2 CPUOffloadPolicy, stages 2/3), or "
                "offload_optimizer.device: nvme to keep the optimizer state on NVMe",
            )
        if self.stage == 0 and self.offload_optimizer.device == "cpu":
            raise ConfigError(join(path, "stage"), "offload_optimizer needs ZeRO stage 1, 2 or 3; stage is 0")
        if self.stage < 2 and self.offload_param.device == "cpu":
            raise ConfigError(
                join(path, "offload_param.device"),
                f"'cpu' parameter offload needs ZeRO stage 3 (or 2: FSDP2 CPUOffloadPolicy); stage is {self.stage}",
            )
        if self.offload_param.device != "none" and self.offload_param.ratio != 1.0:
            raise ConfigError(
                join(path, "offload_param.ratio"),
                "applies to offload_optimizer only (DeepSpeed's partial offload); parameters are offloaded whole",
            )
        nvme = self.offload_optimizer
        if nvme.device == "nvme":
            if self.stage == 0:
                raise ConfigError(
                    join(path, "stage"), "offload_optimizer.device: nvme needs ZeRO stage 1, 2 or 3; stage is 0"
                )
            if not nvme.nvme_path:
                raise ConfigError(
                    join(path, "offload_optimizer.nvme_path"),
                    "is required with offload_optimizer.device: nvme (a folder on a fast disk)",
                )


@dataclass(frozen=True)
class ActivationCheckpointing:
    """DeepSpeed's `activation_checkpointing` section: present, it makes the engine recompute the
    model's transformer blocks in the backward (engine/activation_checkpointing.py)."""

    enabled: bool = field(True, doc="ext: false keeps the section without checkpointing")
    number_checkpoints: Optional[int] = field(
        None, ge=0, doc="how many blocks are checkpointed (the first ones); default all"
    )
    cpu_checkpointing: bool = field(False, doc="saved block inputs go to CPU memory until the backward")
    partition_activations: bool = field(False)
    contiguous_memory_optimization: bool = field(False)
    synchronize_checkpoint_boundary: bool = field(False)
    profile: bool = field(False)


@dataclass(frozen=True)
class MonitorOutput:
    """DeepSpeed's `tensorboard` and `csv_monitor` sections (its defaults): files under
    output_path/job_name, written by engine.monitor on rank 0."""

    enabled: bool = field(False)
    output_path: str = field("", doc="folder; '' means the current directory, as DeepSpeed")
    job_name: str = field("DeepSpeedJobName", doc="subfolder of output_path for this run")


@dataclass(frozen=True)
class Config:
    train_batch_size: Optional[int] = field(None, ge=1)
    train_micro_batch_size_per_gpu: Optional[int] = field(None, ge=1)
    gradient_accumulation_steps: Optional[int] = field(None, ge=1)
    gradient_clipping: float = field(0.0, ge=0.0)
    fp16: FP16 = field(FP16())
    bf16: BF16 = field(BF16())
    optimizer: Optional[Optimizer] = field(None)
    scheduler: Optional[Scheduler] = field(None)
    zero_optimization: ZeroOptimization = field(ZeroOptimization())
    communication_data_type: Optional[str] = field(None, choices=("fp32", "fp16", "bf16"), lower=True)
    wall_clock_breakdown: bool = field(False)
    seed: Optional[int] = field(
        None,
        ge=0,
        doc="seeds Python, NumPy and torch on every rank in initialize; "
        "`qcompress train`'s data order unless --seed is given",
    )
    steps_per_print: int = field(
        10,
        ge=1,
        doc="the engine logs the step and learning rate every this many "
        "steps; `qcompress train` writes a progress line as often when not on a terminal",
    )
    activation_checkpointing: Optional[ActivationCheckpointing] = field(None)
    comm_timeout_s: Optional[float] = field(
        None, gt=0.0, doc="ext: seconds a collective may wait for every rank (default 1800; engine/comm_timeout.py)"
    )
    progressive_layer_drop: ProgressiveLayerDrop = field(ProgressiveLayerDrop())
    tensorboard: MonitorOutput = field(MonitorOutput())
    compile: Compile = field(Compile(), doc="torch.compile of the model by the engine (config/compile.py)")
    tensor_parallel: TensorParallel = field(TensorParallel(), doc="DeepSpeed AutoTP (config/parallel.py)")
    pipeline: Pipeline = field(Pipeline(), doc="pipeline parallelism (config/parallel.py)")
    csv_monitor: MonitorOutput = field(MonitorOutput())
    compression_training: CompressionConfig = field(CompressionConfig())
    raw: Dict[str, Any] = field({}, internal=True, doc="the merged input document, for export metadata")
    auto_keys: Tuple[str, ...] = field((), internal=True, doc='keys given as "auto" (see AUTO_KEYS)')

    def _validate(self, path):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(join(path, "bf16.enabled"), "fp16 and bf16 cannot both be enabled")
        refuse_onebit_placements(self)

    def refuse_auto(self, who: str = "qcompress.initialize") -> None:
        """ConfigError naming the "auto" values `who` cannot fill in (all but the ZeRO sizes)."""
        keys = [key for key in self.auto_keys if not key.startswith("zero_optimization.")]
        if keys:
            also = f" (also {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise ConfigError(
                keys[0],
                f'is "auto"{also}, a value transformers\' Trainer fills in from its '
                f"TrainingArguments (qcompress.hf.CompressionCallback does the same); {who} "
                "needs numbers here",
            )

    @property
    def compression(self) -> CompressionConfig:
        return self.compression_training

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"


def parse_config(doc: dict, source: str = "") -> Config:
    """Parse a merged document; DeepSpeed keys we do not implement are dropped with a warning."""
    if not isinstance(doc, dict):
        raise ConfigError(source, f"a config must be a mapping at the top level, got {type(doc).__name__}")
    warn_unused(doc)
    warn_pipeline_keys(doc)
    warn_zero1_split(doc)
    fields = set(Config.__dataclass_fields__)
    kept = {}
    for key, value in doc.items():
        if key in IGNORED_DEEPSPEED_KEYS and key not in fields:
            continue
        if key == "bfloat16":  # DeepSpeed's older alias
            key = "bf16"
        kept[key] = value
    kept, dropped = drop_unhonoured(kept, Config)  # the rest of DeepSpeed 0.19's keys
    warn_dropped(dropped)
    kept, auto = take_auto(kept)
    cfg = parse(Config, kept, "")
    object.__setattr__(cfg, "raw", doc)
    object.__setattr__(cfg, "auto_keys", auto)
    return cfg
