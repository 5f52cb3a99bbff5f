"""observer: gptq — the calibration side: each solved module's input Hessian H = E[u u^T] on the
calibration batches, then quant/gptq.py's solve, and the solution written into the model.

Called by qcompress.calibrate_weight_ranges (calibrate/input_moments.py), once per module: a module that was
solved keeps its solution (solve again from a freshly built model). What it writes:
- the error-compensated weights replace the full-precision weights (optimizer-step mode: they
  become the master copy and the weight holds their quantization), so QAT and QAD continue from
  GPTQ's solution;
- the scales the solve chose become the module's fixed scales (`WeightQuant.solved`), used by
  every forward, by export and kept in the compression state of checkpoints; with range learning
  they initialise the learned scales (and zero points) instead. Quantizing the compensated
  weights with them gives the solve's Q exactly, so what export writes is what training used.

Which inputs: Linear and transformers' Conv1D take their forward input; a fused experts matrix
takes, for each expert, the tokens routed to it (one Hessian per expert, each expert's matrix
solved alone; an expert no calibration token reached is rounded to nearest, with a warning).

Sequential (`observer_kwargs.sequential`, the default): the repeated blocks (calibrate/blocks.py) are
solved in order, block i on the outputs of blocks 0 .. i-1 already quantized; every solved module of
one block takes its Hessian from the same pass over that block (the block's modules are not
sequential among themselves). Modules outside the blocks (an lm_head) are solved last, on a pass of
the whole quantized model. `sequential: false`: Hessians from one pass of the model as it was
before any GPTQ solve. Either way, before anything is written, a batch list that is empty or never
reaches a module is a ConfigError naming the module.

While calibrating, the modules to solve run unquantized (their own weights), and each solved one
runs on its quantization from then on; other quantizers (minmax / mse groups, activations) act
as configured.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .blocks import BlockCalls, repeated_blocks, run_batch
from ..errors import ConfigError
from ..nn import ranges
from ..nn.experts import IN_OUT, ExpertMatrix
from ..nn.layers import CompressMixin
from ..quant import floats
from ..quant import gptq as solver
from ..quant.observers import Search
from ..quant.reference import make_spec

log = logging.getLogger("qcompress")
GPTQ_KINDS = ("linear", "hf_conv1d", "experts")


def _path(mod) -> str:
    return f"compression_training.weight_quantization.different_groups.{mod.qc_wq.group}.params.observer"


def unsolved(model: nn.Module) -> List[Tuple[str, CompressMixin]]:
    """(name, module) of the gptq modules not solved yet."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, CompressMixin)
        and m.qc_wq is not None
        and m.qc_wq.solver is not None
        and m.qc_wq.solved is None
        and not m.qc_wq.baked
    ]


def _sequential(mod) -> bool:
    return bool(mod.qc_wq.solver_kwargs[3])


def settings(mod) -> solver.Settings:
    wq = mod.qc_wq
    damp, block, act_order, _ = wq.solver_kwargs
    return solver.Settings(
        damp=damp, block_size=block, act_order=act_order, observer=wq.range_observer, search=Search(*wq.range_search)
    )


# --- Hessians ------------------------------------------------------------------------------------


class Hessians:
    """Sums of u u^T (float64, on the input's device) and token counts per module (per expert for
    fused experts). Modules fed one tensor (q / k / v) share its product."""

    def __init__(self, mods: List[Tuple[str, CompressMixin]], count_only: bool = False):
        self.mods = mods
        self.count_only = count_only
        self.sums: Dict[int, Optional[torch.Tensor]] = {id(m): None for _, m in mods}
        self.counts: Dict[int, torch.Tensor] = {}
        for _, m in mods:
            experts = m.matrix_shape()[0] if isinstance(m, ExpertMatrix) else 1
            self.counts[id(m)] = torch.zeros(experts, dtype=torch.int64)
        self._last = (None, None)  # (input, its u^T u): q / k / v see one tensor in a row
        self.reduced = False

    def add(self, mod, x: torch.Tensor, expert: int = 0) -> None:
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            return
        cols = _cols(mod)
        if x.dim() == 0 or x.shape[-1] != cols:
            return  # a shape this weight does not multiply column-wise
        n = x.numel() // cols
        self.counts[id(mod)][expert] += n
        if self.count_only or n == 0:
            return
        if self._last[0] is x:
            p = self._last[1]
        else:
            x2 = x.detach().reshape(-1, cols).float()
            p = (x2.T @ x2).double()  # float32 product, float64 sums
            self._last = (x, p)
        acc = self.sums[id(mod)]
        if acc is None:
            n = self.counts[id(mod)].numel()
            acc = torch.zeros(
                (n, cols, cols) if isinstance(mod, ExpertMatrix) else (cols, cols), dtype=torch.float64, device=p.device
            )
            self.sums[id(mod)] = acc
        if isinstance(mod, ExpertMatrix):
            acc[expert] += p
        else:
            acc += p

    @contextmanager
    def attached(self):
        handles = []
        for _, m in self.mods:
            if isinstance(m, ExpertMatrix):
                m.qc_capture = self._expert_hook(m)
            else:
                handles.append(m.register_forward_pre_hook(self._hook))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            for _, m in self.mods:
                if isinstance(m, ExpertMatrix):
                    m.qc_capture = None
            self._last = (None, None)

    def _hook(self, mod, args):
        if args:
            self.add(mod, args[0])

    def _expert_hook(self, mod):
        def capture(x, e):
            if e is None:
                raise RuntimeError(
                    f"{mod.qc_name}: a product of tokens with the fused matrix that does not say "
                    "which expert it is (a batched experts implementation): set the model's "
                    "experts_implementation to 'eager' to calibrate GPTQ per expert"
                )
            self.add(mod, x, e)

        return capture

    def all_reduce(self) -> None:
        """Sum over ranks (once), so every rank solves the same weights."""
        if self.reduced or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        self.reduced = True
        for _, m in self.mods:
            dev = m.weight.device if dist.get_backend() == "nccl" else torch.device("cpu")
            c = self.counts[id(m)].to(dev)
            dist.all_reduce(c)
            self.counts[id(m)] = c.cpu()
            if self.count_only:
                continue
            s = self.sums[id(m)]
            home = s.device if s is not None else m.weight.device
            if s is None:
                s = torch.zeros(
                    ((c.numel(),) if isinstance(m, ExpertMatrix) else ()) + (_cols(m), _cols(m)), dtype=torch.float64
                )
            s = s.to(dev)
            dist.all_reduce(s)
            self.sums[id(m)] = s.to(home)

    def mean(self, mod) -> torch.Tensor:
        s = self.sums[id(mod)]
        n = self.counts[id(mod)].to(torch.float64)
        if isinstance(mod, ExpertMatrix):
            return s / n.clamp(min=1).to(s.device)[:, None, None]
        return s / float(n[0])

    def unreached(self) -> List[str]:
        return [n for n, m in self.mods if int(self.counts[id(m)].sum()) == 0]


def _cols(mod) -> int:
    if isinstance(mod, ExpertMatrix):
        return mod.matrix_shape()[2]
    return mod.weight_matrix_view(mod.weight).shape[1]


# --- solving one module ---------------------------------------------------------------------------


def _source(mod) -> torch.Tensor:
    """The full-precision weight in its stored layout: the master copy in optimizer-step mode."""
    wq = mod.qc_wq
    w = mod.weight.detach()
    return w if wq.master is None else wq.master.to(w.dtype)


def _spec(mod):
    """The module's quantizer at its (only) width."""
    return ranges._spec_at(mod.qc_wq, mod.qc_wq.target_bits)


def _expert_spec(mod, spec):
    """Each expert's [out, in] matrix as its own weight: per-tensor granularity, stored as one
    channel of the [E, out * in] view, is one scale of that matrix."""
    if not mod.qc_wq.per_expert:
        return spec
    if floats.is_float(spec):
        return floats.FloatSpec(spec.format, "tensor")
    return make_spec(spec.bits, symmetric=spec.symmetric, granularity="tensor")


class Solved:
    """One module's solution, held until the calibration ends: the compensated weights and their
    quantization in the stored layout (the quantization only until it is written into the weight),
    the scales, and the full-precision weight it replaces (put back if calibration fails)."""

    def __init__(self, weight, quantized, params, loss: float, rounded: List[str]):
        self.weight, self.quantized, self.params, self.loss, self.rounded = weight, quantized, params, loss, rounded
        self.original: Optional[torch.Tensor] = None


def solve_module(name: str, mod, H: torch.Tensor, counts: torch.Tensor) -> Solved:
    spec = _spec(mod)
    st = settings(mod)
    src = _source(mod)
    if not isinstance(mod, ExpertMatrix):
        W = mod.weight_matrix_view(src)
        grid = solver.make_grid(spec, W.shape[0], W.shape[1], W.dtype, st)
        sol = solver.solve(W, H, grid, st)
        return Solved(
            mod._from_matrix_view(sol.weight),
            mod._from_matrix_view(sol.quantized),
            sol.params,
            sol.loss,
            [name] if sol.rounded else [],
        )
    E, out, inp = mod.matrix_shape()
    espec = _expert_spec(mod, spec)
    ws, qs, params, loss, rounded = [], [], [], 0.0, []
    for e in range(E):
        W = mod.expert_matrix(src, e)
        He = H[e] if int(counts[e]) > 0 else torch.eye(inp, dtype=torch.float64, device=H.device)
        if int(counts[e]) == 0:
            rounded.append(f"{name}[{e}]")
        grid = solver.make_grid(espec, out, inp, W.dtype, st)
        sol = solver.solve(W, He, grid, st)
        if sol.rounded:
            rounded.append(f"{name}[{e}]")
        ws.append(sol.weight)
        qs.append(sol.quantized)
        params.append(sol.params)
        loss += sol.loss
    return Solved(
        _expert_layout(mod, torch.stack(ws)),
        _expert_layout(mod, torch.stack(qs)),
        _expert_params(mod, spec, params),
        loss,
        rounded,
    )


def _expert_layout(mod, mats: torch.Tensor) -> torch.Tensor:
    return mats.transpose(-1, -2).contiguous() if mod.qc_layout == IN_OUT else mats


def _expert_params(mod, spec, per_expert: list) -> tuple:
    """The experts' scales as the module's view holds them: integer scales in the [E * out, in]
    (or, per tensor, [E, out * in]) view's group order; float scales concatenated per expert as
    ExpertMatrix.expert_float_params splits them, global scales stacked."""
    if floats.is_float(spec):
        s = torch.cat([p[0].reshape(1, 1) if mod.qc_wq.per_expert else p[0] for p in per_expert])
        g = None if per_expert[0][1] is None else torch.stack([p[1].reshape(()) for p in per_expert])
        return s, g
    s = torch.cat([p[0].reshape(-1) for p in per_expert])
    z = None if per_expert[0][1] is None else torch.cat([p[1].reshape(-1) for p in per_expert])
    return s, z


@torch.no_grad()
def _write_quantized(mod, sol: Solved) -> None:
    """While calibrating: the module runs on its quantization (it is inactive until the end)."""
    sol.original = mod.weight.detach().clone()
    mod.weight.copy_(sol.quantized.to(mod.weight.dtype))
    sol.quantized = None


@torch.no_grad()
def _finish(mod, sol: Solved, was_active: bool) -> None:
    """The solution written for good: compensated weights, fixed (or learned) scales."""
    wq = mod.qc_wq
    w = mod.weight
    if wq.range_learning:
        _write_learned(mod, sol.params)
        wq.solved = ()
    else:
        wq.solved = tuple(None if t is None else t.to(w.device) for t in sol.params)
    if not wq.in_forward and was_active:
        # optimizer-step mode: the compensated weights are the master, the weight (which holds
        # their quantization since the solve) what the scheduler wrote from it
        wq.store.reset()
        wq.master = sol.weight.to(device=w.device, dtype=torch.float32).clone()
        wq.applied = w.detach().clone()
    else:
        wq.store.reset()
        w.copy_(sol.weight.to(w.dtype))
    wq.shrink = None


def _write_learned(mod, params) -> None:
    spec = _spec(mod)
    s, z = params
    if floats.is_float(spec):
        from ..quant import float_observers

        view = mod.weight_matrix_view(mod.weight.detach())
        s, g = float_observers.learned_init(view, spec, s, z)
        mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
        if g is not None:
            mod.weight_global_scale.copy_(g.reshape(mod.weight_global_scale.shape))
        return
    mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
    zp = mod._parameters.get("weight_zero_point")
    if zp is not None:
        zp.copy_(z.reshape(zp.shape))


# --- the whole calibration ------------------------------------------------------------------------


def check_kinds(targets) -> None:
    for name, m in targets:
        if m.qc_kind not in GPTQ_KINDS:
            raise ConfigError(
                _path(m),
                f"module {name!r} is a {m.qc_kind}; GPTQ solves a layer against the "
                "inputs it multiplies (Linear, transformers' Conv1D, fused experts)",
            )


def check_batches(targets, batches: list) -> None:
    if targets and not batches:
        name, m = targets[0]
        raise ConfigError(
            _path(m),
            f"module {name!r}{f' and {len(targets) - 1} more' if len(targets) > 1 else ''} "
            "use observer gptq, which solves the weights against their inputs on calibration "
            "batches, but calibrate_weight_ranges got no batches; pass a few batches of training "
            "data (GPTQ's paper: 128 sequences of 2048 tokens)",
        )


@contextmanager
def inactive(targets):
    """The modules to solve run their own weights while calibrating."""
    flags = [(m.qc_wq, m.qc_wq.active) for _, m in targets]
    for wq, _ in flags:
        wq.active = False
    try:
        yield dict((id(wq), a) for wq, a in flags)
    finally:
        for wq, a in flags:
            wq.active = a


def _solve_all(hess: Hessians, mods, solved: Dict[int, Tuple[str, object, Solved]]) -> None:
    hess.all_reduce()
    for name, m in mods:
        sol = solve_module(name, m, hess.mean(m), hess.counts[id(m)])
        log.info("qcompress: GPTQ solved %s (output error estimate %.4g)", name, sol.loss)
        _write_quantized(m, sol)
        solved[id(m)] = (name, m, sol)


@torch.no_grad()
def calibrate_gptq(model: nn.Module, targets, batches: list, forward: Optional[Callable] = None) -> int:
    """Solve `targets` (unsolved gptq modules) on `batches` (module docstring); returns how many."""
    check_kinds(targets)
    check_batches(targets, batches)
    seq = [(n, m) for n, m in targets if _sequential(m)]
    found = repeated_blocks(model, {id(m) for _, m in seq}) if seq else None
    in_blocks = set()
    if found is not None:
        in_blocks = {id(m) for block in found[1] for m in block.modules()}
    staged = [(n, m) for n, m in seq if id(m) in in_blocks]  # block by block
    last = [(n, m) for n, m in seq if id(m) not in in_blocks]  # on the quantized model
    first = [(n, m) for n, m in targets if not _sequential(m)]  # on the model before any solve
    if found is None:
        first, last = first + last, []
    solved: Dict[int, Tuple[str, object, Solved]] = {}
    was_training = model.training
    model.eval()
    with inactive(targets) as active_flags:
        try:
            reach = Hessians(staged + last, count_only=True)
            hess = Hessians(first)
            calls = BlockCalls(found[1], found[0]) if staged else None
            handles = calls.hooks() if calls is not None else []
            try:
                with hess.attached(), reach.attached():
                    for b in batches:
                        run_batch(model, b, forward)
            finally:
                for h in handles:
                    h.remove()
            if calls is not None and calls.unchained:
                m = staged[0][1]
                raise ConfigError(
                    _path(m).replace(".observer", ".observer_kwargs.sequential"),
                    f"{found[0]}[{calls.unchained[0]}] is not fed the output of {found[0]}"
                    f"[{calls.unchained[0] - 1}] as it is (the model changes the hidden state "
                    "between its blocks), so the blocks cannot be calibrated one after another: "
                    "set observer_kwargs.sequential: false",
                )
            reach.all_reduce()
            hess.all_reduce()
            missing = hess.unreached() + reach.unreached()
            if missing:
                m = dict(targets)[missing[0]]
                raise ConfigError(
                    _path(m),
                    f"the calibration batches never reached module(s) {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''}: GPTQ has no inputs to solve them "
                    "against; pass batches whose forward runs them, or leave them out of the group",
                )
            _solve_all(hess, first, solved)
            if calls is not None:
                _run_blocks(calls, staged, solved, len(batches))
            if last:
                hess = Hessians(last)
                with hess.attached():
                    for b in batches:
                        run_batch(model, b, forward)
                _solve_all(hess, last, solved)
        except BaseException:
            for name, m, sol in solved.values():  # put the full-precision weights back
                m.weight.copy_(sol.original)
            raise
        finally:
            model.train(was_training)
        for name, m, sol in solved.values():
            _finish(m, sol, active_flags[id(m.qc_wq)])
    rounded = [r for _, _, sol in solved.values() for r in sol.rounded]
    if rounded:
        warnings.warn(
            f"GPTQ: {rounded[:6]}{' ...' if len(rounded) > 6 else ''} were rounded to nearest: no "
            "calibration token reached these experts, or no dampening made the Hessian factor",
            stacklevel=3,
        )
    return len(solved)


def _run_blocks(calls: BlockCalls, staged, solved, n_batches: int) -> None:
    """Block by block: Hessians of the block's modules on the inputs the quantized blocks before
    it gave, solve, then the block's quantized outputs feed the next one."""
    hidden = list(calls.first_inputs)
    for i, block in enumerate(calls.blocks):
        inside = {id(m) for m in block.modules()}
        mods = [(n, m) for n, m in staged if id(m) in inside]
        if mods:
            hess = Hessians(mods)
            with hess.attached():
                for b in range(n_batches):
                    calls.run(i, b, hidden[b])
            _solve_all(hess, mods, solved)
        hidden = [calls.run(i, b, hidden[b]) for b in range(n_batches)]
