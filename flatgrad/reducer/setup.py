"""A reduction mode for a process group: its topology planned, the mode built. ``BucketReducer`` and ZeRO-3 use it.

Planning is local (it issues no collective), so that each caller folds a bad ``node_size`` into its
own all-ranks agreement before any group is made, and connects the mode (its node and rail groups)
afterwards. See [Note: two-stage reductions] in docs/design.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from . import registry
from .config import ReducerConfig
from .modes import ReductionMode
from .topology import Topology, plan_topology

__all__ = ["ModePlan", "plan_mode"]


class ModePlan(NamedTuple):
    """The mode a group runs, and the group's placement on nodes (``None`` for a flat mode)."""

    mode: ReductionMode
    topology: Topology | None


def plan_mode(config: ReducerConfig, group: dist.ProcessGroup | None, key: str = "node_size") -> ModePlan:
    """The mode ``config.reduction`` names, for ``group`` (``None``: the default group), not yet connected.

    Raises ``ValueError`` naming ``key`` for a ``node_size`` the group cannot be placed with.
    """
    world_size = dist.get_world_size(group)
    topology = None
    if registry.entry(config.reduction).two_stage and world_size > 1:
        members = dist.get_process_group_ranks(group or dist.group.WORLD)
        topology = plan_topology(config.node_size, list(members), dist.get_world_size(), dist.get_rank(group), key)
    mode = registry.build_mode(
        config.reduction, world_size, block=config.block, error_feedback=config.error_feedback, topology=topology
    )
    return ModePlan(mode, topology)
