"""The ZeRO-1/2 step's gradient norm and overflow check, from the unpack's stats.

[Note: ZeRO-2 step statistics]
Before its update, stock's ``step()`` reads every partition twice more: once
for the overflow check (an inf/nan test per piece, then an all_reduce) and
once for the gradient norm (a norm per piece, then an all_reduce per param
group, and one per MoE group). flatgrad's unpack already computes, in the
pass that writes a partition, the sum of squares and the non-finite count of
what it wrote; the last unpack of a window writes the accumulated partition,
so its stats are exactly what both checks need. ``has_overflow`` and
``scaled_global_norm`` are replaced to use them: one all_reduce of
``sub-groups + 1`` floats over the data-parallel group serves both, and MoE
groups are then averaged over their expert group as stock does. Summation
order differs from stock's per-piece norms (within fp32 rounding), so a norm
that clips is stock's instead: read from the partitions per piece of stock's
partitions, in the same one all_reduce (see [Note: stock clipping norm] in
``stock_norm.py``; MoE runs keep the stats). With model
or pipeline parallelism, where stock filters pieces by rank, the norm is read
from the partitions as stock does; so it is in a window where a gradient was
written through DeepSpeed's API after its unpack (``safe_set_full_grad`` ends
in ``update_offload_overflow_tracker`` for params linked by ``_zero_optimizer``,
which ``install`` links and wraps to say so). A write
straight into the partitions, behind DeepSpeed's API, is not seen.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..step_stats import StepStats
from .stock_norm import StockNorm

__all__ = ["Zero2StepStats", "group_squared_norms", "partitions_overflow"]


class Zero2StepStats:
    """The norm and overflow half of ``Zero2Reduction``. See [Note: ZeRO-2 step statistics]."""

    def _grad_edited(self, grad: Any) -> None:
        """Wraps ``update_offload_overflow_tracker``, which DeepSpeed's ``safe_set_full_grad`` calls after writing.

        DeepSpeed calls it for params linked to the optimizer by ``_zero_optimizer``,
        which it sets under offload only; ``install`` links every param. A gradient
        written into a partition after its unpack is not in the unpack's stats: this
        window's step reads the partitions, as stock does.
        """
        self._window.mark_stale()
        self._stock_update_overflow_tracker(grad)

    def _stats_usable(self) -> bool:
        """Whether the unpack stats give stock's norm: no model parallelism, no pipe-replicated params, no
        gradient edited through DeepSpeed's API since the unpack."""
        o = self.optimizer
        if self._window.stale:
            return False
        if o.mpu is not None or o.model_parallel_group is not None:
            return False
        if not all(r.stats_available for r in self.reducers):
            return False  # a reducer made without collect_stats (every reduction mode's unpack computes them)
        return not self._pipe_replicated  # read once at install: pipeline modules mark tied weights when built

    def _reduced_stats(self) -> torch.Tensor:
        """Per sub-group squared norm, then the non-finite count, summed over the ranks: one all_reduce.

        The values come from the last unpack of every sub-group (the accumulated
        partition as written, see ``BucketReducer.shard_stats``), so no partition is
        read again; computed once per step and shared by ``has_overflow`` and
        ``scaled_global_norm``. See [Note: ZeRO-2 step statistics]. When the norm
        clips (``_clips_as_stock``) the squared norms are instead the fp64 sums over
        stock's partitions, read from the partitions as stock reads them, in the
        same all_reduce (fp64). See [Note: stock clipping norm].
        """
        import deepspeed.comm as dist

        o = self.optimizer

        def build() -> torch.Tensor:
            rows = [stats for reducer in self.reducers for stats in reducer.shard_stats()]
            stacked = torch.stack(rows).to(self.comm_device).index_select(0, self._stats_order)  # [G, 2]
            nonfinite = stacked[:, 1].sum().reshape(1)
            if self._clips_as_stock():  # fp64 sums of stock's partitions instead: see [Note: stock clipping norm]
                partitions = [p.flat_partition for p in self.partitions]
                sums = self._stock_norm_plan().partial_sums(partitions, nonfinite.device)
                return torch.cat([sums, nonfinite.double()])
            return torch.cat([stacked[:, 0], nonfinite])

        def all_reduce(total: torch.Tensor) -> None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)

        return self._window.reduced(build, all_reduce)

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        """Replaces ``has_overflow``: any inf/nan in any rank's partitions, from the unpack stats.

        Without usable stats it is stock's check. Under offload stock's reads ``local_overflow``,
        which its own per-parameter host copies set; flatgrad makes none, so the flag is first
        set from the host partitions themselves.
        """
        if not self._stats_usable() or self.partitions is None:
            if self.offload and self.partitions is not None:
                o = self.optimizer
                o.local_overflow = bool(o.local_overflow) or partitions_overflow([p.flat_partition for p in self.partitions])
            return self._stock_has_overflow(partition_gradients)
        return StepStats.overflow(self._reduced_stats()[-1])

    def scaled_global_norm(self, norm_type: float = 2) -> torch.Tensor:
        """Replaces ``scaled_global_norm``: stock's gradient norm from the unpack stats, one all_reduce in all.

        Stock reads every partition again and reduces every param group's squared
        norm with its own all_reduce (and each MoE group's again over its expert
        group); with bucket-sized sub-groups that is one collective per sub-group
        per step. Here the per-sub-group sums come from the unpack's stats, in the
        same vector as the overflow count (see ``_reduced_stats``), then go through
        stock's masking and combination, so clipping and the overflow decision
        follow stock's rule. See [Note: ZeRO-2 step statistics].
        """
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import combine_grad_norm_groups, mask_nan_or_inf_with_val_inplace

        o = self.optimizer
        if norm_type != 2:
            raise ValueError(f"only the L2 gradient norm is supported, got norm_type={norm_type}")
        if self.partitions is not None and self._clips_as_stock():
            norm = self._stock_norm_plan().combine(self._reduced_stats()[:-1], o.dp_process_group)
            return norm.to(self.norm_device)  # stock's device: [Note: step placement]
        if self._stats_usable() and self.partitions is not None:
            total = self._reduced_stats()[:-1].clone()
        else:
            total = self._squared_norms_from_partitions()
        total = total.pow(1.0 / 2.0)
        mask_nan_or_inf_with_val_inplace(total, device=total.device)
        if o.has_moe_layers:
            for pg, indices in self._moe_groups:
                scaled = total[indices] * 1.0 / dist.get_world_size(group=pg)
                dist.all_reduce(scaled, group=pg)
                total[indices] = scaled
        # Stock passes G group norms, which it stacks: the vector as one group is that stack, with no G views.
        return combine_grad_norm_groups([total], norm_type=2).to(self.norm_device)

    def _clips_as_stock(self) -> bool:
        """Whether this step's norm clips and comes from ``StockNorm``: clipping on, no MoE, no model or
        pipeline parallelism (those keep their own paths), stats for the overflow count."""
        o = self.optimizer
        if o.clip_grad <= 0.0 or o.has_moe_layers or o.mpu is not None or o.model_parallel_group is not None:
            return False
        return not self._pipe_replicated and all(r.stats_available for r in self.reducers)

    def _stock_norm_plan(self) -> StockNorm:
        """Where stock's partitions lie in this rank's partitions: planned once, at the first clipped step."""
        import deepspeed.comm as dist

        if self._stock_norm is None:
            o = self.optimizer
            world_size = dist.get_world_size(group=o.dp_process_group)
            unsplit = o._flatgrad_unsplit
            if o.round_robin_gradients:  # stock's flat order then: DeepSpeed's own reorder of each group
                unsplit = [o._round_robin_reorder(params, world_size)[0] for params in unsplit]
            self._stock_norm = StockNorm(
                unsplit, o.round_robin_bit16_groups, self.layouts, dist.get_rank(group=o.dp_process_group),
                world_size, int(o.nccl_start_alignment_factor), host_root=self.offload,
            )  # fmt: skip
        return self._stock_norm

    def _squared_norms_from_partitions(self) -> torch.Tensor:
        """Stock's per-group squared norms, read from the partitions (model or pipeline parallel runs)."""
        import deepspeed.comm as dist
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.utils import is_model_parallel_parameter

        o = self.optimizer
        groups = []
        for i in range(len(o.bit16_groups)):
            grads = (g for g in o.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
            groups.append([
                g for g, p in zip(grads, o.params_in_partition[i])
                if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
                and (is_model_parallel_parameter(p) or o.model_parallel_rank == 0)
            ])  # fmt: skip
        total = group_squared_norms(groups, self.comm_device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)
        o._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        return total


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
