"""The collective timeout (`comm_timeout_s`, our extension): a stalled or dead rank ends the job
with an error naming the collective and the timeout, instead of blocking the others.

gloo enforces the process group's timeout in every wait and raises a RuntimeError that names
neither the collective nor the setting; the engine's entry points turn it into a
CommTimeoutError that does. NCCL's watchdog aborts the process itself (its message names the
operation and the timeout).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from datetime import timedelta
from typing import Optional

DEFAULT_S = 1800.0  # DeepSpeed's and torch's default for gloo: 30 minutes


class CommTimeoutError(RuntimeError):
    """A collective did not complete within comm_timeout_s: some rank stalled or died."""


def timeout_of(cfg) -> timedelta:
    value = getattr(cfg, "comm_timeout_s", None)
    return timedelta(seconds=DEFAULT_S if value is None else float(value))


def apply_to_existing_group(cfg) -> None:
    """A process group created before initialize() keeps its own timeout unless the config sets
    comm_timeout_s explicitly."""
    if getattr(cfg, "comm_timeout_s", None) is None:
        return
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout_of(cfg))
    except Exception as exc:  # a private torch helper: absent or refusing on some backends
        warnings.warn(
            f"comm_timeout_s={cfg.comm_timeout_s:g} cannot be applied to the process group "
            f"created before initialize() ({exc}); pass timeout= to init_process_group",
            stacklevel=3,
        )


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _named(exc: RuntimeError, what: str, seconds: Optional[float]) -> CommTimeoutError:
    limit = DEFAULT_S if seconds is None else seconds
    return CommTimeoutError(
        f"{what}: not every rank joined within comm_timeout_s={limit:g} s (a rank stalled or died; "
        f"raise comm_timeout_s if a rank legitimately works that long alone). Backend: {exc}"
    )


def _ours(exc: RuntimeError, world_size: int) -> bool:
    return world_size > 1 and not isinstance(exc, CommTimeoutError) and _is_timeout(exc)


@contextlib.contextmanager
def collective(what: str, seconds: Optional[float], world_size: int):
    """Turn a timed-out wait inside the block into a CommTimeoutError naming `what`."""
    try:
        yield
    except RuntimeError as exc:
        if _ours(exc, world_size):
            raise _named(exc, what, seconds) from exc
        raise


def guarded(what):
    """Method decorator: `what` is a string or a function of the engine giving one (asked only
    when a collective timed out, so the hot path pays one try block)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except RuntimeError as exc:
                if _ours(exc, self.world_size):
                    label = what(self) if callable(what) else what
                    raise _named(exc, label, getattr(self.config, "comm_timeout_s", None)) from exc
                raise

        return wrapper

    return deco


def backward_collective(engine) -> str:
    if engine.placement.onebit:
        return "engine.backward: the gradient all-reduce (1-bit optimizer warm-up) / compressed exchange"
    if engine.placement.stage >= 2:
        return "engine.backward: the FSDP2 gradient reduce-scatter"
    return "engine.backward: the gradient all-reduce (DistributedDataParallel)"


def forward_collective(engine) -> str:
    if engine.placement.stage >= 2:
        return "engine.forward: the FSDP2 parameter all-gather"
    return (
        "engine.forward: DistributedDataParallel's buffer broadcast / bucket-order broadcast "
        "(it follows each rank's previous all-reduce)"
    )
