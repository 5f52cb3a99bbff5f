"""Expert weights as vLLM's weight loader left them, against load_quantized's.

vLLM's CPU build has no kernel for quantized mixture-of-experts layers, so those exports cannot be
served here; what can be checked is that vLLM's loader put every expert's codes and scales where
its MoE method reads them. The worker (vllm_worker.py --dump) writes each experts layer's w13_* /
w2_* parameters after load_weights, before any kernel repacking: there each expert holds
compressed-tensors' [out, in] entries (w13 = the gate rows, then the up rows; gpt-oss' interleaved
gate/up rows as its checkpoints order them). Each expert's rows are dequantized with the export's
scheme and compared bit for bit with the fused Parameter load_quantized rebuilt from the export.
A difference is vLLM reading the checkpoint differently from how it is written.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from ..export.layout import STREAMED
from ..export.experts import _piece_codes, _piece_float, tensor_name
from ..export.codes import dequantize_2d

SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale")


def _layer_and_rows(pname: str, rec: dict) -> Tuple[Optional[str], str, List[tuple]]:
    """(vLLM's experts layer prefix, "w13" | "w2", [(expert, first row, rows)]) of a fused record."""
    w = STREAMED.get(pname.rsplit(".", 1)[1], (None,))[0]
    e_n, a, b = rec["shape"]
    out = a if rec["layout"] == "out_in" else b
    if rec.get("streamed"):
        return rec["streamed"]["prefix"], rec["streamed"]["param"], [(e, 0, out) for e in range(e_n)]
    pieces = rec.get("pieces") or []
    m = re.match(r"^(.*)\.\d+\.[^.]+\.weight$", pieces[0][0]) if pieces else None
    return (m.group(1) if m else None), w, [(e, o0, r) for _, e, o0, r in pieces]


def _param(dump: Dict[str, torch.Tensor], prefix: str, name: str) -> Optional[torch.Tensor]:
    for key in (f"{prefix}.routed_experts.{name}", f"{prefix}.{name}"):
        if key in dump:
            return dump[key]
    return None


def _rows_entry(dump, prefix: str, w: str, rec: dict, e: int, o0: int, r: int, inp: int) -> Dict[str, torch.Tensor]:
    """Expert e's rows [o0, o0 + r) of vLLM's w13 / w2 parameters as a compressed-tensors entry."""
    bits = rec["weights"]["num_bits"]
    shard = o0 // r
    local = {}
    for suffix in SUFFIXES:
        t = _param(dump, prefix, f"{w}_{suffix}")
        if t is None:
            continue
        t = t[e]
        if t.dim() == 2 and suffix == "weight_zero_point" and rec["format"] == "pack-quantized":
            per = 32 // bits  # zero points packed along the rows
            t = t[o0 // per : (o0 + r) // per]
        elif t.dim() == 2 and suffix == "weight_scale" and rec["weights"].get("strategy") == "block":
            b = rec["weights"]["block_structure"][0]  # one scale row per block of rows
            t = t[o0 // b : (o0 + r + b - 1) // b]
        elif t.dim() == 2:
            t = t[o0 : o0 + r]
        elif t.dim() == 1 and t.numel() > 1:
            t = t[shard].reshape(1)  # one per shard (gate, up) of w13
        else:
            t = t.reshape(1)
        local[tensor_name("x.weight", suffix)] = t
    if rec["format"] == "pack-quantized":
        local["x.weight_shape"] = torch.tensor([r, inp])
    return local


def compare_expert_weights(
    dump: Dict[str, torch.Tensor], experts: Dict[str, dict], params: Dict[str, torch.Tensor]
) -> List[Tuple[str, str]]:
    """[(module, problem)] where vLLM's loaded expert weights differ from load_quantized's
    (`params`: the fused Parameters of a model load_quantized loaded, float32)."""
    problems = []
    for pname, rec in experts.items():
        if rec.get("weights") is None:
            continue
        prefix, w, rows = _layer_and_rows(pname, rec)
        if (
            prefix is None
            or w is None
            or _param(
                dump,
                prefix,
                f"{w}_weight"
                if rec["format"] in ("int-quantized", "float-quantized", "mxfp8-quantized")
                else f"{w}_weight_packed",
            )
            is None
        ):
            problems.append((pname, "vLLM built no quantized experts layer holding it"))
            continue
        want = params[pname].detach().to(torch.float32)
        if rec["layout"] != "out_in":
            want = want.transpose(-1, -2)
        inp = want.shape[-1]
        bad = []
        for e, o0, r in rows:
            local = _rows_entry(dump, prefix, w, rec, e, o0, r, inp)
            try:
                if rec.get("qtype") == "float":
                    got = _piece_float(local, "x.weight", rec, r, inp, pname, None, torch.float32)
                else:
                    q, s, z, g = _piece_codes(local, "x.weight", rec, r, inp, pname)
                    got = dequantize_2d(q, s, z, g, torch.float32)
            except Exception as err:  # noqa: BLE001 -- a parameter of another shape
                bad.append(f"expert {e} rows {o0}-{o0 + r}: {type(err).__name__}: {err}")
                continue
            ref = want[e, o0 : o0 + r]
            if not torch.equal(got, ref):
                diff = (got - ref).abs().nan_to_num(float("inf")).max().item()
                bad.append(f"expert {e} rows {o0}-{o0 + r} differ by up to {diff:.3g}")
        bias = _param(dump, prefix, f"{w}_bias")
        if (
            bias is not None
            and f"{pname}_bias" in params
            and not torch.equal(bias.to(torch.float32), params[f"{pname}_bias"].detach().to(torch.float32))
        ):
            bad.append("the biases differ")
        if bad:
            problems.append(
                (
                    pname,
                    f"vLLM's loader fills {prefix} {w} other than the export holds: "
                    f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                )
            )
    return problems
