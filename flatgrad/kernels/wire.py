"""The wire kernels of the all_to_all reduction modes, on every backend.

Public wrappers validate their arguments once, then dispatch to a backend:

* ``torch``: ``wire_reference`` (the oracle; see [Note: wire format] and
  [Note: wire arithmetic contract] in docs/design.md);
* ``cpu`` / ``cuda``: the compiled ops ``torch.ops.flatgrad.wire_*``
  (``csrc/wire.cpp``, ``csrc/cuda/wire.cu``);
* ``triton``: ``wire_triton``.

``PackQuantizePlan`` (and ``pack_quantize``, which makes one per call) is the
int8/fp8 modes' fused pack side: the per-parameter gradients straight into the
quantized wire, with no packed buffer (see [Note: pack-quantize] in
docs/design.md). It is a plan as ``PackPlan`` is (see [Note: plans] in
docs/design.md): same checks, same tensor table, same cached run table.

``requantize`` is ``dequantize_sum`` and ``quantize`` fused, the step between the
two quantized stages of ``qgz_int8`` / ``qgz_fp8``: received wire segments in, a
wire of their fp32 sum out, with no fp32 partial buffer (see [Note: requantize]
in docs/design.md).

``WireKernels`` (from ``wire_kernels(name)``) skips the checks; the reducer
validates its buffers once at construction and calls it on the hot path.

Both unpacks (``sum_sources``, ``dequantize_sum``) can also return the stats of
what they wrote, in the same pass, as the regular ``unpack`` does: fp32
``[sum_sq, nonfinite_count]`` from ``WireKernels``, an ``UnpackStats`` from the
public wrappers (see [Note: wire arithmetic contract]).
"""

from __future__ import annotations

import functools
import threading
from typing import Protocol, Sequence

import torch

from ..layout import Layout
from . import UnpackStats, _tables, wire_reference
from ._plan import (
    _CODES, _COMPILED, _NONE, DTYPES, MaybeTensor, _Plan, _resolve, _TensorTable, check_pack_tensors, check_scale,
)  # fmt: skip
from .wire_reference import KINDS, QMAX, nblocks, segment_bytes

__all__ = [
    "KINDS", "QMAX", "MIN_BLOCK", "MAX_BLOCK", "PackQuantizePlan", "WireKernels", "check_block", "check_kind",
    "dequantize_sum", "nblocks", "pack_quantize", "quantize", "requantize", "segment_bytes", "sum_sources",
    "wire_kernels",
]  # fmt: skip

MIN_BLOCK, MAX_BLOCK = 32, 4096
_KIND_CODES = {"int8": 0, "fp8": 1}


def check_block(block: object, key: str = "block") -> int:
    """``block`` if it is a power of two in [32, 4096], else a ValueError naming ``key``."""
    if isinstance(block, bool) or not isinstance(block, int) or not MIN_BLOCK <= block <= MAX_BLOCK or block & (block - 1):
        raise ValueError(f"{key} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block!r}")
    return block


def check_kind(kind: object, key: str = "kind") -> str:
    """``kind`` if it is a quantized wire kind this torch supports, else a ValueError naming ``key``."""
    if kind not in KINDS:
        raise ValueError(f"{key} must be one of {KINDS}, got {kind!r}")
    if kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"{key}='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    return kind


class WireKernels(Protocol):
    name: str

    def sum_sources(
        self, recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float, accumulate: bool, stats: bool = False
    ) -> torch.Tensor | None: ...

    def quantize(
        self, packed: torch.Tensor, world_size: int, block: int, kind: str, wire: torch.Tensor, residual: torch.Tensor | None
    ) -> None: ...

    def dequantize_sum(
        self, wire: torch.Tensor, world_size: int, block: int, kind: str, out: torch.Tensor, scale: float,
        accumulate: bool, stats: bool = False,
    ) -> torch.Tensor | None: ...  # fmt: skip

    def requantize(
        self, wire_in: torch.Tensor, sources: int, block: int, kind: str, wire_out: torch.Tensor, segments: int,
        shard_numel: int, residual: torch.Tensor | None,
    ) -> None: ...  # fmt: skip

    # torch and triton only: the compiled backends run PackQuantizePlan's table op instead.
    def pack_quantize(
        self, tensors: Sequence[MaybeTensor], layout: Layout, scale: float, block: int, kind: str, wire: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> None: ...  # fmt: skip


class _Reference:
    name = "torch"
    sum_sources = staticmethod(wire_reference.sum_sources)
    quantize = staticmethod(wire_reference.quantize)
    pack_quantize = staticmethod(wire_reference.pack_quantize)
    dequantize_sum = staticmethod(wire_reference.dequantize_sum)
    requantize = staticmethod(wire_reference.requantize)


class _Compiled:
    def __init__(self, name: str) -> None:
        self.name = name

    def sum_sources(
        self, recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float, accumulate: bool, stats: bool = False
    ) -> torch.Tensor | None:
        result = torch.ops.flatgrad.wire_sum(recv, world_size, out, scale, accumulate, stats)
        return result if stats else None

    def quantize(
        self, packed: torch.Tensor, world_size: int, block: int, kind: str, wire: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        torch.ops.flatgrad.wire_quantize(packed, world_size, block, _KIND_CODES[kind], wire, residual)

    def dequantize_sum(
        self, wire: torch.Tensor, world_size: int, block: int, kind: str, out: torch.Tensor, scale: float,
        accumulate: bool, stats: bool = False,
    ) -> torch.Tensor | None:  # fmt: skip
        result = torch.ops.flatgrad.wire_dequantize_sum(
            wire, world_size, block, _KIND_CODES[kind], out, scale, accumulate, stats
        )
        return result if stats else None

    def requantize(
        self, wire_in: torch.Tensor, sources: int, block: int, kind: str, wire_out: torch.Tensor, segments: int,
        shard_numel: int, residual: torch.Tensor | None,
    ) -> None:  # fmt: skip
        torch.ops.flatgrad.wire_requantize(
            wire_in, sources, block, _KIND_CODES[kind], wire_out, segments, shard_numel, residual
        )


@functools.lru_cache(maxsize=None)
def _register_fakes() -> None:
    """Shape-only implementations of the compiled wire ops (they return nothing), for ``torch.compile``."""

    def _stats_like(out: torch.Tensor, stats: bool) -> torch.Tensor:
        return out.new_empty(2 if stats else 0, dtype=torch.float32)

    @torch.library.register_fake("flatgrad::wire_sum")
    def _sum_fake(
        recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float, accumulate: bool, stats: bool
    ) -> torch.Tensor:
        return _stats_like(out, stats)

    @torch.library.register_fake("flatgrad::wire_quantize")
    def _quantize_fake(
        packed: torch.Tensor, world_size: int, block: int, kind: int, wire: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        return None

    @torch.library.register_fake("flatgrad::_pack_quantize_table")
    def _pack_quantize_fake(
        table: torch.Tensor, runs: torch.Tensor, numel: int, world_size: int, block: int, kind: int, scale: float,
        wire: torch.Tensor, residual: torch.Tensor | None,
    ) -> None:  # fmt: skip
        return None

    @torch.library.register_fake("flatgrad::wire_dequantize_sum")
    def _dequantize_sum_fake(
        wire: torch.Tensor, world_size: int, block: int, kind: int, out: torch.Tensor, scale: float, accumulate: bool,
        stats: bool,
    ) -> torch.Tensor:  # fmt: skip
        return _stats_like(out, stats)

    @torch.library.register_fake("flatgrad::wire_requantize")
    def _requantize_fake(
        wire_in: torch.Tensor, sources: int, block: int, kind: int, wire_out: torch.Tensor, segments: int,
        shard_numel: int, residual: torch.Tensor | None,
    ) -> None:  # fmt: skip
        return None


@functools.lru_cache(maxsize=None)
def wire_kernels(name: str) -> WireKernels:
    """The wire kernels of backend ``name`` (``torch``, ``cpu``, ``cuda``, ``triton``)."""
    if name == "torch":
        return _Reference()
    if name in ("cpu", "cuda"):
        from . import compiled

        missing = compiled._load()
        if missing:
            raise RuntimeError(f"the {name} wire kernels need {missing}")
        if not hasattr(torch.ops.flatgrad, "_pack_quantize_table"):
            raise RuntimeError(
                "flatgrad._C lacks wire kernels (built before csrc/pack_quantize.cpp existed): rebuild it"
            )
        if not hasattr(torch.ops.flatgrad, "wire_requantize"):
            raise RuntimeError(
                "flatgrad._C lacks flatgrad::wire_requantize (an older build of csrc/wire.cpp): rebuild it "
                "(python setup.py build_ext --inplace)"
            )
        _register_fakes()
        return _Compiled(name)
    if name == "triton":
        from . import wire_triton

        return wire_triton.Backend()
    raise ValueError(f"unknown wire backend {name!r}")


def _backend(backend: str | None, device: torch.device) -> WireKernels:
    if backend is None:
        backend = "cuda" if device.type == "cuda" else "cpu"
    return wire_kernels(backend)


def _check_world(world_size: object, numel: int, what: str) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if numel % world_size:
        raise ValueError(f"{what} has {numel} elements, not a multiple of world_size {world_size}")
    return world_size


def _check_flat(t: torch.Tensor, what: str, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{what} has dtype {t.dtype}; expected one of {dtypes}")


def _stats(result: torch.Tensor | None) -> UnpackStats | None:
    return None if result is None else UnpackStats(result[0], result[1] > 0)


def sum_sources(
    recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float = 1.0, accumulate: bool = False,
    backend: str | None = None, return_stats: bool = False,
) -> UnpackStats | None:  # fmt: skip
    """``out (=|+=) scale * sum_w float32(recv chunk w)``, fp32, rank order (``exact`` mode's unpack).

    With ``return_stats`` returns the sum of squares and a non-finite flag of ``out`` as written.
    """
    _check_flat(recv, "recv", DTYPES)
    _check_flat(out, "out", DTYPES)
    _check_world(world_size, recv.numel(), "recv")
    if recv.numel() != world_size * out.numel() or recv.device != out.device:
        raise ValueError(f"recv must hold world_size * out.numel() elements on out's device, got {recv.numel()}")
    result = _backend(backend, out.device).sum_sources(
        recv, world_size, out, float(scale), bool(accumulate), bool(return_stats)
    )
    return _stats(result)


def _check_wire_aligned(wire: torch.Tensor, key: str = "wire") -> None:
    """The fp32 scales are accessed in place, 16-byte multiples from the wire's start (see [Note: wire format])."""
    if wire.data_ptr() % 4:
        raise ValueError(
            f"{key} must start at a 4-byte aligned address (its fp32 scales are accessed in place), got "
            f"{wire.data_ptr():#x}; slice it at a multiple of 4 bytes"
        )


def quantize(
    packed: torch.Tensor, world_size: int, block: int, kind: str, wire: torch.Tensor,
    residual: torch.Tensor | None = None, backend: str | None = None,
) -> None:  # fmt: skip
    """Write ``packed``'s ``W`` chunks into the quantized ``wire`` (see [Note: wire format])."""
    _check_flat(packed, "packed", DTYPES)
    _check_world(world_size, packed.numel(), "packed")
    check_block(block)
    check_kind(kind)
    s = packed.numel() // world_size
    _check_flat(wire, "wire", (torch.uint8,))
    _check_wire_aligned(wire)
    if wire.numel() < world_size * segment_bytes(s, block) or wire.device != packed.device:
        raise ValueError(f"wire needs {world_size * segment_bytes(s, block)} bytes on packed's device")
    if residual is not None:
        _check_flat(residual, "residual", (torch.float32,))
        if residual.numel() != packed.numel() or residual.device != packed.device:
            raise ValueError("residual must be fp32, as large as packed, on its device")
    _backend(backend, packed.device).quantize(packed, world_size, block, kind, wire, residual)


def dequantize_sum(
    wire: torch.Tensor, world_size: int, block: int, kind: str, out: torch.Tensor, scale: float = 1.0,
    accumulate: bool = False, backend: str | None = None, return_stats: bool = False,
) -> UnpackStats | None:  # fmt: skip
    """``out (=|+=) scale * sum_w dequantize(segment w)``, fp32, rank order (int8/fp8 modes' unpack).

    With ``return_stats`` returns the sum of squares and a non-finite flag of ``out`` as written.
    """
    _check_flat(wire, "wire", (torch.uint8,))
    _check_wire_aligned(wire)
    _check_flat(out, "out", DTYPES)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    check_block(block)
    check_kind(kind)
    if wire.numel() < world_size * segment_bytes(out.numel(), block) or wire.device != out.device:
        raise ValueError(f"wire needs {world_size * segment_bytes(out.numel(), block)} bytes on out's device")
    result = _backend(backend, out.device).dequantize_sum(
        wire, world_size, block, kind, out, float(scale), bool(accumulate), bool(return_stats)
    )
    return _stats(result)


def requantize(
    wire_in: torch.Tensor, sources: int, block: int, kind: str, wire_out: torch.Tensor, segments: int,
    shard_numel: int, residual: torch.Tensor | None = None, backend: str | None = None,
) -> None:  # fmt: skip
    """Quantize the fp32 sum of ``wire_in``'s ``sources`` segments into ``segments`` segments of ``wire_out``.

    ``wire_in`` holds ``sources`` wire segments of ``segments * shard_numel`` elements,
    ``wire_out`` receives ``segments`` of ``shard_numel``; ``residual`` (error feedback) is
    fp32 of ``segments * shard_numel``. Writes exactly what ``dequantize_sum`` into an fp32
    partial and ``quantize`` of it write, without the partial (see [Note: requantize]).
    """
    for key, value in (("sources", sources), ("segments", segments)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    if isinstance(shard_numel, bool) or not isinstance(shard_numel, int) or shard_numel < 0:
        raise ValueError(f"shard_numel must be an int >= 0, got {shard_numel!r}")
    check_block(block)
    check_kind(kind)
    part = segments * shard_numel
    _check_flat(wire_in, "wire_in", (torch.uint8,))
    _check_flat(wire_out, "wire_out", (torch.uint8,))
    for key, t, count, numel in (("wire_in", wire_in, sources, part), ("wire_out", wire_out, segments, shard_numel)):
        _check_wire_aligned(t, key)
        if t.numel() < count * segment_bytes(numel, block) or t.device != wire_out.device:
            raise ValueError(
                f"{key} needs {count * segment_bytes(numel, block)} bytes on wire_out's device, got {t.numel()} on "
                f"{t.device}"
            )
    in_end = wire_in.data_ptr() + sources * segment_bytes(part, block)
    out_end = wire_out.data_ptr() + segments * segment_bytes(shard_numel, block)
    if wire_in.data_ptr() < out_end and wire_out.data_ptr() < in_end:
        raise ValueError("wire_in and wire_out overlap: requantize reads one while it writes the other")
    if residual is not None:
        _check_flat(residual, "residual", (torch.float32,))
        if residual.numel() != part or residual.device != wire_out.device:
            raise ValueError(f"residual must be fp32, segments * shard_numel ({part}) elements, on wire_out's device")
    kernels = _backend(backend, wire_out.device)
    kernels.requantize(wire_in, sources, block, kind, wire_out, segments, shard_numel, residual)


class PackQuantizePlan(_Plan):
    """The fused pack-quantize for one layout, ``block`` and ``kind``: validated once, called every step.

    ``plan(tensors, wire, residual, scale=...)`` writes what ``pack(tensors, layout,
    dtype=torch.float32, scale=scale)`` followed by ``quantize(packed, layout.world_size,
    block, kind, wire, residual)`` would (see [Note: pack-quantize] in
    docs/design.md), with no packed buffer. ``tensors`` are as a
    ``PackPlan``'s: the example's numels, dtypes and device, ``None`` packs as
    zeros, and a slot ``None`` in the example takes any supported dtype. See
    [Note: plans] in docs/design.md.

    Attributes:
        layout: the layout (its ``world_size`` is the wire's number of segments).
        block: elements per fp32 scale.
        kind: ``"int8"`` or ``"fp8"``.
        device: where the tensors and the wire live.
        backend: the kernel backend's name.
        wire_bytes: bytes of the wire it writes, ``layout.world_size * segment_bytes(shard_numel, block)``.
        uploads: how many times the tensor table was (re)written (as ``PackPlan.uploads``).
    """

    def __init__(
        self,
        layout: Layout,
        tensors: Sequence[MaybeTensor],
        *,
        block: int,
        kind: str,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        no_device = "a PackQuantizePlan of zero tensors (or only None) needs device= (nothing gives the device)"
        device, _ = check_pack_tensors(layout, tensors, device, no_device)
        self.layout, self.device = layout, device
        self.block, self.kind = check_block(block), check_kind(kind)
        self.wire_bytes = layout.world_size * segment_bytes(layout.shard_numel, block)
        impl, self.backend = _resolve(backend, device)
        self._kernels = wire_kernels(self.backend)
        expected = [(n, _NONE if t is None else _CODES[t.dtype]) for n, t in zip(layout.numels, tensors)]
        self._table = _TensorTable(expected, device, self.backend)
        self._lock = threading.Lock()
        if self.backend in _COMPILED:
            self._runs = _tables.pack_runs(layout, device, impl.max_len)  # PackPlan's table, shared through the cache
            self._op = torch.ops.flatgrad._pack_quantize_table.default
            self._kind_code = _KIND_CODES[kind]

    def _check(self, wire: torch.Tensor, residual: torch.Tensor | None) -> None:
        _check_flat(wire, "wire", (torch.uint8,))
        _check_wire_aligned(wire)
        if wire.numel() < self.wire_bytes or wire.device != self.device:
            raise ValueError(
                f"wire needs {self.wire_bytes} bytes on {self.device}, got {wire.numel()} on {wire.device}"
            )
        if residual is not None:
            _check_flat(residual, "residual", (torch.float32,))
            if residual.numel() != self.layout.numel or residual.device != self.device:
                raise ValueError(f"residual must be fp32 with {self.layout.numel} elements on {self.device}")

    def __call__(
        self, tensors: Sequence[MaybeTensor], wire: torch.Tensor, residual: torch.Tensor | None = None, *,
        scale: float = 1.0,
    ) -> None:  # fmt: skip
        """Quantize the fp32 pack of ``tensors`` (``None``: zeros) times ``scale`` into ``wire``; update residual."""
        scale = check_scale(scale)
        self._check(wire, residual)
        with self._lock:
            if self._table.refresh(tensors, "tensors", wire, "wire", True):
                self._table.upload()
            if self.backend in _COMPILED:
                try:
                    self._op(
                        self._table.acquire(), self._runs, self.layout.numel, self.layout.world_size, self.block,
                        self._kind_code, scale, wire, residual,
                    )  # fmt: skip
                finally:
                    self._table.release()
            else:
                self._kernels.pack_quantize(tensors, self.layout, scale, self.block, self.kind, wire, residual)



def pack_quantize(
    tensors: Sequence[MaybeTensor], layout: Layout, block: int, kind: str, wire: torch.Tensor,
    residual: torch.Tensor | None = None, *, scale: float = 1.0, backend: str | None = None,
) -> None:  # fmt: skip
    """``quantize(pack(tensors, layout, dtype=float32, scale=scale), ...)`` in one pass, without the packed buffer.

    See [Note: pack-quantize] in docs/design.md. ``wire`` is ``uint8`` of
    ``layout.world_size * segment_bytes(layout.shard_numel, block)`` bytes on the
    tensors' device; ``residual`` (error feedback) is fp32 of ``layout.numel``.
    Checks everything and makes a ``PackQuantizePlan`` every call: a caller that
    repeats should keep the plan.
    """
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"wire must be a tensor, got {type(wire).__name__}")
    check_scale(scale)
    plan = PackQuantizePlan(layout, tensors, block=block, kind=kind, device=wire.device, backend=backend)
    plan(tensors, wire, residual, scale=scale)
