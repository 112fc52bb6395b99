"""A per-backward collective schedule: the calls one rank issues, in order, and their totals.

Schedules are computed, never recorded: ``stock.py`` and ``flatgrad_schedule.py``
produce them from a ``ModelSpec`` and a world size, without processes. The
tests compare them call by call with traces of real runs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

import torch

__all__ = ["Collective", "Schedule", "element_size", "size_histogram"]

OPS = ("reduce", "all_reduce", "reduce_scatter", "all_to_all")


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective call as the issuing rank sees it.

    Attributes:
        op: ``"reduce"``, ``"all_reduce"``, ``"reduce_scatter"`` or ``"all_to_all"`` (the
            reduction modes; ``numel`` is the whole send buffer).
        numel: elements of the call's buffer (for ``reduce_scatter`` the whole
            input, ``group size x shard``).
        dtype: the communication dtype.
        group: global ranks of the process group, as a ``range``.
        dst: for ``reduce``, the global rank that receives the sum.
        payload: gradient elements in the buffer; ``numel - payload`` is padding.
    """

    op: str
    numel: int
    dtype: torch.dtype
    group: range
    dst: int | None = None
    payload: int = -1

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.payload < 0:
            object.__setattr__(self, "payload", self.numel)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def key(self) -> tuple:
        """What a trace records of the call: (op, numel, dtype, dst, group ranks)."""
        return (self.op, self.numel, str(self.dtype).replace("torch.", ""), self.dst, tuple(self.group))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The collectives of one backward on one rank, in issue order.

    Attributes:
        name: a label (``"stock ZeRO-2, reduce"``).
        key: a short identifier for JSON and charts (``"stock_zero2_reduce"``).
        world_size: ranks in the job.
        rank: the rank whose view this is (destinations and expert groups depend on it).
        calls: the calls, in issue order.
        note: how the schedule arises, in one line.
        unavailable: why the configuration cannot run at all (then ``calls`` is empty).
    """

    name: str
    key: str
    world_size: int
    rank: int
    calls: tuple[Collective, ...]
    note: str = ""
    unavailable: str | None = None

    @property
    def numel(self) -> int:
        return sum(c.numel for c in self.calls)

    @property
    def payload(self) -> int:
        return sum(c.payload for c in self.calls)

    @property
    def nbytes(self) -> int:
        """Bytes in the call buffers, summed."""
        return sum(c.nbytes for c in self.calls)

    @property
    def padding_overhead(self) -> float:
        """Padding elements as a fraction of the gradient elements communicated."""
        return (self.numel - self.payload) / self.payload if self.payload else 0.0

    def ops(self) -> Counter:
        """Calls per op."""
        return Counter(c.op for c in self.calls)


def size_histogram(calls: Sequence[Collective]) -> list[tuple[int, int, int]]:
    """Calls binned by buffer bytes in powers of two: ``[(lo, hi, count)]`` for ``lo <= bytes < hi``."""
    bins: Counter = Counter()
    for c in calls:
        bins[max(c.nbytes, 1).bit_length() - 1] += 1
    return [(1 << b, 1 << (b + 1), bins[b]) for b in sorted(bins)]
