"""flatgrad's per-backward gradient collectives under DeepSpeed ZeRO-2 and ZeRO-3, computed without processes.

ZeRO-2's schedule reuses the integration's own sub-group split and replays
the reducer's launch rule over the traced hook order. See
[Note: flatgrad ZeRO-2 schedule] in docs/design.md.

ZeRO-3's calls are stock's, since flatgrad keeps DeepSpeed's IPG buckets. See
[Note: flatgrad ZeRO-3 schedule] in docs/design.md.
"""

from __future__ import annotations

import torch

from ..layout import Layout
from .cost import MODES, reduction_calls
from .groups import param_groups, process_group
from .models import ModelSpec
from .schedule import Collective, Schedule
from .stock import NCCL_START_ALIGNMENT_FACTOR, check_args, zero3_buckets, zero3_unavailable

__all__ = ["flatgrad_zero2", "flatgrad_zero3", "sub_groups"]


def sub_groups(spec: ModelSpec, bucket_numel: int) -> list[tuple[int, list[int]]]:
    """flatgrad's ZeRO-2 sub-groups: ``(index of the DeepSpeed param group, parameter indices in layout order)``."""
    from ..integrations.deepspeed.zero2 import split_param_groups

    if len(spec.parameters) != len(spec.params):
        raise ValueError("the ModelSpec carries no parameter objects; build it with flatgrad.planner.models.describe")
    order = {p: i for i, p in enumerate(spec.parameters)}
    index = {id(p): i for i, p in enumerate(spec.parameters)}
    out = []
    for g, group in enumerate(param_groups(spec)):
        subs = split_param_groups([{"params": [spec.parameters[i] for i in group.params]}], order, bucket_numel)
        out += [(g, [index[id(p)] for p in sub["params"]]) for sub in subs]
    return out


def flatgrad_zero2(
    spec: ModelSpec,
    world_size: int,
    *,
    bucket_numel: int = 500_000_000,
    dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    rank: int = 0,
    reduction: str = "reduce_scatter",
    block: int = 256,
    gpus_per_node: int = 8,
) -> Schedule:
    """flatgrad's ZeRO-2 collectives in one backward on ``rank``. See [Note: flatgrad ZeRO-2 schedule].

    ``reduction`` is any mode of ``flatgrad.planner.cost.MODES``: each bucket's
    reduce_scatter becomes that mode's calls (``cost.reduction_calls``, with
    ``block`` and ``gpus_per_node``); the buckets and their order stay. A
    hierarchical mode over a group that is not whole nodes gives an unavailable
    schedule.
    """
    check_args(spec, world_size, rank, bucket_numel)
    if reduction not in MODES:
        raise ValueError(f"reduction must be one of {', '.join(MODES)}; got {reduction!r}")
    comm_dtype = comm_dtype or dtype or spec.dtype
    groups = param_groups(spec)
    subs = sub_groups(spec, bucket_numel)
    registration = {i: k for k, i in enumerate(p.index for p in spec.params)}

    # One reducer per process group, in order of first appearance; its buckets ordered by completion.
    reducers: dict[str | None, list[int]] = {}
    for s, (g, _) in enumerate(subs):
        reducers.setdefault(groups[g].expert_group, []).append(s)
    for indices in reducers.values():
        indices.sort(key=lambda s: -min(registration[i] for i in subs[s][1]))
    bucket_of = {i: s for s, (_, params) in enumerate(subs) for i in params}

    layouts, ranks = [], []
    for g, params in subs:
        group = process_group(world_size, rank, groups[g].ep_size)
        ranks.append(group)
        layouts.append(Layout.flat([spec.params[i].numel for i in params], len(group), NCCL_START_ALIGNMENT_FACTOR))

    calls: list[Collective] = []

    def launch(s: int) -> None:
        if len(ranks[s]) > 1:
            layout = layouts[s]
            if reduction == "reduce_scatter":
                payload = layout.numel_unpadded
                calls.append(Collective("reduce_scatter", layout.numel, comm_dtype, ranks[s], payload=payload))
            else:
                calls.extend(reduction_calls(
                    reduction, layout.numel, comm_dtype, ranks[s], rank=rank, block=block, gpus_per_node=gpus_per_node,
                    world_size=world_size,
                ))  # fmt: skip

    name, key = "flatgrad ZeRO-2", "flatgrad_zero2"
    if reduction != "reduce_scatter":
        name, key = f"{name}, {reduction}", f"{key}_{reduction}"

    pending = [len(params) for _, params in subs]
    launched = {group_name: 0 for group_name in reducers}
    try:
        for i in spec.backward_order:
            if i not in bucket_of:
                continue
            s = bucket_of[i]
            pending[s] -= 1
            group_name = groups[subs[s][0]].expert_group
            order = reducers[group_name]
            while launched[group_name] < len(order) and pending[order[launched[group_name]]] == 0:
                launch(order[launched[group_name]])
                launched[group_name] += 1
        for group_name, order in reducers.items():
            for s in order[launched[group_name] :]:
                launch(s)
    except ValueError as exc:  # a hierarchical mode over a group that is not whole nodes
        return Schedule(name, key, world_size, rank, (), unavailable=str(exc))

    return Schedule(
        name=name,
        key=key,
        world_size=world_size,
        rank=rank,
        calls=tuple(calls),
        note=f"one {reduction} per bucket-sized sub-group; every rank owns 1/p of every bucket",
    )


def flatgrad_zero3(
    spec: ModelSpec,
    world_size: int,
    *,
    bucket_numel: int = 500_000_000,
    dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    rank: int = 0,
    reduction: str = "reduce_scatter",
    block: int = 256,
    gpus_per_node: int = 8,
) -> Schedule:
    """flatgrad's ZeRO-3 collectives in one backward. See [Note: flatgrad ZeRO-3 schedule].

    ``reduction`` is any mode of ``flatgrad.planner.cost.MODES``, priced over stock's buckets as for
    ZeRO-2 (``cost.reduction_calls``); a hierarchical mode over a world that is not whole nodes gives an
    unavailable schedule.
    """
    check_args(spec, world_size, rank, bucket_numel)
    if reduction not in MODES:
        raise ValueError(f"reduction must be one of {', '.join(MODES)}; got {reduction!r}")
    comm_dtype = comm_dtype or dtype or spec.dtype
    name, key = "flatgrad ZeRO-3", "flatgrad_zero3"
    if reduction != "reduce_scatter":
        name, key = f"{name}, {reduction}", f"{key}_{reduction}"
    reason = zero3_unavailable(spec)
    if reason is not None:
        return Schedule(name, key, world_size, rank, (), unavailable=reason)
    world = range(world_size)
    calls: list[Collective] = []
    if world_size > 1:
        try:
            for bucket in zero3_buckets(spec, bucket_numel):
                layout = Layout.chunked([spec.params[i].numel for i in bucket], world_size)
                if reduction == "reduce_scatter":
                    calls.append(Collective("reduce_scatter", layout.numel, comm_dtype, world, payload=layout.numel_unpadded))
                else:
                    calls.extend(reduction_calls(
                        reduction, layout.numel, comm_dtype, world, rank=rank, block=block, gpus_per_node=gpus_per_node,
                        world_size=world_size,
                    ))  # fmt: skip
        except ValueError as exc:  # a hierarchical mode over a world that is not whole nodes
            return Schedule(name, key, world_size, rank, (), unavailable=str(exc))
    return Schedule(
        name, key, world_size, rank, tuple(calls),
        note="stock's buckets and collectives; one fused pack and unpack replace the copies around them"
        if reduction == "reduce_scatter"
        else f"stock's buckets, each reduced by {reduction}; one fused pack and unpack replace the copies around them",
    )  # fmt: skip
