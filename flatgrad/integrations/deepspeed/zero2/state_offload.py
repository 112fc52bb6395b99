"""DeepSpeed's ``offload_states`` / ``reload_states`` of ZeRO-1/2 for flatgrad's gradient partitions.

Stock moves the reduced gradients (``lp_grads``) by moving the flat tensor of each
``averaged_gradients`` entry. Under flatgrad those are the reducers' shards, which the
reducers and the optimizer arenas also hold, so moving the entries alone would leave
the memory in place, and under CPU offload would move the optimizer's host gradients
onto the device at reload. flatgrad moves its shards itself; every other state is stock's.
See [Note: offload_states] in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import torch

from .context import Zero2Context
from .window import Zero2Window

__all__ = ["Zero2StateOffload"]


class Zero2StateOffload:
    """``offload_states`` and ``reload_states`` of one ZeRO-1/2 optimizer: ``lp_grads`` flatgrad's, the rest stock's.

    Args:
        context: the reduction's fixed facts.
        window: the window whose partitions are handed to ``step()``.
        stock_offload: DeepSpeed's own ``offload_states`` of the optimizer.
        stock_reload: DeepSpeed's own ``reload_states`` of the optimizer.
    """

    def __init__(
        self, context: Zero2Context, window: Zero2Window, stock_offload: Callable[..., Any],
        stock_reload: Callable[..., Any],
    ):  # fmt: skip
        self.context = context
        self.window = window
        self.stock_offload = stock_offload
        self.stock_reload = stock_reload
        self._away = False  # offload_states moved the shards, reload_states has not brought them back

    def offload_states(
        self, include: Container[Any] | None = None, device: Any = None, pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:  # fmt: skip
        """Stock's ``offload_states``; ``lp_grads`` moves the reducers' shards (none under CPU offload: the
        gradients are the optimizer's host partitions already, as stock's are there)."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        device = OffloadDeviceEnum.cpu if device is None else device
        o = self.context.optimizer
        grads = OffloadStateTypeEnum.lp_grads
        others = [s for s in OffloadStateTypeEnum if s is not grads and (include is None or s in include)]
        if grads not in o.offloaded_states and (include is None or grads in include):
            if not self.context.offload:
                self._move(torch.device(device.value), non_blocking)
                self._away = True
            o.offloaded_states.add(grads)
        self.stock_offload(include=others, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Stock's ``reload_states``; the shards ``offload_states`` moved come back to their device first."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        o = self.context.optimizer
        if OffloadStateTypeEnum.lp_grads in o.offloaded_states:
            if self._away:
                self._move(None, non_blocking)
                self._away = False
            o.offloaded_states.remove(OffloadStateTypeEnum.lp_grads)
        self.stock_reload(non_blocking=non_blocking)

    def _move(self, device: torch.device | None, non_blocking: bool) -> None:
        """Every reducer's shards onto ``device`` (``None``: home), and the window's hand-over viewing them there."""
        for r in self.context.reducers:
            r.move_shards(device, non_blocking)
        self.window.view_moved_shards()
