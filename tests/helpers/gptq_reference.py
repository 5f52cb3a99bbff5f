"""GPTQ written from the paper (Frantar et al. 2023, Algorithm 1), the oracle of the GPTQ tests:
float64, the upper Cholesky factor of the damped inverse Hessian (computed as cholesky(inv(H)),
not cholesky_inverse), the column loop with each column's error spread over the later columns,
lazy block updates. Group scales are chosen when the loop reaches the group's first column, from
the group's columns as every earlier column's update left them (computed here explicitly from the
deferred updates, for any block size); per tensor / channel, and every group with act_order, on W
before the loop. Integer scales and rounding are qcompress's default numerics written out."""

from __future__ import annotations

import math

import torch

EPS = 2.0**-100


def int_fit(X, bits, sym):
    """Per row of X [rows, n] (float32): (scale, zero point or None), qcompress's default numerics."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    lo, hi = X.amin(1), X.amax(1)
    if sym:
        return (torch.maximum(lo.abs(), hi.abs()) / qmax).clamp(min=EPS), None
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    s = ((hi - lo) / (qmax - qmin)).clamp(min=EPS)
    return s, (qmin - torch.round(lo / s)).clamp(qmin, qmax)


def int_quant(w, params, bits):
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    s, z = params
    if z is None:
        return torch.round(w / s).clamp(qmin, qmax) * s
    return (torch.round(w / s).add(z).clamp(qmin, qmax) - z) * s


def reference(W, H, fit, quant, width, upfront, damp=0.01, block=128, act_order=False):
    """(compensated weights, Q, per-group params) of GPTQ; fit(X [rows, n] float32) -> params,
    quant(w [rows] float32, params) -> x^ float32."""
    rows, cols = W.shape
    W64, H = W.double().clone(), H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    ngroups = math.ceil(cols / width)
    params = [None] * ngroups
    if upfront:
        params = [fit(W[:, g * width : (g + 1) * width]) for g in range(ngroups)]
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(cols)
    W64, H = W64[:, perm], H[perm][:, perm]
    H = H + damp * H.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros(rows, cols, dtype=torch.float32)
    Wc = torch.zeros(rows, cols, dtype=torch.float32)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = W64[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            c = int(perm[j])
            g = c // width
            if not upfront and c % width == 0:
                n = min(width, cols - c)
                now = torch.cat([W1[:, i:], W64[:, i2:] - E1[:, :i] @ U[i1:j, i2:]], dim=1)[:, :n]
                params[g] = fit(now.float())
            w = W1[:, i]
            q = quant(w.float(), params[g])
            Q[:, j], Wc[:, j] = q, w.float()
            e = (w - q.double()) / U[j, j]
            W1[:, i:] -= e[:, None] * U[j, j:i2][None, :]
            E1[:, i] = e
        W64[:, i2:] -= E1 @ U[i1:i2, i2:]
    inv = torch.argsort(perm)
    return Wc[:, inv], Q[:, inv], params


def correlated(n, cols, seed=0):
    """Inputs with correlated, unequal columns (a real layer's inputs are far from white)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) * 0.3 + torch.eye(cols)
    scale = torch.logspace(-1, 0.5, cols)[torch.randperm(cols, generator=g)]
    return (torch.randn(n, cols, generator=g) @ mix) * scale


def problem(rows=24, cols=72, seed=0, dead=()):
    g = torch.Generator().manual_seed(seed + 10)
    W = torch.randn(rows, cols, generator=g) * 0.1
    X = correlated(512, cols, seed)
    X[:, list(dead)] = 0.0
    return W, (X.T.double() @ X.double()) / X.shape[0]
