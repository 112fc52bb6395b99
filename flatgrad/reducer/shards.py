"""Where a window's gradient shards live: one object per placement, chosen once per reducer.

The reducer asks its store for a bucket's shard at the bucket's first launch of an
accumulation window, tells it when a bucket has been unpacked, and drops the
shards at ``zero_grad()``; see [Note: shard lifetime] in docs/design.md.

* ``OwnShards``: each shard allocated on its own, as its bucket launches.
* ``ArenaShards``: one arena per window, the shards slices of it in the caller's order.
* ``TargetShards``: the caller's own persistent tensors, one per bucket (an optimizer's
  host partitions under offload); see [Note: shard targets].

Shard targets are written in place where device and dtype allow, else
delivered once per bucket at the window's end without syncing the host inside
the backward. See [Note: shard targets] in docs/design.md.
"""

from __future__ import annotations

import abc
import itertools
from typing import Sequence

import torch

from .bucket import Bucket

__all__ = ["ArenaShards", "OwnShards", "ShardStore", "TargetShards", "arena_offsets", "make_store", "widen_in_place"]


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

    def move(self, buckets: Sequence[Bucket], device: torch.device, non_blocking: bool = False) -> None:
        """Put this window's shards on ``device``, values kept, the old memory freed (each shard on its own)."""
        for b in buckets:
            if b.shard is not None:
                b.shard = b.shard.to(device, non_blocking=non_blocking)


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

    def move(self, buckets, device, non_blocking=False) -> None:
        """The arena moves whole, in one copy, and the shards are its slices again."""
        if self.arena is None:
            return
        self.arena = self.arena.to(device, non_blocking=non_blocking)
        for b, offset in zip(buckets, self.offsets):
            b.shard = self.arena.narrow(0, offset, b.layout.shard_numel)


class TargetShards(ShardStore):
    """The caller's persistent tensors, one per bucket, written in place or delivered once. See [Note: shard targets]."""

    def __init__(self, targets: list[torch.Tensor], buckets: Sequence[Bucket], dtype: torch.dtype) -> None:
        self.targets = targets
        self.dtype = dtype
        self.in_place = [t.device == b.device and t.dtype == dtype for t, b in zip(targets, buckets)]
        # Per bucket, fixed at construction: whether a delivery copies from CUDA into host memory, and
        # whether that copy can run asynchronously (a pinned target) or must wait for finish().
        self.to_host = [b.device.type == "cuda" and t.device.type == "cpu" for t, b in zip(targets, buckets)]
        self.pinned = [host and t.is_pinned() for t, host in zip(targets, self.to_host)]
        self.final = False
        self.copies = 0  # deliveries made (a copy each), counted for benches and tests
        self._delivered = [False] * len(targets)
        self._deferred: list[Bucket] = []  # pageable host targets of this window, delivered in finish()
        self._widen: list[tuple[torch.Tensor, torch.dtype]] = []  # targets holding bit16 bytes to widen
        self._streams: list = []  # streams with host copies in flight this window
        self._events: dict = {}  # one persistent event per stream

    def ensure(self, b, buckets) -> None:
        if b.shard is not None:
            return
        if self.in_place[b.id]:
            b.shard = self.targets[b.id]
        else:
            b.shard = torch.empty(b.layout.shard_numel, dtype=self.dtype, device=b.device)
        b.accumulate = False

    def unpacked(self, b) -> None:
        if not self.final or self.in_place[b.id]:
            return
        if self.to_host[b.id] and not self.pinned[b.id]:
            self._deferred.append(b)  # a blocking copy: not inside the backward
        else:
            self.deliver(b)

    def deliver(self, b: Bucket) -> None:
        """Move ``b``'s window shard into its target (one copy; none in place), then make the target its shard.

        Runs on the stream current at the call, which must be ordered after ``b``'s unpack.
        """
        if self.in_place[b.id] or self._delivered[b.id] or b.shard is None:
            return
        target, shard = self.targets[b.id], b.shard
        stream = torch.cuda.current_stream(shard.device) if shard.is_cuda else None
        if stream is not None:  # dropped below, maybe on a stream other than the one it was allocated on
            shard.record_stream(stream)
        if not self.to_host[b.id]:
            target.copy_(shard)
        else:
            into = target
            if shard.dtype != target.dtype:  # bit16 bytes into the target's head, widened on the host later
                into = target.view(torch.uint8).narrow(0, 0, shard.numel() * shard.element_size()).view(shard.dtype)
                self._widen.append((target, shard.dtype))
            into.copy_(shard, non_blocking=self.pinned[b.id])
            if self.pinned[b.id] and all(s != stream for s in self._streams):
                self._streams.append(stream)
        self.copies += 1
        b.shard = target
        self._delivered[b.id] = True

    def deliver_all(self, buckets: Sequence[Bucket]) -> None:
        """Deliver every bucket not delivered yet this window, on the current stream, and wait for them."""
        for b in buckets:
            self.deliver(b)
        self.finish()

    def finish(self) -> None:
        for b in self._deferred:
            self.deliver(b)  # the current stream waits for every unpack here (BucketReducer.finish)
        self._deferred.clear()
        for stream in self._streams:  # the host reads the targets next: see [Note: shard targets]
            event = self._events.get(stream)
            if event is None:
                event = self._events[stream] = torch.cuda.Event()
            event.record(stream)
            event.synchronize()
        self._streams.clear()
        for target, dtype in self._widen:
            widen_in_place(target, dtype)
        self._widen.clear()

    def release(self, buckets) -> None:
        super().release(buckets)
        self._delivered = [False] * len(self.targets)

    def allocated_bytes(self, buckets, itemsize) -> int:
        return sum(b.layout.shard_numel for b, here in zip(buckets, self.in_place) if not here) * itemsize

    def move(self, buckets, device, non_blocking=False) -> None:
        raise RuntimeError(
            "the shards of a reducer made with shard_targets are the owner's own tensors (or become them at "
            "delivery): the owner places its targets, move_shards() does not"
        )


def widen_in_place(target: torch.Tensor, dtype: torch.dtype) -> None:
    """Widen the ``target.numel()`` values of ``dtype`` held in the first bytes of ``target`` into ``target`` itself.

    ``target`` is a contiguous 1-D tensor of a wider float dtype whose leading
    ``numel * dtype.itemsize`` bytes hold the narrow values. Widening runs from the
    back in runs: a run ``[start, stop)`` with ``start * wide >= stop * narrow`` reads
    bytes that none of its writes touch, and only bytes that no earlier run has
    written; the first element is read before it is written. No copy of the narrow
    values is made.
    """
    n = target.numel()
    if n == 0:
        return
    itemsize = dtype.itemsize
    if not target.is_contiguous() or target.dim() != 1 or 2 * itemsize > target.element_size():
        raise ValueError(f"widen_in_place needs a contiguous 1-D target at least twice as wide as {dtype}, got {target.dtype}")
    ratio = target.element_size() // itemsize
    narrow = target.view(torch.uint8).narrow(0, 0, n * itemsize).view(dtype)
    stop = n
    while stop > 1:
        start = -(-stop // ratio)  # elements [start, stop) write from byte start * wide >= stop * narrow on
        target.narrow(0, start, stop - start).copy_(narrow.narrow(0, start, stop - start))
        stop = start
    target[0] = narrow[0].item()


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


def check_targets(
    targets: Sequence[torch.Tensor] | None, layouts: Sequence, order: Sequence[int] | None, accum_dtype: torch.dtype
) -> None:
    """Validate ``shard_targets`` before any rank allocates: one dense float tensor of the shard's size per bucket,
    of the accumulation dtype or one at least twice as wide (a delivery widens the accumulated shard in place)."""
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
        if t.dtype != accum_dtype and t.element_size() < 2 * accum_dtype.itemsize:
            raise ValueError(
                f"shard_targets[{b}] has dtype {t.dtype}; a target has the accumulation dtype ({accum_dtype}) or one at "
                "least twice as wide"
            )


def make_store(
    dtype: torch.dtype, buckets: Sequence[Bucket], offsets: list[int] | None, targets: Sequence[torch.Tensor] | None
) -> ShardStore:
    """The store the reducer's arguments ask for (validated before: ``arena_offsets``, ``check_targets``)."""
    if targets is not None:
        return TargetShards(list(targets), buckets, dtype)
    if offsets is not None:
        return ArenaShards(dtype, offsets, sum(b.layout.shard_numel for b in buckets))
    return OwnShards(dtype)
