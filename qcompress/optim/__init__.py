"""Optimizers: communication-compressed OneBitAdam, ZeroOneAdam, OneBitLamb; plain Lamb; build_optimizer.

The 1-bit optimizers follow DeepSpeed's algorithms, parameter names and defaults
(reference/onebit_optimizers.md) and run wherever torch.distributed runs (gloo on CPU, NCCL on
GPU), on world size 1 too (also without torch.distributed initialised). Extra keyword arguments:
`group` (process group, default world), `compressor` ("onebit", "int8" or a name registered with
qcompress.comm.register_compressor), `bucket_size` (elements per compressed all-reduce call),
`comm_hierarchy` (None = automatic: hierarchical when ranks span hosts; "node": hierarchical by
host, so on a single host the exact uncompressed average; "flat"; or a qcompress.comm.Hierarchy),
`ddp_hook_state` (see DDP below), `scale_per_tensor` (OneBitAdam, ZeroOneAdam; default True: each
parameter tensor compressed with its own 1-bit scales and errors, all tensors in the same two
collectives; False: DeepSpeed's fp16 layout, one scale per flat bucket, which converged worse,
benchmarks/RESULTS.md).

Fixes over DeepSpeed: bias_correction is honoured (default True; bc2 counts variance updates and
freezes with the variance); parameters may be fp32, bf16 or fp16 (moments, errors and a master copy
of non-fp32 parameters are float32); the first step() updates the weights (no initialisation
no-op step: warmup is exactly `freeze_step` updates); state_dict() holds the stage, every schedule
counter, this rank's compression errors, the world size and rank and the node layout the errors
belong to, so resuming on the same world size and hosts is bit-exact; on another world size (or
rank, or bucket layout) errors restart from zero with a warning on logging.getLogger("qcompress"),
and on another host layout (same world size, ranks spread over other nodes: checked at the first
step after loading, when the hosts are detected) every rank does the same at that step.
exp_avg_mask (a tensor covering the group's parameters flattened in order) is configuration and is
never taken from a checkpoint. With one rank nothing is compressed (the mean over one rank is exact).

Contract with the caller (the qcompress engine, a DDP hook, or a hand-written loop)
------------------------------------------------------------------------------------
* `optimizer.allreduce_gradients` (bool) tells what the NEXT step() expects:
  True  - gradients averaged over the group (1-bit Adam/LAMB warmup, 0/1 Adam variance steps);
  False - this rank's local gradients; the optimizer runs its own compressed communication.
  Read it before each backward pass (it changes only inside step() and load_state_dict()).
* Gradient accumulation: the caller averages micro-batches (divide each micro-batch loss by the
  number of accumulation steps) in EVERY stage, so the gradient handed to step() is a mean, never
  a sum. (DeepSpeed >= 0.16 sums in the compression stage; we do not.)
* Gradient clipping, if any, is the caller's business; in the compression stage it sees local
  gradients.
* DDP: `optimizer.attach_ddp(ddp_model)` registers qcompress.comm.onebit_ddp_hook and keeps its
  state in step with allreduce_gradients; or register the hook yourself and pass its state as
  `ddp_hook_state=`. DDP's no_sync() still works for accumulation micro-steps.
* Without DDP: call `optimizer.sync_gradients()` between backward and step(); it averages the
  gradients when allreduce_gradients is True and does nothing otherwise. Its all-reduce (and that of
  non_freeze groups in the compression stage) is counted in qcompress.comm.stats like every other
  collective of the package.
* ZeRO stage 1: `OneBitAdam(..., shard_state=True)` (build_optimizer(..., shard_state=True)) keeps
  the variance, its cached denominator and fp32 master copies only for this rank's chunk of each
  flat bucket (the chunk it serves in the compressed all-reduce); the momentum stays whole (the
  compression stage compresses all of it). step() updates the owned elements and all-gathers the
  parameters: (P-1)/P * N * bytes_per_param per rank per step, counted in qcompress.comm.stats and
  more than the 1-bit payload (~(P-1)/P * N/4). Results equal shard_state=False bit for bit; its
  state_dict loads only at the same world size and rank. ZeroOneAdam and OneBitLamb refuse it (why:
  build._NO_SHARD).
* Every rank must call step() the same number of times (the compressed all-reduce is collective).
  A parameter without a gradient counts as a zero gradient in the compression stage.
"""

from .build import build_optimizer
from .lamb import Lamb
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLamb
from .zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "build_optimizer"]
