"""The comm buffer pools, taken per micro-step.

As stock keeps one or two IPG buffers, the buckets of one device and dtype
share ``comm_buffers`` buffers, assigned statically (bucket ``k`` uses buffer
``k mod comm_buffers``) and held only from a micro-step's first launch to
``finish()``. See [Note: comm buffer pool] in docs/design.md.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .bucket import Bucket

__all__ = ["CommPools", "PoolSpec"]


class PoolSpec(NamedTuple):
    """One pool: its key, how many buffers, elements per buffer, dtype, and the buckets that share it."""

    key: tuple
    count: int
    size: int
    dtype: torch.dtype
    purpose: str
    buckets: list[Bucket]


class CommPools:
    """The pools of one reducer: planned once, taken at a micro-step's first launch, given back by ``finish()``."""

    def __init__(self, buckets: Sequence[Bucket], comm_buffers: int) -> None:
        members: dict[tuple[torch.device, torch.dtype | None], list[Bucket]] = {}
        for b in buckets:
            members.setdefault((b.device, b.mode.pool_dtype(b.comm_dtype)), []).append(b)
        self.pools: list[PoolSpec] = []
        for (device, dtype), group in members.items():
            count = min(comm_buffers, len(group))
            for k, b in enumerate(group):
                b.previous = group[k - count] if k >= count else None
            slots = group[0].mode.pool_slots([b.layout for b in group], group[0].comm_dtype)
            for purpose, size, slot_dtype in slots:
                key = (device, dtype) if purpose == "input" else (purpose, device, dtype)
                self.pools.append(PoolSpec(key, count, size, slot_dtype, purpose, group))
        self.buckets = list(buckets)
        self.taken: dict[tuple, list[torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every pool buffer, held from a micro-step's first launch to its ``finish()`` only."""
        return sum(p.count * p.size * p.dtype.itemsize for p in self.pools)

    def acquire(self) -> None:
        """Take the pools for this micro-step (if not taken yet) and give every bucket its views."""
        if self.taken is not None:
            return
        taken: dict[tuple, list[torch.Tensor]] = {}
        buffers: dict[int, dict[str, torch.Tensor]] = {}
        for p in self.pools:
            device = p.buckets[0].device
            pool = taken[p.key] = [torch.empty(p.size, dtype=p.dtype, device=device) for _ in range(p.count)]
            for k, b in enumerate(p.buckets):
                buffers.setdefault(id(b), {})[p.purpose] = pool[k % p.count]
        for b in self.buckets:
            b.bind(buffers[id(b)])
        self.taken = taken

    def release(self) -> None:
        """Give the pools back once every unpack of the micro-step is done."""
        if self.taken is None:
            return
        for b in self.buckets:
            b.unbind()
        side = {s for b in self.buckets for s in (b.pack_stream, b.unpack_stream) if s is not None}
        for pool in self.taken.values():
            for t in pool:
                for stream in side:  # the caching allocator reuses them only after the side streams' work
                    t.record_stream(stream)
        self.taken = None
