"""``Zero2Reduction``: flatgrad's reduce path inside one ``DeepSpeedZeroOptimizer``, its windows and hand-over.

[Note: accumulation dtype]
One rule, DeepSpeed's own contract: micro-steps add up in DeepSpeed's gradient
accumulation dtype (``data_types.grad_accum_dtype``; by default the model's
dtype, so bf16 or fp16 like stock, and fp32 for fp32 models). The partition is
allocated in that dtype and the unpack adds each reduced micro-step into it,
rounding once per micro-step, exactly as stock adds its reduced bit16
gradients; so flatgrad's bit16 results equal stock's. With
``grad_accum_dtype: fp32`` the partition is fp32: 4 bytes x P/W, never a
full-size fp32 buffer. ZeRO-1 keeps DeepSpeed's ``param.grad_accum`` (ZeRO-1
reduces once per window); it is divided by the data-parallel size in its own
dtype and cast to the communication dtype afterwards, as stock does, so
loss-scaled fp16 sums do not overflow in the cast.

[Note: ZeRO-Offload]
Under ``offload_optimizer: {device: cpu}`` stock copies every parameter's slice of
its reduced gradient into the host fp32 partition (``single_partition_of_fp32_groups[i].grad``,
allocated once and kept, pinned with ``pin_memory``), one copy per parameter, and
with accumulation keeps a full-size host copy of each parameter's gradient that it
moves through the device every micro-step. flatgrad gives each sub-group's host
partition to its reducer as the bucket's shard target (see [Note: shard targets] in
``flatgrad/reducer/shards.py``): the fused unpack writes into it in place on a CPU
rank with fp32 accumulation, else the window's shard is delivered by one copy per
bucket as the last micro-step unpacks it. Accumulation follows [Note: accumulation
dtype]. The step is flatgrad's (see [Note: ZeRO-2 step]) over the host
partitions: one optimizer call on the host for all sub-groups, one copy into the
bit16 partitions, the coalesced parameter all_gathers; stock's arithmetic, the
clipping norm rooted as stock's offload path roots it (see [Note: stock clipping
norm]). A checkpoint load that gives a master partition a new
``.grad`` gets the reducers' target put back at the hand-over.

[Note: step placement]
One rule places every tensor of the step: it takes its device from the tensor it
is combined with or written into. The unpack's stats and the vector the step
all_reduces live on the accelerator (``comm_device``: NCCL reduces device
memory). What reads a partition runs where the partition is: under offload the
host fp32 gradients, so ``StockNorm``'s index and per-piece norms, and the norms
of ``group_squared_norms``, are on the host; their sums move to the accelerator
once, before the all_reduce. The global norm is returned on stock's ``device``
(``norm_device``: the host under offload, as stock's offload path returns it),
so the clip scale multiplies the gradients where they are. The updated masters
reach the bit16 partitions through stock's persistent bit16 host buffers,
``non_blocking``.

[Note: ZeRO-2 memory]
Stock frees its IPG buffers and gradient partitions between steps, so
flatgrad must too. The reducers' comm buffers are a pool of
``comm_buffers`` buffers of the largest sub-group (by default as many as
stock's IPG buffers: 2 with ``overlap_comm``, else 1), shared by all
sub-groups, with the reduce_scatter in place, and held from a backward's
first launch to its end only, as stock's IPG buffers are (see [Note: comm
buffer pool] in ``flatgrad/reducer/pool.py``): between steps flatgrad holds
nothing stock does not. The partitions exist from the first
micro-step of an accumulation window (ZeRO-1: from the boundary, where it
reduces) until ``step()`` has consumed them: the step wrapper calls the
reducers' ``zero_grad()``, which drops them. Under ZeRO-2 with an elementwise
optimizer a reducer's partitions are one arena, allocated whole at the
window's first launch (see [Note: optimizer arenas]), as stock allocates its
``grads_in_partition`` whole at its first bucket; ZeRO-1 reduces in the
boundary's backward, while the full gradients are still alive, so there one
arena would raise the peak by most of its size (1.5 B/param at 2 ranks in
fp32, ``bench/memory.py``): ZeRO-1 allocates each partition as its bucket
launches. The per-piece views ``step()``
and the norm read are rebuilt from a plan made once, per window.

This module holds no kernels (the reducer packs and unpacks); the few collectives of
the step go through ``flatgrad.comm`` and ``deepspeed.comm``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .... import comm
from ....layout import Layout
from ..arenas import ELEMENTWISE, OptimizerArenas
from ..collectives import deepspeed_collectives
from ..config import FlatgradConfig, UnsupportedConfigError
from ..step_stats import StepStats
from .checkpoint import Zero2Checkpoints
from .partitions import agree_on_setup, arena_positions, partition_views, verify_layout, view_plan
from .stats import Zero2StepStats
from .step import Zero2Step
from .stock_norm import StockNorm

__all__ = ["Zero2Reduction", "stock_scales"]


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


class Zero2Reduction(Zero2Step, Zero2StepStats, Zero2Checkpoints):
    """flatgrad's reduce path inside one ``DeepSpeedZeroOptimizer`` (ZeRO-1 or 2).

    One ``BucketReducer`` per process group (the data-parallel group, and one
    expert-data-parallel group per MoE group name), one bucket per sub-group.
    See [Note: ZeRO-2 seams].
    """


    def __init__(self, optimizer: Any, cfg: FlatgradConfig):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

        o = optimizer
        self.optimizer = o
        self.cfg = cfg
        _refuse_unsupported(o)
        # Under CPU offload the partitions are the optimizer's host fp32 gradients, which its own step
        # reads: see [Note: ZeRO-Offload]. Where the step's tensors live: [Note: step placement].
        self.offload = bool(getattr(o, "cpu_offload", False))
        self.comm_device = torch.device(get_accelerator().current_device_name())
        self.norm_device = torch.device(o.device)
        groups = self._sub_groups_by_process_group()
        # With an elementwise optimizer the step updates runs of sub-groups as one tensor: the
        # shards of a reducer are then one arena, in sub-group order. See [Note: optimizer arenas].
        use_arenas = type(o.optimizer) in ELEMENTWISE and o.partition_gradients and not self.offload
        self._make_reducers(groups, use_arenas)
        # Under offload, the host partitions the reducers deliver into, by sub-group (fixed at install).
        self._host_targets = [self._host_gradient(i) for i in range(len(self.layouts))] if self.offload else []

        # How step()'s per-piece views lie in each sub-group's partition, planned once; the
        # partitions themselves live for one accumulation window. See [Note: ZeRO-2 memory].
        self._buffer_group = GradPartitionBufferGroup
        self._view_plans = [
            view_plan(layout, self._slot[i][0].rank, o.round_robin_bit16_groups[i])
            for i, layout in enumerate(self.layouts)
        ]
        self.partitions: list[Any] | None = None
        self._window = StepStats()
        self._gather_plan: list[tuple[comm.AllGatherPlan, list[int]]] | None = None
        self._bit16_viewed = [False] * len(self.layouts)
        self._bit16_checks: tuple[list, list, list] | None = None
        self._bit16_copy_lists: tuple[list, list] | None = None
        self._window_open = False
        self.reductions = 0
        self._moe_groups = self._moe_sub_groups()
        self.arenas: OptimizerArenas | None = None
        if use_arenas:
            self.arenas = OptimizerArenas(o, [sorted(indices) for _, indices in groups.values()])
        self._bit16_params = [p for group in o.bit16_groups for p in group]
        # On gloo the step's gather copies every chunk anyway: it takes this rank's bit16 partitions
        # straight from the master arena (one cast), instead of a copy per sub-group first.
        self._gather_from_arenas = self.arenas is not None and all(
            comm.backend_name(r.process_group, self.comm_device) == "gloo" for r in self.reducers
        )
        self._pipe_replicated = any(getattr(p, PIPE_REPLICATED, False) for p in self._bit16_params)
        self._stock_norm: StockNorm | None = None  # planned at the first clipped step

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
                    self._host_gradient(i)
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

    def _make_reducers(self, groups: dict[int, tuple[Any, list[int]]], use_arenas: bool) -> None:
        """One ``BucketReducer`` per process group, one bucket per sub-group, with stock's scales."""
        from ....reducer import BucketReducer

        o, cfg = self.optimizer, self.cfg
        prescale, postscale = stock_scales(o)
        # ZeRO-1 with a wider accumulation dtype keeps DeepSpeed's param.grad_accum; it is
        # pre-scaled in that dtype before the cast to the comm dtype, as stock does. See grad_ready.
        self._accum_prescale = prescale if o.use_grad_accum_attribute else None
        if o.use_grad_accum_attribute:
            prescale = 1.0
        self.reducers: list[Any] = []
        concat_position: list[int] = [0] * len(self.layouts)  # sub-group -> its row in the reducers' stats, stacked
        self.methods: set[str] = set()
        self._slot: list[tuple[Any, int]] = [None] * len(self.layouts)  # type: ignore[list-item]
        self._reducer_of: dict[int, Any] = {}
        for pg, indices in groups.values():
            reducer = BucketReducer(
                [list(o.round_robin_bit16_groups[i]) for i in indices],
                process_group=pg,
                comm_dtype=cfg.torch_comm_dtype() or o.communication_data_type,
                layout="flat",
                align=int(o.nccl_start_alignment_factor),
                average=False,
                prescale=prescale,
                postscale=postscale,
                backend=cfg.backend,
                register_hooks=False,
                method=cfg.reduce_scatter_method,
                comm_buffers=cfg.comm_buffers or (2 if o.overlap_comm else 1),
                collect_stats=True,
                accum_dtype=o.gradient_accumulation_dtype,
                reduction=cfg.reduction,
                block=cfg.block,
                error_feedback=cfg.error_feedback,
                node_size=cfg.node_size,
                collectives=deepspeed_collectives(),
                shard_arena=arena_positions(indices) if use_arenas else None,
                shard_targets=[self._host_gradient(i) for i in indices] if self.offload else None,
            )
            for b, i in enumerate(indices):
                if reducer.layouts[b] != self.layouts[i]:
                    raise RuntimeError(f"flatgrad: the reducer's layout of sub-group {i} differs from DeepSpeed's")
                self._slot[i] = (reducer, b)
                concat_position[i] = sum(len(r.layouts) for r in self.reducers) + b
                for p in o.round_robin_bit16_groups[i]:
                    self._reducer_of[id(p)] = reducer
            self.reducers.append(reducer)
            self.methods.add(comm.resolve_method(cfg.reduce_scatter_method, pg, self.comm_device))
        self._stats_order = torch.tensor(concat_position, dtype=torch.long, device=self.comm_device)

    def _host_gradient(self, i: int) -> torch.Tensor:
        """Sub-group ``i``'s fp32 gradient partition on the host, which the offloaded optimizer reads (stock's own)."""
        grad = self.optimizer.single_partition_of_fp32_groups[i].grad
        if grad is None or grad.numel() != self.layouts[i].shard_numel:
            raise RuntimeError(
                f"flatgrad: sub-group {i} has no host gradient partition of {self.layouts[i].shard_numel} elements "
                "(DeepSpeed allocates it under 'zero_optimization.offload_optimizer')"
            )
        return grad

    def _moe_sub_groups(self) -> list[tuple[Any, torch.Tensor]]:
        """MoE sub-groups by expert group, for the norm (stock averages them over that group)."""
        o = self.optimizer
        moe: dict[int, tuple[Any, list[int]]] = {}
        for i, group in enumerate(o.optimizer.param_groups):
            if o.has_moe_layers and o.is_moe_param_group[i]:
                pg = o.real_dp_process_group[i]
                moe.setdefault(id(pg), (pg, []))[1].append(i)
        return [(pg, torch.tensor(indices, dtype=torch.long, device=self.comm_device)) for pg, indices in moe.values()]

    # -- window: the micro-steps whose gradients one step() consumes

    def _open_window(self) -> None:
        # A new window starts with fresh partitions, unless step() has not consumed the last
        # hand-over yet (several backwards at one boundary): then the reducers keep adding to
        # them, as PyTorch accumulates .grad until step. step() releases them (see step()).
        self._window_open = True

    # -- the replaced seams

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
        self._open_window()
        self._reducer_of[id(param)].mark_ready(param)

    def epilogue(self) -> None:
        """Replaces ``independent_gradient_partition_epilogue``: finish, and hand over at the boundary."""
        o = self.optimizer
        self._open_window()
        for r in self.reducers:
            r.finish()  # every bucket launched, so every param.grad is dropped (stock: _clear_param_grad_only)
        self.reductions += 1
        if o.is_gradient_accumulation_boundary():
            self._hand_over()
        o._release_ipg_buffers()  # the next backward counts a new micro-step (setup_buckets)
        o._epilogue_ran_this_backward = True

    def finalize(self) -> None:
        """Replaces ``finalize_gradient_accumulation_boundary`` (``managed_gradient_accumulation: false``)."""
        self.optimizer.set_gradient_accumulation_boundary(True)
        if self._window_open:
            self._hand_over()

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

    def _hand_over(self) -> None:
        o = self.optimizer
        if self.offload:
            self._deliver_to_host()
        if self.partitions is None:
            shards = {id(r): [gs.shard for gs in r.grad_shards()] for r in self.reducers}
            self.partitions = []
            for i, plan in enumerate(self._view_plans):
                reducer, b = self._slot[i]
                shard = shards[id(reducer)][b]
                self.partitions.append(self._buffer_group(partition_views(shard, plan), shard))
        for i, partition in enumerate(self.partitions):
            o.averaged_gradients[i] = partition
        self._window.forget()  # this hand-over's stats are reduced when step() first asks
        self._window_open = False

    def _deliver_to_host(self) -> None:
        """Offload: every partition in its host gradient, and every host gradient the optimizer's again.

        A checkpoint load may give a master partition a new ``.grad``; the reduced
        gradient is in the tensor the reducers were given, so that one is put back.
        """
        o = self.optimizer
        for r in self.reducers:
            r.deliver()
            r.final_micro_step = False
        for master, target in zip(o.single_partition_of_fp32_groups, self._host_targets):
            if master.grad is not target:
                master.grad = target

    def _handed_over(self) -> bool:
        """Whether DeepSpeed's ``averaged_gradients`` still hold this window's partitions, every one."""
        held = map(self.optimizer.averaged_gradients.get, range(len(self.partitions)))
        return all(map(operator.is_, held, self.partitions))

    def release(self) -> None:
        """Drop this window's fp32 partitions (step() has consumed them, or skipped the step)."""
        o = self.optimizer
        if self.partitions is not None:
            for i, partition in enumerate(self.partitions):
                if o.averaged_gradients.get(i) is partition:
                    o.averaged_gradients[i] = None
        self.partitions = None
        self._window.reset()
        for r in self.reducers:
            r.zero_grad()

    def metadata_bytes(self) -> int:
        """Bytes flatgrad keeps between steps besides gradients and optimizer state, counted in memory figures.

        The kernels' cached run tables, the reducers' plan tables, the gather
        plans' copy tables (gloo), the stats order, the clipping norm's plan
        (``StockNorm``, after a clipped step), and inside a window the stats:
        hundreds of bytes to KBs, which memory targets against stock name rather
        than hide.
        """
        from ....kernels import _tables

        gathers = sum(plan.table_bytes for plan, _ in self._gather_plan or ())
        step_stats = self._window.nbytes
        stock_norm = self._stock_norm.metadata_bytes() if self._stock_norm is not None else 0
        return (
            _tables.nbytes() + sum(r.metadata_bytes() for r in self.reducers) + gathers
            + self._stats_order.nbytes + step_stats + stock_norm
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
