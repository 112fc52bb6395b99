"""One reduce_scatter per bucket over ``torch.distributed``: method choice, averaging, async handles.

Module-level functions; the process group is always passed in explicitly (``None``
means the default group). Streams are the caller's: a collective is issued on the
current stream, and the caller waits on its ``Work`` where it needs the result.

[Note: reduce_scatter method]
Two spellings of one reduce_scatter exist in ``torch.distributed``:

* ``"tensor"``: ``reduce_scatter_single`` (named ``reduce_scatter_tensor`` before
  torch 2.13) over the flat ``W * S`` input. NCCL implements it natively and in one
  kernel, so it is the choice on NCCL and on every backend other than gloo.
* ``"list"``: ``reduce_scatter(output, list(input.chunk(W)))``. On gloo the tensor
  form is emulated by an all_reduce of the whole input plus a chunk copy
  (pytorch#118911), while the list form is gloo's own reduce_scatter. Measured on
  CPU, 8M fp32 elements, time as a multiple of one ``all_reduce`` of the same buffer:

  =================================  =======  =======
  call                               2 ranks  4 ranks
  =================================  =======  =======
  tensor form (all_reduce + chunk)   1.93x    1.65x
  list form (gloo reduce_scatter)    1.44x    1.19x
  =================================  =======  =======

  so ``"auto"`` picks the list form on gloo. Both forms are one collective call.
  ``python bench/reducer_step.py`` re-measures both against ``all_reduce`` on one
  bucket (its last table); on a loaded 2-core machine the figures scatter widely
  from run to run. On gloo both forms also copy on the calling thread when issued
  (about 4 ms per 8M fp32 elements, measured here), while an async ``all_reduce``
  returns at once.

[Note: averaging]
``ReduceOp.AVG`` is used where the backend has it for the dtype (NCCL >= 2.10;
gloo since torch 2.8, pytorch#149781, as a sum then a division), for fp32 and bf16
only. Otherwise the ``1/W`` is folded into the scales the fused kernels apply
anyway, so averaging never costs a pass of its own:

* fp32 / bf16: a post-scale of ``1/W`` in the fp32 unpack (less data than the
  packed buffer, and one rounding, in fp32).
* fp16: a pre-scale of ``1/p`` with ``p`` the power of two nearest ``sqrt(W)``
  (exact in fp16) keeps the sum in range, and a post-scale of ``p/W`` in the
  fp32 unpack does the rest.
* world size 1: nothing (NCCL's AVG is not trusted there, and there is nothing to divide).

[Note: coalesced all_gather]
``all_gather_into_tensor_coalesced`` gathers many buffers as one launch. NCCL
(and any backend but gloo): the backend's ``allgather_into_tensor_coalesced``,
what ``_coalescing_manager`` issues for a group of ``all_gather_into_tensor``
calls, in one call from Python instead of one wrapped call per tensor (about
20 us each here). gloo's coalesced allgather concatenates the inputs, gathers
into a flat buffer of its own and copies every chunk out one ATen call at a
time: (1 + 1/W) times the gathered bytes of staging and about 30 us per
buffer, so a step with 100 sub-groups spent more in it than in the optimizer.
On gloo the gather is therefore one all_gather over a combined buffer, done
by hand: this rank's chunks concatenated into one message, sent to every
other rank with ``isend`` (gloo sends and receives in place, with no staging
of its own), the other ranks' messages received into one buffer, and each
message's chunks copied to their places by one planned kernel call
(``chunk_scatter``: flatgrad's unpack over a one-rank layout, whose table of
chunk addresses an ``AllGatherPlan`` makes once; ``_foreach_copy_`` is one
ATen copy per chunk on CPU, about 3 us each). Staging: the gathered
bytes once (stock's one call per param group stages its group's flat, the
same bytes), and time flat in the number of buffers (``bench/step_sweep.py``;
measured by hand at 2 ranks, 1.6M fp32 elements: 5.1 / 4.9 / 9.2 ms at 1 / 100 /
400 buffers against 5.4 / 7.8 / 17.3 ms for gloo's coalesced form).

[Note: collectives seam]
The gradient collectives (both reduce_scatter forms and the all_to_all of the
reduction modes) are issued through a ``Collectives``: ``torch.distributed``'s
functions by default, looked up at call time. A framework that has its own
communication layer passes its own: under DeepSpeed they are
``deepspeed.comm``'s (``reduce_scatter_fn``, ``reduce_scatter``,
``all_to_all_single``), so DeepSpeed's comms logger and profiler, and anything
that wraps ``deepspeed.comm``, see flatgrad's collectives as they see stock's.
Each is still one call to the same ``torch.distributed`` collective.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "AllGatherPlan",
    "Averaging",
    "ChunkScatter",
    "Collectives",
    "METHODS",
    "TORCH_COLLECTIVES",
    "all_gather_in_place",
    "all_gather_into_tensor_coalesced",
    "all_to_all",
    "averaging",
    "avg_supported",
    "backend_name",
    "chunk_scatter",
    "reduce_scatter",
    "resolve_method",
]

METHODS = ("auto", "tensor", "list")

# Torch release that gave gloo ReduceOp.AVG (pytorch#149781, in 2.8.0).
_GLOO_AVG_SINCE = (2, 8)
# NCCL release that introduced ncclAvg.
_NCCL_AVG_SINCE = (2, 10)


class Averaging(NamedTuple):
    """How a reduction averages over ``world_size`` ranks. See [Note: averaging].

    Attributes:
        op: the reduce op of the collective (``SUM`` or ``AVG``).
        prescale: multiplier applied when packing, before the collective.
        postscale: multiplier applied when unpacking, after the collective.
    """

    op: dist.ReduceOp.RedOpType
    prescale: float
    postscale: float


def backend_name(group: dist.ProcessGroup | None, device: torch.device | None = None) -> str:
    """The backend that serves ``device``'s tensors on ``group`` (e.g. ``"gloo"``, ``"nccl"``).

    ``dist.get_backend`` answers ``"cpu:gloo,cuda:nccl"`` for a group with one
    backend per device type; ``device`` picks one of them (CUDA if not given).
    """
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(","))
    kind = device.type if device is not None else "cuda"
    return per_device.get(kind, next(iter(per_device.values())))


def resolve_method(method: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """``"tensor"`` or ``"list"`` for ``method`` on ``group`` and ``device``. See [Note: reduce_scatter method]."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "list" if backend_name(group, device) == "gloo" else "tensor"


@functools.lru_cache(maxsize=None)
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _nccl_version() -> tuple[int, ...]:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU-only build has no NCCL
        return (0,)
    return tuple(version) if isinstance(version, tuple) else (version // 1000, version % 1000 // 100)


def avg_supported(
    group: dist.ProcessGroup | None, dtype: torch.dtype, device: torch.device | None = None
) -> bool:
    """Whether ``group``'s backend implements ``ReduceOp.AVG`` for ``dtype`` tensors on ``device``."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    name = backend_name(group, device)
    if name == "nccl":
        return _nccl_version() >= _NCCL_AVG_SINCE
    if name == "gloo":
        return _torch_version() >= _GLOO_AVG_SINCE
    return False


def _nearest_pow2_sqrt(world_size: int) -> int:
    return 2 ** round(math.log2(world_size) / 2)


def averaging(
    world_size: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Averaging:
    """The op and the pack/unpack scales that average a reduction of ``dtype`` over ``world_size`` ranks.

    See [Note: averaging]. ``group`` and ``device`` say which backend runs the
    collective (``avg_supported``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
    if dtype == torch.float16:
        pre = _nearest_pow2_sqrt(world_size)
        return Averaging(dist.ReduceOp.SUM, 1.0 / pre, pre / world_size)
    if dtype in (torch.float32, torch.bfloat16) and avg_supported(group, dtype, device):
        return Averaging(dist.ReduceOp.AVG, 1.0, 1.0)
    return Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / world_size)


class Collectives(NamedTuple):
    """The collective calls flatgrad issues for gradients, so that a framework can route them. See [Note: collectives seam].

    Attributes:
        reduce_scatter_tensor: ``(output, input, *, op, group, async_op)``: the tensor form.
        reduce_scatter_list: ``(output, input_list, *, op, group, async_op)``: the list form.
        all_to_all_single: ``(output, input, *, group, async_op)``: equal chunks.
    """

    reduce_scatter_tensor: Callable[..., Any]
    reduce_scatter_list: Callable[..., Any]
    all_to_all_single: Callable[..., Any]


def _torch_reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return single(output, input, **kwargs)


TORCH_COLLECTIVES = Collectives(
    reduce_scatter_tensor=_torch_reduce_scatter_tensor,
    reduce_scatter_list=lambda output, inputs, **kwargs: dist.reduce_scatter(output, inputs, **kwargs),
    all_to_all_single=lambda output, input, **kwargs: dist.all_to_all_single(output, input, **kwargs),
)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    method: str = "auto",
    input_chunks: Sequence[torch.Tensor] | None = None,
    collectives: Collectives | None = None,
) -> dist.Work | None:
    """Reduce the ``W * S``-element ``input`` over ``group`` and leave this rank's ``S`` elements in ``output``.

    One collective call (see [Note: reduce_scatter method] for ``method``). With
    ``async_op`` returns the ``Work`` to wait on. ``input_chunks`` may hold the
    ``W`` views ``input.chunk(W)`` made once by the caller, so that the list form
    builds nothing per call. ``collectives`` issues the call (default
    ``torch.distributed``; see [Note: collectives seam]). World size 1: a copy
    (none when ``output`` is ``input``), no collective, and ``None`` is returned.
    """
    world_size = dist.get_world_size(group)
    if input.dim() != 1 or output.dim() != 1:
        raise ValueError(f"input and output must be 1-D, got {tuple(input.shape)} and {tuple(output.shape)}")
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"input has {input.numel()} elements, expected world_size * output.numel() = "
            f"{world_size} * {output.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"input is {input.dtype} but output is {output.dtype}")
    if world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    method = resolve_method(method, group, input.device)
    issue = collectives or TORCH_COLLECTIVES
    if method == "tensor":
        return issue.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    if input_chunks is None:
        input_chunks = list(input.chunk(world_size))
    elif len(input_chunks) != world_size:
        raise ValueError(f"input_chunks has {len(input_chunks)} tensors, expected {world_size}")
    elif not isinstance(input_chunks, list):
        input_chunks = list(input_chunks)
    return issue.reduce_scatter_list(output, input_chunks, op=op, group=group, async_op=async_op)


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
        for (outputs, chunks), (pieces, whole), scatters in zip(self._batches, self._source_pieces, self._scatters):
            packed = None
            if source is not None:
                packed = source.narrow(0, *whole) if whole else torch.cat([source.narrow(0, *p) for p in pieces])
            all_gather_into_tensor_coalesced(
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
    from .kernels import DTYPES, UnpackPlan, resolve_backend
    from .layout import Layout

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


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    collectives: Collectives | None = None,
) -> dist.Work | None:
    """Send chunk ``r`` of the 1-D ``input`` to rank ``r``; chunk ``w`` of ``output`` comes from rank ``w``.

    One ``all_to_all_single`` with equal chunks (``numel / W`` each); the
    reduction modes ``exact``, ``int8`` and ``fp8`` use it instead of a
    reduce_scatter (see docs/design.md, "Reduction modes"). gloo refuses float8
    tensors: pass a ``uint8`` view. ``collectives`` issues the call (see [Note:
    collectives seam]). World size 1: a copy, no collective, and ``None`` is
    returned.
    """
    world_size = dist.get_world_size(group)
    if input.dim() != 1 or output.dim() != 1:
        raise ValueError(f"input and output must be 1-D, got {tuple(input.shape)} and {tuple(output.shape)}")
    if input.numel() != output.numel() or input.numel() % world_size:
        raise ValueError(
            f"input and output must have the same number of elements, a multiple of the world size {world_size}; "
            f"got {input.numel()} and {output.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"input is {input.dtype} but output is {output.dtype}")
    if world_size == 1:
        output.copy_(input)
        return None
    return (collectives or TORCH_COLLECTIVES).all_to_all_single(output, input, group=group, async_op=async_op)
