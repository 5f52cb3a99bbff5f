"""A small schema layer: frozen dataclasses whose fields say what they accept.

Each config dataclass declares its fields with :func:`field`; :func:`parse` turns a raw mapping
into an instance, checking unknown keys (with a did-you-mean), types, choices and ranges, and
raising :class:`ConfigError` with the full dotted key path. The raw input is never mutated.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Any, Callable, Mapping

from ..errors import ConfigError

_REQUIRED = object()


def field(
    default: Any = _REQUIRED,
    *,
    choices=None,
    ge=None,
    le=None,
    gt=None,
    lt=None,
    alias: str | None = None,
    doc: str = "",
    parse: Callable | None = None,
    lower: bool = False,
    internal: bool = False,
):
    """Declare a config field. `parse(value, path)` may convert nested values itself.
    `internal` fields are set by code, never read from a document (not an allowed key)."""
    meta = dict(
        choices=choices,
        ge=ge,
        le=le,
        gt=gt,
        lt=lt,
        alias=alias,
        doc=doc,
        parse=parse,
        lower=lower,
        required=default is _REQUIRED,
        internal=internal,
    )
    if default is _REQUIRED:
        return dataclasses.field(default=None, metadata=meta)
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def did_you_mean(key, allowed) -> str:
    """' (did you mean 'x'?)' for a misspelt key or value (any type: a non-string never is one)."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_type(value, tp, path):
    """Check a scalar against the annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError(path, f"got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return tuple(_check_type(v, inner, join(path, i)) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        try:
            out = float(value)
        except OverflowError:
            out = math.inf
        if not math.isfinite(out):  # inf or NaN: every use of it would be inf or NaN
            raise ConfigError(path, f"expected a finite number, got {value!r}")
        return out
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    return value


def _check_meta(value, meta, path):
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        hint = did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        shown = ", ".join(str(c).lower() if isinstance(c, bool) else repr(c) for c in choices)
        raise ConfigError(path, f"{value!r} is not allowed; choose one of [{shown}]{hint}")
    for key, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("le", lambda v, b: v <= b, "<="),
        ("gt", lambda v, b: v > b, ">"),
        ("lt", lambda v, b: v < b, "<"),
    ):
        bound = meta.get(key)
        if bound is not None and isinstance(value, (int, float)) and not ok(value, bound):
            raise ConfigError(path, f"{value!r} is out of range; it must be {word} {bound}")


@functools.lru_cache(maxsize=None)
def _layout(cls):
    """(type hints, {document key: field}) of a config dataclass; evaluating the hints is most
    of the cost of a parse, and they never change."""
    hints = typing.get_type_hints(cls)
    by_key = {}
    for f in dataclasses.fields(cls):
        if f.init and not f.metadata.get("internal"):
            by_key[f.metadata.get("alias") or f.name] = f
    return hints, by_key


def parse(cls, raw, path: str = ""):
    """Build the frozen dataclass `cls` from the mapping `raw` (None means all defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping, got {type(raw).__name__} {raw!r}")
    hints, by_key = _layout(cls)
    unknown = [k for k in raw if k not in by_key]
    if unknown:
        key = unknown[0]
        raise ConfigError(
            join(path, key), f"unknown key{did_you_mean(str(key), by_key)}; allowed keys: {sorted(by_key)}"
        )
    values = {}
    for key, f in by_key.items():
        sub = join(path, key)
        meta = f.metadata
        if key not in raw:
            if meta.get("required"):
                raise ConfigError(sub, "is required but missing")
            continue
        value = raw[key]
        if meta.get("lower") and isinstance(value, str):
            value = value.lower()
        if meta.get("parse") is not None:
            value = meta["parse"](value, sub)
        else:
            value = _check_type(value, hints[f.name], sub)
        _check_meta(value, meta, sub)
        values[f.name] = value
    obj = cls(**values)
    check = getattr(obj, "_validate", None)
    if check is not None:
        check(path)
    return obj


def to_dict(obj) -> Any:
    """Plain-data view of a parsed config (tuples become lists), using the original key names."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            if not f.metadata.get("internal"):  # not a document key: load_config would refuse it
                out[f.metadata.get("alias") or f.name] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
