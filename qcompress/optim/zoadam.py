"""0/1 Adam: adaptive variance freezing plus 1-bit synchronization with local steps.

Stage 1 (steps 1 .. var_freeze_step). Step t is a *variance step* when t % var_interval == 0: the
caller hands averaged gradients (allreduce_gradients is True before it) and Adam runs as usual.
Otherwise the local gradient is averaged with the 1-bit compressed all-reduce and only m moves.
After var_update_scaler variance steps var_interval doubles.

Stage 2 (later steps, v frozen, gradients local). Every step is a local AdamW step that also
accumulates a = sum lr_t m_t / bc1_t. Every local_step_interval steps the ranks synchronize:
a <- compressed_mean(a) [* mask];  p <- p_sync * prod(1 - lr_t wd) - a / (sqrt(v/bc2) + eps);
m <- a * bc1 / sum(lr_t). local_step_interval doubles (up to local_step_clipper) every
local_step_scaler steps.

Differences from DeepSpeed's version (by design):
- each parameter tensor is compressed with its own 1-bit scales and errors by default
  (scale_per_tensor=True, as DeepSpeed's fp32 path does with one compressed all-reduce per tensor;
  here all tensors share two collectives). DeepSpeed's fp16 path, and scale_per_tensor=False,
  share one scale over the flattened model, which moves each tensor by the whole model's RMS
  over its own frozen variance: the 0/1 Adam gap in benchmarks/RESULTS.md;
- bias correction (bc1 over all steps, bc2 over variance steps);
- the synchronized parameters are recomputed from the stored last-sync point, so ranks stay
  bit-identical instead of drifting by rounding; the momentum rebuilt at a sync holds no
  weight-decay term; resuming restores every schedule counter.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from ._buckets import is_frozen, param_names
from .base import DEFAULT_BUCKET_SIZE, CompressedOptimizer, check_common, check_positive_int


class ZeroOneAdam(CompressedOptimizer):
    # why shard_state (ZeRO stage 1) is refused; build_optimizer gives the same reason
    NO_SHARD = (
        "its local steps move every rank's parameters by that rank's own momentum between "
        "synchronisations, so parameters differ across ranks and cannot be rebuilt from owned slices"
    )
    _COUNTERS = {
        "step": 0,
        "frozen": False,
        "var_steps": 0,
        "var_interval": 1,
        "var_counter": 0,
        "local_step_interval": 1,
        "local_step_counter": 0,
        "lrs": [],
        "decay": [],
    }

    def __init__(
        self,
        params,
        deepspeed=None,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        var_freeze_step=100000,
        var_update_scaler=16,
        local_step_scaler=32678,
        local_step_clipper=16,
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
        if shard_state:
            raise ValueError(f"shard_state=True (ZeRO stage 1) is not supported by ZeroOneAdam: {self.NO_SHARD}")
        check_common(lr, betas, eps, weight_decay, amsgrad, compressor, bucket_size, comm_hierarchy)
        check_positive_int("var_freeze_step", var_freeze_step)
        check_positive_int("var_update_scaler", var_update_scaler)
        check_positive_int("local_step_scaler", local_step_scaler)
        check_positive_int("local_step_clipper", local_step_clipper)
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
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    @property
    def allreduce_gradients(self) -> bool:
        c = self.counters
        return not c["frozen"] and (c["step"] + 1) % c["var_interval"] == 0

    @property
    def ranks_in_sync(self) -> bool:
        """False while local steps since the last synchronization left each rank its own weights
        (stage 2 between sync steps); every rank computes the same answer."""
        c = self.counters
        return not c["frozen"] or all(lr == 0.0 for lr in c["lrs"])

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collective: run the synchronization of stage 2 now (the average of the accumulated local
        updates applied from the last sync point) when ranks hold different weights, so every rank
        has the same weights for an evaluation, a checkpoint or an export. The next scheduled sync
        step comes as planned (local_step_interval is unchanged)."""
        if self.ranks_in_sync:
            return
        comp = [(gi, g) for gi, g in enumerate(self.param_groups) if not g["non_freeze"]]
        self._sync(self.counters["step"], comp)

    @property
    def stage(self) -> str:
        if self.counters["frozen"]:
            return "local_steps"
        return "variance" if self.allreduce_gradients else "compressed_gradient"

    # ------------------------------------------------------------------ step
    def _step(self):
        c = self.counters
        t = c["step"] + 1
        if not c["frozen"]:
            variance_step = t % c["var_interval"] == 0
            if variance_step:
                for g in self.param_groups:  # non_freeze groups update v on every step
                    self._adam_group(g, t, t if g["non_freeze"] else c["var_steps"] + 1, update_v=True)
                c["var_steps"] += 1
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
            else:
                self._compressed_gradient_step(t)
            c["step"] = t
            if t >= self.var_freeze_step:
                self._enter_stage2()
            return
        self._local_step(t)
        c["step"] = t
        c["local_step_counter"] += 1
        if c["local_step_counter"] == self.local_step_scaler:
            c["local_step_counter"] = 0
            c["local_step_interval"] = min(self.local_step_clipper, 2 * c["local_step_interval"])

    def _adam_group(self, g, steps_m, steps_v, update_v):
        b1, b2 = g["betas"]
        bc1, bc2_sqrt = self.bias_corrections(g, steps_m, steps_v)
        for p in g["params"]:
            grad = self._grad32(p)
            if grad is None:
                continue
            st = self._state(p)
            st["exp_avg"].lerp_(grad, 1 - b1)
            if update_v:
                st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            p32 = self._param32(p)
            self.adam_update_(p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"], bc1, bc2_sqrt)
            self._write_back(p, p32)

    def _local_grads(self, groups):
        grads = []
        for g in groups:
            for p in g["params"]:
                grad = self._grad32(p)
                # every rank must send the same layout: a missing gradient counts as zero
                grads.append(
                    torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    if grad is None or is_frozen(p)
                    else grad.clone()
                )
        return grads

    def _compressed_gradient_step(self, t):
        c = self.counters
        comp = [g for g in self.param_groups if not g["non_freeze"]]
        grads = self._local_grads(comp)
        named = [(i, g) for i, g in enumerate(self.param_groups) if not g["non_freeze"]]
        self._allreduce(grads, named)
        it = iter(grads)
        for g in comp:
            b1 = g["betas"][0]
            bc1, bc2_sqrt = self.bias_corrections(g, t, c["var_steps"])
            for p in g["params"]:
                grad = next(it)
                if is_frozen(p) or p.grad is None:  # no gradient (base.py): it sent zeros
                    continue
                mask = self._mask(p)
                if mask is not None:
                    grad.mul_(mask)
                self._zero_unseen_(p, grad, self._state(p)["exp_avg_sq"], frozen=False)
                st = self._state(p)
                st["exp_avg"].lerp_(grad, 1 - b1)
                p32 = self._param32(p)
                self.adam_update_(
                    p32, st["exp_avg"], st["exp_avg_sq"], g["lr"], g["weight_decay"], g["eps"], bc1, bc2_sqrt
                )
                self._write_back(p, p32)
        for g in self.param_groups:
            if g["non_freeze"]:  # keeps full Adam; its gradients are local on this step
                self._average_group_grads(g)
                self._adam_group(g, t, t, update_v=True)

    def _allreduce(self, tensors, comp, local_steps=False):
        """Compressed mean in place, naming this rank's non-finite tensor when there is one."""
        buckets = self._get_buckets()
        stage = buckets.staging()
        if stage is None:
            return
        for v, x in zip(stage, tensors):
            if v is not None:  # None: a frozen parameter outside the layout
                v.copy_(x.reshape(-1))
        try:
            buckets.allreduce_staged_(tensors, param_names(comp))
        except NonFiniteError as e:
            if not local_steps:
                raise
            # the accumulated updates are already in the weights of the rank that made them: the
            # "skip the step" of stage 1 would not undo anything here
            raise NonFiniteError(
                f"{str(e).split('. Every rank')[0]}. 0/1 Adam's local steps (stage 2) "
                "already applied it to that rank's weights and momentum, so skipping this "
                "step cannot recover; resume from the last checkpoint"
            ) from None

    def _enter_stage2(self):
        c = self.counters
        c["frozen"] = True
        # The compressed quantity changes from gradients to accumulated updates: stale errors would mislead.
        if self._buckets is not None:
            self._buckets.reset_errors()
        c["lrs"] = [0.0] * len(self.param_groups)
        c["decay"] = [1.0] * len(self.param_groups)
        for g in self.param_groups:
            if g["non_freeze"]:
                continue
            for p in g["params"]:
                st = self._state(p)
                st["sync_param"] = self._param32(p).detach().clone()
                st["update_acc"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _local_step(self, t):
        c = self.counters
        comp = []
        for gi, g in enumerate(self.param_groups):
            if g["non_freeze"]:
                self._average_group_grads(g)
                self._adam_group(g, t, t, update_v=True)
                continue
            comp.append((gi, g))
            b1 = g["betas"][0]
            lr, wd = g["lr"], g["weight_decay"]
            bc1, bc2_sqrt = self.bias_corrections(g, t, c["var_steps"])
            for p in g["params"]:
                st = self._state(p)
                grad = self._grad32(p)
                if is_frozen(p) or grad is None:  # no gradient: left alone (base.py)
                    continue
                st["exp_avg"].lerp_(grad, 1 - b1)
                p32 = self._param32(p)
                denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_sqrt, g["eps"])
                self.adam_update_(p32, st["exp_avg"], st["exp_avg_sq"], lr, wd, g["eps"], bc1, bc2_sqrt, denom)
                st["update_acc"].add_(st["exp_avg"], alpha=lr / bc1)
                self._write_back(p, p32)
                # this tensor's own lr sum and decay since the sync point: the group's would count
                # steps it sat out frozen (same values as the group's for a tensor never frozen)
                st["interval_lr"] = st.get("interval_lr", 0.0) + lr
                st["interval_decay"] = st.get("interval_decay", 1.0) * (1 - lr * wd)
            c["lrs"][gi] += lr
            c["decay"][gi] *= 1 - lr * wd
        if t % c["local_step_interval"] != 0 or not comp:
            return
        self._sync(t, comp)

    def _sync(self, t, comp):
        """Average the accumulated updates (1-bit) and apply them from the last sync point."""
        c = self.counters
        accs = [self.state[p]["update_acc"] for _, g in comp for p in g["params"]]  # 0 if frozen all interval
        self._allreduce(accs, comp, local_steps=True)
        for gi, g in comp:
            bc1, bc2_sqrt = self.bias_corrections(g, t, c["var_steps"])
            for p in g["params"]:
                st = self.state[p]
                acc = st["update_acc"]
                pending = "interval_lr" in st  # local steps since the sync point (frozen since: still due)
                lrs, decay = st.pop("interval_lr", 0.0), st.pop("interval_decay", 1.0)
                if is_frozen(p) and not pending:  # left alone; unfrozen later, its local steps start from here
                    acc.zero_()
                    st["sync_param"].copy_(self._param32(p))
                    continue
                mask = self._mask(p)
                if mask is not None:
                    acc.mul_(mask)
                self._zero_unseen_(p, acc, st["exp_avg_sq"])
                denom = self.frozen_denom(p, st["exp_avg_sq"], bc2_sqrt, g["eps"])
                p32 = self._param32(p)
                p32.copy_(st["sync_param"])
                if decay != 1.0:
                    p32.mul_(decay)
                p32.addcdiv_(acc, denom, value=-1.0)
                if lrs > 0:
                    st["exp_avg"].copy_(acc).mul_(bc1 / lrs)
                st["sync_param"].copy_(p32)
                acc.zero_()
                self._write_back(p, p32)
            c["lrs"][gi] = 0.0
            c["decay"][gi] = 1.0

    def _pending_update(self, p) -> bool:
        # frozen after local steps since the sync point: its accumulated update is still averaged and
        # applied at the sync, or each rank would keep its own
        return "interval_lr" in self.state.get(p, {})

    def _after_load(self):
        # a checkpoint written before the per-tensor interval sums: the group's, as it applied then
        c = self.counters
        if not c.get("frozen"):
            return
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                st = self.state.get(p)
                if (
                    not g["non_freeze"]
                    and st
                    and "update_acc" in st
                    and "interval_lr" not in st
                    and not is_frozen(p)
                    and c["lrs"][gi] > 0
                ):
                    st["interval_lr"], st["interval_decay"] = c["lrs"][gi], c["decay"][gi]

    def _state(self, p):
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return st
