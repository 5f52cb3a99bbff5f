"""DeepSpeed keys qcompress accepts so existing ds_config.json files load, but has no use for.

Each such key, when a config gives it, warns (once: see warn_unused), naming the key and saying what
happens instead. The tables are also the source of docs/deepspeed-keys.md (its "warns" rows).
"""
from __future__ import annotations

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
    tables = ((("zero_optimization",), ZERO), (("zero_optimization", "offload_optimizer"), OFFLOAD),
              (("zero_optimization", "offload_param"), OFFLOAD),
              (("activation_checkpointing",), ACTIVATION_CHECKPOINTING), (("fp16",), FP16))
    for path, table in tables:
        section = _present(doc, path)
        if isinstance(section, dict):
            for key in table:
                if key in section:
                    yield ".".join(path + (key,)), table[key]


def warn_unused(doc: dict, stacklevel: int = 4) -> None:
    """Warn for each unused key the document gives; Python's default warning filter shows each
    one once per call site, however often a config is parsed again."""
    for key, instead in given_unused(doc):
        warnings.warn(f"config key {key!r} is a DeepSpeed setting with no effect in qcompress: {instead}",
                      stacklevel=stacklevel)
