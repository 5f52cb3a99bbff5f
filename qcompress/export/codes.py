"""From a compress-aware module to the integers, scales and zero points that get written.

The codes come from `module.quantized_weight()` (the ones the trained model used) and are
mapped onto a compressed-tensors strategy (tensor / channel / group). Every module is then
checked: dequantizing what will be written must give `effective_weight()` bit for bit, or
the export stops with an error naming the module.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..quant import reference
from ..quant.packing import pack_int32
from ..quant.reference import make_spec
from .entry import WeightEntry, observer_kwargs  # apart from this module: floats.py builds them too
from .errors import ExportError

WQ_KEY = "compression_training.weight_quantization"
PACKED_BITS = (2, 4)  # written as weight_packed int32; 8 and odd widths as int8 `weight`


def fmt_for(bits: int) -> str:
    return "pack-quantized" if bits in PACKED_BITS else "int-quantized"


def dequantize_2d(
    q: torch.Tensor,
    scale: torch.Tensor,
    zp: Optional[torch.Tensor],
    group_size: Optional[int],
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """(q - zp) * scale in float32 over a [rows, K] code matrix; same ops as the reference.
    With `dtype`: saturated to its finite range and converted, as the fake quantizer's output."""
    if dtype is not None:
        from ..quant.reference import saturate

        return saturate(dequantize_2d(q, scale, zp, group_size), dtype).to(dtype)
    qf = q.to(torch.float32)
    s = scale.to(torch.float32)
    z = None if zp is None else zp.to(torch.float32)
    if group_size is not None:
        k = q.shape[1]
        s = s.repeat_interleave(group_size, dim=1)[:, :k]
        z = None if z is None else z.repeat_interleave(group_size, dim=1)[:, :k]
    return (qf - z) * s if z is not None else qf * s


def _strategy(mod, q2: torch.Tensor, s: torch.Tensor, zp, spec):
    """(strategy, group_size, scale 2-D, zp 2-D or None) in compressed-tensors shapes."""
    rows, k = q2.shape
    g = spec.granularity
    z = None if zp is None else zp.to(torch.float32)
    if g == "tensor":
        return "tensor", None, s.reshape(1), None if z is None else z.reshape(1)
    if g == "channel":
        return "channel", None, s.reshape(rows, 1), None if z is None else z.reshape(rows, 1)
    if g == "group":
        ng = s.numel() // rows
        return "group", spec.group_size, s.reshape(rows, ng), None if z is None else z.reshape(rows, ng)
    # DeepSpeed quantize_groups: N equal chunks of the flattened weight
    n = spec.num_groups
    chunk = rows * k // n
    if chunk % k == 0:  # each chunk covers whole rows: one scale per row, repeated
        rep = chunk // k
        s2 = s.reshape(n).repeat_interleave(rep).reshape(rows, 1)
        z2 = None if z is None else z.reshape(n).repeat_interleave(rep).reshape(rows, 1)
        return "channel", None, s2, z2
    if k % chunk == 0:  # each row splits into k/chunk chunks: group strategy
        return "group", chunk, s.reshape(rows, k // chunk), None if z is None else z.reshape(rows, k // chunk)
    raise ExportError(
        f"module {mod.qc_name!r}: quantize_groups={n} splits its {rows}x{k} weight into chunks of "
        f"{chunk} elements that straddle rows; compressed-tensors has no such strategy. Set "
        f"{WQ_KEY}.shared_parameters.quantize_groups to a value whose chunk length divides or is a "
        f"multiple of the row length {k}, or set {WQ_KEY}.different_groups.{mod.qc_wq.group}."
        "params.granularity to 'channel' or 'group'"
    )


def weight_entry(mod) -> WeightEntry:
    """The on-disk form of a compress-aware module's quantized weight (checked bit for bit)."""
    wq = mod.qc_wq
    name = mod.qc_name
    grp = f"{WQ_KEY}.different_groups.{wq.group}"
    if wq.mix_enabled and wq.mix_ratio > 0:
        raise ExportError(
            f"module {name!r}: fp16_mixed_quantize is still blending full-precision "
            f"weights in (mix_ratio={wq.mix_ratio}); train until the blend ends "
            f"or disable {WQ_KEY}.shared_parameters.fp16_mixed_quantize"
        )
    if wq.numerics == "deepspeed" and not wq.symmetric:
        raise ExportError(
            f"module {name!r}: asymmetric DeepSpeed numerics (x^ = q*s + z) have no "
            f"compressed-tensors equivalent; set {WQ_KEY}.shared_parameters.numerics "
            "to 'default'"
        )
    _check_finite(mod, name)
    from ..errors import NonFiniteError

    try:
        got = mod.quantized_weight()
    except NonFiniteError as e:  # e.g. a learned scale gone NaN: name the module
        raise ExportError(f"module {name!r}: cannot quantize its weight ({e})") from None
    if got is None:
        raise ExportError(
            f"module {name!r}: weight quantization has no codes (baked during an fp16_mixed_quantize blend)"
        )
    q, s, zp, spec = got
    if spec.kind == "float":  # FP8 / NVFP4 / MX layouts (export/floats.py)
        from .floats import weight_entry as float_entry

        return float_entry(mod, q, s, zp, spec)
    kind = spec.kind
    bits = 2 if kind in ("binary", "ternary") else spec.bits
    if bits > 8:
        raise ExportError(
            f"module {name!r}: {bits}-bit weights cannot be exported (int8 container); "
            f"set {grp}.params.target_bits <= 8"
        )
    ref = mod.weight.detach() if wq.baked else mod.effective_weight().detach()
    ref = mod.weight_matrix_view(ref)
    rows = ref.shape[0]
    q2 = q.reshape(rows, -1).to(torch.int8)
    strategy, gsize, s2, z2 = _strategy(mod, q2, s.to(torch.float32), zp, spec)
    if z2 is not None:
        # a signed zero point must fit the stored width (it does by construction; checked anyway)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if bool(((z2 < lo) | (z2 > hi)).any()):
            raise ExportError(f"module {name!r}: zero point outside the signed {bits}-bit range")
    ref2 = ref.reshape(rows, -1)
    deq = dequantize_2d(q2, s2, z2, gsize, ref.dtype)
    if not torch.equal(deq, ref2):
        # pruning masks zero weights after quantization: store the zero point there instead
        fix = (ref2 == 0) & (deq != 0)
        if bool(fix.any()):
            zfill = torch.zeros_like(q2) if z2 is None else _expand(z2, gsize, q2.shape[1])
            q2 = torch.where(fix, zfill.to(torch.int8), q2)
            deq = dequantize_2d(q2, s2, z2, gsize, ref.dtype)
        bad = int((deq != ref2).sum())
        if bad:
            raise ExportError(
                f"module {name!r}: the exported integers do not reproduce "
                f"effective_weight() ({bad} of {ref2.numel()} elements differ): redundancy_clean "
                "dropped its integer codes because pruning split its groups of inputs (it "
                "warned; quantize it per channel), or the weight changed after redundancy_clean"
            )
    fmt = fmt_for(bits)
    entry = WeightEntry(
        bits=bits,
        qtype=kind,
        symmetric=spec.symmetric,
        strategy=strategy,
        group_size=gsize,
        fmt=fmt,
        shape=list(ref.shape),
        dtype=str(ref.dtype).replace("torch.", ""),
        transposed=mod.qc_kind == "hf_conv1d",
        target_bits=wq.target_bits,
        observer=wq.range_observer,
        observer_kwargs=observer_kwargs(wq),
    )
    t = entry.tensors
    if fmt == "pack-quantized":
        t["weight_packed"] = pack_int32(q2, bits, dim=1).contiguous()
        t["weight_shape"] = torch.tensor(list(ref.shape), dtype=torch.int64)
    else:
        t["weight"] = q2.reshape(ref.shape).contiguous()
    t["weight_scale"] = s2.to(torch.float32).contiguous()
    if z2 is not None:
        zi = z2.to(torch.int8)
        if fmt == "pack-quantized" and strategy in ("channel", "group"):
            t["weight_zero_point"] = pack_int32(zi, bits, dim=0).contiguous()
        else:
            t["weight_zero_point"] = zi.contiguous()
    return entry


def _check_finite(mod, name: str) -> None:
    """NaN / Inf in a weight (diverged training, a bad edit) has no integer code: say which
    tensor and where, instead of a quantizer error without a name."""
    w = mod.weight.detach()
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ExportError(
            f"module {name!r}: tensor {name + '.weight'!r} holds {int(bad.sum())} NaN or "
            f"Inf values (the first at index {first}, value {float(w[tuple(first)])}); "
            "integer codes cannot represent them: fix or retrain the weights before exporting"
        )


def _expand(z2, gsize, k):
    """Per-element zero points (broadcastable to [rows, k]) as int8."""
    if gsize is not None:
        z2 = z2.repeat_interleave(gsize, dim=1)[:, :k]
    return z2.reshape(z2.shape[0], -1) if z2.dim() == 2 else z2.reshape(1, 1)


def act_entry(mod):
    """(QuantizationArgs dict, tensors) for the module's input-activation quantization, or None."""
    aq = mod.qc_aq
    if aq is None or not aq.active:
        return None
    if aq.format != "int":
        from .floats import act_entry as float_act_entry

        return float_act_entry(mod)
    args = {"num_bits": aq.bits, "type": "int", "symmetric": aq.symmetric}
    if aq.calibration == "static" and aq.range_learning and aq.learned_ready:
        from ..quant.api import learned_params

        spec = make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")
        s, zp = learned_params(mod.input_scale, mod._parameters.get("input_zero_point"), spec)
        tensors = {"input_scale": s.detach().cpu().reshape(1).to(torch.float32)}
        if zp is not None:
            tensors["input_zero_point"] = zp.detach().cpu().reshape(1).to(torch.int8)
        args.update(strategy="tensor", dynamic=False, observer=aq.range_observer, observer_kwargs=observer_kwargs(aq))
        return args, tensors
    if aq.calibration == "static":
        if not aq.observer.initialized:
            raise ExportError(
                f"module {mod.qc_name!r}: static activation range was never calibrated "
                "(run training or calibration batches before exporting)"
            )
        spec = make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")
        X = torch.zeros(1, 1)
        s, zp, _ = reference.qparams(
            X, torch.ones(1, dtype=torch.int64), spec, min_val=aq.observer.min.cpu(), max_val=aq.observer.max.cpu()
        )
        tensors = {"input_scale": s.reshape(1).to(torch.float32)}
        if zp is not None:
            tensors["input_zero_point"] = zp.reshape(1).to(torch.int8)
        args.update(strategy="tensor", dynamic=False, observer=aq.range_observer, observer_kwargs=observer_kwargs(aq))
        return args, tensors
    strategy = "token" if aq.per == "token" else "sample"  # "sample": qcompress-only (Conv)
    args.update(strategy=strategy, dynamic=True, observer=None)
    return args, {}


def static_act_fake_quant(x: torch.Tensor, bits: int, scale: torch.Tensor, zp) -> torch.Tensor:
    """Fake-quantize x with a stored static scale/zero point; same ops as the reference."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    xf = x.to(torch.float32)
    s = scale.to(torch.float32).reshape(())
    r = torch.round(xf / s)
    if zp is not None:
        z = zp.to(torch.float32).reshape(())
        return ((r + z).clamp(qmin, qmax) - z).mul(s).to(x.dtype)
    return (r.clamp(qmin, qmax) * s).to(x.dtype)


def packed_cols(k: int, bits: int) -> int:
    return math.ceil(k * bits / 32)
