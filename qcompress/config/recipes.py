"""The ready-made recipes (schedules/*.yaml) by name: load_config(train, "w4a8_g128").

They live in `schedules/` at the top of a source checkout and are installed inside the package as
`qcompress/schedules` (setup.py), so a name works from any folder, with or without a checkout. A
path that exists always wins over a name.
"""
from __future__ import annotations

import os
from typing import List, Optional

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # .../qcompress


def recipes_dir() -> Optional[str]:
    """The folder of the recipes: inside the installed package, else the checkout's schedules/."""
    for folder in (os.path.join(_PACKAGE, "schedules"), os.path.join(os.path.dirname(_PACKAGE), "schedules")):
        if os.path.isfile(os.path.join(folder, "w8a8.yaml")):
            return folder
    return None


def recipe_names() -> List[str]:
    folder = recipes_dir()
    if folder is None:
        return []
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def is_name(source: str) -> bool:
    """Whether a source string can be a recipe name: no folder part."""
    return os.path.basename(source) == source and bool(source)


def find(name: str) -> Optional[str]:
    """The recipe file a name (`w4a8_g128` or `w4a8_g128.yaml`) stands for, or None. Old names
    (config/loader.py RENAMED_RECIPES) are left to the loader, which warns and maps them."""
    folder = recipes_dir()
    if folder is None or not is_name(name):
        return None
    base = name[:-5] if name.endswith(".yaml") else name
    path = os.path.join(folder, base + ".yaml")
    if os.path.isfile(path):
        return path
    from .loader import RENAMED_RECIPES
    if base + ".yaml" in RENAMED_RECIPES:
        return path          # the loader maps the old name to the new file, with its warning
    return None
