"""One bucket: its static plan, its per-micro-step state, and the pack -> collective -> unpack it runs.

The reducer decides when a bucket goes and on which stream; ``pack``, ``start``
and ``unpack`` here are the bucket's own steps, each delegated to its
``ReductionMode``. See [Note: bucket lifecycle] in ``flatgrad.reducer.reducer``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import comm
from ..layout import Layout
from .modes import ReductionMode

__all__ = ["Bucket", "describe_param"]


def describe_param(p: torch.Tensor) -> str:
    """``shape (...) dtype`` of a param, for error messages that name it."""
    return f"shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"


class Bucket:
    """One bucket's static plan, persistent buffers and per-micro-step state."""

    __slots__ = (
        "id", "params", "layout", "device", "comm_dtype", "op", "method", "backend", "unpack_backend", "mode", "pack_scale",
        "unpack_scale", "pack_plan", "unpack_plan", "wire_kernels", "residual", "pieces", "previous",
        "input", "input_chunks", "output", "stage", "stage_chunks", "stage_recv", "recv", "wire_send", "wire_recv", "rail_send", "rail_recv",
        "shard", "accumulate", "stats", "unpacked", "in_flight", "pack_stream", "unpack_stream",
        "ready", "not_ready", "pending", "launched", "work",
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
    ) -> None:
        self.id = bucket_id
        self.params = params
        self.layout = layout
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
        # One fast path for pack and unpack: the kernels' plans, validated once (see [Note: plans] in
        # flatgrad/kernels/_plan.py). A missing gradient is passed as None and packs as zeros.
        self.pack_plan = mode.pack_plan(layout, len(params), comm_dtype, self.device, backend)
        self.unpack_plan = None  # made with the first shard
        self.wire_kernels = None
        self.residual = mode.residual(layout, self.device)
        mode.prepare(self)
        self.pieces = tuple(layout.pieces(rank))
        self.previous: Bucket | None = None  # the comm buffer's previous occupant: see [Note: comm buffer pool]
        self.input = self.input_chunks = self.output = self.stage = self.stage_chunks = self.stage_recv = None
        self.recv = self.wire_send = self.wire_recv = self.rail_send = self.rail_recv = None
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
        self.work = None

    def unbind(self) -> None:
        """Drop the views of the pool buffers (the pools are given back)."""
        self.input = self.input_chunks = self.output = self.stage = self.stage_chunks = self.stage_recv = None
        self.recv = self.wire_send = self.wire_recv = self.rail_send = self.rail_recv = None

    def grads(self) -> list[torch.Tensor | None]:
        """The bucket's gradients as pack inputs: missing ones are None (packed as zeros), odd ones are checked."""
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and not (
                g.dtype == p.dtype and g.device == self.device and g.numel() == self.layout.numels[i] and g.is_contiguous()
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

    def pack(self, grads: list[torch.Tensor | None]) -> None:
        """Fill what the collective sends (the comm buffer, or the quantized send wire)."""
        self.mode.pack(self, grads)

    def start(self, group: Any, rank: int, collectives: comm.Collectives | None) -> Any:
        """Start the bucket's collective; a failure names the mode, the bucket and the rank."""
        try:
            return self.mode.start(self, group, collectives)
        except Exception as exc:
            raise RuntimeError(f"flatgrad: the {self.mode.name} of bucket {self.id} failed on rank {rank}: {exc}") from exc

    def unpack(self, rank: int, world_size: int, collect_stats: bool) -> None:
        """Write (first micro-step of a window) or add what arrived into the shard, with its stats."""
        self.stats = self.mode.unpack(self, rank, world_size, collect_stats)
        self.accumulate = True
