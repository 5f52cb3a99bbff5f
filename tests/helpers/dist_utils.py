"""Spawn helper for multi-process tests: `run_ranks(fn, world_size, *args, timeout=...)`.

The helper itself lives in benchmarks/ranks.py, which the benchmarks share (they never import
tests/); this module keeps the name every test imports."""
from benchmarks.ranks import free_port, run_ranks  # noqa: F401
