"""The input-weighted mse search over whole rows: the groups of a row chosen together.

A layer's output error for one weight row is d^T M d, d the row's quantization error and
M = E[u u^T] of the module's input (GPTQ's objective). The per-group search (observers.mse_shrink
with block moments) minimises only the diagonal blocks d_g^T M_gg d_g, each group alone. Inputs of
real layers are correlated across groups (after a LayerNorm a few channels move together), so the
cross terms 2 d_g^T M_gh d_h are as large as the blocks, and errors of different groups can cancel
in the output instead of adding up.

`descend` minimises the whole-row error by coordinate descent over the groups of every row at
once: starting from the per-group choice, each group in turn takes the factor among {its current
one} + the search grid that minimises

    d_g(p)^T M_gg d_g(p) + 2 d_g(p)^T c_g,     c_g = sum over h != g of M_gh d_h

(the row's error as a function of that group's factor, the others fixed). A group keeps its factor
unless another is strictly better, so the row's error never rises: the result is never worse than
the per-group choice on the output error. (That choice is never worse than minmax on each group's
own block; on the whole row, cross terms included, neither is bound to beat minmax in every row.)
Sweeps over the groups repeat until none changes or MAX_SWEEPS ran. float64 throughout (M d is
updated row by row as groups move); rows are independent, so they are processed in chunks whose
candidate errors fit CHUNK_BYTES.

It lowers the per-layer output error on the calibration inputs below the per-group choice's, and
with it the PTQ perplexity excess (benchmarks/results/quality.md).
"""

from __future__ import annotations

import torch

from .reference import Spec, group_minmax, group_view, shrunk_deviation

MAX_SWEEPS = 4  # passes over a row's groups (each rarely changes much after the third)
CHUNK_BYTES = 256 * 2**20  # float64 candidate errors held at once: [candidates, rows, cols]


def padded(M: torch.Tensor, width: int, device) -> torch.Tensor:
    """M (float64) zero-padded to the group view's width (a ragged last group's padding weighs 0)."""
    M = M.to(device=device, dtype=torch.float64)
    n = M.shape[0]
    return M if n == width else torch.nn.functional.pad(M, (0, width - n, 0, width - n))


@torch.no_grad()
def descend(
    x: torch.Tensor, spec: Spec, p: torch.Tensor, M: torch.Tensor, grid: torch.Tensor, sweeps: int = MAX_SWEEPS
) -> torch.Tensor:
    """Shrink factors (float32 [rows * groups], group fastest) minimising each row's d^T M d by
    coordinate descent from p (see the module docstring). x: the float32 [rows, cols] weight
    matrix, quantized per group of spec.group_size columns; M: E[u u^T], [cols, cols]; grid: the
    candidate factors (float32 [K]); spec: the search's rounding (nearest)."""
    rows, cols = x.shape
    if spec.granularity != "group" or tuple(M.shape) != (cols, cols):
        raise ValueError(
            f"cross-group moments of shape {tuple(M.shape)} do not fit a weight matrix of "
            f"shape {tuple(x.shape)} quantized per {spec.granularity}"
        )
    g = spec.group_size
    assert g is not None  # granularity "group", checked above
    X, counts = group_view(x, spec)
    G = X.shape[0] // rows
    width = G * g
    lo, hi = group_minmax(X, counts)
    Mp = padded(M, width, x.device)
    grid = grid.to(device=x.device, dtype=torch.float32)
    K = grid.numel()
    out = p.to(device=x.device, dtype=torch.float32).clone().reshape(rows, G)
    chunk = max(1, CHUNK_BYTES // (8 * (2 * K + 3) * width))  # cand and bmm's product
    slices = [slice(j * g, (j + 1) * g) for j in range(G)]
    blocks = torch.stack([Mp[sl, sl] for sl in slices])  # [G, g, g]
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        sel = slice(r0 * G, r1 * G)
        Xc, cc, loc, hic = X[sel], counts[sel], lo[sel], hi[sel]
        R = r1 - r0
        idx = torch.arange(R, device=x.device)
        D = shrunk_deviation(Xc, cc, loc, hic, out[r0:r1].reshape(-1), spec)[0].reshape(R, width)
        # every candidate's deviations, group-major so each group's slice is contiguous: [G, K, R, g]
        cand = torch.empty(G, K, R, g, dtype=torch.float64, device=x.device)
        for k, c in enumerate(grid):
            cand[:, k] = shrunk_deviation(Xc, cc, loc, hic, c, spec)[0].reshape(R, G, g).transpose(0, 1)
        # each candidate's own block term d^T M_gg d: fixed while the other groups move
        own = (torch.bmm(cand.reshape(G, K * R, g), blocks) * cand.reshape(G, K * R, g)).sum(-1).reshape(G, K, R)
        pc = out[r0:r1]
        MD = D @ Mp  # kept current by each move below
        for _ in range(sweeps):
            changed = False
            for j, sl in enumerate(slices):
                Mgg = blocks[j]
                cur = D[:, sl]
                cur_M = cur @ Mgg
                cross = MD[:, sl] - cur_M  # sum over h != g of M_gh d_h
                opts = cand[j]
                err = torch.cat(
                    [
                        ((cur_M + 2.0 * cross) * cur).sum(-1)[None],
                        own[j] + 2.0 * torch.einsum("krg,rg->kr", opts, cross),
                    ]
                )
                best = torch.argmin(err, dim=0)  # index 0 (the current factor) wins ties
                new = torch.where((best > 0)[:, None], opts[(best - 1).clamp(min=0), idx], cur)
                moved = torch.nonzero((new != cur).any(dim=1)).flatten()
                if moved.numel() == 0:
                    continue
                changed = True
                pc[moved, j] = grid[best[moved] - 1]
                MD[moved] += (new[moved] - cur[moved]) @ Mp[sl, :]  # only the rows that moved
                D[moved, sl] = new[moved]
            if not changed:
                break
    return out.reshape(-1)
