"""The accumulation window of ZeRO-1/2: the micro-steps whose gradients one ``step()`` consumes, the partitions handed
over to it, and their unpack statistics."""

from __future__ import annotations

import operator
from typing import Any

from ..step_stats import StepStats
from .context import Zero2Context
from .partitions import host_gradient, partition_views, view_plan

__all__ = ["Zero2Window"]


class Zero2Window:
    """One window's partitions, handed to DeepSpeed as ``averaged_gradients`` at the boundary (under CPU offload as
    the host gradients alone, as stock hands them) and released after the step.

    The per-piece views ``step()`` and the norm read are rebuilt per window from a
    plan made once. See [Note: ZeRO-2 memory] and [Note: ZeRO-2 seams].

    Attributes:
        partitions: every sub-group's ``GradPartitionBufferGroup`` of this window, from the hand-over until the
            release; else ``None``.
        step_stats: this window's reduced unpack statistics (see ``Zero2StepStats``).
        is_open: a micro-step added gradients that no hand-over has given DeepSpeed yet.
    """

    def __init__(self, context: Zero2Context):
        from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

        self.context = context
        o = context.optimizer
        self._buffer_group = GradPartitionBufferGroup
        self._view_plans = [
            view_plan(layout, context.slots[i][0].rank, o.round_robin_bit16_groups[i])
            for i, layout in enumerate(context.layouts)
        ]
        # Under offload, the host partitions the reducers deliver into, by sub-group (fixed at install).
        self._host_targets = (
            [host_gradient(o, i, layout) for i, layout in enumerate(context.layouts)] if context.offload else []
        )
        self.partitions: list[Any] | None = None
        self.step_stats = StepStats()
        self.is_open = False

    def open(self) -> None:
        """A micro-step adds gradients to this window.

        A new window starts with fresh partitions, unless step() has not consumed
        the last hand-over yet (several backwards at one boundary): then the
        reducers keep adding to them, as PyTorch accumulates ``.grad`` until step.
        ``release`` drops them.
        """
        self.is_open = True

    def hand_over(self) -> None:
        """Give DeepSpeed every sub-group's partition as ``averaged_gradients[i]`` (under CPU offload, the host
        gradients): see [Note: ZeRO-2 seams]."""
        c = self.context
        if c.offload:
            self._deliver_to_host()
        if self.partitions is None:
            self._view_shards()
        self.step_stats.forget()  # this hand-over's stats are reduced when step() first asks
        self.is_open = False

    def _view_shards(self) -> None:
        """The hand-over's partitions: views of the reducers' shards as step() expects, in ``averaged_gradients``."""
        c = self.context
        shards = {id(r): [gs.shard for gs in r.grad_shards()] for r in c.reducers}
        self.partitions = []
        for i, plan in enumerate(self._view_plans):
            reducer, b = c.slots[i]
            shard = shards[id(reducer)][b]
            self.partitions.append(self._buffer_group(partition_views(shard, plan), shard))
        if not c.offload:  # under CPU offload stock leaves them empty: its step reads the host gradients
            for i, partition in enumerate(self.partitions):
                c.optimizer.averaged_gradients[i] = partition

    def view_moved_shards(self) -> None:
        """The reducers' shards moved (``offload_states``): a hand-over views them where they are now."""
        if self.handed_over():
            self._view_shards()

    def _deliver_to_host(self) -> None:
        """Offload: every partition in its host gradient, and every host gradient the optimizer's again.

        A checkpoint load may give a master partition a new ``.grad``; the reduced
        gradient is in the tensor the reducers were given, so that one is put back.
        """
        for r in self.context.reducers:
            r.deliver()
            r.final_micro_step = False
        for master, target in zip(self.context.optimizer.single_partition_of_fp32_groups, self._host_targets):
            if master.grad is not target:
                master.grad = target

    def handed_over(self) -> bool:
        """Whether DeepSpeed's ``averaged_gradients`` still hold this window's partitions, every one (under CPU
        offload, where they are not published there: whether the window has them)."""
        if self.partitions is None or self.context.offload:
            return self.partitions is not None
        held = map(self.context.optimizer.averaged_gradients.get, range(len(self.partitions)))
        return all(map(operator.is_, held, self.partitions))

    def release(self) -> None:
        """Drop this window's partitions (step() has consumed them, or skipped the step)."""
        averaged = self.context.optimizer.averaged_gradients
        if self.partitions is not None:
            for i, partition in enumerate(self.partitions):
                if averaged.get(i) is partition:
                    averaged[i] = None
        self.partitions = None
        self.step_stats.reset()
        for r in self.context.reducers:
            r.zero_grad()

    def metadata_bytes(self) -> int:
        """Bytes of this window's reduced statistics (none between windows)."""
        return self.step_stats.nbytes
