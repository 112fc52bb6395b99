"""An alpha-beta time model of one collective call on NVLink and InfiniBand, with nccl-tests conventions.

[Note: cost model]
A call over a group of ``p`` ranks on ``n`` nodes takes

    t = alpha + (steps - inter_steps) * hop_intra + inter_steps * hop_inter + bus_bytes / busbw

* ``bus_bytes = nbytes * factor``, the factor being nccl-tests' bus-bandwidth
  factor (``PERFORMANCE.md`` in NVIDIA/nccl-tests): ``2 (p - 1) / p`` for
  ``all_reduce``, ``(p - 1) / p`` for ``reduce_scatter`` (``nbytes`` = its whole
  input), ``(p - 1) / p`` for ``all_to_all`` too (``nbytes`` = the send buffer;
  each rank keeps ``1 / p`` of it), ``1`` for ``reduce`` (a pipelined chain: every
  link carries the whole buffer). It is what the busiest link of the call carries.
  ``reduction_call`` gives the call of each reduction mode (see [Note: reduction
  modes] in ``flatgrad/reducer.py``): ``exact`` sends the bytes a reduce_scatter
  does, ``int8`` / ``fp8`` their wire format (0.5 + 2 / block of bf16's).
* The report's "bytes sent" is what the simulated rank itself sends: the ring
  share for ``all_reduce`` and ``reduce_scatter``, the whole buffer for a
  ``reduce`` rooted elsewhere, nothing for one rooted at it.
* ``busbw``: the NVLink bus bandwidth when the group fits in one node, else the
  InfiniBand one (a ring is as fast as its slowest hop).
* Latency: NCCL's own ring model (``src/graph/tuning.cc``: ``baseLat`` plus
  ``hwLat`` per ring step; ``steps`` = ``2 (p - 1)`` for ``all_reduce``,
  ``p - 1`` otherwise; ``inter_steps`` the same with nodes for ranks), with the
  LL-protocol figures NCCL uses for small messages, which is where per-call
  latency matters. Tree, NVLS, CollNet and PAT algorithms are not modelled, so
  large-scale ``all_reduce`` latency is pessimistic (NCCL would pick a tree).
* The calls of one backward run one after another (DeepSpeed issues them on
  one stream); the model adds their times and ignores overlap with compute.

Default figures, all flags of ``flatgrad plan``:

============  =========  ========================================================
parameter     default    source
============  =========  ========================================================
NVLink busbw  450 GB/s   nccl-tests ``all_reduce_perf`` on 8x H100 SXM (NVLink 4,
                         NVSwitch) reaches 460-480 GB/s busbw at large sizes
                         (Alaya NeW, "NCCL-tests in practice", reference table)
IB busbw      400 GB/s   nccl-tests ``all_reduce_perf`` across H100 SXM nodes with
                         8x 400 Gb/s NDR InfiniBand: 400-450 GB/s busbw at 8 GB
                         (Saturn Cloud, "Validating multi-node GPU clusters with
                         NCCL tests", expected-performance table)
alpha         3.6 us     NCCL ``baseLat`` ring/LL (``src/graph/tuning.cc``)
NVLink hop    0.47 us    NCCL ``hwLat`` NVLink ring/LL
IB hop        2.7 us     NCCL ``hwLat`` NET ring/LL
GPUs / node   8          DGX/HGX H100
============  =========  ========================================================
"""

from __future__ import annotations

import dataclasses

import torch

from .schedule import Collective, Schedule

__all__ = ["CostModel", "DEFAULT", "reduction_call"]


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
    """

    nvlink_busbw_gbps: float = 450.0
    ib_busbw_gbps: float = 400.0
    alpha_us: float = 3.6
    nvlink_hop_us: float = 0.47
    ib_hop_us: float = 2.7
    gpus_per_node: int = 8

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

    def time(self, call: Collective) -> float:
        """Modelled seconds of one call."""
        p = len(call.group)
        nodes = self.nodes(call.group)
        steps = 2 * (p - 1) if call.op == "all_reduce" else p - 1
        inter = 2 * (nodes - 1) if call.op == "all_reduce" else nodes - 1
        latency = self.alpha_us + (steps - inter) * self.nvlink_hop_us + inter * self.ib_hop_us
        busbw = self.nvlink_busbw_gbps if nodes == 1 else self.ib_busbw_gbps
        return latency * 1e-6 + self.bus_bytes(call) / (busbw * 1e9)

    def schedule_time(self, schedule: Schedule) -> float:
        """Modelled seconds of a schedule's calls, one after another."""
        return sum(self.time(c) for c in schedule.calls)

    def schedule_sent_bytes(self, schedule: Schedule) -> float:
        """Bytes the schedule's rank sends in all its calls."""
        return sum(self.sent_bytes(c, schedule.rank) for c in schedule.calls)


DEFAULT = CostModel()


def reduction_call(reduction: str, numel: int, dtype: torch.dtype, group: range, block: int = 256) -> Collective:
    """The collective that moves a ``numel``-element bucket of ``dtype`` under a reduction mode.

    ``reduce_scatter``: today's call; ``exact``: an ``all_to_all`` of the same
    bytes; ``int8`` / ``fp8``: an ``all_to_all`` of the quantized wire (uint8,
    ``W`` segments of ``flatgrad.kernels.wire.segment_bytes``).
    """
    from ..kernels import wire

    if reduction == "reduce_scatter":
        return Collective("reduce_scatter", numel, dtype, group)
    if reduction == "exact":
        return Collective("all_to_all", numel, dtype, group)
    if reduction not in wire.KINDS:
        raise ValueError(f"reduction must be one of reduce_scatter, exact, {', '.join(wire.KINDS)}; got {reduction!r}")
    p = len(group)
    shard = -(-numel // p)
    return Collective("all_to_all", p * wire.segment_bytes(shard, block), torch.uint8, group, payload=numel)
