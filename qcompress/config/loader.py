"""load_config: dicts and JSON/YAML files, later sources deep-merged over earlier ones."""
from __future__ import annotations

import copy
import json
import os
import re
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

    Later sources override earlier ones key by key; the inputs are never mutated. An error in the
    merged document names the source its bad key or value came from.
    """
    if not sources:
        raise ConfigError("", "load_config needs at least one source (a dict or a file path)")
    merged: dict = {}
    docs = []          # (name, document) in merge order
    for i, src in enumerate(sources):
        if isinstance(src, Config):
            doc, name = src.raw, f"source {i + 1} (a parsed Config)"
        elif isinstance(src, Mapping):
            doc, name = src, f"source {i + 1} (a dict)"
        elif isinstance(src, (str, os.PathLike)):
            doc, name = read_document(src), os.fspath(src)
        else:
            raise ConfigError("", f"config source must be a dict or a file path, got {type(src).__name__}")
        docs.append((name, doc))
        merged = deep_merge(merged, doc)
    try:
        return parse_config(merged)
    except ConfigError as err:
        origin = _origin(err.path, docs)
        if origin is None:
            raise
        message = str(err)[len(err.path) + 2:] if err.path else str(err)
        raise ConfigError(err.path, f"{message} (in {origin})") from None


_TOKEN = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def _depth(doc, path: str) -> int:
    """How many leading components of the dotted key path `doc` holds."""
    depth, node = 0, doc
    for index, key in _TOKEN.findall(path):
        if index and isinstance(node, (list, tuple)) and int(index) < len(node):
            node = node[int(index)]
        elif key and isinstance(node, Mapping) and key in node:
            node = node[key]
        else:
            break
        depth += 1
    return depth


def _origin(path: str, docs) -> str | None:
    """The source a bad key path came from: the last one (it wins the merge) that holds the
    deepest part of the path. None for a single dict, which has nothing to name."""
    if len(docs) == 1:
        name = docs[0][0]
        return None if name.startswith("source ") else name
    depths = [_depth(doc, path) for _, doc in docs]
    best = max(depths)
    if best == 0:
        return "the merge of " + ", ".join(name for name, _ in docs)
    return [name for (name, _), d in zip(docs, depths) if d == best][-1]


def as_config(cfg: Any) -> Config:
    """Accept a Config, a dict or a path wherever a config is expected."""
    return cfg if isinstance(cfg, Config) else load_config(cfg)
