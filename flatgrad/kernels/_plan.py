"""Plans: ``pack`` and ``unpack`` for one layout, validated once and called every step.

A plan validates once and keeps the run table and a tensor table of
``(address, dtype code)`` rows on the device, so that a call costs one C check
of the tensors and one op, and uploads only when an address changed. See
[Note: plans] in docs/design.md.

Its device table is ordered across streams with per-stream CUDA events, since
any stream may call it. See [Note: table streams] in docs/design.md.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence, Union

import torch

from ..layout import Layout
from . import _tables
from ._backends import resolve_backend

__all__ = [
    "PackPlan", "UnpackPlan", "DTYPES", "check_tensor", "check_scale", "check_pack_tensors", "normalize_device",
    "overlaps",
]  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NONE = -1  # dtype code of a missing tensor, and "any supported dtype" in a plan's expectations
_COMPILED = ("cpu", "cuda")

MaybeTensor = Optional[torch.Tensor]


def normalize_device(device: torch.device | str) -> torch.device:
    """``device`` as a tensor on it reports its device: ``cuda`` (no index) is the current CUDA device.

    Plans compare every tensor's device with theirs, so ``"cuda"``, ``"cuda:0"`` and
    ``torch.device("cuda", 0)`` must all become the device the tensors report
    (``cuda:N``; a CPU tensor's device is ``cpu``, with no index, so ``cpu:0`` is ``cpu``).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_tensor(name: str, t: object, *, device: torch.device | None = None, numel: int | None = None) -> torch.Tensor:
    """``t`` as a dense, contiguous fp32/bf16/fp16 tensor (on ``device``, of ``numel``), or an error naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: fp32, bf16, fp16")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, the layout expects {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
    return t


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` intersects."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_scale(scale: object) -> float:
    """``scale`` as a finite float, or an error."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_pack_tensors(
    layout: Layout, tensors: Sequence[MaybeTensor], device: torch.device | str | None, no_device: str
) -> tuple[torch.device, list[tuple[int, torch.Tensor]]]:
    """Check pack's layout and tensors (``None`` allowed) on ``device`` (default: the first tensor's).

    Returns the device and the ``(index, tensor)`` pairs that are not None;
    ``no_device`` is the error when nothing gives a device.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("tensors must be a list or tuple of tensors (or None)")
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"got {len(tensors)} tensors, the layout has {layout.num_tensors}")
    present = [(i, t) for i, t in enumerate(tensors) if t is not None]
    if device is None:
        if not present:
            raise ValueError(no_device)
        device = check_tensor(f"tensors[{present[0][0]}]", present[0][1]).device
    device = normalize_device(device)
    for i, t in present:
        check_tensor(f"tensors[{i}]", t, device=device, numel=layout.numels[i])
    return device, present


def _refresh_py(
    tensors: Sequence[MaybeTensor], name: str, meta: torch.Tensor, table: torch.Tensor,
    guard: torch.Tensor, guard_name: str, allow_none: bool,
) -> int:  # fmt: skip
    """``_C.refresh_table`` in Python, for a build without the extension (the ``torch`` backend only)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if len(tensors) != meta.shape[0]:
        raise ValueError(f"got {len(tensors)} {name}, the plan has {meta.shape[0]}")
    changed = 0
    for i, t in enumerate(tensors):
        address, code = 0, _NONE
        if t is None:
            if not allow_none:
                raise TypeError(f"{name}[{i}] is None; only pack takes None (a missing tensor packs as zeros)")
        else:
            numel, dtype = (int(x) for x in meta[i])
            check_tensor(f"{name}[{i}]", t, device=guard.device, numel=numel)
            if dtype != _NONE and _CODES[t.dtype] != dtype:
                raise ValueError(f"{name}[{i}] has dtype {t.dtype}, the plan was made for {DTYPES[dtype]}")
            if overlaps(t, guard):
                raise ValueError(f"{name}[{i}] overlaps {guard_name}; it cannot run in place")
            if numel > 0:
                address, code = t.data_ptr(), _CODES[t.dtype]
        if (int(table[i, 0]), int(table[i, 1])) != (address, code):
            table[i, 0], table[i, 1] = address, code
            changed += 1
    return changed


def _refresher():
    try:
        from .. import _C
    except ImportError:
        return _refresh_py
    return _C.refresh_table


class _TensorTable:
    """The host and device copies of a plan's tensor table; see [Note: plans]."""

    def __init__(self, expected: Sequence[tuple[int, int]], device: torch.device, backend: str) -> None:
        count = len(expected)
        self.meta = torch.tensor(list(expected), dtype=torch.int64).reshape(count, 2)
        self.host = torch.zeros(count, 2, dtype=torch.int64)
        self.host[:, 1] = _NONE
        self.device = device
        # The compiled CUDA backend reads the table on the device; every other backend reads nothing (or the host copy).
        self.on_device = torch.zeros(count, 2, dtype=torch.int64, device=device) if backend == "cuda" else self.host
        self.uploads = 0
        self._stale = True  # the device copy may differ from the host one (set after a failed refresh too)
        self._refresh = _refresher()
        self._streams = self.on_device is not self.host  # a device table: ordered across streams by events
        if self._streams:  # see [Note: table streams]
            stream = torch.cuda.current_stream(device)
            self._written = torch.cuda.Event()
            self._written.record(stream)  # the zeros above
            self._ordered = {stream}  # the streams ordered after the last write
            self._reads: dict = {}  # stream -> event after the last kernel there that read the table

    def refresh(self, tensors: Sequence[MaybeTensor], name: str, guard: torch.Tensor, guard_name: str,
                allow_none: bool) -> bool:  # fmt: skip
        """Check ``tensors`` against the plan and write their addresses into the host table.

        Returns whether the device table needs an ``upload()`` (an address changed).
        """
        try:
            changed = self._refresh(tensors, name, self.meta, self.host, guard, guard_name, allow_none)
        except BaseException:
            self._stale = True  # some rows may have been rewritten before the error
            raise
        return bool(changed) or self._stale

    @property
    def nbytes(self) -> int:
        """Bytes of the table's host, device and metadata copies."""
        copies = [self.meta, self.host] + ([self.on_device] if self.on_device is not self.host else [])
        return sum(t.numel() * t.element_size() for t in copies)

    def invalidate(self) -> None:
        """Forget the addresses, so that the next call checks and uploads afresh."""
        self.host[:, 0] = 0
        self._stale = True

    def upload(self) -> None:
        """Make the device table the host one (CUDA: one asynchronous copy on the current stream)."""
        self._stale = True  # until the copy is queued: a refused upload leaves the next call to retry
        if self.on_device is not self.host:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "flatgrad plan: the tensors' addresses changed during CUDA graph capture, which needs a table "
                    "upload; call the plan once with these tensors before capturing"
                )
            stream = torch.cuda.current_stream(self.device)
            self._after_write(stream)
            for other, read in self._reads.items():
                if other != stream:
                    stream.wait_event(read)  # a kernel queued there may still read the rows rewritten here
            self.on_device.copy_(self.host.pin_memory(), non_blocking=True)
            self._written.record(stream)
            self._ordered = {stream}
        self.uploads += 1
        self._stale = False

    def _after_write(self, stream) -> None:
        if stream not in self._ordered:
            stream.wait_event(self._written)
            self._ordered.add(stream)

    def acquire(self) -> torch.Tensor:
        """The table a kernel reads, once the current stream is ordered after its last write.

        Pair every call with ``release()`` after the kernel is queued. See [Note: table streams].
        """
        if self._streams and not torch.cuda.is_current_stream_capturing():
            self._after_write(torch.cuda.current_stream(self.device))
        return self.on_device

    def release(self) -> None:
        """Record that a kernel on the current stream read the table (a later upload elsewhere waits for it)."""
        if self._streams and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(self.device)
            read = self._reads.get(stream)
            if read is None:
                read = self._reads[stream] = torch.cuda.Event()
            read.record(stream)


def _resolve(backend: str | None, device: torch.device) -> tuple[object, str]:
    impl = resolve_backend(backend, device)
    return impl, impl.name


class _Plan:
    """What pack and unpack plans share: the tensor table and its counters."""

    _table: _TensorTable

    @property
    def uploads(self) -> int:
        return self._table.uploads

    @property
    def table_bytes(self) -> int:
        """Bytes the plan's tensor table holds (host, device and metadata copies)."""
        return self._table.nbytes


class PackPlan(_Plan):
    """``flatgrad.pack`` for one layout and one list of tensor shapes: validated once, called every step.

    ``plan(tensors, out)`` packs as ``flatgrad.pack(tensors, layout, out)`` does,
    for ``tensors`` of the example's numels, dtypes and device: the same list
    or a new one. ``None`` (in the example or in a call) is a missing tensor,
    packed as zeros; a slot that was ``None`` in the example takes any
    supported dtype later. See [Note: plans].

    Attributes:
        layout: the layout.
        device: where the tensors and the buffer live.
        dtype: the buffer's dtype when a call passes no ``out``.
        backend: the kernel backend's name.
        open_slots: some example entry was ``None``, so that slot takes any supported dtype.
        uploads: how many times the tensor table was (re)written: the first
            call, then once per call whose data pointers changed (CUDA: one
            host-to-device copy each).
    """

    def __init__(
        self,
        layout: Layout,
        tensors: Sequence[MaybeTensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        no_device = "a PackPlan of zero tensors (or only None) needs device= (nothing gives the device)"
        device, present = check_pack_tensors(layout, tensors, device, no_device)
        if dtype is None:
            dtypes = {t.dtype for _, t in present}
            dtype = dtypes.pop() if len(dtypes) == 1 else None
        elif dtype not in DTYPES:
            raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {dtype}")
        self.layout, self.device, self.dtype = layout, device, dtype
        self._impl, self.backend = _resolve(backend, device)
        expected = [(n, _NONE if t is None else _CODES[t.dtype]) for n, t in zip(layout.numels, tensors)]
        self.open_slots = len(present) < len(tensors)  # a slot None in the example takes any dtype later
        self._table = _TensorTable(expected, device, self.backend)
        self._lock = threading.Lock()
        if self.backend in _COMPILED:
            self._runs = _tables.pack_runs(layout, device, self._impl.max_len)
            self._op = torch.ops.flatgrad._pack_table.default

    def _check_out(self, out: object, dtype: torch.dtype | None) -> torch.Tensor:
        layout = self.layout
        if out is None:
            dtype = dtype or self.dtype
            if dtype is None:
                raise ValueError("the tensors have mixed dtypes; pass dtype= (or out=) for the buffer")
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {dtype}")
            return torch.empty(layout.numel, dtype=dtype, device=self.device)
        check_tensor("out", out, device=self.device)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
        if out.dim() != 1 or out.numel() != layout.numel:
            raise ValueError(f"out must be 1-D with {layout.numel} elements, got shape {tuple(out.shape)}")
        return out

    def __call__(
        self,
        tensors: Sequence[MaybeTensor],
        out: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Pack ``tensors`` (``None``: zeros) into ``out`` (or a new buffer), scaled; returns the buffer."""
        scale = check_scale(scale)
        out = self._check_out(out, dtype)
        with self._lock:
            if self._table.refresh(tensors, "tensors", out, "out", True):
                self._table.upload()
            if self.backend in _COMPILED:
                try:
                    self._op(self._table.acquire(), self._runs, out, scale)
                finally:
                    self._table.release()
            else:
                self._impl.pack(tensors, self.layout, out, scale)
        return out


OutArg = Union[torch.Tensor, Sequence[torch.Tensor]]


class UnpackPlan(_Plan):
    """``flatgrad.unpack`` for one layout, rank and form of ``out``: validated once, called every step.

    ``plan(shard, out)`` unpacks as ``flatgrad.unpack(shard, layout, rank, out)``
    does. ``out`` has the example's form: one tensor of ``layout.shard_numel``
    elements, or one tensor per ``layout.pieces(rank)`` entry, all of the
    example's dtype; the same tensors or new ones. See [Note: plans].

    Attributes:
        layout: the layout.
        rank: the rank whose shard is unpacked.
        device: where the shard and the outputs live.
        per_piece: ``out`` is a list with one tensor per piece.
        backend: the kernel backend's name.
        uploads: how many times the output table was (re)written.
    """

    def __init__(self, layout: Layout, rank: int, out: OutArg, *, backend: str | None = None) -> None:
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
        rank = layout._check_rank(rank)
        if isinstance(out, torch.Tensor):
            check_tensor("out", out, numel=layout.shard_numel)
            if out.dim() != 1:
                raise ValueError(f"out must be 1-D, got shape {tuple(out.shape)}")
            outs, numels, per_piece = [out], [layout.shard_numel], False
        elif isinstance(out, Sequence):
            pieces = layout.pieces(rank)
            if len(out) != len(pieces):
                raise ValueError(f"out has {len(out)} tensors, rank {rank} owns {len(pieces)} pieces")
            outs, numels, per_piece = list(out), [p.length for p in pieces], True
        else:
            raise TypeError(f"out must be a tensor or a list of tensors, got {type(out).__name__}")
        device = outs[0].device if outs else torch.device("cpu")
        for k, (o, n) in enumerate(zip(outs, numels)):
            name = f"out[{k}]" if per_piece else "out"
            check_tensor(name, o, device=device, numel=n)
            if o.dtype != outs[0].dtype:
                raise ValueError(f"out[{k}] has dtype {o.dtype}, out[0] has {outs[0].dtype}; use one dtype")
        _check_distinct(outs, per_piece)
        self.layout, self.rank, self.device, self.per_piece = layout, rank, device, per_piece
        self.dtype = outs[0].dtype if outs else torch.float32
        self._impl, self.backend = _resolve(backend, device)
        self._table = _TensorTable([(n, _CODES[self.dtype]) for n in numels], device, self.backend)
        self._lock = threading.Lock()
        if self.backend in _COMPILED:
            self._runs = _tables.unpack_runs(layout, rank, per_piece, device, self._impl.max_len)
            self._op = torch.ops.flatgrad._unpack_table.default

    def __call__(
        self,
        shard: torch.Tensor,
        out: OutArg,
        *,
        scale: float = 1.0,
        accumulate: bool = False,
        return_stats: bool = False,
    ) -> torch.Tensor | None:
        """Write the shard into ``out``; with ``return_stats`` returns fp32 ``[sum_sq, nonfinite_count]``."""
        scale = check_scale(scale)
        check_tensor("shard", shard, device=self.device, numel=self.layout.shard_numel)
        if shard.dim() != 1:
            raise ValueError(f"shard must be 1-D, got shape {tuple(shard.shape)}")
        if isinstance(out, torch.Tensor) == self.per_piece:
            form = "a list with one tensor per piece" if self.per_piece else "one tensor"
            raise TypeError(f"out must be {form}, as when the plan was made")
        outs = out if self.per_piece else (out,)
        with self._lock:
            if self._table.refresh(outs, "out", shard, "shard", False):
                try:
                    _check_distinct(outs, self.per_piece)  # new outputs: the pairwise check, only then
                except ValueError:
                    self._table.invalidate()
                    raise
                self._table.upload()
            if self.backend in _COMPILED:
                try:
                    table = self._table.acquire()
                    result = self._op(shard, self._runs, table, self.dtype, scale, accumulate, return_stats)
                finally:
                    self._table.release()
                return result if return_stats else None
            return self._impl.unpack(shard, self.layout, self.rank, list(outs), self.per_piece, scale, accumulate,
                                     return_stats)  # fmt: skip


def _check_distinct(outs: Sequence[torch.Tensor], per_piece: bool) -> None:
    if not per_piece:
        return
    order = sorted(range(len(outs)), key=lambda k: (outs[k].data_ptr(), k))
    for a, b in zip(order, order[1:]):
        if overlaps(outs[a], outs[b]):
            raise ValueError(f"out[{a}] and out[{b}] overlap; every piece needs its own memory")
