"""Recipe names: the old file names still load (with a DeprecationWarning) as the renamed files do,
and schedules/README.md lists every recipe and every old name, with the right kind."""

import os
import re
import shutil
import warnings

import pytest

import qcompress as qc
from qcompress.config.loader import RENAMED_RECIPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = os.path.join(ROOT, "schedules")


def _rows(table_head: str):
    """The first-column names and the rows of the README table that starts with `table_head`."""
    with open(os.path.join(SCHEDULES, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(table_head)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("old,new", sorted(RENAMED_RECIPES.items()))
def test_old_name_loads_the_renamed_file_with_a_deprecation_warning(old, new):
    assert not os.path.exists(os.path.join(SCHEDULES, old)), f"{old} still exists: nothing is renamed"
    with pytest.warns(DeprecationWarning, match=re.escape(f"was renamed to {new}")):
        got = qc.load_config(os.path.join(SCHEDULES, old))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new name loads without one
        want = qc.load_config(os.path.join(SCHEDULES, new))
    assert got == want and got.raw == want.raw


def test_old_name_merges_like_the_new_one():
    base = os.path.join(SCHEDULES, "w4a16_g32.yaml")
    with pytest.warns(DeprecationWarning, match="mse_observer.yaml was renamed to with_mse_observer.yaml"):
        got = qc.load_config(base, os.path.join(SCHEDULES, "mse_observer.yaml"))
    assert got == qc.load_config(base, os.path.join(SCHEDULES, "with_mse_observer.yaml"))
    assert got.compression.weight_quantization.shared.observer == "mse"


def test_a_file_that_really_has_an_old_name_is_read_as_it_is(tmp_path):
    """Only a missing old name is redirected: a user's own file called w4_group32.yaml is theirs."""
    shutil.copy(os.path.join(SCHEDULES, "w8a8.yaml"), tmp_path / "w4_group32.yaml")
    shutil.copy(os.path.join(SCHEDULES, "w4a16_g32.yaml"), tmp_path / "w4a16_g32.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = qc.load_config(str(tmp_path / "w4_group32.yaml"))
    assert got == qc.load_config(os.path.join(SCHEDULES, "w8a8.yaml"))


def test_readme_lists_every_recipe_with_its_kind():
    rows = _rows("| recipe |")
    files = sorted(f for f in os.listdir(SCHEDULES) if f.endswith((".yaml", ".yml", ".json")))
    assert sorted(r[0] for r in rows) == files
    for name, *_, kind in rows:
        cfg = qc.load_config(os.path.join(SCHEDULES, name))
        quantizes = cfg.compression.weight_quantization.enabled or cfg.compression.activation_quantization.enabled
        # a fragment configures nothing to quantize alone, and is named with_*
        assert kind == ("full" if quantizes else "fragment"), name
        assert name.startswith("with_") == (kind == "fragment"), name


def test_readme_lists_every_old_name():
    assert {r[0]: r[1] for r in _rows("| old name |")} == RENAMED_RECIPES
