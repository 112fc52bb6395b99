"""Where a window's gradient shards live: one object per placement, chosen once per reducer.

The reducer asks its store for a bucket's shard at the bucket's first launch of an
accumulation window, tells it when a bucket has been unpacked, and drops the
shards at ``zero_grad()``; see [Note: shard lifetime] in ``reducer.py``.

* ``OwnShards``: each shard allocated on its own, as its bucket launches.
* ``ArenaShards``: one arena per window, the shards slices of it in the caller's order.
* ``TargetShards``: the caller's own persistent tensors, one per bucket (an optimizer's
  host partitions under offload); see [Note: shard targets].

[Note: shard targets]
With ``shard_targets`` every bucket's window ends in a tensor the caller owns and
keeps: under ZeRO-Offload, the fp32 gradient partition on the host that the CPU
optimizer reads. Two cases, decided per bucket at construction:

* in place: the target is on the bucket's device and has the accumulation dtype
  (a CPU rank, fp32 accumulation). The target is the shard from the window's first
  unpack on: the unpack writes (then adds) into it directly, so the reduced
  gradient reaches the optimizer with no copy and no shard is allocated;
* delivered: otherwise (a GPU rank, whose target is host memory; or bit16
  accumulation into an fp32 target) the window's shard is allocated as usual and,
  once the last micro-step of the window has unpacked it, one ``copy_`` per bucket
  moves it into the target (a cast where the dtypes differ, as stock casts its
  accumulated gradient into the fp32 partition). The owner says which micro-step
  is the last (``BucketReducer.final_micro_step``); then each bucket is delivered as
  its unpack completes, so on CUDA the copy runs on the unpack stream while the
  backward goes on (``non_blocking`` into pinned memory), and the device shard is
  dropped right after it (``record_stream``-ed there). ``deliver()`` delivers what is
  left (a window whose last micro-step was not known in advance). After delivery the
  bucket's shard *is* the target, so ``grad_shards()`` and the stats describe it.
  A delivery from CUDA into host memory is waited for by ``finish()`` (one event
  sync per window), because the host reads the target next.
"""

from __future__ import annotations

import abc
import itertools
from typing import Sequence

import torch

from .bucket import Bucket

__all__ = ["ArenaShards", "OwnShards", "ShardStore", "TargetShards", "arena_offsets", "make_store"]


class ShardStore(abc.ABC):
    """Gives a bucket its shard for the window, and takes the window's shards back."""

    arena: torch.Tensor | None = None

    @abc.abstractmethod
    def ensure(self, b: Bucket, buckets: Sequence[Bucket]) -> None:
        """Give ``b`` its shard for this window if it has none (its first unpack then copies)."""

    def unpacked(self, b: Bucket) -> None:
        """``b`` was unpacked (on CUDA, called on its unpack stream)."""

    def finish(self) -> None:
        """The micro-step's unpacks are all done."""

    def release(self, buckets: Sequence[Bucket]) -> None:
        """Drop the window's shards (the owner has consumed them)."""
        for b in buckets:
            b.shard = None
            b.stats = None
        self.arena = None

    def allocated_bytes(self, buckets: Sequence[Bucket], itemsize: int) -> int:
        """Bytes this store allocates for one window's shards."""
        return sum(b.layout.shard_numel for b in buckets) * itemsize


class OwnShards(ShardStore):
    """Each shard allocated on its own as its bucket is first launched in a window."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def ensure(self, b, buckets) -> None:
        if b.shard is None:
            b.shard = torch.empty(b.layout.shard_numel, dtype=self.dtype, device=b.device)
            b.accumulate = False


class ArenaShards(ShardStore):
    """One arena per window, allocated whole at the window's first launch; bucket ``b`` is slice ``offsets[b]``."""

    def __init__(self, dtype: torch.dtype, offsets: list[int], numel: int) -> None:
        self.dtype = dtype
        self.offsets = offsets
        self.numel = numel

    def ensure(self, b, buckets) -> None:
        if b.shard is not None:
            return
        self.arena = torch.empty(self.numel, dtype=self.dtype, device=b.device)
        for bb, offset in zip(buckets, self.offsets):
            bb.shard = self.arena.narrow(0, offset, bb.layout.shard_numel)
            bb.accumulate = False


class TargetShards(ShardStore):
    """The caller's persistent tensors, one per bucket, written in place or delivered once. See [Note: shard targets]."""

    def __init__(self, targets: list[torch.Tensor], buckets: Sequence[Bucket], dtype: torch.dtype) -> None:
        self.targets = targets
        self.dtype = dtype
        self.in_place = [t.device == b.device and t.dtype == dtype for t, b in zip(targets, buckets)]
        self.final = False
        self.copies = 0  # deliveries made (a copy each), counted for benches and tests
        self._delivered = [False] * len(targets)
        self._host_copies: list[tuple[torch.device, object]] = []  # (device, event) of copies into host memory

    def ensure(self, b, buckets) -> None:
        if b.shard is not None:
            return
        if self.in_place[b.id]:
            b.shard = self.targets[b.id]
        else:
            b.shard = torch.empty(b.layout.shard_numel, dtype=self.dtype, device=b.device)
        b.accumulate = False

    def unpacked(self, b) -> None:
        if self.final:
            self.deliver(b)

    def deliver(self, b: Bucket) -> None:
        """Move ``b``'s window shard into its target (one copy; none in place), then make the target its shard."""
        if self.in_place[b.id] or self._delivered[b.id] or b.shard is None:
            return
        target, shard = self.targets[b.id], b.shard
        host = shard.device.type == "cuda" and target.device.type == "cpu"
        target.copy_(shard, non_blocking=host and target.is_pinned())
        self.copies += 1
        if shard.device.type == "cuda":
            shard.record_stream(torch.cuda.current_stream(shard.device))
        if host:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(shard.device))
            self._host_copies.append((shard.device, event))
        b.shard = target
        self._delivered[b.id] = True

    def deliver_all(self, buckets: Sequence[Bucket]) -> None:
        """Deliver every bucket not delivered yet this window."""
        for b in buckets:
            stream = b.unpack_stream
            if stream is None:
                self.deliver(b)
                continue
            with torch.cuda.stream(stream):
                self.deliver(b)
        self.finish()

    def finish(self) -> None:
        for _, event in self._host_copies:
            event.synchronize()  # the host reads the target next: see [Note: shard targets]
        self._host_copies.clear()

    def release(self, buckets) -> None:
        super().release(buckets)
        self._delivered = [False] * len(self.targets)

    def allocated_bytes(self, buckets, itemsize) -> int:
        return sum(b.layout.shard_numel for b, here in zip(buckets, self.in_place) if not here) * itemsize


def arena_offsets(order: Sequence[int] | None, layouts: Sequence, devices: Sequence[torch.device]) -> list[int] | None:
    """Each bucket's offset in the shard arena: bucket ``b`` is the ``order[b]``-th slice. See [Note: shard lifetime]."""
    if order is None:
        return None
    if isinstance(order, torch.Tensor) or not isinstance(order, Sequence) or sorted(order) != list(range(len(layouts))):
        raise ValueError(
            f"shard_arena must be a permutation of range({len(layouts)}) (one arena position per bucket), got {order!r}"
        )
    if len(set(devices)) > 1:
        raise ValueError(f"shard_arena needs every bucket on one device, got {sorted(map(str, set(devices)))}")
    numels = [0] * len(layouts)
    for b, position in enumerate(order):
        numels[position] = layouts[b].shard_numel
    starts = [0, *itertools.accumulate(numels)]
    return [starts[position] for position in order]


def check_targets(targets: Sequence[torch.Tensor] | None, layouts: Sequence, order: Sequence[int] | None) -> None:
    """Validate ``shard_targets`` before any rank allocates: one dense float tensor of the shard's size per bucket."""
    if targets is None:
        return
    if order is not None:
        raise ValueError("shard_targets and shard_arena are exclusive: a target is the shard's own storage")
    if isinstance(targets, torch.Tensor) or not isinstance(targets, Sequence) or len(targets) != len(layouts):
        raise ValueError(f"shard_targets must be a list of {len(layouts)} tensors (one per bucket)")
    for b, (t, layout) in enumerate(zip(targets, layouts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shard_targets[{b}] is a {type(t).__name__}, not a tensor")
        if t.dim() != 1 or t.numel() != layout.shard_numel or not t.is_contiguous():
            raise ValueError(
                f"shard_targets[{b}] must be a contiguous 1-D tensor of {layout.shard_numel} elements (the bucket's "
                f"shard), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"shard_targets[{b}] has dtype {t.dtype}; a gradient target is a float tensor")


def make_store(
    dtype: torch.dtype, buckets: Sequence[Bucket], offsets: list[int] | None, targets: Sequence[torch.Tensor] | None
) -> ShardStore:
    """The store the reducer's arguments ask for (validated before: ``arena_offsets``, ``check_targets``)."""
    if targets is not None:
        return TargetShards(list(targets), buckets, dtype)
    if offsets is not None:
        return ArenaShards(dtype, offsets, sum(b.layout.shard_numel for b in buckets))
    return OwnShards(dtype)
