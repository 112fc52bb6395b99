"""The ZeRO-1/2 step's gradient norm and overflow check, from the unpack's stats.

The last unpack of a window already computed, while writing each partition, the sum of squares
and the non-finite count that both checks need: one all_reduce serves them, and no partition is
read again (except for a norm that clips). See [Note: ZeRO-2 step statistics] in docs/design.md.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..step_stats import StepStats
from .context import Zero2Context
from .stock_norm import StockNorm
from .window import Zero2Window

__all__ = ["Zero2StepStats", "group_squared_norms", "partitions_overflow"]


class Zero2StepStats:
    """The ZeRO-1/2 step's gradient norm and overflow check. See [Note: ZeRO-2 step statistics].

    Args:
        context: the reduction's fixed facts.
        window: the window whose partitions and statistics are read.
        stock_has_overflow: DeepSpeed's own ``has_overflow``, for a window without usable stats.
        stock_update_overflow_tracker: DeepSpeed's own ``update_offload_overflow_tracker``, which ``grad_edited``
            wraps.

    Attributes:
        moe_groups: the MoE sub-groups by expert group, for the norm (stock averages them over that group).
    """

    def __init__(
        self,
        context: Zero2Context,
        window: Zero2Window,
        stock_has_overflow: Callable[[bool], bool],
        stock_update_overflow_tracker: Callable[[Any], None],
    ):
        from deepspeed.runtime.constants import PIPE_REPLICATED

        o = context.optimizer
        self.context = context
        self.window = window
        self.stock_has_overflow = stock_has_overflow
        self.stock_update_overflow_tracker = stock_update_overflow_tracker
        self._order = _stats_order(context.reducers, context.slots, context.comm_device)
        self.moe_groups = _moe_sub_groups(o, context.comm_device)
        # Read once at install: pipeline modules mark tied weights when they are built.
        self._pipe_replicated = any(getattr(p, PIPE_REPLICATED, False) for group in o.bit16_groups for p in group)
        self._stock_norm: StockNorm | None = None  # planned at the first clipped step

    def grad_edited(self, grad: Any) -> None:
        """Wraps ``update_offload_overflow_tracker``, which DeepSpeed's ``safe_set_full_grad`` calls after writing.

        DeepSpeed calls it for params linked to the optimizer by ``_zero_optimizer``,
        which it sets under offload only; ``install`` links every param. A gradient
        written into a partition after its unpack is not in the unpack's stats: this
        window's step reads the partitions, as stock does.
        """
        self.window.step_stats.mark_stale()
        self.stock_update_overflow_tracker(grad)

    def usable(self) -> bool:
        """Whether the unpack stats give stock's norm: no model parallelism, no pipe-replicated params, no
        gradient edited through DeepSpeed's API since the unpack."""
        o = self.context.optimizer
        if self.window.step_stats.stale:
            return False
        if o.mpu is not None or o.model_parallel_group is not None:
            return False
        if not all(r.stats_available for r in self.context.reducers):
            return False  # a reducer made without collect_stats (every reduction mode's unpack computes them)
        return not self._pipe_replicated

    def reduced(self) -> torch.Tensor:
        """Per sub-group squared norm, then the non-finite count, summed over the ranks: one all_reduce.

        The values come from the last unpack of every sub-group (the accumulated
        partition as written, see ``BucketReducer.shard_stats``), so no partition is
        read again; computed once per step and shared by ``has_overflow`` and
        ``scaled_global_norm``. See [Note: ZeRO-2 step statistics]. When the norm
        clips (``clips_as_stock``) the squared norms are instead the fp64 sums over
        stock's partitions, read from the partitions as stock reads them, in the
        same all_reduce (fp64). See [Note: stock clipping norm].
        """
        import deepspeed.comm as dist

        o = self.context.optimizer

        def build() -> torch.Tensor:
            rows = [stats for reducer in self.context.reducers for stats in reducer.shard_stats()]
            stacked = torch.stack(rows).to(self.context.comm_device).index_select(0, self._order)  # [G, 2]
            nonfinite = stacked[:, 1].sum().reshape(1)
            if self.clips_as_stock():  # fp64 sums of stock's partitions instead: see [Note: stock clipping norm]
                partitions = [p.flat_partition for p in self.window.partitions]
                sums = self.stock_norm().partial_sums(partitions, nonfinite.device)
                return torch.cat([sums, nonfinite.double()])
            return torch.cat([stacked[:, 0], nonfinite])

        def all_reduce(total: torch.Tensor) -> None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)

        return self.window.step_stats.reduced(build, all_reduce)

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        """Replaces ``has_overflow``: any inf/nan in any rank's partitions, from the unpack stats.

        Without usable stats it is stock's check. Under offload stock's reads ``local_overflow``,
        which its own per-parameter host copies set; flatgrad makes none, so the flag is first
        set from the host partitions themselves.
        """
        partitions = self.window.partitions
        if not self.usable() or partitions is None:
            if self.context.offload and partitions is not None:
                o = self.context.optimizer
                o.local_overflow = bool(o.local_overflow) or partitions_overflow([p.flat_partition for p in partitions])
            return self.stock_has_overflow(partition_gradients)
        return StepStats.overflow(self.reduced()[-1])

    def scaled_global_norm(self, norm_type: float = 2) -> torch.Tensor:
        """Replaces ``scaled_global_norm``: stock's gradient norm from the unpack stats, one all_reduce in all.

        Stock reads every partition again and reduces every param group's squared
        norm with its own all_reduce (and each MoE group's again over its expert
        group); with bucket-sized sub-groups that is one collective per sub-group
        per step. Here the per-sub-group sums come from the unpack's stats, in the
        same vector as the overflow count (see ``reduced``), then go through
        stock's masking and combination, so clipping and the overflow decision
        follow stock's rule. See [Note: ZeRO-2 step statistics].
        """
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import combine_grad_norm_groups, mask_nan_or_inf_with_val_inplace

        o = self.context.optimizer
        if norm_type != 2:
            raise ValueError(f"only the L2 gradient norm is supported, got norm_type={norm_type}")
        handed_over = self.window.partitions is not None
        if handed_over and self.clips_as_stock():
            norm = self.stock_norm().combine(self.reduced()[:-1], o.dp_process_group)
            return norm.to(self.context.norm_device)  # stock's device: [Note: step placement]
        if self.usable() and handed_over:
            total = self.reduced()[:-1].clone()
        else:
            total = self.squared_norms_from_partitions()
        total = total.pow(1.0 / 2.0)
        mask_nan_or_inf_with_val_inplace(total, device=total.device)
        if o.has_moe_layers:
            for pg, indices in self.moe_groups:
                scaled = total[indices] * 1.0 / dist.get_world_size(group=pg)
                dist.all_reduce(scaled, group=pg)
                total[indices] = scaled
        # Stock passes G group norms, which it stacks: the vector as one group is that stack, with no G views.
        return combine_grad_norm_groups([total], norm_type=2).to(self.context.norm_device)

    def clips_as_stock(self) -> bool:
        """Whether this step's norm clips and comes from ``StockNorm``: clipping on, no MoE, no model or
        pipeline parallelism (those keep their own paths), stats for the overflow count."""
        o = self.context.optimizer
        if o.clip_grad <= 0.0 or o.has_moe_layers or o.mpu is not None or o.model_parallel_group is not None:
            return False
        return not self._pipe_replicated and all(r.stats_available for r in self.context.reducers)

    def stock_norm(self) -> StockNorm:
        """Where stock's partitions lie in this rank's partitions: planned once, at the first clipped step."""
        import deepspeed.comm as dist

        if self._stock_norm is None:
            o = self.context.optimizer
            world_size = dist.get_world_size(group=o.dp_process_group)
            unsplit = o._flatgrad_unsplit
            if o.round_robin_gradients:  # stock's flat order then: DeepSpeed's own reorder of each group
                unsplit = [o._round_robin_reorder(params, world_size)[0] for params in unsplit]
            self._stock_norm = StockNorm(
                unsplit, o.round_robin_bit16_groups, self.context.layouts, dist.get_rank(group=o.dp_process_group),
                world_size, int(o.nccl_start_alignment_factor), host_root=self.context.offload,
            )  # fmt: skip
        return self._stock_norm

    def squared_norms_from_partitions(self) -> torch.Tensor:
        """Stock's per-group squared norms, read from the partitions (model or pipeline parallel runs)."""
        import deepspeed.comm as dist
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.utils import is_model_parallel_parameter

        o = self.context.optimizer
        groups = []
        for i in range(len(o.bit16_groups)):
            grads = (g for g in self.window.partitions[i] if not getattr(g, "_zero_padding", False))
            groups.append([
                g for g, p in zip(grads, o.params_in_partition[i])
                if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
                and (is_model_parallel_parameter(p) or o.model_parallel_rank == 0)
            ])  # fmt: skip
        total = group_squared_norms(groups, self.context.comm_device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)
        o._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        return total

    def metadata_bytes(self) -> int:
        """Bytes the statistics keep between steps: the stats order and, after a clipped step, ``StockNorm``'s plan."""
        stock_norm = self._stock_norm.metadata_bytes() if self._stock_norm is not None else 0
        return self._order.nbytes + stock_norm


def _stats_order(
    reducers: Sequence[Any], slots: Sequence[tuple[Any, int]], device: torch.device
) -> torch.Tensor:
    """Every sub-group's row in the reducers' stats stacked in reducer order, by sub-group index."""
    first, rows = {}, 0
    for reducer in reducers:
        first[id(reducer)] = rows
        rows += len(reducer.layouts)
    return torch.tensor([first[id(r)] + b for r, b in slots], dtype=torch.long, device=device)


def _moe_sub_groups(optimizer: Any, device: torch.device) -> list[tuple[Any, torch.Tensor]]:
    """MoE sub-groups by expert group, as ``(process group, sub-group indices on device)``."""
    o = optimizer
    moe: dict[int, tuple[Any, list[int]]] = {}
    for i, group in enumerate(o.optimizer.param_groups):
        if o.has_moe_layers and o.is_moe_param_group[i]:
            pg = o.real_dp_process_group[i]
            moe.setdefault(id(pg), (pg, []))[1].append(i)
    return [(pg, torch.tensor(indices, dtype=torch.long, device=device)) for pg, indices in moe.values()]


def group_squared_norms(groups: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Stock's squared norm of every group of gradient pieces, stacked on ``device``, where its all_reduce runs.

    Each piece's norm is taken where the piece lives (the host partitions under
    offload), in DeepSpeed's norm dtype; each group's sum moves to ``device``
    once. See [Note: step placement].
    """
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norm_dtype = get_norm_dtype()
    sums = []
    for grads in groups:
        if grads:
            norms = [torch.linalg.vector_norm(g.data.to(norm_dtype).detach(), ord=2.0) for g in grads]
            sums.append(torch.stack(norms).pow(2.0).sum().float().to(device))
        else:
            sums.append(torch.zeros((), dtype=torch.float32, device=device))
    return torch.stack(sums)


def partitions_overflow(partitions: Sequence[torch.Tensor]) -> bool:
    """Whether any of this rank's partitions holds an inf or a NaN (one host read per device)."""
    flags = [(~torch.isfinite(p)).any() for p in partitions if p.numel()]
    return bool(torch.stack([f.cpu() for f in flags]).any()) if flags else False
