"""An export's config.json and tensors, checked before any math on them.

Every problem is a CheckpointError naming the file, the module and the tensor or key: a malformed
qcompress manifest, a quantization_config that says something else than the manifest (other
loaders would read the same integers differently), and tensors missing, surplus or of the wrong
dtype, shape or range.
"""

from __future__ import annotations

import json
import os
import re

import torch

from . import layout
from .errors import CheckpointError
from .quantized import FORWARDS


_FORMATS = ("dense", "pack-quantized", "int-quantized")
_ACT_STRATEGIES = ("tensor", "token", "sample")
_W_STRATEGIES = ("tensor", "channel", "group")
_QUANT_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "input_scale",
    "input_zero_point",
)


def _int_in(x, lo, hi=None) -> bool:
    return type(x) is int and x >= lo and (hi is None or x <= hi)


def _act_problem(a) -> str:
    if not isinstance(a, dict):
        return f"input_activations is {a!r}, not an object or null"
    if not _int_in(a.get("num_bits"), 1, 8):
        return f"input_activations.num_bits={a.get('num_bits')!r} (expected an integer 1-8)"
    for key in ("symmetric", "dynamic"):
        if not isinstance(a.get(key), bool):
            return f"input_activations.{key}={a.get(key)!r} (expected true or false)"
    if a.get("strategy") not in _ACT_STRATEGIES or (not a["dynamic"] and a["strategy"] != "tensor"):
        return (
            f"input_activations.strategy={a.get('strategy')!r} (expected 'tensor' when static, "
            "'token' or 'sample' when dynamic)"
        )
    return ""


def _weights_problem(rec) -> str:
    w = rec["weights"]
    if not isinstance(w, dict):
        return f"weights is {w!r}, not an object or null"
    bits = w.get("num_bits")
    packed = rec["format"] == "pack-quantized"
    if not _int_in(bits, 1, 8) or (packed and 32 % bits):
        return f"weights.num_bits={bits!r} (expected an integer " + (
            "1, 2, 4 or 8 for pack-quantized)" if packed else "1-8)"
        )
    if not isinstance(w.get("symmetric"), bool):
        return f"weights.symmetric={w.get('symmetric')!r} (expected true or false)"
    if w.get("strategy") not in _W_STRATEGIES:
        return f"weights.strategy={w.get('strategy')!r} (expected one of {list(_W_STRATEGIES)})"
    if w["strategy"] == "group" and not _int_in(w.get("group_size"), 1):
        return f"weights.group_size={w.get('group_size')!r} (strategy 'group' needs a positive integer)"
    shape = rec.get("weight_shape")
    if not isinstance(shape, list) or not shape or not all(_int_in(d, 0) for d in shape):
        return f"weight_shape={shape!r} (expected a list of non-negative integers)"
    dt = getattr(torch, str(rec.get("dtype")), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return f"dtype={rec.get('dtype')!r} (expected a torch float dtype name, e.g. 'float32')"
    if rec.get("qtype") not in ("int", "binary", "ternary"):
        return f"qtype={rec.get('qtype')!r} (expected 'int', 'binary' or 'ternary')"
    # a square Conv1D would pass every shape check with the flag wrong, and load transposed weights
    if rec.get("transposed", False) is not (rec["kind"] == "hf_conv1d"):
        return (
            f"transposed={rec.get('transposed')!r} does not fit kind {rec['kind']!r} (exactly the "
            "transformers Conv1D weights are stored transposed)"
        )
    return ""


def _record_problem(rec) -> str:
    """What is malformed in one manifest record ("" if nothing), checked before any math on it."""
    if not isinstance(rec, dict):
        return f"{rec!r} is not an object"
    for key in ("kind", "format", "weights", "input_activations"):
        if key not in rec:
            return f"no {key!r} key"
    if rec["kind"] not in FORWARDS:
        return f"kind={rec['kind']!r} (expected one of {sorted(FORWARDS)})"
    from .floats import is_float_record, record_problem as float_problem

    if is_float_record(rec):
        return float_problem(rec)
    if rec["format"] not in _FORMATS:
        return f"format={rec['format']!r} (expected one of {list(_FORMATS)})"
    if (rec["weights"] is None) != (rec["format"] == "dense"):
        return f"format {rec['format']!r} does not fit weights={rec['weights']!r}"
    act = rec["input_activations"]
    if act is not None and (problem := _act_problem(act)):
        return problem
    if rec["weights"] is None:
        return "" if act is not None else "quantizes neither weights nor inputs"
    return _weights_problem(rec)


def check_manifest(modules, cfg_path: str):
    """The qcompress manifest must be well formed: CheckpointError naming config.json and module."""
    if not isinstance(modules, dict):
        raise CheckpointError(f"{cfg_path}: qcompress.modules is {type(modules).__name__}, not an object")
    for name, rec in modules.items():
        problem = _record_problem(rec) or _tie_problem(name, rec, modules)
        if problem:
            raise CheckpointError(f"{cfg_path}: qcompress manifest entry of module {name!r}: {problem}")


def _tie_problem(name, rec, modules) -> str:
    """A `tied_to` record (tied weights stored once) must name another stored module whose weight
    record is the same."""
    to = rec.get("tied_to")
    if to is None:
        return ""
    src = modules.get(to) if isinstance(to, str) and to != name else None
    if not isinstance(src, dict) or src.get("tied_to") is not None or rec["weights"] is None:
        return f"tied_to={to!r} does not name another module of this export that stores its weight"
    if (rec["format"], rec["weights"], rec.get("weight_shape")) != (
        src.get("format"),
        src.get("weights"),
        src.get("weight_shape"),
    ):
        return f"tied_to={to!r}, but the two modules' weight records differ"
    return ""


def resolve_ties(tensors, where, modules) -> None:
    """Modules stored `tied_to` another read its weight tensors (the same codes and scales)."""
    for name, rec in modules.items():
        to = rec.get("tied_to")
        if to is None:
            continue
        for suffix in layout.expected_tensors({**rec, "input_activations": None}):
            key, src = f"{name}.{suffix}", f"{to}.{suffix}"
            if key in tensors:
                raise CheckpointError(
                    f"{where[key]}: tensor {key!r} is stored although config.json says {name!r} is tied_to {to!r}"
                )
            if src in tensors:
                tensors[key], where[key] = tensors[src], where[src]


def _targeted(patterns, name: str, cfg_path: str) -> bool:
    """compressed-tensors' matching of `targets` / `ignore` entries against a module name."""
    try:
        return any(
            isinstance(t, str) and (t.startswith("re:") and re.match(t[3:], name) or t == name) for t in patterns or ()
        )
    except re.error as e:
        raise CheckpointError(f"{cfg_path}: quantization_config has an invalid regex ({e})") from None


def _describe(args) -> str:
    if not isinstance(args, dict):
        return repr(args) if args is not None else "null"
    how = "dynamic" if args.get("dynamic") else "static"
    return f"{args.get('num_bits')}-bit {args.get('strategy')} {how}"


def _check_args(got, want: dict, keys, what: str, gname: str, name: str, cfg_path: str):
    if want is None or not isinstance(got, dict):
        if got != want:
            raise CheckpointError(
                f"{cfg_path}: config group {gname!r} says {what}="
                f"{_describe(got)} for {name!r}, the qcompress manifest (and the "
                f"tensors) say {_describe(want)}"
            )
        return
    for key in keys:
        if got.get(key) != want.get(key):
            raise CheckpointError(
                f"{cfg_path}: config group {gname!r} says {what}.{key}="
                f"{got.get(key)!r} for {name!r}, the qcompress manifest says "
                f"{want.get(key)!r}"
            )


def check_quant_config(qc: dict, modules: dict, cfg_path: str):
    """quantization_config (what transformers / vLLM follow) must say what the manifest says.

    The manifest is what the tensors are checked against, so any disagreement means other
    loaders would read the same integers differently: status, ignore, format and the weight and
    input-activation args of every portable module's config group are compared.
    """
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config is {type(qc).__name__}, not an object")
    status = qc.get("quantization_status")
    if status != "compressed":
        raise CheckpointError(
            f"{cfg_path}: quantization_config.quantization_status is {status!r}, "
            "but the tensors are compressed integers (expected 'compressed')"
        )
    groups = qc.get("config_groups") or {}
    groups = groups if isinstance(groups, dict) else {}
    for name, rec in modules.items():
        if not layout.portable(rec):
            continue
        if _targeted(qc.get("ignore"), name, cfg_path):
            raise CheckpointError(
                f"{cfg_path}: quantization_config.ignore lists {name!r}, but the "
                f"checkpoint stores it quantized ({rec['format']})"
            )
        hits = [g for g, s in groups.items() if isinstance(s, dict) and _targeted(s.get("targets"), name, cfg_path)]
        if len(hits) != 1:
            raise CheckpointError(
                f"{cfg_path}: quantized Linear {name!r} is matched by "
                f"{len(hits)} quantization_config.config_groups (expected 1)"
            )
        gname, scheme = hits[0], groups[hits[0]]
        # the group's format is what compressed-tensors uses; loaders older than its per-group
        # key read the top-level one, so that must agree too unless it says mixed-precision
        top = qc.get("format")
        fmt = scheme.get("format") or top
        if fmt == rec["format"] and top not in (None, "mixed-precision"):
            fmt = top
        if fmt != rec["format"]:
            raise CheckpointError(
                f"{cfg_path}: quantization_config gives {name!r} format {fmt!r} "
                f"(config group {gname!r}), but its tensors are {rec['format']}"
            )
        _check_args(
            scheme.get("weights"),
            rec["weights"],
            ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"),
            "weights",
            gname,
            name,
            cfg_path,
        )
        act = rec["input_activations"]
        _check_args(
            scheme.get("input_activations"),
            act and dict(act, type=act.get("type", "int")),
            ("num_bits", "type", "symmetric", "strategy", "dynamic"),
            "input_activations",
            gname,
            name,
            cfg_path,
        )


def check_expert_groups(qc: dict, experts: dict, cfg_path: str):
    """Experts that quantization_config declares (under their per-expert module names) must be
    declared as the tensors hold them; exports that list them nowhere (older ones) pass."""
    groups = qc.get("config_groups") or {}
    groups = groups if isinstance(groups, dict) else {}
    if not isinstance(experts, dict):
        return  # load_experts reports a malformed experts manifest
    for pname, rec in experts.items():
        if not isinstance(rec, dict) or rec.get("weights") is None:
            continue
        for name in layout.expert_modules(rec):
            hits = [g for g, s in groups.items() if isinstance(s, dict) and _targeted(s.get("targets"), name, cfg_path)]
            if not hits:
                continue
            if len(hits) > 1 or _targeted(qc.get("ignore"), name, cfg_path):
                raise CheckpointError(
                    f"{cfg_path}: expert {name!r} of {pname!r} is matched by "
                    f"{len(hits)} quantization_config.config_groups and ignore "
                    f"{'lists' if _targeted(qc.get('ignore'), name, cfg_path) else 'does not list'} it "
                    "(expected exactly one group)"
                )
            scheme = groups[hits[0]]
            fmt = scheme.get("format") or qc.get("format")
            if fmt != rec.get("format"):
                raise CheckpointError(
                    f"{cfg_path}: quantization_config gives expert {name!r} format {fmt!r} "
                    f"(config group {hits[0]!r}), but its tensors are {rec.get('format')}"
                )
            _check_args(
                scheme.get("weights"),
                rec["weights"],
                ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"),
                "weights",
                hits[0],
                name,
                cfg_path,
            )
            act = rec.get("input_activations")
            _check_args(
                scheme.get("input_activations"),
                act and dict(act, type=act.get("type", "int")),
                ("num_bits", "type", "symmetric", "strategy", "dynamic"),
                "input_activations",
                hits[0],
                name,
                cfg_path,
            )


def read_config(folder: str):
    if os.path.exists(folder) and not os.path.isdir(folder):  # e.g. the path of model.safetensors
        raise CheckpointError(
            f"{folder}: not a folder; an export is the folder that holds config.json and the safetensors files"
        )
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
        qc = config["quantization_config"]
        modules = config["qcompress"]["modules"]
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: not a qcompress export config ({type(e).__name__}: {e})") from None
    check_manifest(modules, cfg_path)
    return cfg_path, config, qc, modules


def check_tensors(tensors, where, modules, cfg_path):
    for name, rec in modules.items():
        expected = layout.expected_tensors(rec)
        for suffix in _QUANT_SUFFIXES:  # e.g. an input_scale the record does not quantize with
            key = f"{name}.{suffix}"
            if key in tensors and suffix not in expected:
                raise CheckpointError(
                    f"{cfg_path}: module {name!r} ({rec['format']}, input "
                    f"{_describe(rec['input_activations'])}) has no use for "
                    f"tensor {key!r} in {os.path.basename(where[key])}"
                )
        for suffix, (dt, shape) in expected.items():
            key = f"{name}.{suffix}"
            if key not in tensors:
                raise CheckpointError(
                    f"{cfg_path}: module {name!r} ({rec['format']}) needs tensor "
                    f"{key!r}, which no checkpoint file holds"
                )
            t = tensors[key]
            if str(t.dtype).replace("torch.", "") != dt or list(t.shape) != list(shape):
                raise CheckpointError(
                    f"{where[key]}: tensor {key!r} is {t.dtype} {list(t.shape)}, but config.json implies {dt} {shape}"
                )
        w = rec.get("weights")
        if w is not None and rec["format"] == "int-quantized":
            q = tensors[f"{name}.weight"]
            lo, hi = -(1 << (w["num_bits"] - 1)), (1 << (w["num_bits"] - 1)) - 1
            if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
                raise CheckpointError(
                    f"{where[f'{name}.weight']}: tensor {name + '.weight'!r} holds "
                    f"values outside the {w['num_bits']}-bit range [{lo}, {hi}]"
                )
        if w is not None and rec["format"] == "pack-quantized":
            ws = tensors[f"{name}.weight_shape"].tolist()
            if ws != list(rec["weight_shape"]):
                raise CheckpointError(
                    f"{where[f'{name}.weight_shape']}: tensor {name + '.weight_shape'!r}"
                    f" is {ws}, config.json says {rec['weight_shape']}"
                )


def check_unlisted(unexpected, modules, cfg_path):
    """Quantized tensors the model cannot take: their module is missing from the manifest."""
    for key in unexpected:
        mod, _, suffix = key.rpartition(".")
        if suffix in _QUANT_SUFFIXES and mod not in modules:
            raise CheckpointError(
                f"{cfg_path}: the qcompress manifest does not list module {mod!r}, "
                f"whose quantized tensor {key!r} the checkpoint holds"
            )
