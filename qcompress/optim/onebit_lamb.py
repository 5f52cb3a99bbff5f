"""1-bit LAMB: LAMB warmup, then frozen variance and trust ratio, 1-bit compressed momentum.

Warmup (steps 1 .. freeze_step, averaged gradients): LAMB (see lamb.py); the trust ratio c feeds an
EMA lamb_coeff_freeze <- coeff_beta * lamb_coeff_freeze + (1-coeff_beta) c (when c != 1); at
freeze_step the fresh variance v_fresh starts as a copy of v.
Compression stage (local gradients):
  1. once: scaling_coeff_p = mean_q(rms(m_q)) / rms(m_p), so one bucket scale fits every tensor;
  2. m = compressed_mean((b1 m + (1-b1) g) * scaling_coeff) / scaling_coeff  [* mask];
  3. g_hat = (m - b1 m_prev) / (1-b1);  v_fresh = b2 v_fresh + (1-b2) g_hat^2;
  4. u_pre = (m/bc1) / (sqrt(v/bc2_frozen) + eps);  u = u_pre + wd p;
     factor = max(denominator ratio frozen / fresh), blended with ||u_pre||/||u|| when wd > 0,
     clipped to [factor_min, factor_max] and to within factor_threshold of the last factor;
     p = p - lr * lamb_coeff_freeze * factor * u.
There is no scale_per_tensor option (OneBitAdam, ZeroOneAdam): step 1 already brings every
tensor's momentum (as it was at the freeze) to one RMS before the one-scale compression.
"""

from __future__ import annotations

import logging

import torch

from ._buckets import is_frozen, param_names
from .base import DEFAULT_BUCKET_SIZE, CompressedOptimizer, check_common, check_positive_int, rms
from .lamb import apply_update_, bias_corrections, lamb_direction, lamb_step_

log = logging.getLogger("qcompress")


class OneBitLamb(CompressedOptimizer):
    # why shard_state (ZeRO stage 1) is refused; build_optimizer gives the same reason
    NO_SHARD = (
        "its per-parameter trust ratio needs norms of whole parameters and updates; summing them "
        "from slices changes the summation order, so it would not match stage 0"
    )
    _COUNTERS = {"step": 0, "frozen": False, "var_steps": 0, "scaled": False}

    def __init__(
        self,
        params,
        deepspeed=None,
        lr=1e-3,
        freeze_step=100000,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        amsgrad=False,
        cuda_aware=False,
        comm_backend_name="nccl",
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
        *,
        group=None,
        compressor="onebit",
        bucket_size=DEFAULT_BUCKET_SIZE,
        comm_hierarchy=None,
        ddp_hook_state=None,
        shard_state=False,
    ):
        if shard_state:
            raise ValueError(f"shard_state=True (ZeRO stage 1) is not supported by OneBitLamb: {self.NO_SHARD}")
        check_common(lr, betas, eps, weight_decay, amsgrad, compressor, bucket_size, comm_hierarchy)
        check_positive_int("freeze_step", freeze_step)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(f"need 0 < factor_min <= factor_max, got {factor_min}, {factor_max}")
        if not factor_threshold >= 0.0:
            raise ValueError(f"factor_threshold must be >= 0, got {factor_threshold}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(
            params,
            defaults,
            group=group,
            compressor=compressor,
            bucket_size=bucket_size,
            comm_hierarchy=comm_hierarchy,
            ddp_hook_state=ddp_hook_state,
        )
        self.freeze_step = freeze_step
        self._warned_no_coeff = set()  # ids of tensors warned about a zero frozen trust ratio
        self._coeffs = []

    @property
    def allreduce_gradients(self) -> bool:
        return not self.counters["frozen"]

    @property
    def stage(self) -> str:
        return "compression" if self.counters["frozen"] else "warmup"

    def get_lamb_coeffs(self):
        """Trust ratios applied in the last step, one per updated parameter."""
        return list(self._coeffs)

    def _step(self):
        c = self.counters
        t = c["step"] + 1
        frozen = c["frozen"]
        self._coeffs = []
        compressed = []
        for g in self.param_groups:
            if frozen and not g["non_freeze"]:
                compressed.append(g)
                continue
            if frozen:
                self._average_group_grads(g)
            self._warmup_group(g, t, snapshot=not frozen and t == self.freeze_step)
        if compressed:
            self._compressed_step(compressed, t)
        c["step"] = t
        if not frozen:
            c["var_steps"] = t
            if t >= self.freeze_step:
                c["frozen"] = True

    def _warmup_group(self, g, t, snapshot):
        bc1, bc2_sqrt = bias_corrections(g, t, t)
        for p in g["params"]:
            grad = self._grad32(p)
            if grad is None:
                continue
            st = self._state(p)
            p32 = self._param32(p)
            coeff = lamb_step_(
                p32,
                grad,
                st["exp_avg"],
                st["exp_avg_sq"],
                lr=g["lr"],
                betas=g["betas"],
                eps=g["eps"],
                wd=g["weight_decay"],
                bc1=bc1,
                bc2_sqrt=bc2_sqrt,
                max_coeff=g["max_coeff"],
                min_coeff=g["min_coeff"],
            )
            if coeff != 1.0:
                st["lamb_coeff_freeze"] = g["coeff_beta"] * st["lamb_coeff_freeze"] + (1 - g["coeff_beta"]) * coeff
            if snapshot:
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            self._write_back(p, p32)
            self._coeffs.append(coeff)

    def _compressed_step(self, groups, t):
        c = self.counters
        params = [p for g in groups for p in g["params"]]
        for p in params:
            st = self._state(p)
            if "exp_avg_sq_fresh" not in st:  # joined after the freeze: fresh variance starts from v
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
        scale = self.world_size > 1  # one rank sends nothing, so it needs no common scale either
        if scale and not c["scaled"]:
            rmss = [rms(self.state[p]["exp_avg"]) for p in params]
            mean = sum(rmss) / len(rmss)
            for p, r in zip(params, rmss):
                self.state[p]["scaling_coeff"] = mean / r if r > 0 else 1.0
            c["scaled"] = True
        buckets = self._get_buckets()
        stage = buckets.staging()  # None at one rank: the mean is exact, compute in place
        prev, targets, k = [], [], 0
        for g in groups:
            b1 = g["betas"][0]
            for p in g["params"]:
                st = self.state[p]
                m = st["exp_avg"]
                grad = self._grad32(p)
                skip = is_frozen(p) or grad is None  # frozen, or no gradient (base.py)
                prev.append(None if skip else m.clone())
                out = buckets.momentum_slot(stage, k, m, skip)
                k += 1
                if out is None:  # the state stays as it was
                    targets.append(None)
                    continue
                out.lerp_(grad, 1 - b1)
                if scale:
                    out.mul_(st["scaling_coeff"])
                targets.append(m)
        if stage is not None:
            buckets.allreduce_staged_(
                targets, param_names([(i, g) for i, g in enumerate(self.param_groups) if any(g is x for x in groups)])
            )
        it = iter(prev)
        for g in groups:
            b1, b2 = g["betas"]
            lr, wd, eps = g["lr"], g["weight_decay"], g["eps"]
            bc1, bc2_frozen = bias_corrections(g, t, c["var_steps"])
            _, bc2_fresh = bias_corrections(g, t, t)
            for p in g["params"]:
                m_prev = next(it)
                if m_prev is None:  # frozen or no gradient
                    continue
                st = self.state[p]
                m = st["exp_avg"]
                if scale:
                    m.div_(st["scaling_coeff"])
                mask = self._mask(p)
                if mask is not None:
                    m.mul_(mask)
                self._zero_unseen_(p, m, st["exp_avg_sq"])
                g_hat = m.sub(m_prev, alpha=b1).div_(1 - b1)
                fresh = st["exp_avg_sq_fresh"]
                fresh.mul_(b2).addcmul_(g_hat, g_hat, value=1 - b2)
                p32 = self._param32(p)
                denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_frozen, eps)
                update, pre, denom = lamb_direction(p32, m, st["exp_avg_sq"], wd, eps, bc1, bc2_frozen, denom)
                denom_fresh = (fresh.sqrt() / bc2_fresh).add_(eps)
                factor = float((denom / denom_fresh).max())
                if wd != 0:
                    un = float(update.norm())
                    ratio = min(1.0, float(pre.norm()) / un) if un > 0 else 1.0
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, g["factor_min"]), g["factor_max"])
                last = st["last_factor"]
                thr = g["factor_threshold"]
                factor = min(max(factor, last * (1 - thr)), last * (1 + thr))
                st["last_factor"] = factor
                coeff = st["lamb_coeff_freeze"] * factor
                if st["lamb_coeff_freeze"] == 0.0 and id(p) not in self._warned_no_coeff:
                    self._warned_no_coeff.add(id(p))  # DeepSpeed's algorithm: said once per tensor
                    log.warning(
                        "OneBitLamb: a parameter of shape %s trains in the compression stage but had no "
                        "update during the warmup (frozen, or no gradient, until freeze_step %d), so "
                        "its frozen trust ratio is 0 and it does not move; unfreeze it before "
                        "freeze_step",
                        tuple(p.shape),
                        self.freeze_step,
                    )
                apply_update_(p32, update, lr, coeff)
                self._write_back(p, p32)
                self._coeffs.append(coeff)

    def _state(self, p):
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["lamb_coeff_freeze"] = 0.0
            st["last_factor"] = 1.0
        return st
