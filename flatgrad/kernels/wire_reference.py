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

[Note: wire format]
A quantized wire buffer is ``uint8``, ``W`` segments of ``segment_bytes(S, block)``
bytes, one per destination rank (gloo refuses float8 tensors, so bytes travel as
bytes). Segment layout, offsets in bytes:

* ``[0, S)``: the ``S`` quantized values (int8, or float8 e4m3fn bits);
* ``[round16(S), round16(S) + 4 * nblocks)``: ``nblocks = ceil(S / block)`` fp32
  scales, native byte order, block ``j`` covering elements ``[j * block, (j + 1) * block)``
  of the segment (the last block may be short);
* the rest (at most 15 + 15 bytes) is padding and never read.

``segment_bytes(S, block) = round16(S) + round16(4 * nblocks)``. Against a bf16 wire
(``2 * S`` bytes) that is ``0.5 + 2 / block`` of it for large ``S`` (0.508 at block 256).

[Note: pack-quantize]
``pack_quantize(tensors, layout, scale, block, kind, wire, residual)`` writes
exactly what ``pack(tensors, layout, dtype=float32, scale=scale)`` followed by
``quantize(packed, layout.world_size, block, kind, wire, residual)`` writes,
without the packed buffer: per element ``x = float32(grad)``, times
``float32(scale)`` in one fp32 multiply when ``scale != 1`` (the regular pack's
rule, [Note: arithmetic contract] in ``reference.py``); padding and a missing
tensor (``None``) are ``x = 0``; then the block quantize below (with the
residual added to every element, padding included). It reads the gradients
through the layout's pack run table, as the regular pack does.

A pack into a comm-dtype (e.g. bf16) buffer followed by a quantize of that
buffer would round every value twice, to the comm dtype and then to the wire.
The fused path quantizes the fp32 values, one rounding fewer (more accurate,
intended), and so on purpose not bitwise what a bf16 pack + quantize gives;
nor does it need the comm-dtype buffer.

[Note: requantize]
``requantize(wire_in, sources, block, kind, wire_out, segments, shard_numel, residual)``
reads ``L = sources`` wire segments of ``N * S`` elements each (``N = segments``,
``S = shard_numel``) and writes ``N`` wire segments of ``S`` elements: exactly what
``dequantize_sum(wire_in, L, block, kind, partial, 1.0, False)`` into an fp32
``partial`` of ``N * S`` elements followed by ``quantize(partial, N, block, kind,
wire_out, residual)`` writes, with no partial buffer. Per element ``e`` of the
partial: ``x = v_0 + v_1 + ... + v_{L-1}`` in source order, ``v_l = float32(q_l[e]) *
scale_l[e // block]`` (each element's scale is its own input block's); then ``x +
residual[e]`` with error feedback, and the quantize of the output block holding it
(segment ``e // S``, block ``(e % S) // block``), the residual becoming ``x -
float32(q) * scale``. Input and output blocks are aligned only when ``block``
divides ``S`` (or ``N = 1``): in general an output block straddles two input
blocks. The residual (``N * S`` fp32) is in the partial's order, as ``quantize``'s.

[Note: wire arithmetic contract]
All arithmetic is fp32, round-to-nearest-even, no fused multiply-add.

* Quantize, per block of a segment: ``x = float32(packed)`` (``+ residual``, one fp32
  add, with error feedback); ``absmax = max |x|``; ``scale = absmax / Q`` (one fp32
  division; ``Q = 127`` for int8, ``448`` for fp8 e4m3fn). If ``scale == 0`` the
  block is all zeros. Otherwise ``y = x / scale`` (fp32 division, not a reciprocal
  multiply), then int8: ``clamp(round_half_even(y), -127, 127)``; fp8:
  ``float8_e4m3fn(clamp(y, -448, 448))`` (saturating, torch's RNE cast); see
  ``quantize_codes``. With error feedback the residual becomes ``x - float32(q) * scale``.
* Non-finite input: a block holding NaN has a NaN scale, one holding inf (and no
  NaN) an inf scale; then every ``y`` is ``±0`` or NaN, and a NaN ``y`` is the code
  int8 ``0`` / fp8 ``0x7F`` on every backend (``fmaxf``, ``std::max`` and
  ``tl.maximum`` would clamp it to the lowest code instead). Such a block
  dequantizes to NaN in every element (``0 * inf``, ``q * NaN``).
  The sign and payload of a NaN in fp32 (a scale, a residual, an output)
  are not part of the contract; the codes are.
* Dequantize: ``v_w = float32(q_w) * scale_w`` (one fp32 multiply).
* Sum (both unpacks): ``acc = v_0``, then ``acc = acc + v_w`` for ``w = 1 .. W-1``,
  in that order (``v_w = float32(source_w)`` for ``exact``). Then ``acc = acc * post``
  if ``post != 1``; ``out = cast(acc)``, or with ``accumulate``
  ``out = cast(float32(out) + acc)``.
* Stats (both unpacks, optional): fp32 ``[sum_sq, nonfinite_count]`` of the values
  as written to ``out`` (after the cast, and after the accumulate), as the regular
  unpack's (see [Note: arithmetic contract] in ``reference.py``). The order of the
  sum of squares is backend-specific but fixed for a given shape (no atomics, no
  dependence on the thread count), so it matches this reference to fp32 rounding,
  not bitwise; the count is exact.
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
