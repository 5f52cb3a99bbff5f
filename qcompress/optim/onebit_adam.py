"""1-bit Adam: Adam warmup, then frozen variance and 1-bit compressed momentum.

Warmup (steps 1 .. freeze_step, gradients averaged by the caller):
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p = p (1 - lr wd) - lr/bc1 * m / (sqrt(v/bc2) + eps)
Compression stage (later steps, g is this rank's local gradient):
    m = compressed_mean(b1 m + (1-b1) g) [* exp_avg_mask];  v and bc2 stay as they were at freeze_step;
    the same update.  Groups with non_freeze=True keep the warmup algorithm on averaged gradients.

shard_state=True (ZeRO stage 1, used by the qcompress engine): each rank owns the elements of the
compressed parameters that form its server chunk of each flat bucket (_shard.Shards) and keeps the
variance, the cached denominator and any fp32 master copy for those elements only; it updates only
them and one all-gather per step rebuilds the parameters. The momentum stays full size on every
rank: the compression stage compresses this rank's whole local momentum (and the compressed mean
is needed whole for the next step's error feedback). Results are bit-identical to shard_state=False.
non_freeze groups keep their state unsharded. A sharded state_dict loads only at the same world
size and rank (ValueError otherwise: the owned slices would not line up).

scale_per_tensor (default True) compresses each parameter tensor with its own 1-bit scales (see
zoadam.py; DeepSpeed's fp32 path does so too); False keeps DeepSpeed's fp16 layout, one scale per
flat bucket, which converges worse: one scale must fit tensors of very different magnitudes
(benchmarks/experiments/README.md, `zoadam_gap.py`).
"""

from __future__ import annotations

import torch

from . import _dist
from ._buckets import is_frozen, param_names
from ._shard import Shards
from .base import DEFAULT_BUCKET_SIZE, CompressedOptimizer, check_common, check_positive_int


class OneBitAdam(CompressedOptimizer):
    _COUNTERS = {"step": 0, "frozen": False, "var_steps": 0}

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
        amsgrad=False,
        cuda_aware=False,
        comm_backend_name="nccl",
        *,
        group=None,
        compressor="onebit",
        bucket_size=DEFAULT_BUCKET_SIZE,
        comm_hierarchy=None,
        ddp_hook_state=None,
        shard_state=False,
        scale_per_tensor=True,
    ):
        # deepspeed, eps_inside_sqrt, max_grad_norm, cuda_aware, comm_backend_name: accepted so DeepSpeed
        # configs load; DeepSpeed ignores the first three too, the last two pick transports we do not need.
        check_common(lr, betas, eps, weight_decay, amsgrad, compressor, bucket_size, comm_hierarchy)
        check_positive_int("freeze_step", freeze_step)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bool(bias_correction)
        )
        super().__init__(
            params,
            defaults,
            group=group,
            compressor=compressor,
            bucket_size=bucket_size,
            comm_hierarchy=comm_hierarchy,
            ddp_hook_state=ddp_hook_state,
            scale_per_tensor=scale_per_tensor,
        )
        self.freeze_step = freeze_step
        if not isinstance(shard_state, bool):
            raise ValueError(f"shard_state must be true or false, got {shard_state!r}")
        self.shard_state = shard_state
        self._shards = None

    def _get_shards(self):
        if not self.shard_state:
            return None
        if self._shards is None:
            self._shards = Shards(self._compressed_params(), self._get_buckets(), self.comm_group)
        return self._shards

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
        for gi, g in enumerate(self.param_groups):
            if frozen and not g["non_freeze"]:
                compressed.append((gi, g))
                continue
            if frozen:  # non_freeze group in the compression stage: gradients are local, average them here
                self._average_group_grads(g)
            self._adam_group(g, t, t)
        if compressed:
            self._compressed_step(compressed, t, c["var_steps"])
        if self.shard_state:
            self._get_shards().allgather_params()  # every rank updated only the elements it owns
        c["step"] = t
        if not frozen:
            c["var_steps"] = t
            if t >= self.freeze_step:
                c["frozen"] = True

    def _adam_group(self, g, steps_m, steps_v):
        b1, b2 = g["betas"]
        bc1, bc2_sqrt = self.bias_corrections(g, steps_m, steps_v)
        sh = None if g["non_freeze"] else self._get_shards()
        for p in g["params"]:
            grad = self._grad32(p)
            if grad is None:
                continue
            st = self._state(p)
            if sh is not None:
                st["exp_avg"].lerp_(grad, 1 - b1)  # full: the compression stage compresses all of it
                g_own = sh.owned(p, grad)
                st["exp_avg_sq"].mul_(b2).addcmul_(g_own, g_own, value=1 - b2)
                p32 = self._param32_owned(p, sh)
                self.adam_update_(
                    p32,
                    sh.owned(p, st["exp_avg"]),
                    st["exp_avg_sq"],
                    g["lr"],
                    g["weight_decay"],
                    g["eps"],
                    bc1,
                    bc2_sqrt,
                )
                sh.write(p, p32)
                continue
            p32 = self._param32(p)
            st["exp_avg"].lerp_(grad, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            self.adam_update_(p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"], bc1, bc2_sqrt)
            self._write_back(p, p32)

    def _compressed_step(self, groups, t, var_steps):
        buckets = self._get_buckets()
        stage = buckets.staging()  # None at one rank: the mean is exact, compute in place
        targets, k = [], 0
        for _, g in groups:
            b1 = g["betas"][0]
            for p in g["params"]:
                st = self._state(p)
                m = st["exp_avg"]
                grad = self._grad32(p)
                out = buckets.momentum_slot(stage, k, m, is_frozen(p) or grad is None)
                k += 1
                if out is None:  # frozen, or no gradient (base.py): the state stays as it was
                    targets.append(None)
                    continue
                out.lerp_(grad, 1 - b1)
                targets.append(m)
        if stage is not None:
            buckets.allreduce_staged_(targets, param_names(groups))
        sh = self._get_shards()
        if sh is not None:
            self._gather_dead(sh)
        for _, g in groups:
            bc1, bc2_sqrt = self.bias_corrections(g, t, var_steps)
            for p in g["params"]:
                if is_frozen(p) or p.grad is None:
                    continue
                st = self.state[p]
                mask = self._mask(p)
                if mask is not None:
                    st["exp_avg"].mul_(mask)
                if sh is not None:
                    dead = self._dead[p]
                    if dead is not False:
                        st["exp_avg"].masked_fill_(dead, 0.0)
                    p32 = self._param32_owned(p, sh)
                    denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_sqrt, g["eps"])
                    self.adam_update_(
                        p32,
                        sh.owned(p, st["exp_avg"]),
                        st["exp_avg_sq"],
                        g["lr"],
                        g["weight_decay"],
                        g["eps"],
                        bc1,
                        bc2_sqrt,
                        denom,
                    )
                    sh.write(p, p32)
                    continue
                self._zero_unseen_(p, st["exp_avg"], st["exp_avg_sq"])
                p32 = self._param32(p)
                denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_sqrt, g["eps"])
                self.adam_update_(
                    p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"], bc1, bc2_sqrt, denom
                )
                self._write_back(p, p32)

    def _state(self, p):
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            sh = self._get_shards()
            shape = (sh.owned_numel(p),) if sh is not None and sh.holds(p) else p.shape
            st["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return st

    def _param32_owned(self, p, sh) -> torch.Tensor:
        """This rank's owned elements of p in float32: a copy of p's, or the (owned-size) master copy."""
        if p.dtype == torch.float32:
            return sh.owned(p, p.detach())
        st = self.state[p]
        if "master" not in st:
            st["master"] = sh.owned(p, p.detach()).float()
        return st["master"]

    def _gather_dead(self, sh) -> None:
        """The unsharded optimizer zeroes the momentum where the frozen variance is exactly 0, over the
        whole momentum; with a sharded variance the pattern is assembled once (one uint8 all-gather,
        on every rank together: _dead is filled and cleared on all ranks alike)."""
        if all(p in self._dead for p in sh.params):
            return
        for p in sh.params:
            self._state(p)
        masks = sh.gather_masks(lambda p: self.state[p]["exp_avg_sq"] == 0)
        for p, m in zip(sh.params, masks):
            self._dead[p] = m.view_as(p) if bool(m.any()) else False

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self):
        sd = super().state_dict()
        sd["qcompress"]["shard_state"] = self.shard_state
        return sd

    def load_state_dict(self, state_dict):
        self.check_state_dict(state_dict)
        super().load_state_dict(state_dict)

    def check_state_dict(self, state_dict) -> None:
        super().check_state_dict(state_dict)
        extra = state_dict.get("qcompress") or {}
        saved = bool(extra.get("shard_state", False))
        if "qcompress" in state_dict and (saved or self.shard_state):
            here = (self.world_size, _dist.rank(self.comm_group))
            there = (extra.get("world_size"), extra.get("rank"))
            if saved != self.shard_state:
                raise ValueError(
                    f"{type(self).__name__}: the state dict was saved with shard_state={saved} "
                    f"(ZeRO stage {1 if saved else 0}) but this optimizer has "
                    f"shard_state={self.shard_state}; the variance sizes do not match"
                )
            if there != here:
                raise ValueError(
                    f"{type(self).__name__}: sharded optimizer state saved at world size/rank "
                    f"{there[0]}/{there[1]} cannot load at {here[0]}/{here[1]}: each rank holds the "
                    "variance only for its chunk of the compressed all-reduce, whose bounds depend "
                    "on the world size; resume on the same world size"
                )
            if extra.get("layout") not in (None, self._get_buckets().layout()):
                raise ValueError(
                    f"{type(self).__name__}: sharded optimizer state saved with another bucket "
                    "layout (bucket_size, scale_per_tensor or parameters changed); the owned "
                    "slices do not line up"
                )

    def _after_load(self):
        self._shards = None
