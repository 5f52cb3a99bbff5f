"""Plans int4pack_cuda / int8pack_cuda: on a GPU, bfloat16 W4 / W8 Linear layers loaded into a model
already there stay packed and run torch's weight-only kernels. The layouts, kernel calls and the
choice between the two are fast_cuda.py's; these rows hand layers to it."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from .. import fast_cuda
from ..quantized import _QLinear
from .core import Plan, _exported_codes


def cuda_choice(mod: nn.Module, rec: dict) -> Tuple[str, str]:
    """fast_cuda.choose's (plan, why not) for a Linear whose exported tensors sit on a CUDA device;
    ("", "") for any other layer."""
    ws = mod._buffers.get("weight_scale")
    if rec["kind"] not in ("linear", "hf_conv1d") or ws is None or not ws.is_cuda:
        return "", ""
    return fast_cuda.choose(rec, isinstance(mod, _QLinear), torch.cuda.get_device_capability(ws.device))


class CudaPackedPlan(Plan):
    """Codes kept packed on the GPU for one of torch's weight-only kernels (fast_cuda.py)."""

    packs_on_cuda = True

    def choose(self, mod, rec):
        return (self, "") if cuda_choice(mod, rec)[0] == self.name else None

    def convert(self, mod, rec):
        fast_cuda.to_packed(mod, rec, self.name, *_exported_codes(mod, rec))

    def forward(self, mod, x):
        return fast_cuda.forward(mod, mod._qx_input(x))

    def weight(self, mod):
        return fast_cuda.weight(mod)

    def check_saveable(self, mod):
        fast_cuda.refuse_state_dict(mod)


class Int4PackCuda(CudaPackedPlan):
    """4-bit int weights, groups of 32/64/128/256, sm_80+: aten._weight_int4pack_mm."""

    name = "int4pack_cuda"


class Int8PackCuda(CudaPackedPlan):
    """8-bit symmetric channel/tensor int weights: aten._weight_int8pack_mm."""

    name = "int8pack_cuda"
