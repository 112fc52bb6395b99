"""BucketReducer: per bucket, one fused pack, one async reduce_scatter, one fused unpack into an fp32 shard.

Engine-agnostic: plain PyTorch uses it directly (``build_buckets`` + hooks), the
DeepSpeed integration drives it from its own hooks (``register_hooks=False``).

[Note: bucket lifecycle]
A bucket is a list of parameters whose gradients become ready together in
backward. At construction every bucket gets a static ``Layout`` over its params'
numels (bucket order = layout order) and a slot in the reducer's pool of comm
buffers (see [Note: comm buffer pool]). Per micro-step:

1. ``mark_ready(param)`` (the post-accumulate-grad hook) counts the bucket down;
2. when it reaches zero, and every earlier bucket has been launched (see
   [Note: launch order]), the bucket waits until its comm buffer's previous
   occupant has been unpacked, one fused ``pack`` fills the buffer (cast to the
   comm dtype, pre-scale, zero padding; a param without a gradient is passed
   as None and packs as zeros, so no zeros tensor is ever made; int8/fp8: one
   fused pack-quantize fills the send wire instead, see [Note: reduction modes]),
   ``param.grad`` is dropped, and one async ``reduce_scatter`` starts,
   in place: its output is this rank's own chunk of the buffer;
3. one fused ``unpack`` casts that chunk to the shard dtype (fp32), post-scales
   it, and copies it into the bucket's ``shard`` on the first micro-step of an
   accumulation window or adds it afterwards (see [Note: shard lifetime]);
4. ``finish()`` launches what is left, waits for everything, and the shards
   are final for this micro-step.

Nothing on this path syncs the host or rebuilds a table. The pool's plan is
made once and its buffers are taken per micro-step; a bucket's shard is made
at its first unpack of an accumulation window. A non-contiguous gradient is copied to a contiguous one before
packing (off the common path).

[Note: comm buffer pool]
Stock DeepSpeed keeps one or two bucket-sized IPG buffers, not one per bucket,
and only during a backward (``setup_buckets`` to the epilogue); so does
flatgrad. The pools are taken at the first launch of a micro-step and given
back by ``finish()``, so between steps, and in ``step()``, a reducer holds no
comm buffer: the optimizer step's own temporaries (gloo's all_gather staging,
the optimizer's) reuse that memory. On CUDA the caching allocator serves them
from its cache, on the stream current at the first launch; ``finish()`` has
made that stream wait on the side streams and records the buffers on them
before dropping them. The buckets of one device and comm dtype share
``comm_buffers`` buffers (default 2), each as large as the largest of those
buckets, so a pool too small for a bucket cannot be built. Bucket ``k`` uses
buffer ``k mod comm_buffers``: launches are in bucket order, so the
assignment is static and every rank uses the same one. Before bucket ``k``
packs, bucket ``k - comm_buffers`` (the buffer's previous occupant in this
micro-step) must have been unpacked: on CUDA ``pack_stream`` waits on that
bucket's ``unpacked`` event, on CPU the reducer unpacks it first, waiting on
its collective's ``Work``. With two or more buffers the pack of bucket
``k + 1`` therefore still runs while bucket ``k``'s collective is in flight.
Across micro-steps nothing is needed: ``finish()`` has drained everything.

The reduce_scatter runs in place: its output is the rank's chunk
``buffer[rank * S : (rank + 1) * S]`` of its input. NCCL's reduce_scatter
defines that case (recvbuff == sendbuff + rank * recvcount), and gloo's list
and tensor forms give the same bits in place as out of place (checked in
``tests/test_comm.py``), so no backend here needs a separate output buffer.

[Note: shard lifetime]
The fp32 shards live only while a gradient is being accumulated or waits to
be consumed. A bucket's shard is allocated when the bucket is first launched
in an accumulation window (its first unpack copies, later ones add), and all
are released by ``zero_grad()``, which the owner calls once the optimizer has
consumed them. Between steps a reducer therefore holds only its comm
buffers. By default each shard is allocated on its own, as its bucket is
launched, so that the shards come into being as the gradients they replace
are dropped. With ``shard_arena`` the first launch of a window allocates one
arena that all shards are slices of, in the order the caller asks: what an
optimizer needs to update many buckets' partitions as one tensor, and what
stock ZeRO-2 does with its own partition buffer (``grads_in_partition``,
allocated whole at its first bucket). The arena costs memory only in the
first micro-step of a window, between the first and the last launch
(measured in ``bench/memory.py``). On CUDA the caching allocator serves
these from its cache after the first step, with no device allocation.
``grad_shards()`` hands out the current window's shards; a caller that keeps
one keeps its memory alive (a shard is dropped, never resized under a view).

[Note: reduction modes]
``reduction`` picks what moves a bucket (see docs/design.md, "Reduction modes"):

* ``"reduce_scatter"``: the path above, unchanged.
* ``"exact"``: the comm-dtype buffer goes out through one ``all_to_all`` into a
  receive buffer of the same size; the unpack (``wire.sum_sources``) reads its W
  chunks and sums them in fp32 in rank order 0..W-1, post-scales (``1/W`` when
  averaging) and copies or adds into the shard in one pass. Deterministic, same
  bytes as a reduce_scatter.
* ``"int8"`` / ``"fp8"``: one fused pack-quantize (``wire.PackQuantizePlan``, see
  [Note: pack-quantize] in ``kernels/wire_reference.py``) reads the gradients
  through the layout's pack run table and writes the quantized wire (see
  [Note: wire format] there) straight into a send buffer; one all_to_all moves
  it, and the unpack (``wire.dequantize_sum``) dequantizes and sums in fp32.
  There is no comm-dtype buffer in these modes, so ``comm_dtype`` does not
  round anything: the wire is quantized from fp32 ``grad * prescale`` (one
  rounding fewer than the former bf16 pack then quantize, and one buffer of
  ``layout.numel`` comm-dtype elements fewer per pool slot). With
  ``error_feedback`` a persistent fp32 residual per bucket (``layout.numel``
  elements) carries this rank's quantization error into its next quantize.

On a one-rank group nothing is sent, so every mode takes the path above (a
copy through the comm dtype): a quantized wire would only add its rounding,
and error feedback would carry it. That is the MoE expert group of one rank.

With ``collect_stats`` both wire unpacks return the same stats as the regular
unpack (sum of squares and non-finite count of the shard as written), so
``shard_stats()`` works in every mode.

The receive (and wire) buffers come from pools beside the comm buffer pool (or,
int8/fp8, instead of it), keyed by purpose, with the same count and the same
bucket -> buffer assignment, so the hand-off rule of [Note: comm buffer pool]
covers them too.

[Note: launch order]
Collectives are matched across ranks by the order they are issued in, not by
name. Buckets are therefore launched strictly in bucket order: a bucket whose
gradients are all ready waits until every earlier bucket has been launched
(as DDP's reducer does). Ranks whose backward orders differ (data-dependent
control flow, a param unused on one rank only) still issue the same sequence
of collectives; they only overlap less.

[Note: streams]
On CUDA three streams take part, each for one reason:

* the current stream (autograd's, as seen in the hook) produces ``param.grad``
  and, after ``finish()``, consumes the shards (the optimizer);
* ``pack_stream`` packs bucket ``k`` while the current stream computes the
  gradients of bucket ``k + 1``. It waits on the stream current in each
  param's hook as the param becomes ready, and on the current stream again at
  launch (the gradients must be complete: a bucket held back by
  [Note: launch order] is launched from a later hook, possibly on another
  stream, e.g. for layers run on a side stream); each gradient is ``record_stream``-ed on it
  before ``param.grad`` drops the last reference, so the caching allocator
  does not hand the memory out while the pack still reads it. The collective
  is issued from this stream, so NCCL orders it after the pack;
* ``unpack_stream`` waits on the collective (``work.wait()`` under it, which
  blocks no host thread on NCCL) and unpacks into the shard. It is separate
  from ``pack_stream`` so that the pack of bucket ``k + 1`` does not queue
  behind the collective of bucket ``k``.

Within a micro-step a pooled comm buffer is handed from unpack to pack by
the ``unpacked`` event of its previous occupant (see [Note: comm buffer
pool]). ``finish()`` makes the current stream wait on ``unpack_stream``. The
next micro-step's pack waits on the current stream, hence on every earlier
unpack, so a comm buffer or shard is never written while a previous reader
may still be running. The shard arena is allocated on the current stream
(outside the side-stream contexts) and dropped after ``finish()`` has made
the current stream wait for every unpack, so the caching allocator can reuse
it safely. On CPU (gloo) the collective runs on gloo's threads; the pack runs
in the hook, and the unpack of a bucket runs as soon as its collective is
found complete at a later launch, when its buffer is needed again, or in
``finish()``.

[Note: layout agreement]
A wrong layout on one rank would reduce mismatched elements or hang. At
construction the ranks all_gather a fixed-size digest of (world size, bucket
count, per bucket: layout kind, alignment, comm dtype, op, and every param's
shape and dtype), plus a flag for a local setup error. If all agree, that is the
only collective. Otherwise they all_gather the full descriptions and every rank
raises the same ``LayoutMismatchError`` naming the first differing bucket and
parameter; a rank whose own setup failed raises its error and the others name
it. Every rank takes the same branch, so nothing hangs.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import threading
import weakref
from collections import deque
from typing import Any, Iterable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .kernels import DTYPES, PackPlan, UnpackPlan, resolve_backend
from .kernels import wire
from .layout import Layout, Piece, split_numels

__all__ = ["BucketReducer", "GradShard", "LayoutMismatchError", "build_buckets"]

_LAYOUT_KINDS = ("flat", "chunked")
REDUCTIONS = ("reduce_scatter", "exact", "int8", "fp8")


class GradShard(NamedTuple):
    """One bucket's gradient shard on this rank and what it holds.

    Attributes:
        bucket_id: index of the bucket.
        shard: tensor of ``layout.shard_numel`` elements (padding included), of the
            reducer's ``accum_dtype`` (fp32 by default).
        layout: the bucket's layout.
        params: the bucket's params, in layout order.
        pieces: ``layout.pieces(rank)``: which slice of which param lies where in ``shard``.
    """

    bucket_id: int
    shard: torch.Tensor
    layout: Layout
    params: list[nn.Parameter]
    pieces: list[Piece]


class LayoutMismatchError(RuntimeError):
    """The ranks of a process group disagree on the buckets. See [Note: layout agreement]."""


def _describe_param(p: torch.Tensor) -> str:
    return f"shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"


def build_buckets(params: Iterable[torch.Tensor] | nn.Module, bucket_numel: int) -> list[list[nn.Parameter]]:
    """Group the trainable params into buckets of about ``bucket_numel`` elements, in backward order.

    Backward order is taken as reverse registration order. The cuts are
    ``flatgrad.layout.split_numels``'s (a small param joins the next large one
    rather than making a collective of its own), and a bucket never mixes
    devices or dtypes. Given a module, modules that make sparse gradients
    (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are refused.
    """
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an int >= 1, got {bucket_numel!r}")
    if isinstance(params, nn.Module):
        for name, module in params.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                raise ValueError(f"module {name!r} makes sparse gradients (sparse=True); flatgrad reduces dense ones")
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters or a module, not one tensor")
    seen: set[int] = set()
    ordered = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    ordered.reverse()
    buckets: list[list[nn.Parameter]] = []
    start = 0
    for end in range(1, len(ordered) + 1):  # runs of one device and dtype, each cut by split_numels
        if end == len(ordered) or (ordered[end].device, ordered[end].dtype) != (ordered[start].device, ordered[start].dtype):
            run = ordered[start:end]
            buckets += [run[a:b] for a, b in split_numels([p.numel() for p in run], bucket_numel)]
            start = end
    return buckets


class _Bucket:
    """One bucket's static plan, persistent buffers and per-micro-step state. See [Note: bucket lifecycle]."""

    __slots__ = (
        "id", "params", "layout", "device", "comm_dtype", "op", "method", "kernels", "pack_scale",
        "unpack_scale", "pack_plan", "unpack_plan", "input", "input_chunks", "output", "shard", "accumulate", "pieces",
        "previous", "stats",
        "unpacked", "in_flight", "pack_stream", "unpack_stream", "ready", "not_ready", "pending", "launched",
        "work", "reduction", "wire_kernels", "recv", "wire_send", "wire_recv", "residual",
    )  # fmt: skip

    def reset(self) -> None:
        self.ready[:] = self.not_ready
        self.pending = len(self.params)
        self.launched = False
        self.in_flight = False
        self.work = None


class BucketReducer:
    """Reduce-scatters gradients bucket by bucket into persistent fp32 shards. See [Note: bucket lifecycle].

    Args:
        buckets: lists of params, in the order their gradients become ready
            (``build_buckets`` makes them). Each list is one bucket; the params
            must require grad, be dense and share one device.
        process_group: the data-parallel group (``None``: the default group).
        comm_dtype: dtype of the packed buffer and the collective (``None``:
            each bucket's param dtype, which must then be uniform).
        layout: ``"flat"`` or ``"chunked"`` (see ``flatgrad.Layout``).
        align: layout alignment in elements.
        average: divide the sum by the world size (see [Note: averaging] in
            ``flatgrad.comm``); ``False`` sums.
        prescale: extra multiplier applied in pack.
        postscale: extra multiplier applied in unpack.
        backend: flatgrad kernel backend (``None``: automatic per device).
        register_hooks: register a post-accumulate-grad hook on every param
            that calls ``mark_ready``; ``False`` when the caller has its own hooks.
        method: reduce_scatter method (see [Note: reduce_scatter method] in ``flatgrad.comm``).
        comm_buffers: how many bucket-sized comm buffers the buckets of one device
            and comm dtype share (see [Note: comm buffer pool]); 1 serialises
            pack and collective, 2 (the default) overlaps them as stock's double
            IPG buffer does.
        accum_dtype: dtype of the gradient shards, which accumulate micro-steps
            (fp32 by default; see [Note: shard lifetime]).
        collect_stats: every unpack also computes, in the same pass, the sum of
            squares and the non-finite count of the shard it wrote (the
            accumulated values): ``shard_stats()`` returns the last ones, for the
            gradient norm and the overflow check without reading the shards again.
        reduction: ``"reduce_scatter"`` (the default), or one of the all_to_all modes of
            [Note: reduction modes]: ``"exact"``, ``"int8"``, ``"fp8"``.
        block: int8/fp8: elements per fp32 scale, a power of two in [32, 4096].
        error_feedback: int8/fp8: carry each rank's quantization error into its next pack.
        collectives: what issues the collectives (``None``: ``torch.distributed``); see
            [Note: collectives seam] in ``flatgrad.comm``.
        shard_arena: ``None`` (each shard allocated on its own), or one arena position per
            bucket: the window's shards are then slices of one tensor, bucket ``b`` the
            ``shard_arena[b]``-th, so that an optimizer can update them as one tensor
            (see [Note: shard lifetime]).

    Attributes:
        buckets: the buckets, as lists of params in layout order.
        layouts: one ``Layout`` per bucket.
        rank: this rank in ``process_group``.
        world_size: size of ``process_group``.
        kernel_backends: the flatgrad kernel backend each bucket packs and unpacks with.
        comm_buffer_bytes: bytes of the comm buffer pools (comm buffers, and the all_to_all
            modes' receive or wire buffers), held from a micro-step's first launch to its
            ``finish()`` only.
        shard_bytes: bytes of the shards of one accumulation window (held only during one).
        residual_bytes: bytes of the error-feedback residuals (held all the time; 0 without).
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[nn.Parameter]],
        *,
        process_group: dist.ProcessGroup | None = None,
        comm_dtype: torch.dtype | None = None,
        layout: str = "flat",
        align: int = 1,
        average: bool = True,
        prescale: float = 1.0,
        postscale: float = 1.0,
        backend: str | None = None,
        register_hooks: bool = True,
        method: str = "auto",
        comm_buffers: int = 2,
        accum_dtype: torch.dtype = torch.float32,
        collect_stats: bool = False,
        reduction: str = "reduce_scatter",
        block: int = 256,
        error_feedback: bool = False,
        collectives: comm.Collectives | None = None,
        shard_arena: Sequence[int] | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "BucketReducer needs an initialized process group: call torch.distributed.init_process_group first"
            )
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        local_error: Exception | None = None
        description: list[tuple] = []
        try:
            _check_pool_args(comm_buffers, accum_dtype)
            if collectives is not None and not isinstance(collectives, comm.Collectives):
                raise TypeError(f"collectives must be a flatgrad.comm.Collectives or None, got {type(collectives).__name__}")
            self._reduction = _check_reduction(reduction, block, error_feedback)
            if self.world_size == 1:  # nothing is sent: a mode's wire would only add rounding to the copy
                self._reduction = ("reduce_scatter", self._reduction[1], False)
            plans = self._plan(
                buckets, comm_dtype, layout, align, average, prescale, postscale, backend, method, register_hooks
            )
            arena_offsets = _arena_offsets(shard_arena, plans)
            description = [plan["description"] for plan in plans]
        except Exception as exc:  # exchanged below so that every rank raises, then re-raised
            local_error = exc
        if self.world_size > 1:
            device = _agreement_device(process_group)
            _agree(process_group, self.rank, self.world_size, description, local_error, device)
        if local_error is not None:
            raise local_error
        self.accum_dtype = accum_dtype
        self.collect_stats = bool(collect_stats)
        self._collectives = collectives
        self._buckets = [self._bucket(i, plan) for i, plan in enumerate(plans)]
        self._pool_plan = self._plan_pools(comm_buffers)
        self._pools: dict[tuple, list[torch.Tensor]] | None = None  # taken per micro-step: see [Note: comm buffer pool]
        self.buckets: list[list[nn.Parameter]] = [list(b.params) for b in self._buckets]
        self.layouts: list[Layout] = [b.layout for b in self._buckets]
        self.kernel_backends: list[str] = [getattr(b.kernels, "name", type(b.kernels).__name__) for b in self._buckets]
        self.comm_buffer_bytes: int = sum(
            count * size * dtype.itemsize for _, count, size, dtype, _ in self._pool_plan
        )
        self.shard_bytes: int = sum(b.layout.shard_numel for b in self._buckets) * accum_dtype.itemsize
        self._arena_offsets = arena_offsets
        self._arena: torch.Tensor | None = None
        self.residual_bytes: int = sum(b.residual.numel() * 4 for b in self._buckets if b.residual is not None)
        self._where = {p: (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next = 0  # the first bucket not launched yet this micro-step; see [Note: launch order]
        self._in_step = False  # some bucket was marked or launched since the last finish()
        self._inflight: deque[_Bucket] = deque()  # CPU: launched buckets not unpacked yet
        self._lock = threading.Lock()  # hooks of several devices run on their own autograd threads
        self._hooks: list[Any] = []
        if register_hooks:
            for b in self._buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self.mark_ready))
                    _HOOKED[id(p)] = (weakref.ref(p), weakref.ref(self))

    # ------------------------------------------------------------------ setup

    def _plan(
        self, buckets, comm_dtype, kind, align, average, prescale, postscale, backend, method, register_hooks
    ) -> list[dict]:
        """Validate the arguments and describe every bucket; allocates nothing."""
        if isinstance(buckets, torch.Tensor) or not isinstance(buckets, Sequence) or not buckets:
            raise TypeError("buckets must be a non-empty list of lists of parameters")
        if kind not in _LAYOUT_KINDS:
            raise ValueError(f"layout must be one of {_LAYOUT_KINDS}, got {kind!r}")
        if comm_dtype is not None and comm_dtype not in DTYPES:
            raise ValueError(f"comm_dtype must be one of fp32, bf16, fp16, got {comm_dtype}")
        for name, value in (("prescale", prescale), ("postscale", postscale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        seen: dict[int, tuple[int, int]] = {}
        plans = []
        for b, params in enumerate(buckets):
            if isinstance(params, torch.Tensor) or not isinstance(params, Sequence) or not params:
                raise TypeError(f"buckets[{b}] must be a non-empty list of parameters")
            for i, p in enumerate(params):
                where = f"buckets[{b}][{i}] ({_describe_param(p) if isinstance(p, torch.Tensor) else type(p).__name__})"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"{where} is not a tensor")
                if p.layout != torch.strided or (p.grad is not None and p.grad.layout != torch.strided):
                    raise ValueError(f"{where} is sparse; flatgrad reduces dense gradients only")
                if not p.requires_grad:
                    raise ValueError(f"{where} does not require grad; leave it out of the buckets")
                if p.dtype not in DTYPES:
                    raise ValueError(f"{where} has dtype {p.dtype}; supported: fp32, bf16, fp16")
                if p.device != params[0].device:
                    raise ValueError(
                        f"{where} is on {p.device} but buckets[{b}][0] is on {params[0].device}; one device per bucket"
                    )
                if register_hooks and _hook_owner(p) is not None:
                    raise ValueError(
                        f"{where} already has the gradient hook of another BucketReducer, whose pack frees "
                        "param.grad: call remove_hooks() on that reducer first"
                    )
                if id(p) in seen:
                    raise ValueError(f"{where} is the same param as buckets[{seen[id(p)][0]}][{seen[id(p)][1]}]")
                seen[id(p)] = (b, i)
            device = params[0].device
            dtypes = {p.dtype for p in params}
            if comm_dtype is None and len(dtypes) > 1:
                raise ValueError(f"buckets[{b}] mixes dtypes {sorted(map(str, dtypes))}; pass comm_dtype=")
            dtype = comm_dtype if comm_dtype is not None else params[0].dtype
            layout = Layout.make(kind, [p.numel() for p in params], self.world_size, align)
            if not average:
                avg = comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
            elif self._reduction[0] != "reduce_scatter":  # the unpack sums in fp32: average there
                avg = comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / self.world_size)
            else:
                avg = comm.averaging(self.world_size, dtype, self.process_group, device)
            resolved = comm.resolve_method(method, self.process_group, device)
            kernels = resolve_backend(backend, device)
            description = (
                kind, align, str(dtype), str(avg.op), resolved, self._reduction,
                tuple((tuple(p.shape), str(p.dtype)) for p in params),
            )  # fmt: skip
            plans.append(
                dict(
                    params=tuple(params), layout=layout, device=device, dtype=dtype, avg=avg, method=resolved,
                    kernels=kernels, pack_scale=avg.prescale * float(prescale),
                    unpack_scale=avg.postscale * float(postscale), description=description,
                )
            )  # fmt: skip
        return plans

    def _bucket(self, bucket_id: int, plan: dict) -> _Bucket:
        """A bucket's static plan and per-micro-step state (its buffers come from the pool)."""
        b = _Bucket()
        b.id = bucket_id
        b.params = plan["params"]
        b.layout = plan["layout"]
        b.device = plan["device"]
        b.comm_dtype = plan["dtype"]
        b.op = plan["avg"].op
        b.method = plan["method"]
        b.kernels = plan["kernels"]
        # One fast path for pack and unpack: the kernels' plans, validated once (see [Note: plans] in
        # flatgrad/kernels/_plan.py). A missing gradient is passed as None and packs as zeros.
        name = getattr(b.kernels, "name", None)
        b.reduction = self._reduction[0]
        if b.reduction in wire.KINDS:  # the fused pack-quantize: see [Note: reduction modes]
            b.pack_plan = wire.PackQuantizePlan(
                b.layout, [None] * len(b.params), block=self._reduction[1], kind=b.reduction, device=b.device,
                backend=name,
            )  # fmt: skip
        else:
            b.pack_plan = PackPlan(b.layout, [None] * len(b.params), dtype=b.comm_dtype, device=b.device, backend=name)
        b.unpack_plan = None  # made with the first shard
        b.stats = None
        b.pack_scale = plan["pack_scale"]
        b.unpack_scale = plan["unpack_scale"]
        b.shard = None
        b.accumulate = False
        b.pieces = tuple(b.layout.pieces(self.rank))
        b.previous = None
        b.pack_stream = b.unpack_stream = b.unpacked = None
        if b.device.type == "cuda":
            b.pack_stream, b.unpack_stream = _side_streams(b.device)
            b.unpacked = torch.cuda.Event()
        b.wire_kernels = None if b.reduction == "reduce_scatter" else wire.wire_kernels(b.kernels.name)
        b.input = b.input_chunks = b.output = None
        b.recv = b.wire_send = b.wire_recv = None
        b.residual = None
        if self._reduction[2]:  # persistent, zero at the start: see [Note: reduction modes]
            b.residual = torch.zeros(b.layout.numel, dtype=torch.float32, device=b.device)
        b.not_ready = [False] * len(b.params)
        b.ready = list(b.not_ready)
        b.reset()
        return b

    def _plan_pools(self, comm_buffers: int) -> list[tuple[tuple, int, int, torch.dtype, list[_Bucket]]]:
        """Plan the comm buffer pools once: (key, slots, elements per slot, dtype, member buckets) each.

        See [Note: comm buffer pool]. The buffer -> bucket assignment (and so each
        bucket's ``previous`` occupant) is fixed here; the memory is taken per
        micro-step by ``_acquire_pools``.
        """
        members: dict[tuple[torch.device, torch.dtype | None], list[_Bucket]] = {}
        for b in self._buckets:
            # int8/fp8: the wire is bytes whatever the comm dtype, so their buckets share one pool per device.
            members.setdefault((b.device, None if b.reduction in wire.KINDS else b.comm_dtype), []).append(b)
        plan = []
        for (device, dtype), buckets in members.items():
            count = min(comm_buffers, len(buckets))
            for k, b in enumerate(buckets):
                b.previous = buckets[k - count] if k >= count else None
            if buckets[0].reduction in wire.KINDS:
                # The fused pack-quantize writes the send wire from the gradients: no comm-dtype
                # buffer (see [Note: reduction modes]).
                nbytes = max(self.world_size * wire.segment_bytes(b.layout.shard_numel, self._reduction[1]) for b in buckets)
                for purpose in ("wire_send", "wire_recv"):
                    plan.append(((purpose, device, dtype), count, nbytes, torch.uint8, buckets))
                continue
            size = max(b.layout.numel for b in buckets)
            comm_dtype = buckets[0].comm_dtype  # the key's dtype: not None outside the wire modes
            plan.append(((device, dtype), count, size, comm_dtype, buckets))
            if buckets[0].reduction == "exact":  # the all_to_all's receive side: see [Note: reduction modes]
                plan.append((("recv", device, dtype), count, size, comm_dtype, buckets))
        return plan

    def _acquire_pools(self) -> None:
        """Take the pools for this micro-step (if not taken yet) and give every bucket its views.

        Called from the first launch of a micro-step, on the stream current there: see
        [Note: comm buffer pool] for why the pools live for one micro-step only.
        """
        if self._pools is not None:
            return
        pools: dict[tuple, list[torch.Tensor]] = {}
        for key, count, size, dtype, buckets in self._pool_plan:
            device = buckets[0].device
            pool = pools[key] = [torch.empty(size, dtype=dtype, device=device) for _ in range(count)]
            purpose = key[0] if isinstance(key[0], str) else "input"
            for k, b in enumerate(buckets):
                if purpose in ("wire_send", "wire_recv"):
                    setattr(b, purpose, pool[k % count].narrow(0, 0, b.pack_plan.wire_bytes))
                elif purpose == "recv":
                    b.recv = pool[k % count].narrow(0, 0, b.layout.numel)
                else:
                    layout: Layout = b.layout
                    b.input = pool[k % count].narrow(0, 0, layout.numel)
                    b.input_chunks = list(b.input.chunk(self.world_size))
                    # In place: this rank's chunk of the input. World size 1: the whole input.
                    b.output = b.input.narrow(0, self.rank * layout.shard_numel, layout.shard_numel)
        self._pools = pools

    def _release_pools(self) -> None:
        """Give the pools back once every unpack of the micro-step is done (``finish()``)."""
        if self._pools is None:
            return
        for b in self._buckets:
            b.input = b.input_chunks = b.output = None
            b.recv = b.wire_send = b.wire_recv = None
        side = {s for b in self._buckets for s in (b.pack_stream, b.unpack_stream) if s is not None}
        for pool in self._pools.values():
            for t in pool:
                for stream in side:  # the caching allocator reuses them only after the side streams' work
                    t.record_stream(stream)
        self._pools = None

    # ------------------------------------------------------------------ hot path

    def mark_ready(self, param: nn.Parameter) -> None:
        """Record that ``param.grad`` is final for this micro-step; launch every bucket that can go.

        Called by the post-accumulate-grad hook, or by an integration's own hook.
        """
        where = self._where.get(param)
        if where is None:
            raise KeyError(f"param ({_describe_param(param)}) is not in any bucket of this reducer")
        bucket, i = where
        with self._lock:
            if bucket.ready[i] or bucket.launched:
                raise RuntimeError(
                    f"bucket {bucket.id} param {i} ({_describe_param(param)}) became ready twice in one micro-step: "
                    "call finish() after every backward, and run one backward per micro-step"
                )
            grad = param.grad
            if grad is not None and grad.layout != torch.strided:
                raise ValueError(
                    f"bucket {bucket.id} param {i} ({_describe_param(param)}) got a sparse gradient; "
                    "flatgrad reduces dense gradients only"
                )
            if bucket.pack_stream is not None:
                # The hook runs on the stream this param's gradient was made on, which need not be
                # the stream of the hook that later launches the bucket. See [Note: streams].
                bucket.pack_stream.wait_stream(torch.cuda.current_stream(bucket.device))
            bucket.ready[i] = True
            bucket.pending -= 1
            self._in_step = True
            buckets = self._buckets
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                self._launch(buckets[self._next])
                self._next += 1

    def _grads(self, b: _Bucket) -> list[torch.Tensor | None]:
        """The bucket's gradients as pack inputs: missing ones are None (packed as zeros), odd ones are checked."""
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(b.params):
            g = p.grad
            if g is not None and not (
                g.dtype == p.dtype and g.device == b.device and g.numel() == b.layout.numels[i] and g.is_contiguous()
            ):
                g = _conform(b, i, p, g)
            grads.append(g)
        return grads

    def _launch(self, b: _Bucket) -> None:
        """Pack, drop the grads, start the reduce_scatter (and on CUDA queue the unpack)."""
        grads = self._grads(b)
        self._acquire_pools()
        if b.pack_stream is None:
            if b.previous is not None and b.previous.in_flight:
                self._drain(block=True, through=b.previous)  # its comm buffer is this bucket's
            self._pack(b, grads)
            b.work = self._collective(b)
            b.in_flight = True
            self._inflight.append(b)
        else:
            # See [Note: streams]. The shard is allocated on the current stream: see [Note: shard lifetime].
            self._ensure_shard(b)
            current = torch.cuda.current_stream(b.device)
            b.pack_stream.wait_stream(current)
            if b.previous is not None:
                b.pack_stream.wait_event(b.previous.unpacked)  # see [Note: comm buffer pool]
            with torch.cuda.stream(b.pack_stream):
                self._pack(b, grads)
                for g in grads:
                    if g is not None:
                        g.record_stream(b.pack_stream)
                b.work = self._collective(b)
            with torch.cuda.stream(b.unpack_stream):
                if b.work is not None:
                    b.work.wait()
                else:
                    b.unpack_stream.wait_stream(b.pack_stream)
                self._unpack(b)
                b.unpacked.record(b.unpack_stream)
        for p in b.params:
            p.grad = None
        b.launched = True
        if self._inflight:
            self._drain(block=False)

    def _pack(self, b: _Bucket, grads: list[torch.Tensor | None]) -> None:
        """Fill what the bucket's collective sends: the comm buffer, or (int8/fp8) the send wire."""
        if b.reduction in wire.KINDS:  # the fused pack-quantize: see [Note: reduction modes]
            b.pack_plan(grads, b.wire_send, b.residual, scale=b.pack_scale)
        else:
            b.pack_plan(grads, b.input, scale=b.pack_scale)

    def _collective(self, b: _Bucket):
        """Start the bucket's collective. See [Note: reduction modes]."""
        try:
            if b.reduction == "reduce_scatter":
                return comm.reduce_scatter(
                    b.output, b.input, group=self.process_group, op=b.op, async_op=True, method=b.method,
                    input_chunks=b.input_chunks, collectives=self._collectives,
                )  # fmt: skip
            if b.reduction == "exact":
                return comm.all_to_all(
                    b.recv, b.input, group=self.process_group, async_op=True, collectives=self._collectives
                )
            return comm.all_to_all(
                b.wire_recv, b.wire_send, group=self.process_group, async_op=True, collectives=self._collectives
            )
        except Exception as exc:
            raise RuntimeError(f"flatgrad: the {b.reduction} of bucket {b.id} failed on rank {self.rank}: {exc}") from exc

    def _ensure_shard(self, b: _Bucket) -> None:
        """Give ``b`` its shard for this window if it has none; its first unpack then copies. See [Note: shard lifetime]."""
        if b.shard is not None:
            return
        if self._arena_offsets is None:
            b.shard = torch.empty(b.layout.shard_numel, dtype=self.accum_dtype, device=b.device)
            b.accumulate = False
            return
        self._arena = torch.empty(self.shard_bytes // self.accum_dtype.itemsize, dtype=self.accum_dtype, device=b.device)
        for bb, offset in zip(self._buckets, self._arena_offsets):
            bb.shard = self._arena.narrow(0, offset, bb.layout.shard_numel)
            bb.accumulate = False

    def _unpack(self, b: _Bucket) -> None:
        self._ensure_shard(b)
        if b.reduction == "reduce_scatter":
            if b.unpack_plan is None:
                b.unpack_plan = UnpackPlan(b.layout, self.rank, b.shard, backend=getattr(b.kernels, "name", None))
            b.stats = b.unpack_plan(
                b.output, b.shard, scale=b.unpack_scale, accumulate=b.accumulate, return_stats=self.collect_stats
            )
        elif b.reduction == "exact":
            b.stats = b.wire_kernels.sum_sources(
                b.recv, self.world_size, b.shard, b.unpack_scale, b.accumulate, self.collect_stats
            )
        else:
            b.stats = b.wire_kernels.dequantize_sum(
                b.wire_recv, self.world_size, self._reduction[1], b.reduction, b.shard, b.unpack_scale, b.accumulate,
                self.collect_stats,
            )  # fmt: skip
        b.accumulate = True

    def _drain(self, block: bool, through: _Bucket | None = None) -> None:
        """CPU: unpack launched buckets in launch order.

        Waits for their collectives if ``block``; with ``through``, waits up to
        and including that bucket only.
        """
        while self._inflight:
            b = self._inflight[0]
            if b.work is not None:
                if not block and not b.work.is_completed():
                    return
                try:
                    b.work.wait()
                except Exception as exc:
                    raise RuntimeError(
                        f"flatgrad: reduce_scatter of bucket {b.id} failed on rank {self.rank} "
                        f"(world size {self.world_size}): {exc}"
                    ) from exc
            self._unpack(b)
            b.in_flight = False
            self._inflight.popleft()
            if b is through:
                return

    # ------------------------------------------------------------------ epilogue

    def finish(self) -> None:
        """Launch the buckets still waiting (missing grads count as zero), wait for all; shards are final."""
        with self._lock:
            for b in self._buckets[self._next :]:
                self._launch(b)
            self._next = len(self._buckets)
            self._drain(block=True)
            streams = {b.unpack_stream for b in self._buckets if b.unpack_stream is not None}
            for stream in streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._release_pools()
            for b in self._buckets:
                b.reset()
            self._next = 0
            self._in_step = False

    def zero_grad(self) -> None:
        """Start a new accumulation window and release the shards (see [Note: shard lifetime]).

        Call it once the optimizer has consumed the shards; the next micro-step
        allocates fresh ones and copies into them instead of adding.
        """
        if self._in_step:
            raise RuntimeError("zero_grad() in the middle of a micro-step: call finish() first")
        for b in self._buckets:
            b.shard = None
            b.stats = None
        self._arena = None

    def grad_shards(self) -> list[GradShard]:
        """Every bucket's shard with its layout, params and pieces (valid after ``finish()``, until ``zero_grad()``)."""
        if self._in_step or any(b.shard is None for b in self._buckets):
            raise RuntimeError(
                "no gradient shards: none were reduced since the last zero_grad(), or a micro-step is still "
                "running (run a backward and finish() first)"
            )
        return [GradShard(b.id, b.shard, b.layout, list(b.params), list(b.pieces)) for b in self._buckets]

    @property
    def shard_arena(self) -> torch.Tensor | None:
        """With ``shard_arena``: the one tensor every bucket's shard is a slice of (``None`` outside a window)."""
        return self._arena

    @property
    def stats_available(self) -> bool:
        """Whether every unpack computes the stats ``shard_stats()`` returns (every reduction mode's does)."""
        return self.collect_stats

    def shard_stats(self) -> list[torch.Tensor]:
        """Per bucket, fp32 ``[sum_sq, nonfinite_count]`` of its shard as the last unpack wrote it.

        Needs ``collect_stats``; valid after ``finish()``. Computed in the unpack's own
        pass, so reading them costs no pass over the shards.
        """
        if not self.stats_available:
            raise RuntimeError("shard_stats() needs a reducer made with collect_stats=True")
        if self._in_step or any(b.stats is None for b in self._buckets):
            raise RuntimeError("no shard stats: a bucket was not unpacked since the last zero_grad(), or finish() is due")
        return [b.stats for b in self._buckets]

    def plan_bytes(self) -> int:
        """Bytes of the buckets' pack and unpack plans' tensor tables (metadata, counted in memory figures)."""
        plans = [b.pack_plan for b in self._buckets] + [b.unpack_plan for b in self._buckets if b.unpack_plan]
        return sum(plan.table_bytes for plan in plans)

    def metadata_bytes(self) -> int:
        """Bytes kept besides gradients and comm buffers: plan tables; inside a window, the stats (8 B a bucket)."""
        return self.plan_bytes() + sum(b.stats.nbytes for b in self._buckets if b.stats is not None)

    def has_shards(self) -> bool:
        """Whether any bucket holds a shard (an accumulation window is open)."""
        return any(b.shard is not None for b in self._buckets)

    def remove_hooks(self) -> None:
        """Remove the post-accumulate-grad hooks this reducer registered."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for b in self._buckets:
            for p in b.params:
                if _hook_owner(p) is self:
                    del _HOOKED[id(p)]


def _arena_offsets(order: Sequence[int] | None, plans: list[dict]) -> list[int] | None:
    """Each bucket's offset in the shard arena: bucket ``b`` is the ``order[b]``-th slice. See [Note: shard lifetime]."""
    if order is None:
        return None
    if isinstance(order, torch.Tensor) or not isinstance(order, Sequence) or sorted(order) != list(range(len(plans))):
        raise ValueError(
            f"shard_arena must be a permutation of range({len(plans)}) (one arena position per bucket), got {order!r}"
        )
    devices = {plan["device"] for plan in plans}
    if len(devices) > 1:
        raise ValueError(f"shard_arena needs every bucket on one device, got {sorted(map(str, devices))}")
    numels = [0] * len(plans)
    for b, position in enumerate(order):
        numels[position] = plans[b]["layout"].shard_numel
    starts = [0, *itertools.accumulate(numels)]
    return [starts[position] for position in order]


def _check_pool_args(comm_buffers: object, accum_dtype: object) -> None:
    if isinstance(comm_buffers, bool) or not isinstance(comm_buffers, int) or comm_buffers < 1:
        raise ValueError(f"comm_buffers must be an int >= 1, got {comm_buffers!r}")
    if accum_dtype not in DTYPES:
        raise ValueError(f"accum_dtype must be one of fp32, bf16, fp16, got {accum_dtype!r}")


def _check_reduction(reduction: object, block: object, error_feedback: object) -> tuple[str, int, bool]:
    """``(reduction, block, error_feedback)`` validated; each error names its argument."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    wire.check_block(block, "block")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    if reduction in wire.KINDS:
        wire.check_kind(reduction, "reduction")
    elif error_feedback:
        raise ValueError(f"error_feedback needs reduction 'int8' or 'fp8', not {reduction!r}")
    return reduction, block, error_feedback


def _conform(b: _Bucket, i: int, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A gradient the kernels can read (contiguous), or a clear error for one they cannot."""
    where = f"bucket {b.id} param {i} ({_describe_param(p)})"
    if g.layout != torch.strided:
        raise ValueError(f"{where} got a sparse gradient; flatgrad reduces dense gradients only")
    if g.numel() != b.layout.numels[i]:
        raise ValueError(
            f"{where} got a gradient of {g.numel()} elements (shape {tuple(g.shape)}), but the bucket was planned "
            f"for {b.layout.numels[i]}: params must not be resized after the reducer is built"
        )
    if g.dtype != p.dtype:
        raise ValueError(f"{where} got a gradient of dtype {g.dtype}")
    if g.device != b.device:
        raise ValueError(f"{where} got a gradient on {g.device}, the bucket is on {b.device}")
    return g.contiguous()


_STREAMS: dict[torch.device, tuple[Any, Any]] = {}

# Params whose post-accumulate-grad hook belongs to a live reducer: a second one would see the
# gradient the first one's pack already freed, and reduce zeros. Keyed by id (tensors compare
# elementwise), with weak references so that neither params nor reducers are kept alive.
_HOOKED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _hook_owner(p: torch.Tensor) -> "BucketReducer | None":
    entry = _HOOKED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _side_streams(device: torch.device) -> tuple[Any, Any]:
    """The (pack_stream, unpack_stream) pair of ``device``, shared by every bucket there. See [Note: streams]."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]


def _agreement_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the digest tensor lives: a CUDA device when the group's backend needs one (NCCL), else the CPU."""
    name = comm.backend_name(group, torch.device("cpu"))
    if name == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _digest(world_size: int, description: list[tuple], failed: bool) -> torch.Tensor:
    blob = hashlib.sha256(repr((world_size, description)).encode()).digest()
    return torch.tensor([int(failed), len(description), *struct.unpack("<3q", blob[:24])], dtype=torch.int64)


def _agree(
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    description: list[tuple],
    local_error: Exception | None,
    device: torch.device,
) -> None:
    """Check that every rank built the same buckets; raise on every rank if not. See [Note: layout agreement]."""
    mine = _digest(world_size, description, local_error is not None).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.cpu() for g in gathered]
    if all(not bool(r[0]) and torch.equal(r, rows[0]) for r in rows):
        return
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, (None if local_error is None else repr(local_error), description), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(everyone) if err is not None]
    if failed:
        if local_error is not None:
            return  # the caller raises this rank's own error
        r, err = failed[0]
        raise LayoutMismatchError(f"flatgrad: rank {r} failed to set up its BucketReducer: {err} (this is rank {rank})")
    raise LayoutMismatchError(_mismatch_message(rank, [d for _, d in everyone]))


def _mismatch_message(rank: int, descriptions: list[list[tuple]]) -> str:
    """Name the first bucket and param where some rank differs from rank 0."""
    base = descriptions[0]
    for other, desc in enumerate(descriptions):
        if desc == base:
            continue
        message = f"flatgrad: ranks disagree on the gradient buckets (this is rank {rank}): "
        if len(base) != len(desc):
            message += f"rank 0 has {len(base)} buckets, rank {other} has {len(desc)}; "
        return message + _first_difference(base, desc, other)
    return "flatgrad: ranks disagree on the gradient buckets (digests differ, descriptions equal)"


def _first_difference(base: list[tuple], desc: list[tuple], other: int) -> str:
    for b in range(max(len(base), len(desc))):
        if b >= len(base) or b >= len(desc):
            return f"bucket {b} exists on rank {0 if b < len(base) else other} only"
        if base[b] == desc[b]:
            continue
        *settings0, params0 = base[b]
        *settings1, params1 = desc[b]
        for i in range(min(len(params0), len(params1))):
            if params0[i] != params1[i]:
                (s0, d0), (s1, d1) = params0[i], params1[i]
                return f"bucket {b} param {i} has shape {s0} {d0} on rank 0 but shape {s1} {d1} on rank {other}"
        if len(params0) != len(params1):
            return f"bucket {b} has {len(params0)} params on rank 0 and {len(params1)} on rank {other}"
        names = ("layout", "align", "comm dtype", "reduce op", "reduce_scatter method", "reduction")
        for name, v0, v1 in zip(names, settings0, settings1):
            if v0 != v1:
                return f"bucket {b} uses {name} {v0} on rank 0 but {v1} on rank {other}"
    return f"rank 0 and rank {other} differ"
