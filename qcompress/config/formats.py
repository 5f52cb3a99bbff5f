"""The `format` key of weight and activation groups: int or a float format per bit width.

`format` is a string (one format at every width) or a mapping {"bits": format} (keys are
strings, as every config key: YAML `"8": fp8_e4m3`). A bit schedule
that passes through widths the mapping does not list keeps the format of the next wider listed
width, so `start_bits: 8, target_bits: 4, format: {"8": fp8_e4m3, "4": nvfp4}` trains FP8 from the
offset until the drop that reaches 4 bits, then NVFP4, with the integer schedule's offsets.
A float format's own width is fixed: fp8_e4m3 and mxfp8 are 8-bit, nvfp4 and mxfp4 4-bit.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from ..errors import ConfigError
from .schema import did_you_mean, join

FORMATS = ("int", "fp8_e4m3", "nvfp4", "mxfp4", "mxfp8")
WIDTH = {"fp8_e4m3": 8, "nvfp4": 4, "mxfp4": 4, "mxfp8": 8}
# granularities each float format defines, and the group size it fixes
GRANULARITIES = {
    "fp8_e4m3": ("tensor", "channel", "token", "group", "block"),
    "nvfp4": ("group",),
    "mxfp4": ("group",),
    "mxfp8": ("group",),
}
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}

Format = Union[str, Tuple[Tuple[int, str], ...]]


def _one(value, path) -> str:
    if not isinstance(value, str) or value.lower() not in FORMATS:
        raise ConfigError(
            path, f"{value!r} is not a number format; choose one of {list(FORMATS)}{did_you_mean(str(value), FORMATS)}"
        )
    return value.lower()


def parse_format(value, path) -> Optional[Format]:
    """A format name, or {bits: name} frozen as ((bits, name), ...) widest first."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value):
        value = {str(k): v for k, v in value}  # the frozen pairs, as to_dict writes them back
    if isinstance(value, dict):
        if not value:
            raise ConfigError(path, "an empty mapping names no format; give {bits: format}")
        out = {}
        for key, name in value.items():
            try:
                bits = int(key)
            except (TypeError, ValueError):
                raise ConfigError(join(path, key), "keys are bit widths (integers)") from None
            fmt = _one(name, join(path, key))
            if fmt != "int" and WIDTH[fmt] != bits:
                raise ConfigError(join(path, key), f"{fmt} is {WIDTH[fmt]}-bit, not {bits}-bit")
            out[bits] = fmt
        return tuple(sorted(out.items(), reverse=True))
    return _one(value, path)


def format_at(fmt: Format, bits: int) -> str:
    """The format in force at `bits`: the listed width's, else the next wider listed width's."""
    if fmt is None:
        return "int"
    if isinstance(fmt, str):
        return fmt
    wider = [name for width, name in fmt if width >= bits]
    return wider[-1] if wider else fmt[0][1]


def _used(fmt: Format, params) -> set:
    """The formats a weight group's schedule passes through."""
    return {format_at(fmt, b) for b in range(params.target_bits, params.start_bits + 1)}


def float_granularity(fmt: Format, params) -> Tuple[str, Optional[int]]:
    """(granularity, group size) of a weight group that quantizes to a float format: a format that
    fixes its group size (nvfp4, mxfp4, mxfp8) sets both, else the group's granularity (tensor
    when unset) and group size. (params: the group's WeightQuantParams; check_weight_group
    refuses what does not fit.)"""
    sizes = {GROUP_SIZE[f] for f in _used(fmt, params) if f in GROUP_SIZE}
    if sizes:
        return "group", min(sizes)  # one size: more are refused
    return params.granularity or "tensor", params.group_size


def check_weight_group(fmt: Format, params, shared, where: str, fmt_at: str) -> None:
    """Refuse impossible combinations for one weight group (fmt: its format, resolved)."""
    used = _used(fmt, params)
    floats = sorted(used - {"int"})
    if params.granularity == "block" and used != {"fp8_e4m3"}:
        raise ConfigError(
            join(where, "params.granularity"),
            f"128 x 128 blocks are an fp8_e4m3 "
            f"granularity; this group quantizes as {sorted(used)} (set format: fp8_e4m3)",
        )
    if not floats:
        return
    if isinstance(fmt, str) and (params.start_bits != WIDTH[fmt] or params.target_bits != WIDTH[fmt]):
        raise ConfigError(
            join(where, "params.start_bits"),
            f"{fmt} is {WIDTH[fmt]}-bit, but the schedule goes {params.start_bits} -> "
            f"{params.target_bits} bits; give the widths as {WIDTH[fmt]}, or step "
            'between formats with a mapping, e.g. format: {"8": fp8_e4m3, "4": nvfp4}',
        )
    if not isinstance(fmt, str):
        listed = dict(fmt)
        for b in (params.start_bits, params.target_bits):
            if b not in listed:
                raise ConfigError(
                    fmt_at,
                    f"lists widths {sorted(listed)}, but the schedule's "
                    f"{'start' if b == params.start_bits else 'target'}_bits {b} is not one",
                )
    if shared.quantization_type != "symmetric":
        raise ConfigError(
            "compression_training.weight_quantization.shared_parameters.quantization_type",
            f"{floats} are symmetric formats (compressed-tensors has no asymmetric FP4, "
            "vLLM serves no asymmetric FP8); use symmetric",
        )
    for key, bad, why in (
        ("numerics", shared.numerics != "default", "float formats use the default numerics"),
        ("rounding", shared.rounding != "nearest", "float formats round to nearest (even)"),
        (
            "quantize_weight_in_forward",
            not shared.quantize_weight_in_forward,
            "float formats fake-quantize in forward; set it to true",
        ),
    ):
        if bad:
            raise ConfigError(f"compression_training.weight_quantization.shared_parameters.{key}", f"{why} ({floats})")
    sizes = {GROUP_SIZE[f] for f in floats if f in GROUP_SIZE}
    if len(sizes) > 1:
        raise ConfigError(
            fmt_at, f"{floats} fix different group sizes {sorted(sizes)}; one group size serves every width of a group"
        )
    gran, gsize = params.granularity, params.group_size
    if sizes:
        (fixed,) = sizes
        if gran not in (None, "group") or gsize not in (None, fixed):
            shown = f"group_size {gsize}" if gran in (None, "group") else f"granularity {gran!r}"
            raise ConfigError(
                join(where, "params.group_size" if gran in (None, "group") else "params.granularity"),
                f"{shown} does not fit {[f for f in floats if f in GROUP_SIZE]}, whose "
                f"groups hold {fixed} elements; drop it or set group_size: {fixed}",
            )
    g = float_granularity(fmt, params)[0]
    for f in used:
        allowed = GRANULARITIES.get(f, ("tensor", "channel", "group"))
        if g not in allowed or (f == "int" and g == "block"):
            raise ConfigError(
                join(where, "params.granularity"), f"{g!r} is not a granularity of {f} (it defines {list(allowed)})"
            )
    if shared.quantize_groups > 1 and gran is None and not sizes:
        raise ConfigError(
            "compression_training.weight_quantization.shared_parameters.quantize_groups",
            f"chunks of the flattened weight are not a granularity of {floats}; set "
            f"{join(where, 'params.granularity')}",
        )


def check_act_group(fmt: str, params, shared, where: str, at: str) -> None:
    """Refuse impossible float activation settings (bits, symmetry, calibration, group size);
    fmt: the group's format, resolved, and `at` the key path where it was set."""
    if fmt == "int":
        if params.group_size is not None:
            raise ConfigError(
                join(where, "params.group_size"),
                "integer activations are per token (dynamic) or per tensor (static); group_size is for float formats",
            )
        return
    if params.bits != WIDTH[fmt]:
        raise ConfigError(join(where, "params.bits"), f"{params.bits} does not match {fmt}, which is {WIDTH[fmt]}-bit")
    if shared.quantization_type != "symmetric":
        raise ConfigError(
            "compression_training.activation_quantization.shared_parameters.quantization_type",
            f"{fmt} activations are symmetric",
        )
    static = shared.range_calibration == "static"
    if fmt in GROUP_SIZE and params.group_size not in (None, GROUP_SIZE[fmt]):
        raise ConfigError(join(where, "params.group_size"), f"{fmt} groups hold {GROUP_SIZE[fmt]} elements")
    if fmt.startswith("mx") and static:
        raise ConfigError(
            at, f"{fmt} activations take per-group E8M0 scales from each batch: range_calibration must be dynamic"
        )
    if fmt == "fp8_e4m3" and static and params.group_size is not None:
        raise ConfigError(
            join(where, "params.group_size"),
            "a static FP8 range is one per tensor; groups need range_calibration: dynamic",
        )
