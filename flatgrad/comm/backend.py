"""Which backend serves a process group's tensors: the one question both collective paths ask first."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["backend_name"]


def backend_name(group: dist.ProcessGroup | None, device: torch.device | None = None) -> str:
    """The backend that serves ``device``'s tensors on ``group`` (e.g. ``"gloo"``, ``"nccl"``).

    ``dist.get_backend`` answers ``"cpu:gloo,cuda:nccl"`` for a group with one
    backend per device type; ``device`` picks one of them (CUDA if not given).
    """
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(","))
    kind = device.type if device is not None else "cuda"
    return per_device.get(kind, next(iter(per_device.values())))
