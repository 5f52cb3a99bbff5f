"""Compression state of pipeline stages in checkpoints, in the flattened form of
qcompress/serialize.py ({"__dict__": [[key, value], ...]}).

Each stage's CompressionScheduler holds its own modules only. A checkpoint records the union
(every stage's skeleton gathered into engine.json), so any mesh can load it: a stage takes the
entries of its own modules, one process all of them.
"""

from __future__ import annotations

from typing import Any, Iterable, List

from .transfer import all_gather_json


def _modules(skel: Any) -> List[list]:
    """The [name, entry] list of a flattened CompressionScheduler.state_dict()."""
    return dict(skel["__dict__"])["modules"]["__dict__"]


def _with_modules(skel: Any, entries: List[list]) -> Any:
    return {"__dict__": [[k, {"__dict__": entries} if k == "modules" else v] for k, v in skel["__dict__"]]}


def merged_compression(skel: Any, engine) -> Any:
    """Collective under pipeline stages: this rank's skeleton with every stage's modules."""
    if skel is None or getattr(engine, "pipeline", None) is None:
        return skel
    entries = {}
    for other in all_gather_json(skel, engine.device):
        for name, entry in _modules(other):
            entries.setdefault(name, entry)  # a stage's tensor-parallel ranks hold the same
    return _with_modules(skel, [[n, e] for n, e in entries.items()])


def own_compression(skel: Any, names: Iterable[str]) -> Any:
    """The skeleton restricted to the modules `names` (this stage's)."""
    keep = set(names)
    return _with_modules(skel, [[n, e] for n, e in _modules(skel) if n in keep])
