"""Reduction modes: what moves one bucket from the gradients to this rank's shard.

Each mode is one object that owns its part of a bucket's life: the plan its pack
runs, the pool buffers it needs, the pack, the collective, and the unpack. The
reducer (``flatgrad.reducer.reducer``) schedules buckets and never asks which
mode it runs; adding a mode is one new class here plus its kernels.

[Note: reduction modes]
``reduction`` picks what moves a bucket (see docs/design.md, "Reduction modes"):

* ``"reduce_scatter"`` (``ReduceScatter``): the comm-dtype buffer, one
  reduce_scatter in place, the fused unpack of this rank's chunk.
* ``"exact"`` (``ExactSum``): the comm-dtype buffer goes out through one
  ``all_to_all`` into a receive buffer of the same size; the unpack
  (``wire.sum_sources``) reads its W chunks and sums them in fp32 in rank order
  0..W-1, post-scales (``1/W`` when averaging) and copies or adds into the shard
  in one pass. Deterministic, same bytes as a reduce_scatter.
* ``"int8"`` / ``"fp8"`` (``QuantizedWire``): one fused pack-quantize
  (``wire.PackQuantizePlan``, see [Note: pack-quantize] in
  ``kernels/wire_reference.py``) reads the gradients through the layout's pack
  run table and writes the quantized wire (see [Note: wire format] there)
  straight into a send buffer; one all_to_all moves it, and the unpack
  (``wire.dequantize_sum``) dequantizes and sums in fp32. There is no comm-dtype
  buffer in these modes, so ``comm_dtype`` does not round anything: the wire is
  quantized from fp32 ``grad * prescale``. With ``error_feedback`` a persistent
  fp32 residual per bucket (``layout.numel`` elements) carries this rank's
  quantization error into its next quantize.

* ``"2d_reduce_scatter"`` (``TwoStageReduceScatter``): the comm-dtype buffer,
  packed in the two-stage order (see [Note: segment order] in
  ``flatgrad/layout.py``), one in-place reduce_scatter in the node group, then
  one in-place reduce_scatter of this rank's node chunk in the rail group, and
  the unpack of ``ReduceScatter``. The groups: [Note: two-stage reductions] in
  ``flatgrad/reducer/topology.py``. ``start`` returns a ``StagedWork`` that
  starts the rail stage once the node stage is complete: on gloo when the
  reducer finds the node stage done (``is_completed``) or waits for it, so the
  node stage of a later bucket runs while this one's rail stage is in flight;
  on CUDA from the unpack stream, after the node stage's ``wait``.

* ``"hier_int8"`` / ``"hier_fp8"`` (``HierarchicalQuantized``): the pack and
  the node stage of ``2d_reduce_scatter`` (comm dtype, in place); then one
  quantize of this rank's node-reduced chunk (N segments, one per rail peer;
  see [Note: wire format]) into a send wire, one all_to_all of it over the
  rail, and the unpack ``wire.dequantize_sum`` of the N received segments
  (fp32 sum, ``1/W`` there). With ``error_feedback`` a persistent fp32 residual
  of the node chunk (``N * S`` elements) carries this rank's quantization
  error into its next quantize. Across nodes each rank sends ``N - 1`` wire
  segments instead of ``N - 1`` comm-dtype segments.

* ``"hier_exact"`` (``HierarchicalExact``): the pack of ``2d_reduce_scatter``,
  one all_to_all of the comm-dtype buffer in the node group, an fp32 sum of the
  L received chunks in local-rank order (``wire.sum_sources``) into an fp32
  node partial of ``N * S`` elements, one fp32 all_to_all of it over the rail,
  and the unpack ``wire.sum_sources`` of the N received partials in node order
  (``1/W`` there). Every sum is fp32 in a fixed order and the collectives only
  move bytes: the shards are a fixed function of the gradients, bitwise the
  same run to run, whatever the collectives' algorithms.

* ``"qgz_int8"`` / ``"qgz_fp8"`` (``QuantizedTwoStage``, ZeRO++ qgZ's schedule):
  the pack of ``2d_reduce_scatter`` into the comm dtype, one quantize of it
  as L wire segments (one per node peer, ``N * S`` elements each), one
  all_to_all in the node, then between the stages one fused kernel,
  ``wire.requantize``: it dequantizes the L received segments, sums them in
  fp32 in local-rank order and quantizes the sum as N segments (see
  [Note: requantize] in ``kernels/wire_reference.py``), with no fp32 node
  partial in memory; one all_to_all over the rail, and ``wire.dequantize_sum``
  of the N received segments as the unpack. With ``error_feedback`` both
  quantizes carry a residual (``W * S + N * S`` fp32 elements per bucket).
  The wire is quantized from the comm-dtype pack: with a bf16 ``comm_dtype``
  the values round to bf16 first (use fp32 to avoid it).

On a one-rank group nothing is sent, so every mode takes the reduce_scatter
path (a copy through the comm dtype): a quantized wire would only add its
rounding, and error feedback would carry it. That is the MoE expert group of
one rank.

With ``collect_stats`` every unpack returns the same stats (sum of squares and
non-finite count of the shard as written), so ``shard_stats()`` works in every
mode.

The receive (and wire) buffers come from pools beside the comm buffer pool (or,
int8/fp8, instead of it), keyed by purpose, with the same count and the same
bucket -> buffer assignment, so the hand-off rule of [Note: comm buffer pool]
covers them too.
"""

from __future__ import annotations

import abc
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..kernels import PackPlan, UnpackPlan
from ..kernels import wire
from ..layout import Layout
from .config import TWO_STAGE_REDUCTIONS, ReducerConfig
from .topology import Topology

if TYPE_CHECKING:
    from .bucket import Bucket

__all__ = [
    "DividedPack", "ExactSum", "HierarchicalExact", "HierarchicalQuantized", "QuantizedTwoStage", "PoolSlot", "QuantizedWire", "ReduceScatter", "ReductionMode", "StagedWork",
    "TwoStageReduceScatter", "make_mode",
]  # fmt: skip

PoolSlot = tuple[str, int, torch.dtype]  # (purpose, elements per buffer, dtype)


class ReductionMode(abc.ABC):
    """The interface every mode implements; see [Note: reduction modes]."""

    name: str = ""
    block: int = 0
    error_feedback: bool = False

    def describe(self) -> tuple:
        """What every rank must agree on about this mode (part of [Note: layout agreement])."""
        return (self.name, self.block, self.error_feedback)

    def averaging(
        self, average: bool, world_size: int, dtype: torch.dtype, group: dist.ProcessGroup | None, device: torch.device
    ) -> comm.Averaging:
        """How this mode averages over ``world_size`` ranks (see [Note: averaging] in ``flatgrad.comm``)."""
        if not average:
            return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
        return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / world_size)  # the unpack sums in fp32: average there

    def pack_plan(self, layout: Layout, count: int, dtype: torch.dtype, device: torch.device, backend: str | None) -> Any:
        """The bucket's pack plan, validated once (see [Note: plans] in ``flatgrad/kernels/_plan.py``)."""
        return PackPlan(layout, [None] * count, dtype=dtype, device=device, backend=backend)

    def residual(self, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """The persistent per-bucket state this mode carries between steps (``None``: none)."""
        return None

    def connect(self) -> None:
        """Make the process groups the mode needs (none here); called once the ranks agreed on the buckets."""

    def prepare(self, b: "Bucket") -> None:
        """Resolve at construction what the bucket's unpack needs, so that a missing kernel fails there."""

    def pool_dtype(self, comm_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype that keys this mode's pool: buckets of one device and pool dtype share buffers."""
        return comm_dtype

    @abc.abstractmethod
    def pool_slots(self, buckets: Sequence["Bucket"], world_size: int) -> list[PoolSlot]:
        """The buffers one pool slot holds for ``buckets`` (which share a device and pool dtype)."""

    @abc.abstractmethod
    def bind(self, b: "Bucket", purpose: str, buffer: torch.Tensor, rank: int, world_size: int) -> None:
        """Give ``b`` its views of the pool buffer of ``purpose`` for this micro-step."""

    @abc.abstractmethod
    def pack(self, b: "Bucket", grads: list[torch.Tensor | None]) -> None:
        """Fill what the bucket's collective sends."""

    @abc.abstractmethod
    def start(self, b: "Bucket", group: dist.ProcessGroup | None, collectives: comm.Collectives | None) -> Any:
        """Start the bucket's collective (async); returns its work handle or ``None``."""

    @abc.abstractmethod
    def unpack(self, b: "Bucket", rank: int, world_size: int, collect_stats: bool) -> torch.Tensor | None:
        """Write (or add) what arrived into ``b.shard``; returns the stats when ``collect_stats``."""


class ReduceScatter(ReductionMode):
    """Comm-dtype buffer, one in-place reduce_scatter, the fused unpack of this rank's chunk."""

    name = "reduce_scatter"

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        if not average:
            return comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
        return comm.averaging(world_size, dtype, group, device)

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        return [("input", max(b.layout.numel for b in buckets), buckets[0].comm_dtype)]

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        layout = b.layout
        b.input = buffer.narrow(0, 0, layout.numel)
        # The list form's per-rank views, made once per binding; the tensor form needs none.
        b.input_chunks = list(b.input.chunk(world_size)) if b.method == "list" else None
        # In place: this rank's chunk of the input. World size 1: the whole input.
        b.output = b.input.narrow(0, rank * layout.shard_numel, layout.shard_numel)

    def pack(self, b, grads) -> None:
        b.pack_plan(grads, b.input, scale=b.pack_scale)

    def start(self, b, group, collectives) -> Any:
        return comm.reduce_scatter(
            b.output, b.input, group=group, op=b.op, async_op=True, method=b.method,
            input_chunks=b.input_chunks, collectives=collectives,
        )  # fmt: skip

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        if b.unpack_plan is None:
            b.unpack_plan = UnpackPlan(b.layout, rank, b.shard, backend=b.unpack_backend)
        return b.unpack_plan(b.output, b.shard, scale=b.unpack_scale, accumulate=b.accumulate, return_stats=collect_stats)


class DividedPack(ReductionMode):
    """``inner``, with its packed comm-dtype buffer divided by the world size in place before the collective.

    Stock ZeRO-3's arithmetic: ``x / W`` differs from ``x * (1/W)`` unless W is a power of two and
    nothing was cast before it, so where the fused pre-scale would change bits the buffer is divided
    as stock divides it (see [Note: ZeRO-3 reduce path]). Everything else is ``inner``'s, its process
    groups included: a divided twin of a connected mode needs no ``connect`` of its own.
    """

    def __init__(self, inner: ReductionMode) -> None:
        if isinstance(inner, (QuantizedWire, DividedPack)):
            raise TypeError(f"DividedPack needs a mode that packs a comm-dtype buffer, not {type(inner).__name__}")
        self.inner = inner
        self.name, self.block, self.error_feedback = inner.name, inner.block, inner.error_feedback

    def describe(self) -> tuple:
        return (*self.inner.describe(), "divided")

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        return self.inner.averaging(average, world_size, dtype, group, device)

    def pack_plan(self, layout, count, dtype, device, backend) -> Any:
        return self.inner.pack_plan(layout, count, dtype, device, backend)

    def residual(self, layout, device) -> torch.Tensor | None:
        return self.inner.residual(layout, device)

    def connect(self) -> None:
        self.inner.connect()

    def prepare(self, b) -> None:
        self.inner.prepare(b)

    def pool_dtype(self, comm_dtype) -> torch.dtype | None:
        return self.inner.pool_dtype(comm_dtype)

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        return self.inner.pool_slots(buckets, world_size)

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        self.inner.bind(b, purpose, buffer, rank, world_size)

    def pack(self, b, grads) -> None:
        self.inner.pack(b, grads)
        b.input.div_(b.layout.world_size)

    def start(self, b, group, collectives) -> Any:
        return self.inner.start(b, group, collectives)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return self.inner.unpack(b, rank, world_size, collect_stats)


class ExactSum(ReduceScatter):
    """Comm-dtype buffer, one all_to_all, an fp32 sum over the sources in rank order: deterministic."""

    name = "exact"

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        return ReductionMode.averaging(self, average, world_size, dtype, group, device)

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        size = max(b.layout.numel for b in buckets)
        return [("input", size, buckets[0].comm_dtype), ("recv", size, buckets[0].comm_dtype)]

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        if purpose == "recv":
            b.recv = buffer.narrow(0, 0, b.layout.numel)
        else:
            super().bind(b, purpose, buffer, rank, world_size)

    def start(self, b, group, collectives) -> Any:
        return comm.all_to_all(b.recv, b.input, group=group, async_op=True, collectives=collectives)

    def prepare(self, b) -> None:
        b.wire_kernels = wire.wire_kernels(b.backend)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return b.wire_kernels.sum_sources(b.recv, world_size, b.shard, b.unpack_scale, b.accumulate, collect_stats)


class QuantizedWire(ReductionMode):
    """int8 or fp8 blocks with fp32 scales: one fused pack-quantize, one all_to_all, dequantize + fp32 sum."""

    def __init__(self, kind: str, block: int, error_feedback: bool) -> None:
        self.name = kind
        self.block = block
        self.error_feedback = error_feedback

    def pack_plan(self, layout, count, dtype, device, backend) -> Any:
        return wire.PackQuantizePlan(layout, [None] * count, block=self.block, kind=self.name, device=device, backend=backend)

    def residual(self, layout, device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        return torch.zeros(layout.numel, dtype=torch.float32, device=device)  # persistent, zero at the start

    def pool_dtype(self, comm_dtype) -> torch.dtype | None:
        return None  # the wire is bytes whatever the comm dtype: one pool per device

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        nbytes = max(world_size * wire.segment_bytes(b.layout.shard_numel, self.block) for b in buckets)
        return [("wire_send", nbytes, torch.uint8), ("wire_recv", nbytes, torch.uint8)]

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        setattr(b, purpose, buffer.narrow(0, 0, b.pack_plan.wire_bytes))

    def pack(self, b, grads) -> None:
        b.pack_plan(grads, b.wire_send, b.residual, scale=b.pack_scale)

    def start(self, b, group, collectives) -> Any:
        return comm.all_to_all(b.wire_recv, b.wire_send, group=group, async_op=True, collectives=collectives)

    def prepare(self, b) -> None:
        b.wire_kernels = wire.wire_kernels(b.backend)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return b.wire_kernels.dequantize_sum(
            b.wire_recv, world_size, self.block, self.name, b.shard, b.unpack_scale, b.accumulate, collect_stats
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


class TwoStageReduceScatter(ReduceScatter):
    """Comm-dtype buffer in the two-stage order: reduce_scatter in the node, then over the rail; in place."""

    name = "2d_reduce_scatter"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.node_group: dist.ProcessGroup | None = None
        self.rail_group: dist.ProcessGroup | None = None

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

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        t, s = self.topology, b.layout.shard_numel
        b.input = buffer.narrow(0, 0, b.layout.numel)
        b.stage = b.input.narrow(0, t.local * t.num_nodes * s, t.num_nodes * s)  # this rank's node chunk
        b.output = b.stage.narrow(0, t.node * s, s)  # this rank's rail chunk of it: its own segment
        lists = b.method == "list"
        b.input_chunks = list(b.input.chunk(t.local_size)) if lists else None
        b.stage_chunks = list(b.stage.chunk(t.num_nodes)) if lists else None

    def start(self, b, group, collectives) -> Any:
        first = comm.reduce_scatter(
            b.stage, b.input, group=self.node_group, op=b.op, async_op=True, method=b.method,
            input_chunks=b.input_chunks, collectives=collectives,
        )  # fmt: skip

        def rail() -> Any:
            return comm.reduce_scatter(
                b.output, b.stage, group=self.rail_group, op=b.op, async_op=True, method=b.method,
                input_chunks=b.stage_chunks, collectives=collectives,
            )  # fmt: skip

        return StagedWork(first, rail)


class HierarchicalQuantized(TwoStageReduceScatter):
    """Node stage in the comm dtype, then one quantize of the node-reduced chunk, an int8/fp8 all_to_all over
    the rail, and dequantize + fp32 sum in the unpack."""

    def __init__(self, topology: Topology, name: str, block: int, error_feedback: bool) -> None:
        super().__init__(topology)
        self.name = name
        self.kind = name.removeprefix("hier_")
        self.block = block
        self.error_feedback = error_feedback

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

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        nbytes = max(self._wire_bytes(b.layout) for b in buckets)
        return [*super().pool_slots(buckets, world_size), ("wire_send", nbytes, torch.uint8), ("wire_recv", nbytes, torch.uint8)]

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        if purpose == "input":
            super().bind(b, purpose, buffer, rank, world_size)
        else:
            setattr(b, purpose, buffer.narrow(0, 0, self._wire_bytes(b.layout)))

    def prepare(self, b) -> None:
        b.wire_kernels = wire.wire_kernels(b.backend)

    def start(self, b, group, collectives) -> Any:
        first = comm.reduce_scatter(
            b.stage, b.input, group=self.node_group, op=b.op, async_op=True, method=b.method,
            input_chunks=b.input_chunks, collectives=collectives,
        )  # fmt: skip

        def rail() -> Any:
            b.wire_kernels.quantize(b.stage, self.topology.num_nodes, self.block, self.kind, b.wire_send, b.residual)
            return comm.all_to_all(b.wire_recv, b.wire_send, group=self.rail_group, async_op=True, collectives=collectives)

        return StagedWork(first, rail)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return b.wire_kernels.dequantize_sum(
            b.wire_recv, self.topology.num_nodes, self.block, self.kind, b.shard, b.unpack_scale, b.accumulate,
            collect_stats,
        )  # fmt: skip


class HierarchicalExact(TwoStageReduceScatter):
    """Comm-dtype all_to_all in the node, fp32 node partials, fp32 all_to_all over the rail; fixed-order fp32 sums."""

    name = "hier_exact"

    def averaging(self, average, world_size, dtype, group, device) -> comm.Averaging:
        return ReductionMode.averaging(self, average, world_size, dtype, group, device)  # fp32 sums: 1/W in the unpack

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        size = max(b.layout.numel for b in buckets)
        part = max(b.layout.numel // self.topology.local_size for b in buckets)
        dtype = buckets[0].comm_dtype
        return [("input", size, dtype), ("recv", size, dtype), ("partial", part, torch.float32),
                ("partial_recv", part, torch.float32)]  # fmt: skip

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        numel = b.layout.numel
        if purpose == "input":
            b.input = buffer.narrow(0, 0, numel)
        elif purpose == "recv":
            b.recv = buffer.narrow(0, 0, numel)
        elif purpose == "partial":
            b.stage = buffer.narrow(0, 0, numel // self.topology.local_size)
        else:
            b.stage_recv = buffer.narrow(0, 0, numel // self.topology.local_size)

    def prepare(self, b) -> None:
        b.wire_kernels = wire.wire_kernels(b.backend)

    def start(self, b, group, collectives) -> Any:
        first = comm.all_to_all(b.recv, b.input, group=self.node_group, async_op=True, collectives=collectives)

        def rail() -> Any:
            b.wire_kernels.sum_sources(b.recv, self.topology.local_size, b.stage, 1.0, False, False)
            return comm.all_to_all(b.stage_recv, b.stage, group=self.rail_group, async_op=True, collectives=collectives)

        return StagedWork(first, rail)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return b.wire_kernels.sum_sources(
            b.stage_recv, self.topology.num_nodes, b.shard, b.unpack_scale, b.accumulate, collect_stats
        )


class QuantizedTwoStage(TwoStageReduceScatter):
    """int8/fp8 all_to_alls in both stages, dequantize + fp32 sum + requantize between them (ZeRO++ qgZ)."""

    def __init__(self, topology: Topology, name: str, block: int, error_feedback: bool) -> None:
        super().__init__(topology)
        self.name = name
        self.kind = name.removeprefix("qgz_")
        self.block = block
        self.error_feedback = error_feedback

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

    def pool_slots(self, buckets, world_size) -> list[PoolSlot]:
        sizes = [self._sizes(b.layout) for b in buckets]
        node, rail = max(x[0] for x in sizes), max(x[1] for x in sizes)
        return [
            *super().pool_slots(buckets, world_size), ("wire_send", node, torch.uint8), ("wire_recv", node, torch.uint8),
            ("rail_send", rail, torch.uint8), ("rail_recv", rail, torch.uint8),
        ]  # fmt: skip

    def bind(self, b, purpose, buffer, rank, world_size) -> None:
        node, rail = self._sizes(b.layout)
        if purpose == "input":
            b.input = buffer.narrow(0, 0, b.layout.numel)
        elif purpose in ("wire_send", "wire_recv"):
            setattr(b, purpose, buffer.narrow(0, 0, node))
        else:
            setattr(b, purpose, buffer.narrow(0, 0, rail))

    def prepare(self, b) -> None:
        b.wire_kernels = wire.wire_kernels(b.backend)

    def start(self, b, group, collectives) -> Any:
        t, k = self.topology, b.wire_kernels
        numel = b.layout.numel
        first_residual = None if b.residual is None else b.residual.narrow(0, 0, numel)
        k.quantize(b.input, t.local_size, self.block, self.kind, b.wire_send, first_residual)
        first = comm.all_to_all(b.wire_recv, b.wire_send, group=self.node_group, async_op=True, collectives=collectives)

        def rail() -> Any:
            s = b.layout.shard_numel
            second_residual = None if b.residual is None else b.residual.narrow(0, numel, t.num_nodes * s)
            k.requantize(b.wire_recv, t.local_size, self.block, self.kind, b.rail_send, t.num_nodes, s, second_residual)
            return comm.all_to_all(b.rail_recv, b.rail_send, group=self.rail_group, async_op=True, collectives=collectives)

        return StagedWork(first, rail)

    def unpack(self, b, rank, world_size, collect_stats) -> torch.Tensor | None:
        return b.wire_kernels.dequantize_sum(
            b.rail_recv, self.topology.num_nodes, self.block, self.kind, b.shard, b.unpack_scale, b.accumulate,
            collect_stats,
        )  # fmt: skip


def make_mode(config: ReducerConfig, world_size: int, topology: Topology | None = None) -> ReductionMode:
    """The mode ``config`` names, for a group of ``world_size`` ranks placed on nodes as ``topology`` says.

    A one-rank group sends nothing, so every mode is ``ReduceScatter`` there (see [Note: reduction modes]).
    A two-stage mode needs ``topology``; on one node, or with one rank per node, it is the flat mode,
    with a warning (see [Note: two-stage reductions]).
    """
    if world_size == 1 or config.reduction == "reduce_scatter":
        return ReduceScatter()
    if config.reduction in TWO_STAGE_REDUCTIONS:
        if topology is None:
            raise ValueError(f"reduction {config.reduction!r} needs the group's topology (node and rail placement)")
        if not topology.two_stage:
            flat: ReductionMode = ReduceScatter()
            if config.reduction == "hier_exact":
                flat = ExactSum()
            elif topology.num_nodes > 1 and config.reduction.startswith("hier_"):  # one rank per node: all rail
                flat = QuantizedWire(config.reduction.removeprefix("hier_"), config.block, config.error_feedback)
            elif config.reduction.startswith("qgz_"):  # one quantized stage is left: the flat quantized mode
                flat = QuantizedWire(config.reduction.removeprefix("qgz_"), config.block, config.error_feedback)
            warnings.warn(
                f"flatgrad: reduction {config.reduction!r} on {topology.num_nodes} node(s) of {topology.local_size} "
                f"rank(s) has one stage only; running {flat.name!r} (node_size={topology.node_size})",
                stacklevel=3,
            )
            return flat
        if config.reduction == "2d_reduce_scatter":
            return TwoStageReduceScatter(topology)
        if config.reduction == "hier_exact":
            return HierarchicalExact(topology)
        if config.reduction.startswith("qgz_"):
            return QuantizedTwoStage(topology, config.reduction, config.block, config.error_feedback)
        return HierarchicalQuantized(topology, config.reduction, config.block, config.error_feedback)
    if config.reduction == "exact":
        return ExactSum()
    return QuantizedWire(config.reduction, config.block, config.error_feedback)
