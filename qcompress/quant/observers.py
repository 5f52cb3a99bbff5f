"""Range observers: how the range of an integer grid is chosen from the values it quantizes.

minmax  the group's own [min, max] (the formulas of reference.py), qcompress's default.
mse     the group's [min, max] shrunk by the factor p that minimises the reconstruction error
        sum over the group of (x^(p) - x)^2 (norm 2, summed in float64), p searched over the grid
        p = 1 - k / GRID_STEPS for k = 0 .. MAX_SHRINK * GRID_STEPS - 1, i.e. 1.00, 0.99, ..., 0.21.
        Ties keep the larger p, and p = 1 is minmax itself, so mse is never worse than minmax on
        that error. Rounding is nearest during the search (a stochastic grid is chosen the same).
        Symmetric grids then refine the grid's choice by least squares (`refine`): with the codes
        q = clamp(round(x / s)) of the current scale s fixed, the scale that minimises
        sum (s' q - x)^2 is s' = sum x q / sum q^2 (float64 sums), i.e. the factor p' = p s' / s
        (rounded to float32); p' is kept only where the group's error with p' (re-rounded codes,
        the scale int_params gives for [p' lo, p' hi]) is strictly smaller, and the step repeats
        from the kept p' up to REFINE_ITERS times. So the refined factor is never worse than the
        grid's choice (nor than minmax), and it need not lie on the grid. Asymmetric grids keep
        the grid's choice (one factor shrinks both ends; a separate low/high search would need two
        factors per group).

The search is set per group with compressed-tensors' `observer_kwargs` (Search below):
`grid` (steps of 1 / grid), `maxshrink` (factors down to 1 - maxshrink, exclusive: the
defaults 100 and 0.8 give the grid above; llm-compressor's are 100 and 0.2) and `norm` (the error
is sum |x^(p) - x|^norm; llm-compressor uses 2.4). The least-squares refinement belongs to norm 2
only, and the fused kernel computes squared errors: another norm searches in torch, unrefined.

`weight_by: inputs` (weights only; qcompress.calibrate_weight_ranges records what it needs)
replaces the weights' own error by the error of the layer's output each group causes:
d^T M d, d = x^(p) - x over the group and M the block of E[u u^T] of the module's input u over the
group's columns (per-group granularity; the diagonal E[u_j^2] where a group spans whole rows).
The refinement becomes the weighted least squares s' = q^T M x / q^T M q, the same rule otherwise
(kept only where the weighted error drops). Norm 2 only; the same backends as the plain search.
With `cross_groups` (the default) and per-group granularity, the groups of each row are then
chosen together against the whole E[u u^T] (cross_groups.descend: coordinate descent from the
per-group choice over the grid, torch only, on the weight's device): the output error's cross terms
between groups are as large as the blocks on real layers.

Binary and ternary kinds have no range (scale = mean |x| of the values or of the kept values):
both observers give their own scale there (shrink 1).

The search runs once per range update (the first quantization and each bit drop): on CPU in
the fused `mse_errors` kernel (every candidate's scales computed at once, then one pass over the
tensor per candidate that only accumulates the plain or the weighted errors) and the refinement
in `mse_refine_terms` (one pass per step for each group's <q, x>, <q, q> and error), elsewhere
vectorized in torch (`backend="reference"`, and CUDA tensors: one pass per grid point, every
group at once); never a Python loop over elements or groups. Both backends give the same factors
(their float64 sums are ordered differently, so only an exact tie could part them).
Activation ranges (`activation_range`) use the grid only.

What it buys (benchmarks/results/quality.md): the grid lowers the weights' summed squared error
well below minmax's and the refinement a little further, but the PTQ perplexity hardly moves: the
weights' error is not the loss's. Weighted by the inputs, with cross_groups, the excess falls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from . import reference
from .cross_groups import descend
from .reference import Spec, group_minmax, group_view, int_params, shrunk_deviation

OBSERVERS = ("minmax", "mse")
GRID_STEPS = 100
MAX_SHRINK = 0.80
REFINE_ITERS = 4  # least-squares refinements of a symmetric grid's choice (each kept only if better)
ACT_SAMPLE = 16384  # activations: the error is measured on at most this many strided elements
Inner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # per-group weighted inner product


@dataclass(frozen=True)
class Search:
    """The mse observer's search (config: observer_kwargs): candidates p = 1 - k / grid for
    k = 0 .. round(maxshrink * grid) - 1, error sum |x^(p) - x|^norm."""

    grid: int = GRID_STEPS
    maxshrink: float = MAX_SHRINK
    norm: float = 2.0
    weight_by: str = "none"  # "inputs": the caller passes the input moments (mse_shrink)
    cross_groups: bool = True  # weight_by inputs, per group: the row's groups chosen together (cross_groups.py)

    def candidates(self) -> int:
        return int(round(self.maxshrink * self.grid))


DEFAULT_SEARCH = Search()
DEFAULT_SEARCH_FIELDS = (
    DEFAULT_SEARCH.grid,
    DEFAULT_SEARCH.maxshrink,
    DEFAULT_SEARCH.norm,
    DEFAULT_SEARCH.weight_by,
    DEFAULT_SEARCH.cross_groups,
)  # Search(*fields)


def shrink_grid(device=None, search: Search = DEFAULT_SEARCH) -> torch.Tensor:
    """The candidate shrink factors, largest first, float32."""
    g = search.grid
    return torch.tensor([(g - k) / g for k in range(search.candidates())], dtype=torch.float32, device=device)


def _nearest(spec: Spec) -> Spec:
    if spec.rounding == "nearest":
        return spec
    return reference.make_spec(
        spec.bits,
        symmetric=spec.symmetric,
        granularity=spec.granularity,
        group_size=spec.group_size,
        num_groups=spec.num_groups,
        numerics=spec.numerics,
        ternary=spec.ternary,
    )


def _kernels_run(x: torch.Tensor) -> bool:
    """The fused search kernels (mse_errors, mse_refine_terms) run on CPU tensors when built."""
    from . import kernels

    return kernels.available() and x.device.type == "cpu"


def _search_kernel(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    spec: Spec,
    search: Search = DEFAULT_SEARCH,
    moments: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """The same search with the fused CPU kernel: every candidate's parameters at once, then one
    pass over the tensor per candidate computing only the (squared, or with the input moments the
    weighted) errors."""
    from . import kernels

    if search.norm != 2.0 and moments is None:
        return None
    grid = shrink_grid(lo.device, search)[:, None]
    s, zp = int_params(lo[None, :] * grid, hi[None, :] * grid, _nearest(spec))
    err = kernels.mse_errors(x, spec, s, zp, moments)
    if err is None:
        return None
    return grid[:, 0][torch.argmin(err, dim=0)]  # argmin: the first (largest p) of equal errors


def _search(
    X: torch.Tensor,
    counts: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    spec: Spec,
    search: Search = DEFAULT_SEARCH,
    W: Optional[Inner] = None,
) -> torch.Tensor:
    """Per-group argmin over the grid of the error of X quantized with [p lo, p hi] (the
    reference: one vectorized pass per grid point); W: the weighted error (input_weighting)."""
    spec = _nearest(spec)
    best = torch.ones(X.shape[0], dtype=torch.float32, device=X.device)
    best_err = torch.full((X.shape[0],), float("inf"), dtype=torch.float64, device=X.device)
    for p in shrink_grid(X.device, search):
        err = _errors(X, counts, lo, hi, p, spec, search.norm, W)[0]
        better = err < best_err  # strict: on a tie the larger shrink factor stays
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, p, best)
    return best


def _errors(
    X: torch.Tensor,
    counts: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    p: torch.Tensor,
    spec: Spec,
    norm: float = 2.0,
    W: Optional[Inner] = None,
):
    """Per-group error (float64) of X quantized with [p lo, p hi]: sum |x^ - x|^norm, or with W
    the input-weighted d^T M d; its codes and scales."""
    d, q, s = shrunk_deviation(X, counts, lo, hi, p, spec)
    if W is not None:
        return W(d, d), q, s
    return (d.square() if norm == 2.0 else d.abs().pow(norm)).sum(dim=1), q, s


Terms = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
# ^ p -> (scale, <q, x>, <q, q>, error) per group, q the codes of the scale int_params gives p


def refine(p: torch.Tensor, terms: Terms) -> torch.Tensor:
    """Least-squares refinement of symmetric shrink factors p (float32 [groups]): see the module
    docstring; with the input weighting the weighted least squares s' = q^T M x / q^T M q. The
    terms come from torch (reference_terms) or the fused kernel (kernels.mse_refine_terms)."""
    s, num, den, err = terms(p)
    for _ in range(REFINE_ITERS):
        ok = (den > 0) & (num > 0)
        p_new = (p.double() * num / (s.double() * torch.where(ok, den, 1.0))).to(torch.float32)
        ok &= torch.isfinite(p_new) & (p_new > 0)
        p_new = torch.where(ok, p_new, p)
        s_new, num_new, den_new, e_new = terms(p_new)
        better = ok & (e_new < err)
        if not bool(better.any()):
            break
        p, s = torch.where(better, p_new, p), torch.where(better, s_new, s)
        err, num, den = (torch.where(better, a, b) for a, b in ((e_new, err), (num_new, num), (den_new, den)))
    return p


def reference_terms(
    X: torch.Tensor, counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: Spec, W: Optional[Inner] = None
) -> Terms:
    """refine()'s terms in torch, on the group view X (W: the input weighting, else plain)."""
    Xd = X.double()
    inner = W if W is not None else (lambda a, b: (a * b).sum(dim=1))

    def terms(p):
        err, q, s = _errors(X, counts, lo, hi, p, spec, W=W)
        qd = q.double()
        return s, inner(qd, Xd), inner(qd, qd), err

    return terms


def kernel_terms(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: Spec, moments: Optional[torch.Tensor] = None
) -> Terms:
    """refine()'s terms from the fused CPU kernel (_kernels_run(x)), one pass per step."""
    from . import kernels

    def terms(p):
        s = int_params(lo * p, hi * p, spec)[0]
        return (s, *kernels.mse_refine_terms(x, spec, s, moments))

    return terms


def moment_block(spec: Spec) -> int:
    """Columns per block of the input moments the weighted search uses with this spec: a group's
    own columns (granularity group), else 1 (the diagonal: a group spans whole rows)."""
    if spec.granularity != "group":
        return 1
    assert spec.group_size is not None  # make_spec sets it with granularity "group"
    return spec.group_size


def check_moments(x: torch.Tensor, spec: Spec, moments: torch.Tensor) -> int:
    """ValueError unless the moments fit the weight matrix x as quantized by spec; their block b."""
    b = moment_block(spec)
    if (
        x.dim() != 2
        or spec.granularity == "groups"
        or moments.dim() != 3
        or tuple(moments.shape) != (-(-x.shape[1] // b), b, b)
    ):
        raise ValueError(
            f"input moments of shape {tuple(moments.shape)} do not fit a weight matrix of shape "
            f"{tuple(x.shape)} quantized per {spec.granularity}"
            f"{f' of {spec.group_size}' if spec.granularity == 'group' else ''}"
        )
    return b


def input_weighting(x: torch.Tensor, spec: Spec, moments: torch.Tensor) -> Inner:
    """The weighted inner product of the search: (a, b) in group_view(x)'s layout -> per group
    sum a_g^T M_g b_g (float64), M_g the block of E[u u^T] (u the module's input) over group g's
    columns. x: the [rows, cols] weight matrix; moments: [ceil(cols / b), b, b] with
    b = moment_block(spec) (b = 1: the diagonal E[u_j^2])."""
    b = check_moments(x, spec, moments)
    M = moments.to(device=x.device, dtype=torch.float64)
    rows = x.shape[0]
    if b == 1:
        w = group_view(M[:, 0, 0].expand(rows, -1).contiguous(), spec)[0]
        return lambda a, c: (w * a * c).sum(dim=1)
    nb = M.shape[0]

    def inner(a, c):  # rows of X are (weight row, group) pairs, group fastest
        a3 = a.reshape(rows, nb, b).transpose(0, 1)
        c3 = c.reshape(rows, nb, b).transpose(0, 1)
        return (torch.bmm(a3, M) * c3).sum(dim=2).transpose(0, 1).reshape(-1)

    return inner


def mse_shrink(
    x: torch.Tensor,
    spec: Spec,
    backend: Optional[str] = None,
    search: Search = DEFAULT_SEARCH,
    moments: Optional[torch.Tensor] = None,
    cross: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The mse observer's shrink factor of each group of x (float32 [groups]; ones for binary and
    ternary kinds, which have no range): the grid's choice, refined by least squares on symmetric
    grids (norm 2). backend: None (the CPU kernels when built: mse_errors for the grid,
    mse_refine_terms for the refinement) or "reference" (torch); the same choices. moments
    (observer_kwargs.weight_by: inputs, a 2-D x): the error is the input-weighted one
    (input_weighting), in both backends. cross (the whole [cols, cols] E[u u^T], per-group
    granularity): then the groups of each row are chosen together against it (cross_groups.descend),
    starting from the per-group choice."""
    xf = x.detach().to(torch.float32)
    X, counts = group_view(xf, spec)
    if spec.kind != "int" or X.shape[1] == 0:
        return torch.ones(X.shape[0], dtype=torch.float32, device=X.device)
    lo, hi = group_minmax(X, counts)
    reference._check_finite(torch.stack([lo, hi]), "min/max")
    fused = backend != "reference" and _kernels_run(xf)
    W = None
    if moments is not None:
        check_moments(xf, spec, moments)
        if not fused:  # the torch weighting, only where torch searches
            W = input_weighting(xf, spec, moments)
    p = _search_kernel(xf, lo, hi, spec, search, moments) if fused else None
    if p is None:
        p = _search(X, counts, lo, hi, spec, search, W)
    nearest = _nearest(spec)
    if search.norm == 2.0 and nearest.symmetric:  # the refinement is norm 2's, on symmetric grids
        terms = kernel_terms(xf, lo, hi, nearest, moments) if fused else reference_terms(X, counts, lo, hi, nearest, W)
        p = refine(p, terms)
    if cross is not None:
        p = descend(xf, nearest, p, cross, shrink_grid(xf.device, search))
    return p


def weight_params(
    x: torch.Tensor,
    spec: Spec,
    observer: str,
    shrink: Optional[torch.Tensor] = None,
    search: Search = DEFAULT_SEARCH,
    moments: Optional[torch.Tensor] = None,
    cross: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, zero point or None) of each group of x, float32 [groups] (the zero point holds an
    integer), as the observer chooses them; `shrink` reuses factors chosen earlier; moments,
    cross: the mse search's input weighting (mse_shrink)."""
    if observer not in OBSERVERS:
        raise ValueError(f"observer must be one of {OBSERVERS}, got {observer!r}")
    xf = x.detach().to(torch.float32)
    X, counts = group_view(xf, spec)
    if observer == "mse" and shrink is None:
        shrink = mse_shrink(xf, spec, search=search, moments=moments, cross=cross)
    s, zp, _ = reference.qparams(X, counts, spec, shrink=shrink if spec.kind == "int" else None)
    return s, zp


def activation_range(
    x: torch.Tensor, spec: Spec, observer: str, search: Search = DEFAULT_SEARCH
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(min, max) float32 scalars of a whole activation tensor as the observer chooses them: its own
    range, or (mse) that range shrunk by the factor whose error is least on at most ACT_SAMPLE
    evenly strided elements of x."""
    flat = x.detach().reshape(-1).to(torch.float32)
    lo, hi = flat.amin(), flat.amax()
    if observer == "minmax" or spec.kind != "int" or flat.numel() == 0:
        return lo, hi
    stride = max(1, -(-flat.numel() // ACT_SAMPLE))
    sample = flat[::stride].reshape(1, -1)
    counts = torch.full((1,), sample.shape[1], dtype=torch.int64, device=sample.device)
    p = _search(sample, counts, lo.reshape(1), hi.reshape(1), spec, search)[0]
    return lo * p, hi * p
