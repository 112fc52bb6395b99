"""Stock DeepSpeed 0.19.8's per-backward gradient collectives, computed without processes.

Both schedules follow DeepSpeed's own partitioning, bucketing and flushes step
by step, so that they match real runs call for call. See
[Note: stock ZeRO-2 schedule] and [Note: stock ZeRO-3 schedule] in docs/design.md.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from .groups import param_groups, process_group
from .models import ModelSpec
from .schedule import Collective, Schedule

__all__ = [
    "NCCL_START_ALIGNMENT_FACTOR",
    "Partition",
    "check_args",
    "partitions",
    "stock_zero2",
    "stock_zero3",
    "zero3_buckets",
    "zero3_unavailable",
]

# runtime/zero/stage_1_and_2.py: nccl_start_alignment_factor (4-byte alignment / sizeof(fp16)).
NCCL_START_ALIGNMENT_FACTOR = 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Partition:
    """DeepSpeed's flat partition of one ZeRO-1/2 param group.

    Attributes:
        params: trainable parameter indices in flattening order.
        group: global ranks of the group's process group (for the simulated rank).
        offsets: each parameter's element offset in the flat buffer.
        partition_size: ``S``, elements each rank owns.
        numel: the padded flat buffer (``len(group) * S``).
        group_name: the expert group name, None for the data-parallel group (DeepSpeed
            tells process groups apart by object, not by ranks).
    """

    params: tuple[int, ...]
    group: range
    offsets: tuple[int, ...]
    partition_size: int
    numel: int
    group_name: str | None = None

    def slices(self, k: int, numel: int) -> list[tuple[int, int]]:
        """Parameter ``k``'s ``(partition id, grad_start_offset)`` pairs, by offset (``average_tensor``)."""
        start, size = self.offsets[k], self.partition_size
        first, last = start // size, (start + numel - 1) // size
        return [(pid, 0 if pid == first else pid * size - start) for pid in range(first, last + 1)]


def partitions(spec: ModelSpec, world_size: int, rank: int = 0) -> list[Partition]:
    """DeepSpeed's ZeRO-1/2 partitions of every param group of ``spec``, as ``rank`` sees them."""
    out = []
    for g, group in enumerate(param_groups(spec)):
        params = tuple(i for i in group.params if spec.params[i].requires_grad and spec.params[i].numel > 0)
        if not params:
            raise ValueError(
                f"param group {g} ({group.expert_group or 'dense'}) has no trainable parameters with elements; "
                "DeepSpeed's ZeRO optimizer cannot flatten an empty group"
            )
        ranks = process_group(world_size, rank, group.ep_size)
        offsets, cursor = [], 0
        for i in params:
            offsets.append(cursor)
            cursor += spec.params[i].numel
        alignment = NCCL_START_ALIGNMENT_FACTOR * len(ranks)
        padded = _ceil_div(cursor, alignment) * alignment
        out.append(Partition(params, ranks, tuple(offsets), padded // len(ranks), padded, group.expert_group))
    return out


def check_args(spec: ModelSpec, world_size: int, rank: int, bucket_numel: int) -> None:
    """Raise ``ValueError`` naming the argument unless the schedule inputs are valid."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    for name, ep in spec.ep_sizes.items():
        if world_size % ep:
            raise ValueError(f"world_size {world_size} is not a multiple of expert group {name!r}'s ep_size {ep}")


def _backward(spec: ModelSpec, zero3: bool = False) -> Iterator[int]:
    for i in spec.zero3_backward_order if zero3 else spec.backward_order:
        if spec.params[i].numel > 0:
            yield i


def stock_zero2(
    spec: ModelSpec,
    world_size: int,
    *,
    bucket_numel: int = 500_000_000,
    dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    use_multi_rank_bucket_allreduce: bool = True,
    reduce_scatter: bool = True,
    contiguous_gradients: bool = True,
    grad_accum_dtype: torch.dtype | None = None,
    rank: int = 0,
) -> Schedule:
    """Stock ZeRO-2's gradient collectives in one backward on ``rank``. See [Note: stock ZeRO-2 schedule].

    Args:
        spec: the model.
        world_size: data-parallel ranks.
        bucket_numel: ``zero_optimization.reduce_bucket_size``.
        dtype: the parameters' training dtype (fp32, or bf16/fp16 when enabled; default: the spec's).
        comm_dtype: ``communication_data_type`` (default: ``dtype``).
        use_multi_rank_bucket_allreduce: the ZeRO config key (DeepSpeed's default is true).
        reduce_scatter: ``zero_optimization.reduce_scatter``.
        contiguous_gradients: ``zero_optimization.contiguous_gradients``.
        grad_accum_dtype: ``data_types.grad_accum_dtype`` (default: ``dtype``).
        rank: the rank whose view to compute.
    """
    check_args(spec, world_size, rank, bucket_numel)
    dtype = dtype or spec.dtype
    comm_dtype = comm_dtype or dtype
    grad_accum_dtype = grad_accum_dtype or dtype
    if spec.ep_sizes and not (reduce_scatter and contiguous_gradients):
        raise ValueError("DeepSpeed ZeRO-2 with MoE requires reduce_scatter=true and contiguous_gradients=true")
    parts = partitions(spec, world_size, rank)
    where = {i: (g, k) for g, part in enumerate(parts) for k, i in enumerate(part.params)}
    # The fp32 partition buffer of ZeRO-2 (_use_compact_grad_partition_buffer) keeps this rank's slices apart.
    compact = grad_accum_dtype == torch.float32 and dtype != torch.float32
    world = range(world_size)
    calls: list[Collective] = []

    def flush(bucket: list[int]) -> None:
        if not bucket:
            return
        if not (reduce_scatter and contiguous_gradients):
            numel = sum(spec.params[i].numel for i in bucket)
            calls.append(Collective("all_reduce", numel, comm_dtype, world))
            return
        entries: list[list] = []  # [dst partition, numel, (group name, group ranks)]
        prev = None
        for i in bucket:
            g, k = where[i]
            part = parts[g]
            numel = spec.params[i].numel
            pieces = part.slices(k, numel)
            local = part.group.index(rank)
            for idx, (pid, offset) in enumerate(pieces):
                length = (pieces[idx + 1][1] if idx + 1 < len(pieces) else numel) - offset
                own = compact and pid == local
                if not own and prev == (pid, part.group_name):
                    entries[-1][1] += length
                else:
                    entries.append([pid, length, (part.group_name, part.group)])
                prev = (pid, part.group_name)
        keyed: dict[tuple, list[int]] = {}
        for pid, length, group in entries:
            key = ("allreduce", group) if use_multi_rank_bucket_allreduce else ("reduce", pid, group)
            keyed.setdefault(key, []).append(length)
        for key, lengths in keyed.items():
            group = key[-1][1]
            total = 0
            for length in lengths:
                total += length
                if total > bucket_numel:
                    calls.append(_call(key, total, comm_dtype, group))
                    total = 0
            if total:
                calls.append(_call(key, total, comm_dtype, group))

    bucket: list[int] = []
    elements = 0
    for i in _backward(spec):
        numel = spec.params[i].numel
        if elements + numel > bucket_numel:
            flush(bucket)
            bucket, elements = [], 0
        bucket.append(i)
        elements += numel
    flush(bucket)

    mode = "all_reduce" if use_multi_rank_bucket_allreduce else "reduce"
    if not (reduce_scatter and contiguous_gradients):
        mode = "all_reduce of whole buckets"
    return Schedule(
        name=f"stock ZeRO-2, {mode}",
        key="stock_zero2_" + ("allreduce" if use_multi_rank_bucket_allreduce else "reduce"),
        world_size=world_size,
        rank=rank,
        calls=tuple(calls),
        note=(
            f"use_multi_rank_bucket_allreduce={str(use_multi_rank_bucket_allreduce).lower()}: "
            + ("one all_reduce per bucket and process group" if use_multi_rank_bucket_allreduce
               else "one dist.reduce per bucket, destination rank and process group")
        ),
    )  # fmt: skip


def _call(key: tuple, numel: int, dtype: torch.dtype, group: range) -> Collective:
    if key[0] == "allreduce":
        return Collective("all_reduce", numel, dtype, group)
    return Collective("reduce", numel, dtype, group, dst=group[key[1]])


def zero3_buckets(spec: ModelSpec, bucket_numel: int) -> list[list[int]]:
    """ZeRO-3's IPG buckets in backward order (parameter indices). See [Note: stock ZeRO-3 schedule]."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    elements = 0
    for i in _backward(spec, zero3=True):
        numel = spec.params[i].numel
        if bucket and elements + numel > bucket_numel:
            buckets.append(bucket)
            bucket, elements = [], 0
        bucket.append(i)
        elements += numel
    if bucket:
        buckets.append(bucket)
    return buckets


def zero3_unavailable(spec: ModelSpec) -> str | None:
    """Why DeepSpeed 0.19.8 cannot run ``spec`` under ZeRO-3, or None."""
    if spec.ep_sizes:
        return "DeepSpeed 0.19.8 refuses its native MoE under ZeRO-3 ('Native DeepSpeed MoE is not supported with ZeRO Stage 3')"
    return None


def stock_zero3(
    spec: ModelSpec,
    world_size: int,
    *,
    bucket_numel: int = 500_000_000,
    dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    reduce_scatter: bool = True,
    rank: int = 0,
) -> Schedule:
    """Stock ZeRO-3's gradient collectives in one backward. See [Note: stock ZeRO-3 schedule]."""
    check_args(spec, world_size, rank, bucket_numel)
    comm_dtype = comm_dtype or dtype or spec.dtype
    name, key = "stock ZeRO-3", "stock_zero3"
    reason = zero3_unavailable(spec)
    if reason is not None:
        return Schedule(name, key, world_size, rank, (), unavailable=reason)
    world = range(world_size)
    calls = []
    for bucket in zero3_buckets(spec, bucket_numel):
        numels = [spec.params[i].numel for i in bucket]
        payload = sum(numels)
        if reduce_scatter or payload > bucket_numel:
            padded = sum(_ceil_div(n, world_size) * world_size for n in numels)
            calls.append(Collective("reduce_scatter", padded, comm_dtype, world, payload=payload))
        else:
            calls.append(Collective("all_reduce", payload, comm_dtype, world))
    return Schedule(
        name, key, world_size, rank, tuple(calls),
        note="one reduce_scatter per bucket, every parameter padded to a multiple of the world size",
    )  # fmt: skip
