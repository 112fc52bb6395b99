"""ZeRO-3 step statistics: the gradient norm and the overflow check from the unpacks' stats, not from the partitions.

The unpacks of one backward add their ``[sum_sq, nonfinite]`` into one vector, reduced over the ranks once per
step; where that would not give stock's figures the step reads the partitions as stock does. See
[Note: ZeRO-3 step statistics] in docs/design.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..step_stats import StepStats

from .composition import Composition

__all__ = ["Zero3Stats"]


class _BackwardStats:
    """The summed unpack stats of one backward (one ``micro_step_id``) and the buckets they came from."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro_step: int | None = None
        self.total: torch.Tensor | None = None
        self.buckets: list[Composition] | None = None

    def add(self, micro_step: int, comp: Composition, stats: torch.Tensor | None) -> None:
        """Count bucket ``comp``'s unpack stats (``None``: it wrote nothing on this rank) into this backward's."""
        if micro_step != self.micro_step or self.buckets is None:  # a new backward: only its unpacks count
            self.micro_step, self.total, self.buckets = micro_step, None, []
        if stats is not None:
            self.total = stats.clone() if self.total is None else self.total.add_(stats)
        self.buckets.append(comp)


class Zero3Stats:
    """One ZeRO-3 optimizer's step statistics: the last backward's unpack stats, the window, the cover check.

    ``norm_groups`` and ``overflow`` answer for the step, or return ``None`` where stock's must (the caller
    then runs stock's).
    """

    def __init__(self, optimizer: Any, accelerator: Any, dist: Any, *, offload: bool) -> None:
        self.optimizer = optimizer
        self._accelerator = accelerator
        self._dist = dist
        self._offload = offload  # under optimizer offload the norm is stock's: see [Note: ZeRO-3 optimizer offload]
        self._backward = _BackwardStats()
        self._trainable = frozenset(p.ds_id for g in optimizer.fp16_groups for p in g if p.requires_grad)
        self._covers: dict[tuple, bool] = {}
        self._window = StepStats()

    @property
    def nbytes(self) -> int:
        """Bytes held now: the backward's summed stats and the window's reduced ones."""
        total = self._backward.total
        return (total.nbytes if total is not None else 0) + self._window.nbytes

    def add(self, micro_step: int, comp: Composition, stats: torch.Tensor | None) -> None:
        """Count one bucket's unpack stats (``None``: it wrote nothing on this rank) into this backward's."""
        self._backward.add(micro_step, comp, stats)

    def usable(self) -> bool:
        """Whether the unpack stats give stock's figures: the last backward reduced every trainable parameter
        exactly once, over one group, and nothing wrote a gradient since (decided on the host, alike on every rank)."""
        opt = self.optimizer
        buckets = self._backward.buckets
        if opt.model_parallel_group is not None or getattr(opt, "use_muon", False) or buckets is None:
            return False
        if self._window.stale:
            return False
        keys = tuple(c.key for c in buckets)
        usable = self._covers.get(keys)
        if usable is None:
            union = frozenset().union(*(c.bucket_ds_ids for c in buckets))
            usable = (
                len({id(c.group) for c in buckets}) == 1  # stock all_reduces each sub-group's norm over this group
                and sum(len(c.bucket_ds_ids) for c in buckets) == len(union)  # no parameter reduced twice
                and self._trainable <= union
            )
            if len(self._covers) > 64:
                self._covers.clear()
            self._covers[keys] = usable
        return usable

    def _reduced(self) -> torch.Tensor:
        """``[sum_sq, nonfinite]`` of the last backward's unpacks, summed over the ranks: one all_reduce per step."""
        opt, dist = self.optimizer, self._dist

        def build() -> torch.Tensor:
            device = torch.device(self._accelerator.current_device_name())
            if not self._accelerator.resolves_data_dependency():
                self._accelerator.current_stream().wait_stream(opt.reduce_and_partition_stream)
            total = self._backward.total
            return total.to(device) if total is not None else torch.zeros(2, device=device)

        group = self._backward.buckets[0].group
        return self._window.reduced(build, lambda total: dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group))

    def norm_groups(self) -> list[torch.Tensor] | None:
        """``_get_norm_groups`` from the unpack stats (one group), -1 when not finite; ``None`` where stock's
        serves (the stats are not usable, or under optimizer offload)."""
        if self._offload or not self.usable():
            return None
        total = self._reduced()
        norm = total[0].sqrt()
        invalid = (total[1] > 0) | ~torch.isfinite(norm)
        return [torch.where(invalid, torch.full_like(norm, -1.0), norm)]

    def overflow(self) -> bool | None:
        """Whether any rank's partitions hold an inf or NaN, from the unpack stats; ``None`` where stock's serves."""
        if not self.usable():
            return None
        return StepStats.overflow(self._reduced()[1])

    def mark_stale(self) -> None:
        """A gradient was written after its unpack (through DeepSpeed's API): this window's step reads the
        partitions."""
        self._window.mark_stale()

    def end_window(self) -> None:
        """The step consumed the window (or ``zero_grad`` restarted accumulation): the stats restart."""
        self._backward.reset()
        self._window.reset()
