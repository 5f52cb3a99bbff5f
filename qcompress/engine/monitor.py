"""Training logs as DeepSpeed's monitor writes them, from the config's `tensorboard` and `csv_monitor`.

Both write under output_path/job_name on rank 0 only: TensorBoard event files through
torch.utils.tensorboard, and one CSV file per metric (`Train/Samples/lr` -> Train_Samples_lr.csv,
header `step,lr`, then `step,value` rows). Every write_events call is flushed, so a crash loses
little, and CSV files are appended to, so a resumed run continues them (loading a checkpoint
first drops the rows, and TensorBoard's events, past its step: see Monitor.resume_at).
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from typing import Dict, Iterable, Optional, Tuple

Event = Tuple[str, float, int]


def log_dir(section) -> str:
    """output_path/job_name, as DeepSpeed joins them ('' output_path: the current directory)."""
    return os.path.join(section.output_path, section.job_name)


class CSVLog:
    """One `<name with / and spaces as _>.csv` per metric, kept open and flushed per batch of events."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._files: Dict[str, tuple] = {}

    def _writer(self, name: str):
        if name not in self._files:
            path = os.path.join(self.directory, name.replace("/", "_").replace(" ", "_") + ".csv")
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            f = open(path, "a", newline="")
            w = csv.writer(f)
            if fresh:  # a resumed run appends rows under the header the first run wrote
                w.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[name] = (f, w)
        return self._files[name][1]

    def write(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self._writer(name).writerow([step, value])  # floats as repr: they read back exactly

    def flush(self) -> None:
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` from every CSV here: a run resumed from an earlier checkpoint
        writes those steps again (each file is rewritten beside and renamed into place)."""
        from .. import atomic

        self.close()
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if not name.endswith(".csv") or not os.path.isfile(path):
                continue
            with open(path, newline="") as fh:
                rows = list(csv.reader(fh))
            keep = rows[:1] + [r for r in rows[1:] if not (r and r[0].lstrip("-").isdigit() and int(r[0]) > step)]
            if len(keep) == len(rows):
                continue
            out = io.StringIO()
            csv.writer(out).writerows(keep)
            tmp = f"{path}.tmp{os.getpid()}"
            atomic.remove_quietly(tmp)
            atomic.write_text_new(tmp, out.getvalue())
            atomic.fs_replace(tmp, path)


def _summary_writer(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        warnings.warn(
            f"tensorboard.enabled is true, but TensorBoard is not installed ({err}); no event "
            "files are written. Install it with: pip install tensorboard",
            stacklevel=4,
        )
        return None
    os.makedirs(directory, exist_ok=True)
    return SummaryWriter(log_dir=directory)


class Monitor:
    """Writes (name, value, step) events to the enabled backends; a no-op off rank 0 or when both
    sections are disabled (`enabled` is False then)."""

    def __init__(self, tensorboard=None, csv_monitor=None, rank: int = 0):
        self.tensorboard_dir: Optional[str] = None
        self.csv_dir: Optional[str] = None
        self._tb = None
        self._csv: Optional[CSVLog] = None
        if rank != 0:
            return
        if csv_monitor is not None and csv_monitor.enabled:
            self.csv_dir = log_dir(csv_monitor)
            self._csv = CSVLog(self.csv_dir)
        if tensorboard is not None and tensorboard.enabled:
            self._tb = _summary_writer(log_dir(tensorboard))
            if self._tb is not None:
                self.tensorboard_dir = log_dir(tensorboard)

    @classmethod
    def from_config(cls, cfg, rank: int = 0) -> "Monitor":
        return cls(cfg.tensorboard, cfg.csv_monitor, rank)

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._csv is not None

    def write_events(self, events: Iterable[Event]) -> None:
        """events: (name, value, step) tuples, e.g. ("Train/Samples/lr", 1e-4, global_samples)."""
        if not self.enabled:
            return
        clean = []
        for name, value, step in events:
            if int(step) != step:
                raise ValueError(f"monitor event {name!r}: step must be an integer, got {step!r}")
            clean.append((str(name), float(value), int(step)))
        if self._csv is not None:
            self._csv.write(clean)
            self._csv.flush()
        if self._tb is not None:
            for name, value, step in clean:
                self._tb.add_scalar(name, value, step)
            self._tb.flush()

    def resume_at(self, step: int) -> None:
        """Called when a checkpoint at `step` (global samples) is loaded: CSV rows past it are
        dropped and TensorBoard purges its events past it at the next write, so the resumed run's
        logs replace what the interrupted run wrote after the checkpoint."""
        if self._csv is not None:
            self._csv.truncate_after(step)
        if self._tb is not None:
            self._tb.close()
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=self.tensorboard_dir, purge_step=step + 1)

    def close(self) -> None:
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
