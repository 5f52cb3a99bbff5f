"""load_config: dicts and JSON/YAML files, later sources deep-merged over earlier ones."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

import yaml

from ..errors import ConfigError
from .training import Config, parse_config


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML loader that refuses duplicate keys (a silent override is a config bug)."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_document(path: str | os.PathLike) -> dict:
    """Read one JSON or YAML file into a dict; errors name the file."""
    path = os.fspath(path)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(path, f"cannot read config file ({err.strerror})") from None
    try:
        if path.endswith(".json"):
            doc = json.loads(text, object_pairs_hook=_no_duplicates)
        else:
            doc = yaml.load(text, Loader=_UniqueKeyLoader)  # safe: subclass of SafeLoader
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(path, f"not valid {'JSON' if path.endswith('.json') else 'YAML'}: {err}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(path, f"top level must be a mapping, got {type(doc).__name__}")
    return doc


def deep_merge(base: Mapping, override: Mapping) -> dict:
    """Return a new dict: `override` merged into `base`, recursively for nested mappings."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_config(*sources: Any) -> Config:
    """Load and merge config sources (dict, JSON/YAML path, or an already parsed Config).

    Later sources override earlier ones key by key; the inputs are never mutated.
    """
    if not sources:
        raise ConfigError("", "load_config needs at least one source (a dict or a file path)")
    merged: dict = {}
    names = []
    for src in sources:
        if isinstance(src, Config):
            doc = src.raw
            names.append("<Config>")
        elif isinstance(src, Mapping):
            doc = src
            names.append("<dict>")
        elif isinstance(src, (str, os.PathLike)):
            doc = read_document(src)
            names.append(os.fspath(src))
        else:
            raise ConfigError("", f"config source must be a dict or a file path, got {type(src).__name__}")
        merged = deep_merge(merged, doc)
    try:
        return parse_config(merged)
    except ConfigError as err:
        if len(names) == 1 and names[0] not in ("<dict>", "<Config>"):
            raise ConfigError(err.path, f"{err.args[0].split(': ', 1)[-1]} (in {names[0]})") from None
        raise


def as_config(cfg: Any) -> Config:
    """Accept a Config, a dict or a path wherever a config is expected."""
    return cfg if isinstance(cfg, Config) else load_config(cfg)
