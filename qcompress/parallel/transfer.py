"""Point-to-point transfer of named tensors plus a JSON document, without pickle.

The sender first sends a JSON header (the document, and each tensor's name, shape and dtype),
then the tensors in that order; the receiver allocates from the header. Works on gloo and NCCL
(`device`: where the tensors travel; NCCL needs the GPU).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist


def _dtypes() -> Dict[str, torch.dtype]:
    from ..serialize import _DTYPES  # the dtypes checkpoints name, by the same strings

    return _DTYPES


def _wire(t: torch.Tensor, device) -> torch.Tensor:
    t = t.detach().to(device).contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t  # gloo does not send bool


def send_state(tensors: Dict[str, torch.Tensor], doc: Any, dst: int, device) -> None:
    """Send `tensors` and the JSON-able `doc` to rank `dst` (which calls recv_state)."""
    for name, t in tensors.items():
        if str(t.dtype) not in _dtypes():
            raise TypeError(f"send_state: tensor {name!r} has dtype {t.dtype}, which is not transferred")
    header = json.dumps({"doc": doc, "tensors": [[k, list(t.shape), str(t.dtype)] for k, t in tensors.items()]})
    data = torch.frombuffer(bytearray(header.encode("utf-8")), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst)
    dist.send(data.to(device), dst)
    for t in tensors.values():
        dist.send(_wire(t, device), dst)


def recv_state(src: int, device) -> Tuple[Dict[str, torch.Tensor], Any]:
    """({name: tensor on `device`}, doc) sent by rank `src` with send_state."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src)
    header = json.loads(bytes(data.cpu().tolist()).decode("utf-8"))
    out = {}
    for name, shape, dtype in header["tensors"]:
        dt = _dtypes()[dtype]
        buf = torch.empty(shape, dtype=torch.uint8 if dt == torch.bool else dt, device=device)
        dist.recv(buf, src)
        out[name] = buf.view(torch.bool) if dt == torch.bool else buf
    return out, header["doc"]


def all_gather_json(doc: Any, device, group=None) -> list:
    """Collective: every rank's JSON-able `doc`, in rank order, on every rank (bytes, not pickle)."""
    data = torch.frombuffer(bytearray(json.dumps(doc).encode("utf-8")), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(bytes(p[: int(s.item())].cpu().tolist()).decode("utf-8")) for p, s in zip(parts, sizes)]
