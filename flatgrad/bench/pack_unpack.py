"""Pack / unpack throughput: flatgrad's fused kernels against the copies they replace.

The question: how close do ``flatgrad.pack`` and ``flatgrad.unpack`` come to one
contiguous copy of the same bytes, and how much faster are they than what
DeepSpeed and PyTorch do? Every figure is measured in the same process,
on the same tensors, next to its baselines.

Buckets:
* ``transformer``: a couple of transformer layers' gradients (qkv / proj / mlp
  weights, their biases, layernorm vectors) in backward order; about 25M
  elements at the default ``hidden=1024, layers=2``.
* ``small``: 1000 small tensors (vectors, small matrices, a few 0-dim scalars).
* ``mixed``: a mixed bucket, 25M elements in 305 tensors: 4 of 4M and 301
  of 29.9K.

Cases: ``pack bf16->bf16``, ``pack fp32->bf16`` and ``unpack bf16->fp32 +=``
(accumulate into an fp32 grad shard, as from micro-step 1 on).

Pack rows:
* ``flatgrad.pack`` on every backend that runs on the device, on the chunked
  layout (ZeRO-3, and ``torch._chunk_cat``) with scale 1 and with the 1/W
  pre-divide that (a) does, and on the flat layout (ZeRO-2) with scale 1.
* ``flatgrad.pack, unchecked``: the backend object's ``pack`` called directly,
  chunked layout, scale 1: the plain op on a tensor list, without the public
  wrapper's checks.
* ``flatgrad.PackPlan``: a plan made once and called with the same tensors,
  chunked layout, scale 1 (the public ``pack`` reuses such a plan too).
* ``flatgrad.pack, kernel only`` (compiled backends): the plan's op on its
  table, with no per-call check at all: the kernel's own cost, the base of
  the host-overhead targets (see ``HOST_OVERHEAD_S``).
* (a) DeepSpeed ZeRO-3: ``stage3.__avg_scatter_grads`` casts each gradient to
  the comm dtype, then ``coalesced_collectives.reduce_scatter_coalesced`` slices
  every tensor into W chunks, adds an ``empty`` padding tensor where a chunk is
  short, ``torch.cat``s the lot and ``div_``s by W. Reimplemented here line by
  line (the function itself also issues the collective).
* (b) ZeRO-2's IPG bucket: ``buffer.narrow(0, offset, numel).copy_(grad.view(-1))``
  per parameter, flat layout (the padding tail is zeroed once, as it is static).
* (c) ``torch._chunk_cat(grads, dim=0, num_chunks=W, out=...)`` on flattened
  views made outside the timed region (``_chunk_cat`` crashes on 0-dim tensors).
* (d) the roofline: one contiguous ``copy_`` of ``layout.numel`` elements from a
  flat tensor of the input dtype into one of the output dtype.

Unpack rows (rank 0's shard; rank 0 owns a piece of every tensor in the chunked layout):
* ``flatgrad.unpack(accumulate=True)`` into one fp32 tensor of S elements, into
  one fp32 view per piece (as ZeRO-3's per-parameter grad partitions), and, on
  the flat layout, into one tensor; and ``unchecked``: the backend object's
  ``unpack`` into one tensor, without the wrapper's checks.
* (a) DeepSpeed ZeRO-3: the tail of ``reduce_scatter_coalesced`` narrows the
  shard per tensor, ``__avg_scatter_grads`` casts each partition to fp32, and
  ``partition_grads`` narrows each grad partition and ``add_``s into it.
* ``flatgrad.UnpackPlan -> per-piece outs``: a plan made once, called per step.
* (b) a per-piece ``add_`` loop over views prepared outside the timed region.
* (d) the roofline: one contiguous ``add_`` of the S-element bf16 shard into an
  fp32 tensor.
* (d') for reference, not a ratio base: one contiguous fp32 ``add_`` of S
  elements (12 bytes an element). On CPU torch's mixed-dtype ``add_`` in (d)
  runs well below memory speed, and this row shows by how much.

GB/s counts bytes read plus bytes written; ``x(d)`` and ``x(a)`` are ratios to
rows (d) and (a). See [Note: bench bytes and ratios] in docs/design.md.

Every row is checked against the ``torch`` reference first, then the rows are
timed in turns (``_harness.time_round_robin``), CUDA ones between CUDA events.
See [Note: bench timing] in docs/design.md.

``flatgrad bench`` runs this module; so does its entry point, ``bench/pack_unpack.py``::

    python bench/pack_unpack.py --out results.json --plot chart.png
    python bench/pack_unpack.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

import flatgrad

from ..kernels._backends import resolve_backend
from ._harness import load_average, machine_info, machine_line, require_matplotlib, time_round_robin

__all__ = [
    "BenchConfig",
    "Bucket",
    "transformer_bucket",
    "small_bucket",
    "mixed_bucket",
    "run_benchmark",
    "format_table",
    "write_plot",
    "machine_info",
    "add_arguments",
    "run_from_args",
    "main",
]

_BF16, _FP32 = torch.bfloat16, torch.float32


@dataclasses.dataclass(frozen=True)
class _Case:
    name: str
    kind: str  # "pack" or "unpack"
    in_dtype: torch.dtype
    out_dtype: torch.dtype


CASES = (
    _Case("pack bf16->bf16", "pack", _BF16, _BF16),
    _Case("pack fp32->bf16", "pack", _FP32, _BF16),
    _Case("unpack bf16->fp32 +=", "unpack", _BF16, _FP32),
)

# Throughput targets, checked on the transformer bucket: (device, backend) ->
# (minimum x(d), minimum x(a), must beat (c)).
TARGETS = {
    ("cpu", "cpu"): (0.8, 2.0, False),
    ("cuda", "cuda"): (0.9, None, True),
    ("cuda", "triton"): (0.9, None, True),
}

# Host-overhead targets for the compiled backends, judged on median (min beside):
# on the small bucket (1000 tensors), pack bf16->bf16, a repeated public call
# costs at most HOST_OVERHEAD_S more than the kernel alone, and at most
# HOST_RATIO times it; on the mixed bucket, the public pack reaches MIXED_X_D
# of one copy_ of the same bytes (x(d)), median and min.
HOST_OVERHEAD_S = {"cpu": 50e-6}
HOST_RATIO = 1.2
MIXED_X_D = 0.9
_HOST_CASE = "pack bf16->bf16"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A named list of gradient shapes, in the order they are packed.

    Attributes:
        name: short name used in the table and the JSON.
        shapes: one shape per tensor (``()`` is a 0-dim scalar).
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def transformer_bucket(hidden: int = 1024, layers: int = 2) -> Bucket:
    """``layers`` pre-LN transformer blocks' gradients in backward order (about 12 * hidden^2 each)."""
    block = [
        (hidden,), (hidden,),  # ln1 weight, bias
        (3 * hidden, hidden), (3 * hidden,),  # qkv
        (hidden, hidden), (hidden,),  # attention output projection
        (hidden,), (hidden,),  # ln2 weight, bias
        (4 * hidden, hidden), (4 * hidden,),  # mlp fc1
        (hidden, 4 * hidden), (hidden,),  # mlp fc2
    ]
    forward = [shape for _ in range(layers) for shape in block]
    return Bucket("transformer", tuple(reversed(forward)))


def mixed_bucket(large: int = 4, large_numel: int = 4_000_000, small: int = 301, small_numel: int = 29_900) -> Bucket:
    """A mixed bucket: ``large`` tensors of ``large_numel`` among ``small`` of ``small_numel`` (25M in 305)."""
    shapes = [(small_numel,)] * (small // 2) + [(large_numel,)] * large + [(small_numel,)] * (small - small // 2)
    return Bucket("mixed", tuple(shapes))


def small_bucket(count: int = 1000, max_numel: int = 2048, seed: int = 0) -> Bucket:
    """``count`` small tensors: mostly vectors and small matrices, a few 0-dim scalars; fixed by ``seed``."""
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = []
    side = max(1, int(math.isqrt(max_numel)))
    for _ in range(count):
        kind = rng.random()
        if kind < 0.03:
            shapes.append(())
        elif kind < 0.65:
            shapes.append((rng.randint(1, max_numel),))
        else:
            shapes.append((rng.randint(1, side), rng.randint(1, side)))
    return Bucket("small", tuple(shapes))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``run_benchmark`` measures.

    Attributes:
        world_size: W, the number of ranks the layouts are built for.
        repeats: timed calls per row (min and median are reported).
        warmup: untimed calls per row before the timed ones.
        hidden: hidden size of the transformer bucket.
        layers: transformer blocks in the transformer bucket.
        small_tensors: number of tensors in the small bucket.
        buckets: which buckets to run (``transformer``, ``small``, ``mixed``).
        devices: device types to run on (``cpu``, ``cuda``).
        backends: flatgrad backends to measure; ``None`` means every available
            one (``triton`` on CPU only when named, as it runs there only in
            the interpreter).
        seed: seed of the small bucket's shapes and of all tensor values.
    """

    world_size: int = 8
    repeats: int = 20
    warmup: int = 3
    hidden: int = 1024
    layers: int = 2
    small_tensors: int = 1000
    buckets: tuple[str, ...] = ("transformer", "small")
    devices: tuple[str, ...] = ("cpu",)
    backends: tuple[str, ...] | None = None
    seed: int = 0

    def make_buckets(self) -> list[Bucket]:
        made = {
            "transformer": lambda: transformer_bucket(self.hidden, self.layers),
            "small": lambda: small_bucket(self.small_tensors, seed=self.seed),
            "mixed": mixed_bucket,
        }
        return [made[name]() for name in self.buckets]


QUICK = dict(repeats=3, warmup=0, hidden=256, layers=2, small_tensors=100)  # the check call warms up


@dataclasses.dataclass
class _Method:
    """One row to time: a prepared zero-argument call and how to read what it wrote."""

    name: str
    role: str  # "flatgrad", "a", "b", "c", "d", "d'"
    backend: str
    layout: str
    nbytes: int
    run: Callable[[], None]
    result: Callable[[], torch.Tensor] | None = None
    scale: float = 1.0
    expected: torch.Tensor | None = None  # what ``result()`` must hold after one call from a fresh start
    mask: torch.Tensor | None = None  # compare only these elements (to rounding), for (a)'s unset padding


# ---------------------------------------------------------------------------- pack rows


def _flatgrad_pack(tensors, layout, out_dtype, backend, scale, name) -> _Method:
    out = torch.empty(layout.numel, dtype=out_dtype, device=tensors[0].device)

    def run() -> None:
        flatgrad.pack(tensors, layout, out, scale=scale, backend=backend)

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method(name, "flatgrad", backend, layout.kind, nbytes, run, lambda: out, scale)


def _backend_pack(tensors, layout, out_dtype, backend) -> _Method:
    """The backend object's ``pack`` without the public wrapper's per-call checks: the kernel's own cost."""
    out = torch.empty(layout.numel, dtype=out_dtype, device=tensors[0].device)
    impl = resolve_backend(backend, out.device)

    def run() -> None:
        impl.pack(tensors, layout, out, 1.0)

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("flatgrad.pack, unchecked", "flatgrad", backend, layout.kind, nbytes, run, lambda: out)


def _plan_pack(tensors, layout, out_dtype, backend) -> _Method:
    """A ``PackPlan`` made once, called every step with the same tensors."""
    out = torch.empty(layout.numel, dtype=out_dtype, device=tensors[0].device)
    plan = flatgrad.PackPlan(layout, tensors, dtype=out_dtype, backend=backend)

    def run() -> None:
        plan(tensors, out)

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("flatgrad.PackPlan", "flatgrad", backend, layout.kind, nbytes, run, lambda: out)


def _kernel_pack(tensors, layout, out_dtype, backend) -> _Method:
    """The plan's op on its table, with no per-call check: the compiled kernel alone."""
    out = torch.empty(layout.numel, dtype=out_dtype, device=tensors[0].device)
    plan = flatgrad.PackPlan(layout, tensors, dtype=out_dtype, backend=backend)
    plan(tensors, out)  # fills the table
    op, table, runs = torch.ops.flatgrad._pack_table.default, plan._table.on_device, plan._runs

    def run() -> None:
        op(table, runs, out, 1.0)

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("flatgrad.pack, kernel only", "flatgrad", backend, layout.kind, nbytes, run, lambda: out)


def _ds_zero3_pack(tensors, layout, out_dtype) -> _Method:
    """(a): DeepSpeed 0.19 ZeRO-3's cast in ``__avg_scatter_grads``, then ``reduce_scatter_coalesced``'s packing."""
    world_sz = layout.world_size
    holder: list[torch.Tensor] = []

    def run() -> None:
        grads = list(tensors)
        if out_dtype != grads[0].dtype:
            grads = [g.to(out_dtype) for g in grads]
        partitions = []
        for g in grads:
            flat = g.view(-1)
            chunk_sz = math.ceil(g.numel() / world_sz)
            partitions.append([flat[r * chunk_sz : r * chunk_sz + chunk_sz] for r in range(world_sz)])
        padded_sz = tuple(math.ceil(g.numel() / world_sz) for g in grads)
        if len(grads) == 1 and grads[0].numel() % world_sz == 0:
            buffer = grads[0].view(-1)
        else:
            pieces = []
            for r in range(world_sz):
                for i in range(len(grads)):
                    chunk = partitions[i][r]
                    pieces.append(chunk)
                    padding = padded_sz[i] - chunk.numel()
                    if padding > 0:
                        pieces.append(torch.empty(padding, dtype=chunk.dtype, device=chunk.device))
            buffer = torch.cat(pieces)
        buffer.div_(world_sz)
        holder[:] = [buffer]

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("(a) deepspeed zero3 cat+div", "a", "-", layout.kind, nbytes, run, lambda: holder[0], 1.0 / world_sz)


def _narrow_copy_pack(tensors, layout, out_dtype) -> _Method:
    """(b): ZeRO-2's IPG bucket fill, one ``narrow().copy_()`` per parameter; static padding zeroed once."""
    buffer = torch.zeros(layout.numel, dtype=out_dtype, device=tensors[0].device)

    def run() -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            buffer.narrow(0, offset, n).copy_(t.view(-1))
            offset += n

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("(b) narrow().copy_ loop", "b", "-", layout.kind, nbytes, run, lambda: buffer)


def _chunk_cat_pack(tensors, layout, out_dtype) -> _Method:
    """(c): ``torch._chunk_cat`` into a [W, S] view of the buffer (flattened first: 0-dim inputs crash it)."""
    flat = [t.view(-1) for t in tensors]
    out = torch.empty(layout.world_size, layout.shard_numel, dtype=out_dtype, device=tensors[0].device)

    def run() -> None:
        torch._chunk_cat(flat, dim=0, num_chunks=layout.world_size, out=out)

    nbytes = _pack_bytes(layout, tensors[0].dtype, out_dtype)
    return _Method("(c) torch._chunk_cat", "c", "-", layout.kind, nbytes, run, lambda: out.view(-1))


def _roofline_copy(numel, in_dtype, out_dtype, device, seed) -> _Method:
    """(d): one contiguous ``copy_`` of ``numel`` elements, input dtype to output dtype."""
    src = _randn(numel, seed, device).to(in_dtype)
    dst = torch.empty(numel, dtype=out_dtype, device=device)

    def run() -> None:
        dst.copy_(src)

    nbytes = numel * (in_dtype.itemsize + out_dtype.itemsize)
    return _Method("(d) roofline copy_", "d", "-", "contiguous", nbytes, run)


def _pack_bytes(layout, in_dtype, out_dtype) -> int:
    return layout.numel_unpadded * in_dtype.itemsize + layout.numel * out_dtype.itemsize


# ---------------------------------------------------------------------------- unpack rows


def _unpack_bytes(elements: int, in_dtype, out_dtype) -> int:
    return elements * (in_dtype.itemsize + 2 * out_dtype.itemsize)  # read shard, read + write out


def _flatgrad_unpack(shard, layout, rank, out_dtype, backend, per_piece) -> _Method:
    buffer = torch.zeros(layout.shard_numel, dtype=out_dtype, device=shard.device)
    pieces = layout.pieces(rank)
    out = [buffer.narrow(0, p.shard_offset, p.length) for p in pieces] if per_piece else buffer

    def run() -> None:
        flatgrad.unpack(shard, layout, rank, out, accumulate=True, backend=backend)

    name = "flatgrad.unpack -> per-piece outs" if per_piece else "flatgrad.unpack -> 1 out"
    nbytes = _unpack_bytes(sum(p.length for p in pieces), shard.dtype, out_dtype)
    return _Method(name, "flatgrad", backend, layout.kind, nbytes, run, lambda: buffer)


def _plan_unpack(shard, layout, rank, out_dtype, backend) -> _Method:
    """An ``UnpackPlan`` into per-piece views, made once, called every step."""
    buffer = torch.zeros(layout.shard_numel, dtype=out_dtype, device=shard.device)
    pieces = layout.pieces(rank)
    out = [buffer.narrow(0, p.shard_offset, p.length) for p in pieces]
    plan = flatgrad.UnpackPlan(layout, rank, out, backend=backend)

    def run() -> None:
        plan(shard, out, accumulate=True)

    nbytes = _unpack_bytes(sum(p.length for p in pieces), shard.dtype, out_dtype)
    return _Method("flatgrad.UnpackPlan -> per-piece", "flatgrad", backend, layout.kind, nbytes, run,
                   lambda: buffer)  # fmt: skip


def _backend_unpack(shard, layout, rank, out_dtype, backend) -> _Method:
    """The backend object's ``unpack`` into one output, without the public wrapper's per-call checks."""
    buffer = torch.zeros(layout.shard_numel, dtype=out_dtype, device=shard.device)
    impl = resolve_backend(backend, shard.device)

    def run() -> None:
        impl.unpack(shard, layout, rank, [buffer], False, 1.0, True, False)

    nbytes = _unpack_bytes(sum(p.length for p in layout.pieces(rank)), shard.dtype, out_dtype)
    return _Method("flatgrad.unpack -> 1 out, unchecked", "flatgrad", backend, layout.kind, nbytes, run, lambda: buffer)


def _ds_zero3_unpack(shard, layout, rank, out_dtype) -> _Method:
    """(a): the tail of ``reduce_scatter_coalesced``, the fp32 cast of ``__avg_scatter_grads``, ``partition_grads``."""
    world_sz = layout.world_size
    numels = layout.numels
    buffer = torch.zeros(layout.shard_numel, dtype=out_dtype, device=shard.device)
    # ZeRO-3's per-parameter fp32 grad partitions: views of one flat buffer.
    grad_partitions = [buffer.narrow(0, o, c) for o, c in zip(layout.offsets, layout.chunk_numels)]

    def run() -> None:
        outputs, offset = [], 0
        for n in numels:
            chunk_sz = math.ceil(n / world_sz)
            length = max(0, min(chunk_sz, n - rank * chunk_sz))
            outputs.append(shard.narrow(0, offset, length))
            offset += chunk_sz
        outputs = [g.to(out_dtype) for g in outputs]
        for n, partition, reduced in zip(numels, grad_partitions, outputs):
            if partition.numel() * rank >= n:  # no real data of this tensor on this rank
                continue
            grad_buffer = partition.narrow(0, 0, reduced.numel())
            grad_buffer.add_(reduced.to(out_dtype).view(grad_buffer.shape))

    elements = sum(p.length for p in layout.pieces(rank))
    nbytes = _unpack_bytes(elements, shard.dtype, out_dtype)
    return _Method("(a) deepspeed zero3 to()+add_", "a", "-", layout.kind, nbytes, run, lambda: buffer)


def _piece_add_unpack(shard, layout, rank, out_dtype) -> _Method:
    """(b): one ``add_`` per piece, over views prepared once."""
    buffer = torch.zeros(layout.shard_numel, dtype=out_dtype, device=shard.device)
    pieces = layout.pieces(rank)
    pairs = [(buffer.narrow(0, p.shard_offset, p.length), shard.narrow(0, p.shard_offset, p.length)) for p in pieces]

    def run() -> None:
        for dst, src in pairs:
            dst.add_(src)

    nbytes = _unpack_bytes(sum(p.length for p in pieces), shard.dtype, out_dtype)
    return _Method("(b) per-piece add_ loop", "b", "-", layout.kind, nbytes, run, lambda: buffer)


def _roofline_add(shard, out_dtype) -> _Method:
    """(d): one contiguous ``add_`` of the whole shard into an fp32 tensor."""
    dst = torch.zeros(shard.numel(), dtype=out_dtype, device=shard.device)

    def run() -> None:
        dst.add_(shard)

    nbytes = _unpack_bytes(shard.numel(), shard.dtype, out_dtype)
    return _Method("(d) roofline add_", "d", "-", "contiguous", nbytes, run)


def _same_dtype_add(numel: int, out_dtype, device, seed) -> _Method:
    """(d'): one contiguous ``add_`` of ``numel`` elements with both sides in the output dtype.

    Torch's mixed-dtype ``add_`` (the roofline (d)) can run below memory speed
    on CPU; this row shows how far, counting its own (larger) byte count.
    """
    src = _randn(numel, seed, device).to(out_dtype)
    dst = torch.zeros(numel, dtype=out_dtype, device=device)

    def run() -> None:
        dst.add_(src)

    return _Method("(d') same-dtype add_", "d'", "-", "contiguous", numel * 3 * out_dtype.itemsize, run)


# ---------------------------------------------------------------------------- driver


def _randn(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(device)


def _bucket_tensors(bucket: Bucket, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    values = _randn(bucket.numel, seed, torch.device("cpu")).to(dtype)
    tensors, offset = [], 0
    for shape, n in zip(bucket.shapes, bucket.numels):
        tensors.append(values[offset : offset + n].clone().view(shape).to(device))
        offset += n
    return tensors


def _backends_for(device: str, wanted: Sequence[str] | None, skipped: list[dict]) -> list[str]:
    chosen = []
    for name, status in flatgrad.available_backends().items():
        if wanted is not None and name not in wanted:
            continue
        if device not in status.devices:
            why = status.reason or f"runs on {list(status.devices)}, not {device}"
            skipped.append({"device": device, "backend": name, "reason": why})
            continue
        if name == "triton" and device == "cpu" and wanted is None:
            skipped.append({"device": device, "backend": name, "reason": "Triton runs on CPU only in the interpreter"})
            continue
        chosen.append(name)
    return chosen


def _check(method: _Method) -> None:
    """Run ``method`` once and compare what it wrote with its reference; a wrong row is an error, not a figure."""
    method.run()
    if method.expected is None:
        return
    got, expected = method.result().reshape(-1), method.expected
    if method.mask is not None:
        got, expected = got[method.mask], expected[method.mask]
        # (a) divides in the comm dtype after the cast: equal to the reference up to rounding.
        torch.testing.assert_close(got, expected, msg=lambda m: f"{method.name}: {m}")
        return
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero()[:1].tolist()
        where = f"{method.name} [{method.backend}, {method.layout}]"
        raise RuntimeError(f"{where} differs from the reference, first at {bad}")


def _row(method: _Method, times: list[float]) -> dict:
    best, median = min(times), statistics.median(times)
    return {
        "method": method.name,
        "role": method.role,
        "backend": method.backend,
        "layout": method.layout,
        "scale": method.scale,
        "bytes": method.nbytes,
        "min_s": best,
        "median_s": median,
        "gbps_min": method.nbytes / best / 1e9,
        "gbps_median": method.nbytes / median / 1e9,
    }


def _pack_methods(tensors, layouts, case, backends, world_size, seed) -> list[_Method]:
    """Every pack row of one group, each with the reference result it must reproduce."""
    chunked, flat = layouts["chunked"], layouts["flat"]
    references: dict = {}

    def reference(layout, scale: float) -> torch.Tensor:
        key = (layout.kind, scale)
        if key not in references:
            references[key] = flatgrad.pack(tensors, layout, scale=scale, dtype=case.out_dtype, backend="torch")
        return references[key]

    real = flatgrad.pack([torch.ones_like(t) for t in tensors], chunked, backend="torch") != 0
    methods = [_roofline_copy(chunked.numel, case.in_dtype, case.out_dtype, tensors[0].device, seed + 1)]
    methods.append(_ds_zero3_pack(tensors, chunked, case.out_dtype))
    methods[-1].expected, methods[-1].mask = reference(chunked, 1.0 / world_size), real  # its padding is torch.empty
    methods.append(_narrow_copy_pack(tensors, flat, case.out_dtype))
    methods.append(_chunk_cat_pack(tensors, chunked, case.out_dtype))
    for backend in backends:
        methods.append(_flatgrad_pack(tensors, chunked, case.out_dtype, backend, 1.0, "flatgrad.pack"))
        methods.append(
            _flatgrad_pack(tensors, chunked, case.out_dtype, backend, 1.0 / world_size, "flatgrad.pack x1/W")
        )
        methods.append(_flatgrad_pack(tensors, flat, case.out_dtype, backend, 1.0, "flatgrad.pack"))
        methods.append(_backend_pack(tensors, chunked, case.out_dtype, backend))
        methods.append(_plan_pack(tensors, chunked, case.out_dtype, backend))
        if backend in ("cpu", "cuda"):
            methods.append(_kernel_pack(tensors, chunked, case.out_dtype, backend))
    for m in methods:
        if m.role in ("b", "c", "flatgrad"):
            m.expected = reference(layouts[m.layout], m.scale)
    return methods


def _unpack_methods(shards, layouts, case, backends, rank) -> list[_Method]:
    """Every unpack row of one group, each with the reference result it must reproduce (from zero)."""
    chunked, flat = layouts["chunked"], layouts["flat"]
    methods = [_roofline_add(shards["chunked"], case.out_dtype)]
    methods.append(_same_dtype_add(chunked.shard_numel, case.out_dtype, shards["chunked"].device, rank + 3))
    methods.append(_ds_zero3_unpack(shards["chunked"], chunked, rank, case.out_dtype))
    methods.append(_piece_add_unpack(shards["chunked"], chunked, rank, case.out_dtype))
    for backend in backends:
        methods.append(_flatgrad_unpack(shards["chunked"], chunked, rank, case.out_dtype, backend, False))
        methods.append(_flatgrad_unpack(shards["chunked"], chunked, rank, case.out_dtype, backend, True))
        methods.append(_flatgrad_unpack(shards["flat"], flat, rank, case.out_dtype, backend, False))
        methods.append(_backend_unpack(shards["chunked"], chunked, rank, case.out_dtype, backend))
        methods.append(_plan_unpack(shards["chunked"], chunked, rank, case.out_dtype, backend))
    expected = {}
    for kind, layout in layouts.items():
        expected[kind] = torch.zeros(layout.shard_numel, dtype=case.out_dtype, device=shards[kind].device)
        flatgrad.unpack(shards[kind], layout, rank, expected[kind], accumulate=True, backend="torch")
    for m in methods:
        if m.role in ("a", "b", "flatgrad"):
            m.expected = expected[m.layout]
    return methods


def _run_group(
    bucket: Bucket, case: _Case, device: torch.device, backends: list[str], config: BenchConfig
) -> list[dict]:
    """Every row of one (bucket, case, device), checked, then timed in turns; ratios included."""
    w = config.world_size
    layouts = {kind: flatgrad.Layout.make(kind, bucket.numels, w) for kind in ("chunked", "flat")}
    with torch.no_grad():
        if case.kind == "pack":
            tensors = _bucket_tensors(bucket, case.in_dtype, device, config.seed)
            methods = _pack_methods(tensors, layouts, case, backends, w, config.seed)
        else:
            shards = {
                kind: _randn(layout.shard_numel, config.seed + 2, device).to(case.in_dtype)
                for kind, layout in layouts.items()
            }
            methods = _unpack_methods(shards, layouts, case, backends, rank=0)
        for m in methods:
            _check(m)
        times = time_round_robin([m.run for m in methods], config.warmup, config.repeats, device.type == "cuda")
    rows = [_row(m, t) for m, t in zip(methods, times)]
    _add_ratios(rows)
    for row in rows:
        row.update(bucket=bucket.name, case=case.name, device=device.type)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    base = {row["role"]: row for row in rows if row["role"] in ("a", "c", "d")}
    for row in rows:
        for tag, role in (("roofline", "d"), ("ds", "a"), ("chunk_cat", "c")):
            ref = base.get(role)
            for stat in ("median", "min"):
                key = f"x_{tag}_{stat}"
                row[key] = row[f"gbps_{stat}"] / ref[f"gbps_{stat}"] if ref else None


def _evaluate_targets(results: list[dict]) -> list[dict]:
    """The throughput targets on the transformer bucket, per case, for the backends they name.

    x(d) is judged on the plain chunked row (scale 1, one output), x(a) on the
    row doing (a)'s work (the 1/W pre-divide for pack), x(c) on the plain row.
    Met or not is judged on median times; the min-time ratio is given beside.
    """
    verdicts = []
    for (device, backend), (min_d, min_a, beat_c) in TARGETS.items():
        for case in CASES:
            group = [r for r in results if (r["device"], r["bucket"], r["case"]) == (device, "transformer", case.name)]
            mine = [
                r for r in group if (r["role"], r["backend"], r["layout"]) == ("flatgrad", backend, "chunked")
            ]
            if not mine:
                continue
            plain = next(r for r in mine if r["method"] in ("flatgrad.pack", "flatgrad.unpack -> 1 out"))
            like_a = next((r for r in mine if r["scale"] != 1.0), plain)
            verdict = {
                "device": device,
                "backend": backend,
                "case": case.name,
                "x_roofline": plain["x_roofline_median"],
                "x_roofline_min": plain["x_roofline_min"],
                "roofline_target": min_d,
                "roofline_met": plain["x_roofline_median"] >= min_d,
            }
            if min_a is not None:
                verdict.update(
                    x_ds=like_a["x_ds_median"],
                    x_ds_min=like_a["x_ds_min"],
                    ds_target=min_a,
                    ds_met=like_a["x_ds_median"] >= min_a,
                )
            chunk_cat = next((r for r in group if r["role"] == "c"), None)
            if beat_c and chunk_cat is not None:
                verdict.update(
                    x_chunk_cat=plain["gbps_median"] / chunk_cat["gbps_median"],
                    x_chunk_cat_min=plain["gbps_min"] / chunk_cat["gbps_min"],
                )
                verdict["chunk_cat_met"] = verdict["x_chunk_cat"] > 1.0
            verdicts.append(verdict)
    return verdicts


def _evaluate_host_targets(results: list[dict]) -> list[dict]:
    """The host-overhead targets (see ``HOST_OVERHEAD_S``), for every compiled backend measured."""
    verdicts = []

    def find(device: str, backend: str, bucket: str, method: str) -> dict | None:
        want = (device, backend, bucket, _HOST_CASE, method, "chunked", 1.0)
        keys = ("device", "backend", "bucket", "case", "method", "layout", "scale")
        return next((r for r in results if tuple(r[k] for k in keys) == want), None)

    for device, backend in sorted({(r["device"], r["backend"]) for r in results if r["backend"] in ("cpu", "cuda")}):
        public = find(device, backend, "small", "flatgrad.pack")
        kernel = find(device, backend, "small", "flatgrad.pack, kernel only")
        if public and kernel:
            verdict = {"device": device, "backend": backend, "bucket": "small", "case": _HOST_CASE}
            for stat in ("median", "min"):
                # A difference of two noisy times can come out below zero: clamped, with the noise beside it.
                verdict[f"overhead_{stat}_s"] = max(0.0, public[f"{stat}_s"] - kernel[f"{stat}_s"])
                verdict[f"ratio_{stat}"] = public[f"{stat}_s"] / kernel[f"{stat}_s"]
            verdict["noise_floor_s"] = max(r["median_s"] - r["min_s"] for r in (public, kernel))
            verdict["ratio_met"] = verdict["ratio_median"] <= HOST_RATIO
            if device in HOST_OVERHEAD_S:
                verdict["overhead_target_s"] = HOST_OVERHEAD_S[device]
                verdict["overhead_met"] = verdict["overhead_median_s"] <= HOST_OVERHEAD_S[device]
            verdicts.append(verdict)
        mixed = find(device, backend, "mixed", "flatgrad.pack")
        if mixed:
            verdicts.append({
                "device": device, "backend": backend, "bucket": "mixed", "case": _HOST_CASE,
                "x_roofline": mixed["x_roofline_median"], "x_roofline_min": mixed["x_roofline_min"],
                "roofline_target": MIXED_X_D,
                "roofline_met": min(mixed["x_roofline_median"], mixed["x_roofline_min"]) >= MIXED_X_D,
            })  # fmt: skip
    return verdicts


def run_benchmark(config: BenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Measure every row of every (device, bucket, case); returns the JSON document."""
    machine = machine_info()
    results: list[dict] = []
    skipped: list[dict] = []
    buckets = config.make_buckets()
    bucket_info = {}
    for bucket in buckets:
        chunked = flatgrad.Layout.chunked(bucket.numels, config.world_size)
        flat = flatgrad.Layout.flat(bucket.numels, config.world_size)
        bucket_info[bucket.name] = {
            "tensors": len(bucket.shapes),
            "numel": bucket.numel,
            "chunked_numel": chunked.numel,
            "flat_numel": flat.numel,
            "largest": max(bucket.numels, default=0),
        }
    total, done, start = len(config.devices) * len(buckets) * len(CASES), 0, time.perf_counter()
    for device_type in config.devices:
        device = torch.device(device_type)
        backends = _backends_for(device_type, config.backends, skipped)
        for bucket in buckets:
            for case in CASES:
                began = time.perf_counter()
                rows = _run_group(bucket, case, device, backends, config)
                results.extend(rows)
                done += 1
                if log:
                    log(
                        f"[{done}/{total}] {device_type} {bucket.name}: {case.name}: {len(rows)} rows in "
                        f"{time.perf_counter() - began:.1f} s ({time.perf_counter() - start:.0f} s so far)"
                    )
    machine["load_average_1min_end"] = load_average()
    return {
        "benchmark": "pack_unpack",
        "machine": machine,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()},
        "buckets": bucket_info,
        "results": results,
        "skipped": skipped,
        "targets": _evaluate_targets(results),
        "host_targets": _evaluate_host_targets(results),
    }


# ---------------------------------------------------------------------------- output


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _verdict(label: str, median: float, best: float, op: str, target: float) -> str:
    met = median >= target if op == ">=" else median > target
    return f"{label} {median:.2f} [{best:.2f}] ({op} {target}: {'met' if met else 'NOT met'})"


def format_table(doc: dict) -> str:
    """The results as a plain-text table, grouped by device, bucket and case, with the machine named."""
    lines = [f"flatgrad pack/unpack benchmark, W={doc['config']['world_size']}", machine_line(doc["machine"])]
    for name, info in doc["buckets"].items():
        lines.append(
            f"bucket {name}: {info['tensors']} tensors, {info['numel']:,} elements "
            f"(chunked buffer {info['chunked_numel']:,}, flat {info['flat_numel']:,})"
        )
    header = (
        f"  {'method':<36} {'backend':<7} {'layout':<10} {'min ms':>9} {'med ms':>9} {'GB/s':>7} "
        f"{'x(d)':>6} {'x(a)':>6} {'x(d)*':>6} {'x(a)*':>6}"
    )
    groups: dict[tuple, list[dict]] = {}
    for row in doc["results"]:
        groups.setdefault((row["device"], row["bucket"], row["case"]), []).append(row)
    for (device, bucket, case), rows in groups.items():
        lines += ["", f"[{device}] {bucket} | {case}", header]
        for r in rows:
            lines.append(
                f"  {r['method']:<36} {r['backend']:<7} {r['layout']:<10} {r['min_s'] * 1e3:>9.3f} "
                f"{r['median_s'] * 1e3:>9.3f} {r['gbps_median']:>7.2f} {_fmt_ratio(r['x_roofline_median']):>6} "
                f"{_fmt_ratio(r['x_ds_median']):>6} {_fmt_ratio(r['x_roofline_min']):>6} {_fmt_ratio(r['x_ds_min']):>6}"
            )
    lines += [
        "",
        "GB/s: bytes read + written / median time. x(d), x(a): GB/s ratio to (d) and (a) from median times;",
        "x(d)*, x(a)*: the same from min times.",
        "min: the fastest of the timed calls, the least disturbed by other load: compare kernels by it. median: the",
        "typical call: read it for what a training step sees. A median far above its min means other processes",
        "shared the cores during the run; the min is then the better estimate of the kernel's own speed.",
    ]
    for skip in doc["skipped"]:
        lines.append(f"not measured: {skip['backend']} on {skip['device']}: {skip['reason']}")
    if doc["targets"]:
        lines += ["", "throughput targets (transformer bucket, chunked layout; median, min in brackets):"]
    for t in doc["targets"]:
        parts = [_verdict("x(d)", t["x_roofline"], t["x_roofline_min"], ">=", t["roofline_target"])]
        if "x_ds" in t:
            parts.append(_verdict("x(a)", t["x_ds"], t["x_ds_min"], ">=", t["ds_target"]))
        if "x_chunk_cat" in t:
            parts.append(_verdict("x(c)", t["x_chunk_cat"], t["x_chunk_cat_min"], ">", 1.0))
        lines.append(f"  {t['backend']:<6} on {t['device']:<4} {t['case']:<22} " + "; ".join(parts))
    if doc.get("host_targets"):
        lines += ["", "host-overhead targets (public flatgrad.pack over the kernel alone, chunked, scale 1; median, min in brackets):"]
    for t in doc.get("host_targets", []):
        where = f"  {t['backend']:<6} on {t['device']:<4} {t['bucket']:<6} {t['case']:<16}"
        if t["bucket"] == "mixed":
            met = "met" if t["roofline_met"] else "NOT met"
            lines.append(f"{where} x(d) {t['x_roofline']:.2f} [{t['x_roofline_min']:.2f}] "
                         f"(>= {t['roofline_target']}, median and min: {met})")  # fmt: skip
            continue
        parts = []
        if "overhead_target_s" in t:
            met = "met" if t["overhead_met"] else "NOT met"
            parts.append(f"host overhead {t['overhead_median_s'] * 1e6:.1f} us [{t['overhead_min_s'] * 1e6:.1f}] "
                         f"(<= {t['overhead_target_s'] * 1e6:.0f} us: {met}; noise floor "
                         f"{t['noise_floor_s'] * 1e6:.1f} us, the larger median - min of the two rows)")  # fmt: skip
        met = "met" if t["ratio_met"] else "NOT met"
        parts.append(f"x kernel {t['ratio_median']:.2f} [{t['ratio_min']:.2f}] (<= {HOST_RATIO}: {met})")
        lines.append(f"{where} " + "; ".join(parts))
    return "\n".join(lines)


_COLORS = {"flatgrad": "tab:blue", "a": "tab:red", "b": "tab:orange", "c": "tab:green", "d": "tab:gray", "d'": "silver"}


def write_plot(doc: dict, path: str) -> None:
    """A PNG of median GB/s per row: one panel per (device, bucket) and case."""
    plt = require_matplotlib()
    panels = list(dict.fromkeys((r["device"], r["bucket"]) for r in doc["results"]))  # in measuring order
    cases = [c.name for c in CASES if any(r["case"] == c.name for r in doc["results"])]
    fig, axes = plt.subplots(
        len(panels), len(cases), figsize=(6 * len(cases), 0.35 * 14 * len(panels) + 1), squeeze=False
    )
    for i, (device, bucket) in enumerate(panels):
        for j, case in enumerate(cases):
            ax = axes[i][j]
            rows = [r for r in doc["results"] if (r["device"], r["bucket"], r["case"]) == (device, bucket, case)]
            labels = [
                f"{r['method']} [{r['layout'] if r['backend'] == '-' else r['backend'] + ', ' + r['layout']}]"
                for r in rows
            ]
            ax.barh(range(len(rows)), [r["gbps_median"] for r in rows], color=[_COLORS[r["role"]] for r in rows])
            ax.set_yticks(range(len(rows)), labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("GB/s (read + written, median)")
            ax.set_title(f"[{device}] {bucket}: {case}", fontsize=9)
    fig.suptitle(f"flatgrad pack/unpack, W={doc['config']['world_size']}. {machine_line(doc['machine'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, shared by ``flatgrad bench`` and ``bench/pack_unpack.py``."""
    parser.add_argument("--quick", action="store_true", help="small buckets and few repeats (CI)")
    parser.add_argument("--world-size", type=int, default=8, help="W, ranks the layouts are built for (default 8)")
    parser.add_argument("--repeats", type=int, help="timed calls per row (default 20; --quick: 3)")
    parser.add_argument(
        "--warmup", type=int, help="untimed calls per row before timing, after the check call (default 3; --quick: 0)"
    )
    parser.add_argument("--hidden", type=int, help="transformer bucket hidden size (default 1024; --quick: 256)")
    parser.add_argument("--layers", type=int, help="transformer bucket blocks (default 2)")
    parser.add_argument("--small-tensors", type=int, help="tensors in the small bucket (default 1000; --quick: 100)")
    parser.add_argument(
        "--buckets", default="transformer,small",
        help="comma-separated: transformer, small, mixed (default transformer,small)",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cpu, plus cuda when one is visible"
    )
    parser.add_argument("--backends", help="comma-separated flatgrad backends (default: every available one)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads before measuring")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    parser.add_argument(
        "--wire-numel", type=int,
        help="shard elements of the reduction modes' W-source unpack rows (default 4194304; --quick: 262144; 0: skip)",
    )  # fmt: skip


def _split(text: str, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    for item in items:
        if item not in allowed:
            raise ValueError(f"{name}: unknown {item!r}; choose from {', '.join(allowed)}")
    if not items:
        raise ValueError(f"{name} is empty")
    return items


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build a ``BenchConfig`` from parsed options; ``--quick`` sets defaults that explicit options override."""
    values = dict(QUICK) if args.quick else {}
    for field in ("repeats", "warmup", "hidden", "layers", "small_tensors"):
        if getattr(args, field) is not None:
            values[field] = getattr(args, field)
    values["world_size"] = args.world_size
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.wire_numel is not None and args.wire_numel < 0:
        raise ValueError(f"--wire-numel must be >= 0, got {args.wire_numel}")
    minimums = {"world_size": 1, "repeats": 1, "warmup": 0, "hidden": 1, "layers": 1, "small_tensors": 1}
    for field, minimum in minimums.items():
        if field in values and values[field] < minimum:
            raise ValueError(f"--{field.replace('_', '-')} must be >= {minimum}, got {values[field]}")
    values["buckets"] = _split(args.buckets, "--buckets", ("transformer", "small", "mixed"))
    if args.device == "auto":
        values["devices"] = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    else:
        values["devices"] = (args.device,)
    if args.backends is not None:
        values["backends"] = _split(args.backends, "--backends", flatgrad.kernels.BACKENDS)
    return BenchConfig(**values)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark as the options say: print the table, write JSON and the chart."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"flatgrad bench: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            require_matplotlib()
        except RuntimeError as exc:  # fail before measuring, not after
            print(f"flatgrad bench: {exc}", file=sys.stderr)
            return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    doc = run_benchmark(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(doc))
    wire_numel = args.wire_numel if args.wire_numel is not None else (1 << 18 if args.quick else 1 << 22)
    if wire_numel > 0 and "cpu" in config.devices and flatgrad.kernels.available_backends()["cpu"].available:
        from . import wire_unpack

        print(f"wire unpacks ({wire_numel:,} elements per rank) ...", file=sys.stderr, flush=True)
        doc["wire_unpack"] = wire_unpack.measure(wire_numel, min(config.world_size, 8), repeat=config.repeats)
        print()
        print(wire_unpack.format_table(doc["wire_unpack"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        write_plot(doc, args.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``bench/pack_unpack.py``); the same options as ``flatgrad bench``."""
    parser = argparse.ArgumentParser(prog="pack_unpack", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
