"""The ZeRO-1/2 step: stock's update, its per-group loop merged over the sub-groups.

Over bucket-sized sub-groups stock's loop makes one optimizer call and one all_gather per
sub-group; merged, the step's calls do not grow with their number. See [Note: ZeRO-2 step] in
docs/design.md.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from .... import comm
from ..arenas import same_settings
from .context import Zero2Context
from .window import Zero2Window

__all__ = ["Zero2Step", "unscale_and_clip_"]


class Zero2Step:
    """The ZeRO-1/2 step: ``step`` and what it calls. See [Note: ZeRO-2 step].

    Args:
        context: the reduction's fixed facts.
        window: the window whose partitions ``step`` consumes and releases.
        stock_step: DeepSpeed's own ``step``, for a step with no hand-over to consume.
    """

    def __init__(self, context: Zero2Context, window: Zero2Window, stock_step: Callable[..., Any]):
        self.context = context
        self.window = window
        self.stock_step = stock_step
        self.bit16_params = [p for group in context.optimizer.bit16_groups for p in group]
        # On gloo the step's gather copies every chunk anyway: it takes this rank's bit16 partitions
        # straight from the master arena (one cast), instead of a copy per sub-group first.
        self.gather_from_arenas = context.arenas is not None and all(
            comm.backend_name(r.process_group, context.comm_device) == "gloo" for r in context.reducers
        )
        self._gather_plan: list[tuple[comm.AllGatherPlan, list[int]]] | None = None
        self._bit16_viewed = [False] * len(context.layouts)
        self._bit16_checks: tuple[list, list, list] | None = None
        self._bit16_copy_lists: tuple[list, list] | None = None

    def step(self, closure: Any = None) -> None:
        """Replaces ``step``: stock's update in one optimizer call for all sub-groups, then release the partitions.

        See [Note: ZeRO-2 step]. Without a hand-over to consume (a step with no
        backward) it is stock's step.
        """
        if not self.window.handed_over():
            if self.context.arenas is not None:
                self.context.arenas.unshare()
            result = self.stock_step(closure)
            self.window.release()
            return result
        try:
            self._step()
        finally:
            if self.window.partitions is not None:  # _step releases them before its all_gathers, unless it stops early
                self.window.release()
        return None

    def _step(self) -> None:
        """DeepSpeed 0.19's ZeRO-1/2 ``step()`` (CPU offload too; no Muon: refused), with its per-group loop merged."""
        from deepspeed.runtime.utils import is_invalid_grad_norm
        from deepspeed.runtime.zero.stage_1_and_2 import (
            INITIAL_MICRO_STEP_ID,
            OPTIMIZER_ALLGATHER_TIMER,
            OPTIMIZER_GRADIENTS_TIMER,
            OPTIMIZER_STEP_TIMER,
            OPTIMIZER_TIMERS,
        )

        c = self.context
        o = c.optimizer
        o.micro_step_id = INITIAL_MICRO_STEP_ID
        if not o.compute_grad_norm:
            o._global_grad_norm = None
        o.overflow = False
        if o.check_grad_overflow:
            o.check_overflow(partition_gradients=o.partition_gradients)
        norm = None
        if o.compute_grad_norm and not o.overflow:
            norm = o.scaled_global_norm()
            if (o.dtype != torch.bfloat16 or o.check_grad_overflow) and is_invalid_grad_norm(norm):
                o.overflow = True
        prev_scale = o.loss_scale
        o._update_scale(o.overflow)
        if o.overflow:
            if o.compute_grad_norm:
                o._global_grad_norm = float("inf")
            o.zero_grad(set_to_none=True)
            o._release_preflattened_grad_buffers()
            if c.offload:
                o.reset_cpu_buffers()  # stock's: the offload norms and overflow flag start again
            for k in o.averaged_gradients.keys():
                o.averaged_gradients[k] = None
                o.all_grad_tensors[k] = None
            for timer in OPTIMIZER_TIMERS:
                o.timers(timer).start()
                o.timers(timer).stop()
            return
        o._commit_muon_momentum()
        if norm is not None:
            o._global_grad_norm = norm / prev_scale

        o.timers(OPTIMIZER_GRADIENTS_TIMER).start()
        arenas = c.arenas if c.arenas is not None and c.arenas.usable() else None
        arena_grads = self._arena_grads() if arenas is not None else None
        grads = arena_grads if arena_grads is not None else self._sub_group_grads()
        unscale_and_clip_(grads, norm, o.clip_grad, o.loss_scale)
        o.timers(OPTIMIZER_GRADIENTS_TIMER).stop()

        o.timers(OPTIMIZER_STEP_TIMER).start()
        stepped = arena_grads is not None and arenas.step(arena_grads)
        if not stepped:
            if c.arenas is not None:  # a step past the arenas counts scalars per sub-group: [Note: optimizer arenas]
                c.arenas.unshare()
            if arena_grads is not None:
                for k, order in enumerate(arenas.orders):
                    for i, start, stop in zip(order, arenas.offsets[k], arenas.offsets[k][1:]):
                        o.single_partition_of_fp32_groups[i].grad = arena_grads[k].narrow(0, start, stop - start)
            self._optimizer_step_all()
        o._lazy_init_hp_params_optimizer_state()
        del grads, arena_grads  # the partitions go with the release below, as stock frees its gradients there
        if not stepped and not c.offload:  # the arenas set no .grad; offload keeps its host partitions there
            for part in o.single_partition_of_fp32_groups:
                part.grad = None
        if self.gather_from_arenas:  # the gather writes the bit16 partitions: see [Note: ZeRO-2 step]
            if not stepped:  # arenas.step() checked them already
                c.arenas.check_masters()
        else:
            self._copy_to_bit16()
        self.window.release()  # the partitions are consumed: free them before the all_gather, as stock frees its grads
        if c.offload:
            o.reset_cpu_buffers()  # stock's, after its offload update: the norms and the overflow flag start again
        o.timers(OPTIMIZER_STEP_TIMER).stop()

        o.timers(OPTIMIZER_ALLGATHER_TIMER).start()
        for k, gather in enumerate(self._gathers()):  # see [Note: ZeRO-2 step]
            if self.gather_from_arenas:
                with torch.no_grad():
                    gather(c.arenas.masters[k].to(o.bit16_groups_flat[c.arenas.orders[k][0]].dtype))
            else:
                gather()
        o.timers(OPTIMIZER_ALLGATHER_TIMER).stop()
        self._update_bit16_views()
        o.timers.log(OPTIMIZER_TIMERS)

    def metadata_bytes(self) -> int:
        """Bytes the step keeps between steps: the gather plans' copy tables (gloo)."""
        return sum(plan.table_bytes for plan, _ in self._gather_plan or ())

    def _sub_group_grads(self) -> list[torch.Tensor]:
        """Stock's per-group gradient hand-over: each sub-group's partition in fp32 as its master's ``.grad``."""
        o = self.context.optimizer
        grads = []
        for i in range(len(o.bit16_groups)):
            o.free_grad_in_param_list(o.params_not_in_partition[i])
            grad = self.window.partitions[i].flat_partition.view(-1).to(o.single_partition_of_fp32_groups[i].dtype)
            if grad.numel() != o.partition_size[i]:
                raise RuntimeError(
                    f"flatgrad: sub-group {i}'s partition has {grad.numel()} elements, not {o.partition_size[i]}"
                )
            o.single_partition_of_fp32_groups[i].grad = grad
            o.free_grad_in_param_list(o.params_in_partition[i])
            o._release_preflattened_grad_buffers(i)
            o.averaged_gradients[i] = None
            o.all_grad_tensors[i] = None
            grads.append(grad)
        return grads

    def _arena_grads(self) -> list[torch.Tensor] | None:
        """The hand-over for the arenas: each reducer's gradient arena in fp32, one cast for all its sub-groups.

        ``None`` when a reducer holds no arena (the partitions were not its shards).
        See [Note: optimizer arenas].
        """
        o = self.context.optimizer
        arenas = [r.shard_arena for r in self.context.reducers]
        if any(a is None for a in arenas):
            return None
        grads = []
        for arena, master in zip(arenas, self.context.arenas.masters):
            if arena.numel() != master.numel():
                raise RuntimeError(f"flatgrad: a gradient arena has {arena.numel()} elements, its master {master.numel()}")
            grads.append(arena.to(master.dtype))
        o.free_grad_in_param_list(self.bit16_params)
        # Every partition is flatgrad's (step() checked): none has DeepSpeed's preflattened buffers to release.
        o.averaged_gradients.update(dict.fromkeys(range(len(self.context.slots))))
        o.all_grad_tensors.update(dict.fromkeys(range(len(self.context.slots))))
        return grads

    def _update_bit16_views(self) -> None:
        """Stock's ``_update_model_bit16_weights`` for every sub-group whose params are not views of its flat.

        Stock points every param at its slice of the bit16 flat again after each
        all_gather: one Python loop over the params of every sub-group per step.
        The all_gather writes the flats in place, so after the first step that only
        repeats itself; it runs again for a sub-group whose flat or whose first or
        last param moved (a checkpoint load, a user's ``p.data = ...``).
        """
        o = self.context.optimizer
        checked = self._bit16_checks
        if (checked is not None and len(checked[0]) == len(o.bit16_groups_flat)
                and all(map(operator.is_, o.bit16_groups_flat, checked[0]))
                and list(map(torch.Tensor.data_ptr, checked[1])) == checked[2]):  # fmt: skip
            return  # the common case, checked at C speed: no flat replaced, no param moved
        ends = []
        for i, flat in enumerate(o.bit16_groups_flat):
            params, offsets = o.round_robin_bit16_groups[i], o.round_robin_bit16_offsets[i]
            base, size = flat.data_ptr(), flat.element_size()
            pairs = [(params[0], base + offsets[0] * size), (params[-1], base + offsets[-1] * size)]
            if any(p.data_ptr() != ptr for p, ptr in pairs) or not self._bit16_viewed[i]:
                o._update_model_bit16_weights(i)
                self._bit16_viewed[i] = True
            ends += pairs
        self._bit16_checks = (list(o.bit16_groups_flat), [p for p, _ in ends], [ptr for _, ptr in ends])

    @torch.no_grad()
    def _copy_to_bit16(self) -> None:
        """The updated fp32 partitions into this rank's bit16 partitions, as stock copies them.

        Under offload the masters are on the host: each is cast there into stock's own
        persistent bit16 host buffer (pinned with ``pin_memory``), which is then copied
        ``non_blocking`` to the device, as stock's offload step does: no pageable
        temporary and no blocking copy per sub-group.
        """
        bit16, masters = self._bit16_copies()
        if not self.context.offload:
            torch._foreach_copy_(bit16, masters)
            return
        staging = self.context.optimizer.param_buffer_of_bit16_for_cpu_offload_groups
        torch._foreach_copy_(staging, masters)
        torch._foreach_copy_(bit16, staging, non_blocking=True)

    def _bit16_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's bit16 partition of every sub-group and its fp32 master, listed once (again if a flat moved)."""
        o = self.context.optimizer
        cached = self._bit16_copy_lists
        flats = o.bit16_groups_flat
        if cached is None or len(cached[0]) != len(flats) or not all(map(operator.is_, flats, cached[0])):
            partitioned = o.parallel_partitioned_bit16_groups
            bit16 = [partitioned[i][reducer.rank] for i, (reducer, _) in enumerate(self.context.slots)]
            cached = self._bit16_copy_lists = (list(flats), bit16)
        return cached[1], o.single_partition_of_fp32_groups

    def _gathers(self) -> list[comm.AllGatherPlan]:
        """The step's all_gathers, one ``AllGatherPlan`` per reducer, planned once (again if a flat was replaced).

        NCCL coalesces with no copy: no bound. gloo stages the elements of a
        launch once, so a launch holds at most DeepSpeed's
        ``allgather_bucket_size`` elements, the bound DeepSpeed's own chunked
        all_gather keeps. See [Note: ZeRO-2 step].
        """
        o = self.context.optimizer
        flats = o.bit16_groups_flat
        if self._gather_plan is not None and all(
            all(map(operator.is_, map(flats.__getitem__, indices), plan.buffers)) for plan, indices in self._gather_plan
        ):
            return [plan for plan, _ in self._gather_plan]
        plans = []
        for reducer in self.context.reducers:
            indices = [i for i, (r, _) in enumerate(self.context.slots) if r is reducer]
            batch_numel = None
            if comm.backend_name(reducer.process_group, flats[indices[0]].device) != "nccl":
                batch_numel = max(1, int(o.allgather_bucket_size))
            plan = comm.AllGatherPlan([flats[i] for i in indices], group=reducer.process_group, batch_numel=batch_numel)
            plans.append((plan, indices))
        self._gather_plan = plans
        return [plan for plan, _ in plans]

    def _optimizer_step_all(self) -> None:
        """One ``optimizer.step()`` for every sub-group: sub-groups of equal hyperparameters become one group.

        Stock calls the optimizer once per param group; over bucket-sized sub-groups
        that is one call per sub-group, each a multi-tensor update of one tensor.
        Merging sub-groups of equal hyperparameters (those split from one param
        group, as long as a scheduler keeps them equal) makes one multi-tensor
        update over all their partitions; the state is per parameter, so the
        update is the same. What the optimizer writes back into a group's keys goes
        back to every sub-group of it.

        A merged group whose ``foreach`` is ``None`` (torch's "let me choose") runs
        with ``foreach=True``: torch picks the per-tensor loop for CPU tensors, which
        was sized for stock's one flat tensor per group and costs a Python loop per
        sub-group here; the multi-tensor kernels compute the same update (bitwise
        against stock, tested). A ``foreach`` the user set is left as it is.
        """
        o = self.context.optimizer
        groups = o.optimizer.param_groups
        merged: list[dict] = []
        members: list[list[dict]] = []
        last = -1  # the merged group the previous sub-group joined: sub-groups of one param group come in a row
        for group in groups:
            if last >= 0 and same_settings(group, members[last][-1]):
                k = last
            else:
                k = next((j for j, candidate in enumerate(merged) if same_settings(group, candidate)), -1)
            if k < 0:
                merged.append({**{key: v for key, v in group.items() if key != "params"}, "params": []})
                members.append([])
            merged[k]["params"].extend(group["params"])
            members[k].append(group)
            last = k if k >= 0 else len(merged) - 1
        chose = [g for g, subs in zip(merged, members) if len(subs) > 1 and "foreach" in g and g["foreach"] is None]
        for group in chose:
            group["foreach"] = True
        o.optimizer.param_groups = merged
        try:
            o.optimizer.step()
        finally:
            o.optimizer.param_groups = groups
            for group in chose:
                group["foreach"] = None
        for group, subs in zip(merged, members):
            for sub in subs:
                for k, v in group.items():
                    if k != "params":
                        sub[k] = v


def unscale_and_clip_(grads: list[torch.Tensor], norm: Any, clip_grad: float, loss_scale: float) -> None:
    """Stock's ``unscale_and_clip_grads`` with one multi-tensor multiply: the same scale, the same products.

    Stock computes one combined scale from the global norm and multiplies every
    group's gradient by it, one ``mul_`` per group (per sub-group here). The scale
    is computed where the norm is and multiplies the gradients where they are (the
    host partitions under offload): see [Note: step placement].
    """
    if (clip_grad == 0.0 and loss_scale == 1.0) or not grads:
        return
    combined_scale = loss_scale
    if clip_grad > 0.0:
        if not isinstance(norm, torch.Tensor):
            norm = torch.tensor(float(norm), dtype=torch.float)
        # Stock clips an invalid norm (non-finite, or DeepSpeed's -1) as an infinite one; a select, not a sync.
        clip_norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, float("inf")))
        clip = torch.clamp(((clip_norm / loss_scale) + 1e-6) / clip_grad, min=1.0)
        combined_scale = clip * loss_scale
    scale = 1.0 / combined_scale
    if isinstance(scale, torch.Tensor) and scale.device != grads[0].device:
        scale = scale.to(grads[0].device)
    torch._foreach_mul_(grads, scale)
