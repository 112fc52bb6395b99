"""The step's view of one window's unpack statistics, shared by ZeRO-1/2 and ZeRO-3.

Both stages take the gradient norm and the overflow check from what the fused unpack
computed while writing the partitions (sum of squares, non-finite count): reduced
over the ranks once per step, in one all_reduce, and forgotten when the window ends.
A gradient written through DeepSpeed's API after its unpack is not in those stats, so
it marks them stale, and that window's step reads the partitions as stock does (see
[Note: ZeRO-2 step statistics] and [Note: ZeRO-3 step statistics]). What each stage
reduces (one row per sub-group, or one sum) and how it turns that into stock's norm
stays with the stage.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["StepStats"]


class StepStats:
    """One window's reduced unpack statistics: made at most once per step, then shared by norm and overflow.

    Attributes:
        stale: a gradient was written after its unpack (through DeepSpeed's API): the stats do not describe it.
    """

    def __init__(self) -> None:
        self._reduced: torch.Tensor | None = None
        self.stale = False

    def reduced(self, build: Callable[[], torch.Tensor], all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The window's statistics summed over the ranks: ``build()`` then one ``all_reduce``, the first time only."""
        if self._reduced is None:
            total = build()
            all_reduce(total)
            self._reduced = total
        return self._reduced

    @staticmethod
    def overflow(nonfinite: torch.Tensor) -> bool:
        """Whether any rank's partitions hold an inf or NaN (a bool, as stock's check returns: one host sync)."""
        return bool(nonfinite.item() > 0)

    def mark_stale(self) -> None:
        """A gradient was written after its unpack: this window's step reads the partitions."""
        self.stale = True

    def forget(self) -> None:
        """Drop the reduced values (a new hand-over); staleness stays with the window."""
        self._reduced = None

    def reset(self) -> None:
        """The window ended: nothing reduced, nothing stale."""
        self._reduced = None
        self.stale = False

    @property
    def nbytes(self) -> int:
        """Bytes held now (counted in the integrations' metadata)."""
        return self._reduced.nbytes if self._reduced is not None else 0
