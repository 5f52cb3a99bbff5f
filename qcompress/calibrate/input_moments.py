"""Data-weighted weight ranges: `observer: mse` with `observer_kwargs: {weight_by: inputs}`.

The plain mse observer minimises the weights' own squared error. What the model feels is the
error of the layer's output, y = W u: for one output row, E[(dW u)^2] = dW^T E[u u^T] dW (GPTQ's
objective). Each group's shrink factor is chosen alone, so each group minimises the part of that
error its own weights make: d_g^T M_g d_g, with M_g the block of E[u u^T] over the group's columns
(granularity group: group_size x group_size blocks), or, where a group spans whole rows (channel,
tensor), the diagonal E[u_j^2] (the whole matrix would cost cols^2 per module). A column fed large
inputs is worth more range, one fed near-zero inputs may be clipped, and correlated columns are
weighed together. Those moments come from data, so they are recorded here on a few calibration
batches, then the ranges are chosen again with them.

Which modules take moments: Linear and transformers' Conv1D (their input's last dim is the weight's
input dim). An Embedding's input is token ids: it keeps the plain search, unless it is tied to a
Linear (GPT-2's wte / lm_head), whose moments it shares (one tensor, one shrink). Convolutions keep
the plain search (their columns mix channels and kernel positions).

With `cross_groups` (the default, granularity group) the whole E[u u^T] is recorded instead
(cols x cols per module, float32 once averaged; its diagonal blocks serve the per-group search), and
the groups of each row are then chosen together against it: the output error's cross terms between
groups are as large as its blocks on real layers (quant/cross_groups.py).

On several ranks the sums are all-reduced, so every rank chooses the same ranges.

The same call solves the weights of `observer: gptq` groups (calibrate/gptq.py), after the moments.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import gptq
from .blocks import run_batch
from ..nn import ranges
from ..nn.layers import CompressMixin

INPUT_KINDS = ("linear", "hf_conv1d")


def block_size(wq) -> int:
    """Columns per block of the moments a module's weighted search takes (observers.moment_block)."""
    return wq.group_size if wq.granularity == "group" else 1


def free_memory() -> Optional[int]:
    """Bytes of physical memory free now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(whole_shapes: List[Tuple[int, int]]) -> None:
    """MemoryError, before any batch runs, when the whole moments (float64 sums, then float32
    kept) would take more than half the free memory: a 7B model's would take tens of GiB."""
    need = sum(12 * a * b for a, b in whole_shapes)
    free = free_memory()
    if free is not None and need > free // 2:
        raise MemoryError(
            f"observer_kwargs.cross_groups: the whole input moments of {len(whole_shapes)} "
            f"module(s) (cols x cols each) need {need / 2**30:.1f} GiB, more than half of the "
            f"{free / 2**30:.1f} GiB free; set observer_kwargs.cross_groups: false (each group "
            "against its own block of the moments) or calibrate on a machine with more memory"
        )


def diagonal_blocks(M: torch.Tensor, b: int) -> torch.Tensor:
    """[ceil(cols / b), b, b] diagonal blocks of M [cols, cols] (a ragged last block zero-padded)."""
    cols = M.shape[0]
    nb = -(-cols // b)
    P = torch.nn.functional.pad(M, (0, nb * b - cols, 0, nb * b - cols))
    return torch.stack([P[i * b : (i + 1) * b, i * b : (i + 1) * b] for i in range(nb)])


def weighted_modules(model: nn.Module) -> List[Tuple[str, CompressMixin]]:
    """(name, module) of the compress-aware modules whose weight ranges are weighted by inputs."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, CompressMixin) and m.qc_wq is not None and ranges.weighs_by_inputs(m.qc_wq)
    ]


def _run(model: nn.Module, batch, forward: Optional[Callable]):
    return run_batch(model, batch, forward)


def _all_reduce(sums: list, counts: torch.Tensor, device: torch.device) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    flat = torch.cat([s.reshape(-1) for s in sums] + [counts.to(torch.float64)]).to(device)
    dist.all_reduce(flat)
    flat = flat.cpu()
    at = 0
    for s in sums:
        s.copy_(flat[at : at + s.numel()].reshape(s.shape))
        at += s.numel()
    counts.copy_(flat[at:].round().to(counts.dtype))


@torch.no_grad()
def calibrate_weight_ranges(model: nn.Module, batches: Iterable, forward: Optional[Callable] = None) -> int:
    """Record the input moments of each weighted module over `batches` (model in eval mode, no
    gradients): the blocks of E[u u^T] (u the module's input) over each weight group's columns, or
    E[u_j^2] where a group spans whole rows, and the whole E[u u^T] where cross_groups applies
    (MemoryError up front if those would take more than half the free memory). Then choose the
    weight ranges of the quantized modules again with them. Then solve the weights of the modules
    whose group has `observer: gptq` and that were not solved yet (calibrate/gptq.py; its input
    Hessians from the same batches, block by block with `sequential`).

    batches: dicts (model(**b)), tuples (model(*b)) or tensors (model(b)); or pass
    forward(model, batch). Call it after init_compression and before training (or before export
    of a model quantized without training); the moments, and GPTQ's scales, are kept, and the
    scheduler's state_dict carries them, so later bit drops and resumed runs use them too. Returns
    the number of modules whose moments were recorded or whose weights were solved (0 when no
    group asks for weight_by: inputs or gptq: nothing runs).
    """
    targets = gptq.unsolved(model)
    if targets:
        batches = list(batches)
        gptq.check_kinds(targets)
        gptq.check_batches(targets, batches)  # before anything runs or changes
    with gptq.inactive(targets):
        n = _record_moments(model, batches, forward)
    if targets:
        n += gptq.calibrate_gptq(model, targets, batches, forward)
    return n


def _record_moments(model: nn.Module, batches: Iterable, forward: Optional[Callable]) -> int:
    mods = weighted_modules(model)
    takers = [(n, m) for n, m in mods if m.qc_kind in INPUT_KINDS]
    if not takers:
        return 0
    plan = {}  # id(MasterState) -> (store, shape of the sums: [blocks, b, b] or whole [cols, cols], b, cols)
    for _, m in takers:
        if id(m.qc_wq.store) not in plan:
            cols, b = m.weight_matrix_view(m.weight).shape[1], block_size(m.qc_wq)
            shape = (cols, cols) if ranges.takes_cross(m.qc_wq) else (-(-cols // b), b, b)
            plan[id(m.qc_wq.store)] = (m.qc_wq.store, shape, b, cols)
    check_memory([shape for _, shape, _, _ in plan.values() if len(shape) == 2])
    stores = {
        key: (store, torch.zeros(shape, dtype=torch.float64), i, cols, b)  # float64 sums
        for i, (key, (store, shape, b, cols)) in enumerate(plan.items())
    }
    counts = torch.zeros(len(stores), dtype=torch.int64)

    def hook(mod, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            return
        _, acc, i, cols, _ = stores[id(mod.qc_wq.store)]
        if x.shape[-1] != cols:
            return  # a shape this module's weight does not multiply column-wise
        x2 = x.detach().reshape(-1, cols).float()
        if acc.dim() == 2:
            acc += (x2.T @ x2).double().cpu()  # sum_t u u^T
        else:
            nb, b, _ = acc.shape
            x3 = torch.nn.functional.pad(x2, (0, nb * b - cols)).reshape(-1, nb, b).transpose(0, 1)
            acc += torch.bmm(x3.transpose(1, 2), x3).double().cpu()  # per block: sum_t u u^T
        counts[i] += x2.shape[0]

    handles = [m.register_forward_pre_hook(hook) for _, m in takers]
    was_training = model.training
    model.eval()
    try:
        for b in batches:
            _run(model, b, forward)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    entries = sorted(stores.values(), key=lambda e: e[2])
    param = next(model.parameters(), None)
    device = (
        param.device
        if (param is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl")
        else torch.device("cpu")
    )
    _all_reduce([acc for _, acc, _, _, _ in entries], counts, device)
    unseen = []
    for store, acc, i, _, b in entries:
        if counts[i] == 0:
            unseen.append(i)
            continue
        mean = acc / float(counts[i])
        if mean.dim() == 2:  # whole E[u u^T]: its diagonal blocks for the per-group search
            store.input_cross = mean.to(torch.float32)
            mean = diagonal_blocks(mean, b)
        store.input_moments = mean
    if unseen:
        names = [n for n, m in takers if stores[id(m.qc_wq.store)][2] in unseen]
        warnings.warn(
            f"calibrate_weight_ranges: the batches never reached module(s) {names[:4]}"
            f"{' ...' if len(names) > 4 else ''}: their weight ranges keep the unweighted mse search",
            stacklevel=2,
        )
    for _, m in mods:
        wq = m.qc_wq
        if not wq.active or wq.baked:
            continue
        if wq.in_forward or wq.master is None:
            ranges.init_weight_ranges(m)
        else:  # optimizer-step mode: the next scheduler step re-searches on the master
            wq.shrink = None
            wq.pending_ranges = True
    return sum(stores[id(m.qc_wq.store)][2] not in unseen for _, m in takers)


def missing_moments(modules) -> List[str]:
    """Names of active input-weighted modules that take moments but have none recorded."""
    return [
        n
        for n, m in modules
        if m.qc_wq.active and not m.qc_wq.baked and m.qc_kind in INPUT_KINDS and m.qc_wq.store.input_moments is None
    ]


def needs_calibration(model: nn.Module) -> bool:
    """Some module weighs its ranges by inputs it has no moments of yet (active or not), or has
    weights GPTQ has not solved yet."""
    return any(
        m.qc_kind in INPUT_KINDS and m.qc_wq.store.input_moments is None for _, m in weighted_modules(model)
    ) or bool(gptq.unsolved(model))
