"""Training progress on rank 0. On a terminal: a tqdm bar. Anywhere else (a file, a CI log, a
pipe): one plain line every `every` steps and at the last step, never carriage-return frames,
which a log would keep as one endless line."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class StepProgress:
    def __init__(self, name: str, total: int, initial: int = 0, every: int = 10, stream: Optional[TextIO] = None):
        self.name, self.total, self.done, self.every = name, total, initial, max(1, int(every))
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.bar = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=name, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, loss: float, samples_per_s: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.1f}")
        elif self.done % self.every == 0 or self.done == self.total:
            self.stream.write(
                f"[{self.name}] step {self.done}/{self.total} loss {loss:.4f} "
                f"{samples_per_s:.1f} samples/s {time.perf_counter() - self.t0:.0f} s\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
