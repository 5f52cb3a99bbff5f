"""Nested state (dicts, lists, tuples, numbers, tensors) <-> flat tensor dict + JSON skeleton.

Checkpoints keep tensors in torch.distributed.checkpoint files and everything else in JSON, so
nothing is pickled. `flatten` puts each tensor under a dotted key in `out` and leaves
{"__t__": key} in the skeleton; `inline=True` writes small tensors into the JSON itself.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch

_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def flatten(obj: Any, prefix: str, out: Dict[str, torch.Tensor], inline: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        if inline:
            return {
                "__tensor__": obj.detach().cpu().reshape(-1).tolist(),
                "dtype": str(obj.dtype),
                "shape": list(obj.shape),
            }
        out[prefix] = obj
        return {"__t__": prefix}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.reshape(-1).tolist(), "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {"__dict__": [[k, flatten(v, f"{prefix}.{k}", out, inline)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, f"{prefix}.{i}", out, inline) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, f"{prefix}.{i}", out, inline) for i, v in enumerate(obj)]
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint {prefix!r} of type {type(obj).__name__}")


def unflatten(skel: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, list):
        return [unflatten(v, tensors) for v in skel]
    if not isinstance(skel, dict):
        return skel
    if "__t__" in skel:
        return tensors[skel["__t__"]]
    if "__tensor__" in skel:
        dt = _DTYPES[skel["dtype"]]
        return torch.tensor(skel["__tensor__"], dtype=dt).reshape(skel["shape"])
    if "__ndarray__" in skel:
        return np.array(skel["__ndarray__"], dtype=skel["dtype"]).reshape(skel["shape"])
    if "__tuple__" in skel:
        return tuple(unflatten(v, tensors) for v in skel["__tuple__"])
    if "__dict__" in skel:
        return {k: unflatten(v, tensors) for k, v in skel["__dict__"]}
    raise ValueError(f"malformed checkpoint skeleton entry {list(skel)[:3]}")


def tensor_keys(skel: Any) -> list:
    """Keys of the tensors a skeleton refers to."""
    if isinstance(skel, list):
        return [k for v in skel for k in tensor_keys(v)]
    if not isinstance(skel, dict):
        return []
    if "__t__" in skel:
        return [skel["__t__"]]
    if "__tuple__" in skel:
        return tensor_keys(skel["__tuple__"])
    if "__dict__" in skel:
        return [k for _, v in skel["__dict__"] for k in tensor_keys(v)]
    return []
