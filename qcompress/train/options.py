"""The options of `qcompress train` and the fingerprints that decide what a resumed run, or a
borrowed baseline, must share with the run that made it."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional


@dataclass
class JobOptions:
    configs: List[str]
    model: str
    data: str
    task: str
    out: str
    eval_data: Optional[str] = None
    eval_fraction: float = 0.2
    text_column: str = "text"
    label_column: str = "label"
    max_length: int = 128
    epochs: float = 1.0
    max_steps: Optional[int] = None
    seed: Optional[int] = 0  # None (no --seed): the config's seed, else 0 (job_config sets it)
    baseline: bool = False
    resume: bool = False
    overwrite: bool = False
    lr: float = 1e-4
    batch_size: int = 32
    eval_batch_size: int = 64
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    save_steps: int = 50
    baseline_from: Optional[str] = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N (where, not what: not in the fingerprint)
    ptq_range_steps: int = 0  # the ptq_learned stage (qcompress.learn_ranges); 0: none
    progress: bool = True
    gradient_checkpointing: bool = False  # memory, not results: not in the fingerprints
    compile: bool = False  # torch.compile: speed, not results (not in the fingerprints)
    dtype: str = "float32"  # float32 | bfloat16: the model's dtype from loading to the reload
    keep_checkpoints: str = "last"  # all | last | none: disk, not results (not in the fingerprints)
    lora_r: Optional[int] = None  # --lora-r: the lora section switched on at this rank
    calibrate: Optional[str] = None  # "gptq": observer gptq over the configs' weight groups
    calib_batches: int = 8  # training batches (of eval_batch_size) every calibration reads
    notes: List[str] = field(default_factory=list)

    def fingerprint(self, data_digest: Optional[str] = None) -> str:
        """What a resumed run must share with the interrupted one (not out/resume/progress): files by
        absolute path and configs by content (`./a.yaml` from another folder is the same run), and
        the data by what was read from it (an edited data file is other data)."""
        keep = {
            k: v
            for k, v in asdict(self).items()
            if k
            not in (
                "out",
                "resume",
                "overwrite",
                "progress",
                "save_steps",
                "notes",
                "baseline_from",
                "configs",
                "device",
                "gradient_checkpointing",
                "compile",
                "keep_checkpoints",
            )
        }
        if not self.ptq_range_steps:
            keep.pop("ptq_range_steps")  # runs without the stage keep their earlier fingerprint
        if self.dtype == "float32":
            keep.pop("dtype")  # as runs made before --dtype existed
        if self.lora_r is None:
            keep.pop("lora_r")  # likewise runs without --lora-r
        if self.calibrate is None:
            keep.pop("calibrate")  # likewise runs without --calibrate
        if self.calib_batches == 8:
            keep.pop("calib_batches")  # likewise runs at the default calibration size
        keep["model"], keep["data"] = os.path.abspath(self.model), os.path.abspath(self.data)
        keep["eval_data"] = self.eval_data and os.path.abspath(self.eval_data)
        keep["config_text"] = [_file_hex(c) for c in self.configs]
        keep["data_digest"] = data_digest
        return _digest(keep)

    def baseline_fingerprint(self, plain_doc: dict, data_digest: Optional[str] = None) -> str:
        """What decides the FP32 fine-tune: an earlier run with the same one can lend its baseline."""
        keep = {
            k: v
            for k, v in asdict(self).items()
            if k
            in (
                "model",
                "data",
                "task",
                "eval_data",
                "eval_fraction",
                "text_column",
                "label_column",
                "max_length",
                "epochs",
                "max_steps",
                "seed",
                "lr",
                "batch_size",
                "eval_batch_size",
                "max_train_samples",
                "max_eval_samples",
            )
        }
        if self.dtype != "float32":  # float32 runs keep the fingerprint they had before --dtype
            keep["dtype"] = self.dtype
        keep["model"], keep["data"] = os.path.abspath(self.model), os.path.abspath(self.data)
        keep["eval_data"] = self.eval_data and os.path.abspath(self.eval_data)  # same file, any cwd
        keep["plain_config"] = plain_doc
        keep["data_digest"] = data_digest
        return _digest(keep)


def _file_hex(path: str) -> str:
    if not os.path.isfile(path):
        from ..config import recipes

        found = recipes.find(path)  # a recipe by name: its file's content, as a path's
        if found is None or not os.path.isfile(found):
            return path
        path = found
    with open(path, "rb") as fh:
        return fh.read().hex()


def data_digest(data) -> str:
    """A digest of the tokenized train and eval sets and the label names: the data a run saw."""
    h = hashlib.sha256(json.dumps(data.labels).encode())
    for part in (data.train, data.eval):
        h.update(b"|%d|" % len(part))
        for item in part.items:
            for key in sorted(item):
                h.update(key.encode())
                h.update(item[key].numpy().tobytes())
    return h.hexdigest()[:16]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
