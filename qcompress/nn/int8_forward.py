"""Integer forward of the fused compress-aware Linear / Conv1D (`int8_forward: true` or `auto`).

With quantized activations the forward's product x^ @ w^.T is a product of integer codes:
x^ = (qx - zx) * sx per token (or per tensor) and w^ = (qw - zw) * sw per row and group. The
float path multiplies the dequantized copies in fp32 (or autocast's dtype) with a GEMM's
rounding; this path hands the codes to the low-bit kernel of the exported model's fast mode
(`lowbit_linear_a8`: exact int32 sums per group, the scales applied once per group and token)
and writes the result in the op's dtype. So the training forward computes what
`load_quantized(..., mode="fast")` will compute on the exported checkpoint, and on CPUs with
VNNI / AMX it is cheaper than the fp32 GEMM at training batch sizes
(benchmarks/experiments/README.md, `int8_forward_isa.py`).

The values differ from the float path's only by that path's own rounding (the integer sums are
exact); backward is unchanged (it dequantizes the same codes and recomputes w^), so each layer's
gradients given its output gradient are the float path's bit for bit, and the network's differ
by what the forward's rounding changed. Off in a config that does not ask for it, for that
reason: that fused path stays bit for bit the unfused one.

Applies on CPU (the CUDA kernel of that op is a correctness kernel, slower than cuBLAS) to Linear
and transformers Conv1D with int weights of 2-8 bits (default numerics, nearest rounding) per
tensor, channel or row group; elsewhere the float forward runs (`reason()` says why).
`int8_forward: auto` (the W8A8 / W4A8 recipes') asks for it in training mode only, and only where
the kernels have int8 dot products (AVX-512 VNNI or AMX): with AVX2 or plain AVX-512 the int8 kernel
is slower than the fp32 GEMM at training batch sizes (benchmarks/experiments/README.md,
`int8_forward_isa.py`), so there the float forward runs. Eval-mode
forwards keep the float path, so the trained model in eval mode equals the exact reload of its
export bit for bit, as with `false`; `true` runs the integer forward in both modes (and the model
then equals the fast reload).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quant import lowbit


def enabled(aq, training: bool = True) -> bool:
    """Whether an activation quantizer's setting asks for the integer forward on this machine, for
    a module in training (`training`) or eval mode: `true` always; `auto` in training mode where
    the CPU kernels have int8 dot products (eval-mode forwards keep the float path, which the
    exact reload of the export reproduces bit for bit)."""
    setting = getattr(aq, "int8_forward", False)
    return setting is True or (setting == "auto" and training and lowbit.int8_dot())


def reload_mode(model) -> str:
    """The `load_quantized` mode whose kernels compute what this model's eval-mode forward
    computes: "fast" when a module runs the integer forward in eval mode (`int8_forward: true`;
    the exact reload differs from it by the float GEMM's rounding), else "exact"."""
    if _device(model) != "cpu":
        return "exact"  # the integer forward runs on CPU only
    return "fast" if any(enabled(getattr(m, "qc_aq", None), training=False) for m in model.modules()) else "exact"


def _device(model) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


def describe(model) -> Optional[str]:
    """One line on which forward this model's int8_forward setting gives on this machine (None
    when no module asks for the integer forward)."""
    settings = {
        getattr(m.qc_aq, "int8_forward", False) for m in model.modules() if getattr(m, "qc_aq", None) is not None
    }
    settings.discard(False)
    if not settings:
        return None
    said = "/".join(sorted(str(v).lower() for v in settings))
    isa = lowbit.isa() if lowbit.available() else "none (extension not built)"
    if _device(model) != "cpu":
        return f"int8_forward {said}: the float forward runs (the model is on {_device(model)})"
    if reload_mode(model) == "fast":
        return f"int8_forward {said}: CPU Linear / Conv1D forwards multiply the integer codes (low-bit kernels: {isa})"
    if any(enabled(getattr(m, "qc_aq", None)) for m in model.modules()):
        return (
            f"int8_forward {said}: training forwards multiply the integer codes (low-bit kernels: "
            f"{isa}); eval-mode forwards run the float path, as the exact reload of the export does"
        )
    return f"int8_forward {said}: the float forward runs (low-bit kernels: {isa}, no int8 dot products)"


def reason(mod, op: str, weight_mode: str, weight_spec, act_spec) -> Optional[str]:
    """Why the integer forward cannot run for this module's settings (None: it can)."""
    if mod.weight.device.type != "cpu":
        return "the integer forward runs on the CPU (the CUDA kernel of that op is slower than cuBLAS)"
    if op not in ("linear", "hf_conv1d"):
        return "convolutions keep the float forward"
    if act_spec is None:
        return "no activation codes (weight-only)"
    if weight_mode != "fake_quant":
        return "the weight is not quantized in forward"
    if "qc_lora" in mod.__dict__:
        return "a LoRA adapter: the quantized weight is the merged one, made in the float forward"
    ws = weight_spec
    if ws.kind != "int" or ws.bits > 8 or ws.numerics != "default" or ws.rounding != "nearest":
        return f"weights {ws.bits}-bit {ws.kind}/{ws.numerics}/{ws.rounding}: the kernel takes int 2-8 bit, nearest"
    if act_spec.numerics != "default":
        return "activation numerics other than default"
    if ws.granularity == "group":
        k = mod.weight_matrix_view(mod.weight).shape[1]
        if ws.num_groups is not None or not ws.group_size or k % ws.group_size:
            return "groups that do not tile each row"
    elif ws.granularity not in ("tensor", "channel"):
        return f"weight granularity {ws.granularity!r}"
    if not lowbit.available():
        return "the extension is not built"
    return None


def _weight_layout(mod, weight: torch.Tensor):
    """The weight's codes for this forward in the kernel's blocked layout, or None when they do
    not fit it (zero points outside the container's range)."""
    q, s, z, spec = mod.quantized_weight(weight)
    n, k = q.shape
    group = lowbit.kernel_group(spec.granularity, spec.group_size, k)
    if group is None:
        return None
    s = s.to(torch.float32).reshape(n, -1) if s.numel() > 1 else s.to(torch.float32).reshape(1, 1).expand(n, 1)
    if s.shape[1] not in (1, -(-k // group)):
        return None
    cbits = lowbit.container_bits(spec.bits)
    if z is not None:
        z = (z.reshape(n, -1) if z.numel() > 1 else z.reshape(1, 1).expand(n, 1)).to(torch.int32)
        lo, hi = z.aminmax()
        if int(lo) < -(1 << (cbits - 1)) or int(hi) >= (1 << (cbits - 1)):
            return None
    return lowbit.prepack_rows(q.to(torch.int8), s, z, group, cbits), n, group, cbits


def run(mod, x: torch.Tensor, weight: torch.Tensor, bias, q, s, z, out_dtype) -> Optional[torch.Tensor]:
    """op(x^, w^) + b from the codes, in out_dtype; None where the float forward has to run."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    k = q.shape[-1]
    m = q.numel() // max(k, 1)
    if s.numel() not in (1, m) or (z is not None and z.numel() not in (1, m)):
        return None  # per-sample scales of 3-D inputs: not one per token
    with torch.no_grad():
        layout = _weight_layout(mod, weight)
        if layout is None:
            return None
        packed, n, group, cbits = layout
        zx = None if z is None else z.reshape(-1).to(torch.int32)
        y = lowbit.linear_a8(
            q.reshape(m, k),
            s.reshape(-1).to(torch.float32),
            zx,
            packed,
            None if bias is None else bias.detach(),
            n,
            group,
            cbits,
            out_dtype,
        )
    return y.reshape(*q.shape[:-1], n)
