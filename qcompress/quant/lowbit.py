"""Python side of the fused low-bit matmul kernels: load_quantized(mode="fast") and the fused
QAT forward's `int8_forward` (qcompress/nn/int8_forward.py).

The operators (`torch.ops.qcompress.lowbit_*`, csrc/cpu/lowbit_gemm.cpp and
csrc/cuda/lowbit_gemm.cu) keep a Linear weight in a blocked layout of its integer codes
(csrc/include/qcompress/lowbit.h): 2-bit containers for 1-2-bit weights, 4-bit for 3-4-bit,
8-bit for 5-8-bit,
one scale (and zero point) per row and group of columns, converted once at load from the
exported compressed-tensors tensors and back for `state_dict()`.

- `linear`: float32/bfloat16/float16 activations; the weight is decoded in registers to the exact
  path's float values ((q - zp) * s in fp32, bit for bit), so outputs differ from
  load_quantized(mode="exact") only by summation order.
- `linear_a8`: int8 activation codes (what the exact path's input quantization produces) times
  the weight codes, summed exactly in int32 per group; scales applied once per group and token.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional

import torch

from . import kernels as _kernels

ROWS = 16  # output rows per block
K_ALIGN = 8  # every group is padded to a multiple of 8 columns (2-bit: 16)
MAX_GROUP = 16384  # longest group whose int32 sums cannot overflow (lowbit.h kMaxGroup)
CHUNK = 8192  # rows longer than MAX_GROUP (channel / tensor scales) sum in chunks


def available() -> bool:
    """True when the extension with the low-bit operators is loaded."""
    return _kernels.available() and hasattr(torch.ops.qcompress, "lowbit_linear")


_RUNS_ON: Dict[str, bool] = {}


def runs_on(device: torch.device) -> bool:
    """Whether the operators have kernels for this device type (cached: asked on every call)."""
    ok = _RUNS_ON.get(device.type)
    if ok is None:
        ok = _RUNS_ON[device.type] = _runs_on(device.type)
    return ok


def _runs_on(kind: str) -> bool:
    if not available():
        return False
    if kind == "cpu":
        return True
    # torch's stubs ask for a DispatchKey; the operator takes the key's name as well
    return kind == "cuda" and torch.ops.qcompress.lowbit_linear.default.has_kernel_for_dispatch_key("CUDA")  # type: ignore[arg-type]


_ISA: List[str] = []  # the active instruction set's name, asked once (isa(request) refreshes it)


def isa(request: str = "") -> str:
    """The CPU instruction set the kernels use; `request` switches ("scalar", "avx2", "avx512",
    "avx512_vnni", "amx", or "auto" for the best this CPU has). Also QCOMPRESS_LOWBIT_ISA at start."""
    name = torch.ops.qcompress.lowbit_isa(request)
    _ISA[:] = [name]
    return name


def int8_dot() -> bool:
    """Whether the CPU kernels multiply int8 with dot-product instructions (AVX-512 VNNI or AMX).
    Below them the int8 kernels are slower than an fp32 GEMM at training batch sizes
    (benchmarks/experiments/README.md, `int8_forward_isa.py`), which is what `int8_forward: auto` asks."""
    if not available():
        return False
    if not _ISA:
        isa()
    return _ISA[0] in ("avx512_vnni", "amx")


def container_bits(bits: int) -> int:
    return 2 if bits <= 2 else 4 if bits <= 4 else 8


def kernel_group(strategy: str, group_size: Optional[int], k: int) -> Optional[int]:
    """Columns per scale in the kernel layout, or None when the kernels cannot take the group."""
    if strategy == "group":
        assert group_size is not None  # a "group" strategy names its group size
        return group_size if group_size <= MAX_GROUP else None
    return k if k <= MAX_GROUP else CHUNK


class Packed(NamedTuple):
    packed: torch.Tensor  # uint8 codes, blocked
    scales: torch.Tensor  # float32 [Nb * ng * 16]
    offsets: torch.Tensor  # uint8 [Nb * ng * 16] (empty: symmetric)


def prepack(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group: int, cbits: int) -> Packed:
    """Signed codes q [N, K], scale / zero point [N, ceil(K / group)] -> the blocked layout."""
    return Packed(*torch.ops.qcompress.lowbit_prepack(q.to(torch.int8).contiguous(), scale, zero_point, group, cbits))


def prepack_rows(
    q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group: int, cbits: int
) -> Packed:
    """prepack with scale / zero point [N, 1] (one per row: tensor / channel strategies, summed in
    groups of `group` columns) or [N, ceil(K / group)]."""
    n, ng = q.shape[0], -(-q.shape[1] // group)
    if scale.shape[1] != ng:
        scale = scale.expand(n, ng)
        zero_point = None if zero_point is None else zero_point.expand(n, ng)
    return prepack(q, scale.contiguous(), None if zero_point is None else zero_point.contiguous(), group, cbits)


def unpack(p: Packed, n: int, k: int, group: int, cbits: int):
    """(q int8 [N, K], scale [N, ng] fp32, zero point int32 [N, ng] or None) from the layout."""
    q = torch.ops.qcompress.lowbit_unpack(p.packed, n, k, group, cbits)
    ng = math.ceil(k / group)

    def rows(t):
        return t.reshape(-1, ng, ROWS).transpose(1, 2).reshape(-1, ng)[:n]

    zp = None if p.offsets.numel() == 0 else rows(p.offsets).to(torch.int32) - (1 << (cbits - 1))
    return q, rows(p.scales), zp


def linear(
    x: torch.Tensor,
    p: Packed,
    bias: Optional[torch.Tensor],
    n: int,
    group: int,
    cbits: int,
    act: str = "none",
    residual: Optional[torch.Tensor] = None,
):
    """act(x @ W^T + bias) + residual; act "gelu" (erf), "gelu_tanh", "silu" (within 2e-6 |x| of
    torch's) or "relu" is applied to each output before it is stored, and so is the residual (a
    tensor of the output's shape) added, for float32 inputs, in the kernels' store."""
    return torch.ops.qcompress.lowbit_linear(x, p.packed, p.scales, p.offsets, bias, n, group, cbits, act, residual)


def linear_a8(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    x_zero_point: Optional[torch.Tensor],
    p: Packed,
    bias: Optional[torch.Tensor],
    n: int,
    group: int,
    cbits: int,
    out_dtype: torch.dtype,
):
    return torch.ops.qcompress.lowbit_linear_a8(
        xq, x_scale, x_zero_point, p.packed, p.scales, p.offsets, bias, n, group, cbits, out_dtype
    )


def linear_dyn_a8(
    x: torch.Tensor,
    p: Packed,
    bias: Optional[torch.Tensor],
    n: int,
    group: int,
    cbits: int,
    abits: int,
    symmetric: bool,
    seed: int,
    act: str = "none",
    residual: Optional[torch.Tensor] = None,
):
    """linear_a8 on x's dynamic per-token codes (the quantize op's, nearest rounding), one C++ call;
    act and residual as linear's (act, then + residual)."""
    return torch.ops.qcompress.lowbit_linear_dyn_a8(
        x, p.packed, p.scales, p.offsets, bias, n, group, cbits, abits, symmetric, seed, act, residual
    )


# --- fake (meta) kernels: the operators are opaque to torch.compile ------------------------------


def _geometry(n: int, k: int, group: int, cbits: int):
    ng = -(-k // group)
    align = 2 * K_ALIGN if cbits == 2 else K_ALIGN
    gp = -(-group // align) * align
    nb = -(-n // ROWS)
    return nb, ng, nb * (ng * gp * cbits // 8) * ROWS


if available():

    @torch.library.register_fake("qcompress::lowbit_prepack")
    def _fake_prepack(q, scale, zero_point, group, cbits):
        n, k = q.shape
        nb, ng, nbytes = _geometry(n, k, group, cbits)
        params = nb * ng * ROWS
        return (
            q.new_empty((nbytes,), dtype=torch.uint8),
            q.new_empty((params,), dtype=torch.float32),
            q.new_empty((params if zero_point is not None else 0,), dtype=torch.uint8),
        )

    @torch.library.register_fake("qcompress::lowbit_unpack")
    def _fake_unpack(packed, n, k, group, cbits):
        return packed.new_empty((n, k), dtype=torch.int8)

    @torch.library.register_fake("qcompress::lowbit_linear")
    def _fake_linear(x, packed, scales, offsets, bias, n, group, cbits, act="none", residual=None):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("qcompress::lowbit_linear_a8")
    def _fake_linear_a8(xq, x_scale, x_zero_point, packed, scales, offsets, bias, n, group, cbits, out_dtype):
        return xq.new_empty((*xq.shape[:-1], n), dtype=out_dtype)

    @torch.library.register_fake("qcompress::lowbit_linear_dyn_a8")
    def _fake_linear_dyn_a8(
        x, packed, scales, offsets, bias, n, group, cbits, abits, symmetric, seed, act="none", residual=None
    ):
        return x.new_empty((*x.shape[:-1], n))
