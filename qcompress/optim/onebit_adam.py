"""1-bit Adam: Adam warmup, then frozen variance and 1-bit compressed momentum.

Warmup (steps 1 .. freeze_step, gradients averaged by the caller):
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p = p (1 - lr wd) - lr/bc1 * m / (sqrt(v/bc2) + eps)
Compression stage (later steps, g is this rank's local gradient):
    m = compressed_mean(b1 m + (1-b1) g) [* exp_avg_mask];  v and bc2 stay as they were at freeze_step;
    the same update.  Groups with non_freeze=True keep the warmup algorithm on averaged gradients.
"""
from __future__ import annotations

import torch

from .base import DEFAULT_BUCKET_SIZE, CompressedOptimizer, check_common, check_positive_int


class OneBitAdam(CompressedOptimizer):
    _COUNTERS = {"step": 0, "frozen": False, "var_steps": 0}

    def __init__(self, params, deepspeed=None, lr=1e-3, freeze_step=100000, bias_correction=True,
                 betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0,
                 amsgrad=False, cuda_aware=False, comm_backend_name="nccl", *, group=None,
                 compressor="onebit", bucket_size=DEFAULT_BUCKET_SIZE, comm_hierarchy=None,
                 ddp_hook_state=None):
        # deepspeed, eps_inside_sqrt, max_grad_norm, cuda_aware, comm_backend_name: accepted so DeepSpeed
        # configs load; DeepSpeed ignores the first three too, the last two pick transports we do not need.
        check_common(lr, betas, eps, weight_decay, amsgrad, compressor, bucket_size, comm_hierarchy)
        check_positive_int("freeze_step", freeze_step)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults, group=group, compressor=compressor, bucket_size=bucket_size,
                         comm_hierarchy=comm_hierarchy, ddp_hook_state=ddp_hook_state)
        self.freeze_step = freeze_step

    @property
    def allreduce_gradients(self) -> bool:
        return not self.counters["frozen"]

    @property
    def stage(self) -> str:
        return "compression" if self.counters["frozen"] else "warmup"

    def _step(self):
        c = self.counters
        t = c["step"] + 1
        frozen = c["frozen"]
        compressed = []
        for g in self.param_groups:
            if frozen and not g["non_freeze"]:
                compressed.append(g)
                continue
            if frozen:  # non_freeze group in the compression stage: gradients are local, average them here
                self._average_group_grads(g)
            self._adam_group(g, t, t)
        if compressed:
            self._compressed_step(compressed, t, c["var_steps"])
        c["step"] = t
        if not frozen:
            c["var_steps"] = t
            if t >= self.freeze_step:
                c["frozen"] = True

    def _adam_group(self, g, steps_m, steps_v):
        b1, b2 = g["betas"]
        bc1, bc2_sqrt = self.bias_corrections(g, steps_m, steps_v)
        for p in g["params"]:
            grad = self._grad32(p)
            if grad is None:
                continue
            st = self._state(p)
            p32 = self._param32(p)
            st["exp_avg"].lerp_(grad, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            self.adam_update_(p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"],
                              bc1, bc2_sqrt)
            self._write_back(p, p32)

    def _compressed_step(self, groups, t, var_steps):
        momenta = []
        for g in groups:
            b1 = g["betas"][0]
            for p in g["params"]:
                st = self._state(p)
                grad = self._grad32(p)
                if grad is None:
                    st["exp_avg"].mul_(b1)  # every rank must send the same layout: a missing grad counts as 0
                else:
                    st["exp_avg"].lerp_(grad, 1 - b1)
                momenta.append(st["exp_avg"])
        self._get_buckets().allreduce_(momenta)
        for g in groups:
            bc1, bc2_sqrt = self.bias_corrections(g, t, var_steps)
            for p in g["params"]:
                st = self.state[p]
                mask = self._mask(p)
                if mask is not None:
                    st["exp_avg"].mul_(mask)
                self._zero_unseen_(p, st["exp_avg"], st["exp_avg_sq"])
                p32 = self._param32(p)
                denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_sqrt, g["eps"])
                self.adam_update_(p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"],
                                  bc1, bc2_sqrt, denom)
                self._write_back(p, p32)

    def _state(self, p):
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return st
