"""Float-format modules on disk: compressed-tensors' float-quantized, nvfp4-pack-quantized,
mxfp4-pack-quantized and mxfp8-quantized layouts, with the tensor names and dtypes vLLM reads.

  float-quantized        weight float8_e4m3fn, weight_scale (the weight's dtype) [1] / [out, 1] /
                         [out/128, in/128] blocks; static input: input_scale
  nvfp4-pack-quantized   weight_packed uint8 (two E2M1 codes a byte, low nibble first),
                         weight_scale float8_e4m3fn [out, in/16], weight_global_scale float32 [1];
                         static input: input_global_scale (local scales per 16, dynamic)
  mxfp4-pack-quantized   weight_packed uint8, weight_scale uint8 E8M0 exponents [out, in/32]
  mxfp8-quantized        weight float8_e4m3fn, weight_scale uint8 E8M0 [out, in/32]

Every module is checked: what is written dequantizes to effective_weight() bit for bit.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from ..quant import floats
from .entry import WeightEntry, observer_kwargs
from .errors import ExportError

FORMAT_OF = {
    "fp8_e4m3": "float-quantized",
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp8": "mxfp8-quantized",
}
SPEC_OF = {v: k for k, v in FORMAT_OF.items()}
FLOAT_FORMATS = tuple(SPEC_OF)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_SCALE_DTYPE = {"nvfp4": "torch.float8_e4m3fn", "mxfp4": "torch.uint8", "mxfp8": "torch.uint8"}


def is_float_record(rec: dict) -> bool:
    act = rec.get("input_activations") or {}
    return rec.get("format") in FLOAT_FORMATS or act.get("type") == "float"


# --- E2M1 packing and E8M0 exponents ----------------------------------------------------------


def pack_fp4(q: torch.Tensor) -> torch.Tensor:
    """E2M1 values [rows, k] (k even) -> uint8 [rows, k/2]: code = grid index | 8 for a set sign
    bit (-0.0 too), element 2j in the low nibble."""
    sign = torch.signbit(q).to(torch.uint8) << 3
    idx = torch.bucketize(q.abs().to(torch.float32), _E2M1.to(q.device)).to(torch.uint8)
    codes = (sign | idx).reshape(q.shape[0], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [rows, k/2] -> E2M1 values float32 [rows, k]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], k)
    mag = _E2M1.to(packed.device)[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -mag, mag)


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> biased exponents (uint8), as compressed-tensors stores them."""
    return (127 + torch.floor(torch.log2(scale.to(torch.float32))).to(torch.int32)).to(torch.uint8)


def from_e8m0(e: torch.Tensor, dtype) -> torch.Tensor:
    return (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(dtype)


# --- what a module writes -----------------------------------------------------------------------


def _strategy(spec) -> str:
    if spec.format == "nvfp4":
        return "tensor_group"
    return spec.granularity


def weight_args(spec) -> dict:
    """compressed-tensors' QuantizationArgs (as its presets serialize) of a float weight."""
    out = {
        "num_bits": spec.bits,
        "type": "float",
        "symmetric": True,
        "group_size": spec.group_size,
        "strategy": _strategy(spec),
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": list(floats.BLOCK) if spec.granularity == "block" else None,
    }
    if spec.format in _SCALE_DTYPE:
        out["scale_dtype"] = _SCALE_DTYPE[spec.format]
    return out


def weight_entry(mod, q, s, g, spec):
    """codes.WeightEntry of a float-format weight (tensors in compressed-tensors' layout)."""
    wq, name = mod.qc_wq, mod.qc_name
    ref = mod.weight.detach() if wq.baked else mod.effective_weight().detach()
    ref = mod.weight_matrix_view(ref)
    deq = floats.dequantize_codes(q, spec, s, g, dtype=ref.dtype)
    if not torch.equal(deq, ref):
        bad = int((deq != ref).sum())
        raise ExportError(
            f"module {name!r}: the exported {spec.format} codes do not reproduce "
            f"effective_weight() ({bad} of {ref.numel()} elements differ; pruning masks "
            "after quantization or a weight changed after redundancy_clean)"
        )
    if mod.qc_aq is not None and mod.qc_aq.active and mod.qc_aq.format == "int":
        raise ExportError(
            f"module {name!r}: {spec.format} weights with integer input activations "
            "have no compressed-tensors scheme; give the activation group a float format "
            "or leave the module out of it"
        )
    fmt = FORMAT_OF[spec.format]
    entry = WeightEntry(
        bits=spec.bits,
        qtype="float",
        symmetric=True,
        strategy=_strategy(spec),
        group_size=spec.group_size,
        fmt=fmt,
        shape=list(ref.shape),
        dtype=str(ref.dtype).replace("torch.", ""),
        transposed=mod.qc_kind == "hf_conv1d",
        target_bits=wq.target_bits,
    )
    entry.args = weight_args(spec)
    # the mse observer's choice, recorded as the integer path does (compressed-tensors' names)
    entry.args.update(observer=wq.range_observer, observer_kwargs=observer_kwargs(wq))
    t = entry.tensors
    rows = ref.shape[0]
    if spec.bits == 8:
        t["weight"] = q.reshape(ref.shape).contiguous()
    else:
        t["weight_packed"] = pack_fp4(q.reshape(rows, -1))
    if spec.scale_kind == "e8m0":
        t["weight_scale"] = e8m0(s).contiguous()
    elif spec.scale_kind == "e4m3":
        t["weight_scale"] = s.to(torch.float8_e4m3fn).contiguous()
        t["weight_global_scale"] = g.to(torch.float32).reshape(1).contiguous()
    else:
        t["weight_scale"] = s.to(ref.dtype).reshape(floats.scale_grid_shape(ref.shape, spec)).contiguous()
    return entry


def act_spec(act: dict):
    """The FloatSpec of a manifest's float input_activations."""
    fmt = {4: "nvfp4" if act["strategy"] == "tensor_group" else "mxfp4"}.get(act["num_bits"])
    if fmt is None:
        fmt = "mxfp8" if act.get("scale_dtype") == "torch.uint8" else "fp8_e4m3"
    gran = "group" if act["strategy"] in ("group", "tensor_group") else act["strategy"]
    return floats.float_spec(fmt, gran, act.get("group_size"))


def act_entry(mod):
    """(QuantizationArgs dict, tensors) of a module's float input activations."""
    aq, name = mod.qc_aq, mod.qc_name
    spec = mod.input_spec()
    wq = mod.qc_wq
    if wq is not None and wq.active and not floats.is_float(wq.spec()):
        raise ExportError(
            f"module {name!r}: integer weights with {aq.format} input activations have no "
            "compressed-tensors scheme here; give the weights a float format too"
        )
    static = aq.calibration == "static"
    args = {
        "num_bits": spec.bits,
        "type": "float",
        "symmetric": True,
        "group_size": spec.group_size,
        "strategy": _strategy(spec) if spec.granularity == "group" else spec.granularity,
        "dynamic": not static,
        "actorder": None,
        "observer": "minmax" if static else None,
        "observer_kwargs": {},
        "block_structure": None,
    }
    if spec.format in _SCALE_DTYPE:
        args["scale_dtype"] = _SCALE_DTYPE[spec.format]
    if not static:
        if spec.format == "nvfp4":
            raise ExportError(
                f"module {name!r}: NVFP4 input activations are served with a calibrated "
                "global scale (input_global_scale): set compression_training."
                "activation_quantization.shared_parameters.range_calibration: static"
            )
        return args, {}
    if not aq.observer.initialized:
        raise ExportError(
            f"module {name!r}: static activation range was never calibrated "
            "(run training or calibration batches before exporting)"
        )
    lo, hi = aq.observer.min.detach().cpu(), aq.observer.max.detach().cpu()
    if spec.format == "nvfp4":
        args["dynamic"] = "local"  # local scales per 16 from each batch, the global one stored
        return args, {"input_global_scale": floats.global_scale(lo.reshape(1), hi.reshape(1))}
    dtype = mod.weight.dtype if mod.weight.is_floating_point() else torch.float32
    s = floats.scales_from_range(lo.to(dtype).reshape(1), hi.to(dtype).reshape(1), spec)
    return args, {"input_scale": s.to(torch.float32).reshape(1)}


# --- reading back ------------------------------------------------------------------------------


def expected_tensors(rec: dict) -> Dict[str, tuple]:
    """suffix -> (dtype name, shape) a float record promises."""
    out = {}
    act = rec.get("input_activations")
    if act and act["dynamic"] is not True:
        out["input_global_scale" if act["strategy"] == "tensor_group" else "input_scale"] = ("float32", [1])
    w = rec.get("weights")
    if w is None:
        return out
    spec = weight_spec(rec)
    shape = rec["weight_shape"]
    rows, k = shape[0], math.prod(shape[1:])
    if spec.bits == 8:
        out["weight"] = ("float8_e4m3fn", list(shape))
    else:
        out["weight_packed"] = ("uint8", [rows, k // 2])
    sshape = list(floats.scale_grid_shape(shape, spec))
    out["weight_scale"] = ({"e8m0": "uint8", "e4m3": "float8_e4m3fn"}.get(spec.scale_kind, rec["dtype"]), sshape)
    if spec.scale_kind == "e4m3":
        out["weight_global_scale"] = ("float32", [1])
    return out


def weight_spec(rec: dict):
    w = rec["weights"]
    gran = "group" if w["strategy"] == "tensor_group" else w["strategy"]
    return floats.float_spec(SPEC_OF[rec["format"]], gran, w.get("group_size"))


def dequantize(rec: dict, buf, dtype) -> torch.Tensor:
    """The float weight [out, ...] of a float record (the codes times their scales)."""
    spec = weight_spec(rec)
    shape = rec["weight_shape"]
    rows = shape[0]
    if spec.bits == 8:
        q = buf["qweight"].reshape(rows, -1)
    else:
        q = unpack_fp4(buf["weight_packed"], math.prod(shape[1:]))
    s, g = _decoded_scales(spec, buf["weight_scale"], buf, dtype)
    return floats.dequantize_codes(q, spec, s, g, dtype=dtype).reshape(shape)


def _decoded_scales(spec, s: torch.Tensor, buf, dtype):
    """(scales as floats, global scale or None) from the stored ones (E8M0 exponents, e4m3)."""
    if spec.scale_kind == "e8m0":
        return from_e8m0(s, dtype), None
    if spec.scale_kind == "e4m3":
        return s.to(torch.float32), buf["weight_global_scale"]
    return s, None


def gather_rows(rec: dict, buf, ids: torch.Tensor, dtype) -> torch.Tensor:
    """Rows `ids` of dequantize(rec, buf, dtype) of a 2-D table, decoded from those rows' codes and
    scales only: each element takes the same code times the same scale, so the same value bit for bit.
    A 128 x 128 block's scale serves 128 rows: row r reads scale row r // 128."""
    spec = weight_spec(rec)
    k = rec["weight_shape"][1]
    idx = ids.reshape(-1)
    if spec.bits == 8:
        q = buf["qweight"].reshape(-1, k).index_select(0, idx)
    else:
        q = unpack_fp4(buf["weight_packed"].index_select(0, idx), k)
    s = buf["weight_scale"]
    if spec.granularity in ("channel", "group"):
        s = s.index_select(0, idx)
    elif spec.granularity == "block":
        bw = floats.BLOCK[1]
        s = s.index_select(0, torch.div(idx, floats.BLOCK[0], rounding_mode="floor"))
        s = s.repeat_interleave(bw, dim=1)[:, :k]  # one scale per element of the row
    s, g = _decoded_scales(spec, s, buf, dtype)
    if spec.granularity == "block":
        out = (q.to(s.dtype) * s).to(dtype)  # the product dequantize_codes forms per tile
    else:
        out = floats.dequantize_codes(q, spec, s, g, dtype=dtype)
    return out.reshape(*ids.shape, k)


def fake_quantize_input(mod, x: torch.Tensor, act: dict) -> torch.Tensor:
    spec = act_spec(act)
    if act["dynamic"] is True:
        return floats.fake_quantize_float(x, spec)
    if spec.format == "nvfp4":
        return floats.fake_quantize_float(x, spec, gscale=mod.input_global_scale)
    s = mod.input_scale.to(x.dtype).reshape(1)
    return floats.fake_quantize_float(x, spec, scale=s)


def record_problem(rec: dict) -> str:
    """What is malformed in a float record ("" if nothing)."""
    w, act = rec["weights"], rec["input_activations"]
    if rec["format"] not in FLOAT_FORMATS + ("dense",) or (w is None) != (rec["format"] == "dense"):
        return f"format={rec['format']!r} does not fit float weights={w!r}"
    try:
        if act is not None:
            if act.get("type") != "float" or act.get("dynamic") not in (True, False, "local"):
                return f"input_activations={act!r} (expected float args, dynamic true, false or 'local')"
            act_spec(act)
        if w is None:
            return ""
        if w.get("type") != "float" or w.get("symmetric") is not True:
            return f"weights={w!r} (expected symmetric float args)"
        spec = weight_spec(rec)
        if w.get("num_bits") != spec.bits:
            return f"weights.num_bits={w.get('num_bits')!r} does not fit {rec['format']}"
        shape = rec.get("weight_shape")
        if not isinstance(shape, list) or len(shape) != 2 or not all(type(d) is int and d > 0 for d in shape):
            return f"weight_shape={shape!r} (expected [out, in] positive integers)"
        reason = floats.check_shape(shape, spec)
        if reason:
            return reason
        dt = getattr(torch, str(rec.get("dtype")), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            return f"dtype={rec.get('dtype')!r} (expected a torch float dtype name)"
        if rec.get("transposed", False) is not (rec["kind"] == "hf_conv1d"):
            return f"transposed={rec.get('transposed')!r} does not fit kind {rec['kind']!r}"
    except (ValueError, KeyError, TypeError) as e:
        return f"float args not understood ({e})"
    return ""
