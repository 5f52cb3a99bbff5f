"""load_quantized(mode="fast") for the model's unquantized float nn.Linear layers, an LLM's
lm_head above all: at up to MAX_TOKENS tokens on the CPU they run qcompress's few-token float
kernel (csrc/cpu/float_gemv.cpp), elsewhere torch's matmul. In a W4 model's decode step the float
lm_head reads more bytes than every quantized layer together, and torch's CPU matmul reads them at
a half (float32) to a third (bfloat16) of memory bandwidth at one token. The kernel multiplies and
sums in float32 and rounds once to the layer's dtype, as torch does; only the order of the sums
differs. Parameters, state_dict and autograd stay nn.Linear's: a call that needs gradients takes
torch's path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...quant import kernels as _kernels
from .. import quantized

MAX_TOKENS = 8  # above it torch's GEMM wins in bfloat16 (benchmarks/experiments/float_gemv.py)
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return _kernels.available() and hasattr(torch.ops.qcompress, "float_gemv")


def takes(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether the few-token kernel runs this call (CPU, one float dtype, no gradient asked)."""
    grads = (x, weight) if bias is None else (x, weight, bias)
    return (
        x.is_cpu
        and weight.is_cpu
        and x.dtype == weight.dtype
        and weight.dtype in DTYPES
        and x.dim() >= 1
        and x.numel() <= MAX_TOKENS * x.shape[-1]
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in grads))
    )


class FastFloatLinear(nn.Linear):
    """nn.Linear whose few-token CPU calls run the float GEMV kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(x, self.weight, self.bias):
            return torch.ops.qcompress.float_gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def convert(root: nn.Module, modules=None, options=None) -> int:
    """Give every plain nn.Linear of `root` (not a quantized or otherwise specialised subclass) the
    few-token kernel; returns how many. Nothing changes without the compiled extension."""
    if not available():
        return 0
    count = 0
    for mod in root.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = FastFloatLinear
            count += 1
    return count


quantized.register_load_step("fast", convert)
