"""DeepSpeed keys qcompress accepts so existing ds_config.json files load, but has no use for.

Each such key, when a config gives it, warns (once: see warn_unused), naming the key and saying what
happens instead. The tables are also the source of docs/deepspeed-keys.md (its "warns" rows).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Dict, Iterable, Tuple

# top-level keys and sections: dropped from the document before parsing
TOP_LEVEL: Dict[str, str] = {
    "prescale_gradients": "gradients are always divided by the world size before the all-reduce "
    "(so fp16 sums cannot overflow)",
    "gradient_predivide_factor": "gradients are divided by the world size before the all-reduce, by nothing else",
    "sparse_gradients": "gradients are dense tensors, reduced by DDP / FSDP2",
    "zero_allow_untested_optimizer": "every optimizer is allowed with ZeRO",
    "zero_force_ds_cpu_optimizer": "the optimizer the config names runs the offloaded update",
    "wandb": "no Weights & Biases events; the tensorboard and csv_monitor sections work",
    "comet": "no Comet events; the tensorboard and csv_monitor sections work",
    "flops_profiler": "no FLOPs profile",
    "comms_logger": "no communication log; engine.comm_bytes() counts every byte the engine moves",
    "dump_state": "the engine state is not printed",
    "elasticity": "the batch sizes are the configured ones, for the world size the job starts with",
    "aio": "NVMe offload reads and writes with its own threads (offload_optimizer.buffer_count, "
    "pipeline_read, pipeline_write)",
    "checkpoint": "save_checkpoint writes torch.distributed.checkpoint folders",
    "data_efficiency": "batches are sampled as the training loop gives them",
    "curriculum_learning": "batches are sampled as the training loop gives them",
    "amp": "use fp16 or bf16 (torch.autocast)",
    "autotuning": "the configured sizes are used as given",
    "memory_breakdown": "no per-step memory log; engine.memory_report() measures the bytes",
    "disable_allgather": "ZeRO gathers as FSDP2 does",
    "eigenvalue": "no eigenvalue computation",
    "quantize_training": "use compression_training.weight_quantization (the MoQ keys are accepted there)",
    "sparse_attention": "attention runs the model's own kernels",
    "nebula": "save_checkpoint writes torch.distributed.checkpoint folders",
    "hybrid_engine": "no inference-mode engine switch",
    "data_types": "gradients accumulate in the parameters' dtype",
    "timers": "wall_clock_breakdown times forward, backward, the all-reduce and the step",
    "dataloader_drop_last": "the engine builds no data loader; the training loop decides",
}

# zero_optimization keys
ZERO: Dict[str, str] = {
    "overlap_comm": "DDP / FSDP2 overlap communication with backward on their own",
    "contiguous_gradients": "DDP keeps gradients in its buckets, FSDP2 in its sharded buffers",
    "reduce_scatter": "stages 2/3 reduce-scatter gradients (FSDP2), stages 0/1 all-reduce (DDP)",
    "allgather_bucket_size": "FSDP2 gathers one module's parameters at a time",
    "allgather_partitions": "ZeroRedundancyOptimizer broadcasts each rank's updated partition",
    "round_robin_gradients": "gradients are partitioned as DDP / FSDP2 partition them",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches the next module's parameters",
    "stage3_param_persistence_threshold": "every module that owns parameters is sharded",
    "stage3_max_live_parameters": "FSDP2 frees each module's gathered parameters after use",
    "stage3_max_reuse_distance": "FSDP2 frees each module's gathered parameters after use",
}

# keys of zero_optimization.offload_optimizer / offload_param
OFFLOAD: Dict[str, str] = {
    "buffer_size": "parameters are offloaded by FSDP2's CPUOffloadPolicy, without staging buffers",
    "max_in_cpu": "parameters are offloaded by FSDP2's CPUOffloadPolicy, without staging buffers",
    "fast_init": "the optimizer state is created at the first step",
}

# fp16 keys
FP16: Dict[str, str] = {
    "auto_cast": "the forward runs under torch.autocast, which casts each operation's inputs; the batch "
    "itself is not cast",
}

# activation_checkpointing keys
ACTIVATION_CHECKPOINTING: Dict[str, str] = {
    "partition_activations": "every rank keeps its own checkpointed block inputs whole",
    "contiguous_memory_optimization": "the saved block inputs are ordinary tensors",
    "synchronize_checkpoint_boundary": "no device synchronization at checkpoint boundaries",
    "profile": "checkpointed forwards and recomputes are not timed separately",
}

# Keys of DeepSpeed 0.19's schema (deepspeed_0_19_keys.json, made by deepspeed_schema.py) that the
# schema here does not declare: accepted, dropped before parsing, and warned about by name. These
# say what happens instead; the others get UNHONOURED.
_ZEROPP = (
    "ZeRO runs on FSDP2 / ZeroRedundancyOptimizer, which gather and reduce in the training "
    "dtype: no ZeRO++ quantized weights or gradients, no hierarchical partitions"
)
NOT_HONOURED: Dict[str, str] = {
    "zero_optimization.ignore_unused_parameters": "parameters without a gradient are refused at stages 0/1 "
    "(engine.step names them) and skipped at stages 2/3",
    "zero_optimization.zero_quantized_weights": _ZEROPP,
    "zero_optimization.zero_quantized_nontrainable_weights": _ZEROPP,
    "zero_optimization.zero_quantized_gradients": _ZEROPP,
    "zero_optimization.zero_hpz_partition_size": _ZEROPP,
    "zero_optimization.zeropp_loco_param": _ZEROPP,
    "zero_optimization.mics_shard_size": "ZeRO shards over the whole data-parallel group (FSDP2)",
    "zero_optimization.mics_hierarchical_params_gather": "ZeRO shards over the whole data-parallel group (FSDP2)",
    "zero_optimization.offload_optimizer.super_offload": "the offloaded update runs as offload_optimizer says",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "the offloaded update runs on torch's CPU threads",
    "bf16.immediate_grad_update": "gradients accumulate in the parameters and the optimizer steps once per "
    "accumulation boundary",
    "bf16.bf16_master_weights_and_grads": "the parameters keep their dtype; bf16 runs the forward under torch.autocast",
    "bf16.bf16_optimizer_states": "the optimizer state has the parameters' dtype",
    "bf16.check_grad_overflow": "bf16 has no loss scaling; a non-finite loss stops qcompress train",
    "fp16.fp16_master_weights_and_grads": "the parameters keep their dtype; fp16 runs the forward under "
    "torch.autocast with loss scaling",
    "torch_autocast": "use the bf16 or fp16 section: the forward then runs under torch.autocast in that dtype",
    "gradient_allreduce_op": "gradients are averaged over the data-parallel ranks",
    "graph_harvesting": "no CUDA graph capture by the engine; the compile section can ask torch.compile for it",
    "managed_gradient_accumulation": "gradient_accumulation_steps micro-batches make one optimizer step",
    "seq_parallel_communication_data_type": "no sequence parallelism",
    "use_data_before_expert_parallelism": "no expert parallelism: experts are trained where their layer is",
    "expert_parallel": "no expert parallelism: experts are trained where their layer is",
    "weight_quantization": "DeepSpeed's inference-time weight quantization; use "
    "compression_training.weight_quantization",
    "log_level": "qcompress logs through Python's logging ('qcompress' logger)",
    "datastates_ckpt": "save_checkpoint writes torch.distributed.checkpoint folders",
    "allgather_size": "ZeRO gathers as FSDP2 does",
}
# DeepSpeed's other names for keys declared here (its pydantic field names behind the aliases, and
# a deprecated spelling): read as the declared key
RENAMED: Dict[str, str] = {
    "zero_optimization.gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_optimization.max_live_parameters": "stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "stage3_max_reuse_distance",
}
UNHONOURED = "qcompress accepts it (DeepSpeed 0.19 has it) and does not honour it; nothing else changes"


@functools.lru_cache(maxsize=1)
def deepspeed_keys() -> frozenset:
    """DeepSpeed 0.19's dotted key paths (the committed list; see deepspeed_schema.py)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_0_19_keys.json")
    with open(path, encoding="utf-8") as fh:
        return frozenset(json.load(fh)["keys"])


def _section_type(hint):
    """The config dataclass a field holds (its type, or the one inside Optional[...]), or None."""
    import dataclasses
    import typing

    for tp in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(tp):
            return tp
    return None


def drop_unhonoured(doc: dict, cls, prefix: str = "") -> Tuple[dict, list]:
    """(a copy of `doc` without the DeepSpeed 0.19 keys `cls`'s schema does not declare, [(dotted key,
    what happens instead)]), down the sections the schema parses. Keys DeepSpeed does not know
    either stay, for the parser to refuse by name."""
    from .schema import _layout
    import typing

    known = deepspeed_keys()
    hints, by_key = _layout(cls)
    out, dropped = dict(doc), []
    for key, value in doc.items():
        path = prefix + str(key)
        if key in by_key:
            sub = _section_type(typing.get_type_hints(cls).get(by_key[key].name))
            if sub is not None and isinstance(value, dict):
                out[key], more = drop_unhonoured(value, sub, path + ".")
                dropped.extend(more)
        elif path in RENAMED and RENAMED[path] in by_key and RENAMED[path] not in doc:
            del out[key]
            out[RENAMED[path]] = value
        elif path in known:
            del out[key]
            dropped.append((path, NOT_HONOURED.get(path, UNHONOURED)))
        else:
            _refuse_misspelt(path, key, by_key, known)
    return out, dropped


def _refuse_misspelt(path: str, key, by_key, known) -> None:
    """A key neither schema has, close to one only DeepSpeed's has: ConfigError suggesting it (the
    parser's own message suggests among the declared keys only)."""
    from ..errors import ConfigError
    from .schema import did_you_mean

    if not isinstance(key, str) or did_you_mean(key, by_key):
        return
    prefix = path[: len(path) - len(key)]
    theirs = [k[len(prefix) :] for k in known if k.startswith(prefix) and "." not in k[len(prefix) :]]
    hint = did_you_mean(key, theirs)
    if hint:
        raise ConfigError(
            path, f"unknown key{hint}; allowed keys: {sorted(by_key)}, and DeepSpeed's own, which load with a warning"
        )


def _present(doc: dict, path: Tuple[str, ...]):
    section = doc
    for key in path:
        if not isinstance(section, dict) or key not in section:
            return None
        section = section[key]
    return section


def given_unused(doc: dict) -> Iterable[Tuple[str, str]]:
    """(dotted key, what happens instead) for every unused DeepSpeed key the document gives."""
    for key in TOP_LEVEL:
        if key in doc:
            yield key, TOP_LEVEL[key]
    tables = (
        (("zero_optimization",), ZERO),
        (("zero_optimization", "offload_optimizer"), OFFLOAD),
        (("zero_optimization", "offload_param"), OFFLOAD),
        (("activation_checkpointing",), ACTIVATION_CHECKPOINTING),
        (("fp16",), FP16),
    )
    for path, table in tables:
        section = _present(doc, path)
        if isinstance(section, dict):
            for key in table:
                if key in section:
                    yield ".".join(path + (key,)), table[key]


def warn_dropped(dropped, stacklevel: int = 4) -> None:
    """One warning per key drop_unhonoured took out, naming it (once per key: the default filter)."""
    for key, instead in dropped:
        warnings.warn(
            f"config key {key!r} is a DeepSpeed setting qcompress does not honour: {instead}", stacklevel=stacklevel
        )


def warn_unused(doc: dict, stacklevel: int = 4) -> None:
    """Warn for each unused key the document gives; Python's default warning filter shows each
    one once per call site, however often a config is parsed again."""
    for key, instead in given_unused(doc):
        warnings.warn(
            f"config key {key!r} is a DeepSpeed setting with no effect in qcompress: {instead}", stacklevel=stacklevel
        )
