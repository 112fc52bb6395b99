"""One bucket: its static plan, its per-micro-step state, and its one reduction path.

``Bucket.reduce`` packs the gradients and starts the collective through the bucket's mode, and
the ``InFlight`` it returns waits and unpacks, returning the stats: the one path from gradients to
shard that ``BucketReducer`` (around its streams and launch order) and ZeRO-3 (inside DeepSpeed's
reduce stream) both take. It is two calls because on gloo the unpack of one bucket waits while
later buckets pack; ZeRO-3's host staging moves what arrived and unpacks the copy (``Bucket.unpack``).
See [Note: bucket lifecycle] in docs/design.md.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .. import comm
from ..kernels import UnpackPlan
from ..layout import Layout
from .modes import ReductionMode

__all__ = ["Bucket", "InFlight", "describe_param"]


def describe_param(p: torch.Tensor) -> str:
    """``shape (...) dtype`` of a param, for error messages that name it."""
    return f"shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"


class Bucket:
    """One bucket's static plan, persistent state (residual) and per-micro-step state (views, shard, flight)."""

    __slots__ = (
        "id", "params", "layout", "rank", "device", "comm_dtype", "op", "method", "backend", "unpack_backend", "mode",
        "pack_scale", "unpack_scale", "divide", "pack_plan", "unpack_plan", "wire_kernels", "unpack_wire_kernels",
        "residual", "pieces", "previous", "views", "flight", "shard", "accumulate", "stats", "unpacked", "in_flight", "pack_stream",
        "unpack_stream", "ready", "not_ready", "pending", "launched",
    )  # fmt: skip

    def __init__(
        self,
        bucket_id: int,
        params: tuple[nn.Parameter, ...],
        layout: Layout,
        rank: int,
        *,
        comm_dtype: torch.dtype,
        averaging: comm.Averaging,
        method: str,
        backend: str | None,
        mode: ReductionMode,
        prescale: float,
        postscale: float,
        streams: tuple[Any, Any] | None,
        unpack_backend: str | None = None,
        divide: bool = False,
    ) -> None:
        if divide and not mode.packs_comm_buffer:
            raise TypeError(f"divide needs a mode that packs a comm-dtype buffer, not {type(mode).__name__}")
        self.id = bucket_id
        self.params = params
        self.layout = layout
        self.rank = rank
        self.device = params[0].device
        self.comm_dtype = comm_dtype
        self.op = averaging.op
        self.method = method
        self.backend = backend
        # The unpack's kernels where its shard lives elsewhere than the gradients (a host-side unpack
        # of a staged segment); by default the bucket's own backend.
        self.unpack_backend = backend if unpack_backend is None else unpack_backend
        self.mode = mode
        self.pack_scale = averaging.prescale * float(prescale)
        self.unpack_scale = averaging.postscale * float(postscale)
        # Stock ZeRO-3's divide of the packed buffer by W, where folding it into the pack's scale would change
        # bits (see [Note: ZeRO-3 reduce path] in docs/design.md).
        self.divide = divide
        # One fast path for pack and unpack: the kernels' plans, validated once (see [Note: plans] in
        # docs/design.md). A missing gradient is passed as None and packs as zeros.
        self.pack_plan = mode.pack_plan(layout, len(params), comm_dtype, self.device, backend)
        self.unpack_plan: Any = None  # made with the first shard
        self.wire_kernels = mode.wire_kernels(backend)  # the collective's stages run these
        # The unpack's: the host's where a staged segment is unpacked on the host.
        same = self.unpack_backend == backend
        self.unpack_wire_kernels = self.wire_kernels if same else mode.wire_kernels(self.unpack_backend)
        self.residual = mode.residual(layout, self.device)
        self.pieces = tuple(layout.pieces(rank))
        self.previous: Bucket | None = None  # the comm buffer's previous occupant: see [Note: comm buffer pool]
        self.views: Any = None  # the mode's views of this micro-step's pool buffers
        self.flight: InFlight | None = None
        self.shard: torch.Tensor | None = None
        self.accumulate = False
        self.stats: torch.Tensor | None = None
        self.pack_stream = self.unpack_stream = self.unpacked = None
        if streams is not None:
            self.pack_stream, self.unpack_stream = streams
            self.unpacked = torch.cuda.Event()
        self.not_ready = [False] * len(params)
        self.ready = list(self.not_ready)
        self.reset()

    def reset(self) -> None:
        """Back to the start of a micro-step: nothing ready, nothing launched."""
        self.ready[:] = self.not_ready
        self.pending = len(self.params)
        self.launched = False
        self.in_flight = False
        self.flight = None

    def bind(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Take this micro-step's views of the pool buffers (one per purpose of the mode's ``pool_slots``)."""
        self.views = self.mode.bind(self, buffers)

    def unbind(self) -> None:
        """Drop the views of the pool buffers (the pools are given back)."""
        self.views = None

    def unpack_plan_for(self, shard: Any) -> Any:
        """The unpack plan, made with the first shard (one tensor, or one per piece) and kept."""
        if self.unpack_plan is None:
            self.unpack_plan = UnpackPlan(self.layout, self.rank, shard, backend=self.unpack_backend)
        return self.unpack_plan

    def grads(self) -> list[torch.Tensor | None]:
        """The bucket's gradients as pack inputs: missing ones are None (packed as zeros), odd ones are checked."""
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and not (
                g.dtype == p.dtype
                and g.device == self.device
                and g.numel() == self.layout.numels[i]
                and g.is_contiguous()
            ):
                g = self._conform(i, p, g)
            grads.append(g)
        return grads

    def _conform(self, i: int, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A gradient the kernels can read (contiguous), or a clear error for one they cannot."""
        where = f"bucket {self.id} param {i} ({describe_param(p)})"
        if g.layout != torch.strided:
            raise ValueError(f"{where} got a sparse gradient; flatgrad reduces dense gradients only")
        if g.numel() != self.layout.numels[i]:
            raise ValueError(
                f"{where} got a gradient of {g.numel()} elements (shape {tuple(g.shape)}), but the bucket was planned "
                f"for {self.layout.numels[i]}: params must not be resized after the reducer is built"
            )
        if g.dtype != p.dtype:
            raise ValueError(f"{where} got a gradient of dtype {g.dtype}")
        if g.device != self.device:
            raise ValueError(f"{where} got a gradient on {g.device}, the bucket is on {self.device}")
        return g.contiguous()

    def reduce(
        self,
        grads: list[torch.Tensor | None],
        group: Any,
        collectives: comm.Collectives | None,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> "InFlight":
        """Pack ``grads`` and start the collective, through the mode; the ``InFlight`` waits and unpacks.

        The views are the bound ones, or, with ``buffers``, views of those for this reduction only.
        A failure to start names the mode, the bucket and the rank.
        """
        views = self.views if buffers is None else self.mode.bind(self, buffers)
        if views is None:
            raise RuntimeError(f"bucket {self.id} has no comm buffers bound: bind() them or pass buffers=")
        self.mode.pack(self, views, grads)
        try:
            work = self.mode.start(self, views, group, collectives)
        except Exception as exc:
            raise RuntimeError(
                f"flatgrad: the {self.mode.name} of bucket {self.id} failed on rank {self.rank}: {exc}"
            ) from exc
        return InFlight(self, views, work)

    def unpack(self, received: torch.Tensor, shard: Any, accumulate: bool, collect_stats: bool) -> torch.Tensor | None:
        """Write (``accumulate=False``) or add ``received`` into ``shard`` through the mode; the stats when asked.

        ``InFlight.unpack`` calls it with what arrived; a caller that moved that elsewhere (ZeRO-3's host
        staging) calls it with the copy.
        """
        return self.mode.unpack(self, received, shard, accumulate, collect_stats)


class InFlight:
    """One bucket's started collective: wait for it, then unpack what arrived into a shard, returning the stats."""

    __slots__ = ("bucket", "views", "work")

    def __init__(self, bucket: Bucket, views: Any, work: Any) -> None:
        self.bucket = bucket
        self.views = views
        self.work = work

    @property
    def received(self) -> torch.Tensor:
        """What the unpack reads (a caller may move it first, e.g. to the host, and pass the copy to ``Bucket.unpack``)."""
        return self.views.received

    def is_completed(self) -> bool:
        """Whether the collective is done (a two-stage one starts its second stage when it finds the first done)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        """Wait for the collective (on CUDA: order the current stream after it); a failure names bucket and rank."""
        if self.work is None:
            return
        b = self.bucket
        try:
            self.work.wait()
        except Exception as exc:
            raise RuntimeError(
                f"flatgrad: {b.mode.name} of bucket {b.id} failed on rank {b.rank} (world size {b.layout.world_size}): {exc}"
            ) from exc

    def unpack(self, shard: Any, accumulate: bool, collect_stats: bool) -> torch.Tensor | None:
        """Write (``accumulate=False``) or add what arrived into ``shard``; the stats when asked."""
        return self.bucket.unpack(self.views.received, shard, accumulate, collect_stats)
