"""What the parts of one ZeRO-1/2 reduction read, fixed when it is installed: the optimizer, its sub-groups, their
reducers, and where the step's tensors live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ....layout import Layout
from ..arenas import OptimizerArenas

if TYPE_CHECKING:
    from ....reducer import BucketReducer

__all__ = ["Zero2Context"]


@dataclass(frozen=True, eq=False)
class Zero2Context:
    """The fixed facts of one ``Zero2Reduction`` that its window, step, statistics and checkpoints read.

    Attributes:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer``.
        layouts: every sub-group's ``Layout``, by sub-group index.
        reducers: one ``BucketReducer`` per process group, one bucket per sub-group.
        slots: every sub-group's ``(reducer, bucket index in it)``, by sub-group index.
        arenas: the optimizer arenas (an elementwise optimizer under ZeRO-2 without offload), else ``None``.
        offload: the partitions are the optimizer's host fp32 gradients. See [Note: ZeRO-Offload].
        comm_device: where the unpack's stats and the step's all_reduce live. See [Note: step placement].
        norm_device: where the global norm is returned (stock's ``device``).
    """

    optimizer: Any
    layouts: tuple[Layout, ...]
    reducers: tuple[BucketReducer, ...]
    slots: tuple[tuple[BucketReducer, int], ...]
    arenas: OptimizerArenas | None
    offload: bool
    comm_device: torch.device
    norm_device: torch.device

