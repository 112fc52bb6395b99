"""Reduction modes: what moves one bucket from the gradients to this rank's shard.

Each mode is one object that owns its part of a bucket's life: the plan its pack runs, the pool
buffers it needs and its views of them, the pack, the collective and the unpack. The bucket's one
reduction path (``Bucket.reduce``) calls them; the reducer never asks which mode it runs. Adding a
mode is one class here plus one entry in ``flatgrad.reducer.registry``. See [Note: reduction modes]
and [Note: two-stage reductions] in docs/design.md.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..kernels import PackPlan
from ..kernels import wire
from ..layout import Layout
from .topology import Topology

__all__ = [
    "BucketPlan", "ExactSum", "HierarchicalExact", "HierarchicalQuantized", "PoolSlot", "QuantizedTwoStage",
    "QuantizedWire", "ReduceScatter", "ReductionMode", "StagedWork", "TwoStageReduceScatter", "Views",
]  # fmt: skip

PoolSlot = tuple[str, int, torch.dtype]  # (purpose, elements per buffer, dtype)


class BucketPlan(Protocol):
    """What a mode reads of a bucket: its static plan (``flatgrad.reducer.Bucket`` is one)."""

    id: int
    layout: Layout
    rank: int
    comm_dtype: torch.dtype
    op: Any
    method: str
    backend: str | None
    pack_plan: Any
    pack_scale: float
    unpack_scale: float
    divide: bool
    residual: torch.Tensor | None
    wire_kernels: Any
    unpack_wire_kernels: Any

    def unpack_plan_for(self, shard: Any) -> Any:
        """The bucket's unpack plan for ``shard``'s form, made once."""


class Views(Protocol):
    """A mode's views of the pool buffers for one micro-step; ``received`` is what its unpack reads."""

    received: torch.Tensor


class ReductionMode(abc.ABC):
    """The interface every mode implements; see [Note: reduction modes] in docs/design.md."""

    name: str = ""
    block: int = 0
    error_feedback: bool = False
    packs_comm_buffer: bool = True  # the pack writes a comm-dtype buffer (which a bucket may divide in place)
    # The unpack writes a shard given as one tensor or as one per piece (it reads this rank's comm-dtype
    # segment); False: it sums sources, or dequantizes a wire, into one contiguous shard only.
    unpacks_pieces: bool = False

    @classmethod
    def build(
        cls, name: str, kind: str | None, block: int, error_feedback: bool, topology: Topology | None
    ) -> "ReductionMode":
        """The mode registered as ``name`` (with wire ``kind``), for a group placed as ``topology`` says."""
        return cls()

    def describe(self) -> tuple:
        """What every rank must agree on about this mode (part of [Note: layout agreement])."""
        return (self.name, self.block, self.error_feedback)

    def averaging(
        self, average: bool, world_size: int, dtype: torch.dtype, group: dist.ProcessGroup | None, device: torch.device
    ) -> comm.Averaging:
        """How this mode averages over ``world_size`` ranks (see [Note: averaging] in docs/design.md)."""
        if not average:
            return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
        return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / world_size)  # the unpack sums in fp32: average there

    def pack_plan(
        self, layout: Layout, count: int, dtype: torch.dtype, device: torch.device, backend: str | None
    ) -> Any:
        """The bucket's pack plan, validated once (see [Note: plans] in docs/design.md)."""
        return PackPlan(layout, [None] * count, dtype=dtype, device=device, backend=backend)

    def residual(self, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """The persistent per-bucket state this mode carries between steps (``None``: none)."""
        return None

    def wire_kernels(self, backend: str | None) -> Any:
        """The wire kernels the mode's unpack (or stage) runs, resolved at construction (``None``: none)."""
        return None

    def connect(self) -> None:
        """Make the process groups the mode needs (none here); called once the ranks agreed on the buckets."""

    def pool_dtype(self, comm_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype that keys this mode's pool: buckets of one device and pool dtype share buffers."""
        return comm_dtype

    @abc.abstractmethod
    def pool_slots(self, layouts: Sequence[Layout], comm_dtype: torch.dtype) -> list[PoolSlot]:
        """The buffers one pool slot holds for buckets of ``layouts`` (which share a device and pool dtype)."""

    @abc.abstractmethod
    def bind(self, b: BucketPlan, buffers: Mapping[str, torch.Tensor]) -> Views:
        """``b``'s views of this micro-step's pool buffers, one per purpose of ``pool_slots``."""

    @abc.abstractmethod
    def pack(self, b: BucketPlan, views: Any, grads: list[torch.Tensor | None]) -> None:
        """Fill what the bucket's collective sends."""

    @abc.abstractmethod
    def start(
        self, b: BucketPlan, views: Any, group: dist.ProcessGroup | None, collectives: comm.Collectives | None
    ) -> Any:
        """Start the bucket's collective (async); returns its work handle or ``None``."""

    @abc.abstractmethod
    def unpack(self, b: BucketPlan, received: torch.Tensor, shard: Any, accumulate: bool, collect_stats: bool) -> Any:
        """Write (or add) ``received`` into ``shard``; returns the stats when ``collect_stats``."""


def _pack_comm_buffer(b: BucketPlan, grads: list[torch.Tensor | None], buffer: torch.Tensor) -> None:
    """The comm-dtype pack; with ``b.divide``, the packed buffer divided by W in place, as stock ZeRO-3 divides
    (see [Note: ZeRO-3 reduce path] in docs/design.md)."""
    b.pack_plan(grads, buffer, scale=b.pack_scale)
    if b.divide:
        buffer.div_(b.layout.world_size)


def _input(b: BucketPlan, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return buffers["input"].narrow(0, 0, b.layout.numel)


@dataclasses.dataclass(frozen=True)
class FlatViews:
    """The comm-dtype buffer, its per-rank chunks for the list form, and this rank's chunk (in place)."""

    input: torch.Tensor
    chunks: list[torch.Tensor] | None
    received: torch.Tensor


class ReduceScatter(ReductionMode):
    """Comm-dtype buffer, one in-place reduce_scatter, the fused unpack of this rank's chunk."""

    name = "reduce_scatter"
    unpacks_pieces = True

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        if not average:
            return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
        return comm.averaging(world_size, dtype, group, device)

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        return [("input", max(layout.numel for layout in layouts), comm_dtype)]

    def bind(self, b, buffers) -> FlatViews:
        layout, buffer = b.layout, _input(b, buffers)
        # The list form's per-rank views, made once per binding; the tensor form needs none.
        chunks = list(buffer.chunk(layout.world_size)) if b.method == "list" else None
        # In place: this rank's chunk of the input. World size 1: the whole input.
        return FlatViews(buffer, chunks, buffer.narrow(0, b.rank * layout.shard_numel, layout.shard_numel))

    def pack(self, b, views, grads) -> None:
        _pack_comm_buffer(b, grads, views.input)

    def start(self, b, views, group, collectives) -> Any:
        return comm.reduce_scatter(
            views.received, views.input, group=group, op=b.op, async_op=True, method=b.method,
            input_chunks=views.chunks, collectives=collectives,
        )  # fmt: skip

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_plan_for(shard)(
            received, shard, scale=b.unpack_scale, accumulate=accumulate, return_stats=collect_stats
        )


@dataclasses.dataclass(frozen=True)
class ExchangeViews:
    """A send buffer and the receive buffer of one all_to_all (which the unpack reads)."""

    input: torch.Tensor
    received: torch.Tensor


class ExactSum(ReductionMode):
    """Comm-dtype buffer, one all_to_all, an fp32 sum over the sources in rank order: deterministic."""

    name = "exact"

    def wire_kernels(self, backend) -> Any:
        return wire.wire_kernels(backend)

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        size = max(layout.numel for layout in layouts)
        return [("input", size, comm_dtype), ("recv", size, comm_dtype)]

    def bind(self, b, buffers) -> ExchangeViews:
        return ExchangeViews(_input(b, buffers), buffers["recv"].narrow(0, 0, b.layout.numel))

    def pack(self, b, views, grads) -> None:
        _pack_comm_buffer(b, grads, views.input)

    def start(self, b, views, group, collectives) -> Any:
        return comm.all_to_all(views.received, views.input, group=group, async_op=True, collectives=collectives)

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_wire_kernels.sum_sources(
            received, b.layout.world_size, shard, b.unpack_scale, accumulate, collect_stats
        )


class QuantizedWire(ReductionMode):
    """int8 or fp8 blocks with fp32 scales: one fused pack-quantize, one all_to_all, dequantize + fp32 sum."""

    packs_comm_buffer = False

    def __init__(self, kind: str, block: int, error_feedback: bool) -> None:
        self.name = kind
        self.block = block
        self.error_feedback = error_feedback

    @classmethod
    def build(cls, name, kind, block, error_feedback, topology) -> "QuantizedWire":
        return cls(kind, block, error_feedback)

    def pack_plan(self, layout, count, dtype, device, backend) -> Any:
        return wire.PackQuantizePlan(
            layout, [None] * count, block=self.block, kind=self.name, device=device, backend=backend
        )

    def residual(self, layout, device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        return torch.zeros(layout.numel, dtype=torch.float32, device=device)  # persistent, zero at the start

    def wire_kernels(self, backend) -> Any:
        return wire.wire_kernels(backend)

    def pool_dtype(self, comm_dtype) -> torch.dtype | None:
        return None  # the wire is bytes whatever the comm dtype: one pool per device

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        nbytes = max(layout.world_size * wire.segment_bytes(layout.shard_numel, self.block) for layout in layouts)
        return [("wire_send", nbytes, torch.uint8), ("wire_recv", nbytes, torch.uint8)]

    def bind(self, b, buffers) -> ExchangeViews:
        n = b.pack_plan.wire_bytes
        return ExchangeViews(buffers["wire_send"].narrow(0, 0, n), buffers["wire_recv"].narrow(0, 0, n))

    def pack(self, b, views, grads) -> None:
        b.pack_plan(grads, views.input, b.residual, scale=b.pack_scale)

    def start(self, b, views, group, collectives) -> Any:
        return comm.all_to_all(views.received, views.input, group=group, async_op=True, collectives=collectives)

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_wire_kernels.dequantize_sum(
            received, b.layout.world_size, self.block, self.name, shard, b.unpack_scale, accumulate, collect_stats
        )


class StagedWork:
    """The work handle of a two-stage collective: the second stage starts once the first is complete.

    ``is_completed()`` starts the second stage when it finds the first done (without blocking);
    ``wait()`` waits for the first, starts the second if need be and waits for it.
    """

    __slots__ = ("_first", "_second", "_start")

    def __init__(self, first: Any, start_second: Any) -> None:
        self._first = first
        self._start = start_second
        self._second: Any = None

    def _advance(self) -> None:
        if self._start is not None:
            if self._first is not None:
                self._first.wait()
            start, self._start = self._start, None
            self._second = start()

    def is_completed(self) -> bool:
        """Whether both stages are done; starts the second stage once the first is."""
        if self._start is not None:
            if self._first is not None and not self._first.is_completed():
                return False
            self._advance()
        return self._second is None or self._second.is_completed()

    def wait(self) -> bool:
        """Wait for both stages (on CUDA, order the current stream after them)."""
        self._advance()
        if self._second is not None:
            self._second.wait()
        return True


@dataclasses.dataclass(frozen=True)
class TwoStageViews:
    """The comm-dtype buffer in the two-stage order, this rank's node chunk of it, and its own segment."""

    input: torch.Tensor
    stage: torch.Tensor
    received: torch.Tensor
    input_chunks: list[torch.Tensor] | None
    stage_chunks: list[torch.Tensor] | None


class TwoStageReduceScatter(ReduceScatter):
    """Comm-dtype buffer in the two-stage order: reduce_scatter in the node, then over the rail; in place."""

    name = "2d_reduce_scatter"
    unpacks_pieces = True

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.node_group: dist.ProcessGroup | None = None
        self.rail_group: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, name, kind, block, error_feedback, topology) -> "TwoStageReduceScatter":
        return cls(topology)

    def describe(self) -> tuple:
        return (*super().describe(), f"node_size={self.topology.node_size}")

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        # bf16: an AVG in each stage would round each division to bf16; the sums run in bf16 and the
        # 1/W is one fp32 multiply in the unpack. Otherwise as ReduceScatter (AVG per stage where the
        # backend has it: 1/L then 1/N; fp16: the split of [Note: averaging], a SUM in both stages).
        if average and dtype == torch.bfloat16:
            return ReductionMode.averaging(self, average, world_size, dtype, group, device)
        return super().averaging(average, world_size, dtype, group, device)

    def connect(self) -> None:
        self.node_group, self.rail_group = self.topology.groups()

    def pack_plan(self, layout, count, dtype, device, backend) -> Any:
        ordered = layout.reordered(self.topology.positions)
        return PackPlan(ordered, [None] * count, dtype=dtype, device=device, backend=backend)

    def bind(self, b, buffers) -> TwoStageViews:
        t, s = self.topology, b.layout.shard_numel
        buffer = _input(b, buffers)
        stage = buffer.narrow(0, t.local * t.num_nodes * s, t.num_nodes * s)  # this rank's node chunk
        lists = b.method == "list"
        return TwoStageViews(
            buffer, stage, stage.narrow(0, t.node * s, s),  # this rank's rail chunk of it: its own segment
            list(buffer.chunk(t.local_size)) if lists else None, list(stage.chunk(t.num_nodes)) if lists else None,
        )  # fmt: skip

    def _node_stage(self, b: BucketPlan, views: Any, collectives: comm.Collectives | None) -> Any:
        """The comm-dtype reduce_scatter in the node group, onto this rank's node chunk."""
        return comm.reduce_scatter(
            views.stage, views.input, group=self.node_group, op=b.op, async_op=True, method=b.method,
            input_chunks=views.input_chunks, collectives=collectives,
        )  # fmt: skip

    def start(self, b, views, group, collectives) -> Any:
        def rail() -> Any:
            return comm.reduce_scatter(
                views.received, views.stage, group=self.rail_group, op=b.op, async_op=True, method=b.method,
                input_chunks=views.stage_chunks, collectives=collectives,
            )  # fmt: skip

        return StagedWork(self._node_stage(b, views, collectives), rail)


@dataclasses.dataclass(frozen=True)
class HierarchicalViews:
    """The two-stage buffer and node chunk, then the rail's send and receive wires."""

    input: torch.Tensor
    stage: torch.Tensor
    input_chunks: list[torch.Tensor] | None
    send: torch.Tensor
    received: torch.Tensor


class HierarchicalQuantized(TwoStageReduceScatter):
    """Node stage in the comm dtype, then one quantize of the node-reduced chunk, an int8/fp8 all_to_all over
    the rail, and dequantize + fp32 sum in the unpack."""

    unpacks_pieces = False

    def __init__(self, topology: Topology, name: str, kind: str, block: int, error_feedback: bool) -> None:
        super().__init__(topology)
        self.name = name
        self.kind = kind
        self.block = block
        self.error_feedback = error_feedback

    @classmethod
    def build(cls, name, kind, block, error_feedback, topology) -> "HierarchicalQuantized":
        return cls(topology, name, kind, block, error_feedback)

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        # The node stage sums in the comm dtype (fp16: pre-scaled against overflow); 1/W is an fp32 multiply in the unpack.
        if average and dtype == torch.float16:
            return comm.averaging(world_size, dtype, group, device)
        return ReductionMode.averaging(self, average, world_size, dtype, group, device)

    def _wire_bytes(self, layout: Layout) -> int:
        return self.topology.num_nodes * wire.segment_bytes(layout.shard_numel, self.block)

    def residual(self, layout, device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        return torch.zeros(self.topology.num_nodes * layout.shard_numel, dtype=torch.float32, device=device)

    def wire_kernels(self, backend) -> Any:
        return wire.wire_kernels(backend)

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        nbytes = max(self._wire_bytes(layout) for layout in layouts)
        return [
            *super().pool_slots(layouts, comm_dtype),
            ("wire_send", nbytes, torch.uint8),
            ("wire_recv", nbytes, torch.uint8),
        ]

    def bind(self, b, buffers) -> HierarchicalViews:
        node = super().bind(b, buffers)
        n = self._wire_bytes(b.layout)
        return HierarchicalViews(
            node.input, node.stage, node.input_chunks, buffers["wire_send"].narrow(0, 0, n),
            buffers["wire_recv"].narrow(0, 0, n),
        )  # fmt: skip

    def start(self, b, views, group, collectives) -> Any:
        def rail() -> Any:
            b.wire_kernels.quantize(views.stage, self.topology.num_nodes, self.block, self.kind, views.send, b.residual)
            return comm.all_to_all(
                views.received, views.send, group=self.rail_group, async_op=True, collectives=collectives
            )

        return StagedWork(self._node_stage(b, views, collectives), rail)

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_wire_kernels.dequantize_sum(
            received, self.topology.num_nodes, self.block, self.kind, shard, b.unpack_scale, accumulate, collect_stats
        )


@dataclasses.dataclass(frozen=True)
class PartialViews:
    """The two-stage buffer and its node receive buffer, then the fp32 node partial and its rail receive buffer."""

    input: torch.Tensor
    recv: torch.Tensor
    partial: torch.Tensor
    received: torch.Tensor


class HierarchicalExact(TwoStageReduceScatter):
    """Comm-dtype all_to_all in the node, fp32 node partials, fp32 all_to_all over the rail; fixed-order fp32 sums."""

    unpacks_pieces = False

    name = "hier_exact"

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        return ReductionMode.averaging(self, average, world_size, dtype, group, device)  # fp32 sums: 1/W in the unpack

    def wire_kernels(self, backend) -> Any:
        return wire.wire_kernels(backend)

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        size = max(layout.numel for layout in layouts)
        part = max(layout.numel // self.topology.local_size for layout in layouts)
        return [("input", size, comm_dtype), ("recv", size, comm_dtype), ("partial", part, torch.float32),
                ("partial_recv", part, torch.float32)]  # fmt: skip

    def bind(self, b, buffers) -> PartialViews:
        numel = b.layout.numel
        part = numel // self.topology.local_size
        return PartialViews(
            _input(b, buffers), buffers["recv"].narrow(0, 0, numel), buffers["partial"].narrow(0, 0, part),
            buffers["partial_recv"].narrow(0, 0, part),
        )  # fmt: skip

    def start(self, b, views, group, collectives) -> Any:
        first = comm.all_to_all(views.recv, views.input, group=self.node_group, async_op=True, collectives=collectives)

        def rail() -> Any:
            b.wire_kernels.sum_sources(views.recv, self.topology.local_size, views.partial, 1.0, False, False)
            return comm.all_to_all(
                views.received, views.partial, group=self.rail_group, async_op=True, collectives=collectives
            )

        return StagedWork(first, rail)

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_wire_kernels.sum_sources(
            received, self.topology.num_nodes, shard, b.unpack_scale, accumulate, collect_stats
        )


@dataclasses.dataclass(frozen=True)
class RequantizedViews:
    """The two-stage buffer, the node stage's send and receive wires, then the rail's."""

    input: torch.Tensor
    node_send: torch.Tensor
    node_recv: torch.Tensor
    rail_send: torch.Tensor
    received: torch.Tensor


class QuantizedTwoStage(TwoStageReduceScatter):
    """int8/fp8 all_to_alls in both stages, dequantize + fp32 sum + requantize between them (ZeRO++ qgZ)."""

    unpacks_pieces = False

    def __init__(self, topology: Topology, name: str, kind: str, block: int, error_feedback: bool) -> None:
        super().__init__(topology)
        self.name = name
        self.kind = kind
        self.block = block
        self.error_feedback = error_feedback

    @classmethod
    def build(cls, name, kind, block, error_feedback, topology) -> "QuantizedTwoStage":
        return cls(topology, name, kind, block, error_feedback)

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        return ReductionMode.averaging(self, average, world_size, dtype, group, device)  # fp32 sums: 1/W in the unpack

    def _sizes(self, layout: Layout) -> tuple[int, int]:
        """(node wire bytes, rail wire bytes) of one bucket."""
        t, s = self.topology, layout.shard_numel
        node = t.local_size * wire.segment_bytes(t.num_nodes * s, self.block)
        return node, t.num_nodes * wire.segment_bytes(s, self.block)

    def residual(self, layout, device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        part = self.topology.num_nodes * layout.shard_numel  # the node quantize's (numel), then the requantize's
        return torch.zeros(layout.numel + part, dtype=torch.float32, device=device)

    def wire_kernels(self, backend) -> Any:
        return wire.wire_kernels(backend)

    def pool_slots(self, layouts, comm_dtype) -> list[PoolSlot]:
        sizes = [self._sizes(layout) for layout in layouts]
        node, rail = max(x[0] for x in sizes), max(x[1] for x in sizes)
        return [
            *super().pool_slots(layouts, comm_dtype), ("wire_send", node, torch.uint8), ("wire_recv", node, torch.uint8),
            ("rail_send", rail, torch.uint8), ("rail_recv", rail, torch.uint8),
        ]  # fmt: skip

    def bind(self, b, buffers) -> RequantizedViews:
        node, rail = self._sizes(b.layout)
        return RequantizedViews(
            _input(b, buffers), buffers["wire_send"].narrow(0, 0, node), buffers["wire_recv"].narrow(0, 0, node),
            buffers["rail_send"].narrow(0, 0, rail), buffers["rail_recv"].narrow(0, 0, rail),
        )  # fmt: skip

    def start(self, b, views, group, collectives) -> Any:
        t, k = self.topology, b.wire_kernels
        numel = b.layout.numel
        first_residual = None if b.residual is None else b.residual.narrow(0, 0, numel)
        k.quantize(views.input, t.local_size, self.block, self.kind, views.node_send, first_residual)
        first = comm.all_to_all(
            views.node_recv, views.node_send, group=self.node_group, async_op=True, collectives=collectives
        )

        def rail() -> Any:
            s = b.layout.shard_numel
            second_residual = None if b.residual is None else b.residual.narrow(0, numel, t.num_nodes * s)
            k.requantize(
                views.node_recv, t.local_size, self.block, self.kind, views.rail_send, t.num_nodes, s, second_residual
            )
            return comm.all_to_all(
                views.received, views.rail_send, group=self.rail_group, async_op=True, collectives=collectives
            )

        return StagedWork(first, rail)

    def unpack(self, b, received, shard, accumulate, collect_stats) -> Any:
        return b.unpack_wire_kernels.dequantize_sum(
            received, self.topology.num_nodes, self.block, self.kind, shard, b.unpack_scale, accumulate, collect_stats
        )
