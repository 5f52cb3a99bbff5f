"""DeepSpeed's `seed`: one seed for Python's, NumPy's and torch's generators on every rank, so
ranks draw the same numbers (initialisation after initialize, shuffles, dropout masks)."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # NumPy is optional: nothing of it to seed
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too
