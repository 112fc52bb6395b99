"""How DeepSpeed's ZeRO-1/2 partitions lie on flatgrad's layouts: checked once, viewed as step() expects.

Every sub-group's flat buffer and partition must be exactly ``Layout.flat``'s, or
the run stops before training (see [Note: bucket-aligned sub-groups] in docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ....layout import Layout

__all__ = ["agree_on_setup", "arena_positions", "host_gradient", "partition_views", "verify_layout", "view_plan"]


def verify_layout(optimizer: Any, i: int, layout: Layout, rank: int) -> None:
    """Raise unless ``layout`` is exactly DeepSpeed's flat buffer and partition of sub-group ``i``."""
    o = optimizer
    params = o.round_robin_bit16_groups[i]

    def fail(what: str) -> None:
        raise RuntimeError(
            f"flatgrad: sub-group {i} ({len(params)} params, {layout.numel_unpadded} elements, world size "
            f"{layout.world_size}) does not match DeepSpeed's own partitioning: {what}. Refusing to train with "
            "a gradient layout that differs from the optimizer's."
        )

    flat = o.bit16_groups_flat[i]
    if flat.numel() != layout.numel:
        fail(f"flat buffer has {flat.numel()} elements, layout {layout.numel}")
    if int(o.partition_size[i]) != layout.shard_numel:
        fail(f"partition_size {o.partition_size[i]} != shard_numel {layout.shard_numel}")
    base, size = flat.data_ptr(), flat.element_size()
    for k, (p, offset) in enumerate(zip(params, layout.offsets)):
        if p.data_ptr() != base + offset * size:
            fail(f"param {k} is not at element offset {offset} of the flat buffer")
    pieces = layout.pieces(rank)
    in_partition = o.params_in_partition[i]
    if [id(params[pc.tensor_index]) for pc in pieces] != [id(p) for p in in_partition]:
        fail(f"params_in_partition of rank {rank} differ from the layout's pieces")
    if int(o.first_offset[i]) != (pieces[0].tensor_offset if pieces else 0):
        fail(f"first_offset {o.first_offset[i]} differs")
    for pc in pieces:
        pid = o.get_param_id(params[pc.tensor_index])
        if int(o.grad_partition_insertion_offset[i][rank][pid]) != pc.shard_offset:
            fail(f"insertion offset of param {pc.tensor_index} differs")
        if int(o.grad_start_offset[i][rank][pid]) != pc.tensor_offset:
            fail(f"start offset of param {pc.tensor_index} differs")



def host_gradient(optimizer: Any, i: int, layout: Layout) -> torch.Tensor:
    """Sub-group ``i``'s fp32 gradient partition on the host, which the offloaded optimizer reads (stock's own)."""
    grad = optimizer.single_partition_of_fp32_groups[i].grad
    if grad is None or grad.numel() != layout.shard_numel:
        raise RuntimeError(
            f"flatgrad: sub-group {i} has no host gradient partition of {layout.shard_numel} elements "
            "(DeepSpeed allocates it under 'zero_optimization.offload_optimizer')"
        )
    return grad



def agree_on_setup(group: Any, local_error: Exception | None) -> None:
    """Raise on every rank of ``group`` if the setup failed on any (the reducer's agreement step).

    A rank that raised alone would leave the others waiting forever in the
    reducers' first collective. See [Note: layout agreement] in ``flatgrad/reducer/agreement.py``.
    """
    import torch.distributed as tdist

    from ....reducer import agree, agreement_device

    rank, world_size = tdist.get_rank(group), tdist.get_world_size(group)
    if world_size > 1:
        agree(group, rank, world_size, [], local_error, agreement_device(group))
    if local_error is not None:
        raise local_error



def arena_positions(indices: Sequence[int]) -> list[int]:
    """Each bucket's place in its reducer's arenas: sub-group index order, as the master arena's."""
    rank_of = {i: k for k, i in enumerate(sorted(indices))}
    return [rank_of[i] for i in indices]



def view_plan(
    layout: Layout, rank: int, params: Sequence[torch.Tensor]
) -> list[tuple[int, int, torch.Size | None]]:
    """``(offset, length, shape)`` of every view step() expects of the partition, in partition order.

    One view per piece (shaped like its param when it holds all of it), and one
    per gap of padding, marked by ``shape is None``.
    """
    plan: list[tuple[int, int, torch.Size | None]] = []
    cursor = 0
    for pc in layout.pieces(rank):
        if pc.shard_offset > cursor:
            plan.append((cursor, pc.shard_offset - cursor, None))
        p = params[pc.tensor_index]
        whole = pc.tensor_offset == 0 and pc.length == p.numel()
        plan.append((pc.shard_offset, pc.length, p.shape if whole else torch.Size([pc.length])))
        cursor = pc.shard_offset + pc.length
    if cursor < layout.shard_numel:
        plan.append((cursor, layout.shard_numel - cursor, None))
    return plan



def partition_views(shard: torch.Tensor, plan: list[tuple[int, int, torch.Size | None]]) -> list[torch.Tensor]:
    """The views of ``plan`` over ``shard``; padding views carry ``_zero_padding`` as step() expects."""
    views: list[torch.Tensor] = []
    for offset, length, shape in plan:
        view = shard.narrow(0, offset, length)
        if shape is None:
            view._zero_padding = True
        elif len(shape) != 1:
            view = view.view(shape)
        views.append(view)
    return views

