"""CUDA's device rule on a machine without a GPU: two devices, and a mode that refuses what CUDA refuses.

On a CPU-only run every tensor is on ``cpu``, so code that combines an
accelerator tensor with a host one (the offloaded host partitions with the
unpack's stats, a norm with the gradients it scales) runs there and crashes on
the first GPU. Here the two roles are played by ``cpu`` and ``meta`` (tensors
with no data), one each, and ``SameDevice`` refuses every op whose tensor
arguments lie on two devices, as CUDA does. The one mix CUDA allows is a 0-dim
host tensor in an elementwise (or foreach) op, a scalar to the accelerator; a
0-dim accelerator tensor does not mix with host tensors. Copies (``copy_``,
``_to_copy``, the foreach copy) are how data crosses, so they pass.

Data moves onto ``meta`` only, so a test gives ``cpu`` to the side whose values
are read (the host partitions a norm reads; the accelerator scalar a clip scale
is computed from) and ``meta`` to the side data moves to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["DeviceMixError", "SameDevice"]

_aten = torch.ops.aten
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten._foreach_copy_.default, _aten._foreach_copy.default}


class DeviceMixError(RuntimeError):
    """An op was given tensors on two devices (CUDA's one exception aside: a 0-dim host scalar)."""


class SameDevice(TorchDispatchMode):
    """Refuses an op whose tensor arguments lie on more than one device, except the copies that cross.

    Args:
        host: the device playing the host: its 0-dim tensors are scalars in elementwise ops.

    Attributes:
        ops: every op seen, with the devices of its tensor arguments, in order.
    """

    def __init__(self, host: torch.device | str) -> None:
        super().__init__()
        self.host = torch.device(host)
        self.ops: list[tuple[Any, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        scalars_mix = torch.Tag.pointwise in func.tags or func.name().startswith("aten::_foreach_")
        devices: list[torch.device] = []
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor) or (scalars_mix and t.dim() == 0 and t.device == self.host):
                continue
            if t.device not in devices:
                devices.append(t.device)
        self.ops.append((func, tuple(map(str, devices))))
        if len(devices) > 1 and func not in _CROSSING:
            raise DeviceMixError(f"{func} got tensors on {', '.join(map(str, devices))}")
        return func(*args, **kwargs)
