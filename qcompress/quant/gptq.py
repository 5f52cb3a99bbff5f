"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2023): one weight matrix quantized column by column, each column's rounding error
spread over the columns not yet quantized so that the layer's output error on the calibration
inputs, (W - Q) H (W - Q)^T with H = E[u u^T], stays small.

For W [rows, cols] and H [cols, cols] (float64 here):
  1. Columns whose input never fired (H_jj = 0) get H_jj = 1: they are rounded to nearest and
     take no error from the others (their weights are kept, not zeroed as the reference code
     does, so inputs calibration never saw still meet the trained weights).
  2. act_order: columns permuted by decreasing H_jj (stable), H permuted with them.
  3. H += damp * mean(diag H) * I; U = the upper Cholesky factor of H^-1 (H^-1 = U^T U).
  4. For each column j in order, w the column as the earlier columns left it:
       q = quantize(w),  e = (w - q) / U_jj,  w_k -= e U_jk for every later column k,
     with the updates of later blocks deferred and applied at once per block of `block_size`
     columns (the lazy batch updates of the paper: the same values, fewer passes over W).
Scales: per tensor and per channel they are chosen on W before the solve; per group, when the
loop reaches the group's first column, from the group's columns as the updates before it left
them (the paper's rule). The block size is then rounded to a multiple of the group size, so a
group never straddles a deferred update and its scales see exactly those values. With act_order
and groups, every group's scales are chosen on the original W before the solve (llm-compressor's
"static" order), so each column keeps its original group and the export needs no g_idx.

`quantize` is the format's own quantizer with the group's scales, on the column as stored in the
weight's dtype: what the compress-aware module's forward then computes from the returned weights
and scales, element for element. The returned weight is every column as it stood when it was
quantized (the error-compensated weights); Q is its quantization.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from . import float_observers, floats, observers
from .api import fake_quantize_spec
from .floats import FloatSpec
from .observers import DEFAULT_SEARCH, Search
from .reference import Spec, make_spec

DAMP_RETRIES = 3  # a Hessian Cholesky cannot factor: damp x 10 each time, then round to nearest


@dataclass(frozen=True)
class Settings:
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    observer: str = "minmax"  # how each group's scale is chosen: minmax | mse
    search: Search = field(default=DEFAULT_SEARCH)


@dataclass
class Solution:
    weight: torch.Tensor  # the error-compensated weights, W's dtype and shape
    quantized: torch.Tensor  # their quantization (W's dtype)
    params: tuple  # the scales: int (scale, zero point or None), float (scale, global or None)
    loss: float  # sum over columns of (w - q)^2 / U_jj^2 / 2: the output error estimate
    damp: float  # the dampening that factored (a retry raises it)
    rounded: bool = False  # no dampening factored H: rounded to nearest with the same scales


class IntGrid:
    """Integer grids of one [rows, cols] matrix: tensor, channel or group granularity (group
    scales as qcompress's group view orders them: row-major [rows, groups], a ragged last group)."""

    def __init__(self, spec: Spec, rows: int, cols: int, observer: str = "minmax", search: Search = DEFAULT_SEARCH):
        if spec.kind != "int" or spec.granularity not in ("tensor", "channel", "group"):
            raise ValueError(f"GPTQ takes integer grids per tensor, channel or group, not {spec}")
        self.spec, self.rows, self.cols = spec, rows, cols
        self.observer, self.search = observer, search
        self.row_spec = make_spec(spec.bits, symmetric=spec.symmetric, granularity="channel")
        self.width: int = spec.group_size if spec.granularity == "group" and spec.group_size else cols
        self.groups = max(1, math.ceil(cols / self.width))
        self.scale = torch.zeros(rows, self.groups, dtype=torch.float32)
        self.zero: Optional[torch.Tensor] = (
            None if spec.symmetric else torch.zeros(rows, self.groups, dtype=torch.float32)
        )
        self._tensor: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    @property
    def in_loop(self) -> bool:
        return self.spec.granularity == "group"

    def fit(self, X: torch.Tensor, k: int) -> None:
        """Group k's scales (one per row) from its columns X [rows, n] (float32)."""
        s, z = observers.weight_params(X, self.row_spec, self.observer, search=self.search)
        self.scale[:, k] = s.cpu()
        if self.zero is not None and z is not None:  # asymmetric grids have a zero point
            self.zero[:, k] = z.cpu()

    def fit_all(self, W: torch.Tensor) -> None:
        W = W.float()
        if self.spec.granularity == "tensor":
            s, z = observers.weight_params(W, self.spec, self.observer, search=self.search)
            s1, z1 = s.reshape(1).cpu(), None if z is None else z.reshape(1).cpu()
            self._tensor = (s1, z1)
            self.scale[:, 0] = s1
            if self.zero is not None and z1 is not None:
                self.zero[:, 0] = z1
            return
        for k in range(self.groups):
            self.fit(W[:, k * self.width : (k + 1) * self.width], k)

    def quantize(self, w: torch.Tensor, k: int) -> torch.Tensor:
        s = self.scale[:, k].to(w.device)
        z = None if self.zero is None else self.zero[:, k].to(w.device)
        return fake_quantize_spec(w.reshape(-1, 1), self.row_spec, scale=s, zero_point=z).reshape(-1)

    def params(self):
        """(scale, zero point or None), float32, one per group of the module's spec."""
        if self._tensor is not None:
            return self._tensor
        z = None if self.zero is None else self.zero.reshape(-1).clone()
        return self.scale.reshape(-1).clone(), z


class FloatGrid:
    """Float-format grids (quant/floats.py) of one [rows, cols] matrix: FP8 per tensor, channel,
    group or 128 x 128 block, NVFP4 (groups of 16 under one global scale chosen on the whole
    matrix first, as llm-compressor does), MXFP4 / MXFP8 (groups of 32)."""

    def __init__(
        self,
        spec: FloatSpec,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        observer: str = "minmax",
        search: Search = DEFAULT_SEARCH,
    ):
        self.spec, self.rows, self.cols, self.dtype = spec, rows, cols, dtype
        self.observer, self.search = observer, search
        gran = spec.granularity
        self.width: int = {"group": spec.group_size, "block": floats.BLOCK[1]}.get(gran) or cols
        self.groups = max(1, math.ceil(cols / self.width))
        self.row_spec = FloatSpec(spec.format, "channel")  # one scale per row of a column
        self.slice_spec = FloatSpec(spec.format, gran, spec.group_size) if gran in ("group", "block") else spec
        self.gscale: Optional[torch.Tensor] = None
        # per group: [rows] scale of each row (block: expanded)
        self.scales: List[Optional[torch.Tensor]] = [None] * self.groups
        self._whole: Optional[torch.Tensor] = None

    @property
    def in_loop(self) -> bool:
        return self.spec.granularity in ("group", "block")

    def set_global(self, W: torch.Tensor) -> None:
        """NVFP4's global scale, from the matrix before the solve (minmax, or the mse search's)."""
        if self.spec.scale_kind != "e4m3":
            return
        if self.observer == "mse":
            pg = float_observers.mse_shrink(W, self.spec, self.search)[-1]
            self.gscale = float_observers.global_at(W, pg)
        else:
            self.gscale = floats.tensor_global_scale(W)

    def _choose(self, X: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
        if self.observer != "mse":
            return floats.qparams(X, spec, self.gscale)[0]
        a = float_observers._absmax(X, spec)
        best = float_observers._argmin(
            X, spec, a, float_observers.candidates(spec, self.search, a.device), self.gscale, self.search.norm
        )
        return float_observers.block_scales(a, spec, best, self.gscale)

    def fit(self, X: torch.Tensor, k: int) -> None:
        s = self._choose(X.to(self.dtype), self.slice_spec)
        if self.spec.granularity == "block":  # [row blocks, 1] -> one per row
            s = s.reshape(-1).repeat_interleave(floats.BLOCK[0])[: self.rows]
        self.scales[k] = s.reshape(-1)

    def fit_all(self, W: torch.Tensor) -> None:
        W = W.to(self.dtype)
        if self.spec.granularity in ("tensor", "channel"):
            s = self._choose(W, self.spec)
            self._whole = s
            row = s.reshape(-1).expand(self.rows) if self.spec.granularity == "tensor" else s.reshape(-1)
            self.scales = [row]
            return
        for k in range(self.groups):
            self.fit(W[:, k * self.width : (k + 1) * self.width], k)

    def quantize(self, w: torch.Tensor, k: int) -> torch.Tensor:
        s = self.scales[0 if self._whole is not None else k]
        assert s is not None, "fit or fit_all chooses a group's scales before it is quantized"
        s = s.to(w.device)
        return floats.fake_quantize_float(
            w.reshape(-1, 1), self.row_spec, scale=s.reshape(-1, 1), gscale=self.gscale
        ).reshape(-1)

    def params(self):
        """(scale in the shape floats.qparams gives the module's spec, global scale or None)."""
        if self._whole is not None:
            return self._whole.clone(), self.gscale
        gran = self.spec.granularity
        cols = torch.stack(self.scales, dim=1)  # [rows, groups]
        if gran == "block":
            cols = cols[:: floats.BLOCK[0]]  # one row per row block
        return cols.contiguous(), self.gscale


def make_grid(spec, rows: int, cols: int, dtype: torch.dtype, settings: Settings):
    if floats.is_float(spec):
        return FloatGrid(spec, rows, cols, dtype, settings.observer, settings.search)
    return IntGrid(spec, rows, cols, settings.observer, settings.search)


def _inverse_factor(H: torch.Tensor, damp: float):
    """(U, damp used): upper Cholesky factor of (H + damp mean(diag H) I)^-1, retrying with more
    dampening; (None, damp) when none factors."""
    mean = float(torch.diagonal(H).mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(DAMP_RETRIES):
        d = damp * (10**attempt)
        L, info = torch.linalg.cholesky_ex(H + (d * mean) * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0 and bool(torch.isfinite(U).all()):
                return U, d
    return None, damp


@torch.no_grad()
def solve(W: torch.Tensor, H: torch.Tensor, grid, settings: Optional[Settings] = None) -> Solution:
    """GPTQ of the matrix W [rows, cols] against H = E[u u^T] [cols, cols] (module docstring); the
    grid (IntGrid / FloatGrid) keeps the scales it chose (Solution.params)."""
    settings = settings or Settings()
    rows, cols = W.shape
    dtype = W.dtype
    work = W.detach().to(torch.float64).clone()
    H = H.detach().to(device=work.device, dtype=torch.float64).clone()
    if H.shape != (cols, cols):
        raise ValueError(f"the Hessian is {tuple(H.shape)}, the weight has {cols} columns")
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    if isinstance(grid, FloatGrid):
        grid.set_global(W.detach().to(dtype))
    upfront = settings.act_order or not grid.in_loop
    if upfront:
        grid.fit_all(W.detach().to(dtype))
    perm = None
    if settings.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        work, H = work[:, perm], H[perm][:, perm]
    with _one_thread(work.device):  # torch's threaded cholesky_inverse stalls on a busy CPU
        U, damp = _inverse_factor(H, settings.damp)
    rounded = U is None
    if rounded:
        U = torch.eye(cols, dtype=torch.float64, device=work.device)
    width = grid.width
    B = settings.block_size if upfront else max(width, (settings.block_size // width) * width)
    # columns as rows: each column and each rank-1 update is contiguous
    work_t = work.t().contiguous()
    out = torch.empty(cols, rows, dtype=dtype, device=W.device)
    quant = torch.empty_like(out)
    loss = torch.zeros((), dtype=torch.float64, device=work.device)
    for i1 in range(0, cols, B):
        i2 = min(i1 + B, cols)
        block = work_t[i1:i2].clone()
        errs = torch.empty_like(block)
        with _one_thread(work.device):
            _columns(block, errs, out, quant, U, grid, perm, upfront, width, i1, i2, dtype, loss)
        if i2 < cols:
            work_t[i2:].addmm_(U[i1:i2, i2:].t(), errs, alpha=-1.0)
    out, quant = out.t(), quant.t()
    if perm is not None:
        inv = torch.argsort(perm)
        out, quant = out[:, inv], quant[:, inv]
    out, quant = out.contiguous(), quant.contiguous()
    return Solution(out, quant, grid.params(), float(loss), damp, rounded)


@contextmanager
def _one_thread(device):
    """The column loop's operations are a few thousand elements each: on the CPU, intra-op threads
    cost more to wake than they save (hundreds of times more on a busy machine); so does the
    threaded cholesky_inverse of a few thousand columns."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _columns(block, errs, out, quant, U, grid, perm, upfront, width, i1, i2, dtype, loss):
    """One block's columns (rows of `block`, the transposed weights), each quantized and its error
    spread over the block's later columns."""
    for i in range(i2 - i1):
        j = i1 + i
        c = int(perm[j]) if perm is not None else j
        k = c // width
        if not upfront and c % width == 0:  # a group starts: its scales from its current columns
            grid.fit(block[i : i + width].t().to(dtype), k)
        w = block[i]
        stored = w.to(dtype)
        q = grid.quantize(stored, k).to(dtype)
        out[j], quant[j] = stored, q
        e = (w - q.to(torch.float64)) / U[j, j]
        loss += e.dot(e) / 2.0
        block[i:].addr_(U[j, j:i2], e, alpha=-1.0)
        errs[i] = e
