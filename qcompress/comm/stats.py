"""Per-rank byte counters for every collective qcompress.comm and qcompress.optim issue.

Counting rule (payload bytes, exact, independent of the backend's internal algorithm):
- all_to_all_single with equal splits of B bytes per peer: sent (P-1)*B, received (P-1)*B
  (the chunk a rank keeps for itself does not travel).
- all_gather_into_tensor of a B-byte chunk: sent (P-1)*B (this rank's chunk to every other rank),
  received (P-1)*B (every other rank's chunk).
- all_reduce of B bytes (uncompressed paths: DDP hook warmup, optimizer.sync_gradients and the
  gradients of non_freeze groups, one all_reduce per gradient dtype): the ring volume,
  sent = received = 2*(P-1)*B // P.
- the hostname exchange that detects nodes (hierarchy "auto" / "node", once per group): an
  all-gather of a 32-byte digest, counted as above: (P-1)*32 each way.
- reduce / broadcast of B bytes inside a node (hierarchical mode): a non-root sends (reduce) or
  receives (broadcast) B; the root receives (reduce) or sends (broadcast) (L-1)*B.
Collectives over a group of one rank move nothing and count nothing.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts = {"bytes_sent": 0, "bytes_received": 0}
_running = {"bytes_sent": 0, "bytes_received": 0}  # never reset: the engine's counter reads differences


def add(sent: int, received: int) -> None:
    """Record one collective's traffic for this rank."""
    with _lock:
        for d in (_counts, _running):
            d["bytes_sent"] += int(sent)
            d["bytes_received"] += int(received)


def running_totals() -> dict:
    """Like stats(), but since the process started (reset_stats() leaves it alone)."""
    with _lock:
        return dict(_running)


def stats() -> dict:
    """This rank's cumulative {"bytes_sent": int, "bytes_received": int} since the last reset_stats()."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    """Zero this rank's byte counters."""
    with _lock:
        _counts["bytes_sent"] = 0
        _counts["bytes_received"] = 0
