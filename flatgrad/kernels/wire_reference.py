"""The pure-PyTorch reference of the wire kernels (reduction modes ``exact``, ``int8``, ``fp8``): the oracle.

The wire kernels serve the reduction modes that replace the reduce_scatter by
one ``all_to_all`` (see docs/design.md, "Reduction modes"): the packed buffer holds
``W`` chunks of ``S`` elements, chunk ``r`` for rank ``r``; after the
all_to_all, source ``w`` of the receive buffer is what rank ``w`` sent to this
rank. Five operations:

* ``sum_sources``: ``exact`` mode's unpack; the sources are comm-dtype chunks.
* ``quantize``: writes the wire format from a packed buffer (optionally adding
  and updating an error-feedback residual).
* ``pack_quantize``: the int8/fp8 modes' pack side, ``pack`` and ``quantize``
  fused: the wire is written from the per-parameter gradients directly (see
  [Note: pack-quantize]).
* ``dequantize_sum``: the int8/fp8 modes' unpack.
* ``requantize``: ``dequantize_sum`` and ``quantize`` fused, between the two
  stages of ``qgz_int8`` / ``qgz_fp8``: received wire segments in, a wire of
  their fp32 sum out (see [Note: requantize]).

A quantized wire is bytes (gloo refuses float8 tensors): per destination the
values, then the fp32 block scales from a 16-byte boundary. See
[Note: wire format] in docs/design.md.

``pack_quantize`` and ``requantize`` write exactly what their unfused
compositions write, without the intermediate buffer. See [Note: pack-quantize]
and [Note: requantize] in docs/design.md.

All arithmetic is fp32 in a fixed order, with no FMA, so that every backend
matches this one bitwise. See [Note: wire arithmetic contract] in docs/design.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import Layout
from . import reference

QMAX = {"int8": 127.0, "fp8": 448.0}
KINDS = tuple(QMAX)


def round16(n: int) -> int:
    return (n + 15) // 16 * 16


def nblocks(shard_numel: int, block: int) -> int:
    return (shard_numel + block - 1) // block


def segment_bytes(shard_numel: int, block: int) -> int:
    """Bytes of one rank's segment of a quantized wire buffer. See [Note: wire format]."""
    return round16(shard_numel) + round16(4 * nblocks(shard_numel, block))


def value_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8" else torch.float8_e4m3fn


def wire_views(wire: torch.Tensor, world_size: int, shard_numel: int, block: int, kind: str):
    """``(values[W, S], scales[W, nblocks])`` views of a quantized wire buffer (``uint8``)."""
    seg = segment_bytes(shard_numel, block)
    rows = wire[: world_size * seg].view(world_size, seg)
    values = rows[:, :shard_numel].view(value_dtype(kind))
    start = round16(shard_numel)
    scales = rows[:, start : start + 4 * nblocks(shard_numel, block)].view(torch.float32)
    return values, scales


def quantize_codes(y: torch.Tensor, kind: str) -> torch.Tensor:
    """The wire values of ``y = x / scale`` (fp32), as ``value_dtype(kind)``. See [Note: wire arithmetic contract].

    int8: ``clamp(round_half_even(y), -127, 127)``; fp8: ``float8_e4m3fn(clamp(y, -448, 448))``.
    NaN (every ``y`` of a block whose scale is inf or NaN may be one) is int8 ``0`` and fp8 ``0x7F``
    (e4m3fn's NaN, positive): one code on every backend, whatever the NaN's sign or the cast's habits.
    """
    nan = torch.isnan(y)
    if kind == "int8":
        q = torch.round(y).clamp(-127.0, 127.0)
        return torch.where(nan, torch.zeros_like(q), q).to(torch.int8)
    bits = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(nan, torch.full_like(bits, 0x7F), bits).view(torch.float8_e4m3fn)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[W, S]`` -> ``[W, nblocks, block]``, zero-padded."""
    w, s = x.shape
    padded = x.new_zeros(w, nblocks(s, block) * block)
    padded[:, :s] = x
    return padded.view(w, -1, block)


@torch.no_grad()
def quantize(
    packed: torch.Tensor,
    world_size: int,
    block: int,
    kind: str,
    wire: torch.Tensor,
    residual: torch.Tensor | None,
) -> None:
    """Write the wire format of ``packed`` (``W * S`` elements) into ``wire``; update ``residual`` if given."""
    s = packed.numel() // world_size
    x = packed.view(world_size, s).to(torch.float32)
    if residual is not None:
        x = x + residual.view(world_size, s)
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1)
    # A tensor divisor on amax's device: ATen divides a CUDA tensor by a Python scalar as a multiply by
    # its reciprocal, which is not the correctly rounded division the kernels do.
    scale = amax / torch.full_like(amax, QMAX[kind])
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = torch.where(scale[..., None] == 0, torch.zeros_like(xb), xb / safe[..., None])
    q = quantize_codes(y, kind)
    values, scales = wire_views(wire, world_size, s, block, kind)
    values.copy_(q.view(world_size, -1)[:, :s])
    scales.copy_(scale)
    if residual is not None:
        deq = (q.to(torch.float32) * scale[..., None]).view(world_size, -1)[:, :s]
        residual.view(world_size, s).copy_(x - deq)


@torch.no_grad()
def pack_quantize(
    tensors: Sequence[torch.Tensor | None],
    layout: Layout,
    scale: float,
    block: int,
    kind: str,
    wire: torch.Tensor,
    residual: torch.Tensor | None,
) -> None:
    """Quantize the fp32 pack of ``tensors`` (``None``: zeros) into ``wire``. See [Note: pack-quantize]."""
    if layout.numel == 0:
        return
    device = wire.device
    packed = torch.empty(layout.numel, dtype=torch.float32, device=device)
    reference.pack(tensors, layout, packed, scale)
    quantize(packed, layout.world_size, block, kind, wire, residual)


def _finish(acc: torch.Tensor, out: torch.Tensor, scale: float, accumulate: bool, stats: bool) -> torch.Tensor | None:
    if scale != 1.0:
        acc = acc * scale
    if accumulate:
        out.copy_((out.to(torch.float32) + acc).to(out.dtype))
    else:
        out.copy_(acc.to(out.dtype))
    if not stats:
        return None
    written = out.to(torch.float32)
    return torch.stack([written.square().sum(), (~torch.isfinite(written)).sum().to(torch.float32)])


@torch.no_grad()
def sum_sources(
    recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float, accumulate: bool, stats: bool = False
) -> torch.Tensor | None:
    """``out (=|+=) scale * sum_w float32(recv[w])`` in rank order; ``recv`` holds ``W`` chunks of ``out.numel()``.

    With ``stats`` returns fp32 ``[sum_sq, nonfinite_count]`` of ``out`` as written.
    """
    sources = recv.view(world_size, -1)
    acc = sources[0].to(torch.float32)
    for w in range(1, world_size):
        acc = acc + sources[w].to(torch.float32)
    return _finish(acc, out, scale, accumulate, stats)


@torch.no_grad()
def dequantize_sum(
    wire: torch.Tensor,
    world_size: int,
    block: int,
    kind: str,
    out: torch.Tensor,
    scale: float,
    accumulate: bool,
    stats: bool = False,
) -> torch.Tensor | None:
    """``out (=|+=) scale * sum_w dequantize(wire segment w)`` in rank order (``S = out.numel()``).

    With ``stats`` returns fp32 ``[sum_sq, nonfinite_count]`` of ``out`` as written.
    """
    s = out.numel()
    values, scales = wire_views(wire, world_size, s, block, kind)
    expanded = scales.repeat_interleave(block, dim=1)[:, :s]
    acc = values[0].to(torch.float32) * expanded[0]
    for w in range(1, world_size):
        acc = acc + values[w].to(torch.float32) * expanded[w]
    return _finish(acc, out, scale, accumulate, stats)


@torch.no_grad()
def requantize(
    wire_in: torch.Tensor,
    sources: int,
    block: int,
    kind: str,
    wire_out: torch.Tensor,
    segments: int,
    shard_numel: int,
    residual: torch.Tensor | None,
) -> None:
    """Quantize the fp32 sum of ``wire_in``'s segments into ``segments`` segments of ``wire_out``.

    The composition ``dequantize_sum`` + ``quantize`` that the fused kernels must match; see [Note: requantize].
    """
    partial = torch.empty(segments * shard_numel, dtype=torch.float32, device=wire_in.device)
    dequantize_sum(wire_in, sources, block, kind, partial, 1.0, False)
    quantize(partial, segments, block, kind, wire_out, residual)
