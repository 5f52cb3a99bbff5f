"""The rank spawner the multi-process benchmarks use (qcompress/spawn.py)."""

from qcompress.spawn import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
