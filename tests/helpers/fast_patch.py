"""Patching a name of the fast-mode package (qcompress.export.fast) where its code reads it: the
package's modules import their helpers by name, so a name is patched in each module that binds it."""

import importlib
import pkgutil

import qcompress.export.fast as fast


def patch_fast(monkeypatch, name: str, value) -> None:
    mods = [fast] + [importlib.import_module(f"{fast.__name__}.{m.name}") for m in pkgutil.iter_modules(fast.__path__)]
    hit = [m for m in mods if name in vars(m)]
    assert hit, f"no module of {fast.__name__} defines {name}"
    for m in hit:
        monkeypatch.setattr(m, name, value)
