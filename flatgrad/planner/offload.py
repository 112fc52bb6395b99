"""Host copies per backward under optimizer offload: stock DeepSpeed's per-parameter copies against flatgrad's.

Under ``offload_optimizer: {device: cpu}`` stock copies per parameter, flatgrad
per bucket or sub-group (none on a CPU rank); ``offload_copies`` counts both
for one backward at the boundary. See [Note: offload copies] in docs/design.md.
"""

from __future__ import annotations

from typing import NamedTuple

from .flatgrad_schedule import sub_groups
from .models import ModelSpec
from .stock import check_args, partitions, zero3_buckets

__all__ = ["OffloadCopies", "offload_copies"]


class OffloadCopies(NamedTuple):
    """Host copies of one backward at the boundary, on one rank.

    Attributes:
        stock_zero2: stock ZeRO-1/2's copies (one per parameter piece of the rank's partitions).
        flatgrad_zero2: flatgrad ZeRO-1/2's on a GPU rank (one per sub-group; 0 on a CPU rank, in place).
        stock_zero3: stock ZeRO-3's (one per parameter with data in the rank's partition).
        flatgrad_zero3: flatgrad ZeRO-3's on a GPU rank (one per bucket; 0 on a CPU rank).
    """

    stock_zero2: int
    flatgrad_zero2: int
    stock_zero3: int
    flatgrad_zero3: int


def offload_copies(spec: ModelSpec, world_size: int, *, bucket_numel: int, rank: int = 0) -> OffloadCopies:
    """The host copies of ``rank`` in one backward at the boundary. See [Note: offload copies]."""
    check_args(spec, world_size, rank, bucket_numel)
    stock2 = 0
    for part in partitions(spec, world_size, rank):
        me = part.group.index(rank)
        start, stop = me * part.partition_size, (me + 1) * part.partition_size
        for k, i in enumerate(part.params):
            offset = part.offsets[k]
            stock2 += offset < stop and offset + spec.params[i].numel > start
    stock3 = 0
    for p in spec.params:
        if p.requires_grad and p.numel > 0:
            chunk = -(-p.numel // world_size)
            stock3 += chunk * rank < p.numel
    buckets3 = len(zero3_buckets(spec, bucket_numel)) if world_size > 1 else 0
    return OffloadCopies(stock2, len(sub_groups(spec, bucket_numel)), stock3, buckets3)
