"""``Zero2Reduction``: flatgrad's reduce path inside one ``DeepSpeedZeroOptimizer``, made of its parts, and ``install``.

Micro-steps add up in DeepSpeed's gradient accumulation dtype, rounding as stock's do. See [Note:
accumulation dtype] in docs/design.md.

Under optimizer offload the partitions are the optimizer's host fp32 gradients, which its own step
reads. See [Note: ZeRO-Offload] in docs/design.md.

Every tensor of the step takes its device from the tensor it meets. See [Note: step placement] in
docs/design.md.

The partitions live for one window and the comm buffers for one backward, so that between steps
flatgrad holds nothing stock does not. See [Note: ZeRO-2 memory] in docs/design.md.

This module holds no kernels (the reducer packs and unpacks); the few collectives of
the step go through ``flatgrad.comm`` and ``deepspeed.comm``.
"""

from __future__ import annotations

from typing import Any

import torch

from .... import comm
from ....layout import Layout
from ..arenas import ELEMENTWISE, OptimizerArenas
from ..collectives import deepspeed_collectives
from ..config import FlatgradConfig, UnsupportedConfigError
from .checkpoint import Zero2Checkpoints
from .context import Zero2Context
from .partitions import agree_on_setup, arena_positions, host_gradient, verify_layout
from .seams import Zero2Seams
from .state_offload import Zero2StateOffload
from .stats import Zero2StepStats
from .step import Zero2Step
from .window import Zero2Window

__all__ = ["Zero2Reduction", "install", "stock_scales"]


def _refuse_unsupported(o: Any) -> None:
    """What the optimizer itself shows flatgrad cannot take (the config was checked before: ``support.py``)."""
    if any(any(pad) for pad in o.round_robin_bit16_padding):
        raise UnsupportedConfigError(
            "per-parameter alignment padding ('zero_optimization.parameter_alignment') is not supported by flatgrad"
        )


def stock_scales(o: Any) -> tuple[float, float]:
    """``(prescale, postscale)`` of the gradients, reproducing stock's arithmetic.

    With reduce_scatter (the default, and required for MoE) every gradient, expert ones included,
    is divided by the data-parallel size before the sum; without it, by the predivide factor before
    and the rest after.
    """
    import deepspeed.comm as dist

    world_size = dist.get_world_size(group=o.dp_process_group)
    dp = world_size / float(o.sequence_parallel_size)
    if not o.gradient_average:
        return 1.0, 1.0
    if o.reduce_scatter or not o.postscale_gradients:
        return 1.0 / dp, 1.0
    pd = float(o.gradient_predivide_factor)
    return 1.0 / pd, (pd / dp if pd != world_size else 1.0)


class Zero2Reduction:
    """flatgrad's reduce path inside one ``DeepSpeedZeroOptimizer`` (ZeRO-1 or 2).

    One ``BucketReducer`` per process group (the data-parallel group, and one
    expert-data-parallel group per MoE group name), one bucket per sub-group.
    The reduction takes the backward's seams itself; its parts own the rest,
    each built here and handed what it reads. See [Note: ZeRO-2 seams].

    Attributes:
        seams: DeepSpeed's methods flatgrad replaces, stock's kept (``Zero2Seams``).
        context: the fixed facts the parts read (``Zero2Context``).
        window: the accumulation window and its partitions (``Zero2Window``).
        stepper: the merged step (``Zero2Step``).
        stats: the step's norm and overflow check (``Zero2StepStats``).
        checkpoints: the checkpoint saver and loaders (``Zero2Checkpoints``).
        state_offload: ``offload_states`` and ``reload_states`` (``Zero2StateOffload``).
        reductions: backwards reduced so far.
    """

    def __init__(self, optimizer: Any, config: FlatgradConfig):
        from deepspeed.accelerator import get_accelerator

        o = optimizer
        self.seams = Zero2Seams(o)
        self.optimizer = o
        self.config = config
        _refuse_unsupported(o)
        # Under CPU offload the partitions are the optimizer's host fp32 gradients, which its own step
        # reads: see [Note: ZeRO-Offload]. Where the step's tensors live: [Note: step placement].
        self.offload = bool(getattr(o, "cpu_offload", False))
        comm_device = torch.device(get_accelerator().current_device_name())
        groups = self._sub_groups_by_process_group()
        # With an elementwise optimizer the step updates runs of sub-groups as one tensor: the
        # shards of a reducer are then one arena, in sub-group order. See [Note: optimizer arenas].
        use_arenas = type(o.optimizer) in ELEMENTWISE and o.partition_gradients and not self.offload
        self._make_reducers(groups, use_arenas, comm_device)
        self.arenas: OptimizerArenas | None = None
        if use_arenas:
            self.arenas = OptimizerArenas(o, [sorted(indices) for _, indices in groups.values()])
        self.context = Zero2Context(
            optimizer=o, layouts=tuple(self.layouts), reducers=tuple(self.reducers), slots=tuple(self._slot),
            arenas=self.arenas, offload=self.offload, comm_device=comm_device, norm_device=torch.device(o.device),
        )  # fmt: skip
        seams = self.seams
        self.window = Zero2Window(self.context)
        self.stepper = Zero2Step(self.context, self.window, seams.stock.step)
        self.stats = Zero2StepStats(
            self.context, self.window, seams.stock.has_overflow, seams.stock.update_offload_overflow_tracker
        )
        self.checkpoints = Zero2Checkpoints(
            o, self.reducers, self.arenas, seams.stock.state_dict, seams.stock._load_legacy_checkpoint,
            layout=config.checkpoint_layout,
        )
        self.state_offload = Zero2StateOffload(
            self.context, self.window, seams.stock.offload_states, seams.stock.reload_states
        )
        self.reductions = 0

    def bind(self) -> None:
        """Put flatgrad's methods in place of DeepSpeed's on the optimizer; this reduction is ``optimizer.flatgrad``."""
        self.seams.bind(
            {
                "_load_legacy_checkpoint": self.checkpoints.load_legacy,
                "state_dict": self.checkpoints.state_dict,
                "step": self.stepper.step,
                "reduce_independent_p_g_buckets_and_remove_grads": self.grad_ready,
                "independent_gradient_partition_epilogue": self.epilogue,
                "finalize_gradient_accumulation_boundary": self.finalize,
                "setup_buckets": self.setup_buckets,
                "load_hp_checkpoint_state_from_checkpoint_dir": self.checkpoints.load_universal,
                "scaled_global_norm": self.stats.scaled_global_norm,
                "has_overflow": self.stats.has_overflow,
                "update_offload_overflow_tracker": self.stats.grad_edited,
                "offload_states": self.state_offload.offload_states,
                "reload_states": self.state_offload.reload_states,
            },
            adapter=self,
        )

    def _sub_groups_by_process_group(self) -> dict[int, tuple[Any, list[int]]]:
        """Every sub-group's layout, checked against DeepSpeed's on every rank, and the sub-groups of each process group
        in the order they complete in backward."""
        import deepspeed.comm as dist

        o = self.optimizer
        align = int(o.nccl_start_alignment_factor)
        groups: dict[int, tuple[Any, list[int]]] = {}
        self.layouts: list[Layout] = []
        local_error: Exception | None = None
        try:
            for i, params in enumerate(o.round_robin_bit16_groups):
                pg = o.real_dp_process_group[i]
                layout = Layout.flat([p.numel() for p in params], dist.get_world_size(group=pg), align)
                verify_layout(o, i, layout, dist.get_rank(group=pg))
                self.layouts.append(layout)
                if self.offload:
                    host_gradient(o, i, layout)
                groups.setdefault(id(pg), (pg, []))[1].append(i)
        except Exception as exc:  # exchanged below so that every rank raises, then re-raised
            local_error = exc
        agree_on_setup(o.dp_process_group, local_error)
        # A reducer launches its buckets strictly in bucket order (collectives match by issue
        # order), so order each reducer's sub-groups by when they complete in backward: when
        # their earliest-registered parameter's gradient arrives. Sub-groups of one param group
        # are in that order already; this interleaves several param groups correctly.
        position = {id(p): k for k, p in enumerate(o.param_names)}
        unknown = len(position)

        def completes(i: int) -> int:
            return -min(position.get(id(p), unknown) for p in o.round_robin_bit16_groups[i])

        for _, indices in groups.values():
            indices.sort(key=completes)
        return groups

    def _make_reducers(
        self, groups: dict[int, tuple[Any, list[int]]], use_arenas: bool, comm_device: torch.device
    ) -> None:
        """One ``BucketReducer`` per process group, one bucket per sub-group, with stock's scales."""
        from ....reducer import BucketReducer

        o, config = self.optimizer, self.config
        prescale, postscale = stock_scales(o)
        # ZeRO-1 with a wider accumulation dtype keeps DeepSpeed's param.grad_accum; it is
        # pre-scaled in that dtype before the cast to the comm dtype, as stock does. See grad_ready.
        self._accum_prescale = prescale if o.use_grad_accum_attribute else None
        if o.use_grad_accum_attribute:
            prescale = 1.0
        self.reducers: list[Any] = []
        self.methods: set[str] = set()
        self._slot: list[tuple[Any, int]] = [None] * len(self.layouts)  # type: ignore[list-item]
        self._reducer_of: dict[int, Any] = {}
        for pg, indices in groups.values():
            reducer = BucketReducer(
                [list(o.round_robin_bit16_groups[i]) for i in indices],
                process_group=pg,
                comm_dtype=config.torch_comm_dtype() or o.communication_data_type,
                layout="flat",
                align=int(o.nccl_start_alignment_factor),
                average=False,
                prescale=prescale,
                postscale=postscale,
                backend=config.backend,
                register_hooks=False,
                method=config.reduce_scatter_method,
                comm_buffers=config.comm_buffers or (2 if o.overlap_comm else 1),
                collect_stats=True,
                accum_dtype=o.gradient_accumulation_dtype,
                reduction=config.reduction,
                block=config.block,
                error_feedback=config.error_feedback,
                node_size=config.node_size,
                collectives=deepspeed_collectives(),
                shard_arena=arena_positions(indices) if use_arenas else None,
                shard_targets=[host_gradient(o, i, self.layouts[i]) for i in indices] if self.offload else None,
            )
            for b, i in enumerate(indices):
                if reducer.layouts[b] != self.layouts[i]:
                    raise RuntimeError(f"flatgrad: the reducer's layout of sub-group {i} differs from DeepSpeed's")
                self._slot[i] = (reducer, b)
                for p in o.round_robin_bit16_groups[i]:
                    self._reducer_of[id(p)] = reducer
            self.reducers.append(reducer)
            self.methods.add(comm.resolve_method(config.reduce_scatter_method, pg, comm_device))

    # -- the backward's seams

    def grad_ready(self, param: torch.nn.Parameter, i: int) -> None:
        """Replaces ``reduce_independent_p_g_buckets_and_remove_grads``: mark ``param`` ready."""
        o = self.optimizer
        if param.numel() == 0:
            return
        if not getattr(param, "ds_grad_is_ready", True):
            return
        if o.use_grad_accum_attribute and getattr(param, "grad_accum", None) is not None:
            # ZeRO-1 with a wider accumulation dtype (fp16 params, fp32 grad_accum): divide in
            # that dtype, then cast to the communication dtype, as stock does; casting first
            # would overflow loss-scaled sums above the fp16 range.
            param.grad = param.grad_accum.mul_(self._accum_prescale).to(param.dtype)
            param.grad_accum = None
        if param.grad is None:
            return
        o._maybe_reduce_autoep_folding_tp_gradient(param, param.grad)
        self.window.open()
        self._reducer_of[id(param)].mark_ready(param)

    def epilogue(self) -> None:
        """Replaces ``independent_gradient_partition_epilogue``: finish, and hand over at the boundary."""
        o = self.optimizer
        self.window.open()
        for r in self.reducers:
            r.finish()  # every bucket launched, so every param.grad is dropped (stock: _clear_param_grad_only)
        self.reductions += 1
        if o.is_gradient_accumulation_boundary():
            self.window.hand_over()
        o._release_ipg_buffers()  # the next backward counts a new micro-step (setup_buckets)
        o._epilogue_ran_this_backward = True

    def finalize(self) -> None:
        """Replaces ``finalize_gradient_accumulation_boundary`` (``managed_gradient_accumulation: false``)."""
        self.optimizer.set_gradient_accumulation_boundary(True)
        if self.window.is_open:
            self.window.hand_over()

    def setup_buckets(self) -> None:
        """Replaces ``setup_buckets``: count the micro-step, allocate no IPG bucket (flatgrad has its own)."""
        o = self.optimizer
        if not o.ready_for_gradients:
            o.micro_step_id += 1
            o.ready_for_gradients = True
            if self.offload:  # the boundary's unpacks deliver to the host as they finish: [Note: ZeRO-Offload]
                final = o.is_gradient_accumulation_boundary()
                for r in self.reducers:
                    r.final_micro_step = final

    def metadata_bytes(self) -> int:
        """Bytes flatgrad keeps between steps besides gradients and optimizer state, counted in memory figures.

        The kernels' cached run tables, the reducers' plan tables, the gather
        plans' copy tables (gloo), the stats order, the clipping norm's plan
        (``StockNorm``, after a clipped step), and inside a window the stats:
        hundreds of bytes to KBs, which memory targets against stock name rather
        than hide.
        """
        from ....kernels import _tables

        return (
            _tables.nbytes() + sum(r.metadata_bytes() for r in self.reducers) + self.stepper.metadata_bytes()
            + self.stats.metadata_bytes() + self.window.metadata_bytes()
        )  # fmt: skip

    def _collective_words(self) -> str:
        """What moves a bucket, for the take-over line: the reduce_scatter method, or the reduction mode's name."""
        names = sorted({r.mode.name for r in self.reducers if r.world_size > 1} or {"reduce_scatter"})
        if names == ["reduce_scatter"]:
            return f"one reduce_scatter ({', '.join(sorted(self.methods))})"
        return "the " + " / ".join(names) + " reduction"

    def describe(self) -> str:
        """The take-over line: stage, sub-groups, buckets, reduction method."""
        o = self.optimizer
        unsplit = getattr(o, "_flatgrad_origins", (len(self.layouts), None))[0]
        return (
            f"flatgrad: ZeRO-{2 if o.partition_gradients else 1} gradient reduction taken over: {unsplit} param group(s) "
            f"split into {len(self.layouts)} sub-group(s) = {len(self.layouts)} bucket(s) on {len(self.reducers)} "
            f"process group(s), per bucket one fused pack, {self._collective_words()}, "
            f"one fused unpack into the {o.gradient_accumulation_dtype} partition"
            + (", delivered to the optimizer's host fp32 partition (optimizer offload)" if self.offload else "")
        )


def install(engine: Any, config: FlatgradConfig) -> Zero2Reduction:
    """Install flatgrad's reduce path into a ZeRO-1/2 engine built under ``prepare``."""
    reduction = Zero2Reduction(engine.optimizer, config)
    reduction.bind()
    reduction.checkpoints.attach(engine)
    return reduction
