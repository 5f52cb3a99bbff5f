"""config.json content: the compressed-tensors `quantization_config` and qcompress's manifest.

Only nn.Linear modules go into `config_groups` (what compressed-tensors, transformers and vLLM
load). Conv, Embedding and HF Conv1D weights are stored with the same tensor suffixes but are
listed only in the `qcompress` manifest, which `load_quantized` reads. QuantizationArgs carry
only the portable keys (no scale_dtype / zp_dtype, which loaders pinned to <=0.12 reject).
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional

MANIFEST_VERSION = 1
PORTABLE_STRATEGIES = ("tensor", "channel", "group", "token", "tensor_group")


def weight_args(e) -> dict:
    if getattr(e, "args", None) is not None:  # float formats: export/floats.py
        return dict(e.args)
    return {
        "num_bits": e.bits,
        "type": "int",
        "symmetric": e.symmetric,
        "strategy": e.strategy,
        "group_size": e.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": e.observer,
        "observer_kwargs": dict(e.observer_kwargs),
        "block_structure": None,
    }


def input_args(a: Optional[dict]) -> Optional[dict]:
    if a is None:
        return None
    if a.get("type") == "float":
        return dict(a)
    return {
        "num_bits": a["num_bits"],
        "type": "int",
        "symmetric": a["symmetric"],
        "strategy": a["strategy"],
        "group_size": None,
        "dynamic": a["dynamic"],
        "actorder": None,
        "observer": a["observer"],
        "observer_kwargs": dict(a.get("observer_kwargs") or {}),
        "block_structure": None,
    }


def exact_target(names: List[str]) -> str:
    """One `re:` target matching exactly these module names (compressed-tensors uses re.match)."""
    return "re:^(?:" + "|".join(re.escape(n) for n in names) + ")$"


def portable(m: dict) -> bool:
    """Whether compressed-tensors can load this manifest record (nn.Linear, whole groups)."""
    if m["kind"] != "linear":
        return False
    if (m["input_activations"] or {}).get("strategy", "token") not in PORTABLE_STRATEGIES:
        return False
    w = m["weights"]
    if w is not None and w["strategy"] == "group" and m["weight_shape"][1] % w["group_size"]:
        return False  # compressed-tensors needs in_features divisible by group_size
    return True


def _group_names(groups: Dict[str, dict]) -> Dict[str, str]:
    """key -> config group name, weight groups first once the names are sorted.

    transformers (5.x) decompresses every Linear with the first config group's scheme, and
    config.json is written with sorted keys, so an activation-only group must not sort first.
    """
    order = sorted(groups, key=lambda k: groups[k]["scheme"]["weights"] is None)
    width = len(str(len(order) - 1))
    return {k: f"group_{i:0{width}d}_{groups[k]['base']}" for i, k in enumerate(order)}


def _scheme(rec: dict) -> dict:
    return {
        "weights": rec["weights"],
        "input_activations": input_args(rec["input_activations"]),
        "output_activations": None,
        "format": rec["format"],
    }


def quantization_config(
    modules: Dict[str, dict], plain_linears: List[str], experts: Optional[Dict[str, dict]] = None
) -> dict:
    """The compressed-tensors schema of everything a compressed-tensors reader can load.

    Linear layers are matched by their exact names; MoE experts by the per-expert module names that
    vLLM asks for (`{experts}.{e}.{gate,up,down}_proj`, Mixtral's `w1/w3/w2`) and that the tensors are
    written under (`expert_targets`). What only qcompress.load_quantized reads (Conv, Embedding,
    transformers' Conv1D, partial groups, gpt-oss' fused experts) goes to `ignore` and to the refusal
    group, so that no loader applies a scheme to it or loads it as float weights."""
    groups: Dict[str, dict] = {}
    members: Dict[str, List[str]] = {}

    def add(rec, fragments):
        scheme = _scheme(rec)
        key = json.dumps(scheme, sort_keys=True)
        if key not in groups:
            groups[key] = {"base": rec["group"] or "group", "scheme": scheme}
            members[key] = []
        members[key].extend(fragments)

    for name, m in modules.items():
        if portable(m):
            add(m, [name])
    local_only = sorted(n for n, m in modules.items() if m["weights"] is not None and not portable(m))
    reasons = [unportable_reason(modules[n]) for n in local_only]
    ignore = list(plain_linears) + local_only
    for name, rec in sorted((experts or {}).items()):
        if rec["weights"] is None:
            continue  # input-only experts: no weight scheme for a loader to pick
        fragments = expert_targets(rec)
        if rec.get("streamed"):
            # gpt-oss: vLLM reads these names; transformers reads gpt-oss experts only unquantized,
            # so the refusal group keeps it from loading them as random weights (vLLM ignores it)
            local_only.append(name)
            reasons.append("gpt-oss experts under vLLM's per-expert names, which transformers does not read")
        if fragments is None:
            local_only.append(name)
            reasons.append("fused experts (gpt-oss layout), which vLLM and transformers do not read quantized")
            ignore.append(name)
            continue
        add(rec, fragments)
    formats = sorted({g["scheme"]["format"] for g in groups.values()})
    mixed = len(formats) > 1
    config_groups = {}
    for key, gname in _group_names(groups).items():
        # every group names its format: without it compressed-tensors infers one from the scheme
        # (W4A8 -> int-quantized, int-quantized 8-bit next to activations -> another layout) and
        # transformers builds modules the tensors do not fit
        scheme = dict(groups[key]["scheme"])
        # Linears by their plain names (vLLM maps those to its own module names, e.g. gpt-oss'
        # self_attn -> attn; it leaves `re:` targets as they are), experts by one pattern per projection
        names = [m for m in members[key] if not m.startswith("re:")]
        scheme["targets"] = names + [m for m in members[key] if m.startswith("re:")]
        config_groups[gname] = scheme
    weight_schemes = [g["weights"] for g in config_groups.values() if g["weights"] is not None]
    if len({json.dumps(w, sort_keys=True) for w in weight_schemes}) > 1:
        config_groups[GUARD_GROUP] = guard_scheme(weight_schemes[0])
    if local_only:
        config_groups[REFUSAL_GROUP] = refusal_scheme(local_only, reasons)
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if mixed else (formats[0] if formats else "dense"),
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


# gpt-oss' fused experts -> the per-expert names vLLM's gpt-oss loader streams (w13 = gate and up)
STREAMED = {"gate_up_proj": ("w13", ("gate_proj", "up_proj")), "down_proj": ("w2", ("down_proj",))}


def streamed_modules(st: dict, n_experts: int) -> List[str]:
    """The per-expert module names vLLM's compressed-tensors config is asked for (its
    get_moe_method asks `{prefix}.0.gate_proj`, `.up_proj`, `.down_proj`)."""
    leaf = next(k for k, v in STREAMED.items() if v[0] == st["param"])
    return [f"{st['prefix']}.{e}.{p}" for e in range(n_experts) for p in STREAMED[leaf][1]]


_EXPERT_PIECE = re.compile(r"^(.*)\.(\d+)\.([^.]+)\.weight$")


def expert_modules(rec: dict) -> List[str]:
    """The per-expert Linear names an experts record is written under (`...experts.3.gate_proj`);
    for gpt-oss' streamed experts, the names vLLM asks its config for."""
    if rec.get("streamed"):
        return streamed_modules(rec["streamed"], rec["shape"][0])
    return [saved[: -len(".weight")] for saved, *_ in rec.get("pieces") or ()]


def expert_targets(rec: dict) -> Optional[List[str]]:
    """`targets` entries matching exactly the per-expert module names of an experts record: one
    `re:` pattern per projection that every expert has, plain names otherwise; None for a fused
    (gpt-oss) record."""
    if rec.get("streamed"):
        # one pattern per record (vLLM leaves `re:` targets as they are; its gpt-oss name mapper
        # would turn a plain `...experts.0.down_proj` into `...experts.0.w2_weight`)
        names = sorted({n.rsplit(".", 1)[1] for n in expert_modules(rec)})
        return ["re:^" + re.escape(rec["streamed"]["prefix"]) + r"\.\d+\.(?:" + "|".join(names) + ")$"]
    if rec.get("fused") is not None or not rec.get("pieces"):
        return None
    n_experts = rec["shape"][0]
    seen: Dict[tuple, set] = {}
    loose: List[str] = []
    for saved, e, _, _ in rec["pieces"]:
        m = _EXPERT_PIECE.match(saved)
        if m is None or int(m.group(2)) != e:
            loose.append(saved[: -len(".weight")] if saved.endswith(".weight") else saved)
            continue
        seen.setdefault((m.group(1), m.group(3)), set()).add(e)
    out = []
    for (prefix, proj), es in sorted(seen.items()):
        if es == set(range(n_experts)):
            out.append("re:^" + re.escape(prefix) + r"\.\d+\." + re.escape(proj) + "$")
        else:
            out.extend(f"{prefix}.{e}.{proj}" for e in sorted(es))
    return out + loose


# A config group that no compressed-tensors reader accepts (QuantizationScheme forbids unknown
# keys), written when some quantized weights have no config group (transformers' Conv1D, Conv,
# Embedding, Linears with partial groups): transformers would load those modules with random
# weights, so it must refuse the export instead. Its names carry the message, as pydantic shortens
# the value in its error.
REFUSAL_GROUP = "qcompress_only_export"
REFUSAL_KEY = "transformers_cannot_load_these_weights_use_qcompress_load_quantized"


def unportable_reason(m: dict) -> str:
    """Why portable(m) is False, in a few words."""
    kind = {"hf_conv1d": "transformers Conv1D", "conv": "convolution", "embedding": "embedding"}.get(m["kind"])
    if kind:
        return kind
    w = m["weights"]
    if w is not None and w["strategy"] == "group" and m["weight_shape"][1] % w["group_size"]:
        return f"in_features {m['weight_shape'][1]} not a multiple of group_size {w['group_size']}"
    return f"input activations per {(m['input_activations'] or {}).get('strategy')}"


def refusal_scheme(names: List[str], reasons: Optional[List[str]] = None) -> dict:
    reasons = reasons or [""] * len(names)
    shown = ", ".join(f"{n} ({r})" if r else n for n, r in zip(names[:3], reasons)) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    return {
        "targets": [],
        "weights": None,
        "input_activations": None,
        "output_activations": None,
        REFUSAL_KEY: (
            f"{len(names)} quantized modules ({shown}) are not nn.Linear layers with whole "
            "groups, which is all compressed-tensors' transformers loader quantizes: "
            "transformers would load them with random weights; use "
            "qcompress.load_quantized(folder, model), or leave them out of the weight "
            "groups' modules for an export transformers loads"
        ),
    }


# With several weight schemes, transformers' dequantize=True path (it decompresses every Linear
# with the first config group's scheme) would load some layers with wrong weights. A first group
# (sorted names: "_" before "group_") that matches no module and names a format compressed-tensors
# has no decompressor for (marlin-24, a legacy format) makes that path fail instead; plain
# from_pretrained applies each group's own scheme and loads right; load_quantized skips it.
GUARD_GROUP = "_qcompress_several_weight_schemes"


def guard_scheme(weights: dict) -> dict:
    return {
        "targets": ["re:^$"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": "marlin-24",
    }


def transformers_caveat(qc: dict) -> Optional[str]:
    """What transformers cannot do with this quantization_config, or None.

    transformers 5.x with `dequantize=True` decompresses every (non-expert) Linear with the first
    config group's scheme (integrations/compressed_tensors.py get_dense_scheme); the guard group
    makes it refuse such checkpoints, which plain `from_pretrained` loads right.
    """
    schemes = [g for n, g in qc["config_groups"].items() if g["weights"] is not None and n != GUARD_GROUP]
    formats = sorted({g.get("format") or qc["format"] for g in schemes})
    how = "; plain from_pretrained loads it"
    if formats == ["int-quantized", "pack-quantized"]:
        return (
            "transformers (5.x) cannot load checkpoints that mix int-quantized and "
            "pack-quantized config groups with CompressedTensorsConfig(dequantize=True)" + how
        )
    distinct = {json.dumps(g["weights"], sort_keys=True) for g in schemes}
    if len(distinct) > 1:
        return (
            "transformers (5.x) with CompressedTensorsConfig(dequantize=True) decompresses every "
            f"Linear with the first config group's weight scheme, and this checkpoint has {len(distinct)} "
            "different ones: it refuses to load it that way" + how
        )
    return None


def module_record(kind: str, group: Optional[str], entry, act: Optional[dict]) -> dict:
    rec = {"kind": kind, "group": group, "input_activations": act}
    if entry is None:
        rec.update(format="dense", weights=None)
        return rec
    rec.update(
        format=entry.fmt,
        weights=weight_args(entry),
        qtype=entry.qtype,
        weight_shape=entry.shape,
        dtype=entry.dtype,
        transposed=entry.transposed,
        target_bits=entry.target_bits,
    )
    return rec


def expected_tensors(rec: dict) -> Dict[str, tuple]:
    """suffix -> (dtype name, shape) that a manifest record promises, for load-time checks."""
    import math
    from .floats import expected_tensors as float_tensors, is_float_record

    if is_float_record(rec):
        return float_tensors(rec)
    out = {}
    act = rec.get("input_activations")
    if act and not act["dynamic"]:
        out["input_scale"] = ("float32", [1])
        if not act["symmetric"]:
            out["input_zero_point"] = ("int8", [1])
    w = rec.get("weights")
    if w is None:
        return out
    shape = rec["weight_shape"]
    rows, k = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    bits, strat = w["num_bits"], w["strategy"]
    ng = 1 if strat in ("tensor", "channel") else math.ceil(k / w["group_size"])
    sshape = [1] if strat == "tensor" else [rows, ng]
    out["weight_scale"] = ("float32", sshape)
    if rec["format"] == "pack-quantized":
        out["weight_packed"] = ("int32", [rows, math.ceil(k * bits / 32)])
        out["weight_shape"] = ("int64", [len(shape)])
        if not w["symmetric"]:
            out["weight_zero_point"] = (
                ("int8", [1]) if strat == "tensor" else ("int32", [math.ceil(rows * bits / 32), ng])
            )
    else:
        out["weight"] = ("int8", shape)
        if not w["symmetric"]:
            out["weight_zero_point"] = ("int8", sshape)
    return out
