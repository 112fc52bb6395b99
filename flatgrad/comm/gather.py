"""The parameters' all_gather after a ZeRO-1/2 step: many flat buffers gathered in place, in few launches.

Only the ZeRO-1/2 step takes this path (an ``AllGatherPlan``, made once and
called every step); the gradients' collectives are in ``scatter.py``. On NCCL a
batch of buffers is one coalesced launch. gloo's own coalesced form stages more
than the gathered bytes and copies one buffer at a time, so on gloo the gather
is done by hand: one message to every peer, and one planned copy per rank into
the buffers. See [Note: coalesced all_gather] in docs/design.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..kernels import DTYPES, UnpackPlan, resolve_backend
from ..layout import Layout
from .backend import backend_name

__all__ = [
    "AllGatherPlan",
    "ChunkScatter",
    "all_gather_in_place",
    "all_gather_into_tensor_coalesced",
    "chunk_scatter",
    "gather_batches",
]


def gather_batches(numels: Sequence[int], batch_numel: int | None) -> list[list[int]]:
    """The buffers (by index) of each coalesced all_gather an ``AllGatherPlan`` launches.

    First fit, largest first, into groups of at most ``batch_numel`` elements (a
    buffer larger than that goes alone): few groups, the same on every rank.
    ``None``: one group. Each group lists its buffers in index order.
    """
    if batch_numel is None:
        return [list(range(len(numels)))] if len(numels) else []
    batches: list[list[int]] = []
    filled: list[int] = []
    for k in sorted(range(len(numels)), key=lambda k: -numels[k]):
        n = numels[k]
        for j, f in enumerate(filled):
            if f + n <= batch_numel:
                batches[j].append(k)
                filled[j] += n
                break
        else:
            batches.append([k])
            filled.append(n)
    return [sorted(batch) for batch in batches]


class AllGatherPlan:
    """In-place all_gathers of a fixed set of flat buffers: validated and batched once, then launched per call.

    Each buffer is ``W`` equal chunks and this rank's chunk is its input: what a
    ZeRO step does with every param group's bit16 buffer after the update. The
    buffers of a batch go out as one launch (``all_gather_into_tensor_coalesced``,
    see [Note: coalesced all_gather]): on NCCL one coalesced group with no
    copies; on gloo one combined gather that stages the batch's bytes once, as
    one ``all_gather_into_tensor`` of a buffer stages that buffer's bytes on
    gloo. ``batch_numel`` bounds the elements of one launch, and so gloo's
    staging: buffers are placed first fit, largest first (``gather_batches``),
    so the launches are few and the same on every rank; a buffer larger than
    the bound goes alone. ``None``: one launch.

    The plan holds views of the buffers (this rank's chunks); ``buffers`` says
    which tensors it gathers, so a caller can tell when they were replaced.
    Buffers must be 1-D, of one dtype and device, with numels divisible by ``W``.
    A call may take this rank's chunks from elsewhere (``source``).
    """

    def __init__(
        self, buffers: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None, batch_numel: int | None = None
    ) -> None:
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if batch_numel is not None and (isinstance(batch_numel, bool) or not isinstance(batch_numel, int) or batch_numel < 1):
            raise ValueError(f"batch_numel must be a positive int or None, got {batch_numel!r}")
        for k, b in enumerate(buffers):
            if b.dim() != 1 or b.numel() % world_size:
                raise ValueError(f"buffers[{k}] must be 1-D with a multiple of {world_size} elements, got {tuple(b.shape)}")
            if b.dtype != buffers[0].dtype or b.device != buffers[0].device:
                raise ValueError(
                    f"buffers[{k}] is {b.dtype} on {b.device}; buffers[0] is {buffers[0].dtype} on {buffers[0].device}"
                )
        self.group = group
        self.buffers: tuple[torch.Tensor, ...] = tuple(buffers)
        batches = gather_batches([b.numel() for b in buffers], batch_numel) if world_size > 1 else []
        # Per batch: its buffers, and every buffer's chunk of every rank (this rank's are the inputs).
        self._batches = [
            ([buffers[k] for k in batch], [[buffers[k].view(world_size, -1)[r] for k in batch] for r in range(world_size)])
            for batch in batches
        ]
        self._rank = rank
        # gloo copies every chunk out of the combined messages: one planned kernel per rank and batch.
        self._scatters = [None] * len(self._batches)
        if self._batches and backend_name(group, buffers[0].device) == "gloo":
            self._scatters = [[chunk_scatter(chunks[r]) for r in range(world_size)] for _, chunks in self._batches]
        # One rank: nothing to send, and a ``source`` is copied into the buffers themselves.
        self._one_rank_scatter = chunk_scatter(self.buffers) if world_size == 1 else None
        # Where each buffer's chunk lies in a ``source`` (buffer order), and per batch its slice of it
        # when the batch's buffers follow each other there (else the call concatenates them).
        starts = [0]
        for b in buffers:
            starts.append(starts[-1] + b.numel() // world_size)
        self.source_numel = starts[-1]
        self._source_pieces = [
            ([(starts[k], starts[k + 1] - starts[k]) for k in batch],
             (starts[batch[0]], starts[batch[-1] + 1] - starts[batch[0]]) if batch == list(range(batch[0], batch[-1] + 1)) else None)
            for batch in batches
        ]  # fmt: skip

    def __len__(self) -> int:
        """The launches one call makes (one per batch)."""
        return len(self._batches)

    @property
    def table_bytes(self) -> int:
        """Bytes of the planned copy tables the plan keeps (gloo and one rank; NCCL keeps none)."""
        scatters = [s for batch in self._scatters if batch for s in batch] + [self._one_rank_scatter]
        return sum(s.table_bytes for s in scatters if s is not None)

    def __call__(self, source: torch.Tensor | None = None) -> int:
        """Gather every buffer in place; returns the number of launches.

        ``source``: this rank's chunks of every buffer, concatenated in buffer order
        (``source_numel`` elements, the buffers' dtype), written to the buffers by the
        gather itself; the buffers' own chunks are not read then. A ZeRO step that
        has its updated partitions in one tensor saves a pass over them on gloo,
        whose gather copies every chunk anyway. ``None``: the buffers hold them.
        """
        group, rank = self.group, self._rank
        if source is not None and (
            source.dim() != 1 or source.numel() != self.source_numel or (self.buffers and source.dtype != self.buffers[0].dtype)
        ):
            raise ValueError(
                f"source must be 1-D with {self.source_numel} elements of the buffers' dtype, "
                f"got {tuple(source.shape)} {source.dtype}"
            )
        # The package's name, looked up per call: a recorder that wraps it counts the plan's launches.
        from . import all_gather_into_tensor_coalesced as gather

        for (outputs, chunks), (pieces, whole), scatters in zip(self._batches, self._source_pieces, self._scatters):
            packed = None
            if source is not None:
                packed = source.narrow(0, *whole) if whole else torch.cat([source.narrow(0, *p) for p in pieces])
            gather(
                outputs, chunks[rank], group=group, chunks=chunks, packed=packed, scatters=scatters
            )
        if source is not None and self._one_rank_scatter is not None:
            self._one_rank_scatter(source)
        return len(self._batches)


def all_gather_into_tensor_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    chunks: Sequence[Sequence[torch.Tensor]] | None = None,
    packed: torch.Tensor | None = None,
    scatters: Sequence[Callable[[torch.Tensor], None]] | None = None,
) -> None:
    """``all_gather_into_tensor(outputs[k], inputs[k])`` for every ``k`` as one launch, then wait.

    See [Note: coalesced all_gather]. Callers validate shapes (``AllGatherPlan``
    does, once): every ``outputs[k]`` is 1-D, ``W`` times ``inputs[k]``.
    ``chunks[r][k]``, if given, is ``outputs[k]``'s chunk of group rank ``r``
    (a caller that gathers the same buffers every step makes these views once).
    ``packed``, if given, holds what the inputs would, concatenated, and is read
    instead of them (they may be stale: with in-place inputs, the gather writes them).
    ``scatters[r]``, if given, is ``chunk_scatter(chunks[r])``, made once (gloo only; else unplanned copies).
    """
    if backend_name(group, outputs[0].device) == "gloo":
        _all_gather_point_to_point(outputs, inputs, group, chunks, packed, scatters)
        return
    if packed is not None:
        inputs = packed.split([t.numel() for t in inputs])
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    pg.allgather_into_tensor_coalesced(list(outputs), list(inputs)).wait()


_GATHER_TAG = 0x6667  # the point-to-point messages of one combined all_gather; nothing else is in flight then


def chunk_scatter(chunks: Sequence[torch.Tensor], *, planned: bool = True) -> ChunkScatter:
    """A ``ChunkScatter`` that copies a flat tensor, the concatenation of ``chunks``, into ``chunks``.

    ``planned`` (for one made once and called every step), with fp32/bf16/fp16 and
    flatgrad's compiled kernels: one ``UnpackPlan`` call (one C loop over the chunks,
    no view made per call; its table is uploaded once and cached). Otherwise views
    of the flat and one ``_foreach_copy_``, which on CPU is one ATen copy per chunk:
    what a one-off copy uses, so that it plans and caches nothing.
    """
    chunks = [c for c in chunks if c.numel() > 0]
    sizes = [c.numel() for c in chunks]
    if not chunks:
        return ChunkScatter(lambda flat: None, 0)
    if planned and chunks[0].dtype in DTYPES and resolve_backend(None, chunks[0].device).name in ("cpu", "cuda"):
        plan = UnpackPlan(Layout.flat(sizes, 1, 1), 0, chunks)
        return ChunkScatter(lambda flat: plan(flat, chunks), plan.table_bytes)
    return ChunkScatter(lambda flat: torch._foreach_copy_(chunks, list(flat.split(sizes))), 0)


class ChunkScatter:
    """What ``chunk_scatter`` makes: ``scatter(flat)`` copies; ``table_bytes`` is its planned table (metadata)."""

    __slots__ = ("_copy", "table_bytes")

    def __init__(self, copy: Callable[[torch.Tensor], None], table_bytes: int) -> None:
        self._copy = copy
        self.table_bytes = table_bytes

    def __call__(self, flat: torch.Tensor) -> None:
        self._copy(flat)


def _all_gather_point_to_point(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    chunks: Sequence[Sequence[torch.Tensor]] | None,
    packed: torch.Tensor | None,
    scatters: Sequence[Callable[[torch.Tensor], None]] | None,
) -> None:
    """gloo: this rank's chunks as one message to every other rank, then every rank's chunks copied in place."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if chunks is None:
        chunks = [[output.view(world_size, -1)[r] for output in outputs] for r in range(world_size)]
    if scatters is None:  # a one-off gather: no plan made and cached for it
        scatters = [chunk_scatter(c, planned=False) for c in chunks]
    mine = packed if packed is not None else torch.cat(list(inputs))
    n = mine.numel()
    peers = [r for r in range(world_size) if r != rank]
    received = torch.empty(len(peers) * n, dtype=mine.dtype, device=mine.device)
    works = []
    for j, r in enumerate(peers):
        peer = r if group is None else dist.get_global_rank(group, r)
        works.append(dist.isend(mine, dst=peer, group=group, tag=_GATHER_TAG))
        works.append(dist.irecv(received[j * n : (j + 1) * n], src=peer, group=group, tag=_GATHER_TAG))
    for work in works:
        work.wait()
    # This rank's chunks too, unless every input already lies in its chunk (an ``AllGatherPlan`` passes the chunks).
    if packed is not None or (
        inputs is not chunks[rank] and any(t.data_ptr() != s.data_ptr() for t, s in zip(chunks[rank], inputs))
    ):
        scatters[rank](mine)
    for j, r in enumerate(peers):
        scatters[r](received[j * n : (j + 1) * n])


def all_gather_in_place(
    buffers: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None, batch_numel: int | None = None
) -> int:
    """All-gather many flat buffers in place, once: ``AllGatherPlan(buffers, ...)()``.

    Returns the number of coalesced groups launched. A caller that gathers the
    same buffers every step keeps the plan instead.
    """
    return AllGatherPlan(buffers, group=group, batch_numel=batch_numel)()
