"""Layer reduction: initialise a shallower student from chosen teacher layers.

Student layer i <- teacher layer teacher_layer[i] (under module_name_prefix), then every
other_module_name module copied whole. Unlike DeepSpeed (which zips .parameters() by position),
tensors are matched BY NAME (parameters and persistent buffers) with shape checks; everything is
checked before anything is copied, so a bad config leaves the student untouched.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..unwrap import unwrap

PATH = "compression_training.layer_reduction"


def _get(model, name, path, which):
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ConfigError(path, f"the {which} has no module {name!r}") from None


def _plan_copy(dst: nn.Module, src: nn.Module, dst_name: str, src_name: str, path: str):
    d, s = dst.state_dict(), src.state_dict()
    missing = sorted(set(d) - set(s))
    extra = sorted(set(s) - set(d))
    if missing or extra:
        raise ConfigError(
            path,
            f"student {dst_name!r} and teacher {src_name!r} hold different "
            f"tensors: only in student {missing[:5]}, only in teacher {extra[:5]}",
        )
    pairs = []
    for key, t in d.items():
        if tuple(t.shape) != tuple(s[key].shape):
            raise ConfigError(
                path,
                f"tensor {dst_name}.{key} has shape {tuple(t.shape)} in the "
                f"student but {src_name}.{key} has {tuple(s[key].shape)} in the teacher",
            )
        pairs.append((t, s[key]))
    return pairs


@torch.no_grad()
def student_initialization(student: nn.Module, teacher: nn.Module, cfg) -> List[Tuple[str, str]]:
    """Copy the mapped teacher tensors into the student in place; returns [(student, teacher)] names."""
    student, teacher = unwrap(student), unwrap(teacher)
    prefix = cfg.module_name_prefix
    if not prefix or not cfg.teacher_layer:
        raise ConfigError(PATH, "module_name_prefix and teacher_layer are required")
    container = _get(student, prefix, f"{PATH}.module_name_prefix", "student")
    if hasattr(container, "__len__") and len(container) != len(cfg.teacher_layer):
        raise ConfigError(
            f"{PATH}.teacher_layer",
            f"lists {len(cfg.teacher_layer)} teacher layers but the student's "
            f"{prefix!r} has {len(container)}; build the student with that many layers",
        )
    copies, names = [], []
    for i, t in enumerate(cfg.teacher_layer):
        dname, sname = f"{prefix}.{i}", f"{prefix}.{t}"
        dst = _get(student, dname, f"{PATH}.module_name_prefix", "student")
        src = _get(teacher, sname, f"{PATH}.teacher_layer[{i}]", "teacher")
        copies += _plan_copy(dst, src, dname, sname, f"{PATH}.teacher_layer[{i}]")
        names.append((dname, sname))
    for j, name in enumerate(cfg.other_module_name):
        path = f"{PATH}.other_module_name[{j}]"
        dst = _get(student, name, path, "student")
        src = _get(teacher, name, path, "teacher")
        copies += _plan_copy(dst, src, name, name, path)
        names.append((name, name))
    for dst_t, src_t in copies:
        dst_t.copy_(src_t)
    return names
