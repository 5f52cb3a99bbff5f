"""DDP comm hook for the 1-bit optimizers: average in warmup, send nothing in the compression stage.

    state = qcompress.comm.OneBitDDPHookState(process_group=None)
    ddp_model.register_comm_hook(state, qcompress.comm.onebit_ddp_hook)
    opt = qcompress.optim.OneBitAdam(ddp_model.parameters(), ..., ddp_hook_state=state)

While `state.compression_stage` is False the hook averages each gradient bucket with one
dist.all_reduce (so warmup equals plain DDP). When the optimizer reaches its freeze step it sets
`state.compression_stage = True`; from then on the hook returns the local bucket unchanged and moves
no bytes (each rank keeps its local gradient; the optimizer exchanges the compressed momentum
itself). Setting it back to False (e.g. 0/1 Adam's full-precision variance steps) restores the
all-reduce for the next backward pass. The flag is read when a bucket is ready, so flip it between
steps, not during backward.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation object.
import torch
import torch.distributed as dist

from . import stats as _stats


class OneBitDDPHookState:
    """State for onebit_ddp_hook: the process group and the `compression_stage` flag."""

    def __init__(self, process_group=None, compression_stage: bool = False):
        self.process_group = process_group
        self.compression_stage = bool(compression_stage)
        self.allreduce_calls = 0  # buckets averaged so far (warmup)
        self.local_calls = 0  # buckets returned unchanged (compression stage)

    def __setstate__(self, state):  # DDP may pickle hook state with the model
        self.__dict__.update(state)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["process_group"] = None  # process groups do not pickle; the default group is used after
        return d


def onebit_ddp_hook(state: OneBitDDPHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: all-reduce average in warmup, the local bucket in the compression stage."""
    buf = bucket.buffer()
    if state.compression_stage:
        state.local_calls += 1
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut
    group = state.process_group
    world = dist.get_world_size(group)
    state.allreduce_calls += 1
    buf.div_(world)
    nbytes = buf.numel() * buf.element_size()
    sent = 2 * (world - 1) * nbytes // world
    _stats.add(sent, sent)
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])
