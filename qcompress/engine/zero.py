"""ZeRO stages on PyTorch's own engines: 0 = DDP, 1 = DDP + ZeroRedundancyOptimizer,
2 = FSDP2 fully_shard(reshard_after_forward=False), 3 = fully_shard, offload = CPUOffloadPolicy."""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .traffic import CustomComm, nbytes_of, reduce_scatter

_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None, None: None}


def comm_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return _COMM_DTYPES[name]


@torch.no_grad()
def broadcast_module_state(model: nn.Module, src: int = 0, group=None, traffic=None) -> None:
    """Make every rank start from rank `src`'s parameters and buffers (one collective per dtype)."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers())]
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        if traffic is not None:
            traffic.broadcast("broadcast", flat.numel() * flat.element_size(), dist.get_rank(group) == src)
        offset = 0
        for t in group_tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


class GradReduceHook:
    """DDP comm hook: average a bucket across ranks, optionally in fp16/bf16 (works on gloo,
    unlike torch's bf16_compress_hook on CPU). With `timed`, the all-reduce runs synchronously so
    its wall time can be attributed (wall_clock_breakdown); otherwise it overlaps with backward."""

    def __init__(self, group, world_size: int, dtype: Optional[torch.dtype], timed: bool, traffic=None):
        self.group, self.world_size, self.dtype, self.timed = group, world_size, dtype, timed
        self.traffic = traffic  # engine.traffic.Traffic: counts each bucket as it is sent
        self.seconds = 0.0

    def reduce(self, bucket):
        buf = bucket.buffer()
        # Divide first so fp16 sums cannot overflow (as torch's fp16_compress_hook does; torch's
        # own allreduce_hook divides first too, and matches DDP without a hook).
        send = buf.div(self.world_size).to(self.dtype) if self.dtype is not None else buf.div_(self.world_size)
        if self.traffic is not None:
            self.traffic.all_reduce("ddp", send.numel() * send.element_size())
        if self.timed:
            t0 = time.perf_counter()
            dist.all_reduce(send, group=self.group)
            if send.is_cuda:
                torch.cuda.synchronize(send.device)
            self.seconds += time.perf_counter() - t0
            if send is not buf:
                buf.copy_(send)
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut
        work = dist.all_reduce(send, group=self.group, async_op=True)

        def done(f):
            f.value()  # re-raises a failed or timed-out all-reduce (else DDP never sees it)
            if send is not buf:
                buf.copy_(send)
            return buf

        return work.get_future().then(done)


def grad_reduce_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """The function DDP calls per bucket; the GradReduceHook instance is its state."""
    return state.reduce(bucket)


def bucket_cap_mb(elements: int, element_size: int) -> float:
    """DDP's bucket_cap_mb (MiB) for buckets of `elements` gradients: reduce_bucket_size counts
    elements, as in DeepSpeed. DDP sizes a bucket by its gradient buffer, which has the
    parameters' dtype even when our hook sends fp16/bf16, so that dtype gives the bytes."""
    return max(elements * element_size / (1024 * 1024), 1e-3)


def _grad_element_size(model: nn.Module) -> int:
    return next((p.element_size() for p in model.parameters() if p.requires_grad), 4)


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    group,
    world_size: int,
    bucket_elements: int,
    dtype_name: Optional[str],
    timed: bool,
    find_unused_parameters: bool = False,
    traffic=None,
):
    """find_unused_parameters: progressive layer drop skips whole blocks (the same on every rank),
    whose parameters then get no gradient. traffic (engine.traffic.Traffic): count every gradient
    bucket and DDP's start-up broadcast of the module state; the hook is registered for it even
    when nothing else needs one. Returns (ddp, the hook when fp16/bf16 or timing asked for it)."""
    device_ids = [device.index] if device.type == "cuda" else None
    # Buffers are synced at optimizer boundaries instead of every forward (no communication on
    # accumulation micro-steps); the keyword was renamed in recent torch.
    import inspect

    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else {"broadcast_buffers": False}
    )
    ddp = DDP(
        model,
        device_ids=device_ids,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb(bucket_elements, _grad_element_size(model)),
        gradient_as_bucket_view=True,  # grads live in the buckets: no second copy
        find_unused_parameters=find_unused_parameters,
        **no_buffer_sync,
    )
    if traffic is not None:  # DDP broadcast rank 0's parameters (and buffers, see above) when built
        buffers = list(model.buffers()) if "forward_sync_buffers" in no_buffer_sync else []
        state = list(model.parameters()) + buffers
        traffic.broadcast("broadcast", nbytes_of(state), dist.get_rank(group) == 0)
    hook = None
    dtype = comm_dtype(dtype_name)
    if dtype is not None or timed or traffic is not None:
        hook = GradReduceHook(group, world_size, dtype, timed, traffic)
        ddp.register_comm_hook(hook, grad_reduce_hook)
    return ddp, (hook if dtype is not None or timed else None)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class TimedReduceScatter(CustomComm):
    """FSDP2 reduce-scatter (set_custom_reduce_scatter) that adds its wall time to `seconds`, for
    wall_clock_breakdown. It waits for the work queued before it (backward kernels) before
    starting the clock and for the collective after, so only the communication is counted; on
    GPU that costs its overlap with backward, as the timed DDP hook does."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        _sync(input_tensor)
        t0 = time.perf_counter()
        work = reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        _sync(output_tensor)
        self.seconds += time.perf_counter() - t0
        return work


def time_reduce_scatter(model: nn.Module) -> Optional[TimedReduceScatter]:
    """Route every FSDP2 module's gradient reduce-scatter through one TimedReduceScatter; None
    when this torch has no set_custom_reduce_scatter (the time then stays inside backward)."""
    fsdp_modules = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    if not fsdp_modules:
        return None
    timer = TimedReduceScatter()
    for m in fsdp_modules:
        m.set_custom_reduce_scatter(timer)
    return timer


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def shard_units(model: nn.Module):
    """What wrap_fsdp passes to fully_shard, children before parents: each non-root module that owns
    parameters, except that modules sharing a Parameter (tied weights: GPT-2's lm_head and wte) form
    one list, as FSDP2 requires (one FSDP group per parameter), and so does a module with the
    modules its hooks read (a channel-pruned conv's BatchNorm)."""
    named = [m for name, m in model.named_modules() if name]
    owners = [m for m in named if _owns_params(m)]
    # A hook object holding another module (channel pruning's BatchNorm hook holds its conv and
    # reads the conv's scores) needs that module's parameters whole while the host runs: one unit.
    reads = {}
    for m in named:
        for hook in list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values()):
            for v in getattr(hook, "__dict__", {}).values():
                if isinstance(v, nn.Module) and v is not m and _owns_params(v):
                    reads.setdefault(id(m), []).append(v)
    owners += [m for m in named if id(m) in reads and not _owns_params(m)]
    index = {id(m): i for i, m in enumerate(owners)}
    root = list(range(len(owners)))

    def find(i):
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    first_owner = {}
    for i, m in enumerate(owners):
        for p in m.parameters(recurse=False):
            j = find(first_owner.setdefault(id(p), i))
            root[find(i)] = j
        for other in reads.get(id(m), ()):
            if id(other) in index:
                root[find(i)] = find(index[id(other)])
    units = {}
    for i in range(len(owners)):
        units.setdefault(find(i), []).append(i)
    # A unit goes after every module below any of its members: order by its first pre-order index.
    order = {id(m): k for k, m in enumerate(named)}
    for idx in units.values():
        idx.sort(key=lambda i: order[id(owners[i])])
    ordered = sorted(units.values(), key=lambda idx: order[id(owners[idx[0]])], reverse=True)
    return [owners[idx[0]] if len(idx) == 1 else [owners[i] for i in idx] for idx in ordered]


def wrap_fsdp(
    model: nn.Module,
    device: torch.device,
    group,
    stage: int,
    offload: bool,
    dtype_name: Optional[str],
    pin_memory: bool = False,
    offload_ratio: float = 1.0,
    mesh=None,
):
    """fully_shard every module that owns parameters (tied ones together), then the root (FSDP2's
    usual recipe). offload: CPUOffloadPolicy (pinned host memory with pin_memory, on CUDA); with
    offload_ratio < 1, only for the first units in module order holding at most that share of the
    parameter bytes (engine/offload.py). mesh: the 1-D mesh to shard over (a split model's dp
    sub-mesh), else `group`'s. Returns the parameters whose units were offloaded."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from .offload import choose_share

    if mesh is None:
        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    units = shard_units(model)
    own = [[p for m in (u if isinstance(u, list) else [u]) for p in m.parameters(recurse=False)] for u in units]
    order = {id(m): k for k, m in enumerate(model.modules())}
    by_order = sorted(
        range(len(units)), key=lambda i: order[id(units[i][0] if isinstance(units[i], list) else units[i])]
    )
    moved = set()
    if offload:
        chosen = choose_share(by_order, offload_ratio, size=lambda i: sum(p.numel() * p.element_size() for p in own[i]))
        moved = set(chosen) if offload_ratio < 1.0 else set(range(len(units)))
    cpu = CPUOffloadPolicy(pin_memory=pin_memory and device.type == "cuda")
    mp = MixedPrecisionPolicy(reduce_dtype=comm_dtype(dtype_name))
    offloaded = []
    for i, unit in enumerate(units):
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=(stage == 3),
            mp_policy=mp,
            offload_policy=cpu if i in moved else OffloadPolicy(),
        )
        if i in moved:  # after fully_shard: its sharded Parameters replaced the originals
            offloaded += [p for m in (unit if isinstance(unit, list) else [unit]) for p in m.parameters(recurse=False)]
    whole = offload and offload_ratio >= 1.0
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=(stage == 3),
        mp_policy=mp,
        offload_policy=cpu if whole else OffloadPolicy(),
    )
    if whole:
        offloaded += list(model.parameters(recurse=False))
    return model, offloaded


def build_zero1(params, factory, group):
    """ZeroRedundancyOptimizer over `factory(param_groups)` (any optimizer built from the config)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def constructor(param_groups, **_):
        return factory(param_groups)

    return ZeroRedundancyOptimizer(params, optimizer_class=constructor, process_group=group)


def _gather(p, device: torch.device) -> torch.Tensor:
    """The whole tensor of a sharded DTensor parameter, gathered on the training device (an
    offloaded shard lives in CPU memory, which NCCL cannot gather from)."""
    local = p.to_local()
    if local.device == device:
        return p.full_tensor()
    from torch.distributed.tensor import DTensor

    on_device = DTensor.from_local(
        local.to(device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return on_device.full_tensor()


@contextlib.contextmanager
def full_weights(model: nn.Module, rank: int, world: int, device: torch.device):
    """Give compress-aware modules whole weights (not FSDP2 shards) while the compression scheduler
    reads or rewrites them at step time, then copy each rank's slice of the result back."""
    swapped = []
    gathered = {}  # id(shard) -> whole Parameter: tied weights (lm_head / wte) stay one tensor
    for m in model.modules():
        if not hasattr(m, "qc_wq"):
            continue
        for pname, p in list(m._parameters.items()):
            if p is None or not hasattr(p, "full_tensor"):
                continue
            full = gathered.get(id(p))
            if full is None:
                full = gathered[id(p)] = nn.Parameter(_gather(p, device), requires_grad=p.requires_grad)
            m._parameters[pname] = full
            swapped.append((m, pname, p, full))
    try:
        yield
    finally:
        with torch.no_grad():
            copied = set()
            for m, pname, p, full in swapped:
                m._parameters[pname] = p
                if id(p) in copied:  # a tied weight: its one whole copy went back already
                    continue
                copied.add(id(p))
                local = p.to_local()
                pieces = torch.chunk(full.detach(), world, dim=0)  # FSDP2 shards dim 0 like torch.chunk
                mine = pieces[rank] if rank < len(pieces) else full.detach()[:0]
                if local.shape != mine.shape:
                    raise RuntimeError(
                        f"cannot map {pname} of {type(m).__name__} back onto its shard "
                        f"({tuple(mine.shape)} vs {tuple(local.shape)})"
                    )
                local.copy_(mine)
