"""Export and reload of mixture-of-experts weights (qcompress.nn.experts.ExpertMatrix).

Names: each fused expert Parameter is written under the tensor names the model's own
`save_pretrained` writes. Where transformers converts the fused tensor back to per-expert
tensors on save (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, OLMoE: `experts.{e}.gate_proj.weight`;
Mixtral: `block_sparse_moe.experts.{e}.w1.weight`), the mapping is read off transformers'
`revert_weight_conversion` applied to an index tensor (each element holding its own flat
position), so every family's converters are followed as written, not re-implemented here. Each
per-expert matrix is then a compressed-tensors Linear entry (`.weight_packed`, `.weight_scale`,
`.weight_zero_point`, `.weight_shape`, or int8 `.weight`).

gpt-oss keeps its experts fused in its own checkpoints (`experts.gate_up_proj` [E, in, out]).
Quantized, each expert is written under the names vLLM's gpt-oss loader streams one expert at a
time (its `_try_load_streamed_expert`): `experts.{e}.w13_weight_packed`, `experts.{e}.w13_weight_scale`,
`experts.{e}.w2_weight` ... (w13 = gate_up_proj, w2 = down_proj), each expert's compressed-tensors
entry in [out, in] orientation for the MoE methods vLLM copies as they are (WNA16, NVFP4) and
transposed for the ones it transposes on load (int8 / FP8 / MX formats: the loader treats them as
gpt-oss' [in, out] float layout). `weight_shape` is not written (vLLM's gpt-oss loader sends any
other `w13_weight*` name down its fused path, which fails on it; the record gives the shape).
Exports of earlier versions stacked the entries along a leading expert dimension under the fused
name (`experts.gate_up_proj_packed`, ...): load_quantized still reads them.

config.json lists them in the `qcompress` manifest under `experts`; load_quantized reassembles
each fused Parameter from them (`load_experts`).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .codes import dequantize_2d, weight_entry
from .errors import CheckpointError, ExportError
from .layout import STREAMED, weight_args

Piece = Tuple[str, int, int, int]  # (saved tensor name, expert, first out row, rows)
SUFFIXES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_global_scale", "weight")


# --- names as save_pretrained writes them ------------------------------------------------------
def _revert(root: nn.Module, name: str, index: torch.Tensor) -> Dict[str, torch.Tensor]:
    """transformers' save-time conversion of one fused tensor; {name: index} where there is none."""
    if getattr(root, "config", None) is None or not hasattr(root.config, "model_type"):
        return {name: index}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {name: index}
    return dict(revert_weight_conversion(root, {name: index}))


def saved_pieces(root: nn.Module, part) -> Tuple[Optional[str], List[Piece]]:
    """(fused name, []) when the fused tensor is saved as it is, else (None, per-expert pieces)."""
    name = part.qc_name
    shape = tuple(part.weight.shape)
    index = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    out = _revert(root, name, index)
    if len(out) == 1 and torch.equal(next(iter(out.values())), index):
        return next(iter(out)), []
    e_n, o_n, i_n = part.matrix_shape()
    pieces = []
    for saved, t in out.items():
        e, a, b = (torch.as_tensor(v) for v in torch.unravel_index(t, shape)) if t.dim() else (None,) * 3
        o, i = (a, b) if part.qc_layout == "out_in" else (b, a)
        ok = (
            t.dim() == 2
            and t.shape[1] == i_n
            and bool((e == e[0, 0]).all())
            and bool((i == torch.arange(i_n)).all())
            and bool((o == o[0, 0] + torch.arange(t.shape[0]).unsqueeze(1)).all())
        )
        if not ok:
            raise ExportError(
                f"module {name!r}: save_pretrained writes {saved!r} (shape {list(t.shape)}) "
                "from it in a way that is not whole rows of one expert's [out, in] matrix; "
                "its quantized codes cannot be written under that name"
            )
        pieces.append((saved, int(e[0, 0]), int(o[0, 0]), int(t.shape[0])))
    return None, sorted(pieces, key=lambda p: (p[1], p[2]))


def input_name(saved: str, suffix: str) -> str:
    """Name of an expert's static `input_scale` / `input_zero_point`: `x.weight` -> `x.input_scale`;
    a fused `x.gate_up_proj` -> `x.gate_up_proj_input_scale` (stacked over experts)."""
    return saved[: -len("weight")] + suffix if saved.endswith(".weight") else f"{saved}_{suffix}"


def tensor_name(saved: str, suffix: str) -> str:
    """compressed-tensors' name for `suffix` (weight_packed, weight_scale, ...) of a saved tensor:
    `x.weight` -> `x.weight_packed`; a fused `x.gate_up_proj` -> `x.gate_up_proj_packed`."""
    if saved.endswith(".weight"):
        return saved[: -len("weight")] + suffix
    return saved + suffix[len("weight") :]


# --- gpt-oss: the per-expert names vLLM's gpt-oss loader streams --------------------------------
STREAMED_SUFFIXES = SUFFIXES + ("input_scale", "input_zero_point", "input_global_scale")


def streamed_layout(root: nn.Module, fused: str) -> Optional[dict]:
    """{"prefix", "param"} for a gpt-oss fused Parameter (`...mlp.experts.gate_up_proj` -> w13),
    else None (other fused layouts keep the stacked entries only load_quantized reads)."""
    if getattr(getattr(root, "config", None), "model_type", None) != "gpt_oss":
        return None
    prefix, _, leaf = fused.rpartition(".")
    if leaf not in STREAMED or not prefix.endswith(".experts"):
        return None
    return {"prefix": prefix, "param": STREAMED[leaf][0]}


def streamed_transposed(fmt: str, weights: Optional[dict], act: Optional[dict]) -> bool:
    """Whether vLLM's gpt-oss loader transposes each streamed expert tensor on load: it copies
    them as they are for its WNA16 and NVFP4 MoE methods and transposes them for every other one
    (GptOssRoutedExperts.weight_loader), so those are written transposed."""
    wna16 = fmt == "pack-quantized" and (weights or {}).get("type", "int") == "int" and not act
    return not (wna16 or fmt == "nvfp4-pack-quantized")


def streamed_name(st: dict, e: int, suffix: str) -> str:
    """`{prefix}.{e}.w13_weight_packed` for suffix `weight_packed` (vLLM's parameter name, per expert)."""
    return f"{st['prefix']}.{e}.{st['param']}_{suffix}"


def _unstream(rec: dict, tensors: Dict[str, torch.Tensor], where: str) -> dict:
    """Rename a streamed record's tensors to per-expert Linear entries (`{prefix}.{e}.{param}.weight_*`,
    [out, in] orientation, weight_shape filled in) and return the record as a pieces record."""
    st = rec["streamed"]
    e_n, a, b = rec["shape"]
    out, inp = (a, b) if rec["layout"] == "out_in" else (b, a)
    flip = st.get("transposed", False)
    pieces = []
    codes = (
        "weight_packed"
        if rec.get("format") in ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")
        else "weight"
    )
    for e in range(e_n):
        saved = f"{st['prefix']}.{e}.{st['param']}.weight"
        pieces.append([saved, e, 0, out])
        if streamed_name(st, e, codes) not in tensors:
            raise CheckpointError(f"{where}: tensor {streamed_name(st, e, codes)!r} is missing")
        for suffix in STREAMED_SUFFIXES:
            key = streamed_name(st, e, suffix)
            if key not in tensors:
                continue
            t = tensors.pop(key)
            if flip and t.dim() == 2:
                t = t.t().contiguous()
            tensors[saved[: -len("weight")] + suffix] = t
        if rec.get("format") == "pack-quantized":
            tensors[saved + "_shape"] = torch.tensor([out, inp], dtype=torch.int64)
    return {**rec, "fused": None, "pieces": pieces}


# --- one expert's rows as a Linear-like weight for codes.weight_entry ---------------------------
class _Rows:
    """Rows [o0, o0 + r) of expert e's [out, in] matrix, seen as a compress-aware Linear."""

    qc_kind = "linear"

    def __init__(self, part, codes, eff, e: int, o0: int, r: int, saved: str):
        self.qc_wq, self.qc_aq, self.qc_name = part.qc_wq, part.qc_aq, saved
        q, s, z, spec = codes
        e_n, out, inp = part.matrix_shape()
        if spec.kind == "float" and spec.granularity == "block":  # 128 x 128 blocks per expert
            from ..quant.floats import BLOCK

            rb = -(-out // BLOCK[0])
            if o0 % BLOCK[0] or (r % BLOCK[0] and o0 + r != out):
                raise ExportError(
                    f"module {part.qc_name!r}: {saved!r} holds rows {o0}-{o0 + r} of expert {e}, "
                    f"which cut its {BLOCK[0]}-row scale blocks; a block format needs those "
                    "projections to be whole blocks"
                )
            first = e * rb + o0 // BLOCK[0]
            rows = slice(e * out + o0, e * out + o0 + r)
            self._codes = (
                q.reshape(e_n * out, -1)[rows],
                s.reshape(e_n * rb, -1)[first : first + -(-r // BLOCK[0])],
                None,
                spec,
            )
        elif spec.kind == "float":  # z: each expert's global scale (NVFP4) or None
            rows = slice(e * out + o0, e * out + o0 + r)
            self._codes = (
                q.reshape(e_n * out, -1)[rows],
                s.reshape(e_n * out, -1)[rows],
                None if z is None else z[e],
                spec,
            )
        elif part.qc_per_expert_tensor:  # [E, out * in] view: one scale per expert
            from dataclasses import replace

            self._codes = (
                q[e].reshape(out, inp)[o0 : o0 + r],
                s.reshape(e_n)[e].reshape(1),
                None if z is None else z.reshape(e_n)[e].reshape(1),
                replace(spec, granularity="tensor"),
            )
        else:
            rows = slice(e * out + o0, e * out + o0 + r)
            s2 = s.reshape(e_n * out, -1)
            self._codes = (q[rows], s2[rows], None if z is None else z.reshape(e_n * out, -1)[rows], spec)
        self.weight = part.expert_matrix(eff, e)[o0 : o0 + r]

    def quantized_weight(self):
        return self._codes

    def effective_weight(self):
        return self.weight

    def weight_matrix_view(self, w):
        return w


def part_entries(root: nn.Module, part) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(tensors to write, manifest record) of one ExpertMatrix; every expert checked bit for bit."""
    codes = part.quantized_weight()
    if codes is None:
        raise ExportError(f"module {part.qc_name!r}: weight quantization has no codes")
    wq = part.qc_wq
    eff = (part.weight if wq.baked else part.effective_weight()).detach()
    fused, pieces = saved_pieces(root, part)
    e_n, out, inp = part.matrix_shape()
    tensors: Dict[str, torch.Tensor] = {}
    st = None if fused is None else streamed_layout(root, fused)
    if st is not None:
        entries = [
            weight_entry(_Rows(part, codes, eff, e, 0, out, f"{st['prefix']}.{e}.{st['param']}")) for e in range(e_n)
        ]
        first = entries[0]
        acts = part.qc_aq is not None and part.qc_aq.active
        st["transposed"] = streamed_transposed(first.fmt, {"type": first.qtype}, acts)
        for e, entry in enumerate(entries):
            for key, t in entry.tensors.items():
                if key == "weight_shape":
                    continue
                tensors[streamed_name(st, e, key)] = t.t().contiguous() if st["transposed"] and t.dim() == 2 else t
        fused = None
    elif fused is not None:
        entries = [weight_entry(_Rows(part, codes, eff, e, 0, out, f"{fused}[{e}]")) for e in range(e_n)]
        for key in entries[0].tensors:
            tensors[tensor_name(fused, key)] = torch.stack([x.tensors[key] for x in entries]).contiguous()
        first = entries[0]
    else:
        first = None
        for saved, e, o0, r in pieces:
            entry = weight_entry(_Rows(part, codes, eff, e, o0, r, saved))
            first = first or entry
            for key, t in entry.tensors.items():
                tensors[tensor_name(saved, key)] = t
    record = {
        "kind": "experts",
        "group": wq.group,
        "format": first.fmt,
        "weights": weight_args(first),
        "qtype": first.qtype,
        "dtype": first.dtype,
        "target_bits": wq.target_bits,
        "layout": part.qc_layout,
        "shape": list(part.weight.shape),
        "fused": fused,
        "pieces": [list(p) for p in pieces],
    }
    if st is not None:
        record["streamed"] = st
    return tensors, record


def collect_experts(root: nn.Module):
    """({tensor name: tensor}, {Parameter name: manifest record}, [state_dict keys replaced])."""
    from ..nn.experts import ExpertMatrix

    tensors, records, replaced = {}, {}, []
    from .codes import act_entry

    for name, mod in root.named_modules():
        if not isinstance(mod, ExpertMatrix):
            continue
        static = mod.qc_aq is not None and mod.qc_aq.active and mod.qc_aq.calibration == "static"
        act = _static_args(mod) if static else act_entry(mod)  # per token: arguments only, no tensors
        if mod.qc_wq is not None and mod.qc_wq.active:
            t, rec = part_entries(root, mod)
            tensors.update(t)
            replaced.append(name)
            replaced.extend(f"{name}.{k}" for k in mod._parameters)  # learned ranges: in the codes
        elif act is not None:
            fused, pieces = saved_pieces(root, mod)
            rec = {
                "kind": "experts",
                "group": mod.qc_aq.group,
                "format": "dense",
                "weights": None,
                "layout": mod.qc_layout,
                "shape": list(mod.weight.shape),
                "fused": fused,
                "pieces": [list(p) for p in pieces],
            }
        else:
            continue
        rec["input_activations"] = None if act is None else act[0]
        if static:
            tensors.update(_static_inputs(mod, rec))
        records[name] = rec
    return tensors, records, replaced


def _static_args(part):
    from .codes import observer_kwargs

    aq = part.qc_aq
    return (
        {
            "num_bits": aq.bits,
            "type": "int",
            "symmetric": aq.symmetric,
            "strategy": "tensor",
            "dynamic": False,
            "observer": aq.range_observer,
            "observer_kwargs": observer_kwargs(aq),
        },
        {},
    )


def _static_inputs(part, rec: dict) -> Dict[str, torch.Tensor]:
    """Each expert's static input range as compressed-tensors writes a Linear's (`input_scale`
    float32 [1], `input_zero_point` int8 [1]) under that expert's names; stacked [E] under a fused name."""
    from ..quant import reference

    aq = part.qc_aq
    spec = reference.make_spec(aq.bits, symmetric=aq.symmetric, granularity="tensor")
    scales, zps = [], []
    for e, r in enumerate(aq.observer.experts):
        if not r.initialized:
            raise ExportError(
                f"module {part.qc_name!r}: expert {e} was routed no token while its static input "
                "range was calibrated, so it has no input_scale; run more (or more varied) "
                "training or calibration batches before exporting"
            )
        s, zp, _ = reference.qparams(
            torch.zeros(1, 1), torch.ones(1, dtype=torch.int64), spec, min_val=r.min.cpu(), max_val=r.max.cpu()
        )
        scales.append(s.reshape(1).to(torch.float32))
        zps.append(None if zp is None else zp.reshape(1).to(torch.int8))
    out = {}
    if rec.get("streamed"):
        for e in range(len(scales)):
            out[streamed_name(rec["streamed"], e, "input_scale")] = scales[e].clone()
            if zps[e] is not None:
                out[streamed_name(rec["streamed"], e, "input_zero_point")] = zps[e].clone()
        return out
    if rec["fused"] is not None:
        out[input_name(rec["fused"], "input_scale")] = torch.cat(scales)
        if zps[0] is not None:
            out[input_name(rec["fused"], "input_zero_point")] = torch.cat(zps)
        return out
    for saved, e, _, _ in rec["pieces"]:
        out[input_name(saved, "input_scale")] = scales[e].clone()
        if zps[e] is not None:
            out[input_name(saved, "input_zero_point")] = zps[e].clone()
    return out


def _load_static_inputs(part, rec: dict, tensors, where: str) -> None:
    """The per-expert input scales (and zero points) the export wrote, taken out of `tensors`."""
    e_n = rec["shape"][0]
    sym = rec["input_activations"]["symmetric"]
    s = torch.empty(e_n, dtype=torch.float32)
    z = None if sym else torch.empty(e_n, dtype=torch.float32)

    def take(saved, suffix):
        key = input_name(saved, suffix)
        if key not in tensors:
            raise CheckpointError(f"{where}: tensor {key!r} (a static input range) is missing")
        return tensors.pop(key).to(torch.float32).reshape(-1)

    if rec["fused"] is not None:
        s.copy_(take(rec["fused"], "input_scale"))
        if z is not None:
            z.copy_(take(rec["fused"], "input_zero_point"))
    else:
        for saved, e, _, _ in rec["pieces"]:
            s[e] = take(saved, "input_scale")[0]
            if z is not None:
                z[e] = take(saved, "input_zero_point")[0]
    part.qc_static_inputs = (s, z)


# --- reload ------------------------------------------------------------------------------------
def _piece_codes(tensors, saved: str, rec: dict, rows: int, inp: int, where: str, e=None):
    """(q [rows, in] int8, scale, zero point, group size) of one stored entry."""
    w = rec["weights"]
    bits, gsize = w["num_bits"], w["group_size"] if w["strategy"] == "group" else None

    def take(suffix, required=True):
        key = tensor_name(saved, suffix)
        if key not in tensors:
            if required:
                raise CheckpointError(f"{where}: tensor {key!r} is missing")
            return None
        t = tensors.pop(key) if e is None else tensors[key]
        return t if e is None else t[e]

    from ..quant.packing import unpack_int32

    if rec["format"] == "pack-quantized":
        q = unpack_int32(take("weight_packed"), bits, inp, dim=1)
        take("weight_shape")
    else:
        q = take("weight")
    s = take("weight_scale")
    z = take("weight_zero_point", required=not w["symmetric"])
    if z is not None and rec["format"] == "pack-quantized" and w["strategy"] in ("channel", "group"):
        z = unpack_int32(z, bits, rows, dim=0)
    if w["strategy"] == "tensor":
        s = s.reshape(1, 1)
        z = None if z is None else z.reshape(1, 1)
    if tuple(q.shape) != (rows, inp):
        raise CheckpointError(f"{where}: codes of {saved!r} are {list(q.shape)}, expected {[rows, inp]}")
    return q, s, z, gsize


def _piece_float(tensors, saved: str, rec: dict, rows: int, inp: int, where: str, e, dtype):
    """One stored float-format entry (FP8, NVFP4, MXFP4 ...) dequantized to [rows, in]."""
    from . import floats as float_layout

    def take(suffix, key_as):
        key = tensor_name(saved, suffix)
        if key not in tensors:
            raise CheckpointError(f"{where}: tensor {key!r} is missing")
        t = tensors.pop(key) if e is None else tensors[key]
        return key_as, (t if e is None else t[e])

    spec = float_layout.weight_spec(rec)
    names = [("weight", "qweight")] if spec.bits == 8 else [("weight_packed", "weight_packed")]
    names.append(("weight_scale", "weight_scale"))
    if spec.scale_kind == "e4m3":
        names.append(("weight_global_scale", "weight_global_scale"))
    buf = dict(take(*n) for n in names)
    return float_layout.dequantize({**rec, "weight_shape": [rows, inp]}, buf, dtype)


def load_experts(root: nn.Module, experts: Dict[str, dict], tensors: Dict[str, torch.Tensor], cfg_path: str):
    """Put each exported fused expert Parameter, dequantized (the trained effective weight bit for
    bit), into `tensors` under its state_dict name, taking its stored entries out."""
    params = dict(root.named_parameters())
    modules = dict(root.named_modules())
    for name, rec in experts.items():
        where = f"{cfg_path}: experts {name!r}"
        if name not in params:
            raise CheckpointError(f"{where}: no such Parameter in the given model")
        have = list(params[name].shape)
        if have != rec["shape"]:
            raise CheckpointError(f"{where}: shape {rec['shape']} in the checkpoint but {have} in the given model")
        if rec.get("streamed"):
            rec = _unstream(rec, tensors, where)
        part = _loaded_part(modules, name, rec)
        act = rec.get("input_activations")
        if act is not None and not act.get("dynamic", True):
            _load_static_inputs(part, rec, tensors, where)
        if rec["weights"] is None:
            continue
        e_n, a, b = rec["shape"]
        out, inp = (a, b) if rec["layout"] == "out_in" else (b, a)
        dtype = getattr(torch, rec["dtype"])
        is_float = rec.get("qtype") == "float"
        codes = None if is_float else _Codes(e_n, out, inp, rec)  # no low-bit kernels for float formats
        full = torch.empty(e_n, out, inp, dtype=dtype)
        if rec["fused"] is not None:
            todo = [(rec["fused"], e, 0, out) for e in range(e_n)]
        else:
            todo = [tuple(p) for p in rec["pieces"]]
        for saved, e, o0, r in todo:
            stacked = e if rec["fused"] is not None else None
            if is_float:
                full[e, o0 : o0 + r] = _piece_float(tensors, saved, rec, r, inp, where, stacked, dtype)
                continue
            q, s, z, g = _piece_codes(tensors, saved, rec, r, inp, where, stacked)
            full[e, o0 : o0 + r] = dequantize_2d(q, s, z, g, dtype)
            codes.put(e, o0, q, s, z)
        if codes is not None:
            part.__dict__["_qc_loaded_codes"] = codes  # for load_quantized(mode="fast")
        if rec["fused"] is not None:
            for suffix in SUFFIXES:
                tensors.pop(tensor_name(rec["fused"], suffix), None)
        tensors[name] = full if rec["layout"] == "out_in" else full.transpose(-1, -2).contiguous()


# --- hooks of export_quantized / load_quantized -------------------------------------------------
def add_experts(model: nn.Module, tensors: Dict[str, torch.Tensor]) -> Dict[str, dict]:
    """Replace the fused float expert Parameters in `tensors` by their quantized entries; returns
    the manifest records ({} when the model has no quantized experts)."""
    from ..unwrap import unwrap

    new, records, replaced = collect_experts(unwrap(model))
    for k in replaced:
        tensors.pop(k, None)
    tensors.update({k: v.detach().cpu().clone() for k, v in new.items()})  # own storage each (safetensors)
    return records


def add_to_config(config: dict, records: Dict[str, dict], modules: Dict[str, dict]) -> None:
    """List the experts in the manifest (their config groups are layout.quantization_config's);
    warn where transformers refuses them (gpt-oss) or only qcompress.load_quantized reads them
    (other fused layouts)."""
    if not records:
        return
    config["qcompress"]["experts"] = records
    import warnings

    fused = sorted(n for n, r in records.items() if r["weights"] is not None and r["fused"] is not None)
    if fused:
        warnings.warn(
            f"{len(fused)} fused expert Parameters ({', '.join(fused[:2])}{', ...' if len(fused) > 2 else ''}) "
            "keep their fused layout, which only qcompress.load_quantized reads quantized; "
            "transformers and vLLM refuse the export (see docs/moe.md)",
            stacklevel=3,
        )
    streamed = sorted(n for n, r in records.items() if r["weights"] is not None and r.get("streamed"))
    if streamed:
        warnings.warn(
            f"{len(streamed)} quantized gpt-oss expert Parameters ({', '.join(streamed[:2])}"
            f"{', ...' if len(streamed) > 2 else ''}) are written under the per-expert names vLLM "
            "loads; transformers reads gpt-oss experts only unquantized and refuses the export: "
            "use vLLM or qcompress.load_quantized (see docs/moe.md)",
            stacklevel=3,
        )


def _loaded_part(modules, name: str, rec: dict):
    """The ExpertMatrix of a loaded fused Parameter: quantizes its inputs as the export did and, in
    fast mode, runs each expert on the low-bit kernels."""
    from ..nn.experts import ExpertMatrix, attach
    from ..nn.state import ActQuant

    owner_name, pname = name.rsplit(".", 1)
    part = ExpertMatrix(modules[owner_name], pname, rec["layout"], name)
    act = rec.get("input_activations")
    if act is not None:
        static = not act.get("dynamic", True)
        fmt, group_size = "int", None
        if act.get("type") == "float":  # FP8 / MX inputs: the format and its groups, not int8 per token
            from .floats import act_spec

            spec = act_spec(act)
            fmt, group_size = spec.format, (spec.group_size if spec.granularity == "group" else None)
        part.qc_aq = ActQuant(
            group=rec["group"],
            bits=act["num_bits"],
            symmetric=act["symmetric"],
            calibration="static" if static else "dynamic",
            offset=0,
            per="token",
            active=True,
            format=fmt,
            group_size=group_size,
        )
        if static:  # per-expert ranges: a product that names no expert is refused (input_observer)
            from ..nn.expert_ranges import ExpertRanges

            part.qc_aq.observer = ExpertRanges(rec["shape"][0])
    attach([part], always=True)
    return part


class _Codes:
    """Each expert's integer codes, scales and zero points as loaded, [out, in] orientation."""

    def __init__(self, e_n: int, out: int, inp: int, rec: dict):
        w = rec["weights"]
        self.rec, self.out, self.inp = rec, out, inp
        self.q = torch.empty(e_n, out, inp, dtype=torch.int8)
        ng = 1 if w["strategy"] != "group" else -(-inp // w["group_size"])
        self.s = torch.empty(e_n, out, ng, dtype=torch.float32)
        self.z = None if w["symmetric"] else torch.empty(e_n, out, ng, dtype=torch.int32)

    def put(self, e, o0, q, s, z):
        r = q.shape[0]
        self.q[e, o0 : o0 + r] = q
        self.s[e, o0 : o0 + r] = s.to(torch.float32).expand(r, -1)
        if self.z is not None:
            self.z[e, o0 : o0 + r] = z.to(torch.int32).expand(r, -1)


class _FastExperts:
    """Expert e's product on the low-bit kernel (csrc/cpu/lowbit_gemm.cpp), weights prepacked once."""

    def __init__(self, codes: _Codes):
        from ..quant import lowbit

        w = codes.rec["weights"]
        self.lowbit, self.n, self.k = lowbit, codes.out, codes.inp
        self.group = lowbit.kernel_group(w["strategy"], w["group_size"], codes.inp)
        self.cbits = lowbit.container_bits(w["num_bits"])
        self.packed = [
            lowbit.prepack_rows(codes.q[e], codes.s[e], None if codes.z is None else codes.z[e], self.group, self.cbits)
            for e in range(codes.q.shape[0])
        ]

    def runs_on(self, x: torch.Tensor) -> bool:
        """The weights were prepacked on the CPU; elsewhere the dequantized weight multiplies."""
        return x.device == self.packed[0].packed.device and self.lowbit.runs_on(x.device)

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        y = self.lowbit.linear(x.reshape(-1, self.k).contiguous(), self.packed[e], None, self.n, self.group, self.cbits)
        return y.reshape(*x.shape[:-1], self.n)


def fast_experts(root: nn.Module, modules, options) -> None:
    """load_quantized(mode="fast"): each loaded expert runs on its routed tokens through the low-bit
    kernels (where the extension is built and the group fits them)."""
    from ..nn.experts import ExpertMatrix
    from ..quant import lowbit

    for mod in root.modules():
        codes = mod.__dict__.pop("_qc_loaded_codes", None) if isinstance(mod, ExpertMatrix) else None
        if codes is None or not lowbit.available():
            continue
        w = codes.rec["weights"]
        if lowbit.kernel_group(w["strategy"], w["group_size"], codes.inp) is not None:
            mod.qc_fast = _FastExperts(codes)


def _drop_codes(root: nn.Module, modules, options) -> None:
    for mod in root.modules():
        mod.__dict__.pop("_qc_loaded_codes", None)  # exact mode: the dequantized weights suffice


def _register_fast() -> None:
    from .quantized import register_load_step

    register_load_step("fast", fast_experts)
    register_load_step("exact", _drop_codes)


_register_fast()


def inspect_owners(experts: Dict[str, dict]) -> Dict[str, Tuple[str, dict]]:
    """{stored tensor name: (fused Parameter, a record with that tensor's weight_shape)} for
    `qcompress export inspect`: each expert entry is listed with its format, bits and fp32 size."""
    out = {}
    for name, rec in experts.items():
        if rec["weights"] is None:
            continue
        e_n, a, b = rec["shape"]
        inp = b if rec["layout"] == "out_in" else a
        codes = "weight_packed" if rec["format"] == "pack-quantized" else "weight"
        if rec.get("streamed"):
            st = rec["streamed"]
            rows = a * b // inp
            for e in range(e_n):
                entry = {**rec, "weight_shape": [rows, inp], "codes_key": streamed_name(st, e, codes)}
                for suffix in SUFFIXES:
                    out[streamed_name(st, e, suffix)] = (f"{name} (experts)", entry)
            continue
        if rec["fused"] is not None:
            entries = [(rec["fused"], [e_n, a * b // inp, inp])]
        else:
            entries = [(saved, [r, inp]) for saved, _, _, r in rec["pieces"]]
        for saved, shape in entries:
            entry = {**rec, "weight_shape": shape, "codes_key": tensor_name(saved, codes)}
            for suffix in SUFFIXES:
                out[tensor_name(saved, suffix)] = (f"{name} (experts)", entry)
    return out
