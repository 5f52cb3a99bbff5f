"""Number formats besides integers: FP8 (e4m3), NVFP4, MXFP4, MXFP8, in plain torch.

The math equals compressed-tensors 0.20's quantizers op for op (calculate_qparams,
generate_gparam, fake_quantize), so the trained weights are the ones vLLM dequantizes:

  amax       = max(|min(lo, 0)|, |max(hi, 0)|)     per tensor / channel / token / group / block
  fp8_e4m3   s = amax / 448                         in x's dtype; 0 -> finfo(dtype).eps
  nvfp4      g = 448 * 6 / amax(tensor)            one FP32 global scale (generate_gparam)
             s = e4m3(g * (amax / 6))               per 16, rounded to e4m3; 0 -> 0.125
  mxfp4/8    s = 2^(floor(log2(pow2(amax))) - o)    per 32, E8M0 (o = 2 for FP4, 8 for FP8)
  x^         = cast(clamp(x / (s / g), -qmax, qmax)) * (s / g)

cast is the e4m3 conversion (round half to even, saturated by the clamp) or the E2M1 grid
{0, .5, 1, 1.5, 2, 3, 4, 6} with ties to even; every intermediate keeps the dtype torch's type
promotion gives it there (bf16 weights: bf16 amax / 448, FP32 NVFP4 scales), as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..config.formats import FORMATS, GRANULARITIES, GROUP_SIZE, WIDTH  # noqa: F401 (re-exported)
from ..errors import NonFiniteError

E4M3_MAX = 448.0
E2M1_MAX = 6.0
BLOCK = (128, 128)  # FP8_BLOCK's weight blocks (rows, columns)
_MX_OFFSET = {4: 2, 8: 8}  # floor(log2(qmax)) of E2M1 and e4m3


@dataclass(frozen=True)
class FloatSpec:
    """How a tensor is quantized to a float format. Granularity acts on the tensor as a matrix:
    channel = rows of [shape[0], -1]; token = rows of [-1, shape[-1]]; group = runs of
    group_size along the last dim; block = 128 x 128 tiles of a 2-D weight."""

    format: str
    granularity: str
    group_size: Optional[int] = None

    kind = "float"
    symmetric = True
    numerics = "default"

    @property
    def bits(self) -> int:
        return WIDTH[self.format]

    @property
    def qmax(self) -> float:
        return E2M1_MAX if self.bits == 4 else E4M3_MAX

    @property
    def scale_kind(self) -> str:
        """float (the tensor's dtype), e4m3 (under an FP32 global scale) or e8m0."""
        return {"fp8_e4m3": "float", "nvfp4": "e4m3"}.get(self.format, "e8m0")


def float_spec(fmt: str, granularity: str, group_size: Optional[int] = None) -> FloatSpec:
    """A validated FloatSpec (ValueError naming what the format allows)."""
    if fmt not in WIDTH:
        raise ValueError(f"float format must be one of {tuple(WIDTH)}, got {fmt!r}")
    if granularity not in GRANULARITIES[fmt]:
        raise ValueError(f"{fmt} defines granularities {GRANULARITIES[fmt]}, not {granularity!r}")
    if fmt in GROUP_SIZE:
        if group_size not in (None, GROUP_SIZE[fmt]):
            raise ValueError(f"{fmt} groups hold {GROUP_SIZE[fmt]} elements, not {group_size}")
        group_size = GROUP_SIZE[fmt]
    elif granularity == "group" and (group_size is None or group_size < 1):
        raise ValueError(f"granularity 'group' needs group_size >= 1, got {group_size!r}")
    if granularity != "group":
        group_size = None
    return FloatSpec(fmt, granularity, group_size)


def is_float(spec) -> bool:
    return getattr(spec, "kind", None) == "float"


def check_shape(shape, spec: FloatSpec) -> Optional[str]:
    """Why a tensor of this shape cannot take spec (None when it can): groups must tile the
    last dim (compressed-tensors refuses a ragged group), FP4 pairs must fill bytes."""
    if spec.granularity == "block" and len(shape) != 2:
        return f"128 x 128 blocks need a 2-D weight, got shape {tuple(shape)}"
    if spec.granularity == "group" and shape[-1] % spec.group_size:
        return (
            f"the last dim {shape[-1]} is not a multiple of {spec.format}'s group size "
            f"{spec.group_size} (shape {tuple(shape)})"
        )
    return None


# --- grouping: stats and scales per granularity -------------------------------------------------


def _tiles(x: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """x with each scale's elements on trailing dims: [1, n] tensor, [r, k] channel/token,
    [r, g, gs] group, [R, C, 128, 128] block (zero padded, as compressed-tensors pads)."""
    g = spec.granularity
    if g == "tensor":
        return x.reshape(1, -1)
    if g == "channel":
        return x.reshape(x.shape[0], -1)
    if g == "token":
        return x.reshape(-1, x.shape[-1])
    if g == "group":
        reason = check_shape(x.shape, spec)
        if reason:
            raise ValueError(reason)
        gs = spec.group_size
        assert gs is not None  # check_shape refuses a group spec without one
        return x.reshape(-1, x.shape[-1] // gs, gs)
    rows, cols = x.shape
    bh, bw = BLOCK
    pr, pc = (-rows) % bh, (-cols) % bw
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape(x.shape[0] // bh, bh, x.shape[1] // bw, bw).transpose(1, 2)


def _untile(y: torch.Tensor, x: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    if spec.granularity != "block":
        return y.reshape(x.shape)
    y = y.transpose(1, 2)
    y = y.reshape(y.shape[0] * y.shape[1], y.shape[2] * y.shape[3])
    return y[: x.shape[0], : x.shape[1]]


def _reduce_dims(t: torch.Tensor, spec: FloatSpec) -> Tuple[int, ...]:
    return (2, 3) if spec.granularity == "block" else (t.dim() - 1,)


def _check_finite(lo, hi, what):
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
    if bool(bad.any()):
        raise NonFiniteError(
            f"{int(bad.sum())} of {bad.numel()} quantization groups contain NaN or "
            f"Inf values ({what}); fix the input before quantizing"
        )


def absmax(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max(|min(lo, 0)|, |max(hi, 0)|): 0 is always representable."""
    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    return torch.max(torch.abs(lo), torch.abs(hi))


def global_scale(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 global scale [1] from a tensor's range (compressed-tensors' generate_gparam:
    computed in the range's dtype; a zero or non-finite range gives 1)."""
    a = absmax(lo, hi)
    a = torch.clamp(a, min=torch.finfo(a.dtype).tiny)
    g = (E4M3_MAX * E2M1_MAX) / a
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32).reshape([1])


def tensor_global_scale(x: torch.Tensor) -> torch.Tensor:
    a = torch.amax(torch.abs(x.detach()))
    _check_finite(a, a, "global range")
    return global_scale(-a, a)


def _pow2_round(a: torch.Tensor) -> torch.Tensor:
    """The power of two an MX scale starts from: a's sign and exponent after adding half an
    E2M1 mantissa step below the stored mantissa (compressed-tensors' round_to_power_2)."""
    bits = {
        torch.bfloat16: (torch.uint16, 7, 8),
        torch.float16: (torch.uint16, 10, 5),
        torch.float32: (torch.uint32, 23, 8),
        torch.float64: (torch.uint64, 52, 11),
    }
    if a.dtype not in bits:
        raise TypeError(f"MX scales need a float dtype, got {a.dtype}")
    udt, mant, expo = bits[a.dtype]
    i = a.view(udt).to(torch.int64 if udt == torch.uint64 else torch.int32)
    add = 1 << (mant - 1 - 1)  # E2M1's one mantissa bit, for every MX element type
    mask = ((1 << (expo + 1)) - 1) << mant
    r = torch.bitwise_and(i + add, mask)
    return r.to(udt).view(a.dtype) if udt == torch.uint16 else r.view(a.dtype)


def scales_from_range(
    lo: torch.Tensor, hi: torch.Tensor, spec: FloatSpec, gscale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Each group's scale (as compressed-tensors' calculate_qparams returns it: a float tensor,
    already rounded to e4m3 / a power of two where the format says so)."""
    return scales_from_absmax(absmax(lo, hi), spec, gscale)


def scales_from_absmax(
    a: torch.Tensor, spec: FloatSpec, gscale: Optional[torch.Tensor] = None, zero_floor: bool = True
) -> torch.Tensor:
    """Each group's scale from its absmax; zero_floor=False leaves a scale that rounds to 0 at 0
    (the mse search's e4m3 steps need to see it) instead of the format's floor."""
    if spec.scale_kind == "e8m0":
        e = 127 + torch.floor(torch.log2(_pow2_round(a))) - _MX_OFFSET[spec.bits]
        e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8).to(e.dtype)
        s = (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(e.dtype)
        eps = 1.0
    else:
        s = a / (torch.tensor(2 * spec.qmax).to(a.dtype) / 2)
        if gscale is not None:
            s = gscale * s
        if spec.scale_kind == "e4m3":
            fi = torch.finfo(torch.float8_e4m3fn)
            s = torch.clamp(s, fi.min, fi.max).to(torch.float8_e4m3fn).to(s.dtype)
            eps = 0.125
        else:
            eps = torch.finfo(s.dtype).eps
    if zero_floor:
        s = torch.where(s == 0, torch.tensor(eps, dtype=s.dtype, device=s.device), s)
    return s.reshape(1) if s.dim() == 0 else s


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4)."""
    sign = torch.sign(v)
    a = torch.abs(v)
    out = torch.zeros_like(a)
    out = torch.where((a > 0.25) & (a < 0.75), 0.5, out)
    out = torch.where((a >= 0.75) & (a <= 1.25), 1.0, out)
    out = torch.where((a > 1.25) & (a < 1.75), 1.5, out)
    out = torch.where((a >= 1.75) & (a <= 2.5), 2.0, out)
    out = torch.where((a > 2.5) & (a < 3.5), 3.0, out)
    out = torch.where((a >= 3.5) & (a <= 5.0), 4.0, out)
    out = torch.where(a > 5.0, 6.0, out)
    return out * sign


def _codes(scaled: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    """clamp to the format's range, then onto its grid (a float tensor of grid values)."""
    v = torch.clamp(scaled, -spec.qmax, spec.qmax)
    if spec.bits == 8:
        return v.to(torch.float8_e4m3fn).to(v.dtype)
    return _e2m1(v)


# --- public: parameters, codes, fake quantization ---------------------------------------------


def qparams(
    x: torch.Tensor, spec: FloatSpec, gscale: Optional[torch.Tensor] = None, static_range=None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, global scale) of x: scale shaped [1] (tensor), [rows, 1] (channel, token),
    [rows, groups] (group), [row blocks, col blocks] (block). NVFP4's global scale is x's own
    unless given. `static_range` (lo, hi) replaces x's per-tensor range (static activations)."""
    x = x.detach()
    if spec.scale_kind == "e4m3" and gscale is None:
        gscale = tensor_global_scale(x) if static_range is None else global_scale(*static_range)
    if static_range is not None:
        if spec.granularity != "tensor" and spec.format == "fp8_e4m3":
            raise ValueError("a static range needs granularity 'tensor'")
        lo, hi = (t.to(x.dtype).reshape(1) for t in static_range)
        _check_finite(lo, hi, "static range")
        if spec.format == "fp8_e4m3":
            return scales_from_range(lo, hi, spec, gscale), gscale
    t = _tiles(x, spec)
    # max |x| of each group: the same value as max(|min(lo, 0)|, |max(hi, 0)|), one reduction
    a = torch.amax(torch.abs(t), dim=_reduce_dims(t, spec))
    _check_finite(a, a, f"{spec.format} {spec.granularity}")
    s = scales_from_absmax(a, spec, gscale)
    if spec.granularity in ("channel", "token"):
        s = s.reshape(-1, 1)
    elif spec.granularity == "tensor":
        s = s.reshape(1)
    return s, gscale


def _broadcast(t: torch.Tensor, s: torch.Tensor, spec: FloatSpec) -> torch.Tensor:
    if spec.granularity == "group":
        return s.reshape(t.shape[0], t.shape[1], 1)
    if spec.granularity == "block":
        return s.reshape(t.shape[0], t.shape[1], 1, 1)
    return s.reshape(-1, 1) if spec.granularity != "tensor" else s.reshape(1)


def _scaled(x, spec, scale, gscale):
    t = _tiles(x, spec)
    s = _broadcast(t, scale, spec)
    if gscale is not None and spec.scale_kind == "e4m3":
        s = s / gscale
    scaled = t / s
    scaled = scaled + torch.zeros((), dtype=x.dtype, device=x.device)  # zero point 0: -0 -> +0, as there
    return t, s, scaled


def quantize_codes(
    x: torch.Tensor, spec: FloatSpec, scale: torch.Tensor, gscale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The format's values for x (same shape): float8_e4m3fn for 8-bit formats, the E2M1 grid
    values (as float32) for FP4; export packs these."""
    with torch.no_grad():
        t, s, scaled = _scaled(x.detach(), spec, scale, gscale)
        q = _untile(_codes(scaled, spec), x, spec)
    return q.to(torch.float8_e4m3fn) if spec.bits == 8 else q.to(torch.float32)


def dequantize_codes(
    q: torch.Tensor, spec: FloatSpec, scale: torch.Tensor, gscale: Optional[torch.Tensor] = None, dtype=torch.float32
) -> torch.Tensor:
    """q * (scale / global scale) in the scale's dtype, then `dtype` (inverse of quantize_codes)."""
    t = _tiles(q, spec)
    s = _broadcast(t, scale, spec)
    if gscale is not None and spec.scale_kind == "e4m3":
        s = s / gscale
    return _untile(t.to(s.dtype) * s, q, spec).to(dtype)


def _kernel_layout(x, spec):
    """(x as [rows, cols], rows per scale, cols per scale) for the kernel: one scale per block."""
    g = spec.granularity
    if g == "block":
        return x, BLOCK[0], BLOCK[1]
    if g in ("tensor", "channel"):
        x2 = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, 1)
        return x2, (x2.shape[0] if g == "tensor" else 1), max(1, x2.shape[1])
    x2 = x.reshape(-1, x.shape[-1])
    return x2, 1, (spec.group_size if g == "group" else max(1, x2.shape[1]))


def _use_kernel(x, backend) -> bool:
    if backend == "reference":
        return False
    from . import kernels

    key = "CUDA" if x.is_cuda else "CPU"
    ok = (
        kernels.available()
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and torch.ops.qcompress.float_fake_quant.default.has_kernel_for_dispatch_key(key)  # type: ignore[arg-type]
        if kernels.available()
        else False
    )
    if backend == "kernel" and not ok:
        raise RuntimeError(f"backend='kernel': no float_fake_quant kernel for {x.dtype} on {x.device}")
    return ok


def _fake_kernel(x, spec, scale, gscale):
    """The csrc kernel (csrc/cpu/floats.cpp, csrc/cuda/floats.cu): same bits as _fake."""
    s = scale.reshape(-1)
    if gscale is not None and spec.scale_kind == "e4m3":
        s = s / gscale
    x2, br, bc = _kernel_layout(x, spec)
    return torch.ops.qcompress.float_fake_quant(x2, s, br, bc, spec.bits).reshape(x.shape)


def _fake(x, spec, scale, gscale, want_mask, backend=None):
    if not want_mask and _use_kernel(x, backend):
        return _fake_kernel(x, spec, scale, gscale), None
    t, s, scaled = _scaled(x, spec, scale, gscale)
    y = _codes(scaled, spec).to(scaled.dtype).to(s.dtype)
    y = y - torch.zeros((), dtype=s.dtype, device=s.device)
    y = _untile(y * s, x, spec).to(x.dtype)
    mask = None
    if want_mask:
        mask = _untile(scaled.abs() <= spec.qmax, x, spec)
    return y, mask


class _FloatSTE(torch.autograd.Function):
    """Straight-through: x^'s gradient passes to x (zeroed where clipped with clip_grad)."""

    @staticmethod
    def forward(ctx, x, spec, scale, gscale, clip_grad, backend):
        y, mask = _fake(x.detach(), spec, scale, gscale, clip_grad, backend)
        ctx.clip = clip_grad
        if clip_grad:
            ctx.save_for_backward(mask)
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.clip:
            (mask,) = ctx.saved_tensors
            grad = grad * mask.to(grad.dtype)
        return grad, None, None, None, None, None


def fake_quantize_float(
    x: torch.Tensor, spec: FloatSpec, *, scale=None, gscale=None, static_range=None, clip_grad=False, backend=None
) -> torch.Tensor:
    """x quantized to spec's format and back (x's shape and dtype), straight-through gradient.
    Scales come from x itself (weights, dynamic activations), from `static_range` or are given.
    backend: None (the kernel when built, else torch), "kernel" or "reference" (plain torch)."""
    if x.numel() == 0:
        return x
    if not torch.is_floating_point(x) or x.dtype == torch.float64:
        raise TypeError(f"{spec.format} fake quantization takes float32/bf16/fp16 tensors, got {x.dtype}")
    if scale is None:
        scale, gscale = qparams(x, spec, gscale, static_range)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FloatSTE.apply(x, spec, scale, gscale, bool(clip_grad), backend)
    with torch.no_grad():
        return _fake(x, spec, scale, gscale, False, backend)[0]


def scale_grid_shape(shape, spec: FloatSpec) -> Tuple[int, ...]:
    """Stored shape of a 2-D weight's scale (what export writes)."""
    rows, cols = shape[0], math.prod(shape[1:])
    return {
        "tensor": (1,),
        "channel": (rows, 1),
        "group": (rows, cols // (spec.group_size or 1)),
        "block": (math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1])),
    }[spec.granularity]
