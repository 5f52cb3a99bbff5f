"""LAMB (uncompressed), DeepSpeed's variant: Adam moments, decoupled weight decay, and a per-tensor
trust ratio ||p|| / ||u|| clipped to [min_coeff, max_coeff] (1 when either norm is zero).

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    u = (m / bc1) / (sqrt(v)/sqrt(bc2) + eps) + wd p;  c = clip(||p|| / ||u||);  p = p - lr c u
bc1 = 1 - b1^t, bc2 = 1 - b2^t when bias_correction (default), else 1.
eps_inside_sqrt=True (DeepSpeed FusedLamb's option) adds eps to the bias-corrected second moment
before the square root instead: u = (m / bc1) / sqrt(v / bc2 + eps) + wd p.
Operations run in exactly that order, each rounded on its own (m and v as torch.optim.Adam moves
them: m.lerp_(g, 1-b1), v.mul_(b2).addcmul_(g, g, value=1-b2)), so a LAMB written from these
formulas gives the same bits. Fused forms are avoided on purpose: torch's add(alpha=) is a fused
multiply-add on CPU and sqrt(bc2) via ** 0.5 (C pow) is not always correctly rounded.
"""

from __future__ import annotations

import math

import torch

from .base import check_common


def bias_corrections(group, steps_m: int, steps_v: int):
    """(bc1, sqrt(bc2)) for LAMB, sqrt correctly rounded (1, 1 when bias_correction is off)."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    b1, b2 = group["betas"]
    return 1 - b1**steps_m, math.sqrt(1 - b2**steps_v)


def lamb_direction(p32, exp_avg, exp_avg_sq, wd, eps, bc1, bc2_sqrt, denom=None):
    """(update u, update before weight decay, denominator)."""
    if denom is None:
        denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    pre = (exp_avg / bc1).div_(denom)
    update = (p32 * wd).add_(pre) if wd != 0 else pre  # wd p rounded, then added: no fused multiply-add
    return update, pre, denom


def apply_update_(p32, update, lr, coeff) -> None:
    """p = p - (lr c) u, the product rounded before the subtraction (add_(alpha=) would fuse them).
    Consumes `update`."""
    p32.sub_(update.mul_(lr * coeff))


def trust_ratio(p32, update, max_coeff, min_coeff) -> float:
    w = float(p32.norm())
    u = float(update.norm())
    if w == 0.0 or u == 0.0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)


def lamb_step_(
    p32,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    betas,
    eps,
    wd,
    bc1,
    bc2_sqrt,
    max_coeff,
    min_coeff,
    eps_inside_sqrt=False,
    bc2=1.0,
):
    """One LAMB step on float32 tensors in place; returns the trust ratio used. `bc2` (1 - b2^t,
    or 1) is read only with eps_inside_sqrt."""
    b1, b2 = betas
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (exp_avg_sq / bc2).add_(eps).sqrt_() if eps_inside_sqrt else None
    update, _, _ = lamb_direction(p32, exp_avg, exp_avg_sq, wd, eps, bc1, bc2_sqrt, denom)
    coeff = trust_ratio(p32, update, max_coeff, min_coeff)
    apply_update_(p32, update, lr, coeff)
    return coeff


class Lamb(torch.optim.Optimizer):
    """Plain LAMB with DeepSpeed's parameter names (FusedLamb); fp32 state, fp32 master copy for bf16/fp16."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        amsgrad=False,
    ):
        check_common(lr, betas, eps, weight_decay, amsgrad, "onebit", 1, None)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=bool(eps_inside_sqrt),
        )
        super().__init__(params, defaults)
        self._coeffs = []

    def get_lamb_coeffs(self):
        """Trust ratios of the last step, one per updated parameter."""
        return list(self._coeffs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._coeffs = []
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "step" not in st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    if p.dtype != torch.float32:
                        st["master"] = p.detach().float().clone()
                st["step"] += 1
                t = st["step"]
                bc1, bc2_sqrt = bias_corrections(g, t, t)
                p32 = st.get("master", p)
                grad = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
                inside = g.get("eps_inside_sqrt", False)  # absent from groups saved before it existed
                coeff = lamb_step_(
                    p32,
                    grad,
                    st["exp_avg"],
                    st["exp_avg_sq"],
                    lr=g["lr"],
                    betas=(b1, b2),
                    eps=g["eps"],
                    wd=g["weight_decay"],
                    bc1=bc1,
                    bc2_sqrt=bc2_sqrt,
                    max_coeff=g["max_coeff"],
                    min_coeff=g["min_coeff"],
                    eps_inside_sqrt=inside,
                    bc2=(1 - b2**t) if g["bias_correction"] else 1.0,
                )
                if p32 is not p:
                    p.copy_(p32)
                self._coeffs.append(coeff)
        return loss

    def load_state_dict(self, state_dict):
        # torch casts saved floating state to the parameter dtype; keep our float32 moments instead.
        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for sg, g in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(sg["params"], g["params"]):
                if pid in saved:
                    self.state[p] = {
                        k: (v.detach().clone().to(p.device) if torch.is_tensor(v) else v) for k, v in saved[pid].items()
                    }
