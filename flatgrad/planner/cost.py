"""An alpha-beta time model of one collective call on NVLink and InfiniBand, with nccl-tests conventions.

Each call is priced alone from NCCL's own ring latencies and nccl-tests'
bus-bandwidth factors, and the calls of a backward are added in series; the
link parameters are ``CostModel``'s fields. See [Note: cost model] in docs/design.md.

An all_to_all is priced as the per-peer sends NCCL makes, not as a ring, and
the two-stage modes as their two stages. See [Note: all_to_all cost] in docs/design.md.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import wire
from ..reducer import registry
from .schedule import Collective, Schedule

__all__ = ["CostModel", "DEFAULT", "FLAT_MODES", "HIERARCHICAL_MODES", "MODES", "reduction_call", "reduction_calls"]

FLAT_MODES = registry.names(two_stage=False)
"""The reducer's flat modes: one call per bucket over its group (``flatgrad.reducer.registry``)."""
HIERARCHICAL_MODES = registry.names(two_stage=True)
"""Two-stage modes (the reducer's, placed as it places them). See [Note: all_to_all cost]."""
MODES = registry.names()


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Link parameters of the alpha-beta model. See [Note: cost model].

    Attributes:
        nvlink_busbw_gbps: bus bandwidth inside a node, GB/s (1e9 bytes/s).
        ib_busbw_gbps: bus bandwidth of a group that spans nodes, GB/s.
        alpha_us: fixed latency of a call, microseconds.
        nvlink_hop_us: latency per ring step between GPUs of one node.
        ib_hop_us: latency per ring step between nodes.
        gpus_per_node: ranks per node (global rank // gpus_per_node is the node).
        ib_nic_gbps: line rate of one GPU's own NIC, GB/s: what its all_to_all
            traffic to other nodes goes through (see [Note: all_to_all cost]).
    """

    nvlink_busbw_gbps: float = 450.0
    ib_busbw_gbps: float = 400.0
    alpha_us: float = 3.6
    nvlink_hop_us: float = 0.47
    ib_hop_us: float = 2.7
    gpus_per_node: int = 8
    ib_nic_gbps: float = 50.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0 and not (field.name.endswith("_us") and value == 0):
                raise ValueError(f"{field.name} must be positive, got {value!r}")

    @staticmethod
    def factor(call: Collective) -> float:
        """nccl-tests' bus-bandwidth factor of the call's op."""
        p = len(call.group)
        if call.op == "all_reduce":
            return 2 * (p - 1) / p
        if call.op in ("reduce_scatter", "all_to_all"):
            return (p - 1) / p
        return 1.0 if p > 1 else 0.0

    def bus_bytes(self, call: Collective) -> float:
        """Bytes the call's busiest link carries (nccl-tests' bus bytes)."""
        return call.nbytes * self.factor(call)

    def sent_bytes(self, call: Collective, rank: int) -> float:
        """Bytes ``rank`` sends in the call (ring algorithms; a reduce's root sends nothing)."""
        if call.op == "reduce":
            return 0.0 if call.dst == rank or len(call.group) == 1 else float(call.nbytes)
        return self.bus_bytes(call)

    def nodes(self, group: range) -> int:
        """Nodes the ranks of ``group`` live on (rank // gpus_per_node), without walking the group."""
        if len(group) == 0:
            return 0
        g, first, last = self.gpus_per_node, group[0], group[-1]
        # Members closer than a node apart leave no node in between empty; farther apart, each has its own.
        return last // g - first // g + 1 if abs(group.step) <= g else len(group)

    def local(self, group: range) -> int:
        """The group's ranks per node (groups spread evenly over their nodes, as DeepSpeed's are)."""
        return max(1, len(group) // max(1, self.nodes(group)))

    def latency(self, call: Collective) -> float:
        """The call's alpha terms, seconds: fixed latency plus one hop per ring step or all_to_all peer."""
        p = len(call.group)
        if call.op == "all_to_all":  # See [Note: all_to_all cost]
            local = self.local(call.group)
            intra, inter = local - 1, p - local
        else:
            nodes = self.nodes(call.group)
            steps = 2 * (p - 1) if call.op == "all_reduce" else p - 1
            inter = 2 * (nodes - 1) if call.op == "all_reduce" else nodes - 1
            intra = steps - inter
        return (self.alpha_us + intra * self.nvlink_hop_us + inter * self.ib_hop_us) * 1e-6

    def bandwidth_time(self, call: Collective) -> float:
        """The call's bandwidth terms, seconds (its bytes over the link that limits it)."""
        p = len(call.group)
        if p <= 1:
            return 0.0
        if call.op == "all_to_all":  # See [Note: all_to_all cost]
            local = self.local(call.group)
            nvlink = call.nbytes * (local - 1) / p / (self.nvlink_busbw_gbps * 1e9)
            return max(nvlink, self.inter_node_bytes(call) / (self.ib_nic_gbps * 1e9))
        if self.nodes(call.group) == 1:
            busbw = self.nvlink_busbw_gbps
        else:  # a ring's IB bandwidth is its node-boundary crossings', one NIC per rank of the group on a node
            busbw = min(self.ib_busbw_gbps, self.local(call.group) * self.ib_nic_gbps)
        return self.bus_bytes(call) / (busbw * 1e9)

    def inter_node_bytes(self, call: Collective) -> float:
        """Bytes a rank of the call sends to other nodes, averaged over the group's ranks.

        all_to_all: its chunks for the peers on other nodes. Rings: the bus bytes of one
        hop in ``local`` (the one that crosses to the next node). reduce: the bus bytes
        when the chain spans nodes, shared by the ``local`` ranks of a node.
        """
        p = len(call.group)
        if p <= 1 or self.nodes(call.group) == 1:
            return 0.0
        local = self.local(call.group)
        if call.op == "all_to_all":
            return call.nbytes * (p - local) / p
        return self.bus_bytes(call) / local

    def time(self, call: Collective) -> float:
        """Modelled seconds of one call: ``latency`` plus ``bandwidth_time``."""
        return self.latency(call) + self.bandwidth_time(call)

    def schedule_time(self, schedule: Schedule) -> float:
        """Modelled seconds of a schedule's calls, one after another."""
        return sum(self.time(c) for c in schedule.calls)

    def schedule_latency(self, schedule: Schedule) -> float:
        """The alpha terms of a schedule's calls, seconds."""
        return sum(self.latency(c) for c in schedule.calls)

    def schedule_inter_node_bytes(self, schedule: Schedule) -> float:
        """Bytes a rank sends to other nodes in all of a schedule's calls (average over the group)."""
        return sum(self.inter_node_bytes(c) for c in schedule.calls)

    def schedule_sent_bytes(self, schedule: Schedule) -> float:
        """Bytes the schedule's rank sends in all its calls."""
        return sum(self.sent_bytes(c, schedule.rank) for c in schedule.calls)


DEFAULT = CostModel()


def _stage_call(stage: registry.Stage, numel: int, dtype: torch.dtype, members: range, block: int) -> Collective:
    """The collective of one stage of a mode, moving ``numel`` elements among ``members``."""
    if stage.payload == "wire":  # W segments of the wire format, one per member
        nbytes = len(members) * wire.segment_bytes(-(-numel // len(members)), block)
        return Collective(stage.collective, nbytes, torch.uint8, members, payload=numel)
    return Collective(stage.collective, numel, torch.float32 if stage.payload == "fp32" else dtype, members)


def reduction_call(reduction: str, numel: int, dtype: torch.dtype, group: range, block: int = 256) -> Collective:
    """The collective that moves a ``numel``-element bucket of ``dtype`` under a flat reduction mode.

    Priced from the mode's registry entry: ``reduce_scatter`` is one reduce_scatter of the comm dtype,
    ``exact`` an ``all_to_all`` of the same bytes, ``int8`` / ``fp8`` an ``all_to_all`` of the quantized
    wire (uint8, ``W`` segments of ``flatgrad.kernels.wire.segment_bytes``).
    """
    if reduction not in FLAT_MODES:
        raise ValueError(f"reduction must be one of {', '.join(FLAT_MODES)}; got {reduction!r}")
    return _stage_call(registry.entry(reduction).stages[0], numel, dtype, group, block)


def reduction_calls(
    reduction: str,
    numel: int,
    dtype: torch.dtype,
    group: range,
    *,
    rank: int | None = None,
    block: int = 256,
    gpus_per_node: int = 8,
    world_size: int | None = None,
) -> tuple[Collective, ...]:
    """The calls that move a ``numel``-element bucket of ``dtype`` under any mode of ``MODES``, as ``rank`` sees them.

    Flat modes: ``(reduction_call(...),)``. Two-stage modes (see [Note: all_to_all cost]): the node
    stage over ``rank``'s node, then the rail stage over its rail (none when the group is one node),
    each priced from the mode's registry entry, placed by ``flatgrad.reducer.topology.place_ranks`` as
    the reducer places them (``world_size``: the global one, default the group's nodes, whole). The
    rail stage moves what the node stage left this rank: ``numel / L`` elements. ``numel`` must be a
    multiple of the group size (flatgrad's layouts pad to it).
    """
    if reduction in FLAT_MODES:
        return (reduction_call(reduction, numel, dtype, group, block),)
    if reduction not in HIERARCHICAL_MODES:
        raise ValueError(f"reduction must be one of {', '.join(MODES)}; got {reduction!r}")
    p, g = len(group), gpus_per_node
    rank = group.start if rank is None else rank
    if rank not in group:
        raise ValueError(f"rank {rank} is not in the group {group}")
    if numel % p:
        raise ValueError(f"numel ({numel}) must be a multiple of the group size ({p})")
    from ..reducer.topology import place_ranks

    world = world_size if world_size is not None else -(-(group[-1] + 1) // g) * g
    try:  # the reducer's own placement: see [Note: two-stage reductions] in docs/design.md
        topology = place_ranks(g, list(group), world, group.index(rank), name="gpus_per_node")
    except ValueError as exc:
        raise ValueError(f"{reduction} needs a group spread evenly over whole nodes of {g} ranks, got {group}: {exc}") from exc
    node, rail = _strided(topology.node_ranks), _strided(topology.rail_ranks)
    part = numel // topology.local_size  # what this rank owns after the node stage; the rail splits it n ways
    first, second = registry.entry(reduction).stages
    calls = [_stage_call(first, numel, dtype, node, block), _stage_call(second, part, dtype, rail, block)]
    return tuple(c for c in calls if len(c.group) > 1)


def _strided(ranks: tuple[int, ...]) -> range:
    """A node or rail group's ranks (evenly strided by construction) as the ``range`` a ``Collective`` holds."""
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    out = range(ranks[0], ranks[-1] + step, step)
    if tuple(out) != ranks:
        raise ValueError(f"group ranks {ranks} are not evenly strided")
    return out
