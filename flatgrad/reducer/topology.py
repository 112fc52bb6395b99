"""Node and rail groups of a process group, for the two-stage reductions.

A two-stage reduction sends only ``(N - 1) / W`` of a bucket across nodes;
every member makes every node and rail group of its parent in one order, since
``new_group`` (NCCL's ``ncclCommSplit``) needs every rank's same calls. See
[Note: two-stage reductions] in docs/design.md.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch.distributed as dist

__all__ = ["Topology", "default_node_size", "place_ranks", "plan_topology", "two_stage_positions"]


class Topology(NamedTuple):
    """Where the members of a process group sit on nodes; see [Note: two-stage reductions].

    Attributes:
        node_size: ranks per physical node (the config's ``node_size``).
        num_nodes: N, the nodes the group spans.
        local_size: L, the group's members on each node.
        node: this rank's node index in the group (0..N-1).
        local: this rank's local index (0..L-1).
        node_ranks: global ranks of this rank's node group, ascending.
        rail_ranks: global ranks of this rank's rail group, ascending (node order).
        positions: per group rank, where its segment lies in the packed buffer.
        nodes: global ranks of every node group of the parent, in node order (``place_ranks`` fills it).
    """

    node_size: int
    num_nodes: int
    local_size: int
    node: int
    local: int
    node_ranks: tuple[int, ...]
    rail_ranks: tuple[int, ...]
    positions: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...] = ()

    @property
    def two_stage(self) -> bool:
        """Whether both stages have more than one rank (else the two-stage mode is the flat one)."""
        return self.num_nodes > 1 and self.local_size > 1

    def group_ranks(self) -> list[tuple[int, ...]]:
        """Every node group, then every rail group, of the parent: the ``new_group`` calls every member makes."""
        if not self.nodes:
            raise ValueError("this Topology lists no node groups: make it with place_ranks or plan_topology")
        rails = [tuple(node[l] for node in self.nodes) for l in range(self.local_size)]
        return list(self.nodes) + rails

    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Make every group of ``group_ranks()`` and return this rank's (node group, rail group).

        Every member of the parent group calls this once per mode, in the same order: see
        [Note: two-stage reductions].
        """
        made = {ranks: dist.new_group(list(ranks), use_local_synchronization=True) for ranks in self.group_ranks()}
        return made[self.node_ranks], made[self.rail_ranks]


def default_node_size(world_size: int) -> int:
    """The launcher's ``LOCAL_WORLD_SIZE``, or ``world_size`` where it is unset."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else world_size


def two_stage_positions(num_nodes: int, local_size: int) -> tuple[int, ...]:
    """Per group rank ``n * L + l`` (nodes in order), its segment's position ``l * N + n``."""
    return tuple(l * num_nodes + n for n in range(num_nodes) for l in range(local_size))


def plan_topology(
    node_size: int | None, group_ranks: list[int], world_size: int, rank: int, name: str = "node_size"
) -> Topology:
    """The node/rail placement of this rank's group from the config's ``node_size`` and the launcher's view.

    ``None`` takes ``LOCAL_WORLD_SIZE`` (else ``world_size``); a ``node_size`` that differs from a set
    ``LOCAL_WORLD_SIZE`` is refused. Then ``place_ranks``. Makes no group.
    """
    if node_size is None:
        node_size = default_node_size(world_size)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and not isinstance(node_size, bool) and isinstance(node_size, int) and int(local) != node_size:
        raise ValueError(f"{name} = {node_size} differs from the launcher's LOCAL_WORLD_SIZE = {local}")
    return place_ranks(node_size, group_ranks, world_size, rank, name)


def place_ranks(node_size: int, group_ranks: list[int], world_size: int, rank: int, name: str = "node_size") -> Topology:
    """The node/rail placement of a group whose members have global ranks ``group_ranks``; pure arithmetic.

    ``world_size`` is the global world size, ``rank`` this rank's index in the group. Raises
    ``ValueError`` naming ``name`` for a bad ``node_size``. See [Note: two-stage reductions].
    ``flatgrad plan`` prices the two-stage modes from the same placement.
    """
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {node_size!r}")
    if world_size % node_size:
        raise ValueError(f"{name} = {node_size} does not divide the world size {world_size}")
    nodes: dict[int, list[int]] = {}
    for g in group_ranks:
        nodes.setdefault(g // node_size, []).append(g)
    for members in nodes.values():
        members.sort()  # a new group's ranks are in global order
    counts = {len(members) for members in nodes.values()}
    if len(counts) != 1:
        sizes = {n: len(m) for n, m in nodes.items()}
        raise ValueError(f"{name} = {node_size}: the process group's members per node differ ({sizes}); two stages need equal ones")
    order = sorted(nodes)
    local_size = counts.pop()
    positions = two_stage_positions(len(order), local_size)
    index = {member: (order.index(node), members.index(member)) for node, members in nodes.items() for member in members}
    placed = tuple(positions[index[member][0] * local_size + index[member][1]] for member in group_ranks)
    n, l = index[group_ranks[rank]]
    return Topology(
        node_size, len(order), local_size, n, l, tuple(nodes[order[n]]), tuple(nodes[k][l] for k in order), placed,
        tuple(tuple(nodes[k]) for k in order),
    )  # fmt: skip
