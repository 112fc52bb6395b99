"""ZeRO-3 optimizer offload: the reduced segments' way to the host grad partitions, and the boundary's fp32 copies.

One transfer per bucket (the unpack writes the host partitions directly, or one asynchronous copy into one of two
pinned staging buffers, unpacked once it landed), and at the boundary stock's per-parameter norms and one host copy
per contiguous run into the fp32 gradients. See [Note: ZeRO-3 optimizer offload] in docs/design.md.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from .composition import Composition

__all__ = ["Staged", "Zero3Offload"]


class _OffloadRuns(NamedTuple):
    """Where one composition's partitions go at the boundary: see [Note: ZeRO-3 optimizer offload]."""

    stamp: tuple  # the data pointers the runs were computed against
    param_ids: tuple[int, ...]  # DeepSpeed's ``get_param_id`` of every piece, for ``norm_for_param_grads``
    runs: tuple[tuple[int, int, int, int], ...]  # (sub-group, offset in its fp32 grad, offset in the flat buffer, n)


class Staged(NamedTuple):
    """A staged segment whose copy has landed: what its host-side unpack needs."""

    comp: Composition
    segment: torch.Tensor  # the view of the staging buffer holding the reduced segment
    micro_step: int
    boundary: bool


class Zero3Offload:
    """The host side of one ZeRO-3 optimizer's offload: staging buffers, staged queue, boundary copies.

    Attributes:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` it serves.
        enabled: whether the optimizer offloads to the CPU (``offload_optimizer``).
        host_transfers: reduced segments moved to the host, per process (one per bucket with data here per
            micro-step); tests and benches read it.
        fp32_copies: the boundary's host copies into the fp32 gradients, per process.
        always_stage: stage the segment through the pinned buffers even where it already is in host memory (the
            CPU accelerator), so that tests and benches run and measure the accelerator's path on a host.
    """

    def __init__(self, optimizer: Any, accelerator: Any, dist: Any) -> None:
        self.optimizer = optimizer
        self.enabled = bool(optimizer.offload_optimizer)
        self._accelerator = accelerator
        self._dist = dist
        self._runs: dict[tuple, _OffloadRuns] = {}
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staged: deque = deque()  # (event, slot, comp, staged, micro_step, boundary), oldest first
        self._next_slot = 0
        self.host_transfers = 0
        self.fp32_copies = 0
        self.always_stage = False

    # -- the transfer ------------------------------------------------------------------------------------

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

    def allocate_staging(self, nbytes: int) -> None:
        """The two pinned staging buffers of the staged transfer, ``nbytes`` each (the largest ``received``)."""
        self._staging = [self._accelerator.pin_memory(torch.empty(nbytes, dtype=torch.uint8)) for _ in range(2)]

    def stages(self, segment: torch.Tensor, partitions_device: torch.device) -> bool:
        """Whether ``segment`` goes through a staging buffer, rather than unpacked straight into the partitions."""
        return segment.device != partitions_device or (self.enabled and self.always_stage)

    def count_direct_transfer(self) -> None:
        """Under offload, an unpack straight into the host partitions is the segment's one transfer."""
        if self.enabled:
            self.host_transfers += 1

    def claim_slot(self) -> int:
        """The staging buffer the next segment takes (they alternate); its previous segment must be drained first."""
        slot = self._next_slot
        self._next_slot = 1 - slot
        return slot

    def stage(self, slot: int, comp: Composition, segment: torch.Tensor, micro_step: int, boundary: bool) -> None:
        """One asynchronous copy of ``segment`` (what arrived: a reduced segment, the sources, or wire bytes) into
        staging buffer ``slot``, queued until its event completes."""
        nbytes = segment.numel() * segment.element_size()
        buffer = self._staging[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._staging[slot] = self._accelerator.pin_memory(torch.empty(nbytes, dtype=torch.uint8))
        staged = buffer.narrow(0, 0, nbytes).view(segment.dtype)
        staged.copy_(segment, non_blocking=True)
        self.host_transfers += 1
        event_type = self._accelerator.Event  # None on the CPU accelerator, where the copy has landed
        event = event_type() if event_type is not None else None
        if event is not None:
            event.record()
        self._staged.append((event, slot, comp, staged, micro_step, boundary))

    def landed(self, *, slot: int | None = None, everything: bool = False) -> Iterator[Staged]:
        """The staged segments whose copies have landed, oldest first, each taken off the queue before it is
        yielded; waits for ``slot``'s copy (and stops after it), or for every copy."""
        while self._staged:
            event, occupant, comp, staged, micro_step, boundary = self._staged[0]
            if event is not None:  # None: the copy was synchronous
                if everything or occupant == slot:
                    event.synchronize()
                elif not event.query():
                    return
            self._staged.popleft()
            yield Staged(comp, staged, micro_step, boundary)
            if occupant == slot and not everything:
                return

    # -- the boundary --------------------------------------------------------------------------------------

    def _offload_runs(self, comp: Composition, outs: Sequence[torch.Tensor]) -> _OffloadRuns:
        """The boundary's copies for ``comp``: runs contiguous in both the flat grad buffer and an fp32 gradient."""
        opt = self.optimizer
        flat = opt.grad_partitions_flat_buffer
        groups = opt.fp32_partitioned_groups_flat
        stamp = (flat.data_ptr(), tuple(g.grad.data_ptr() if g.grad is not None else 0 for g in groups))
        key = (comp.comm_dtype, comp.ds_ids)
        cached = self._runs.get(key)
        if cached is not None and cached.stamp == stamp:
            return cached
        param_ids, runs = [], []
        gap = 0  # the previous piece's padding: zero in both buffers, so a run may span it
        for param, length, out in zip(comp.piece_params, comp.lengths, outs):
            param_id = opt.get_param_id(param)
            param_ids.append(param_id)
            group, dest, _ = opt.grad_position[param_id]
            src = out.storage_offset() - flat.storage_offset()  # ``out`` starts where the partition does
            if runs and runs[-1][0] == group and dest == runs[-1][1] + runs[-1][3] + gap \
                    and src == runs[-1][2] + runs[-1][3] + gap:
                g, d, s, n = runs[-1]
                runs[-1] = (g, d, s, n + gap + length)
            else:
                runs.append((group, dest, src, length))
            gap = param.partition_numel() - length
        cached = self._runs[key] = _OffloadRuns(stamp, tuple(param_ids), tuple(runs))
        return cached

    def to_fp32_grads(self, comp: Composition, outs: Sequence[torch.Tensor]) -> None:
        """At the boundary: stock's per-parameter norms of ``outs`` (``comp``'s grad partitions), then the
        partitions into the host fp32 gradients."""
        opt = self.optimizer
        plan = self._offload_runs(comp, outs)
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
