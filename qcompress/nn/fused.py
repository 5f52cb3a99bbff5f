"""Fused compress-aware Linear / Conv / transformers Conv1D: backward keeps the input's codes.

Unfused, `F.linear(fake_quantize(x), fake_quantize(w), b)` makes autograd keep x^ (a float copy
of the input) and w^ (a float copy of the weight) until backward. x^ is exactly (q - zp) * s for
its integer codes q (int8 up to 8 bits) and its per-token / per-sample / per-tensor scale and
zero point, so the one autograd Function here keeps those and dequantizes in backward; w^ is
recomputed in backward from the weight Parameter (and its learned scales), which the module holds
anyway, and in optimizer-step mode w^ *is* the Parameter. Backward runs the ops torch's own
derivatives of addmm / mm / convolution run (same layouts, same autocast casts) on the same
values, and the weight quantizer's own backward (straight-through, clip mask, LSQ) on the
recomputed w^, so every gradient is bit for bit the unfused path's.

LoRA (mode qat): backward makes the merged weight W + (B A) * scaling and its w^ again without a
graph and hands the merged weight's gradient to lora.merge_grads (autograd's tensors through the
merge, bit for bit), so at most two weight-size tensors, w^ and its gradient, are alive at once.

Shared inputs: sibling modules fed one tensor with the same dynamic activation settings (Q/K/V,
gate/up) quantize it once. The last codes are kept per thread, keyed by the tensor itself (a weak
reference), its version counter and the Spec: a different tensor (a pre-hook's result, a
checkpoint recompute's) or an in-place change quantizes anew, so sharing never changes a value.
Static ranges are not shared: every module's observer must see its input.

Weight-only modules (no activation quantization, or not active yet) with w^ made in forward take
the same Function with the input itself as the saved "codes": autograd then keeps x, as FP32
training does, and no float copy of the weight.

Host cost (what bounds a step on a GPU or with small layers; benchmarks/host_overhead.py): the float
forward takes x^ from the quantizer's own pass (`quantize_values`: codes and values at once) rather
than dequantizing the codes it just made, and each weight's quantizer arguments are made once per
forward for both weight passes.

`plan(mod, x, op)` returns None where the fused path does not apply; the module then runs the
composed autograd path as before (reasons at each `return None`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import NonFiniteError
from ..quant import kernels
from ..quant.api import dequantize, quantize_spec
from . import int8_forward, lora, ranges
from ..quant.reference import saturate

_enabled = True


def set_enabled(flag: bool) -> bool:
    """Turn the fused path on or off process-wide (off: every module runs the composed autograd
    path, the reference the fused one must match); returns the previous setting."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


@contextlib.contextmanager
def enabled(flag: bool):
    """`with fused.enabled(False): ...` runs the block on the unfused path."""
    old = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(old)


# --- shared-input codes --------------------------------------------------------------------------


class _LastCodes(threading.local):
    entry = None  # (weakref to x, x._version, spec, (q, s, z))


_last = _LastCodes()


def clear_shared() -> None:
    """Forget the kept codes (they are small, and also saved for backward while training)."""
    _last.entry = None


def _input_codes(mod, x, spec, values=False):
    """(q, scale, zero point, x^ or None) of x under the module's activation quantizer, the codes
    shared with the previous module when that one quantized this very tensor (same version) the
    same way. With `values`, x^ comes from the same kernel pass where one quantizes x anew (None
    otherwise: the caller dequantizes); only the codes are kept for a sibling, a float x^ is not."""
    aq = mod.qc_aq
    if aq.calibration == "static":
        lo, hi = mod.static_input_range(x, spec)  # this module's observer sees x, as unfused
        return _quantize(x, spec, lo, hi, values)
    share = aq.share_input and not x.is_inference()  # inference tensors keep no version counter
    if share:
        e = _last.entry
        if e is not None and e[0]() is x and e[1] == x._version and e[2] == spec:
            return (*e[3], None)
    out = _quantize(x, spec, None, None, values)
    if share:
        _last.entry = (weakref.ref(x), x._version, spec, out[:3])
    return out


def _quantize(x, spec, lo, hi, values):
    if values:
        out = kernels.quantize_values(x, spec, lo, hi)
        if out is not None:
            return out
    return (*quantize_spec(x, spec, min_val=lo, max_val=hi), None)


def _dequantize(q, s, z, dtype, spec, cast=None):
    """x^ in x's dtype, bit for bit the fake quantizer's output (which saturates at the dtype's
    largest finite value; the check on the scales is cheap and almost never true). With `cast`
    (autocast's dtype) x^ as autocast would cast it, written directly: the float32 value rounded
    once to nearest even either way."""
    # (on a GPU reading the scales back would sync the device: saturate there without looking)
    direct = s.is_cpu and float(s.amax()) * float(spec.qmax - spec.qmin + 1) < _FINITE_MAX[dtype]
    out = dtype if not direct or cast is None or dtype == torch.float64 else cast
    y = kernels.dequantize_codes(q, s, z, spec, out)
    if y is None:
        y = dequantize(q, s, z, dtype=out)
    return y if direct else _cast(saturate(y, dtype), cast)


_FINITE_MAX = {dt: torch.finfo(dt).max for dt in (torch.float16, torch.bfloat16)}
_FINITE_MAX.update({dt: torch.finfo(torch.float32).max for dt in (torch.float32, torch.float64)})


# --- when the fused path applies -----------------------------------------------------------------


class Plan:
    """What one fused forward does: the op, the activation Spec, how the weight is made."""

    __slots__ = ("mod", "op", "spec", "weight_mode", "weight_spec", "shrink", "int8", "weight_args", "lora")

    def __init__(self, mod, op, spec, weight_mode, weight_spec, shrink, int8=False, lora=False):
        self.mod, self.op, self.spec = mod, op, spec
        self.lora = lora  # mode qat LoRA: the weight is W + (B A) * scaling, made here (nn/lora.py)
        self.weight_mode, self.weight_spec, self.shrink = weight_mode, weight_spec, shrink
        self.int8 = int8  # forward multiplies the codes (int8_forward), backward as always
        # the weight's own (minmax) ranges: its quantizer op's arguments, made once for both calls
        self.weight_args = None
        if weight_mode == "fake_quant" and shrink is None and not mod.qc_wq.range_learning:
            self.weight_args = kernels.prepared_args(mod.weight_matrix_view(mod.weight), weight_spec)

    def weight(self, w, scale=None, zero_point=None, lora_a=None, lora_b=None):
        """The weight the op uses: the Parameter itself, or its fake-quantized copy (of the merged
        weight, with a LoRA adapter's A and B)."""
        if self.weight_mode == "param":
            return w
        if self.lora:
            w = lora.merge(self.mod, w, lora_a, lora_b)
        return self.quantized(w, scale, zero_point)

    def quantized(self, w, scale=None, zero_point=None):
        """The weight quantizer's output for w (the Parameter, or the merged weight)."""
        mod, wq = self.mod, self.mod.qc_wq
        if ranges.chosen(wq) is not self.shrink:
            raise RuntimeError(
                f"{mod.qc_name}: the weight's mse ranges changed between forward and "
                "backward (a scheduler step in between?); run backward first"
            )
        if self.weight_args is not None and not torch.is_grad_enabled():  # no graph: the op itself
            try:
                wh = kernels.fake_quantize_prepared(mod.weight_matrix_view(w), self.weight_args)
            except NonFiniteError as err:
                raise mod.qc_located("weight", err) from None
            return mod._from_matrix_view(wh)
        learned = (scale, zero_point) if wq.range_learning else None
        return mod._from_matrix_view(mod._fake_quantize_weight(w, wq, spec=self.weight_spec, learned=learned))

    def run(self, xq, w, bias):
        mod = self.mod
        if self.op == "linear":
            return F.linear(xq, w, bias)
        if self.op == "conv":
            return mod._conv_forward(xq, w, bias)
        size_out = xq.size()[:-1] + (mod.nf,)  # transformers Conv1D, as its forward
        return torch.addmm(bias, xq.reshape(-1, xq.size(-1)), w).view(size_out)


def plan(mod, x, op: str) -> Optional[Plan]:
    """The fused plan for this forward, or None to run the composed path."""
    aq = mod.qc_aq
    act = aq is not None and aq.active
    if not _enabled or (act and not aq.fused):
        return None
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None  # float64 and non-float inputs: rare, left to the composed path
    if x.dim() < 2 or x.numel() == 0:
        return None  # 1-D inputs take matmul's vector path, whose derivative differs
    if act and aq.bits > 8:
        return None  # int32 codes would take as much memory as the float32 input
    if act and aq.range_learning:
        return None  # LSQ's scale gradient needs x / s - round(x / s), which the codes do not hold
    if mod.qc_pruning:
        return None  # masks multiply the weight and bias inside autograd: kept composed
    if torch.compiler.is_compiling():
        return None  # the shared-codes cache (weak references) is not traceable
    if type(x).__name__ == "DTensor" or type(mod.weight).__name__ == "DTensor":
        return None  # tensor parallel: the composed path reduces ranges over the group (nn/sharded.py)
    if op == "conv" and (mod.padding_mode != "zeros" or isinstance(mod.padding, str)):
        return None  # F.pad or padding='same' run before the convolution: another graph
    wq = mod.qc_wq
    weight_spec = shrink = None
    if wq is None or wq.baked:
        mode = "param"
    elif wq.active and wq.in_forward:
        if wq.mix_enabled and wq.mix_ratio > 0.0:
            return None  # fp16_mixed blend r w + (1 - r) w^: a transient schedule phase
        ranges.check_solved(mod)
        mode, weight_spec, shrink = "fake_quant", wq.spec(), ranges.chosen(wq)
    elif wq.range_learning:
        return None  # unused learned scales get zero gradients (ranges.attach_unused)
    else:
        mode = "param"  # not active yet, or optimizer-step mode: the weight is the quantized one
    if not act and mode != "fake_quant":
        return None  # nothing quantized in forward: the composed path is FP32's
    adapted = "qc_lora" in mod.__dict__ and mod.qc_lora.mode == "qat" and not (wq is not None and wq.baked)
    if adapted and mode != "fake_quant":
        return None  # a LoRA adapter on a weight not quantized now: composed (effective_weight merges)
    spec = mod.input_spec() if act else None
    if getattr(weight_spec, "kind", None) == "float" or getattr(spec, "kind", None) == "float":
        return None  # float formats (quant/floats.py) run composed
    int8 = (
        act and int8_forward.enabled(aq, mod.training) and int8_forward.reason(mod, op, mode, weight_spec, spec) is None
    )
    return Plan(mod, op, spec, mode, weight_spec, shrink, int8, adapted)


def run(p: Plan, x: torch.Tensor) -> torch.Tensor:
    mod = p.mod
    try:
        # weight-only: forward keeps x; the float forward takes x^ from the quantizer's own pass
        q, s, z, xh = (None,) * 4 if p.spec is None else _input_codes(mod, x, p.spec, values=not p.int8)
    except NonFiniteError as err:
        raise mod.qc_located("input", err) from None
    w_scale = w_zp = None
    if p.weight_mode == "fake_quant" and mod.qc_wq.range_learning:
        w_scale = mod.weight_scale
        w_zp = mod._parameters.get("weight_zero_point") if p.weight_spec.kind == "int" else None
    lora_a = lora_b = None
    if p.lora:
        lora_a, lora_b = lora.adapter_weights(mod)
    return _FusedCompressed.apply(x, mod.weight, mod.bias, w_scale, w_zp, q, s, z, xh, p, lora_a, lora_b)


# --- the autograd Function -----------------------------------------------------------------------


def _autocast_dtype(device_type: str):
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast(t, dtype):
    """What autocast does to an argument of a lower-precision op (cached_cast)."""
    if dtype is None or t is None or t.dtype == dtype or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _mat1_grad(grad, mat2, mat1_shape):
    """torch's mm_mat1_backward: the gradient of mat1 in mat1 @ mat2, for a contiguous mat1 (x^
    always is), which counts as column-major only when it is [1, 1]."""
    if mat1_shape[0] == 1 and mat1_shape[1] == 1:
        return mat2.mm(grad.t()).t()
    return grad.mm(mat2.t())


def _mat2_grad(grad, mat1, mat2):
    """torch's mm_mat2_backward: the gradient of mat2 in mat1 @ mat2."""
    if mat2.stride(0) == 1 and mat2.stride(1) == mat2.size(0):
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _op_input(p: Plan, q, s, z, x_dtype, cast):
    """What the op multiplied: x^ from its codes, or (weight-only) the saved, already cast input."""
    return q if p.spec is None else _dequantize(q, s, z, x_dtype, p.spec, cast)


def _op_grads(p: Plan, grad, q, s, z, x_dtype, cast, wc, bias_shape, need_x, need_w, need_b):
    """(grad of x^, of the weight the op used, of the bias) in the op's compute dtype. x^ is
    dequantized here and let go before the input's gradient is made, which can reuse its memory."""
    mod = p.mod
    if p.op == "conv":  # the input's shape and dtype are needed even without weight gradients
        xc = _op_input(p, q, s, z, x_dtype, cast)
        n = xc.dim() - 2
        return torch.ops.aten.convolution_backward(
            grad,
            xc,
            wc,
            None if bias_shape is None else list(bias_shape),
            list(mod.stride),
            list(mod.padding),
            list(mod.dilation),
            False,
            [0] * n,
            mod.groups,
            [need_x, need_w, need_b],
        )
    g2 = grad.reshape(-1, grad.size(-1))
    mat2 = wc.t() if p.op == "linear" else wc  # linear: x @ w.t(); Conv1D: x @ w
    gw = gx = gb = None
    if need_w:
        xc = _op_input(p, q, s, z, x_dtype, cast)
        gw = _mat2_grad(g2, xc.reshape(-1, xc.size(-1)), mat2)
        gw = gw.t() if p.op == "linear" else gw
        del xc
    if need_x:
        gx = _mat1_grad(g2, mat2, (g2.size(0), q.size(-1))).reshape(q.shape)
    if need_b:
        gb = g2.sum_to_size(bias_shape)
    return gx, gw, gb


class _FusedCompressed(torch.autograd.Function):
    """op(x^, w^, b), x^ = dequantize(q, s, z) (given as xh when the quantizer wrote it in the same
    pass); saves the codes, the scales and the Parameters only."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_scale, w_zp, q, s, z, xh, p, lora_a=None, lora_b=None):
        ctx.cast = _autocast_dtype(x.device.type)
        if p.spec is None:  # weight-only: keep the input as autocast would cast it for the op
            xq = q = _cast(x, ctx.cast)
            out = None
        else:
            out = int8_forward.run(p.mod, x, weight, bias, q, s, z, ctx.cast or x.dtype) if p.int8 else None
            if out is not None:
                xq = None
            elif xh is not None:  # x^ from the quantizer's pass: autocast casts it for the op
                xq = _cast(xh, ctx.cast)
            else:
                xq = _dequantize(q, s, z, x.dtype, p.spec, ctx.cast)
        if out is None:
            out = p.run(xq, p.weight(weight, w_scale, w_zp, lora_a, lora_b), bias)
        ctx.p = p
        ctx.x_dtype = x.dtype
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        ctx.save_for_backward(q, s, z, weight, w_scale, w_zp, lora_a, lora_b)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, s, z, weight, w_scale, w_zp, lora_a, lora_b = ctx.saved_tensors
        p = ctx.p
        need_x, need_w, need_b, need_s, need_z = ctx.needs_input_grad[:5]
        need_la, need_lb = ctx.needs_input_grad[10:12]
        weight_grads = need_w or need_s or need_z or need_la or need_lb
        if p.lora and weight_grads:
            return _lora_backward(ctx, grad, q, s, z, weight, w_scale, w_zp, lora_a, lora_b)
        # the weight the forward used; with autograd recording when the quantizer's own backward
        # (straight-through, clip mask, LSQ) has to carry the gradient on to the Parameters
        leaves = []
        wq = p.mod.qc_wq
        # straight-through without clip mask or learned ranges: the weight's gradient is the op's
        # own, so w^ is made without a graph and no nested autograd pass runs
        track = weight_grads and p.weight_mode == "fake_quant" and (wq.range_learning or wq.clip_grad)
        with torch.set_grad_enabled(track):
            if track:
                pairs = ((weight, need_w), (w_scale, need_s), (w_zp, need_z))
                w_in, s_in, z_in = (None if t is None else t.detach().requires_grad_(need) for t, need in pairs)
                leaves = [t for t, (_, need) in zip((w_in, s_in, z_in), pairs) if need]
                w_used = p.weight(w_in, s_in, z_in)
            else:
                w_used = p.weight(weight, w_scale, w_zp)
        bias_shape = None if ctx.bias_meta is None else ctx.bias_meta[0]
        gx, gw, gb = _op_grads(
            p,
            grad,
            q,
            s,
            z,
            ctx.x_dtype,
            ctx.cast,
            _cast(w_used.detach(), ctx.cast),
            bias_shape,
            need_x,
            weight_grads,
            need_b,
        )
        gx, gb = _input_grads(ctx, gx, gb)
        g_w = g_s = g_z = None
        if weight_grads:
            gw = gw.to(w_used.dtype)
            if track:
                got = iter(torch.autograd.grad(w_used, leaves, gw))
                g_w = next(got) if need_w else None
                g_s = next(got) if need_s else None
                g_z = next(got) if need_z else None
            else:
                g_w = gw
        return gx, g_w, gb, g_s, g_z, None, None, None, None, None, None, None


def _input_grads(ctx, gx, gb):
    if gx is not None:
        gx = gx.to(ctx.x_dtype)
    if gb is not None:
        gb = gb.to(ctx.bias_meta[1])
    return gx, gb


def _lora_backward(ctx, grad, q, s, z, weight, w_scale, w_zp, lora_a, lora_b):
    """Backward of a mode qat LoRA layer: the merged weight W + (B A) * scaling and its quantization
    are made again without a graph (the quantizer's own backward recorded only where it has one:
    clip mask, learned ranges), and the merge's gradients are lora.merge_grads', so no weight-size
    intermediate of the merge waits in an autograd graph; the values are autograd's through
    lora.merge bit for bit. At most two weight-size tensors are alive at once (w^ and its
    gradient), where a recorded merge kept a third. (The saved tensors come unpacked: checkpointing
    allows one unpacking.)"""
    p = ctx.p
    need_x, need_w, need_b, need_s, need_z = ctx.needs_input_grad[:5]
    need_la, need_lb = ctx.needs_input_grad[10:12]
    wq = p.mod.qc_wq
    graph = wq.range_learning or wq.clip_grad  # the quantizer's backward is more than the identity
    with torch.no_grad():
        merged = lora.merge(p.mod, weight, lora_a, lora_b)
    leaves = []
    need_m = need_w or need_la or need_lb
    with torch.set_grad_enabled(graph):
        if graph:
            m_in = merged.requires_grad_(need_m)
            s_in, z_in = (
                None if t is None else t.detach().requires_grad_(need)
                for t, need in ((w_scale, need_s), (w_zp, need_z))
            )
            leaves = [t for t, need in ((m_in, need_m), (s_in, need_s), (z_in, need_z)) if need]
            w_used = p.quantized(m_in, s_in, z_in)
            del m_in
        else:
            w_used = p.quantized(merged, w_scale, w_zp)
    del merged  # (kept by the graph only where the quantizer's backward reads it)
    bias_shape = None if ctx.bias_meta is None else ctx.bias_meta[0]
    gx, gw, gb = _op_grads(
        p, grad, q, s, z, ctx.x_dtype, ctx.cast, _cast(w_used.detach(), ctx.cast), bias_shape, need_x, True, need_b
    )
    gx, gb = _input_grads(ctx, gx, gb)
    gw = gw.to(w_used.dtype)
    g_s = g_z = None
    if graph:
        got = iter(torch.autograd.grad(w_used, leaves, gw))
        del gw
        g_m = next(got) if need_m else None
        g_s = next(got) if need_s else None
        g_z = next(got) if need_z else None
    else:
        g_m = gw  # straight-through: the merged weight's gradient is w^'s
        del gw
    del w_used
    g_w = g_a = g_b = None
    if need_m:
        g_w, g_a, g_b = lora.merge_grads(p.mod, g_m, weight, lora_a, lora_b, need_w, need_la, need_lb, own_grad=True)
    return gx, g_w, gb, g_s, g_z, None, None, None, None, None, g_a, g_b
