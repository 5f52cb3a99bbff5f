"""Bridge to the fused csrc/ kernels (the `qcompress._C` extension).

Same functions as :mod:`qcompress.quant.reference` (`fake_quantize_with_mask`, `quantize`,
`dequantize`), :mod:`qcompress.quant.packing` (`pack_int32`, `unpack_int32`) and
:mod:`qcompress.quant.onebit` (`onebit_compress`, `onebit_decode_average`), with the same bits.
The operators live in the `torch.ops.qcompress` namespace with fake (meta) kernels registered
here, so `torch.compile` treats them as opaque custom ops.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Optional, Tuple

import torch  # must be imported before the extension (libc10)

from ..errors import NonFiniteError
from . import onebit as _onebit
from . import packing as _packing
from . import reference, stepped
from .reference import Spec

_error: Optional[str] = None
_has_cuda = False
try:
    if os.environ.get("QCOMPRESS_PURE_PYTHON") == "1":  # asked for by name: even a built extension stays unused
        raise ImportError("QCOMPRESS_PURE_PYTHON=1 asks for the pure-torch reference paths")
    from .. import _C  # noqa: F401  (registers torch.ops.qcompress.*)

    # torch's stubs ask for a DispatchKey; the operator takes the key's name as well
    _has_cuda = torch.ops.qcompress.fake_quant.default.has_kernel_for_dispatch_key("CUDA")  # type: ignore[arg-type]
except Exception as exc:  # noqa: BLE001 - any load failure means "use the reference"
    _error = f"{type(exc).__name__}: {exc}"

if _has_cuda and os.environ.get("QCOMPRESS_CUDA_SYNC_CHECKS", "") == "1":
    torch.ops.qcompress.cuda_sync_checks(True)

_cache_mb = os.environ.get("QCOMPRESS_CPU_CACHE_MB", "").strip()
if _cache_mb and not _cache_mb.lstrip("-").isdigit():
    warnings.warn(
        f"QCOMPRESS_CPU_CACHE_MB={_cache_mb!r} is not a whole number of MB; the kernels keep "
        "the default 512 MB of reusable output blocks (0 turns the cache off)",
        stacklevel=2,
    )

_KIND = {"int": 0, "binary": 1, "ternary": 2}
_NONFINITE = "qcompress.NonFiniteError: "
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """True when the compiled operators loaded."""
    return _error is None


def load_error() -> str:
    """Why the extension did not load ('' when it did)."""
    return _error or ""


def _ops():
    if _error is not None:
        raise RuntimeError(f"qcompress kernels are not available: {_error}")
    return torch.ops.qcompress


def on_kernel_device(*tensors) -> bool:
    """True when every tensor lives where a built kernel runs (CPU, or CUDA in a CUDA build)."""
    for t in tensors:  # a loop, not all(genexpr): this runs several times per layer call
        if not (t.is_cpu or (_has_cuda and t.is_cuda)):
            return False
    return True


def cuda_sync_checks(on: bool) -> bool:
    """Whether each CUDA quantizer call checks for NaN/Inf itself (one device sync per call, the
    error raised at the call that met them) instead of counting them for check_nonfinite();
    returns the previous setting. Off by default; QCOMPRESS_CUDA_SYNC_CHECKS=1 turns it on."""
    return bool(torch.ops.qcompress.cuda_sync_checks(bool(on))) if _has_cuda else False


def check_nonfinite() -> None:
    """Raise NonFiniteError when a CUDA quantizer met NaN/Inf since the last check (the count is
    then reset). The CPU kernels and the reference raise at the call itself; the CUDA kernels
    count instead, because reading the count back syncs the GPU (benchmarks/results/gpu.md).
    CompressionScheduler.step, export_quantized and the train job's evaluate() call this."""
    if not _has_cuda or not torch.cuda.is_initialized():
        return
    for dev in range(torch.cuda.device_count()):
        n = int(torch.ops.qcompress.cuda_nonfinite_take(dev))
        if n:
            raise NonFiniteError(
                f"{n} quantization groups on cuda:{dev} contained NaN or Inf values since the "
                "last check (the last optimizer step); the run has diverged or its input holds "
                "NaN/Inf: fix it, or set QCOMPRESS_CUDA_SYNC_CHECKS=1 to stop at the call"
            )


def _call(op, *args):
    """Run an op, turning the kernels' NaN/Inf report into NonFiniteError."""
    try:
        return op(*args)
    except RuntimeError as exc:
        msg = str(exc)
        if _NONFINITE in msg:
            detail = msg.split(_NONFINITE, 1)[1].splitlines()[0]
            raise NonFiniteError(detail) from None
        raise


# --- layout: every granularity is x viewed as [rows, cols] with groups of `group` along cols ----


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() >= 2 else 1


def layout(x: torch.Tensor, spec: Spec) -> Tuple[int, int, int]:
    """(rows, cols, group) of reference.group_view; group 0 for a zero-width view."""
    n = x.numel()
    g = spec.granularity
    if g == "tensor":
        return 1, n, n
    if g == "channel":
        rows = _rows(x)
        cols = n // rows if rows else 0
        return rows, cols, cols
    if g == "token":
        cols = x.shape[-1] if x.dim() else 1
        rows = math.prod(x.shape[:-1]) if x.dim() else 1
        return rows, cols, cols
    if g == "groups":
        groups = spec.num_groups
        assert groups is not None  # make_spec sets it with granularity "groups"
        if n % groups:
            raise ValueError(f"num_groups={groups} does not divide the tensor's {n} elements (shape {tuple(x.shape)})")
        cols = n // groups
        return groups, cols, cols
    rows = _rows(x)
    cols = n // rows if rows else 0
    assert spec.group_size is not None  # granularity "group"
    return rows, cols, spec.group_size


def _args(x: torch.Tensor, spec: Spec, min_val, max_val, unmixed: bool = False):
    rows, cols, group = layout(x, spec)
    rng = None
    if min_val is not None and spec.kind == "int":
        rng = torch.stack(
            [
                torch.as_tensor(min_val, dtype=torch.float32).reshape(()),
                torch.as_tensor(max_val, dtype=torch.float32).reshape(()),
            ]
        ).to(x.device)
    return (
        rng,
        rows,
        cols,
        group,
        spec.bits,
        _KIND[spec.kind],
        spec.symmetric,
        spec.numerics == "deepspeed",
        1 if spec.rounding == "stochastic" else 0,
        spec.seed & 0xFFFFFFFF if unmixed else _int_seed(spec),
    )


def _int_seed(spec: Spec) -> int:
    """The ops' int seed; a step tensor (compiled stochastic rounding) only the fake_quant op takes."""
    if spec.step is not None:
        raise ValueError(
            "a stochastic-rounding Spec with a step tensor reaches only the fake_quant op "
            "(quant/stepped.py); give this call the mixed int seed (rng.mix_seed)"
        )
    return spec.seed & 0xFFFFFFFF


def _prep(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x if x.dtype in _FLOATS else x.to(torch.float32)


# --- the reference's functions ---------------------------------------------------------------


def _params_kernel(x: torch.Tensor, spec: Spec, params) -> bool:
    """Whether the given-parameters kernels take this call (else the reference does)."""
    s = params[0]
    return (
        spec.kind == "int"
        and spec.numerics == "default"
        and x.numel() > 0
        and on_kernel_device(x, s)
        and s.device == x.device
    )


def _group_params(x: torch.Tensor, spec: Spec, params):
    groups = reference.num_groups(x, spec)
    return reference.flat_params(params[0], params[1], groups, x.device)


def fake_quantize_with_mask(x: torch.Tensor, spec: Spec, min_val=None, max_val=None, *, with_mask=True, params=None):
    """(x^ in x's dtype, bool mask of elements that were not clipped), as the reference.

    with_mask=False skips writing the mask (returns an empty one): less memory traffic when
    no clip-aware gradient needs it. `params` = (scale, zero point or None): given per-group
    parameters (reference.quantize_view); integer kinds run the fake_quant_params kernel.
    """
    if params is not None:
        if not _params_kernel(x, spec, params):
            return reference.fake_quantize_with_mask(x, spec, min_val, max_val, params)
        xk = _prep(x)
        s, z = _group_params(xk, spec, params)
        if (z is None) != spec.symmetric:
            raise ValueError("give a zero point exactly when the spec is asymmetric")
        rows, cols, group = layout(xk, spec)
        y, mask = _ops().fake_quant_params(
            xk,
            s,
            z,
            rows,
            cols,
            group,
            spec.bits,
            1 if spec.rounding == "stochastic" else 0,
            _int_seed(spec),
            with_mask,
        )
        return (y if y.dtype == x.dtype else y.to(x.dtype)), mask  # the ops' outputs have x's shape
    if not on_kernel_device(x) or x.numel() == 0:  # empty: nothing to run, shapes from the reference
        return reference.fake_quantize_with_mask(x, spec, min_val, max_val)
    xk = _prep(x)
    if spec.step is not None:  # compiled stochastic rounding: the step is a graph input
        rng, rows, cols, group, bits, kind, sym, ds, _, seed = _args(xk, spec, min_val, max_val, unmixed=True)
        y, mask = _call(stepped.fake_quant, xk, rng, spec.step, rows, cols, group, bits, kind, sym, ds, seed, with_mask)
    else:
        y, mask = _call(_ops().fake_quant, xk, *_args(xk, spec, min_val, max_val), with_mask)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), mask


def _takes(x: torch.Tensor) -> bool:
    """Whether the quantizer ops run on x as it is: kernels built, a non-empty float tensor on a
    kernel device (the fused layers' direct calls; the general wrappers convert or fall back)."""
    return _error is None and x.dtype in _FLOATS and x.numel() > 0 and on_kernel_device(x)


def prepared_args(x: torch.Tensor, spec: Spec):
    """The fake_quant op's arguments for tensors of x's shape, dtype and device quantized with spec
    and their own ranges, or None where fake_quantize would not call that op (see fake_quantize_prepared)."""
    if not _takes(x):
        return None
    return _args(x, spec, None, None)


def fake_quantize_prepared(x: torch.Tensor, args) -> torch.Tensor:
    """fake_quantize(x, spec) with args = prepared_args(x, spec) made earlier: the fused layers call
    this twice per step for each weight (forward and backward), whose layout does not change."""
    return _call(_ops().fake_quant, x.detach(), *args, False)[0]


def fake_quantize(x: torch.Tensor, spec: Spec, min_val=None, max_val=None, params=None) -> torch.Tensor:
    """x^ only (no clip mask written)."""
    return fake_quantize_with_mask(x, spec, min_val, max_val, with_mask=False, params=params)[0]


def lsq_backward(grad: torch.Tensor, x: torch.Tensor, spec: Spec, scale: torch.Tensor, zero_point=None):
    """As reference.lsq_backward (integer kinds in one fused pass; binary/ternary by the reference)."""
    if not _params_kernel(x, spec, (scale, zero_point)) or not on_kernel_device(grad) or grad.device != x.device:
        return reference.lsq_backward(grad, x, spec, scale, zero_point)
    xk = _prep(x)
    g = grad if grad.dtype in _FLOATS else grad.to(torch.float32)
    s, z = _group_params(xk, spec, (scale, zero_point))
    rows, cols, group = layout(xk, spec)
    gx, gs, gz = _ops().lsq_backward(
        g.detach(), xk, s, z, rows, cols, group, spec.bits, 1 if spec.rounding == "stochastic" else 0, _int_seed(spec)
    )
    gx = gx.reshape(grad.shape)
    if gx.dtype != grad.dtype:
        gx = gx.to(grad.dtype)
    return gx, gs, (gz if z is not None else None)


def mse_errors(x: torch.Tensor, spec: Spec, scales: torch.Tensor, zero_points=None, moments=None):
    """float64 [K, groups]: squared reconstruction error of x's groups under each of K candidate
    (scale, zero point) rows (the mse observer's search in one fused pass per candidate), or with
    `moments` (float64 [blocks, b, b], observers.input_weighting's layout) the input-weighted
    error d^T M d; None when no kernel runs here (CUDA tensors: the reference's vectorized search
    is fast there)."""
    if _error is not None or x.device.type != "cpu" or spec.kind != "int" or x.numel() == 0:
        return None
    xk = _prep(x)
    rows, cols, group = layout(xk, spec)
    if moments is not None:
        moments = moments.to(device=xk.device, dtype=torch.float64).contiguous()
    return _ops().mse_errors(
        xk,
        scales.to(torch.float32).contiguous(),
        None if zero_points is None else zero_points.to(torch.float32).contiguous(),
        rows,
        cols,
        group,
        spec.bits,
        moments,
    )


def mse_refine_terms(x: torch.Tensor, spec: Spec, scales: torch.Tensor, moments=None):
    """(<q, x>, <q, q>, <d, d>) per group, float64, for symmetric scales (float32 [groups]): the
    codes q = clamp(round(x / s)), d = q s - x, in the input-weighted inner product of `moments`
    (as mse_errors) or the plain one: the mse observer's least-squares refinement in one pass. None
    when no kernel runs here."""
    if _error is not None or x.device.type != "cpu" or spec.kind != "int" or not spec.symmetric or x.numel() == 0:
        return None
    xk = _prep(x)
    rows, cols, group = layout(xk, spec)
    if moments is not None:
        moments = moments.to(device=xk.device, dtype=torch.float64).contiguous()
    return _ops().mse_refine_terms(xk, scales.to(torch.float32).contiguous(), rows, cols, group, spec.bits, moments)


def quantize(x: torch.Tensor, spec: Spec, min_val=None, max_val=None, params=None):
    """(q, scale, zero_point) as reference.quantize (given `params`: by the reference, which
    computes the same codes as fake_quant_params)."""
    if params is not None or not on_kernel_device(x) or x.numel() == 0:
        return reference.quantize(x, spec, min_val, max_val, params)
    xk = _prep(x)
    q, s, zp = _call(_ops().quantize, xk, *_args(xk, spec, min_val, max_val))
    shape = reference.scale_shape(x, spec)
    zp = zp.reshape(shape) if (spec.kind == "int" and not spec.symmetric) else None
    return q, s.reshape(shape), zp  # q has x's shape


def quantize_values(x: torch.Tensor, spec: Spec, min_val=None, max_val=None):
    """(q, scale, zero_point, x^): quantize's codes and parameters and fake_quantize's values, from
    one pass over x; None where the kernel does not take x (the caller then quantizes and
    dequantizes). The fused layers' forward: the op multiplies x^, backward keeps the codes."""
    if not _takes(x):
        return None
    xk = x.detach()
    q, s, zp, y = _call(_ops().quantize_values, xk, *_args(xk, spec, min_val, max_val))
    shape = reference.scale_shape(x, spec)
    zp = zp.reshape(shape) if (spec.kind == "int" and not spec.symmetric) else None
    return q, s.reshape(shape), zp, y  # q and y have x's shape


def _broadcast_layout(q: torch.Tensor, scale: torch.Tensor, zero_point):
    """(rows, cols) when scale (and zero point) broadcast as one value per leading index block."""
    if scale.dim() > q.dim():
        return None
    sshape = (1,) * (q.dim() - scale.dim()) + tuple(scale.shape)
    d = 0
    for i, v in enumerate(sshape):
        if v != 1:
            d = i + 1
    if tuple(sshape[:d]) != tuple(q.shape[:d]) or any(v != 1 for v in sshape[d:]):
        return None
    if zero_point is not None and tuple(zero_point.shape) != tuple(scale.shape):
        return None
    rows = math.prod(q.shape[:d])
    return rows, (q.numel() // rows if rows else 0)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point=None, *, group_size=None, num_groups=None, dtype=torch.float32
) -> torch.Tensor:
    """x^ = (q - zero_point) * scale, as reference.dequantize."""
    simple = (
        not q.is_floating_point()
        and q.dtype != torch.bool
        and q.numel() > 0
        and dtype in _FLOATS + (torch.float64,)
        and on_kernel_device(q, scale)
        and scale.device == q.device
        and (zero_point is None or zero_point.device == q.device)
    )
    lay = None
    if simple:
        if num_groups is not None:
            if q.numel() % num_groups == 0:
                cols = q.numel() // num_groups
                lay = (num_groups, cols, cols)
        elif group_size is not None:
            rows = _rows(q)
            lay = (rows, q.numel() // rows, group_size)
        else:
            rc = _broadcast_layout(q, scale, zero_point)
            if rc is not None:
                lay = (rc[0], rc[1], rc[1])
    if lay is None or scale.numel() != lay[0] * max(1, math.ceil(lay[1] / lay[2])):
        return reference.dequantize(q, scale, zero_point, group_size=group_size, num_groups=num_groups, dtype=dtype)
    s = scale.to(torch.float32).reshape(-1)
    z = None if zero_point is None else zero_point.to(torch.float32).reshape(-1)
    return _ops().dequantize(q, s, z, *lay, dtype)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero_point, spec: Spec, dtype) -> Optional[torch.Tensor]:
    """x^ of codes `quantize(x, spec)` returned (scale and zero point as it shaped them), in one kernel
    call with the layout taken from spec: the fused layers' hot path, which skips dequantize's layout
    inference. None where the kernel does not take it (the caller then runs dequantize)."""
    if (
        _error is not None
        or dtype not in _FLOATS
        or not on_kernel_device(q)
        or scale.device != q.device
        or q.numel() == 0
        or scale.dtype != torch.float32
    ):
        return None
    z = None if zero_point is None else zero_point.reshape(-1).to(torch.float32)
    return _ops().dequantize(q, scale.reshape(-1), z, *layout(q, spec), dtype)


def ste_backward(grad: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """grad * inside.to(grad.dtype) in one pass (clip-aware straight-through gradient)."""
    if (
        not on_kernel_device(grad, inside)
        or grad.device != inside.device
        or grad.shape != inside.shape
        or grad.dtype not in _FLOATS + (torch.float64,)
    ):
        return grad * inside.to(grad.dtype)
    return _ops().ste_backward(grad, inside)


def pack_int32(q: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """As packing.pack_int32."""
    _packing._check_bits(bits)
    if q.dim() == 0 or q.is_floating_point() or q.dtype == torch.bool or not on_kernel_device(q):
        return _packing.pack_int32(q, bits, dim)
    out = _ops().pack_int32(q.movedim(dim, -1), bits)
    return out.movedim(-1, dim)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = -1) -> torch.Tensor:
    """As packing.unpack_int32."""
    _packing._check_bits(bits)
    if packed.dim() == 0 or packed.dtype != torch.int32 or not on_kernel_device(packed):
        return _packing.unpack_int32(packed, bits, length, dim)
    p = packed.movedim(dim, -1)
    length = max(0, min(int(length), p.shape[-1] * (32 // bits)))
    return _ops().unpack_int32(p, bits, length).movedim(-1, dim)


def onebit_compress(x: torch.Tensor, error: torch.Tensor):
    """As onebit.compress: (packed uint8 [n/8], scale float32 0-d, new_error float32 [n])."""
    if x.numel() % 8:
        raise ValueError(f"packbits needs a multiple of 8 elements, got {x.numel()}")
    if not on_kernel_device(x, error) or x.device != error.device:
        return _onebit.compress(x, error)
    xk = _prep(x)
    err = error.detach()
    if err.dtype != torch.float32:
        err = err.to(torch.float32)
    return _ops().onebit_compress(xk, err)


def onebit_decode_average(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """As onebit.decode_average: packed uint8 [P, m], scales [P] -> float32 [8 m]."""
    if not on_kernel_device(packed, scales) or packed.dtype != torch.uint8 or packed.dim() != 2:
        return _onebit.decode_average(packed, scales)
    return _ops().onebit_decode_average(packed, scales.to(torch.float32))


def onebit_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [P, m], scales [P] -> float32 [P, 8 m], row r = onebit.decode(packed[r], scales[r]).

    Rows may be a view with a row stride (e.g. payload rows without their trailing scale bytes).
    """
    if _error is not None or not on_kernel_device(packed, scales) or packed.dtype != torch.uint8 or packed.dim() != 2:
        return (
            torch.stack([_onebit.decode(packed[r], scales[r]) for r in range(packed.shape[0])])
            if packed.shape[0]
            else packed.new_empty((0, 8 * packed.shape[-1]), dtype=torch.float32)
        )
    return _ops().onebit_decode(packed, scales.to(torch.float32))


# --- fake (meta) kernels: opaque custom ops under torch.compile (autograd: csrc/autograd.cpp) ---

if _error is None:

    @torch.library.register_fake("qcompress::onebit_decode")
    def _fake_onebit_decode(packed, scales):
        return packed.new_empty((packed.shape[0], 8 * packed.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("qcompress::fake_quant")
    def _fake_fake_quant(x, rng, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed, with_mask):
        mask = x.new_empty(x.shape if with_mask else (0,), dtype=torch.bool)
        return torch.empty_like(x, memory_format=torch.contiguous_format), mask

    @torch.library.register_fake("qcompress::quantize")
    def _fake_quantize(x, rng, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed):
        ngr = max(1, -(-cols // group)) if group else 1
        small = (bits <= 8) and not (deepspeed and not symmetric and bits == 8)
        q = x.new_empty(x.shape, dtype=torch.int8 if small else torch.int32)
        return q, x.new_empty((rows * ngr,), dtype=torch.float32), x.new_empty((rows * ngr,), dtype=torch.int32)

    @torch.library.register_fake("qcompress::quantize_values")
    def _fake_quantize_values(x, rng, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed):
        q, s, z = _fake_quantize(x, rng, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed)
        return q, s, z, torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("qcompress::dequantize")
    def _fake_dequantize(q, scale, zero_point, rows, cols, group, dtype):
        return q.new_empty(q.shape, dtype=dtype)

    @torch.library.register_fake("qcompress::fake_quant_params")
    def _fake_fake_quant_params(x, scale, zero_point, rows, cols, group, bits, rounding, seed, with_mask):
        mask = x.new_empty(x.shape if with_mask else (0,), dtype=torch.bool)
        return torch.empty_like(x, memory_format=torch.contiguous_format), mask

    @torch.library.register_fake("qcompress::lsq_backward")
    def _fake_lsq_backward(grad, x, scale, zero_point, rows, cols, group, bits, rounding, seed):
        groups = scale.numel()
        return (
            torch.empty_like(grad, memory_format=torch.contiguous_format),
            x.new_empty((groups,), dtype=torch.float32),
            x.new_empty((groups if zero_point is not None else 0,), dtype=torch.float32),
        )

    @torch.library.register_fake("qcompress::mse_errors")
    def _fake_mse_errors(x, scales, zero_points, rows, cols, group, bits, moments=None):
        return scales.new_empty(scales.shape, dtype=torch.float64)

    @torch.library.register_fake("qcompress::mse_refine_terms")
    def _fake_mse_refine_terms(x, scales, rows, cols, group, bits, moments=None):
        return tuple(scales.new_empty(scales.shape, dtype=torch.float64) for _ in range(3))

    @torch.library.register_fake("qcompress::ste_backward")
    def _fake_ste_backward(grad, mask):
        return torch.empty_like(grad, memory_format=torch.contiguous_format)

    @torch.library.register_fake("qcompress::pack_int32")
    def _fake_pack(q, bits):
        per = 32 // bits
        return q.new_empty((*q.shape[:-1], -(-q.shape[-1] // per)), dtype=torch.int32)

    @torch.library.register_fake("qcompress::unpack_int32")
    def _fake_unpack(packed, bits, length):
        return packed.new_empty((*packed.shape[:-1], length), dtype=torch.int8)

    @torch.library.register_fake("qcompress::onebit_compress")
    def _fake_onebit_compress(x, error):
        n = x.numel()
        return (
            x.new_empty((n // 8,), dtype=torch.uint8),
            x.new_empty((), dtype=torch.float32),
            x.new_empty((n,), dtype=torch.float32),
        )

    @torch.library.register_fake("qcompress::float_gemv")
    def _fake_float_gemv(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("qcompress::onebit_decode_average")
    def _fake_decode_average(packed, scales):
        return packed.new_empty((8 * packed.shape[1],), dtype=torch.float32)
