"""The ready-made recipes (schedules/*.yaml) by name: load_config(train, "w4a8_g128").

They live in `schedules/` at the top of a source checkout and are installed inside the package as
`qcompress/schedules` (setup.py), so a name works from any folder, with or without a checkout. A
path that exists always wins over a name.
"""

from __future__ import annotations

import os
from typing import List, Optional

# Recipe files renamed to one scheme (w<bits>a<bits>[_g<group>][_variant], fragments with_*): the
# old names still load for one release, with a warning naming the new file.
RENAMED_RECIPES = {
    "w4_group128.yaml": "w4a16_g128.yaml",
    "w4_group32.yaml": "w4a16_g32.yaml",
    "w3_group32.yaml": "w3a16_g32.yaml",
    "xtc_binary.yaml": "w1a8_xtc.yaml",
    "mse_observer.yaml": "with_mse_observer.yaml",
    "range_learning.yaml": "with_range_learning.yaml",
    "qad_range_learning.yaml": "with_qad_range_learning.yaml",
    "onebit_adam.yaml": "with_onebit_adam.yaml",
}

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../qcompress


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
    """The recipe file a name (`w4a8_g128` or `w4a8_g128.yaml`) stands for, or None. An old name
    (RENAMED_RECIPES) gives its old path: the loader warns and maps it to the new file."""
    folder = recipes_dir()
    if folder is None or not is_name(name):
        return None
    base = name[:-5] if name.endswith(".yaml") else name
    path = os.path.join(folder, base + ".yaml")
    if os.path.isfile(path):
        return path
    if base + ".yaml" in RENAMED_RECIPES:
        return path  # the loader maps the old name to the new file, with its warning
    return None
