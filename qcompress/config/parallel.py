"""Schema of DeepSpeed's `tensor_parallel` and `pipeline` sections, and the mesh they make.

The data-parallel size is derived as DeepSpeed does: world / (tensor x pipeline). `mesh_shape`
checks the sizes against a world size and a model (heads, hidden size, blocks) and names the key
at fault; the engine calls it once the world size is known.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from ..errors import ConfigError
from .schema import field, join

TP_STYLES = ("colwise", "rowwise")
SCHEDULES = ("1f1b", "gpipe")

# pipeline keys DeepSpeed has and that change nothing here (warned about by name)
PIPELINE_UNUSED = {
    "seed_layers": "every stage's layers take the model's own initial weights (rank 0's, broadcast)",
    "pipe_partitioned": "activations between stages are sent whole (torch.distributed.pipelining)",
    "grad_partitioned": "gradients between stages are sent whole (torch.distributed.pipelining)",
    "activation_checkpoint_interval": "use the activation_checkpointing section: it recomputes the "
    "blocks of every stage",
}


def _plan(value, path):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping of module regex -> colwise | rowwise, got {value!r}")
    for pattern, style in value.items():
        if style not in TP_STYLES:
            raise ConfigError(
                join(path, pattern), f"{style!r} is not a tensor-parallel style; choose one of {', '.join(TP_STYLES)}"
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(join(path, pattern), f"is not a regular expression: {err}") from None
    return dict(value)


@dataclass(frozen=True)
class TensorParallel:
    """DeepSpeed AutoTP's section: the model's Linear layers split over autotp_size ranks."""

    autotp_size: int = field(1, ge=1, doc="ranks one tensor-parallel group splits each layer over")
    tp_plan: Optional[Dict[str, str]] = field(
        None,
        parse=_plan,
        doc="ext: module regex (re.search on "
        "the dotted name) -> colwise | rowwise; default: the "
        "model's own base_model_tp_plan (transformers)",
    )


def _stages(value, path):
    if value == "auto":
        return 1  # DeepSpeed's "auto": the PipelineModule's num_stages; a plain model has none
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(path, f'expected a positive integer or "auto", got {value!r}')
    return value


@dataclass(frozen=True)
class Pipeline:
    """DeepSpeed's `pipeline` section (its keys and defaults)."""

    stages: int = field(
        1, parse=_stages, doc='pipeline stages; "auto" means 1 for a model that is not a PipelineModule'
    )
    partition: str = field(
        "uniform",
        choices=("uniform", "parameters", "best"),
        lower=True,
        doc="how blocks are split: uniform (same count) or parameters (balanced "
        'parameter count; DeepSpeed\'s "best" means the same here)',
    )
    schedule: str = field(
        "1f1b",
        choices=SCHEDULES,
        lower=True,
        doc="ext: torch.distributed.pipelining schedule: 1f1b (DeepSpeed's) or gpipe",
    )
    seed_layers: bool = field(False)
    activation_checkpoint_interval: int = field(0, ge=0)
    pipe_partitioned: Union[bool, str] = field(True)
    grad_partitioned: Union[bool, str] = field(True)


def warn_pipeline_keys(doc: dict) -> None:
    """Warn, once per key, for the pipeline keys of a document that have no effect here."""
    section = doc.get("pipeline") if isinstance(doc, dict) else None
    if not isinstance(section, dict):
        return
    for key, instead in PIPELINE_UNUSED.items():
        if key in section and section[key] not in (False, 0, "auto"):
            warnings.warn(
                f"config key 'pipeline.{key}' is a DeepSpeed setting with no effect in qcompress: {instead}",
                stacklevel=4,
            )


ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


def warn_zero1_split(doc: dict) -> None:
    """ZeRO stage 1 under a tensor or pipeline split runs as stage 2 (FSDP2 on the data-parallel
    group: ZeroRedundancyOptimizer broadcasts plain tensors, not the split's DTensor parameters);
    the 1-bit optimizers keep their own shards. Said once, by key."""
    zero = doc.get("zero_optimization") if isinstance(doc, dict) else None
    if not isinstance(zero, dict) or zero.get("stage") != 1:
        return
    tp = (doc.get("tensor_parallel") or {}).get("autotp_size", 1) if isinstance(doc.get("tensor_parallel"), dict) else 1
    pp = (doc.get("pipeline") or {}).get("stages", 1) if isinstance(doc.get("pipeline"), dict) else 1
    split = [
        f"{k} {v}"
        for k, v in (("tensor_parallel.autotp_size", tp), ("pipeline.stages", pp))
        if isinstance(v, int) and not isinstance(v, bool) and v > 1
    ]
    opt = doc.get("optimizer")
    name = opt.get("type") if isinstance(opt, dict) else None
    if not split or (isinstance(name, str) and name.lower() in ONEBIT_OPTIMIZERS):
        return
    warnings.warn(
        f"config key 'zero_optimization.stage' is 1 with {' and '.join(split)}: a split model runs "
        "ZeRO stage 2 instead (FSDP2 shards the optimizer state and the gradients over the "
        "data-parallel group, since ZeroRedundancyOptimizer cannot broadcast the split's DTensor "
        "parameters); the updates are stage 1's, the memory stage 2's",
        stacklevel=4,
    )


@dataclass(frozen=True)
class MeshShape:
    """(pp, dp, tp) sizes of the engine's DeviceMesh."""

    pp: int
    dp: int
    tp: int

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def as_dict(self) -> Dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}


def mesh_shape(tp: int, pp: int, world: int) -> MeshShape:
    """The mesh for these sizes; ConfigError naming the key when tp x pp does not divide the world."""
    if world % tp:
        raise ConfigError("tensor_parallel.autotp_size", f"{tp} does not divide the world size {world}")
    if world % (tp * pp):
        raise ConfigError(
            "pipeline.stages",
            f"{pp} stages x autotp_size {tp} = {tp * pp} ranks per replica does not divide the world size {world}",
        )
    return MeshShape(pp=pp, dp=world // (tp * pp), tp=tp)


def check_model_sizes(
    tp: int, pp: int, heads: Optional[int], kv_heads: Optional[int], hidden: Optional[int], blocks: Optional[int]
) -> None:
    """ConfigError when the model cannot be split: heads / hidden size not divisible by the TP size,
    more pipeline stages than blocks."""
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads), ("hidden size", hidden)):
        if tp > 1 and n is not None and n % tp:
            raise ConfigError("tensor_parallel.autotp_size", f"{tp} does not divide the model's {n} {what}")
    if pp > 1 and blocks is not None and pp > blocks:
        raise ConfigError(
            "pipeline.stages",
            f"{pp} stages but the model has {blocks} transformer blocks; each stage needs at least one",
        )


def model_sizes(model) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(heads, kv heads, hidden size) from a transformers-style model config, Nones when absent."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    return heads, kv, hidden
