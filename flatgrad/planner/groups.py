"""How DeepSpeed 0.19.8 groups parameters (optimizer param groups) and ranks (process groups).

Both the stock and the flatgrad schedules start from these, because flatgrad
splits DeepSpeed's own groups and reduces over DeepSpeed's own process groups.

* Param groups: ``deepspeed.initialize(model_parameters=list(model.parameters()))``
  with an optimizer from the config gives one group of every parameter. With
  MoE layers the engine calls ``configure_moe_param_groups``: the dense group
  ``"dense-params"`` keeps the non-expert parameters, and every expert group
  name gets groups of its expert parameters (registration order), split
  greedily at ``178,956,971`` elements
  (``split_params_into_different_moe_groups_for_optimizer``). DeepSpeed walks
  the group names as a ``set``; they are sorted here.
* Process groups (``deepspeed.utils.groups._create_expert_and_data_parallel``
  without model parallelism): dense parameters reduce over all ranks; the
  expert-data-parallel group of rank ``r`` for expert-parallel size ``E`` is
  ``range(r % E, W, E)``.
"""

from __future__ import annotations

import dataclasses

from .models import ModelSpec

__all__ = ["OptimizerGroup", "MOE_MAX_GROUP_SIZE", "param_groups", "process_group"]

# deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(max_group_size=...)
MOE_MAX_GROUP_SIZE = 178956971


@dataclasses.dataclass(frozen=True)
class OptimizerGroup:
    """One optimizer param group as DeepSpeed builds it.

    Attributes:
        params: indices into ``ModelSpec.params``, in group order (frozen ones included,
            as DeepSpeed receives them; its ZeRO optimizers drop them).
        expert_group: the expert group name for MoE groups, None for the dense group.
        ep_size: the expert-parallel size of that group (1 for dense).
    """

    params: tuple[int, ...]
    expert_group: str | None = None
    ep_size: int = 1


def param_groups(spec: ModelSpec) -> list[OptimizerGroup]:
    """DeepSpeed's optimizer param groups for ``spec`` (see the module docstring)."""
    if not spec.ep_sizes:
        return [OptimizerGroup(tuple(p.index for p in spec.params))]
    groups = [OptimizerGroup(tuple(p.index for p in spec.params if p.expert_group is None))]
    for name in sorted(spec.ep_sizes):
        chunks: list[list[int]] = []
        current: list[int] = []
        size = 0
        for p in spec.params:
            if p.expert_group != name:
                continue
            if size + p.numel <= MOE_MAX_GROUP_SIZE:
                current.append(p.index)
                size += p.numel
            else:
                chunks.append(current)
                current, size = [p.index], p.numel
        if current:
            chunks.append(current)
        groups += [OptimizerGroup(tuple(c), name, spec.ep_sizes[name]) for c in chunks]
    return groups


def process_group(world_size: int, rank: int, ep_size: int = 1) -> range:
    """Global ranks of the group that ``rank`` reduces a param group of expert-parallel size ``ep_size`` over."""
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"the world size ({world_size}) must be a multiple of the expert-parallel size ({ep_size})")
    if ep_size == 1:
        return range(world_size)
    return range(rank % ep_size, world_size, ep_size)
