"""flatgrad's reduce path inside a DeepSpeed ZeRO-3 optimizer (DeepSpeed 0.19.x).

ZeRO-3 already partitions every parameter into ``ceil(numel / W)`` chunks, which
is exactly ``Layout.chunked(numels, W)``; so flatgrad keeps DeepSpeed's buckets,
partitions, checkpoints and step, and replaces only the per-bucket copies.

[Note: ZeRO-3 reduce path]
Stock DeepSpeed, per IPG bucket: copy every grad into the IPG buffer, re-pack
the buffer with padding (``torch.cat`` in ``reduce_scatter_coalesced``), divide
it by W, one ``reduce_scatter``, then one copy or add per parameter into the
grad partitions (``__param_id_to_grad_partition``), after a cast per parameter
when the accumulation dtype differs from the comm dtype.

flatgrad, per the same bucket (same parameters, same order, same collective):
1. ``__add_grad_to_ipg_bucket`` only books the parameter; the grad stays where
   autograd put it (no IPG copy).
2. ``__reduce_and_partition_ipg_grads``: one fused ``pack`` from the grads into
   the rank-aligned buffer (the IPG buffer when it is large enough), casting to
   the comm dtype and dividing by W; one ``reduce_scatter`` of the buffer onto
   this rank's segment; one fused ``unpack`` of that segment into the grad
   partitions, casting to their dtype, copying on micro-step 0 and adding
   afterwards.

Bitwise equality with stock (fp32 and bf16, any world size; tested):
* the division is folded into pack's scale only where a multiply by 1/W gives
  the bits of stock's divide (W a power of two and the grads already in the
  comm dtype); otherwise the buffer is divided in place, as stock does;
* the reduce_scatter is the one stock issues (``reduce_scatter_tensor``), so
  every element is summed in the same order: the ``"flatgrad"`` section's
  ``reduce_scatter_method: "auto"`` means that here. ``"list"`` (gloo's native
  reduce_scatter, faster on CPU) sums in another order on more than 2 ranks;
* accumulation adds in fp32 and rounds once, which is what ``add_`` does
  whenever the comm dtype converts to the partition dtype exactly; otherwise
  the segment is cast first, as stock does.

Everything else is DeepSpeed's own: bucket boundaries, the stream the work runs
on and the reduce events, ``param.grad`` freed after the reduction, the bucket
reset, micro-step bookkeeping and the step. ``comm_dtype`` and ``bucket_numel``
of the ``"flatgrad"`` section act as ``communication_data_type`` and
``reduce_bucket_size`` do.

[Note: ZeRO-3 two-stage reduction]
``"flatgrad": {"reduction": "2d_reduce_scatter"}`` reduces each bucket in two
stages, as ZeRO-1/2 does (see [Note: two-stage reductions] in
``flatgrad/reducer/topology.py``): the pack writes the segments in the
two-stage order, one reduce_scatter in the node group, then one over the rail
group, in place in the same buffer; the unpack is unchanged. ZeRO-3 serves
``reduce_scatter`` and ``2d_reduce_scatter`` only; ``initialize`` refuses the
others by key.
* The groups are made once, at install, for the one partition group of the
  trainable parameters (a model with several, MoE or MiCS, is refused by
  key). Every rank first exchanges its placement or its error (one
  ``all_gather_object``), so a ``node_size`` that does not divide the world,
  differs from ``LOCAL_WORLD_SIZE`` or differs between ranks raises on every
  rank before any group is made. On one node, or with one rank per node, the
  flat mode runs, with ``make_mode``'s warning.
* Stock's divide stays as in [Note: ZeRO-3 reduce path]: folded into the pack
  where it keeps stock's bits, else the packed buffer is divided in place
  (``DividedPack`` around the same connected mode). Both stages then SUM.
* The sums run in another order than the flat reduce_scatter's, so training
  is not bitwise stock's: with fp32 communication the losses agree with flat
  flatgrad's to 1e-6 on 4 ranks as 2 nodes of 2 (tested), and checkpoints are
  DeepSpeed's own, unchanged.

[Note: ZeRO-3 step statistics]
Stock's step reads every grad partition again: one norm per parameter and one
all_reduce per sub-group for the gradient norm (``_get_norm_groups``), and with
fp16 an isinf/isnan pass over the whole partition buffer and another all_reduce
for the overflow check. The fused unpack already computes the sum of squares
and the non-finite count of what it writes; with accumulation that is the
accumulated partition. The unpacks of one backward add their stats into one
2-element vector, so at the step ``_get_norm_groups`` and ``has_overflow`` take
them from one all_reduce over the buckets' partition group (stock all_reduces
each sub-group's norm over it), and read no partition.

That equals stock's figures only when the last backward of the window reduced
every trainable parameter exactly once: stock reads every partition,
including one whose parameter got no gradient in the last backward (it keeps
what an earlier backward, or an earlier step, left there). The check is made
on the host, from the buckets' parameter ids, which every rank shares (the
reduce_scatters match only if the buckets do), so every rank takes the same
path; otherwise, or with model parallelism, Muon, or buckets reduced over
more than one group (MoE), the step is stock's. So is a step after a gradient
was written through DeepSpeed's API between backward and step
(``safe_set_full_grad`` and kin, whose optimizer methods are wrapped to say
so): the unpack's stats do not know that write. A write straight into the
partitions, behind DeepSpeed's API, is not seen. The norm
is the square root of the summed squares (one group: stock combines per-group
norms into the same value, up to rounding), -1 when non-finite, as stock's
``get_grad_norm_direct`` returns. Stock sums the norm in its norm dtype (fp64
on CPU), the unpack in fp32 in another order: the norms agree to about 1e-7
relative, so runs whose gradients are clipped agree with stock's to 1e-6
(tested), not bitwise; without clipping nothing changes. ZeRO-1/2 follow the
same rule (see [Note: ZeRO-2 step statistics]). Under optimizer offload the norm
is stock's own, from per-parameter norms: see [Note: ZeRO-3 optimizer offload].

[Note: ZeRO-3 optimizer offload]
With ``offload_optimizer: {device: cpu}`` stock keeps its grad partitions
(``grad_partitions_flat_buffer``, in the accumulation dtype) on the host,
pinned when ``pin_memory`` is set, and per parameter per micro-step copies the
reduced partition device-to-host (accumulating on the device, so host-to-device
and back); at the accumulation boundary it records each parameter's norm
(``norm_for_param_grads``) and copies each partition into the host fp32
gradient of its sub-group (``fp32_partitioned_groups_flat[i].grad``).

flatgrad, per bucket, keeps stock's buffers and state and batches the copies:
1. pack, one reduce_scatter, as without offload;
2. one transfer of this rank's reduced segment to the host: where the segment
   already is in host memory (the CPU accelerator) the fused unpack writes the
   host grad partitions directly; otherwise one asynchronous copy of the
   segment, in the comm dtype, into a pinned staging buffer (two of them, of the
   largest segment: one may fill while the other is unpacked), and the CPU
   kernel unpacks it into the host grad partitions once the copy's event has
   completed: polled at the next bucket, waited for when both buffers are
   busy, and at the end of the backward (stock's epilogue already waits for the
   reduce stream there). The backward keeps running while the copy flies;
3. at the boundary micro-step, for the bucket's parameters with data here, the
   norm stock records (``_constant_buffered_norm2`` on the same partition
   values, so the same bits; on an accelerator stock takes it on the device,
   flatgrad on the host: both sum in fp64 and round to fp32 before the
   all_reduce) and one host copy per run of the bucket's partitions that is
   contiguous in both the grad partitions and the fp32 gradient (one per
   sub-group the bucket spans when the bucket is in sub-group order; the
   padding between two parameters' partitions is zero in both buffers).

The cast, the accumulation (copy on micro-step 0, add after) and the boundary
cast into fp32 are stock's, so with torch's AdamW training is bitwise stock's,
clipping included (the norm is stock's). The step, the host optimizer update,
the copy back and the all_gather are stock's. The overflow check comes from
the unpack stats as without offload. NVMe offload, partial offload
(``offload_optimizer.ratio`` < 1) and SuperOffload are refused by key.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from ... import comm
from ...layout import Layout
from ...kernels import host_backend
from ...reducer import Bucket, ReduceScatter, ReductionMode, build_mode, plan_topology
from .collectives import deepspeed_collectives
from .config import FlatgradConfig, UnsupportedConfigError, deepspeed_version, offload_device
from .support import config_value
from .step_stats import StepStats

__all__ = ["install", "check_offload", "Zero3Reducer", "ZERO3_REDUCTIONS"]

_PREFIX = "_DeepSpeedZeroOptimizer_Stage3__"
_ADD_GRAD = _PREFIX + "add_grad_to_ipg_bucket"
_REDUCE = _PREFIX + "reduce_and_partition_ipg_grads"
_GRAD_PARTITIONS = _PREFIX + "param_id_to_grad_partition"
_ATTR = "flatgrad_zero3"
# The reductions ZeRO-3 serves: see [Note: ZeRO-3 two-stage reduction].
ZERO3_REDUCTIONS = ("reduce_scatter", "2d_reduce_scatter")

class _Composition(NamedTuple):
    """Everything static about one bucket composition (same parameters, same order)."""

    layout: Layout
    group: Any
    rank: int
    comm_dtype: torch.dtype
    bucket: Bucket  # the pack -> reduce_scatter -> unpack every flatgrad reduction runs
    ds_ids: tuple[int, ...]  # parameters with data in this rank's segment, in segment order
    lengths: tuple[int, ...]  # their piece lengths
    key: tuple  # (bucket dtype, every parameter's ds_id in bucket order): the same on every rank
    bucket_ds_ids: frozenset[int]  # every parameter of the bucket, for [Note: ZeRO-3 step statistics]
    piece_params: tuple  # the parameters of ``ds_ids``, in segment order


class _OffloadRuns(NamedTuple):
    """Where one composition's partitions go at the boundary: see [Note: ZeRO-3 optimizer offload]."""

    stamp: tuple  # the data pointers the runs were computed against
    param_ids: tuple[int, ...]  # DeepSpeed's ``get_param_id`` of every piece, for ``norm_for_param_grads``
    runs: tuple[tuple[int, int, int, int], ...]  # (sub-group, offset in its fp32 grad, offset in the flat buffer, n)


class Zero3Reducer:
    """The replacement of one ZeRO-3 optimizer's IPG bucket reduction; see [Note: ZeRO-3 reduce path].

    Attributes:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` it serves.
        config: the ``FlatgradConfig``.
        compositions: ``{(comm_dtype, ds_ids): _Composition}``, one per bucket composition seen.
    """

    def __init__(self, optimizer: Any, config: FlatgradConfig, mode: ReductionMode | None = None) -> None:
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        self.optimizer = optimizer
        self.config = config
        self.compositions: dict[tuple, _Composition] = {}
        self._dist = dist
        self._accelerator = get_accelerator()
        self._comm_dtype = config.torch_comm_dtype()
        self._method = "tensor" if config.reduce_scatter_method == "auto" else config.reduce_scatter_method
        self._collectives = deepspeed_collectives()
        # The mode of every bucket (its divided twin where stock's divide must be kept), see
        # [Note: ZeRO-3 two-stage reduction]. A two-stage mode comes connected from install(), its groups made once.
        self.mode: ReductionMode = mode if mode is not None else ReduceScatter()
        self._outs: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
        self.stats = _BackwardStats()
        self._trainable = frozenset(p.ds_id for g in optimizer.fp16_groups for p in g if p.requires_grad)
        self._covers: dict[tuple, bool] = {}
        self._window = StepStats()
        self._stock_get_norm_groups = optimizer._get_norm_groups
        self._stock_has_overflow = optimizer.has_overflow
        self._stock_step = optimizer.step
        self._stock_zero_grad = optimizer.zero_grad
        self._stock_epilogue = optimizer.independent_gradient_partition_epilogue
        self.offload = bool(optimizer.offload_optimizer)
        self._runs: dict[tuple, _OffloadRuns] = {}
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staged: deque = deque()  # (event, slot, comp, flight, staged, micro_step, boundary), oldest first
        self._next_slot = 0
        # Counted per process (tests and benches read them): reduced segments moved to the host (one per
        # bucket with data here per micro-step), and the boundary's host copies into the fp32 gradients.
        self.host_transfers = 0
        self.fp32_copies = 0
        # Stage the segment through the pinned buffers even where it already is in host memory (the CPU
        # accelerator), so that tests and benches run and measure the accelerator's path on a host.
        self.always_stage = False

    def describe(self) -> str:
        """The take-over line: stage, sub-groups, buckets, reduction method, offload."""
        opt = self.optimizer
        line = (
            f"flatgrad: ZeRO-3 gradient reduction taken over: {len(opt.fp16_groups)} sub-group(s), DeepSpeed's IPG "
            f"buckets of {opt.reduce_bucket_size} elements, per bucket one fused pack, {self._collective_words()}, "
            f"one fused unpack into the {opt.gradient_accumulation_dtype} grad partitions"
        )
        if self.offload:
            pinned = "pinned" if opt.offload_optimizer_pin_memory else "pageable"
            line += (
                f"; CPU optimizer offload served: the partitions are in {pinned} host memory, one transfer of the "
                "reduced segment per bucket, one host copy per run into the fp32 gradients at the boundary"
            )
        return line

    def _collective_words(self) -> str:
        topology = getattr(self.mode, "topology", None)
        if topology is None:
            return f"one reduce_scatter ({self._method})"
        return (
            f"{self.mode.name}: one reduce_scatter ({self._method}) in the node of {topology.local_size} rank(s), "
            f"then one over the rail of {topology.num_nodes} node(s)"
        )

    def metadata_bytes(self) -> int:
        """Bytes kept besides gradients and buffers: the kernels' cached run tables, the buckets' plan tables
        and the step statistics (KBs), which memory figures name rather than hide."""
        from ...kernels import _tables

        plans = [c.bucket.pack_plan for c in self.compositions.values()]
        plans += [c.bucket.unpack_plan for c in self.compositions.values() if c.bucket.unpack_plan is not None]
        stats = self.stats.total.nbytes if self.stats.total is not None else 0
        return _tables.nbytes() + sum(plan.table_bytes for plan in plans) + stats + self._window.nbytes

    # -- the two seams ------------------------------------------------------------------------

    @torch.no_grad()
    def add_grad_to_ipg_bucket(self, param: torch.nn.Parameter) -> None:
        """Book ``param`` into its bucket without copying its grad (pack reads it in place)."""
        opt, acc = self.optimizer, self._accelerator
        if not acc.resolves_data_dependency():
            # The pack on the reduce stream reads this grad, produced on the compute stream.
            opt.reduce_and_partition_stream.wait_stream(acc.current_stream())
        bucket = opt.ipg_buckets[opt.get_param_comm_dtype(param)]
        bucket.params.append(param)
        bucket.process_group = opt._get_param_partition_group(param)
        bucket.elements += param.grad.numel()

    @torch.no_grad()
    def reduce_and_partition_ipg_grads(self, communication_data_type: torch.dtype) -> None:
        """Reduce one IPG bucket: fused pack -> one reduce_scatter -> fused unpack into the partitions."""
        opt, acc = self.optimizer, self._accelerator
        bucket = opt.ipg_buckets[communication_data_type]
        params = bucket.params
        if not params:
            return
        opt._assert_same_partition_group(params)
        for param in params:
            if param.grad.numel() != param.ds_numel:
                raise RuntimeError(
                    f"{param.grad.numel()} != {param.ds_numel}: cannot reduce-scatter a gradient whose size "
                    f"differs from its parameter's (ds_id {param.ds_id})"
                )
        if len({p.ds_id for p in params}) != len(params):
            raise RuntimeError("a ZeRO-3 IPG bucket holds the same parameter twice")

        events = opt.param_reduce_events
        while events and events[0].query():
            events.popleft()
        if len(events) > opt.max_param_reduce_events:
            events.popleft().synchronize()

        with acc.stream(opt.reduce_and_partition_stream):
            if self._staged:
                self._drain()  # the staged segments whose copies have landed: unpacked while the backward runs
            if opt.enable_sanity_checks:
                from deepspeed.runtime.utils import assert_ints_same_as_other_ranks

                assert_ints_same_as_other_ranks([p.ds_id for p in params])
            params.sort(key=lambda p: p.ds_id)
            comp = self._composition(params, communication_data_type)
            self._reduce(comp, params, bucket)
            opt._offload_boundary_param_ids.update(comp.ds_ids)
            synchronized = acc.is_synchronized_device()
            for param in params:
                if not synchronized:
                    param.grad.record_stream(acc.current_stream())
                param.grad = None
            params.clear()
            bucket.elements = 0
            bucket.process_group = None
            if not acc.handles_memory_backpressure():
                event = acc.Event()
                event.record()
                events.append(event)

    def independent_gradient_partition_epilogue(self) -> None:
        """Wraps stock's epilogue: after it (and its wait for the reduce stream), every staged bucket is unpacked."""
        self._stock_epilogue()
        self._drain(everything=True)

    # -- compositions and reduction ----------------------------------------------------------------------

    def _composition(self, params: Sequence[torch.nn.Parameter], bucket_dtype: torch.dtype) -> _Composition:
        key = (bucket_dtype, tuple(p.ds_id for p in params))
        comp = self.compositions.get(key)
        if comp is None:
            comp = self.compositions[key] = self._build_composition(params, bucket_dtype)
        return comp

    def _build_composition(self, params: Sequence[torch.nn.Parameter], bucket_dtype: torch.dtype) -> _Composition:
        opt, dist = self.optimizer, self._dist
        group = opt._get_param_partition_group(params[0])
        world_size = dist.get_world_size(group=group)
        rank = dist.get_rank(group=group)
        if opt._gradient_averaging_world_size(params, world_size) != world_size:
            raise RuntimeError("a ZeRO-3 bucket averages over another world size (AutoEP); install() refuses those")
        topology = getattr(self.mode, "topology", None)
        if topology is not None and len(topology.positions) != world_size:
            raise RuntimeError(
                f"a ZeRO-3 bucket reduces over {world_size} ranks, but the two-stage groups were made for "
                f"{len(topology.positions)}"
            )
        layout = Layout.chunked([p.ds_numel for p in params], world_size)
        for p, chunk in zip(params, layout.chunk_numels):
            if p.partition_numel() != chunk:
                raise RuntimeError(
                    f"ZeRO-3 partition of ds_id {p.ds_id} has {p.partition_numel()} elements; flatgrad's chunked "
                    f"layout expects ceil({p.ds_numel}/{world_size}) = {chunk}"
                )
        comm_dtype = self._comm_dtype or bucket_dtype
        power_of_two = world_size & (world_size - 1) == 0
        # x * (1/W) has the bits of x / W only for a power-of-two W, and only without a cast before it.
        fused = power_of_two and all(p.dtype == comm_dtype for p in params)
        # A staged segment is unpacked on the host: its kernels are the host's, whatever runs the pack.
        staged = self.offload and self.needs_staging()
        bucket = Bucket(
            0, tuple(params), layout, rank, comm_dtype=comm_dtype,
            averaging=comm.Averaging(self._dist.ReduceOp.SUM, 1.0 / world_size if fused else 1.0, 1.0),
            method=self._method, backend=self.config.backend,
            mode=self.mode, prescale=1.0, postscale=1.0, streams=None,
            unpack_backend=host_backend(self.config.backend) if staged else None, divide=not fused,
        )  # fmt: skip
        pieces = layout.pieces(rank)
        return _Composition(
            layout=layout,
            group=group,
            rank=rank,
            comm_dtype=comm_dtype,
            bucket=bucket,
            ds_ids=tuple(params[p.tensor_index].ds_id for p in pieces),
            lengths=tuple(p.length for p in pieces),
            key=(bucket_dtype, tuple(p.ds_id for p in params)),
            bucket_ds_ids=frozenset(p.ds_id for p in params),
            piece_params=tuple(params[p.tensor_index] for p in pieces),
        )

    def _grad_partitions(self, comp: _Composition) -> list[torch.Tensor]:
        """Views of this rank's grad partitions for ``comp``'s pieces, cached while DeepSpeed keeps them."""
        opt = self.optimizer
        partitions = getattr(opt, _GRAD_PARTITIONS)
        stamp = (id(partitions), opt.grad_partitions_flat_buffer.data_ptr())
        key = (comp.comm_dtype, comp.ds_ids)
        cached = self._outs.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        outs = [partitions[ds_id].narrow(0, 0, n) for ds_id, n in zip(comp.ds_ids, comp.lengths)]
        self._outs[key] = (stamp, outs)
        return outs

    def _reduce(self, comp: _Composition, params: Sequence[torch.nn.Parameter], bucket: Any) -> None:
        layout = comp.layout
        grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
        device = grads[0].device
        ipg_buffer = bucket.buffer
        if ipg_buffer is not None and ipg_buffer.dtype == comp.comm_dtype and ipg_buffer.device == device:
            if ipg_buffer.numel() < layout.numel:
                # A chunked layout pads every param to a multiple of W, and one param may exceed the
                # bucket: grow the IPG buffer once to the largest layout seen, not a buffer per step.
                if ipg_buffer.is_cuda:
                    ipg_buffer.record_stream(torch.cuda.current_stream(device))
                ipg_buffer = bucket.buffer = torch.empty(layout.numel, dtype=comp.comm_dtype, device=device)
            buffer = ipg_buffer.narrow(0, 0, layout.numel)
        else:
            buffer = torch.empty(layout.numel, dtype=comp.comm_dtype, device=device)
        flight = comp.bucket.reduce(grads, comp.group, self._collectives, buffers={"input": buffer})
        flight.wait()
        if not comp.ds_ids:
            self.stats.add(self.optimizer.micro_step_id, comp.key, None)  # nothing here, but the bucket was reduced
            return
        outs = self._grad_partitions(comp)
        micro_step = self.optimizer.micro_step_id
        if flight.received.device == outs[0].device and not (self.offload and self.always_stage):
            boundary = self.offload and self.optimizer.is_gradient_accumulation_boundary()
            self._host_side(comp, flight, flight.received, micro_step, boundary)
            if self.offload:
                self.host_transfers += 1  # the unpack writes the host partitions: the segment's one transfer
        else:
            self._stage(comp, flight, micro_step, self.optimizer.is_gradient_accumulation_boundary())

    def _host_side(self, comp: _Composition, flight: Any, segment: torch.Tensor, micro_step: int, boundary: bool) -> None:
        """Unpack ``segment`` into the grad partitions (copy on micro-step 0, add after); then the boundary's work."""
        outs = self._grad_partitions(comp)
        out_dtype = outs[0].dtype
        if segment.dtype != out_dtype and out_dtype != torch.float32:
            segment = segment.to(out_dtype)  # stock adds after this cast; see [Note: ZeRO-3 reduce path]
        stats = flight.unpack(outs, micro_step != 0, True, received=segment)
        self.stats.add(micro_step, comp.key, stats)
        if boundary:
            self._to_fp32_grads(comp, outs)

    # -- optimizer offload: see [Note: ZeRO-3 optimizer offload] -----------------------------------------

    def _offload_runs(self, comp: _Composition) -> _OffloadRuns:
        """The boundary's copies for ``comp``: runs contiguous in both the flat grad buffer and an fp32 gradient."""
        opt = self.optimizer
        flat = opt.grad_partitions_flat_buffer
        groups = opt.fp32_partitioned_groups_flat
        stamp = (flat.data_ptr(), tuple(g.grad.data_ptr() if g.grad is not None else 0 for g in groups))
        key = (comp.comm_dtype, comp.ds_ids)
        cached = self._runs.get(key)
        if cached is not None and cached.stamp == stamp:
            return cached
        partitions = getattr(opt, _GRAD_PARTITIONS)
        param_ids, runs = [], []
        gap = 0  # the previous piece's padding: zero in both buffers, so a run may span it
        for param, length in zip(comp.piece_params, comp.lengths):
            param_id = opt.get_param_id(param)
            param_ids.append(param_id)
            group, dest, _ = opt.grad_position[param_id]
            src = partitions[param.ds_id].storage_offset() - flat.storage_offset()
            if runs and runs[-1][0] == group and dest == runs[-1][1] + runs[-1][3] + gap \
                    and src == runs[-1][2] + runs[-1][3] + gap:
                g, d, s, n = runs[-1]
                runs[-1] = (g, d, s, n + gap + length)
            else:
                runs.append((group, dest, src, length))
            gap = param.partition_numel() - length
        cached = self._runs[key] = _OffloadRuns(stamp, tuple(param_ids), tuple(runs))
        return cached

    def _to_fp32_grads(self, comp: _Composition, outs: Sequence[torch.Tensor]) -> None:
        """At the boundary: stock's per-parameter norms, then the partitions into the host fp32 gradients."""
        opt = self.optimizer
        plan = self._offload_runs(comp)
        norms = opt.norm_for_param_grads
        for param_id, out in zip(plan.param_ids, outs):
            norms[param_id] = opt._constant_buffered_norm2(out)
        flat = opt.grad_partitions_flat_buffer
        dtype = opt.master_weights_and_grads_dtype
        for group, dest, src, n in plan.runs:
            target = opt.fp32_partitioned_groups_flat[group].grad.narrow(0, dest, n)
            source = flat.narrow(0, src, n)
            target.copy_(source if source.dtype == dtype else source.to(dtype), non_blocking=True)
            self.fp32_copies += 1

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """The pinned host staging buffers of the GPU's offload path (empty until allocated, and on a CPU rank)."""
        return [b for b in self._staging if b is not None]

    def needs_staging(self) -> bool:
        """Whether the reduced segments reach the host partitions through the staging buffers: the
        partitions are not in the compute device's memory, or ``always_stage`` asks for it."""
        device = torch.device(self._accelerator.current_device_name())
        return self.always_stage or self.optimizer.grad_partitions_flat_buffer.device != device

    def staging_numel(self) -> int:
        """Elements of the largest reduced segment any bucket can have: a bucket holds at most
        ``max(reduce_bucket_size, largest parameter)`` elements, each parameter padded by less than W."""
        opt = self.optimizer
        params = [p for g in opt.fp16_groups for p in g]
        world_size = self._dist.get_world_size(group=opt.dp_process_group)
        largest = max((p.ds_numel for p in params), default=0)
        return -(-max(opt.reduce_bucket_size, largest) // world_size) + len(params)

    def allocate_staging(self) -> None:
        """The two pinned staging buffers of the staged transfer, in the widest comm dtype the buckets use."""
        opt = self.optimizer
        itemsize = max(torch.empty(0, dtype=self._comm_dtype or d).element_size() for d in opt.ipg_buckets)
        nbytes = self.staging_numel() * itemsize
        self._staging = [self._accelerator.pin_memory(torch.empty(nbytes, dtype=torch.uint8)) for _ in range(2)]

    def _stage(self, comp: _Composition, flight: Any, micro_step: int, boundary: bool) -> None:
        """One asynchronous copy of the reduced segment into a pinned staging buffer; unpacked once it landed."""
        segment = flight.received
        slot = self._next_slot
        self._next_slot = 1 - slot
        self._drain(slot=slot)  # the slot's previous segment must be unpacked before it is overwritten
        nbytes = segment.numel() * segment.element_size()
        buffer = self._staging[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._staging[slot] = self._accelerator.pin_memory(torch.empty(nbytes, dtype=torch.uint8))
        staged = buffer.narrow(0, 0, nbytes).view(segment.dtype)
        staged.copy_(segment, non_blocking=True)
        flight.release_buffers()
        self.host_transfers += 1
        event_type = self._accelerator.Event  # None on the CPU accelerator, where the copy has landed
        event = event_type() if event_type is not None else None
        if event is not None:
            event.record()
        self._staged.append((event, slot, comp, flight, staged, micro_step, boundary))

    def _drain(self, *, slot: int | None = None, everything: bool = False) -> None:
        """Unpack the staged segments whose copies have landed; wait for ``slot``'s, or for all of them."""
        while self._staged:
            event, occupant, comp, flight, staged, micro_step, boundary = self._staged[0]
            if event is not None:  # None: the copy was synchronous
                if everything or occupant == slot:
                    event.synchronize()
                elif not event.query():
                    return
            self._staged.popleft()
            self._host_side(comp, flight, staged, micro_step, boundary)
            if occupant == slot and not everything:
                return

    # -- the step's norm and overflow, from the unpack stats: see [Note: ZeRO-3 step statistics] --------------

    def _stats_usable(self) -> bool:
        opt = self.optimizer
        if opt.model_parallel_group is not None or getattr(opt, "use_muon", False) or self.stats.keys is None:
            return False
        if self._window.stale:
            return False
        keys = tuple(self.stats.keys)
        usable = self._covers.get(keys)
        if usable is None:
            comps = [self.compositions[key] for key in keys]
            union = frozenset().union(*(p.bucket_ds_ids for p in comps))
            usable = (
                len({id(p.group) for p in comps}) == 1  # stock all_reduces each sub-group's norm over this group
                and sum(len(p.bucket_ds_ids) for p in comps) == len(union)  # no parameter reduced twice
                and self._trainable <= union
            )
            if len(self._covers) > 64:
                self._covers.clear()
            self._covers[keys] = usable
        return usable

    def _reduced_stats(self) -> torch.Tensor:
        """``[sum_sq, nonfinite]`` of the last backward's unpacks, summed over the ranks: one all_reduce per step."""
        opt, dist = self.optimizer, self._dist

        def build() -> torch.Tensor:
            device = torch.device(self._accelerator.current_device_name())
            if not self._accelerator.resolves_data_dependency():
                self._accelerator.current_stream().wait_stream(opt.reduce_and_partition_stream)
            return self.stats.total.to(device) if self.stats.total is not None else torch.zeros(2, device=device)

        group = self.compositions[self.stats.keys[0]].group
        return self._window.reduced(build, lambda total: dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group))

    def get_norm_groups(self) -> list[torch.Tensor]:
        """Replaces ``_get_norm_groups``: the norm from the unpack stats (one group), -1 when not finite; under
        optimizer offload stock's, from the per-parameter norms (see [Note: ZeRO-3 optimizer offload])."""
        if self.offload or not self._stats_usable():
            return self._stock_get_norm_groups()
        total = self._reduced_stats()
        norm = total[0].sqrt()
        invalid = (total[1] > 0) | ~torch.isfinite(norm)
        return [torch.where(invalid, torch.full_like(norm, -1.0), norm)]

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        """Replaces ``has_overflow``: any inf/nan in any rank's partitions, from the unpack stats."""
        if not partition_gradients or not self._stats_usable():
            return self._stock_has_overflow(partition_gradients)
        return StepStats.overflow(self._reduced_stats()[1])

    def _edits_grads(self, method: Any) -> Any:
        """Wraps a DeepSpeed method that writes grad partitions (``safe_set_full_grad`` and kin): a partition
        written after its unpack is not in the unpack's stats, so this window's step reads the partitions."""

        def edited(*args: Any, **kwargs: Any) -> Any:
            self._window.mark_stale()
            return method(*args, **kwargs)

        return edited

    def step(self, closure: Any = None) -> Any:
        """Wraps ``step``: the window's stats are consumed (or discarded) with it."""
        try:
            return self._stock_step(closure)
        finally:
            self._end_window()

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        """Wraps ``zero_grad``: it restarts accumulation, so the stats restart too."""
        self._end_window()
        return self._stock_zero_grad(*args, **kwargs)

    def _end_window(self) -> None:
        self.stats.reset()
        self._window.reset()


class _BackwardStats:
    """The summed unpack stats of one backward (one ``micro_step_id``) and the buckets they came from."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro_step: int | None = None
        self.total: torch.Tensor | None = None
        self.keys: list[tuple] | None = None

    def add(self, micro_step: int, key: tuple, stats: torch.Tensor | None) -> None:
        """Count bucket ``key``'s unpack stats (``None``: it wrote nothing on this rank) into this backward's."""
        if micro_step != self.micro_step or self.keys is None:  # a new backward: only its unpacks count
            self.micro_step, self.total, self.keys = micro_step, None, []
        if stats is not None:
            self.total = stats.clone() if self.total is None else self.total.add_(stats)
        self.keys.append(key)


# DeepSpeed's methods behind safe_set_full_grad / safe_set_local_grad / safe_update_full_grad_vectorized.
_GRAD_WRITERS = ("set_fp32_grad_for_param", "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized")


# What the replacement seams call or read on the optimizer, besides the seams themselves.
_METHODS = ("get_param_comm_dtype", "_get_param_partition_group", "_assert_same_partition_group",
            "_gradient_averaging_world_size", "_get_norm_groups", "has_overflow", "step", "zero_grad",
            "independent_gradient_partition_epilogue", "is_gradient_accumulation_boundary", "get_param_id",
            "_constant_buffered_norm2") + _GRAD_WRITERS
_STATE = ("ipg_buckets", "param_reduce_events", "max_param_reduce_events", "reduce_and_partition_stream",
          "micro_step_id", "grad_partitions_flat_buffer", "_offload_boundary_param_ids", "enable_sanity_checks",
          "fp16_groups", "dp_process_group", "model_parallel_group", "offload_optimizer")
# What the offload path reads besides, checked when it is on: see [Note: ZeRO-3 optimizer offload].
_OFFLOAD_STATE = ("grad_position", "fp32_partitioned_groups_flat", "norm_for_param_grads",
                  "master_weights_and_grads_dtype", "offload_optimizer_pin_memory", "swap_optimizer", "partial_offload")


def _check_seams(opt: Any) -> None:
    """Refuse a DeepSpeed whose ZeRO-3 optimizer lacks what flatgrad replaces or relies on, naming the version."""
    cls = type(opt)
    missing = [name for name in (_ADD_GRAD, _REDUCE) + _METHODS if not callable(getattr(cls, name, None))]
    missing += [name for name in _STATE if not hasattr(opt, name)]
    if getattr(opt, "offload_optimizer", False):
        missing += [name for name in _OFFLOAD_STATE if not hasattr(opt, name)]
    if not isinstance(getattr(opt, _GRAD_PARTITIONS, None), dict):
        missing.append(_GRAD_PARTITIONS)
    if missing:
        version = ".".join(map(str, deepspeed_version()))
        raise UnsupportedConfigError(
            f"DeepSpeed {version}: {cls.__name__} lacks {missing}, which flatgrad's ZeRO-3 backend replaces or "
            "uses (docs/design.md 'DeepSpeed seams'); it is written against DeepSpeed 0.19.8"
        )


def _resize_ipg_buffers(opt: Any, cfg: FlatgradConfig) -> None:
    """Give the IPG buffers (flatgrad's pack target) the bucket size and comm dtype flatgrad will use."""
    dtype = cfg.torch_comm_dtype()
    for bucket in opt.ipg_buckets.values():
        buffer = bucket.buffer
        if buffer is None:
            continue
        want = (opt.reduce_bucket_size, dtype or buffer.dtype)
        if (buffer.numel(), buffer.dtype) != want:
            bucket.buffer = torch.empty(want[0], dtype=want[1], device=buffer.device)


def check_offload(ds_config: Mapping[str, Any]) -> None:
    """Refuse, before DeepSpeed starts, the ZeRO-3 optimizer offload variants flatgrad does not serve, by key.

    NVMe offload is refused by ``support.REFUSALS``; here: partial offload
    (``offload_optimizer.ratio`` < 1) and SuperOffload.
    """
    section = config_value(ds_config, "zero_optimization.offload_optimizer")
    if offload_device(section) != "cpu":
        return
    ratio = section.get("ratio", 1.0)
    if ratio is not None and float(ratio) != 1.0:
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-3 backend does not support partial optimizer offload "
            f"('zero_optimization.offload_optimizer.ratio' = {ratio!r}); use ratio 1"
        )
    if section.get("super_offload"):
        raise UnsupportedConfigError(
            "flatgrad's ZeRO-3 backend does not support SuperOffload "
            f"('zero_optimization.offload_optimizer.super_offload' = {section.get('super_offload')!r})"
        )


def install(engine: Any, cfg: FlatgradConfig) -> "Zero3Reducer | None":
    """Install flatgrad's reduce path into ``engine``'s ZeRO-3 optimizer (nothing when disabled).

    Call after ``deepspeed.initialize`` and before the first backward. The two
    seams become instance attributes of the optimizer, and the ``Zero3Reducer``
    stays reachable as ``engine.optimizer.flatgrad_zero3``. Raises
    ``UnsupportedConfigError`` for engines it cannot serve.
    """
    if not cfg.enabled:
        return
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    opt = getattr(engine, "optimizer", None)
    if type(opt) is not DeepSpeedZeroOptimizer_Stage3:
        if opt is None or type(opt).__name__ == "DeepSpeedZeRoOffload":
            why = (
                "no optimizer was given (no 'optimizer' config section, no client optimizer), so DeepSpeed reduces "
                "no gradients"
            )
        else:
            why = "SuperOffload (zero_optimization.offload_optimizer.super_offload) and subclasses are not supported"
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-3 backend needs a DeepSpeedZeroOptimizer_Stage3; the engine has "
            f"{type(opt).__name__}: {why}"
        )
    if getattr(opt, _ATTR, None) is not None:
        raise RuntimeError("flatgrad's ZeRO-3 backend is already installed on this optimizer")
    _check_seams(opt)
    if opt.offload_optimizer:
        if opt.swap_optimizer:
            raise UnsupportedConfigError(
                "flatgrad's ZeRO-3 backend does not support NVMe optimizer offload "
                "('zero_optimization.offload_optimizer.device' = 'nvme'); offload to 'cpu' instead"
            )
        if opt.partial_offload != 1.0:
            raise UnsupportedConfigError(
                f"flatgrad's ZeRO-3 backend does not support partial optimizer offload "
                f"('zero_optimization.offload_optimizer.ratio' = {opt.partial_offload}); use ratio 1"
            )
    if not opt.reduce_scatter:
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend needs zero_optimization.reduce_scatter=true")
    if getattr(opt, "zenflow", False):
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend does not support ZenFlow (zero_optimization.zenflow)")
    if opt.all2all_process_group is not None:
        raise UnsupportedConfigError(
            "flatgrad's ZeRO-3 backend does not support qgZ (zero_optimization.zero_quantized_gradients)"
        )
    if any(getattr(p, "ds_zero_placement_family", None) == "autoep_expert" for g in opt.fp16_groups for p in g):
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend does not support AutoEP (expert_parallel.enabled)")
    reducer = Zero3Reducer(opt, cfg, _reduction_mode(opt, cfg))
    if cfg.bucket_numel is not None:
        opt.reduce_bucket_size = cfg.bucket_numel
    _resize_ipg_buffers(opt, cfg)
    setattr(opt, _ADD_GRAD, reducer.add_grad_to_ipg_bucket)
    setattr(opt, _REDUCE, reducer.reduce_and_partition_ipg_grads)
    opt._get_norm_groups = reducer.get_norm_groups
    opt.has_overflow = reducer.has_overflow
    opt.step = reducer.step
    opt.zero_grad = reducer.zero_grad
    opt.independent_gradient_partition_epilogue = reducer.independent_gradient_partition_epilogue
    for name in _GRAD_WRITERS:
        setattr(opt, name, reducer._edits_grads(getattr(opt, name)))
    if reducer.offload:
        _agree_on_staging(reducer, engine)
    setattr(opt, _ATTR, reducer)
    return reducer


def _partition_members(opt: Any) -> tuple[Any, tuple[int, ...]]:
    """The one partition group of the trainable parameters, with its members' global ranks; else refused."""
    import torch.distributed as tdist

    groups: dict[tuple[int, ...], Any] = {}
    for p in (p for g in opt.fp16_groups for p in g if p.requires_grad):
        group = opt._get_param_partition_group(p)
        groups.setdefault(tuple(tdist.get_process_group_ranks(group)), group)
    if len(groups) != 1:
        raise UnsupportedConfigError(
            f"'flatgrad.reduction' = '2d_reduce_scatter' under ZeRO-3 needs one partition group for every trainable "
            f"parameter; this model has {len(groups)} (MoE or MiCS): use 'reduce_scatter'"
        )
    members, group = next(iter(groups.items()))
    return group, members


def _reduction_mode(opt: Any, cfg: FlatgradConfig) -> ReductionMode:
    """The buckets' mode: ``reduce_scatter``, or the two-stage one with its node and rail groups made once.

    Every rank exchanges its placement (or its error) before any group is made, so a bad or differing
    ``node_size`` raises on every rank instead of hanging: see [Note: ZeRO-3 two-stage reduction].
    """
    if cfg.reduction == "reduce_scatter":
        return ReduceScatter()
    if cfg.reduction not in ZERO3_REDUCTIONS:
        raise UnsupportedConfigError(
            f"'flatgrad.reduction' = {cfg.reduction!r} is not supported by flatgrad's ZeRO-3 backend; use one of "
            f"{ZERO3_REDUCTIONS} ('zero_optimization.stage' = 3)"
        )
    import torch.distributed as tdist

    group, members = _partition_members(opt)
    world_size, rank = len(members), tdist.get_rank(group)
    topology, error = None, None
    try:
        topology = plan_topology(cfg.node_size, list(members), tdist.get_world_size(), rank, "'flatgrad.node_size'")
    except ValueError as exc:
        error = str(exc)
    mine = (error, None if topology is None else topology.node_size)
    everyone: list[Any] = [None] * world_size
    tdist.all_gather_object(everyone, mine, group=group)
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        r, e = failed[0]
        raise UnsupportedConfigError(f"flatgrad's ZeRO-3 two-stage reduction on rank {r}: {e} (this is rank {rank})")
    sizes = {r: n for r, (_, n) in enumerate(everyone)}
    if len(set(sizes.values())) != 1:
        raise UnsupportedConfigError(
            f"the ranks disagree on 'flatgrad.node_size' (per rank: {sizes}; this is rank {rank}): every rank must "
            "place the ranks on the same nodes"
        )
    mode = build_mode(cfg.reduction, world_size, topology=topology)
    mode.connect()
    return mode


def _agree_on_staging(reducer: Zero3Reducer, engine: Any) -> None:
    """Allocate the staging buffers where the grads are not in host memory; every rank learns of any rank's
    failure (one all_reduce at install), so all raise instead of the others hanging in the first reduce_scatter."""
    from deepspeed import comm as dist

    opt = reducer.optimizer
    error = ""
    if reducer.needs_staging():
        try:
            reducer.allocate_staging()
        except (RuntimeError, MemoryError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    failed = torch.tensor([1.0 if error else 0.0], device=reducer._accelerator.current_device_name())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=opt.dp_process_group)
    if failed.item():
        rank = dist.get_rank(group=opt.dp_process_group)
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-3 optimizer offload could not allocate its pinned host staging buffers (2 x "
            f"{reducer.staging_numel()} elements of the comm dtype) on "
            + (f"this rank ({rank}): {error}" if error else "another rank")
            + " ('zero_optimization.offload_optimizer'); lower 'zero_optimization.reduce_bucket_size' or free host "
            "memory"
        )
