"""load_config: dicts and JSON/YAML files, later sources deep-merged over earlier ones.

Every source is checked as a whole before anything else reads it (`check_document`): string
keys only, finite numbers, no container inside itself (a recursive YAML alias), at most
MAX_DEPTH levels and MAX_VALUES values counted as a tree (YAML aliases that repeat large parts,
"billion laughs", would otherwise expand in every later copy or dump). So every bad document
gives a ConfigError, never another exception.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import warnings
from typing import Any, List, Mapping, Tuple

import yaml

from ..errors import ConfigError
from . import recipes
from .recipes import RENAMED_RECIPES
from .schema import join
from .training import Config, parse_config


# libyaml's parser when PyYAML was built with it (same documents, several times faster);
# the constructor is SafeConstructor either way
_SafeBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeBase):  # type: ignore[valid-type,misc]  # a base chosen at import
    """Safe YAML loader that refuses duplicate keys (a silent override is a config bug)."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:  # a YAML complex key such as `? [1, 2]`
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a string, found {type(key).__name__} {key!r}", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class DuplicateKeyError(ValueError):
    def __init__(self, key):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def unique_pairs(pairs):
    """json object_pairs_hook refusing a key given twice (json keeps the last copy silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


MAX_DEPTH = 50  # nesting levels; DeepSpeed configs use about 6
MAX_VALUES = 20_000  # values counted as a tree (an alias counts every time it is used)


def _path(link) -> str:
    """The dotted key path of a (parent link, key) chain."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = join(path, key)
    return path


_PLAIN = (str, int, bool, type(None))


def check_document(doc: Any, source: str = "") -> None:
    """ConfigError naming the key path (and `source`) for what no config may hold; iterative,
    so any depth or size is refused without exhausting the stack or the memory."""
    where = f" (in {source})" if source else ""
    # (value, path link, depth, ids of the containers above)
    stack: List[Tuple[Any, Any, int, Tuple[int, ...]]] = [(doc, None, 0, ())]
    count = 0
    while stack:
        value, link, depth, above = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(
                _path(link),
                f"the document expands to more than {MAX_VALUES} values{where} (YAML aliases that repeat large parts?)",
            )
        kind = type(value)
        if kind in _PLAIN:
            continue
        if kind is float:
            if not math.isfinite(value):
                raise ConfigError(_path(link), f"{value!r} is not a finite number{where}")
            continue
        if not isinstance(value, (Mapping, list, tuple)):
            continue
        if id(value) in above:
            raise ConfigError(_path(link), f"contains itself{where} (a recursive YAML alias?)")
        if depth >= MAX_DEPTH:
            raise ConfigError(_path(link), f"nested more than {MAX_DEPTH} levels deep{where}")
        inner = above + (id(value),)
        if isinstance(value, Mapping):
            for key, sub in value.items():
                if type(key) is not str:
                    raise ConfigError(
                        _path(link), f"key {key!r} is a {type(key).__name__}; config keys must be strings{where}"
                    )
                stack.append((sub, (link, key), depth + 1, inner))
        else:
            for i, sub in enumerate(value):
                stack.append((sub, (link, i), depth + 1, inner))


# RENAMED_RECIPES (recipes.py): the old names, mapped here with a DeprecationWarning


def _renamed_recipe(path: str) -> str:
    """The new path of a renamed recipe that no longer exists under its old name (with a
    DeprecationWarning), else `path` unchanged."""
    folder, name = os.path.split(path)
    new = RENAMED_RECIPES.get(name)
    if new is None or os.path.exists(path) or not os.path.exists(os.path.join(folder, new)):
        return path
    warnings.warn(
        f"recipe {path} was renamed to {new}; the old name stops working in the next release",
        DeprecationWarning,
        stacklevel=4,
    )
    return os.path.join(folder, new)


def _missing_source(path: str) -> str:
    """The file a source that is not a file stands for: a recipe by name (config/recipes.py), else
    `path`; a name that is no recipe is a ConfigError listing the recipes."""
    named = recipes.find(path)
    if named is not None:
        return named
    base = os.path.basename(path)
    stem = base[:-5] if base.endswith(".yaml") else base
    names = recipes.recipe_names()
    if recipes.is_name(path) and not base.endswith(".json") and names:
        from .schema import did_you_mean

        raise ConfigError(
            path,
            f"no such config file, and no recipe of that name{did_you_mean(stem, names)}; "
            f"the recipes that ship with qcompress: {', '.join(names)}",
        )
    if stem in names and not os.path.exists(path):
        raise ConfigError(
            path,
            f"no such config file; the recipe {stem!r} ships with qcompress: pass its "
            f"name, {stem!r}, to load it from any folder",
        )
    return path


def read_document(path: str | os.PathLike) -> dict:
    """Read one JSON or YAML file into a dict; errors name the file. A source that is no file but
    a recipe's name (`w4a8_g128`, `w4a8_g128.yaml`) reads that recipe."""
    path = os.fspath(path)
    if not os.path.exists(path):
        path = _missing_source(path)
    path = _renamed_recipe(path)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(path, f"cannot read config file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"not UTF-8 text ({err})") from None
    return parse_document(text, path)


def parse_document(text: str, name: str) -> dict:
    """Parse the text of a config file (JSON when `name` ends in .json, else YAML) into a
    checked dict; errors name `name`."""
    path = name
    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        if kind == "JSON":
            doc = json.loads(text, object_pairs_hook=unique_pairs)
        else:
            doc = yaml.load(text, Loader=_UniqueKeyLoader)  # safe: SafeConstructor only
    except (ValueError, yaml.YAMLError) as err:
        # PyYAML marks a string source as "<unicode string>": name the file there too
        raise ConfigError(path, f"not valid {kind}: {str(err).replace('<unicode string>', path)}") from None
    except (IndexError, TypeError, AttributeError, KeyError, OverflowError) as err:
        # PyYAML's constructors fail this way on explicitly tagged values that do not fit their
        # tag (`x: !!float` with no value raises IndexError)
        raise ConfigError(
            path, f"not valid {kind}: a value does not fit its tag ({type(err).__name__}: {err})"
        ) from None
    except RecursionError:
        raise ConfigError(
            path, f"not a usable {kind} document: nested too deeply (at most {MAX_DEPTH} levels)"
        ) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(path, f"top level must be a mapping, got {type(doc).__name__}")
    check_document(doc, path)
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
    docs = []  # (name, document) in merge order
    doc: Mapping[str, Any]
    for i, src in enumerate(sources):
        if isinstance(src, Config):
            doc, name = src.raw, f"source {i + 1} (a parsed Config)"
        elif isinstance(src, Mapping):
            doc, name = src, f"source {i + 1} (a dict)"
            check_document(doc, name if len(sources) > 1 else "")
        elif isinstance(src, (str, os.PathLike)):
            doc, name = read_document(src), os.fspath(src)
        else:
            raise ConfigError("", f"config source must be a dict or a file path, got {type(src).__name__}")
        docs.append((name, doc))
        merged = deep_merge(merged, doc)
    try:
        cfg = parse_config(merged)
    except ConfigError as err:
        origin = _origin(err.path, docs)
        if origin is None:
            raise
        message = str(err)[len(err.path) + 2 :] if err.path else str(err)
        raise ConfigError(err.path, f"{message} (in {origin})") from None
    # kept (not a field: no effect on equality or export) so errors found later, when the config
    # meets the model (init_compression), can name the file too
    object.__setattr__(cfg, "_sources", tuple(docs))
    return cfg


def source_of(cfg: Config, path: str) -> str:
    """' (in FILE)' for the source `cfg` took the key `path` from, as load_config's own errors
    name it; '' when there is nothing to name (a single dict, a Config not made by load_config)."""
    docs = getattr(cfg, "_sources", None)
    origin = _origin(path, docs) if docs else None
    return f" (in {origin})" if origin else ""


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
