"""The reduce path of one ZeRO-3 optimizer: its two IPG seams, the bucket compositions, and per bucket
pack -> reduce_scatter -> unpack.

DeepSpeed keeps its IPG buckets, partitions and step; per bucket, flatgrad books the parameters without the IPG
copy, packs the grads once, issues the reduce_scatter stock issues and unpacks this rank's segment into the grad
partitions, bitwise stock's. See [Note: ZeRO-3 reduce path] in docs/design.md.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .... import comm
from ....kernels import host_backend, resolve_backend
from ....layout import Layout
from ....reducer import Bucket, ReduceScatter, ReductionMode, registry
from .checkpoint import Zero3Residuals
from .composition import Composition
from ..collectives import deepspeed_collectives
from ..config import FlatgradConfig
from ..support import QGZ_KEY
from .offload import Zero3Offload
from .stats import Zero3Stats

__all__ = ["GRAD_PARTITIONS", "Zero3Reduction"]

# DeepSpeed's name-mangled ``{ds_id: grad partition}`` of this rank: what the unpack writes.
GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class Zero3Reduction:
    """The replacement of one ZeRO-3 optimizer's IPG bucket reduction; see [Note: ZeRO-3 reduce path].

    Attributes:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` it serves.
        config: the ``FlatgradConfig``.
        mode: every bucket's reduction mode (its divided twin where stock's divide must be kept); a two-stage
            mode comes connected, its groups made once (see [Note: ZeRO-3 two-stage reduction]).
        compositions: ``{(comm_dtype, ds_ids): Composition}``, one per bucket composition seen.
        offload: the optimizer offload's staging and boundary copies (``Zero3Offload``).
        stats: the step's norm and overflow from the unpacks (``Zero3Stats``).
        residuals: the error-feedback residuals as checkpoints save and load them (``Zero3Residuals``).
    """

    def __init__(self, optimizer: Any, config: FlatgradConfig, mode: ReductionMode | None = None) -> None:
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        self.optimizer = optimizer
        self.config = config
        self.compositions: dict[tuple, Composition] = {}
        self._dist = dist
        self._accelerator = get_accelerator()
        self._comm_dtype = config.torch_comm_dtype()
        self._method = "tensor" if config.reduce_scatter_method == "auto" else config.reduce_scatter_method
        self._collectives = deepspeed_collectives()
        self.mode: ReductionMode = mode if mode is not None else ReduceScatter()
        self._outs: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
        self.offload = Zero3Offload(optimizer, self._accelerator, dist)
        self.stats = Zero3Stats(optimizer, self._accelerator, dist, offload=self.offload.enabled)
        self.residuals = Zero3Residuals(optimizer, self.mode.describe(), self.mode.error_feedback)

    def describe(self) -> str:
        """The take-over line: stage, sub-groups, buckets, reduction mode (and the key that chose it), offload."""
        opt = self.optimizer
        unpack = "one fused unpack" if self.mode.unpacks_pieces else "one fused sum into an fp32 segment, its unpack"
        line = (
            f"flatgrad: ZeRO-3 gradient reduction taken over: {len(opt.fp16_groups)} sub-group(s), DeepSpeed's IPG "
            f"buckets of {opt.reduce_bucket_size} elements, per bucket one fused pack, {self._collective_words()}, "
            f"{unpack} into the {opt.gradient_accumulation_dtype} grad partitions"
        )
        if self.config.reduction_key == QGZ_KEY:
            line += f"; DeepSpeed's qgZ ('{QGZ_KEY}') runs as flatgrad's {self.config.reduction}"
            if self.mode.name != self.config.reduction:
                line += f", which on one node (or one rank per node) is the flat {self.mode.name}"
        if self.offload.enabled:
            pinned = "pinned" if opt.offload_optimizer_pin_memory else "pageable"
            line += (
                f"; CPU optimizer offload served: the partitions are in {pinned} host memory, one transfer of the "
                "reduced segment per bucket, one host copy per run into the fp32 gradients at the boundary"
            )
        return line

    def _collective_words(self) -> str:
        mode = self.mode
        if mode.name == "reduce_scatter":
            return f"one reduce_scatter ({self._method})"
        topology = getattr(mode, "topology", None)
        if mode.name == "2d_reduce_scatter":
            return (
                f"{mode.name}: one reduce_scatter ({self._method}) in the node of {topology.local_size} rank(s), "
                f"then one over the rail of {topology.num_nodes} node(s)"
            )
        words = f"{mode.name} ({registry.entry(mode.name).summary}"
        if mode.error_feedback:
            words += ", with error feedback"
        if topology is not None:
            words += f"; node of {topology.local_size} rank(s), rail of {topology.num_nodes} node(s)"
        return words + ")"

    def staging_bytes(self) -> int:
        """Bytes of the largest ``received`` any bucket can have (what the staged transfer moves): the comm-dtype
        segment of ``Zero3Offload.staging_numel`` elements for the reduce_scatter modes; for the others the
        mode's last pool buffer (its receive buffer) for a bucket of that segment."""
        opt = self.optimizer
        numel = self.offload.staging_numel()
        world_size = self._dist.get_world_size(group=opt.dp_process_group)
        comm_dtype = max((self._comm_dtype or d for d in opt.ipg_buckets), key=lambda d: d.itemsize)
        if self.mode.unpacks_pieces:
            return numel * comm_dtype.itemsize
        _, n, dtype = self.mode.pool_slots([Layout.chunked([numel * world_size], world_size)], comm_dtype)[-1]
        return n * dtype.itemsize

    def metadata_bytes(self) -> int:
        """Bytes kept besides gradients and buffers: the kernels' cached run tables, the buckets' plan tables
        and the step statistics (KBs), which memory figures name rather than hide."""
        from ....kernels import _tables

        plans = [c.bucket.pack_plan for c in self.compositions.values()]
        plans += [c.bucket.unpack_plan for c in self.compositions.values() if c.bucket.unpack_plan is not None]
        return _tables.nbytes() + sum(plan.table_bytes for plan in plans) + self.stats.nbytes

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
            self.drain()  # the staged segments whose copies have landed: unpacked while the backward runs
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

    def drain(self, *, slot: int | None = None, everything: bool = False) -> None:
        """Unpack the staged segments whose copies have landed; wait for ``slot``'s, or for all of them."""
        for comp, staged, micro_step, boundary in self.offload.landed(slot=slot, everything=everything):
            self._host_side(comp, staged, micro_step, boundary)

    # -- compositions and reduction ----------------------------------------------------------------------

    def _composition(self, params: Sequence[torch.nn.Parameter], bucket_dtype: torch.dtype) -> Composition:
        key = (bucket_dtype, tuple(p.ds_id for p in params))
        comp = self.compositions.get(key)
        if comp is None:
            comp = self.compositions[key] = self._build_composition(params, bucket_dtype)
            self.residuals.restore(comp)  # a loaded checkpoint's residual of this composition
        return comp

    def _build_composition(self, params: Sequence[torch.nn.Parameter], bucket_dtype: torch.dtype) -> Composition:
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
        mode = self.mode
        if mode.packs_comm_buffer:
            power_of_two = world_size & (world_size - 1) == 0
            # x * (1/W) has the bits of x / W only for a power-of-two W, and only without a cast before it.
            fused = power_of_two and all(p.dtype == comm_dtype for p in params)
            averaging = comm.Averaging(dist.ReduceOp.SUM, 1.0 / world_size if fused else 1.0, 1.0)
        else:
            # The wire is not stock's bits anyway: 1/W is folded into the unpack's scale, as under ZeRO-1/2.
            fused = True
            averaging = comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / world_size)
        device = torch.device(self._accelerator.current_device_name())
        backend = getattr(resolve_backend(self.config.backend, device), "name", None)
        # A staged segment is unpacked on the host: its kernels are the host's, whatever runs the pack.
        staged = self.offload.enabled and self.offload.needs_staging()
        bucket = Bucket(
            0, tuple(params), layout, rank, comm_dtype=comm_dtype, averaging=averaging, method=self._method,
            backend=backend, mode=mode, prescale=1.0, postscale=1.0, streams=None,
            unpack_backend=host_backend(self.config.backend) if staged else None, divide=not fused,
        )  # fmt: skip
        pieces = layout.pieces(rank)
        return Composition(
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
            temporaries=tuple(s for s in mode.pool_slots([layout], comm_dtype) if s[0] != "input"),
        )

    def _grad_partitions(self, comp: Composition) -> list[torch.Tensor]:
        """Views of this rank's grad partitions for ``comp``'s pieces, cached while DeepSpeed keeps them."""
        opt = self.optimizer
        partitions = getattr(opt, GRAD_PARTITIONS)
        stamp = (id(partitions), opt.grad_partitions_flat_buffer.data_ptr())
        key = (comp.comm_dtype, comp.ds_ids)
        cached = self._outs.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        outs = [partitions[ds_id].narrow(0, 0, n) for ds_id, n in zip(comp.ds_ids, comp.lengths)]
        self._outs[key] = (stamp, outs)
        return outs

    def _reduce(self, comp: Composition, params: Sequence[torch.nn.Parameter], bucket: Any) -> None:
        grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
        device = grads[0].device
        buffers = {
            purpose: torch.empty(n, dtype=dtype, device=device) for purpose, n, dtype in comp.temporaries
        }  # temporaries of this reduce only: on CUDA, the caching allocator reuses them
        if comp.bucket.mode.packs_comm_buffer:
            buffers["input"] = self._input_buffer(comp, bucket, device)
        segment = self._pack_and_reduce(comp, grads, buffers)
        micro_step = self.optimizer.micro_step_id
        if not comp.ds_ids:
            self.stats.add(micro_step, comp, None)  # nothing here, but the bucket was reduced
            return
        outs = self._grad_partitions(comp)
        opt = self.optimizer
        if self.offload.stages(segment, outs[0].device):
            self._stage(comp, segment, micro_step, opt.is_gradient_accumulation_boundary())
        else:
            self._host_side(comp, segment, micro_step, self.offload.enabled and opt.is_gradient_accumulation_boundary())
            self.offload.count_direct_transfer()

    @staticmethod
    def _input_buffer(comp: Composition, bucket: Any, device: torch.device) -> torch.Tensor:
        """The comm-dtype buffer the pack writes: the IPG buffer, grown to the layout where it is short."""
        layout = comp.layout
        ipg_buffer = bucket.buffer
        if ipg_buffer is None or ipg_buffer.dtype != comp.comm_dtype or ipg_buffer.device != device:
            return torch.empty(layout.numel, dtype=comp.comm_dtype, device=device)
        if ipg_buffer.numel() < layout.numel:
            # A chunked layout pads every param to a multiple of W, and one param may exceed the
            # bucket: grow the IPG buffer once to the largest layout seen, not a buffer per step.
            if ipg_buffer.is_cuda:
                ipg_buffer.record_stream(torch.cuda.current_stream(device))
            ipg_buffer = bucket.buffer = torch.empty(layout.numel, dtype=comp.comm_dtype, device=device)
        return ipg_buffer.narrow(0, 0, layout.numel)

    def _pack_and_reduce(
        self, comp: Composition, grads: list[torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Pack ``grads`` into ``buffers``, run the bucket's collective and wait: what arrived (this rank's reduced
        segment for the reduce_scatter modes, a view of the input; the sources or the wire for the others)."""
        flight = comp.bucket.reduce(grads, comp.group, self._collectives, buffers=buffers)
        flight.wait()
        return flight.received

    def _unpack(
        self, comp: Composition, segment: torch.Tensor, outs: list[torch.Tensor], accumulate: bool
    ) -> torch.Tensor | None:
        """Unpack ``segment`` into ``outs`` (add when ``accumulate``): the ``[sum_sq, nonfinite]`` of what it wrote."""
        b = comp.bucket
        if b.mode.unpacks_pieces:
            return b.unpack(segment, outs, accumulate, True)
        return b.unpack_plan_for(outs)(segment, outs, scale=1.0, accumulate=accumulate, return_stats=True)

    def _host_side(self, comp: Composition, received: torch.Tensor, micro_step: int, boundary: bool) -> None:
        """Unpack ``received`` into the grad partitions (copy on micro-step 0, add after); then the boundary's work.

        A mode that sums sources or dequantizes a wire writes one contiguous shard: it sums into one fp32 segment,
        which the per-piece unpack then writes as it writes a reduce_scatter's (see [Note: ZeRO-3 reduce path]).
        """
        b = comp.bucket
        segment = received
        if not b.mode.unpacks_pieces:
            segment = torch.empty(comp.layout.shard_numel, dtype=torch.float32, device=received.device)
            b.unpack(received, segment, False, False)
        outs = self._grad_partitions(comp)
        out_dtype = outs[0].dtype
        if segment.dtype != out_dtype and out_dtype != torch.float32:
            segment = segment.to(out_dtype)  # stock adds after this cast; see [Note: ZeRO-3 reduce path]
        self.stats.add(micro_step, comp, self._unpack(comp, segment, outs, micro_step != 0))
        if boundary:
            self.offload.to_fp32_grads(comp, outs)

    def _stage(self, comp: Composition, segment: torch.Tensor, micro_step: int, boundary: bool) -> None:
        """One asynchronous copy of the reduced segment into a pinned staging buffer; unpacked once it landed."""
        slot = self.offload.claim_slot()
        self.drain(slot=slot)  # the slot's previous segment must be unpacked before it is overwritten
        self.offload.stage(slot, comp, segment, micro_step, boundary)
